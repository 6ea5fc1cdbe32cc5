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
  MEGACPP_FAIL(ErrorKind::kInvalidArgument, "recipe {}: {}: {}", origin.string(), key, rule);
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

void get_bool(const toml::table* t, std::string_view section, const char* key, bool& out,
              const std::filesystem::path& origin) {
  if (t == nullptr) return;
  const auto* node = t->get(key);
  if (node == nullptr) return;
  auto v = node->value<bool>();
  if (!node->is_boolean() || !v)
    bad(origin, fmt::format("{}.{}", section, key), "must be a boolean");
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
  }
  rule(model.mode == kModeAuthorDp || model.mode == kModeNemoNative, "mode",
       "must be \"author_dp\" (tensor parallel 1) or \"nemo_native\" (tensor parallel 2 with "
       "sequence parallelism)");
  rule(model.vocab_size >= 2 && model.vocab_size <= kMaxVocab, "model.vocab_size",
       fmt::format("must be in [2, {}]", kMaxVocab));
  rule(model.seq_len >= 2, "model.seq_len", "must be >= 2");
  rule(model.n_layers >= 1 && model.n_layers <= kMaxLayers, "model.n_layers",
       fmt::format("must be in [1, {}]", kMaxLayers));
  rule(model.d_model >= 2, "model.d_model", "must be >= 2");
  rule(model.n_heads >= 1 && model.d_model % model.n_heads == 0, "model.n_heads",
       "must divide model.d_model");
  rule(model.n_heads >= 1 && (model.d_model / model.n_heads) % 2 == 0, "model.d_model",
       "head dimension d_model/n_heads must be even (RoPE rotates pairs)");
  rule(model.mlp_mult >= 1, "model.mlp_mult", "must be >= 1");
  rule(model.n_kv_heads == 0 ||
           (model.n_kv_heads <= model.n_heads && model.n_heads % model.n_kv_heads == 0),
       "model.n_kv_heads", "must divide model.n_heads (each key/value head serves a group)");
  rule(model.rope_theta > 0, "model.rope_theta", "must be > 0");
  const auto uses = [&](char family) { return pattern.find(family) != std::string::npos; };
  const MoeConfig& moe = model.moe;
  if (moe.enabled) {
    rule(uses('E'), "moe.enabled", "the pattern has no E layer to place the experts in");
    rule(moe.n_experts >= 1, "moe.n_experts", "must be >= 1 when MoE is enabled");
    rule(moe.top_k >= 1 && moe.top_k <= moe.n_experts, "moe.top_k",
         "must be in [1, moe.n_experts]");
    rule(moe.expert_hidden >= 1, "moe.expert_hidden", "must be >= 1 when MoE is enabled");
  }
  rule(moe.aux_loss_coef >= 0, "moe.aux_loss_coef", "must be >= 0");
  const SsmConfig& ssm = model.ssm;
  rule(ssm.d_state >= 1, "ssm.d_state", "must be >= 1");
  rule(ssm.expand >= 1, "ssm.expand", "must be >= 1");
  rule(ssm.head_dim >= 1 && (uint64_t{ssm.expand} * model.d_model) % ssm.head_dim == 0,
       "ssm.head_dim", "must divide ssm.expand x model.d_model (the mixer's heads)");
  rule(ssm.conv_kernel >= 1, "ssm.conv_kernel", "must be >= 1");
  rule(ssm.chunk >= 1, "ssm.chunk", "must be >= 1");
  rule(model.rnn.conv_kernel >= 1, "rnn.conv_kernel", "must be >= 1");
  rule(train.batch_size >= 1, "train.batch_size",
       "must be >= 1 (a rank with zero-length work is refused)");
  const BatchSpec batch = batch_spec(*this);
  rule(batch.fits_slot(), "train.batch_size, model.seq_len",
       fmt::format("a batch of batch_size x (seq_len + 1) tokens is {} bytes; a batch ring "
                   "slot holds at most {}",
                   batch.slot_bytes(), kMaxBatchSlotBytes));
  rule(train.min_lr_ratio >= 0 && train.min_lr_ratio <= 1, "train.min_lr_ratio",
       "must be in [0, 1]");
  const OptimConfig& o = train.optim;
  rule(o.embed_lr > 0, "optim.embed_lr", "must be > 0");
  rule(o.head_lr > 0, "optim.head_lr", "must be > 0");
  rule(o.adam_lr > 0, "optim.adam_lr", "must be > 0");
  rule(o.adam_beta1 >= 0 && o.adam_beta1 < 1, "optim.adam_beta1", "must be in [0, 1)");
  rule(o.adam_beta2 >= 0 && o.adam_beta2 < 1, "optim.adam_beta2", "must be in [0, 1)");
  rule(o.adam_eps > 0, "optim.adam_eps", "must be > 0");
  rule(o.adam_weight_decay >= 0, "optim.adam_weight_decay", "must be >= 0");
  rule(o.muon_lr > 0, "optim.muon_lr", "must be > 0");
  rule(o.muon_momentum >= 0 && o.muon_momentum < 1, "optim.muon_momentum", "must be in [0, 1)");
  rule(o.muon_beta2 >= 0 && o.muon_beta2 < 1, "optim.muon_beta2", "must be in [0, 1)");
  rule(o.muon_weight_decay >= 0, "optim.muon_weight_decay", "must be >= 0");
  rule(o.muon_orthogonalizer == "polar_express" || o.muon_orthogonalizer == "newton_schulz",
       "optim.muon_orthogonalizer", "must be \"polar_express\" or \"newton_schulz\"");
  rule(o.muon_ns_steps >= 1 &&
           o.muon_ns_steps <= (o.muon_orthogonalizer == "polar_express" ? 5 : 20),
       "optim.muon_ns_steps", "must be in [1, 5] for polar_express, [1, 20] for newton_schulz");
  rule(train.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)");
  rule(train.checkpoint_every >= 1, "train.checkpoint_every", "must be >= 1");
  const bool builtin = data.source == "builtin";
  rule(builtin || data.source == "llmc" || data.source == "megatron", "data.source",
       "must be \"builtin\", \"llmc\" (llm.c .bin shards) or \"megatron\" (Megatron .idx/.bin)");
  rule(data.split == "train" || data.split == "val", "data.split", "must be \"train\" or \"val\"");
  rule(data.eos_id >= -1 && data.eos_id < int64_t{model.vocab_size}, "data.eos_id",
       "must be below model.vocab_size (or absent)");
  if (builtin) {
    rule(model.vocab_size >= 128, "model.vocab_size",
         "the built-in corpus is 7-bit text: needs vocab_size >= 128");
    rule(data.path.empty(), "data.path", "names shards; the built-in corpus is generated");
    rule(data.pack, "data.pack", "the built-in corpus has no documents: pack must be true");
    rule(data.shards >= 1, "data.shards", "must be >= 1");
    rule(uint64_t{data.shard_tokens} > batch.row_tokens(), "data.shard_tokens",
         "must exceed model.seq_len + 1");
  }
}

