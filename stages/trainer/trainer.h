// megacpp::trainer — the model, one training step (forward, loss, backward, clipping, the
// hybrid DistMuon + DistAdamW optimizer of optim.h), this rank's share of a checkpoint
// snapshot, and the rank's side of the snapshot plane.
//
// Used by the rank process (megacpp-trainer) and, unchanged, by an in-process benchmark
// loop: TrainStep knows nothing about rings, control sockets or journals. Everything runs on
// CPU in float32. Collectives go through a c10d Backend (ProcessGroupGloo on CPU); without
// one the step is single-process and issues no collective.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "ipc/channel.h"
#include "ipc/shm.h"
#include "recipes/recipe.h"
#include "schemas/common.capnp.h"
#include "schemas/control.capnp.h"
#include "schemas/launch.capnp.h"

namespace megacpp::trainer {

// ---------------------------------------------------------------------------------------
// Configuration: the recipe's own types (recipes/recipe.h), so a recipe, a launch spec and a
// test all build the same TrainStep.

using ModelConfig = recipe::ModelConfig;
using TrainConfig = recipe::TrainConfig;
using OptimConfig = recipe::OptimConfig;

ModelConfig model_config(schema::ModelSpec::Reader spec);
TrainConfig train_config(schema::TrainSpec::Reader spec);
// Throws Error{kInvalidArgument} naming the rule: every size > 0, d_model % n_heads == 0,
// an even head dimension (RoPE rotates pairs).
void validate(const ModelConfig& model);

// The LR schedule's factor for 1-based `step` of `total_steps` (every [optim] learning rate is
// multiplied by it): linear warmup from 0 to 1 over warmup_steps, then cosine from 1 down to
// min_lr_ratio at total_steps.
double lr_scale(const TrainConfig& train, uint32_t step, uint32_t total_steps);

// ---------------------------------------------------------------------------------------
// Model: decoder-only transformer. Embedding -> RMSNorm -> n_layers x [x + attn(norm(x)),
// x + mlp(norm(x))] -> RMSNorm -> untied head. Attention: fused QKV, QK-norm, RoPE, causal
// SDPA. MLP: relu(x)^2, hidden = mlp_mult * d_model. RMSNorm carries no weight. No biases.
// Parameter names: embed.weight, blocks.<i>.attn.qkv.weight, blocks.<i>.attn.proj.weight,
// blocks.<i>.mlp.fc.weight, blocks.<i>.mlp.proj.weight, head.weight.

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const ModelConfig& config);
  // x: [B, T, D]; cos, sin: [T, head_dim / 2].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear proj{nullptr};

 private:
  int64_t n_heads_;
  int64_t head_dim_;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const ModelConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear fc{nullptr};
  torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const ModelConfig& config);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  Attention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

class TransformerImpl : public torch::nn::Module {
 public:
  // Parameters are initialised deterministically from `seed` with a private generator
  // (the global torch RNG is neither read nor changed): same seed, same weights.
  TransformerImpl(const ModelConfig& config, uint32_t seed);
  // tokens: int64 [B, T] with T <= seq_len (any strides); returns float logits [B, T, V].
  at::Tensor forward(const at::Tensor& tokens);
  const ModelConfig& config() const noexcept { return config_; }

  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  ModelConfig config_;
  at::Tensor rope_cos_;  // [seq_len, head_dim / 2]
  at::Tensor rope_sin_;
};
TORCH_MODULE(Transformer);

// ---------------------------------------------------------------------------------------
// One training step.

struct StepTiming {
  float loss = 0;              // mean cross-entropy of this rank's batch, before the update
  double grad_norm = 0;        // L2 norm of this rank's own gradient, before clipping
  double lr_scale = 0;         // the schedule's factor applied to every learning rate this step
  double forward_seconds = 0;  // forward + loss
  double backward_seconds = 0;
  // Clipping + DistAdamW::step + DistMuon::step, their collectives (has-grad masks,
  // all-reduce / reduce-scatter / all-gather of gradients and parameters) included.
  double optimizer_seconds = 0;
};

// Optional callbacks into the caller, invoked on the calling thread.
struct StepHooks {
  // Called with FORWARD, BACKWARD and OPTIMIZER as each part begins.
  std::function<void(schema::Phase)> on_phase;
  // Called once backward is done: from then on the step holds no reference to `tokens`,
  // so the caller may recycle the memory behind it (e.g. release a ring slot).
  std::function<void()> after_backward;
};

using NamedTensor = std::pair<std::string, at::Tensor>;

