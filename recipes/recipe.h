// megacpp::recipe — named, hashed training declarations (DESIGN.md "Layout additions"), parsed from
// TOML.
//
// Parsing is strict: an unknown key, a wrong type or a value outside its rule is an
// Error{kInvalidArgument} naming the file, the key and the rule. The hash is XXH3-64 of the
// canonical expanded declaration (every value, pattern expanded to layers; not the path),
// so two files that declare the same thing hash the same.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "recipes/batch_spec.h"
#include "schemas/launch.capnp.h"

namespace megacpp::recipe {

// A hybrid recipe's mixture of experts ([moe]). Off by default: an E layer is then a dense MLP.
struct MoeConfig {
  bool enabled = false;
  uint32_t n_experts = 0;       // routed experts
  uint32_t top_k = 0;           // routed experts per token
  uint32_t expert_hidden = 0;   // a routed expert's hidden size
  uint32_t shared_hidden = 0;   // the shared expert's hidden size; 0 = no shared expert
  double aux_loss_coef = 0.01;  // the load-balancing loss's weight in the training loss
  bool operator==(const MoeConfig&) const = default;
};
// The M family's Mamba-2 mixer ([ssm]); d_inner = expand * d_model, heads = d_inner / head_dim.
struct SsmConfig {
  uint32_t d_state = 16;
  uint32_t head_dim = 32;
  uint32_t expand = 2;
  uint32_t conv_kernel = 4;
  uint32_t chunk = 64;  // steps per chunk of the SSD scan
  bool operator==(const SsmConfig&) const = default;
};
// The R family's gated linear recurrence ([rnn]) of the author_dp mode.
struct RnnConfig {
  uint32_t width = 0;  // channels of the recurrence; 0 = d_model
  uint32_t conv_kernel = 4;
  bool operator==(const RnnConfig&) const = default;
};

// Block kinds a layer runs, one character per layer (ModelConfig::blocks): what a pattern symbol
// becomes under a mode (expand_blocks).
inline constexpr char kBlockAttention = 'A';  // attention + relu^2 MLP
inline constexpr char kBlockMoe = 'E';        // mixture of experts (E with MoE on)
inline constexpr char kBlockMlp = 'F';        // dense relu^2 MLP (E with MoE off)
inline constexpr char kBlockMamba = 'M';      // Mamba-2 mixer (M; R in nemo_native)
inline constexpr char kBlockRecurrent = 'R';  // gated linear recurrence (R in author_dp)

inline constexpr std::string_view kModeAuthorDp = "author_dp";
inline constexpr std::string_view kModeNemoNative = "nemo_native";

struct ModelConfig {
  uint32_t vocab_size = 256;
  uint32_t seq_len = 64;
  uint32_t d_model = 128;
  uint32_t n_layers = 2;
  uint32_t n_heads = 4;
  uint32_t mlp_mult = 4;
  // The hybrid architecture (DESIGN.md "Hybrid recipes"). At these defaults a recipe is the
  // plain attention decoder, and its launch contract and hash are what they were before these
  // fields existed.
  uint32_t n_kv_heads = 0;  // grouped-query attention: key/value heads; 0 = n_heads
  double rope_theta = 10000.0;
  uint32_t ffn_hidden =
      0;  // the A block's and a dense E layer's MLP hidden; 0 = mlp_mult * d_model
  std::string mode = std::string(kModeAuthorDp);  // "author_dp" (TP 1) | "nemo_native" (TP 2 + SP)
  MoeConfig moe = {};
  SsmConfig ssm = {};
  RnnConfig rnn = {};
  // Derived, not declared: the block kind of each layer (expand_blocks of the recipe's pattern).
  // Empty means every layer is kBlockAttention (a config built in code for the plain decoder).
  std::string blocks = {};

