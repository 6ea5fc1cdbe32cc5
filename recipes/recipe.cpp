#include "recipes/recipe.h"

#include <capnp/message.h>

#include <set>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "core/error.h"
#include "core/util.h"
#include "schemas/json.h"

namespace megacpp::recipe {

namespace {

[[noreturn]] void bad(const std::filesystem::path& origin, std::string_view key,
                      std::string_view rule) {
  throw Error(ErrorKind::kInvalidArgument,
              fmt::format("recipe {}: {}: {}", origin.string(), key, rule));
}

void check_keys(const toml::table& t, const std::set<std::string>& allowed,
                const std::filesystem::path& origin, std::string_view section) {
  for (const auto& [k, v] : t) {
    if (!allowed.count(std::string(k.str()))) {
      bad(origin, section.empty() ? std::string(k.str()) : fmt::format("{}.{}", section, k.str()),
          "unknown key");
    }
  }
}

template <typename T>
void get_uint(const toml::table* t, std::string_view section, const char* key, T& out,
              const std::filesystem::path& origin) {
  if (t == nullptr) return;
  const auto* node = t->get(key);
  if (node == nullptr) return;
  auto v = node->value<int64_t>();
  if (!node->is_integer() || !v || *v < 0 || *v > int64_t{UINT32_MAX}) {
    bad(origin, fmt::format("{}.{}", section, key), "must be a non-negative integer");
  }
  out = static_cast<T>(*v);
}

void get_double(const toml::table* t, std::string_view section, const char* key, double& out,
                const std::filesystem::path& origin) {
  if (t == nullptr) return;
  const auto* node = t->get(key);
  if (node == nullptr) return;
  auto v = node->value<double>();
  if (!(node->is_floating_point() || node->is_integer()) || !v) {
    bad(origin, fmt::format("{}.{}", section, key), "must be a number");
  }
  out = *v;
}

void get_string(const toml::table* t, std::string_view section, const char* key, std::string& out,
                const std::filesystem::path& origin) {
  if (t == nullptr) return;
  const auto* node = t->get(key);
  if (node == nullptr) return;
  auto v = node->value<std::string>();
  if (!v)
    bad(origin, section.empty() ? std::string(key) : fmt::format("{}.{}", section, key),
        "must be a string");
  out = *v;
}

const toml::table* section(const toml::table& root, const char* name,
                           const std::filesystem::path& origin) {
  const auto* node = root.get(name);
  if (node == nullptr) return nullptr;
  if (!node->is_table()) bad(origin, name, "must be a table");
  return node->as_table();
}

std::string canonical(const Recipe& r) {
  capnp::MallocMessageBuilder msg;
  auto spec = msg.initRoot<schema::RecipeSpec>();
  Recipe copy = r;
  copy.path.clear();
  copy.hash.clear();
  to_spec(copy, spec);
  return schemas::to_json(spec.asReader());
}

}  // namespace

void Recipe::validate() const {
  auto rule = [&](bool ok, std::string_view key, std::string_view text) {
    if (!ok) bad(path, key, text);
  };
  rule(!name.empty(), "name", "is required");
  rule(!pattern.empty(), "pattern", "must name at least one block family");
  for (char c : pattern) {
    rule(std::string_view("AEMR").find(c) != std::string_view::npos, "pattern",
         "symbols are A (attention), E (experts), M (state space), R (recurrent)");
    rule(c == 'A', "pattern",
         "this build implements block family A only (E, M, R are declared, not built)");
  }
  rule(model.vocab_size >= 2 && model.vocab_size <= 65536, "model.vocab_size",
       "must be in [2, 65536] (token shards store uint16)");
  rule(model.seq_len >= 2, "model.seq_len", "must be >= 2");
  rule(model.n_layers >= 1, "model.n_layers", "must be >= 1");
  rule(model.n_heads >= 1 && model.d_model % model.n_heads == 0, "model.n_heads",
       "must divide model.d_model");
  rule(model.n_heads >= 1 && (model.d_model / model.n_heads) % 2 == 0, "model.d_model",
       "head dimension d_model/n_heads must be even (RoPE rotates pairs)");
  rule(model.mlp_mult >= 1, "model.mlp_mult", "must be >= 1");
  rule(train.batch_size >= 1, "train.batch_size",
       "must be >= 1 (a rank with zero-length work is refused)");
  rule(train.lr > 0, "train.lr", "must be > 0");
  rule(train.min_lr_ratio >= 0 && train.min_lr_ratio <= 1, "train.min_lr_ratio",
       "must be in [0, 1]");
  rule(train.beta1 >= 0 && train.beta1 < 1, "train.beta1", "must be in [0, 1)");
  rule(train.beta2 >= 0 && train.beta2 < 1, "train.beta2", "must be in [0, 1)");
  rule(train.weight_decay >= 0, "train.weight_decay", "must be >= 0");
  rule(train.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)");
  rule(train.checkpoint_every >= 1, "train.checkpoint_every", "must be >= 1");
  rule(data.corpus == "builtin", "data.corpus", "only the built-in corpus exists in this build");
  rule(model.vocab_size >= 128, "model.vocab_size",
       "the built-in corpus is 7-bit text: needs vocab_size >= 128");
  rule(data.shards >= 1, "data.shards", "must be >= 1");
  rule(data.shard_tokens > model.seq_len + 1, "data.shard_tokens", "must exceed model.seq_len + 1");
}

std::filesystem::path resolve(const std::string& name_or_path,
                              const std::filesystem::path& recipe_dir) {
  std::filesystem::path p(name_or_path);
  if (p.has_extension() || name_or_path.find('/') != std::string::npos) {
    if (!std::filesystem::is_regular_file(p)) {
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("recipe {}: no such file", name_or_path));
    }
    return std::filesystem::absolute(p);
  }
  auto named = recipe_dir / (name_or_path + ".toml");
  if (!std::filesystem::is_regular_file(named)) {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("recipe '{}': no such recipe in {} (pass a path to a .toml file)",
                            name_or_path, recipe_dir.string()));
  }
  return std::filesystem::absolute(named);
}

