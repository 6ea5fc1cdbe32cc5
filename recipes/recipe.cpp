#include "recipes/recipe.h"

#include <capnp/message.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <set>
#include <tuple>
#include <type_traits>

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

// One value of a recipe, as TOML gives it at `where` ("section.key", or the key at the top).
void parse_value(const toml::node& node, const std::string& where, uint32_t& out,
                 const std::filesystem::path& origin) {
  auto v = node.value<int64_t>();
  if (!node.is_integer() || !v || *v < 0 || *v > int64_t{UINT32_MAX})
    bad(origin, where, "must be a non-negative integer");
  out = static_cast<uint32_t>(*v);
}

// data.eos_id: absent is -1 (none); present, a non-negative integer.
void parse_value(const toml::node& node, const std::string& where, int64_t& out,
                 const std::filesystem::path& origin) {
  uint32_t v = 0;
  parse_value(node, where, v, origin);
  out = v;
}

void parse_value(const toml::node& node, const std::string& where, double& out,
                 const std::filesystem::path& origin) {
  auto v = node.value<double>();
  if (!(node.is_floating_point() || node.is_integer()) || !v)
    bad(origin, where, "must be a number");
  out = *v;
}

void parse_value(const toml::node& node, const std::string& where, bool& out,
                 const std::filesystem::path& origin) {
  auto v = node.value<bool>();
  if (!node.is_boolean() || !v) bad(origin, where, "must be a boolean");
  out = *v;
}

void parse_value(const toml::node& node, const std::string& where, std::string& out,
                 const std::filesystem::path& origin) {
  auto v = node.value<std::string>();
  if (!v) bad(origin, where, "must be a string");
  out = *v;
}

// optim.muon_bf16: true | false | "auto" (the default, settled per device at launch).
void parse_muon_bf16(const toml::node& node, const std::string& where, Recipe& r,
                     const std::filesystem::path& origin) {
  if (node.is_boolean()) {
    r.train.optim.muon_bf16 = *node.value<bool>();
    r.train.optim.muon_bf16_auto = false;
  } else if (node.value<std::string>() != "auto") {
    bad(origin, where, "must be true, false or \"auto\"");
  }
}

// The recipe's fields, each declared once: its TOML table and key, where a Recipe holds it, and
// the launch contract's setter and getter. The TOML parse, to_spec, model_config, train_config
// and from_spec are all walks of these tables; Recipe::validate holds the rules and describe the
// sentences, which read several fields at once.
enum class Section : uint8_t { kRoot, kModel, kMoe, kSsm, kRnn, kTrain, kOptim, kData };
constexpr std::string_view section_name(Section s) {
  constexpr std::array<std::string_view, 8> kNames = {"",    "model", "moe",   "ssm",
                                                      "rnn", "train", "optim", "data"};
  return kNames[static_cast<size_t>(s)];
}

using CustomParse = void (*)(const toml::node&, const std::string&, Recipe&,
                             const std::filesystem::path&);

// `at` is a generic lambda returning the Recipe's member (const or not, as the Recipe is).
template <typename At, typename Set, typename Get>
struct Field {
  Section section;
  std::string_view key;
  At at;
  Set set;                      // &schema::XSpec::Builder::setY
  Get get;                      // &schema::XSpec::Reader::getY
  CustomParse parse = nullptr;  // nullptr: parse_value of the member's type
};
template <typename At, typename Set, typename Get>
constexpr Field<At, Set, Get> field(Section section, std::string_view key, At at, Set set, Get get,
                                    CustomParse parse = nullptr) {
  return {section, key, at, set, get, parse};
}

using RS = schema::RecipeSpec;
using MS = schema::ModelSpec;
using AS = schema::ArchSpec;
using TS = schema::TrainSpec;
using OS = schema::OptimSpec;
using MemS = schema::MemorySpec;
using ES = schema::EvalSpec;
using DS = schema::DataSpec;
using enum Section;

