// The distributed optimizers (README.md "Distributed optimizer"): DistAdamW and DistMuon (ZeRO-2
// style).
//
// Contracts shared by both:
// - The process group may be null: world 1, rank 0, no collectives (the single-process
//   reference runs the same code path).
// - step() reads each parameter's .grad(); an undefined gradient means "this rank has none".
//   Every step starts with one all-reduce(MAX) of an int32 has-grad mask (one entry per
//   parameter); a rank without a gradient contributes zeros, and every rank issues the same
//   collectives in the same order whatever its local gradient presence. A parameter that no
//   rank has a gradient for is left exactly as it was, and so is its state (as nanochat skips
//   a parameter whose grad is None: no weight decay, no step count). The decision is taken
//   on tensors (torch::where), never on the host.
// - Gradients are averaged over ranks with SUM then a division by the world size (Gloo has
//   no AVG). On Gloo a reduce-scatter is an all-reduce followed by a narrow.
// - Step scalars (lr, betas, momentum, weight decay) are 0-D float32 tensors on the
//   parameters' device, owned by the optimizer and updated in place (set_* or through
//   scalars()): a step contains no host synchronisation for them. The weight decay changes
//   only through set_weight_decay or load_state_dict, which keep the host's knowledge of
//   whether a group decays (a group that does not skips the decay's arithmetic, on a device
//   without reading the tensor).
// - step() does not modify gradients and does not zero them.
// - Not thread-safe; one step at a time. Parameters must outlive the optimizer and keep
//   their storage (the optimizer updates them in place).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "ops/ops.h"

namespace megacpp::trainer {

// What a state entry holds, as a type: {parameter, group, stack, field}. DistAdamW keeps
// per-parameter moments and step counts (scope kParam; `param` is the parameter's index
// flattened over the groups) and per-group scalars (kGroup); DistMuon keeps per-stack moments
// (kStack: stack `stack` of group `group`) and per-group scalars (kGroup). Indices the scope
// does not use are 0. Code compares keys, never names: a name is derived from a key
// (entry_name) and never parsed back into one.
enum class StateScope : uint8_t { kParam, kGroup, kStack };
enum class StateField : uint8_t {
  kExpAvg,          // DistAdamW, per parameter
  kExpAvgSq,        // DistAdamW, per parameter
  kStep,            // DistAdamW, per parameter: steps in which some rank had a gradient
  kMomentum,        // DistMuon: per stack (the buffer) and per group (the coefficient)
  kSecondMomentum,  // DistMuon, per stack
  kLr,
  kBeta1,
  kBeta2,
  kEps,
  kWeightDecay,
  kMaster,  // both, beside the moments: the float32 master copy of a parameter's owned part
};
struct StateKey {
  StateScope scope = StateScope::kGroup;
  uint32_t param = 0;
  uint32_t group = 0;
  uint32_t stack = 0;
  StateField field = StateField::kLr;

