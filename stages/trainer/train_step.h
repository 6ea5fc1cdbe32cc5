// megacpp::trainer train step — model, optimizers and one training step (forward, loss,
// backward, clipping, the hybrid DistMuon + DistAdamW optimizer of optim.h) for one rank, and
// that rank's share of a checkpoint snapshot.
//
// Used by the rank process (megacpp-trainer) and, unchanged, by an in-process benchmark
// loop: TrainStep knows nothing about rings, control sockets or journals. Everything runs in
// float32 on the CPU or on one CUDA device. Collectives go through a c10d Backend
// (ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA); without one the step is single-process
// and issues no collective. Batches arrive on the CPU and are copied to the device by step().
//
// Contract: construction and step() are collectives when a process group is given (they block
// until every rank takes part; a peer's failure or a transport timeout surfaces as
// Error{kPeerFailure} / Error{kTimeout} or a c10::Error). Invalid input throws
// Error{kInvalidArgument}. One owner thread; the object lives as long as the rank's loop.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "checkpoint/reader.h"
#include "recipes/recipe.h"
#include "schemas/common.capnp.h"
#include "schemas/launch.capnp.h"
#include "stages/trainer/model.h"
#include "stages/trainer/optim.h"
#include "stages/trainer/snapshot_copy.h"
#include "stages/trainer/snapshot_layout.h"
#include "stages/trainer/staged_snapshot.h"
#include "stages/trainer/tensor_parallel.h"

namespace megacpp::trainer {

// The recipe's own types (recipes/recipe.h), so a recipe, a launch spec and a test all build
// the same TrainStep.
using TrainConfig = recipe::TrainConfig;
using OptimConfig = recipe::OptimConfig;

using recipe::train_config;

// Widens one batch slot (recipes/batch_spec.h: header, then uint16 or uint32 tokens) into a
// [batch, seq_len + 1] int64 tensor, after checking the header against `spec` and `step`: a
// fresh one, or `into` when given (contiguous int64 of that shape, e.g. a page-locked buffer
// reused every step). The tensor owns its memory: the slot may be released as soon as this
// returns. Throws Error{kProtocol} naming the field that does not match.
at::Tensor widen_batch(std::span<const std::byte> slot, const recipe::BatchSpec& spec,
                       uint64_t step, recipe::BatchHeader* header = nullptr, at::Tensor into = {});

// The LR schedule's factor for 1-based `step` of `total_steps` (every [optim] learning rate is
// multiplied by it): linear warmup from 0 to 1 over warmup_steps, then cosine from 1 down to
// min_lr_ratio at total_steps.
double lr_scale(const TrainConfig& train, uint32_t step, uint32_t total_steps);

// ---------------------------------------------------------------------------------------
// One training step.

struct StepTiming {
  float loss = 0;  // mean cross-entropy of this rank's batch, before the update
  // MoE models: the weighted load-balancing loss added to the cross-entropy for backward (0
  // without MoE), and per MoE layer the token assignments each expert received on this rank
  // (under tensor parallelism: each expert this rank runs; 0 for its group's other experts,
  // so the counts add up over the ranks of a job).
  float aux_loss = 0;
  std::vector<std::vector<int64_t>> tokens_per_expert;
  double grad_norm = 0;        // L2 norm of this rank's own gradient, before clipping
  double lr_scale = 0;         // the schedule's factor applied to every learning rate this step
  double forward_seconds = 0;  // forward + loss
  double backward_seconds = 0;
  // Clipping + DistAdamW::step + DistMuon::step, their collectives (has-grad masks,
  // all-reduce / reduce-scatter / all-gather of gradients and parameters) included.
  double optimizer_seconds = 0;
  // Parts of optimizer_seconds: the gradient norm and clipping, and both optimizers' phases
  // summed (the rest of optimizer_seconds is the schedule's scalar updates).
  double clip_seconds = 0;
  OptimizerPhaseTimes optimizer_phases;
  // StepHooks::stop_requested's agreement: set when the hook was asked.
  std::optional<bool> stop_agreed;
  // Whether this rank's loss or gradient norm is non-finite (NaN or infinite).
  bool nonfinite = false;
  // The data-parallel ranks whose loss or gradient norm was non-finite this step, the same
  // list on every rank: agreed in the step's gradient exchange (so no rank commits a step
  // that diverged anywhere). Unset under tensor parallelism, whose agreement spans two groups:
  // call any_rank(nonfinite) then.
  std::optional<std::vector<uint32_t>> nonfinite_ranks;
};

// Optional callbacks into the caller, invoked on the calling thread.
struct StepHooks {
  // Called with FORWARD, BACKWARD and OPTIMIZER as each part begins.
  std::function<void(schema::Phase)> on_phase;
  // Called once backward is done: from then on the step holds no reference to `tokens`,
  // so the caller may recycle the memory behind it (e.g. release a ring slot).
  std::function<void()> after_backward;
  // Asked once per step, during the optimizer phase: whether this rank wants to stop after
  // this step. Its answer rides in the step's gradient exchange and every rank's comes back
  // as StepTiming::stop_agreed (any rank's true: true), the same on every rank; the
  // agreement any_rank() would make, without a collective of its own. Not asked under
  // tensor parallelism, whose agreement spans two groups: call any_rank() then.
  std::function<bool()> stop_requested;
  // Test hook (MEGACPP_FAULT action nan): asked once backward is done; true makes this rank's
  // gradients NaN before clipping, as an overflow would.
  std::function<bool()> poison_gradients;
  // Called once per step, after backward and before the step changes any parameter or
  // optimizer state: a SnapshotCopy still reading that state must
  // finish here.
  std::function<void()> before_update;
};

// Which optimizer steps a parameter, and in which group.
struct ParamAssignment {
  std::string name;       // model parameter name
  std::string optimizer;  // "muon" or "adamw"
  std::string group;      // muon: "qkv" | "matrices"; adamw: "embed" | "head" | "other"
  bool sharded = false;   // adamw: reduce-scatter + all-gather (else all-reduce); muon: true
};

// Model, optimizers and the step, for one rank. Not thread-safe; not copyable or movable.
//
// Construction initialises the model from train.seed (identical on every rank), then, with
// a process group, broadcasts rank 0's parameters (a collective: every rank must construct
// its TrainStep). `pg` is kept for the object's lifetime; nullptr means one process.
// Optimizers (train.optim): DistMuon takes the blocks' 2-D matrices, the fused qkv
// projections in their own group (split into q, k, v when optim.qkv_split); DistAdamW takes
// the embedding, the head and every other parameter, one group each. The gradients are not
// all-reduced by the step itself: each optimizer reduces (or reduce-scatters) what it owns.
// Clipping (train.grad_clip) scales this rank's gradient by its own norm before that
// reduction, so it needs no extra collective.
class TrainStep {
 public:
  // `device`: where the model, its gradients and the optimizer state live (CPU, or a CUDA
  // device whose backend is loaded, with `pg` a group on that device). The model is
  // initialised on the CPU from train.seed and then moved, so every device starts from the
  // same parameters.
  // `tp` (size > 1): the ranks of a tensor-parallel group that train on the same batch
  // (tensor_parallel.h); `pg` is then the data-parallel group across such groups (null for
  // one group), over which the optimizers reduce. Rank r of the job is data-parallel rank
  // r / tp.size and tensor-parallel rank r % tp.size (groups of consecutive ranks); the
  // parameters are broadcast over both groups, then cut to this rank's weight shards
  // (shard_model), and DistMuon steps the matrices whole over tp.job (every rank of the job;
  // required when there is more than one group).
  // `kernels`: the device's fused optimizer kernels (a CUDA rank's from its plugin:
  // cuda_plugin.h CudaPlugin::optim_kernels); empty: torch's operations.
  TrainStep(const ModelConfig& model, const TrainConfig& train, uint32_t total_steps,
            c10::intrusive_ptr<c10d::Backend> pg = {}, at::Device device = at::kCPU,
            TensorParallel tp = {}, OptimKernels kernels = {});
  ~TrainStep();
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  // tokens: int64 [batch, T + 1] (T <= seq_len), any strides; inputs are tokens[:, :T] and
  // targets tokens[:, 1:]. `step_index` is 1-based and drives the LR schedule. With a
  // process group this is a collective: all ranks call it with the same step_index.
  // Throws Error{kInvalidArgument} on a wrong dtype/shape; c10::Error from torch/Gloo
  // (e.g. a collective timeout) propagates.
  StepTiming step(const at::Tensor& tokens, uint32_t step_index, const StepHooks& hooks = {});