  uint32_t kv_heads() const { return n_kv_heads ? n_kv_heads : n_heads; }
  uint32_t head_dim() const { return d_model / n_heads; }
  uint32_t ffn() const { return ffn_hidden ? ffn_hidden : mlp_mult * d_model; }
  uint32_t rnn_width() const { return rnn.width ? rnn.width : d_model; }
  char block(uint32_t layer) const { return blocks.empty() ? kBlockAttention : blocks.at(layer); }
  // The tensor-parallel degree the mode implies (nemo_native: 2, with sequence parallelism).
  uint32_t tensor_parallel() const { return mode == kModeNemoNative ? 2 : 1; }
  // True when every hybrid field is at its default (the launch contract then omits them).
  bool plain_architecture() const;
};

// The pattern tiled to n_layers, each symbol mapped to its block kind: A -> attention; E -> MoE
// when `moe_enabled`, else a dense MLP; M -> Mamba-2; R -> the recurrence in author_dp, Mamba-2 in
// nemo_native (that mode runs both M and R on the Mamba-family block).
std::string expand_blocks(std::string_view pattern, uint32_t n_layers, std::string_view mode,
                          bool moe_enabled);
// "attention", "moe", "mlp", "mamba2", "recurrent".
std::string_view block_name(char block);

// The chunk of the recurrence's diagonal scan over `positions` steps: a power of two near
// (2T)^(1/3), at least 4, at most `cap` (the recipe's ssm.chunk). The trainer scans with it and
// the plan counts the scan's decay matrices with it.
int64_t recurrence_scan_chunk(int64_t positions, int64_t cap);

// The [optim] table: the hybrid optimizer of README.md "Distributed optimizer". DistMuon takes
// every 2-D matrix inside the blocks; DistAdamW takes the embedding (embed_lr), the head (head_lr)
// and every other parameter (adam_lr). Learning rates are the peaks of the [train] schedule, which
// scales all of them by the same factor each step.
struct OptimConfig {
  double embed_lr = 0.2;
  double head_lr = 0.004;
  double adam_lr = 0.004;
  double adam_beta1 = 0.8;
  double adam_beta2 = 0.95;
  double adam_eps = 1e-10;
  double adam_weight_decay = 0.0;
  // A DistAdamW parameter with at least this many elements and shape[0] % world == 0 is
  // sharded (reduce-scatter, owned-slice update, all-gather); others are all-reduced.
  uint32_t adamw_crossover = 262144;  // measured on Gloo: bench_optimizer section 3
  double muon_lr = 0.02;
  double muon_momentum = 0.95;
  double muon_beta2 = 0.95;
  double muon_weight_decay = 0.0;  // cautious: applied where update and parameter agree
  std::string muon_orthogonalizer = "polar_express";  // or "newton_schulz"
  uint32_t muon_ns_steps = 5;
  bool muon_bf16 = true;  // orthogonalize in bfloat16
  // The recipe said muon_bf16 = "auto" (its default): resolve_muon_precision decides for the
  // device the run meets, before the recipe is hashed for a launch.
  bool muon_bf16_auto = false;
  bool qkv_split = true;  // orthogonalize the fused qkv projection's q, k, v slices alone
};

// DistMuon exchanges its stacks in buckets of at most this many buffer elements (all ranks'
// segments; stages/trainer/optim.h DistMuonOptions::bucket_numel): the trainer's setting and the
// plan's (recipes/plan.h exchange buffers).
inline constexpr int64_t kMuonBucketNumel = int64_t{1} << 26;

struct TrainConfig {
  uint32_t batch_size = 16;  // sequences per rank per step
  // LR schedule (a factor on every [optim] learning rate): linear warmup over warmup_steps,
  // then cosine down to min_lr_ratio at the last step.
  double min_lr_ratio = 0.1;
  uint32_t warmup_steps = 5;
  double grad_clip = 1.0;  // per-rank gradient norm clip before the optimizer; 0 disables
  uint32_t seed = 1234;
  uint32_t checkpoint_every = 20;
  // Held-out evaluation (README.md "Validation loss"): every eval_every steps and at the last
  // step, the ranks compute the mean cross-entropy of eval_tokens tokens (over all ranks) of the
  // data's val split, without gradients and without touching the optimizers or the training
  // data order. 0 = no evaluation. Not in the recipe's hash: evaluation does not change what
  // trains (the comparison class names the validation set apart).
  uint32_t eval_every = 0;
  uint32_t eval_tokens = 65536;
  // Memory (README.md "Precision, recomputation and sharding"). precision: "fp32" (every
  // tensor float32) or "bf16-mixed" (bfloat16 parameters, activations and gradients for
  // compute; float32 master weights and optimizer state held only in the optimizers' shards;
  // bfloat16 has float32's exponent range, so no loss scaling). grad_reduce: the dtype the
  // gradients are summed in across data parallel, "fp32" or "bf16" (bf16-mixed only).
  // recompute: activation recomputation, "none", "selective" (each block's element-wise tails
  // — norms, activations, RoPE, the scans — recomputed, every matmul's output kept) or "full"
  // (only each block's input kept, its forward run again in backward).
  std::string precision = "fp32";
  std::string grad_reduce = "fp32";
  std::string recompute = "none";
  bool default_memory() const {
    return precision == "fp32" && grad_reduce == "fp32" && recompute == "none";
  }
  bool bf16_mixed() const { return precision == "bf16-mixed"; }
  OptimConfig optim;
};

// Whether a run of `total_steps` evaluates after 1-based `step`: every `every` steps and at the
// last one (never when every is 0).
constexpr bool evaluates_at(uint32_t every, uint32_t step, uint32_t total_steps) noexcept {
  return every > 0 && (step % every == 0 || step == total_steps);
}
// The evaluations after steps after+1 .. total_steps.
constexpr uint32_t evaluations_after(uint32_t every, uint32_t after,
                                     uint32_t total_steps) noexcept {
  if (every == 0 || after >= total_steps) return 0;
  return total_steps / every - after / every + (total_steps % every != 0 ? 1 : 0);
}

// train.recompute parsed once: the trainer's model (stages/trainer/model.h) and the plan's
// activation estimate (recipes/plan.h) take this, not the string.
enum class Recompute { kNone, kSelective, kFull };
// "none" | "selective" | "full"; anything else is Error{kInvalidArgument} naming the rule.
Recompute recompute_mode(std::string_view value);

// The recipe's [data]: where the token shards come from and how windows are cut from them
// (data/shards.h, data/sampler.h). A window is model.seq_len + 1 tokens.
struct DataConfig {
  std::string source = "builtin";   // "builtin" | "llmc" | "megatron"
  std::string path;                 // llmc/megatron: directory or glob, relative to --data-dir
  std::string split = "train";      // "train" | "val": file names containing it ("{split}" in path)
  bool pack = true;                 // windows may cross document boundaries
  int64_t eos_id = -1;              // the end-of-text id that starts a document; -1 = none
  uint32_t shard_tokens = 1 << 20;  // builtin: tokens per generated shard
  uint32_t shards = 2;              // builtin: generated shards
};
// The largest vocabulary a recipe may declare (token ids travel as uint32).
inline constexpr uint32_t kMaxVocab = 1u << 24;

struct Recipe {
  std::string name;
  std::filesystem::path path;
  std::string pattern = "A";
  std::vector<std::string> layers;  // pattern expanded to n_layers block families
  ModelConfig model;
  TrainConfig train;
  DataConfig data;
  std::string hash;