  static constexpr StateKey of_param(uint32_t param, StateField field) {
    return {.scope = StateScope::kParam, .param = param, .field = field};
  }
  static constexpr StateKey of_group(uint32_t group, StateField field) {
    return {.scope = StateScope::kGroup, .group = group, .field = field};
  }
  static constexpr StateKey of_stack(uint32_t group, uint32_t stack, StateField field) {
    return {.scope = StateScope::kStack, .group = group, .stack = stack, .field = field};
  }
  bool operator==(const StateKey&) const = default;
};
// "exp_avg", "exp_avg_sq", "step", "momentum", "second_momentum", "lr", "beta1", "beta2",
// "eps", "weight_decay", "master": the last component of entry names and of the snapshot's logical
// names (TrainStep::snapshot_share).
std::string_view field_name(StateField field);
// The entry's name: "p<param>.<field>", "g<group>.<field>" or "g<group>.s<stack>.<field>".
std::string entry_name(const StateKey& key);

// One rank's share of an optimizer's state. Each entry is a tensor this rank owns (a slice
// along dim 0 of a logical tensor of full_shape, starting at row `offset`) or holds
// replicated (offset 0, full_shape == value's shape, replicated true). Loading it into an
// optimizer built over the same parameters, groups, world and rank reproduces the next step
// bit-exactly. Ranks' dicts together reassemble every logical tensor (concatenate the
// non-replicated entries of a key in offset order; a Muon stack's trailing padding rows,
// beyond full_shape[0], belong to no parameter).
struct OptimizerStateEntry {
  StateKey key;
  at::Tensor value;
  std::vector<int64_t> full_shape;
  int64_t offset = 0;
  bool replicated = true;
};
struct OptimizerState {
  std::string kind;  // "dist_adamw" or "dist_muon"
  uint32_t rank = 0;
  uint32_t world = 1;
  std::vector<OptimizerStateEntry> entries;
};

// Where an optimizer step's time went, in host wall seconds, added to by step() when given
// (the caller zeroes it). On a CUDA device the figures are host time: work still queued on the
// stream is counted by whichever later part waits for it.
struct OptimizerPhaseTimes {
  double reduce = 0;         // has-grad mask, gradient packing and all-reduce / reduce-scatter
  double orthogonalize = 0;  // DistMuon: Polar Express / Newton-Schulz
  double update = 0;         // element-wise math: moments, variance reduction, the update
  double gather = 0;         // all-gather of updated parameters and their unpacking
};

// ---------------------------------------------------------------------------------------
// DistAdamW (nanochat adamw_step_fused math): p *= 1 - lr*wd; m = lerp(m, g, 1-b1);
// v = lerp(v, g², 1-b2); p -= lr/(1-b1^t) * m / (sqrt(v/(1-b2^t)) + eps). Decoupled weight
// decay applies to every parameter of the group (not cautious). t counts the steps in which
// some rank had a gradient for that parameter.
// Placement, fixed at construction: a parameter with numel >= crossover_numel and
// shape[0] % world == 0 is sharded (each rank owns rows [rank*r, (rank+1)*r), r =
// shape[0]/world: reduce-scatter, local update of the slice and its state, all-gather);
// every other parameter (0-D included) is replicated (all-reduce, replicated state).
struct AdamWParamGroup {
  std::vector<at::Tensor> params = {};
  // With master weights (DistAdamWOptions::master_weights): the float32 values the master
  // copies start from, one per parameter of its shape; empty: the parameters' own values.
  std::vector<at::Tensor> masters = {};
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};
// One AdamW step with ops.h adamw_step_cpu's contract over n float32 elements: p, g, m, v and
// the scalars (the optimizer's 0-D float32 tensors, `step` already counting this step, `gate`
// the has-grad flag) are on the parameters' device. Issued in the order of the device's
// current stream (synchronous on the CPU); may throw Error.
using AdamWKernel = std::function<void(float* p, const float* g, float* m, float* v, int64_t n,
                                       const ops::AdamWStepScalars& s, bool decays)>;

// Muon's tail with ops.h muon_tail_cpu's contract: every array, the scalars and the workspace
// (muon_tail_workspace floats) on the parameters' device. Issued in the order of the device's
// current stream (synchronous on the CPU); may throw Error.
using MuonTailKernel = std::function<void(const ops::MuonTailArgs& args)>;

// The fused kernels a device's optimizers run in place of torch's operations (empty: none);
// TrainStep hands them to the optimizers.
struct OptimKernels {
  AdamWKernel adamw_step;    // DistAdamWOptions::fused_update
  MuonTailKernel muon_tail;  // DistMuonOptions::fused_tail
};

struct DistAdamWOptions {
  // From this many elements a parameter is sharded. The default is the crossover measured
  // by bench_optimizer on Gloo at world 2 (sharding stops being slower at 2^18 elements;
  // Gloo has no native reduce-scatter). NCCL's crossover is not measured here (the design
  // note's geometry put it near 1024): set it per transport. Huge = all replicated.
  int64_t crossover_numel = 262144;
  // Mixed precision (README.md "Precision, recomputation and sharding"): the parameters are a
  // compute copy (bfloat16) and the optimizer keeps a float32 master copy of the rows it owns
  // (a sharded parameter's rows, a replicated one whole), updates it with the float32 moments
  // and writes its cast into the parameter, whose all-gather then moves the compute dtype.
  bool master_weights = false;
  // The dtype gradients are summed in across ranks; unset: each parameter's dtype. A float32
  // reduction of bfloat16 gradients keeps the rank-ordered single-buffer exchange.
  std::optional<at::ScalarType> reduce_dtype = std::nullopt;
  // As DistMuonOptions::host_decisions: false takes a device's path on the CPU (tests).
  bool host_decisions = true;
  // The fused update the gated path (a device's) runs instead of torch's operations, one call
  // per parameter whose float32 target, gradient and moments are contiguous: on a CUDA rank the
  // plugin's kernel (cuda_plugin.h CudaPlugin::optim_kernels). Null: torch's operations.
  AdamWKernel fused_update = nullptr;
};
struct AdamWScalars {
  at::Tensor lr, beta1, beta2, eps, weight_decay;  // 0-D float32
};

class Exchange;

class DistAdamW {
 public:
  // Throws Error{kInvalidArgument} for an empty group, an undefined parameter, or
  // parameters on different devices.
  DistAdamW(std::vector<AdamWParamGroup> groups, c10::intrusive_ptr<c10d::Backend> pg,
            DistAdamWOptions options = {});
  DistAdamW(const DistAdamW&) = delete;
  DistAdamW& operator=(const DistAdamW&) = delete;
  DistAdamW(DistAdamW&&) = delete;
  DistAdamW& operator=(DistAdamW&&) = delete;
  ~DistAdamW();