Recipe parse(const std::string& text, const std::filesystem::path& origin) {
  toml::table root;
  try {
    root = toml::parse(text, origin.string());
  } catch (const toml::parse_error& e) {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("recipe {}:{}:{}: {}", origin.string(), e.source().begin.line,
                            e.source().begin.column, e.description()));
  }
  Recipe r;
  r.path = origin;
  check_keys(root, {"name", "pattern", "model", "train", "data"}, origin, "");
  get_string(&root, "", "name", r.name, origin);
  get_string(&root, "", "pattern", r.pattern, origin);
  const auto* m = section(root, "model", origin);
  const auto* t = section(root, "train", origin);
  const auto* d = section(root, "data", origin);
  if (m)
    check_keys(*m, {"vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_mult"}, origin,
               "model");
  if (t) {
    check_keys(*t,
               {"batch_size", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1",
                "beta2", "grad_clip", "seed", "checkpoint_every"},
               origin, "train");
  }
  if (d) check_keys(*d, {"corpus", "shard_tokens", "shards"}, origin, "data");
  get_uint(m, "model", "vocab_size", r.model.vocab_size, origin);
  get_uint(m, "model", "seq_len", r.model.seq_len, origin);
  get_uint(m, "model", "d_model", r.model.d_model, origin);
  get_uint(m, "model", "n_layers", r.model.n_layers, origin);
  get_uint(m, "model", "n_heads", r.model.n_heads, origin);
  get_uint(m, "model", "mlp_mult", r.model.mlp_mult, origin);
  get_uint(t, "train", "batch_size", r.train.batch_size, origin);
  get_double(t, "train", "lr", r.train.lr, origin);
  get_double(t, "train", "min_lr_ratio", r.train.min_lr_ratio, origin);
  get_uint(t, "train", "warmup_steps", r.train.warmup_steps, origin);
  get_double(t, "train", "weight_decay", r.train.weight_decay, origin);
  get_double(t, "train", "beta1", r.train.beta1, origin);
  get_double(t, "train", "beta2", r.train.beta2, origin);
  get_double(t, "train", "grad_clip", r.train.grad_clip, origin);
  get_uint(t, "train", "seed", r.train.seed, origin);
  get_uint(t, "train", "checkpoint_every", r.train.checkpoint_every, origin);
  get_string(d, "data", "corpus", r.data.corpus, origin);
  get_uint(d, "data", "shard_tokens", r.data.shard_tokens, origin);
  get_uint(d, "data", "shards", r.data.shards, origin);
  r.validate();
  for (uint32_t i = 0; i < r.model.n_layers; ++i)
    r.layers.emplace_back(1, r.pattern[i % r.pattern.size()]);
  r.hash = xxh3_hex(canonical(r));
  return r;
}