std::filesystem::path resolve(const std::string& name_or_path,
                              const std::filesystem::path& recipe_dir) {
  std::filesystem::path p(name_or_path);
  if (p.has_extension() || name_or_path.find('/') != std::string::npos) {
    if (!std::filesystem::is_regular_file(p)) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "recipe {}: no such file", name_or_path);
    }
    return std::filesystem::absolute(p);
  }
  auto named = recipe_dir / (name_or_path + ".toml");
  if (!std::filesystem::is_regular_file(named)) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "recipe '{}': no such recipe in {} (pass a path to a .toml file)", name_or_path,
                 recipe_dir.string());
  }
  return std::filesystem::absolute(named);
}

Recipe parse(const std::string& text, const std::filesystem::path& origin) {
  toml::table root;
  try {
    root = toml::parse(text, origin.string());
  } catch (const toml::parse_error& e) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "recipe {}:{}:{}: {}", origin.string(),
                 e.source().begin.line, e.source().begin.column, e.description());
  }
  Recipe r;
  r.path = origin;
  check_keys(root,
             {"name", "pattern", "mode", "model", "moe", "ssm", "rnn", "train", "optim", "data"},
             origin, "");
  get_string(&root, "", "name", r.name, origin);
  get_string(&root, "", "pattern", r.pattern, origin);
  get_string(&root, "", "mode", r.model.mode, origin);
  const auto* m = section(root, "model", origin);
  const auto* moe = section(root, "moe", origin);
  const auto* ssm = section(root, "ssm", origin);
  const auto* rnn = section(root, "rnn", origin);
  if (moe) {
    check_keys(*moe,
               {"enabled", "n_experts", "top_k", "expert_hidden", "shared_hidden", "aux_loss_coef"},
               origin, "moe");
  }
  if (ssm)
    check_keys(*ssm, {"d_state", "head_dim", "expand", "conv_kernel", "chunk"}, origin, "ssm");
  if (rnn) check_keys(*rnn, {"width", "conv_kernel"}, origin, "rnn");
  get_bool(moe, "moe", "enabled", r.model.moe.enabled, origin);
  get_uint(moe, "moe", "n_experts", r.model.moe.n_experts, origin);
  get_uint(moe, "moe", "top_k", r.model.moe.top_k, origin);
  get_uint(moe, "moe", "expert_hidden", r.model.moe.expert_hidden, origin);
  get_uint(moe, "moe", "shared_hidden", r.model.moe.shared_hidden, origin);
  get_double(moe, "moe", "aux_loss_coef", r.model.moe.aux_loss_coef, origin);
  get_uint(ssm, "ssm", "d_state", r.model.ssm.d_state, origin);
  get_uint(ssm, "ssm", "head_dim", r.model.ssm.head_dim, origin);
  get_uint(ssm, "ssm", "expand", r.model.ssm.expand, origin);
  get_uint(ssm, "ssm", "conv_kernel", r.model.ssm.conv_kernel, origin);
  get_uint(ssm, "ssm", "chunk", r.model.ssm.chunk, origin);
  get_uint(rnn, "rnn", "width", r.model.rnn.width, origin);
  get_uint(rnn, "rnn", "conv_kernel", r.model.rnn.conv_kernel, origin);
  const auto* t = section(root, "train", origin);
  const auto* o = section(root, "optim", origin);
  const auto* d = section(root, "data", origin);
  if (m)
    check_keys(*m,
               {"vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_mult", "n_kv_heads",
                "rope_theta", "ffn_hidden"},
               origin, "model");
  if (t) {
    check_keys(
        *t, {"batch_size", "min_lr_ratio", "warmup_steps", "grad_clip", "seed", "checkpoint_every"},
        origin, "train");
  }
  if (o) {
    check_keys(
        *o,
        {"embed_lr", "head_lr", "adam_lr", "adam_beta1", "adam_beta2", "adam_eps",
         "adam_weight_decay", "adamw_crossover", "muon_lr", "muon_momentum", "muon_beta2",
         "muon_weight_decay", "muon_orthogonalizer", "muon_ns_steps", "muon_bf16", "qkv_split"},
        origin, "optim");
  }
  if (d)
    check_keys(*d, {"source", "path", "split", "pack", "eos_id", "shard_tokens", "shards"}, origin,
               "data");
  get_uint(m, "model", "vocab_size", r.model.vocab_size, origin);
  get_uint(m, "model", "seq_len", r.model.seq_len, origin);
  get_uint(m, "model", "d_model", r.model.d_model, origin);
  get_uint(m, "model", "n_layers", r.model.n_layers, origin);
  get_uint(m, "model", "n_heads", r.model.n_heads, origin);
  get_uint(m, "model", "mlp_mult", r.model.mlp_mult, origin);
  get_uint(m, "model", "n_kv_heads", r.model.n_kv_heads, origin);
  get_double(m, "model", "rope_theta", r.model.rope_theta, origin);
  get_uint(m, "model", "ffn_hidden", r.model.ffn_hidden, origin);
  get_uint(t, "train", "batch_size", r.train.batch_size, origin);
  get_double(t, "train", "min_lr_ratio", r.train.min_lr_ratio, origin);
  get_uint(t, "train", "warmup_steps", r.train.warmup_steps, origin);
  get_double(t, "train", "grad_clip", r.train.grad_clip, origin);
  get_uint(t, "train", "seed", r.train.seed, origin);
  get_uint(t, "train", "checkpoint_every", r.train.checkpoint_every, origin);
  OptimConfig& op = r.train.optim;
  get_double(o, "optim", "embed_lr", op.embed_lr, origin);
  get_double(o, "optim", "head_lr", op.head_lr, origin);
  get_double(o, "optim", "adam_lr", op.adam_lr, origin);
  get_double(o, "optim", "adam_beta1", op.adam_beta1, origin);
  get_double(o, "optim", "adam_beta2", op.adam_beta2, origin);
  get_double(o, "optim", "adam_eps", op.adam_eps, origin);
  get_double(o, "optim", "adam_weight_decay", op.adam_weight_decay, origin);
  get_uint(o, "optim", "adamw_crossover", op.adamw_crossover, origin);
  get_double(o, "optim", "muon_lr", op.muon_lr, origin);
  get_double(o, "optim", "muon_momentum", op.muon_momentum, origin);
  get_double(o, "optim", "muon_beta2", op.muon_beta2, origin);
  get_double(o, "optim", "muon_weight_decay", op.muon_weight_decay, origin);
  get_string(o, "optim", "muon_orthogonalizer", op.muon_orthogonalizer, origin);
  get_uint(o, "optim", "muon_ns_steps", op.muon_ns_steps, origin);
  // true | false | "auto" (the default): "auto" is settled per device at launch.
  op.muon_bf16_auto = true;
  if (o != nullptr && o->get("muon_bf16") != nullptr) {
    const auto* node = o->get("muon_bf16");
    if (node->is_boolean()) {
      op.muon_bf16 = *node->value<bool>();
      op.muon_bf16_auto = false;
    } else if (node->value<std::string>() != "auto") {
      bad(origin, "optim.muon_bf16", "must be true, false or \"auto\"");
    }
  }
  get_bool(o, "optim", "qkv_split", op.qkv_split, origin);
  get_string(d, "data", "source", r.data.source, origin);
  get_string(d, "data", "path", r.data.path, origin);
  get_string(d, "data", "split", r.data.split, origin);
  get_bool(d, "data", "pack", r.data.pack, origin);
  if (d != nullptr && d->get("eos_id") != nullptr) {
    uint32_t eos = 0;
    get_uint(d, "data", "eos_id", eos, origin);
    r.data.eos_id = eos;
  }
  get_uint(d, "data", "shard_tokens", r.data.shard_tokens, origin);
  get_uint(d, "data", "shards", r.data.shards, origin);
  return rehash(std::move(r));
}