  void step(OptimizerPhaseTimes* times = nullptr);

  // For a caller that reduces this step's gradients together with other data (a DistMuon
  // step's riders, one exchange for both): on Gloo, packs the has-grad flags and every
  // gradient into the buffer the step reduces and returns it; the caller must SUM it over the
  // ranks in place (rank order, as DistMuon's riders are) before the next step(), which then
  // uses it as it is. Elsewhere returns an undefined tensor and step() reduces as usual.
  at::Tensor pack_for_exchange();

  size_t num_groups() const;
  // Update in place (fill_/copy_) between steps; the weight decay through set_weight_decay.
  AdamWScalars& scalars(size_t group);
  void set_lr(size_t group, double lr);
  void set_weight_decay(size_t group, double wd);
  // Placement of parameter `index` (flattened over groups, in construction order).
  bool is_sharded(size_t index) const;

  OptimizerState state_dict() const;  // deep copies
  // The same entries aliasing the live state (no copy): valid until the next step() or
  // load_state_dict(); for copying straight into a snapshot.
  OptimizerState state_view() const;
  // Throws Error{kInvalidArgument} when the dict was taken from a different world, rank,
  // kind or parameter layout.
  void load_state_dict(const OptimizerState& state);

  uint32_t rank() const { return rank_; }
  uint32_t world() const { return world_; }