// RecipeSpec's declared fields (path, hash and layers are derived).
constexpr auto kRecipeFields = std::tuple{
    field(
        kRoot, "name", [](auto& r) -> auto& { return r.name; }, &RS::Builder::setName,
        &RS::Reader::getName),
    field(
        kRoot, "pattern", [](auto& r) -> auto& { return r.pattern; }, &RS::Builder::setPattern,
        &RS::Reader::getPattern),
};
constexpr auto kModelFields = std::tuple{
    field(
        kModel, "vocab_size", [](auto& r) -> auto& { return r.model.vocab_size; },
        &MS::Builder::setVocabSize, &MS::Reader::getVocabSize),
    field(
        kModel, "seq_len", [](auto& r) -> auto& { return r.model.seq_len; },
        &MS::Builder::setSeqLen, &MS::Reader::getSeqLen),
    field(
        kModel, "d_model", [](auto& r) -> auto& { return r.model.d_model; },
        &MS::Builder::setDModel, &MS::Reader::getDModel),
    field(
        kModel, "n_layers", [](auto& r) -> auto& { return r.model.n_layers; },
        &MS::Builder::setNLayers, &MS::Reader::getNLayers),
    field(
        kModel, "n_heads", [](auto& r) -> auto& { return r.model.n_heads; },
        &MS::Builder::setNHeads, &MS::Reader::getNHeads),
    field(
        kModel, "mlp_mult", [](auto& r) -> auto& { return r.model.mlp_mult; },
        &MS::Builder::setMlpMult, &MS::Reader::getMlpMult),
};
// ModelSpec.arch: written only when a field differs from its default (plain_architecture).
constexpr auto kArchFields = std::tuple{
    field(
        kRoot, "mode", [](auto& r) -> auto& { return r.model.mode; }, &AS::Builder::setMode,
        &AS::Reader::getMode),
    field(
        kModel, "n_kv_heads", [](auto& r) -> auto& { return r.model.n_kv_heads; },
        &AS::Builder::setNKvHeads, &AS::Reader::getNKvHeads),
    field(
        kModel, "rope_theta", [](auto& r) -> auto& { return r.model.rope_theta; },
        &AS::Builder::setRopeTheta, &AS::Reader::getRopeTheta),
    field(
        kModel, "ffn_hidden", [](auto& r) -> auto& { return r.model.ffn_hidden; },
        &AS::Builder::setFfnHidden, &AS::Reader::getFfnHidden),
    field(
        kMoe, "enabled", [](auto& r) -> auto& { return r.model.moe.enabled; },
        &AS::Builder::setMoeEnabled, &AS::Reader::getMoeEnabled),
    field(
        kMoe, "n_experts", [](auto& r) -> auto& { return r.model.moe.n_experts; },
        &AS::Builder::setMoeExperts, &AS::Reader::getMoeExperts),
    field(
        kMoe, "top_k", [](auto& r) -> auto& { return r.model.moe.top_k; }, &AS::Builder::setMoeTopK,
        &AS::Reader::getMoeTopK),
    field(
        kMoe, "expert_hidden", [](auto& r) -> auto& { return r.model.moe.expert_hidden; },
        &AS::Builder::setMoeExpertHidden, &AS::Reader::getMoeExpertHidden),
    field(
        kMoe, "shared_hidden", [](auto& r) -> auto& { return r.model.moe.shared_hidden; },
        &AS::Builder::setMoeSharedHidden, &AS::Reader::getMoeSharedHidden),
    field(
        kMoe, "aux_loss_coef", [](auto& r) -> auto& { return r.model.moe.aux_loss_coef; },
        &AS::Builder::setMoeAuxLossCoef, &AS::Reader::getMoeAuxLossCoef),
    field(
        kSsm, "d_state", [](auto& r) -> auto& { return r.model.ssm.d_state; },
        &AS::Builder::setSsmDState, &AS::Reader::getSsmDState),
    field(
        kSsm, "head_dim", [](auto& r) -> auto& { return r.model.ssm.head_dim; },
        &AS::Builder::setSsmHeadDim, &AS::Reader::getSsmHeadDim),
    field(
        kSsm, "expand", [](auto& r) -> auto& { return r.model.ssm.expand; },
        &AS::Builder::setSsmExpand, &AS::Reader::getSsmExpand),
    field(
        kSsm, "conv_kernel", [](auto& r) -> auto& { return r.model.ssm.conv_kernel; },
        &AS::Builder::setSsmConvKernel, &AS::Reader::getSsmConvKernel),
    field(
        kSsm, "chunk", [](auto& r) -> auto& { return r.model.ssm.chunk; },
        &AS::Builder::setSsmChunk, &AS::Reader::getSsmChunk),
    field(
        kRnn, "width", [](auto& r) -> auto& { return r.model.rnn.width; },
        &AS::Builder::setRnnWidth, &AS::Reader::getRnnWidth),
    field(
        kRnn, "conv_kernel", [](auto& r) -> auto& { return r.model.rnn.conv_kernel; },
        &AS::Builder::setRnnConvKernel, &AS::Reader::getRnnConvKernel),
};
constexpr auto kTrainFields = std::tuple{
    field(
        kTrain, "batch_size", [](auto& r) -> auto& { return r.train.batch_size; },
        &TS::Builder::setBatchSize, &TS::Reader::getBatchSize),
    field(
        kTrain, "min_lr_ratio", [](auto& r) -> auto& { return r.train.min_lr_ratio; },
        &TS::Builder::setMinLrRatio, &TS::Reader::getMinLrRatio),
    field(
        kTrain, "warmup_steps", [](auto& r) -> auto& { return r.train.warmup_steps; },
        &TS::Builder::setWarmupSteps, &TS::Reader::getWarmupSteps),
    field(
        kTrain, "grad_clip", [](auto& r) -> auto& { return r.train.grad_clip; },
        &TS::Builder::setGradClip, &TS::Reader::getGradClip),
    field(
        kTrain, "seed", [](auto& r) -> auto& { return r.train.seed; }, &TS::Builder::setSeed,
        &TS::Reader::getSeed),
    field(
        kTrain, "checkpoint_every", [](auto& r) -> auto& { return r.train.checkpoint_every; },
        &TS::Builder::setCheckpointEvery, &TS::Reader::getCheckpointEvery),
};
// TrainSpec.eval: written only when the recipe evaluates (eval_every > 0).
constexpr auto kEvalFields = std::tuple{
    field(
        kTrain, "eval_every", [](auto& r) -> auto& { return r.train.eval_every; },
        &ES::Builder::setEvery, &ES::Reader::getEvery),
    field(
        kTrain, "eval_tokens", [](auto& r) -> auto& { return r.train.eval_tokens; },
        &ES::Builder::setTokens, &ES::Reader::getTokens),
};
// TrainSpec.memory: written only when a field differs from its default (default_memory), so
// the hash of a recipe that does not name them is what it was before they existed.
constexpr auto kMemoryFields = std::tuple{
    field(
        kTrain, "precision", [](auto& r) -> auto& { return r.train.precision; },
        &MemS::Builder::setPrecision, &MemS::Reader::getPrecision),
    field(
        kTrain, "grad_reduce", [](auto& r) -> auto& { return r.train.grad_reduce; },
        &MemS::Builder::setGradReduce, &MemS::Reader::getGradReduce),
    field(
        kTrain, "recompute", [](auto& r) -> auto& { return r.train.recompute; },
        &MemS::Builder::setRecompute, &MemS::Reader::getRecompute),
};
constexpr auto kOptimFields = std::tuple{
    field(
        kOptim, "embed_lr", [](auto& r) -> auto& { return r.train.optim.embed_lr; },
        &OS::Builder::setEmbedLr, &OS::Reader::getEmbedLr),
    field(
        kOptim, "head_lr", [](auto& r) -> auto& { return r.train.optim.head_lr; },
        &OS::Builder::setHeadLr, &OS::Reader::getHeadLr),
    field(
        kOptim, "adam_lr", [](auto& r) -> auto& { return r.train.optim.adam_lr; },
        &OS::Builder::setAdamLr, &OS::Reader::getAdamLr),
    field(
        kOptim, "adam_beta1", [](auto& r) -> auto& { return r.train.optim.adam_beta1; },
        &OS::Builder::setAdamBeta1, &OS::Reader::getAdamBeta1),
    field(
        kOptim, "adam_beta2", [](auto& r) -> auto& { return r.train.optim.adam_beta2; },
        &OS::Builder::setAdamBeta2, &OS::Reader::getAdamBeta2),
    field(
        kOptim, "adam_eps", [](auto& r) -> auto& { return r.train.optim.adam_eps; },
        &OS::Builder::setAdamEps, &OS::Reader::getAdamEps),
    field(
        kOptim, "adam_weight_decay",
        [](auto& r) -> auto& { return r.train.optim.adam_weight_decay; },
        &OS::Builder::setAdamWeightDecay, &OS::Reader::getAdamWeightDecay),
    field(
        kOptim, "adamw_crossover", [](auto& r) -> auto& { return r.train.optim.adamw_crossover; },
        &OS::Builder::setAdamwCrossover, &OS::Reader::getAdamwCrossover),
    field(
        kOptim, "muon_lr", [](auto& r) -> auto& { return r.train.optim.muon_lr; },
        &OS::Builder::setMuonLr, &OS::Reader::getMuonLr),
    field(
        kOptim, "muon_momentum", [](auto& r) -> auto& { return r.train.optim.muon_momentum; },
        &OS::Builder::setMuonMomentum, &OS::Reader::getMuonMomentum),
    field(
        kOptim, "muon_beta2", [](auto& r) -> auto& { return r.train.optim.muon_beta2; },
        &OS::Builder::setMuonBeta2, &OS::Reader::getMuonBeta2),
    field(
        kOptim, "muon_weight_decay",
        [](auto& r) -> auto& { return r.train.optim.muon_weight_decay; },
        &OS::Builder::setMuonWeightDecay, &OS::Reader::getMuonWeightDecay),
    field(
        kOptim, "muon_orthogonalizer",
        [](auto& r) -> auto& { return r.train.optim.muon_orthogonalizer; },
        &OS::Builder::setMuonOrthogonalizer, &OS::Reader::getMuonOrthogonalizer),
    field(
        kOptim, "muon_ns_steps", [](auto& r) -> auto& { return r.train.optim.muon_ns_steps; },
        &OS::Builder::setMuonNsSteps, &OS::Reader::getMuonNsSteps),
    field(
        kOptim, "muon_bf16", [](auto& r) -> auto& { return r.train.optim.muon_bf16; },
        &OS::Builder::setMuonBf16, &OS::Reader::getMuonBf16, &parse_muon_bf16),
    field(
        kOptim, "qkv_split", [](auto& r) -> auto& { return r.train.optim.qkv_split; },
        &OS::Builder::setQkvSplit, &OS::Reader::getQkvSplit),
};
constexpr auto kDataFields = std::tuple{
    field(
        kData, "source", [](auto& r) -> auto& { return r.data.source; }, &DS::Builder::setSource,
        &DS::Reader::getSource),
    field(
        kData, "path", [](auto& r) -> auto& { return r.data.path; }, &DS::Builder::setPath,
        &DS::Reader::getPath),
    field(
        kData, "split", [](auto& r) -> auto& { return r.data.split; }, &DS::Builder::setSplit,
        &DS::Reader::getSplit),
    field(
        kData, "pack", [](auto& r) -> auto& { return r.data.pack; }, &DS::Builder::setPack,
        &DS::Reader::getPack),
    field(
        kData, "eos_id", [](auto& r) -> auto& { return r.data.eos_id; }, &DS::Builder::setEosId,
        &DS::Reader::getEosId),
    field(
        kData, "shard_tokens", [](auto& r) -> auto& { return r.data.shard_tokens; },
        &DS::Builder::setShardTokens, &DS::Reader::getShardTokens),
    field(
        kData, "shards", [](auto& r) -> auto& { return r.data.shards; }, &DS::Builder::setShards,
        &DS::Reader::getShards),
};