// The layers and blocks are derived from the pattern, n_layers and mode here, so a recipe changed
// after parsing (an override of the mode or the depth) is expanded again before it is hashed.
std::string resolve_muon_precision(Recipe& r, std::string_view device,
                                   std::string_view cpu_bf16_units) {
  auto name = [](bool bf16) { return bf16 ? "bfloat16" : "float32"; };
  OptimConfig& o = r.train.optim;
  if (!o.muon_bf16_auto) return fmt::format("{} (the recipe)", name(o.muon_bf16));
  std::string why;
  if (device == "cuda") {
    o.muon_bf16 = true;
    why = "auto: cuda";
  } else if (!cpu_bf16_units.empty()) {
    o.muon_bf16 = true;
    why = fmt::format("auto: cpu with {}", cpu_bf16_units);
  } else {
    o.muon_bf16 = false;
    why = "auto: cpu without bfloat16 matrix units";
  }
  o.muon_bf16_auto = false;
  r = rehash(std::move(r));
  return fmt::format("{} ({})", name(o.muon_bf16), why);
}

Recipe rehash(Recipe r) {
  r.validate();
  r.layers.clear();
  for (uint32_t i = 0; i < r.model.n_layers; ++i)
    r.layers.emplace_back(1, r.pattern[i % r.pattern.size()]);
  r.model.blocks = expand_blocks(r.pattern, r.model.n_layers, r.model.mode, r.model.moe.enabled);
  r.hash = xxh3_hex(canonical(r));
  return r;
}