 private:
  struct Group;
  struct Param;
  std::unique_ptr<Exchange> exchange_;  // exchange.h: the collectives over the group
  uint32_t rank_ = 0;
  uint32_t world_ = 1;
  bool exchanges_by_point_to_point() const;
  void pack_bucket();
  std::vector<Group> groups_;
  std::vector<Param> params_;
  // step()'s buffer on a rank-ordered exchange, kept from one step to the next: the has-grad
  // flags and every gradient. packed_: pack_for_exchange() handed the bucket out for this step.
  at::Tensor bucket_;
  bool packed_ = false;
  bool host_decisions_ = true;  // DistAdamWOptions::host_decisions
  AdamWKernel fused_update_;    // DistAdamWOptions::fused_update
};

// ---------------------------------------------------------------------------------------
// DistMuon (nanochat muon_step_fused math), per stack of same-shape matrices:
//   Nesterov momentum: buf = lerp(buf, g, 1-μ); g = lerp(g, buf, μ)
//   then per matrix — per row slice when qkv_split_sizes is set, each slice being a matrix of
//   its own (rows r = its size) from here on:
//   orthogonalization:
//     Polar Express: X = g/(‖g‖_F·1.02 + 1e-6), the 5 coefficient triples of
//     tools/optim_reference.py
//     (tall: A = XᵀX, X = aX + X(bA + cA²); wide: A = XXᵀ, X = aX + (bA + cA²)X), or
//     classic Newton–Schulz (3.4445, −4.7750, 2.0315) on the wide orientation after
//     X = g/(‖g‖_F + 1e-7);
//   variance reduction (NorMuon): factored second moment over the longer side (per row when
//     rows >= cols or the group is split, else per column), rescaled to preserve the
//     matrix's (slice's) Frobenius norm;
//   cautious weight decay: mask = (u * p) >= 0; p -= lr_eff*u + lr_eff*wd*p*mask,
//     lr_eff = lr * sqrt(max(1, r/cols)). The parameter-sign gate masks the decay only; the
//     update is never masked (DESIGN.md "Decisions": the cautious gate).
// A split parameter therefore moves exactly as its slices would as separate parameters
// whenever every slice has r >= cols (a wide slice alone would keep per-column statistics).
// Stacking: within a group, parameters of one shape form a stack (shapes in sorted order,
// parameters in given order). Each rank owns chunk_size = ceil(n / world) consecutive
// entries of a stack (the last ranks may own fewer or none); the stacked gradients of all
// stacks are zero-padded to chunk_size*world and laid out rank-major in one buffer, which
// one reduce-scatter reduces, the owned entries are updated with their state, and one
// all-gather returns every entry. DistMuonOptions::replicated instead gives every rank the
// whole stacks (the same buffer, all-reduced).
enum class Orthogonalizer { kPolarExpress, kNewtonSchulz };

// The part of a matrix one rank holds (tensor-parallel weight shards, tensor_parallel.h):
// blocks along `dim`, block k being indices [full_offset, full_offset + size) of the whole
// matrix (full_shape) at [local_offset, local_offset + size) of the rank's tensor. A block
// `contributes` when its gradient is this rank's to give: a block every rank of a
// tensor-parallel group holds (and whose gradient was summed over that group) contributes on
// one rank only. No block: the rank holds none of the matrix (an expert another rank runs;
// its tensor is empty and never has a gradient).
struct MatrixPart {
  std::vector<int64_t> full_shape;  // [rows, cols]
  int64_t dim = 0;                  // 0: blocks of rows, 1: blocks of columns
  struct Block {
    int64_t full_offset = 0;
    int64_t local_offset = 0;
    int64_t size = 0;
    bool contributes = true;
    // Every rank of the tensor-parallel group holds this block (its gradient is summed over
    // the group before the step); for the caller, DistMuon does not read it.
    bool replicated = false;
  };
  std::vector<Block> blocks;
};

struct MuonParamGroup {
  std::vector<at::Tensor> params = {};  // 2-D only
  double lr = 0.02;
  double momentum = 0.95;
  double beta2 = 0.95;
  double weight_decay = 0.0;
  // Row sizes of a fused projection (e.g. {q, k, v}), summing to every parameter's shape[0];
  // empty: each matrix is orthogonalized whole.
  std::vector<int64_t> qkv_split_sizes = {};
  // With master weights (DistMuonOptions::master_weights): float32 starting values, one per
  // parameter of its shape; empty: the parameters' own values.
  std::vector<at::Tensor> masters = {};
  // Tensor-parallel weight shards: one per parameter, the part of its matrix the rank holds;
  // empty: every parameter is whole. With parts, every matrix is stepped whole (stacked by
  // its full shape, orthogonalized and variance-reduced as the unsplit matrix, its lr scale
  // from the full shape) by the one rank of the process group that owns its stack entry, on a
  // whole copy of the matrix that owner keeps (float32 with master weights, else the
  // parameters' dtype; the state's "master" entries); `masters` must then hold every
  // matrix's whole starting values. A rank sends its contributing blocks in the stacked
  // exchange (zeros elsewhere: summing them adds nothing, so the sums are those of the whole
  // gradients) and takes its blocks back from the all-gathered whole matrices. The process
  // group is then every rank holding a part (data parallel x tensor parallel).
  std::vector<MatrixPart> parts = {};
};
struct DistMuonOptions {
  Orthogonalizer orthogonalizer = Orthogonalizer::kPolarExpress;
  int ns_steps = 5;  // 1..5 for Polar Express
  // Orthogonalize in bfloat16 (as nanochat does); false keeps the parameter dtype.
  bool bf16_orthogonalization = true;
  // Every rank owns every stack entry (chunk_size = stack length): stacked gradients are
  // all-reduced, every rank updates the whole stack with a full copy of the state, and
  // nothing is all-gathered. Same results as sharded; for checks (the stress harness compares
  // state across ranks with it) and for worlds where memory is no object.
  bool replicated = false;
  // Mixed precision, as DistAdamWOptions::master_weights: a float32 master copy of the stack
  // entries this rank owns, momentum and second moment in float32, the parameters (bfloat16)
  // receiving the masters' cast through the all-gather.
  bool master_weights = false;
  // The dtype the stacked gradients are summed in; unset: the parameters' dtype. Not float32:
  // the riders are summed by collectives of their own (they keep float32 precision).
  std::optional<at::ScalarType> reduce_dtype = std::nullopt;
  // The most elements a step's exchange buffer holds (all ranks' segments): stacks are
  // exchanged in buckets of at most this much (a stack larger than a bucket is split between
  // buckets, its entries keeping their owners), so the buffers kept from one step to the next
  // are bounded by it (or one entry per rank, when larger). The same bits at any size.
  int64_t bucket_numel = int64_t{1} << 26;
  // The gradients' sum over the ranks is divided by this; 0: the world. With tensor-parallel
  // parts (MuonParamGroup::parts) the data-parallel degree: the ranks of a tensor-parallel
  // group give disjoint blocks of one gradient, which are not averaged.
  uint32_t replicas = 0;
  // On the CPU the has-grad mask and the weight decay are read on the host (the in-place path
  // when every entry had a gradient and nothing decays). false: a device's path there too —
  // every decision a tensor, the mask a 0/1 weight (for tests on the CPU). A device's mask is
  // never read on the host.
  bool host_decisions = true;
  // Muon's tail (variance reduction and update, no weight decay) as one fused call per stack of
  // float32 matrices of one slice on the gated path (a device's) instead of torch's operations:
  // on a CUDA rank the plugin's kernel (cuda_plugin.h CudaPlugin::optim_kernels). Null: torch's.
  MuonTailKernel fused_tail = nullptr;
};
struct MuonScalars {
  at::Tensor lr, momentum, beta2, weight_decay;  // 0-D float32
};

class DistMuon {
 public:
  // Throws Error{kInvalidArgument} for a parameter that is not 2-D (naming its shape), an
  // empty group, qkv_split_sizes that do not sum to shape[0], mixed devices or dtypes, or
  // an ns_steps out of range.
  DistMuon(std::vector<MuonParamGroup> groups, c10::intrusive_ptr<c10d::Backend> pg,
           DistMuonOptions options = {});
  DistMuon(const DistMuon&) = delete;
  DistMuon& operator=(const DistMuon&) = delete;
  DistMuon(DistMuon&&) = delete;
  DistMuon& operator=(DistMuon&&) = delete;
  ~DistMuon();