  // Throws Error{kInvalidArgument} naming the violated rule.
  void validate() const;
};

// The most layers a recipe may declare (the pattern is expanded to one entry per layer).
inline constexpr uint32_t kMaxLayers = 4096;
// The batch slot geometry (recipes/batch_spec.h) of a model and its training, or of a recipe.
constexpr BatchSpec batch_spec(const ModelConfig& model, const TrainConfig& train) noexcept {
  return BatchSpec{.batch = train.batch_size,
                   .seq_len = model.seq_len,
                   .token_bytes = slot_token_bytes(model.vocab_size)};
}
constexpr BatchSpec batch_spec(const Recipe& r) noexcept {
  return batch_spec(r.model, r.train);
}
// The batch geometry of an attempt of `world` ranks (recipes/batch_spec.h BatchGeometry): the
// recipe's slot with `rank_batch` rows per rank (0: the recipe's train.batch_size; a resume at
// another world size keeps the global batch with its own), its mode's tensor-parallel groups.
// Pure: the recipe's rules (Recipe::validate) bound it; the caller checks the world.
BatchGeometry resolve_batch(const ModelConfig& model, const TrainConfig& train, uint32_t world,
                            uint32_t rank_batch);
BatchGeometry resolve_batch(const Recipe& r, uint32_t world, uint32_t rank_batch);
// The launch contract's record of the geometry (LaunchContract.batch).
void to_spec(const BatchGeometry& batch, schema::BatchGeometry::Builder spec);
// The geometry a launch contract records: what the data loader and the trainers use. A contract
// written before the field gets what its supervisor resolved then (resolve_batch of its recipe,
// world and resume.rankBatch). Throws Error{kInvalidArgument} when the record disagrees with
// itself, with the world (no tensor-parallel grouping of the world) or with the recorded recipe
// (a seq_len other than its model.seq_len, which Recipe::validate bounds: the one seq_len rule),
// or a slot size is not its rows'.
BatchGeometry batch_geometry(schema::LaunchContract::Reader launch);
// How the attempt a launch contract describes evaluates (LaunchContract.validation): windows 0
// when it does not (no validation, or it is off).
ValidationShare validation_share(schema::LaunchContract::Reader launch);

// `name_or_path`: a path to a .toml file, or the name of a recipe in `recipe_dir`.
std::filesystem::path resolve(const std::string& name_or_path,
                              const std::filesystem::path& recipe_dir);
Recipe load(const std::filesystem::path& path);
Recipe parse(const std::string& toml_text, const std::filesystem::path& origin);
// A recipe changed after parsing (the CLI's overrides): validated again, hash recomputed.
Recipe rehash(Recipe recipe);
// Settles muon_bf16 = "auto" for the device the run trains on: bfloat16 on "cuda" and on a
// CPU with bfloat16 matrix units (`cpu_bf16_units`, as core's cpu_bf16_units() reports them),
// float32 elsewhere, where bf16 matmuls are emulated and the orthogonalization several times
// slower. The recipe is rehashed (its hash covers the precision that runs). Returns how the
// precision was chosen, for the launch contract and receipts, e.g. "bfloat16 (auto: cpu with
// amx_bf16 avx512_bf16)" or "float32 (the recipe)".
std::string resolve_muon_precision(Recipe& recipe, std::string_view device,
                                   std::string_view cpu_bf16_units);
// `given` (a command's recipe, "auto" unsettled) with its "auto" settings settled as `run` (a
// launched run's recipe) settled them, rehashed: equal hashes then mean the command names the
// run's recipe, whichever device or CPU the run first met.
Recipe settled_like(Recipe given, const Recipe& run);

void to_spec(const Recipe& r, schema::RecipeSpec::Builder spec);
// The recipe a launch contract recorded, rebuilt without its file (a resumed run trains on
// exactly what it started with, whatever happened to the .toml since). Validated and rehashed:
// throws Error{kInvalidArgument} when it breaks a rule, Error{kCorruption} when it does not
// hash to the recorded hash.
Recipe from_spec(schema::RecipeSpec::Reader spec);
// The launch contract's model and training sections as the configs the trainer runs (the one
// mapping from_spec uses too). Not validated: the caller validates.
// The model's blocks are expanded from the recipe's pattern, n_layers and mode.
ModelConfig model_config(schema::RecipeSpec::Reader spec);
TrainConfig train_config(schema::TrainSpec::Reader spec);
// A human-readable expansion (what `megacpp plan` prints).
std::string describe(const Recipe& r);

}  // namespace megacpp::recipe