Recipe load(const std::filesystem::path& path) {
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error& e) {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("recipe {}: cannot read: {}", path.string(), e.what()));
  }
  return parse(text, path);
}

void to_spec(const Recipe& r, schema::RecipeSpec::Builder s) {
  s.setName(r.name);
  s.setPath(r.path.string());
  s.setHash(r.hash);
  s.setPattern(r.pattern);
  auto layers = s.initLayers(static_cast<unsigned>(r.layers.size()));
  for (size_t i = 0; i < r.layers.size(); ++i) layers.set(static_cast<unsigned>(i), r.layers[i]);
  auto m = s.initModel();
  m.setVocabSize(r.model.vocab_size);
  m.setSeqLen(r.model.seq_len);
  m.setDModel(r.model.d_model);
  m.setNLayers(r.model.n_layers);
  m.setNHeads(r.model.n_heads);
  m.setMlpMult(r.model.mlp_mult);
  auto t = s.initTrain();
  t.setBatchSize(r.train.batch_size);
  t.setLr(r.train.lr);
  t.setMinLrRatio(r.train.min_lr_ratio);
  t.setWarmupSteps(r.train.warmup_steps);
  t.setWeightDecay(r.train.weight_decay);
  t.setBeta1(r.train.beta1);
  t.setBeta2(r.train.beta2);
  t.setGradClip(r.train.grad_clip);
  t.setSeed(r.train.seed);
  t.setCheckpointEvery(r.train.checkpoint_every);
  auto d = s.initData();
  d.setCorpus(r.data.corpus);
  d.setShardTokens(r.data.shard_tokens);
  d.setShards(r.data.shards);
}

std::string describe(const Recipe& r) {
  std::string layers;
  for (size_t i = 0; i < r.layers.size(); ++i)
    layers += fmt::format("{}{}:{}", i ? " " : "", i, r.layers[i]);
  return fmt::format(
      "recipe {} ({})\n  hash      {}\n  pattern   {} -> {} layers [{}]\n"
      "  model     vocab {} seq {} d_model {} heads {} mlp x{}\n"
      "  train     batch {}/rank lr {} (warmup {}, min ratio {}) betas ({}, {}) wd {} clip {} seed "
      "{}\n"
      "  checkpoint every {} steps\n  data      {} corpus, {} shards x {} tokens\n",
      r.name, r.path.string(), r.hash, r.pattern, r.layers.size(), layers, r.model.vocab_size,
      r.model.seq_len, r.model.d_model, r.model.n_heads, r.model.mlp_mult, r.train.batch_size,
      r.train.lr, r.train.warmup_steps, r.train.min_lr_ratio, r.train.beta1, r.train.beta2,
      r.train.weight_decay, r.train.grad_clip, r.train.seed, r.train.checkpoint_every,
      r.data.corpus, r.data.shards, r.data.shard_tokens);
}

}  // namespace megacpp::recipe