// Every field of every table, in this order (the parse's order within a TOML table).
template <typename Fn>
void for_each_field(Fn&& fn) {
  const auto each = [&](const auto& table) {
    std::apply([&](const auto&... f) { (fn(f), ...); }, table);
  };
  each(kRecipeFields);
  each(kModelFields);
  each(kArchFields);
  each(kTrainFields);
  each(kMemoryFields);
  each(kEvalFields);
  each(kOptimFields);
  each(kDataFields);
}

// The launch contract's struct `spec` from a table's fields of `r`.
template <typename Table, typename Builder>
void write_fields(const Table& table, const Recipe& r, Builder spec) {
  std::apply(
      [&](const auto&... f) {
        (
            [&] {
              const auto& v = f.at(r);
              if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::string>) {
                (spec.*f.set)(capnp::Text::Reader(v.c_str(), v.size()));
              } else {
                (spec.*f.set)(v);
              }
            }(),
            ...);
      },
      table);
}

// A table's fields of `r` from the launch contract's struct `spec`.
template <typename Table, typename Reader>
void read_fields(const Table& table, Reader spec, Recipe& r) {
  std::apply(
      [&](const auto&... f) {
        (
            [&] {
              auto& out = f.at(r);
              const auto v = (spec.*f.get)();
              if constexpr (std::is_same_v<std::decay_t<decltype(out)>, std::string>) {
                out.assign(v.cStr(), v.size());
              } else {
                out = v;
              }
            }(),
            ...);
      },
      table);
}