bool ModelConfig::plain_architecture() const {
  const ModelConfig defaults;
  return (n_kv_heads == 0 || n_kv_heads == n_heads) && rope_theta == defaults.rope_theta &&
         ffn_hidden == 0 && mode == defaults.mode && moe == defaults.moe && ssm == defaults.ssm &&
         rnn == defaults.rnn;
}

std::string expand_blocks(std::string_view pattern, uint32_t n_layers, std::string_view mode,
                          bool moe_enabled) {
  std::string out;
  if (pattern.empty()) return out;
  out.reserve(n_layers);
  for (uint32_t i = 0; i < n_layers; ++i) {
    switch (pattern[i % pattern.size()]) {
      case 'A':
        out.push_back(kBlockAttention);
        break;
      case 'E':
        out.push_back(moe_enabled ? kBlockMoe : kBlockMlp);
        break;
      case 'M':
        out.push_back(kBlockMamba);
        break;
      case 'R':
        out.push_back(mode == kModeNemoNative ? kBlockMamba : kBlockRecurrent);
        break;
      default:
        MEGACPP_FAIL(ErrorKind::kInvalidArgument, "pattern {}: unknown block family '{}'", pattern,
                     pattern[i % pattern.size()]);
    }
  }
  return out;
}

std::string_view block_name(char block) {
  switch (block) {
    case kBlockAttention:
      return "attention";
    case kBlockMoe:
      return "moe";
    case kBlockMlp:
      return "mlp";
    case kBlockMamba:
      return "mamba2";
    case kBlockRecurrent:
      return "recurrent";
    default:
      return "unknown";
  }
}