// One entry of a snapshot share: where a tensor lies in the staging region.
struct SnapshotEntry {
  std::string name;
  std::string dtype;  // safetensors dtype name: F32, I64, ...
  std::vector<uint64_t> shape;
  uint64_t offset = 0;  // from the region start, a multiple of kSnapshotAlignment
  uint64_t bytes = 0;
};

struct SnapshotLayout {
  std::vector<SnapshotEntry> entries;
  uint64_t total_bytes = 0;  // end of the last entry, rounded up to kSnapshotAlignment
};

inline constexpr uint64_t kSnapshotAlignment = 64;

// Safetensors dtype name of a torch dtype; throws Error{kInvalidArgument} for others.
std::string safetensors_dtype(at::ScalarType type);
// Packs `tensors` in order at kSnapshotAlignment-aligned offsets.
SnapshotLayout layout_of(const std::vector<NamedTensor>& tensors);
// Writes `layout` into `out`, which must have exactly layout.entries.size() elements.
void fill_tensor_entries(const SnapshotLayout& layout,
                         capnp::List<schema::TensorEntry>::Builder out);

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
  TrainStep(const ModelConfig& model, const TrainConfig& train, uint32_t total_steps,
            c10::intrusive_ptr<c10d::Backend> pg = {});
  ~TrainStep();
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  // tokens: int64 [batch, T + 1] (T <= seq_len), any strides; inputs are tokens[:, :T] and
  // targets tokens[:, 1:]. `step_index` is 1-based and drives the LR schedule. With a
  // process group this is a collective: all ranks call it with the same step_index.
  // Throws Error{kInvalidArgument} on a wrong dtype/shape; c10::Error from torch/Gloo
  // (e.g. a collective timeout) propagates.
  StepTiming step(const at::Tensor& tokens, uint32_t step_index, const StepHooks& hooks = {});

  uint32_t rank() const noexcept;
  uint32_t world() const noexcept;
  uint32_t total_steps() const noexcept;
  const ModelConfig& model_config() const noexcept;
  const TrainConfig& train_config() const noexcept;
  Transformer& model() noexcept;
  // (name, tensor) in registration order; the tensors alias the live parameters.
  std::vector<NamedTensor> parameters() const;

  std::vector<ParamAssignment> assignment() const;  // in parameter order

  // This rank's share of state, in a fixed order. Rank 0: "model.<name>" for every
  // parameter, then every optimizer entry held replicated (the same on every rank):
  // "optim.adamw.<param>.{exp_avg,exp_avg_sq,step}" of all-reduced parameters and the
  // groups' scalars "optim.{adamw,muon}.<group>.{lr,...}". Every rank: the slices it owns,
  // suffixed ".shard<rank>": "optim.adamw.<param>.{exp_avg,exp_avg_sq}.shard<r>" (rows
  // [offset, offset + rows) of the parameter's state) and
  // "optim.muon.<group>.<rows>x<cols>.{momentum,second_momentum}.shard<r>" (entries of a
  // stack of same-shape matrices; rows past the stack length are padding).
  // snapshot_metadata() says how to reassemble them. Names are unique across the ranks of a
  // world, and names, shapes and sizes never change over a run (state exists, zero, from
  // construction). The tensors alias live parameters and optimizer state.
  std::vector<NamedTensor> snapshot_share() const;
  SnapshotLayout snapshot_layout() const;
  // JSON, the same on every rank but for "rank": {"format": "megacpp.snapshot.v1", "rank",
  // "world", "shards": {<entry>: {"logical": <name without .shard<r>>, "full_shape": [...],
  // "offset": <first row>}}, "muon_stacks": {"optim.muon.<group>.<r>x<c>": [<param>, ...]}}.
  std::string snapshot_metadata() const;
  // Copies this rank's share into `region` per snapshot_layout() and returns that layout.
  // Throws Error{kInvalidArgument} if the region is smaller than layout.total_bytes.
  SnapshotLayout copy_snapshot(std::span<std::byte> region) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------------------