  // Held-out evaluation (README.md "Validation loss"): the cross-entropy of `tokens` (int64 [B,
  // T + 1], as step() takes) summed over its B x T targets in float32, and B x T, computed
  // without gradients in the training precision. Changes no parameter, gradient, optimizer
  // state or anything step() reads, so the next step() is bit-identical to one without it.
  // Under tensor parallelism a collective of the group (every rank passes the same batch) and
  // the sum is the group's; otherwise not a collective. Throws as step().
  struct EvalSum {
    double loss_sum = 0;
    double tokens = 0;
  };
  EvalSum evaluate(const at::Tensor& tokens);
  // `local` summed over the data-parallel ranks (a collective of two float64s every rank calls
  // at the same point; without a process group, `local`): under tensor parallelism every rank
  // of a group passes its group's sum and gets the job's.
  EvalSum sum_over_data_ranks(EvalSum local);

  // This rank's place in the job (the snapshot plane's rank and world): data-parallel rank x
  // tp.size + tensor-parallel rank, of data-parallel world x tp.size.
  uint32_t rank() const noexcept;
  uint32_t world() const noexcept;
  uint32_t total_steps() const noexcept;
  const ModelConfig& model_config() const noexcept;
  const TrainConfig& train_config() const noexcept;
  Transformer& model() noexcept;
  // (name, tensor) in registration order; the tensors alias the live parameters.
  std::vector<NamedTensor> parameters() const;

  std::vector<ParamAssignment> assignment() const;  // in parameter order