Recipe load(const std::filesystem::path& path) {
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error& e) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "recipe {}: cannot read: {}", path.string(),
                 e.what());
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
  if (!r.model.plain_architecture()) {
    const ModelConfig& c = r.model;
    auto a = m.initArch();
    a.setMode(c.mode);
    a.setNKvHeads(c.n_kv_heads);
    a.setRopeTheta(c.rope_theta);
    a.setFfnHidden(c.ffn_hidden);
    a.setMoeEnabled(c.moe.enabled);
    a.setMoeExperts(c.moe.n_experts);
    a.setMoeTopK(c.moe.top_k);
    a.setMoeExpertHidden(c.moe.expert_hidden);
    a.setMoeSharedHidden(c.moe.shared_hidden);
    a.setMoeAuxLossCoef(c.moe.aux_loss_coef);
    a.setSsmDState(c.ssm.d_state);
    a.setSsmHeadDim(c.ssm.head_dim);
    a.setSsmExpand(c.ssm.expand);
    a.setSsmConvKernel(c.ssm.conv_kernel);
    a.setSsmChunk(c.ssm.chunk);
    a.setRnnWidth(c.rnn.width);
    a.setRnnConvKernel(c.rnn.conv_kernel);
  }
  auto t = s.initTrain();
  t.setBatchSize(r.train.batch_size);
  t.setMinLrRatio(r.train.min_lr_ratio);
  t.setWarmupSteps(r.train.warmup_steps);
  t.setGradClip(r.train.grad_clip);
  t.setSeed(r.train.seed);
  t.setCheckpointEvery(r.train.checkpoint_every);
  const OptimConfig& o = r.train.optim;
  auto os = t.initOptim();
  os.setEmbedLr(o.embed_lr);
  os.setHeadLr(o.head_lr);
  os.setAdamLr(o.adam_lr);
  os.setAdamBeta1(o.adam_beta1);
  os.setAdamBeta2(o.adam_beta2);
  os.setAdamEps(o.adam_eps);
  os.setAdamWeightDecay(o.adam_weight_decay);
  os.setAdamwCrossover(o.adamw_crossover);
  os.setMuonLr(o.muon_lr);
  os.setMuonMomentum(o.muon_momentum);
  os.setMuonBeta2(o.muon_beta2);
  os.setMuonWeightDecay(o.muon_weight_decay);
  os.setMuonOrthogonalizer(o.muon_orthogonalizer);
  os.setMuonNsSteps(o.muon_ns_steps);
  os.setMuonBf16(o.muon_bf16);
  os.setQkvSplit(o.qkv_split);
  auto d = s.initData();
  d.setSource(r.data.source);
  d.setPath(r.data.path);
  d.setSplit(r.data.split);
  d.setPack(r.data.pack);
  d.setEosId(r.data.eos_id);
  d.setShardTokens(r.data.shard_tokens);
  d.setShards(r.data.shards);
}