// Rendezvous: a TCPStore client at host:port (the server is hosted elsewhere, e.g. by the
// supervisor) and a ProcessGroupGloo over it. Blocks until all `world` ranks joined or
// store_timeout passed (then c10::Error / c10d exceptions propagate). Collectives on the
// returned group time out after collective_timeout.
struct GlooOptions {
  std::string store_host = "127.0.0.1";
  uint16_t store_port = 0;
  uint32_t rank = 0;
  uint32_t world = 1;
  std::chrono::milliseconds store_timeout{60'000};
  std::chrono::milliseconds collective_timeout{300'000};
  std::string device_hostname = "127.0.0.1";  // the interface Gloo's TCP transport binds
  // Keys of this group live under this prefix in the store (e.g. one per run generation),
  // so a store shared by several groups or generations never mixes their rendezvous.
  std::string store_prefix;
};
c10::intrusive_ptr<c10d::Backend> connect_gloo(const GlooOptions& options);

// A TCPStore server on 127.0.0.1 at a port the kernel picks (read it with getPort()), for
// a process that forks its own ranks (tests, the stress harness, benchmarks); `timeout`
// bounds every store operation. Throws c10::Error (c10d's) when it cannot listen.
c10::intrusive_ptr<c10d::TCPStore> host_local_store(std::chrono::milliseconds timeout);

// ---------------------------------------------------------------------------------------
// The rank's side of the snapshot plane (DESIGN.md "Decisions": snapshot ownership): one staging
// region, created at the first snapshot and unlinked with this object, leased to the checkpointer
// from a SnapshotReady until the SnapshotAck{ok} of that step.
//
// Surviving a checkpointer restart: the checkpointer may die and be relaunched under the
// same identity and endpoint, discarding what it had not committed. While this rank needs an
// ack — the lease of its last snapshot, or the commit of its final one — it re-sends that
// snapshot's SnapshotReady every resend_interval; the staging region still holds exactly
// that snapshot (it is leased, or it is the final one and never overwritten). The
// checkpointer treats a duplicate as idempotent. Acks are matched by step: an ack for any
// other step neither releases the lease nor fails the rank. SnapshotAck{ok=false} for the
// pending step (the checkpointer failed and goes down) is logged and waited out: a relaunched
// checkpointer gets the re-sent snapshot, and the supervisor handles one that stays dead.
// Every wait is bounded by lease_timeout / commit_timeout.
struct SnapshotPlaneOptions {
  std::string endpoint;     // the checkpointer's ROUTER
  std::string identity;     // this rank's DEALER routing identity ("trainer-<rank>")
  std::string peer_name;    // names the checkpointer in errors ("checkpointer-0")
  std::string region_name;  // the staging shm segment (created here; must not exist)
  std::chrono::milliseconds lease_timeout{60'000};
  std::chrono::milliseconds commit_timeout{120'000};
  std::chrono::milliseconds resend_interval{2'000};
  // Polled while waiting; when it returns true the wait gives up. May be empty.
  std::function<bool()> stop_requested;
};

// Not thread-safe: one owner (the rank's loop). Keeps a reference to `ts` and `zmq`.
class SnapshotPlane {
 public:
  SnapshotPlane(ipc::ZmqContext& zmq, const TrainStep& ts, SnapshotPlaneOptions options);
  ~SnapshotPlane();
  SnapshotPlane(const SnapshotPlane&) = delete;
  SnapshotPlane& operator=(const SnapshotPlane&) = delete;

  // Handles every ack already queued and re-sends the pending SnapshotReady when one is
  // needed and due. Never blocks.
  void poll();
  // Waits for the lease of the previous snapshot (re-sending it), copies this rank's share
  // into staging and sends SnapshotReady of `step`. Returns false (nothing sent) when a
  // stop was requested while waiting. Throws Error{kTimeout} when the lease is not released
  // within lease_timeout, Error{kPeerFailure} when the message cannot even be queued.
  bool take(uint32_t step, bool final);
  // Waits for SnapshotAck{committed} of a step >= `step`, re-sending the last snapshot.
  // Returns false on a stop request; throws Error{kTimeout} after commit_timeout.
  bool wait_committed(uint32_t step);

  // The step whose staging lease is still held; the newest step acked as committed; the
  // number of duplicate SnapshotReady messages sent so far.
  std::optional<uint32_t> leased() const noexcept { return leased_; }
  std::optional<uint32_t> committed() const noexcept { return committed_; }
  uint64_t resends() const noexcept { return resends_; }

 private:
  template <typename Pred>
  bool wait_for(Pred done, std::chrono::milliseconds timeout);
  bool needs_ack() const;
  void resend_if_due();
  void handle(ipc::Received& msg);
  std::string last_error_note() const;

  const TrainStep& ts_;
  SnapshotPlaneOptions options_;
  ipc::Channel channel_;
  std::unique_ptr<ipc::ShmRegion> region_;
  // The last SnapshotReady sent, kept for re-sending while its ack is needed.
  std::unique_ptr<ipc::ControlMessageBuilder> pending_;
  uint32_t pending_step_ = 0;
  bool pending_final_ = false;
  std::chrono::steady_clock::time_point last_send_{};
  std::optional<uint32_t> leased_;
  std::optional<uint32_t> committed_;
  std::string last_error_;  // from the last SnapshotAck{ok=false} of the pending step
  uint64_t resends_ = 0;
};

}  // namespace megacpp::trainer