std::string where(Section s, std::string_view key) {
  return s == kRoot ? std::string(key) : fmt::format("{}.{}", section_name(s), key);
}

// A recipe's TOML tables by section (nullptr: absent).
struct Tables {
  const toml::table& root;
  std::array<const toml::table*, 8> of = {};
  const std::filesystem::path& origin;

  // Finds `s`'s table: absent is nullptr, anything but a table is refused.
  void find(Section s) {
    const auto* node = root.get(section_name(s));
    if (node == nullptr) return;
    if (!node->is_table()) bad(origin, section_name(s), "must be a table");
    of[static_cast<size_t>(s)] = node->as_table();
  }
  // The unknown keys of every section of `sections` first, then their values, in table order.
  void read(std::initializer_list<Section> sections, Recipe& r) const {
    for (Section s : sections) {
      const toml::table* t = of[static_cast<size_t>(s)];
      if (t == nullptr) continue;
      std::set<std::string> allowed;
      for_each_field([&](const auto& f) {
        if (f.section == s) allowed.emplace(f.key);
      });
      if (s == kRoot) {
        for (Section sub : {kModel, kMoe, kSsm, kRnn, kTrain, kOptim, kData})
          allowed.emplace(section_name(sub));
      }
      check_keys(*t, allowed, origin, section_name(s));
    }
    for (Section s : sections) {
      const toml::table* t = of[static_cast<size_t>(s)];
      if (t == nullptr) continue;
      for_each_field([&](const auto& f) {
        if (f.section != s) return;
        const toml::node* node = t->get(f.key);
        if (node == nullptr) return;
        if (f.parse != nullptr) {
          f.parse(*node, where(s, f.key), r, origin);
        } else {
          parse_value(*node, where(s, f.key), f.at(r), origin);
        }
      });
    }
  }
};