ModelConfig model_config(schema::RecipeSpec::Reader spec) {
  const auto m = spec.getModel();
  ModelConfig c{.vocab_size = m.getVocabSize(),
                .seq_len = m.getSeqLen(),
                .d_model = m.getDModel(),
                .n_layers = m.getNLayers(),
                .n_heads = m.getNHeads(),
                .mlp_mult = m.getMlpMult()};
  if (m.hasArch()) {
    const auto a = m.getArch();
    c.mode = a.getMode();
    c.n_kv_heads = a.getNKvHeads();
    c.rope_theta = a.getRopeTheta();
    c.ffn_hidden = a.getFfnHidden();
    c.moe = MoeConfig{.enabled = a.getMoeEnabled(),
                      .n_experts = a.getMoeExperts(),
                      .top_k = a.getMoeTopK(),
                      .expert_hidden = a.getMoeExpertHidden(),
                      .shared_hidden = a.getMoeSharedHidden(),
                      .aux_loss_coef = a.getMoeAuxLossCoef()};
    c.ssm = SsmConfig{.d_state = a.getSsmDState(),
                      .head_dim = a.getSsmHeadDim(),
                      .expand = a.getSsmExpand(),
                      .conv_kernel = a.getSsmConvKernel(),
                      .chunk = a.getSsmChunk()};
    c.rnn = RnnConfig{.width = a.getRnnWidth(), .conv_kernel = a.getRnnConvKernel()};
  }
  c.blocks = expand_blocks(std::string(spec.getPattern()), c.n_layers, c.mode, c.moe.enabled);
  return c;
}

TrainConfig train_config(schema::TrainSpec::Reader t) {
  TrainConfig c;
  c.batch_size = t.getBatchSize();
  c.min_lr_ratio = t.getMinLrRatio();
  c.warmup_steps = t.getWarmupSteps();
  c.grad_clip = t.getGradClip();
  c.seed = t.getSeed();
  c.checkpoint_every = t.getCheckpointEvery();
  const auto o = t.getOptim();
  c.optim = OptimConfig{.embed_lr = o.getEmbedLr(),
                        .head_lr = o.getHeadLr(),
                        .adam_lr = o.getAdamLr(),
                        .adam_beta1 = o.getAdamBeta1(),
                        .adam_beta2 = o.getAdamBeta2(),
                        .adam_eps = o.getAdamEps(),
                        .adam_weight_decay = o.getAdamWeightDecay(),
                        .adamw_crossover = o.getAdamwCrossover(),
                        .muon_lr = o.getMuonLr(),
                        .muon_momentum = o.getMuonMomentum(),
                        .muon_beta2 = o.getMuonBeta2(),
                        .muon_weight_decay = o.getMuonWeightDecay(),
                        .muon_orthogonalizer = o.getMuonOrthogonalizer(),
                        .muon_ns_steps = o.getMuonNsSteps(),
                        .muon_bf16 = o.getMuonBf16(),
                        .qkv_split = o.getQkvSplit()};
  return c;
}