  // True when `local` is true on any rank: a collective of one int32 (MAX all-reduce over the
  // data-parallel group, then over the tensor-parallel group, which reaches every rank) that
  // every rank calls at the same point of the same step; without a process group, `local`.
  // A graceful stop is agreed this way, so every rank checkpoints the same step.
  bool any_rank(bool local);

  // The first entry of snapshot_share() holding a NaN or an infinity, or nullopt when every one
  // is finite. One pass over the state (a device sync on a GPU): asked before each snapshot, so
  // no checkpoint with a non-finite tensor is committed.
  std::optional<std::string> first_nonfinite_state() const;

  // This rank's share of state, in a fixed order. The replicated writer (rank 0, or
  // set_replicated_rank's): "model.<name>" for every parameter held whole, then every
  // optimizer entry held replicated (the same on every rank). Under tensor parallelism each
  // rank of the replicated writer's group also writes its blocks of the split matrices,
  // "model.<name>.tp<t>.<k>" (a block of rows, or of columns: "dim": 1), and "model.<name>" of
  // the routed experts it runs; DistAdamW's entries come from tensor-parallel rank 0 only
  // (its state is the same on every rank of a group), DistMuon's from every rank of the job
  // (stacks of whole matrices, "master" their whole values). The replicated entries:
  // "optim.adamw.<param>.{exp_avg,exp_avg_sq,step}" of all-reduced parameters and the groups'
  // scalars "optim.{adamw,muon}.<group>.{lr,...}". Every rank: the slices it owns, suffixed
  // ".shard<rank>": "optim.adamw.<param>.{exp_avg,exp_avg_sq}.shard<r>" (rows [offset, offset +
  // rows) of the parameter's state) and
  // "optim.muon.<group>.<rows>x<cols>.{momentum,second_momentum}.shard<r>" (entries of a
  // stack of same-shape matrices; rows past the stack length are padding).
  // snapshot_metadata() says how to reassemble them. Names are unique across the ranks of a
  // world, and names, shapes and sizes never change over a run (state exists, zero, from
  // construction). The tensors alias live parameters and optimizer state.
  std::vector<NamedTensor> snapshot_share() const;
  // Which job rank's share holds the replicated entries (default 0). A job across nodes names
  // each node's first rank, so every node's part of a checkpoint holds all its ranks resume
  // from (the replicated state once per node). Before the first snapshot_share().
  void set_replicated_rank(uint32_t job_rank) noexcept;
  SnapshotLayout snapshot_layout() const;
  // JSON, the same on every rank but for "rank": {"format": "megacpp.snapshot.v1", "rank",
  // "world" (rank() and world()), "shards": {<entry>: {"logical": <name without .shard<r>>,
  // "full_shape": [...], "offset": <first row>, "dim": 1 for a block of columns}},
  // "muon_stacks": {"optim.muon.<group>.<r>x<c>": [<param>, ...]}}.
  std::string snapshot_metadata() const;
  // Copies this rank's share into `region` per snapshot_layout() and returns that layout,
  // with streaming stores (ops::stream_copy) that are fenced before it returns, so a stamp
  // stored after it is seen after the bytes. Throws Error{kInvalidArgument} if the region
  // is smaller than layout.total_bytes.
  SnapshotLayout copy_snapshot(std::span<std::byte> region) const;
  // The same copy, started: fills `*layout`, copies what lies on a device now (torch
  // synchronizes with it) and returns the copy of the host tensors running on its own thread.
  // Until the returned copy's wait() returns, nothing may change parameters or optimizer state
  // (SnapshotCopy; StepHooks::before_update is where step() would). Throws as copy_snapshot.
  SnapshotCopy start_snapshot_copy(std::span<std::byte> region, SnapshotLayout* layout) const;
  // The same copy into an exported staging buffer (staged_snapshot.h): fills `*layout`, issues
  // the copy into `target`, sealed `step` (StagingTarget::copy_async), and returns; the returned
  // copy's wait() orders later changes of the share after it (target.order_after_copy()), and
  // keeps what the copy reads alive until then. A tensor on another device than the target
  // expects is copied now through torch. Throws Error{kInvalidArgument} if the target is smaller
  // than the layout.
  SnapshotCopy start_staged_copy(StagingTarget& target, uint64_t step,
                                 SnapshotLayout* layout) const;

  // Loads the parameters and this rank's optimizer state (moments, step counts, group
  // scalars) from a committed checkpoint: afterwards the next step() is bit-identical to
  // the one the checkpointed run took after the checkpoint's step. The checkpoint may come
  // from another world size: every entry is cut from the logical tensor the rank files
  // reassemble, whichever ranks held it (a DistAdamW parameter sharded there and replicated
  // here, a Muon stack padded differently). Not a collective: every rank reads the files.
  // Throws Error{kInvalidArgument} naming the tensor when the checkpoint does not fit this
  // model and optimizer (missing, another shape or dtype), Error{kCorruption} as the reader.
  void restore(const checkpoint::CheckpointReader& ckpt);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megacpp::trainer