std::string canonical(const Recipe& r) {
  capnp::MallocMessageBuilder msg;
  auto spec = msg.initRoot<schema::RecipeSpec>();
  Recipe copy = r;
  copy.path.clear();
  copy.hash.clear();
  // Evaluation reads the model and changes nothing that trains: a recipe's hash is the same
  // with or without it (the comparison class holds the validation set apart).
  copy.train.eval_every = 0;
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
  rule(train.eval_every == 0 || train.eval_tokens >= model.seq_len, "train.eval_tokens",
       "must be >= model.seq_len (one window) when train.eval_every > 0");
  rule(train.precision == "fp32" || train.precision == "bf16-mixed", "train.precision",
       "must be \"fp32\" or \"bf16-mixed\"");
  rule(train.grad_reduce == "fp32" || (train.grad_reduce == "bf16" && train.bf16_mixed()),
       "train.grad_reduce", "must be \"fp32\", or \"bf16\" with train.precision = \"bf16-mixed\"");
  rule(train.recompute == "none" || train.recompute == "selective" || train.recompute == "full",
       "train.recompute", "must be \"none\", \"selective\" or \"full\"");
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
  r.train.optim.muon_bf16_auto = true;  // muon_bf16 absent: "auto"
  // This order (the top level; the model, moe, ssm and rnn tables' kinds; moe, ssm and rnn;
  // then the other tables' kinds; model, train, optim and data) decides which error a recipe
  // with several is refused with, as it always has.
  Tables tables{.root = root, .origin = origin};
  tables.of[static_cast<size_t>(kRoot)] = &root;
  tables.read({kRoot}, r);
  for (Section s : {kModel, kMoe, kSsm, kRnn}) tables.find(s);
  tables.read({kMoe, kSsm, kRnn}, r);
  for (Section s : {kTrain, kOptim, kData}) tables.find(s);
  tables.read({kModel, kTrain, kOptim, kData}, r);
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

Recipe settled_like(Recipe given, const Recipe& run) {
  OptimConfig& o = given.train.optim;
  if (!o.muon_bf16_auto) return given;
  o.muon_bf16 = run.train.optim.muon_bf16;
  o.muon_bf16_auto = false;
  return rehash(std::move(given));
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

// The scan does L (the chunk) units of work per step within chunks and (T / L)^2 / T across them;
// a power of two near (2T)^(1/3) balances the two. Measured at width 256, T 256, forward +
// backward: chunk 8 takes 0.22 s, 16 0.30 s, 64 0.97 s.
int64_t recurrence_scan_chunk(int64_t positions, int64_t cap) {
  const double balanced = std::cbrt(2.0 * static_cast<double>(positions));
  int64_t chunk = 4;
  while (static_cast<double>(chunk * 2) <= balanced * 1.5 && chunk * 2 <= cap) chunk *= 2;
  return std::max<int64_t>(1, std::min(chunk, cap));
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

Recompute recompute_mode(std::string_view value) {
  if (value == "none") return Recompute::kNone;
  if (value == "selective") return Recompute::kSelective;
  MEGACPP_CHECK(
      value == "full", ErrorKind::kInvalidArgument,
      fmt::format("train.recompute: must be \"none\", \"selective\" or \"full\", got \"{}\"",
                  value));
  return Recompute::kFull;
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
  write_fields(kRecipeFields, r, s);
  s.setPath(r.path.string());
  s.setHash(r.hash);
  auto layers = s.initLayers(static_cast<unsigned>(r.layers.size()));
  for (size_t i = 0; i < r.layers.size(); ++i) layers.set(static_cast<unsigned>(i), r.layers[i]);
  auto m = s.initModel();
  write_fields(kModelFields, r, m);
  if (!r.model.plain_architecture()) write_fields(kArchFields, r, m.initArch());
  auto t = s.initTrain();
  write_fields(kTrainFields, r, t);
  write_fields(kOptimFields, r, t.initOptim());
  if (!r.train.default_memory()) write_fields(kMemoryFields, r, t.initMemory());
  if (r.train.eval_every > 0) write_fields(kEvalFields, r, t.initEval());
  write_fields(kDataFields, r, s.initData());
}

ModelConfig model_config(schema::RecipeSpec::Reader spec) {
  Recipe r;
  const auto m = spec.getModel();
  read_fields(kModelFields, m, r);
  if (m.hasArch()) read_fields(kArchFields, m.getArch(), r);
  ModelConfig& c = r.model;
  c.blocks = expand_blocks(std::string(spec.getPattern()), c.n_layers, c.mode, c.moe.enabled);
  return std::move(c);
}

TrainConfig train_config(schema::TrainSpec::Reader t) {
  Recipe r;
  read_fields(kTrainFields, t, r);
  read_fields(kOptimFields, t.getOptim(), r);
  if (t.hasMemory()) read_fields(kMemoryFields, t.getMemory(), r);
  if (t.hasEval()) read_fields(kEvalFields, t.getEval(), r);
  return std::move(r.train);
}

Recipe from_spec(schema::RecipeSpec::Reader s) {
  Recipe r;
  read_fields(kRecipeFields, s, r);
  r.path = std::string(s.getPath());
  for (auto l : s.getLayers()) r.layers.emplace_back(l.cStr());
  r.model = model_config(s);
  r.train = train_config(s.getTrain());
  read_fields(kDataFields, s.getData(), r);
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
  // Whether the record holds together, and with the recorded recipe's seq_len: the values' own
  // bounds are the recipe's rules (the recipe in the contract passed them), checked once there;
  // the sampler and the model take seq_len as given.
  MEGACPP_CHECK(
      !recorded || ((g.slot.token_bytes == 2 || g.slot.token_bytes == 4) &&
                    g.slot.seq_len == l.getRecipe().getModel().getSeqLen() &&
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

ValidationShare validation_share(schema::LaunchContract::Reader launch) {
  ValidationShare share;
  if (!launch.hasValidation()) {
    share.windows = 0;
    return share;
  }
  const auto v = launch.getValidation();
  const BatchGeometry g = batch_geometry(launch);
  share.windows = v.getOff().size() == 0 && v.hasDataset() && v.getEvery() > 0 ? v.getWindows() : 0;
  share.data_ranks = g.data_ranks();
  share.batch = g.slot.batch;
  return share;
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
  if (!r.train.default_memory()) {
    arch += fmt::format("  memory    precision {}, gradients reduced in {}, recompute {}\n",
                        r.train.precision, r.train.grad_reduce, r.train.recompute);
  }
  if (r.train.eval_every > 0) {
    arch += fmt::format("  eval      every {} steps and the last: {} tokens of the val split\n",
                        r.train.eval_every, r.train.eval_tokens);
  }
  return describe_base(r, layers) + arch;
}

}  // namespace megacpp::recipe