Recipe from_spec(schema::RecipeSpec::Reader s) {
  Recipe r;
  r.name = s.getName();
  r.path = std::string(s.getPath());
  r.pattern = s.getPattern();
  for (auto l : s.getLayers()) r.layers.emplace_back(l.cStr());
  r.model = model_config(s);
  r.train = train_config(s.getTrain());
  const auto d = s.getData();
  r.data.source = d.getSource();
  r.data.path = d.getPath();
  r.data.split = d.getSplit();
  r.data.pack = d.getPack();
  r.data.eos_id = d.getEosId();
  r.data.shard_tokens = d.getShardTokens();
  r.data.shards = d.getShards();
  const std::string recorded = s.getHash();
  r = rehash(std::move(r));
  MEGACPP_CHECK(r.hash == recorded, ErrorKind::kCorruption,
                fmt::format("recipe {} as recorded hashes to {}, not its recorded {}", r.name,
                            r.hash, recorded));
  return r;
}

BatchGeometry resolve_batch(const ModelConfig& model, const TrainConfig& train, uint32_t world,
                            uint32_t rank_batch) {
  BatchGeometry g{
      .slot = batch_spec(model, train), .world = world, .tensor_parallel = model.tensor_parallel()};
  if (rank_batch != 0) g.slot.batch = rank_batch;
  return g;
}

BatchGeometry resolve_batch(const Recipe& r, uint32_t world, uint32_t rank_batch) {
  return resolve_batch(r.model, r.train, world, rank_batch);
}

void to_spec(const BatchGeometry& g, schema::BatchGeometry::Builder s) {
  s.setRankBatch(g.slot.batch);
  s.setSeqLen(g.slot.seq_len);
  s.setTokenBytes(g.slot.token_bytes);
  // The recipe rules keep a slot within kMaxBatchSlotBytes, which fits 32 bits.
  s.setSlotBytes(static_cast<uint32_t>(g.slot.slot_bytes()));
  s.setTensorParallel(g.tensor_parallel);
  s.setDataRanks(g.data_ranks());
  s.setWindowsPerStep(g.windows_per_step());
}

BatchGeometry batch_geometry(schema::LaunchContract::Reader l) {
  const bool recorded = l.hasBatch();
  const auto b = l.getBatch();
  const BatchGeometry g =
      recorded ? BatchGeometry{.slot = {.batch = b.getRankBatch(),
                                        .seq_len = b.getSeqLen(),
                                        .token_bytes = b.getTokenBytes()},
                               .world = l.getWorld(),
                               .tensor_parallel = b.getTensorParallel()}
               : resolve_batch(model_config(l.getRecipe()), train_config(l.getRecipe().getTrain()),
                               l.getWorld(), l.getResume().getRankBatch());
  MEGACPP_CHECK(g.tensor_parallel >= 1 && g.world % g.tensor_parallel == 0,
                ErrorKind::kInvalidArgument,
                fmt::format("a world of {} does not divide into tensor-parallel groups of {}",
                            g.world, g.tensor_parallel));
  MEGACPP_CHECK(
      !recorded || (g.slot.batch >= 1 && g.slot.seq_len >= 1 &&
                    (g.slot.token_bytes == 2 || g.slot.token_bytes == 4) && g.slot.fits_slot() &&
                    b.getSlotBytes() == g.slot.slot_bytes() && b.getDataRanks() == g.data_ranks() &&
                    b.getWindowsPerStep() == g.windows_per_step()),
      ErrorKind::kInvalidArgument,
      fmt::format("launch contract: the batch geometry ({} rows of {} + 1 tokens of {} "
                  "bytes per rank, {}-byte slots, {} data ranks, {} windows a step) "
                  "does not hold together: relaunch the run",
                  g.slot.batch, g.slot.seq_len, g.slot.token_bytes, b.getSlotBytes(),
                  b.getDataRanks(), b.getWindowsPerStep()));
  return g;
}