  // Adds a group (same checks as the constructor); its stacks get their chunk_size from the
  // current world. Every rank must add the same groups in the same order.
  void add_param_group(MuonParamGroup group);

  // `riders`: contiguous 1-D float32 tensors on the parameters' device, each replaced by its
  // SUM over the ranks within this step's own reduction (on Gloo they travel in every
  // segment of the exchange, summed in rank order; elsewhere each is all-reduced). A
  // collective: every rank passes riders of the same sizes.
  void step(OptimizerPhaseTimes* times = nullptr, std::span<const at::Tensor> riders = {});

  size_t num_groups() const;
  size_t num_stacks(size_t group) const;
  int64_t chunk_size(size_t group, size_t stack) const;
  int64_t stack_len(size_t group, size_t stack) const;
  // Indices (in the group's given parameter order) of a stack's entries, in stack order.
  std::vector<size_t> stack_members(size_t group, size_t stack) const;
  MuonScalars& scalars(size_t group);  // as DistAdamW::scalars
  void set_lr(size_t group, double lr);
  void set_momentum(size_t group, double momentum);
  void set_weight_decay(size_t group, double wd);

  OptimizerState state_dict() const;  // deep copies
  OptimizerState state_view() const;  // aliases, as DistAdamW::state_view
  void load_state_dict(const OptimizerState& state);

  uint32_t rank() const { return rank_; }
  uint32_t world() const { return world_; }

 private:
  struct Group;
  struct Stack;
  struct Update;
  // `row`: the first state row of the entries (their position in this rank's chunk).
  Update begin_update(Group& g, Stack& s, const at::Tensor& grad, const at::Tensor& mask,
                      int64_t start, int64_t owned, int64_t row);
  void orthogonalize_all(std::vector<Update>& updates) const;
  // The new values; written into `dest` (contiguous, the entries' size) and returned as it
  // where that saves a copy, else a tensor of their own.
  at::Tensor finish_update(Update& u, at::Tensor dest);
  // finish_update through options_.fused_tail where it applies (the gated path, no weight
  // decay, one slice, float32 and contiguous); undefined where it does not.
  at::Tensor fused_tail(Update& u, const at::Tensor& dest) const;
  std::unique_ptr<Exchange> exchange_;  // exchange.h: the collectives over the group
  DistMuonOptions options_;
  uint32_t rank_ = 0;
  uint32_t world_ = 1;
  std::vector<Group> groups_;
  // step()'s buffers, kept from one step to the next: the rank-major stacked gradients and
  // the updated entries to all-gather (sharded).
  at::Tensor grad_buf_, param_buf_;
};

namespace detail {
// Where an iteration's scaled sums (b·A + c·A², a·X + B·X) are taken. kSeparate: as separately
// rounded element-wise operations after the products (on the CPU through the fused loops of
// ops/optim_kernels.h: the bits of torch's operations, which the golden losses pin). kInProduct:
// by the products themselves (addmm / baddbmm with beta and alpha: cuBLAS applies them in its
// epilogue, one rounding, no pass over A or X). kAuto: kInProduct on a device, kSeparate on the
// CPU.
enum class OrthoSums { kAuto, kSeparate, kInProduct };
// The orthogonalization of a batch of matrices (..., rows, cols), exposed for tests.
at::Tensor orthogonalize(const at::Tensor& g, Orthogonalizer which, int steps, bool bf16,
                         OrthoSums sums = OrthoSums::kAuto);
}  // namespace detail

}  // namespace megacpp::trainer