namespace {

// The recipe's common part: name, hash, pattern, dims, training, optimizers, data.
std::string describe_base(const Recipe& r, const std::string& layers) {
  return fmt::format(
      "recipe {} ({})\n  hash      {}\n  pattern   {} -> {} layers [{}]\n"
      "  model     vocab {} seq {} d_model {} heads {} mlp x{}\n"
      "  train     batch {}/rank, lr schedule: warmup {}, cosine to x{}; clip {} seed {}\n"
      "  optim     DistMuon (hidden matrices): lr {} momentum {} beta2 {} wd {} {} x{}{}{}\n"
      "            DistAdamW: embed lr {}, head lr {}, other lr {}, betas ({}, {}) eps {} wd {}, "
      "sharded from {} elements\n"
      "  checkpoint every {} steps\n  data      {}\n",
      r.name, r.path.string(), r.hash, r.pattern, r.layers.size(), layers, r.model.vocab_size,
      r.model.seq_len, r.model.d_model, r.model.n_heads, r.model.mlp_mult, r.train.batch_size,
      r.train.warmup_steps, r.train.min_lr_ratio, r.train.grad_clip, r.train.seed,
      r.train.optim.muon_lr, r.train.optim.muon_momentum, r.train.optim.muon_beta2,
      r.train.optim.muon_weight_decay, r.train.optim.muon_orthogonalizer,
      r.train.optim.muon_ns_steps,
      r.train.optim.muon_bf16_auto ? " bf16=auto"
      : r.train.optim.muon_bf16    ? " bf16"
                                   : "",
      r.train.optim.qkv_split ? ", qkv split" : "", r.train.optim.embed_lr, r.train.optim.head_lr,
      r.train.optim.adam_lr, r.train.optim.adam_beta1, r.train.optim.adam_beta2,
      r.train.optim.adam_eps, r.train.optim.adam_weight_decay, r.train.optim.adamw_crossover,
      r.train.checkpoint_every,
      r.data.source == "builtin"
          ? fmt::format("built-in corpus, {} shards x {} tokens", r.data.shards,
                        r.data.shard_tokens)
          : fmt::format("{} shards at {} (split {}, {}{})", r.data.source,
                        r.data.path.empty() ? "--data-dir" : r.data.path, r.data.split,
                        r.data.pack ? "packed" : "inside documents",
                        r.data.eos_id >= 0 ? fmt::format(", eos {}", r.data.eos_id) : ""));
}

}  // namespace

std::string describe(const Recipe& r) {
  std::string layers;
  for (size_t i = 0; i < r.layers.size(); ++i)
    layers += fmt::format("{}{}:{}", i ? " " : "", i, r.layers[i]);
  std::string arch;
  if (!r.model.plain_architecture()) {
    const ModelConfig& m = r.model;
    arch = fmt::format(
        "  arch      mode {} (tensor parallel {}), kv heads {}, rope theta {}, ffn {}\n", m.mode,
        m.tensor_parallel(), m.kv_heads(), m.rope_theta, m.ffn());
    arch += fmt::format("  blocks    {}\n", m.blocks);
    if (m.moe.enabled) {
      arch += fmt::format(
          "  moe       {} routed experts (hidden {}), top {}, shared expert hidden {}, aux loss "
          "x{}\n",
          m.moe.n_experts, m.moe.expert_hidden, m.moe.top_k, m.moe.shared_hidden,
          m.moe.aux_loss_coef);
    }
    if (m.blocks.find(kBlockMamba) != std::string::npos) {
      arch +=
          fmt::format("  ssm       state {}, head dim {}, expand {}, conv {}, chunk {}\n",
                      m.ssm.d_state, m.ssm.head_dim, m.ssm.expand, m.ssm.conv_kernel, m.ssm.chunk);
    }
    if (m.blocks.find(kBlockRecurrent) != std::string::npos)
      arch += fmt::format("  rnn       width {}, conv {}\n", m.rnn_width(), m.rnn.conv_kernel);
  }
  return describe_base(r, layers) + arch;
}

}  // namespace megacpp::recipe
