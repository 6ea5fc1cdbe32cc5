// TrainStep (step, clipping, DistAdamW + DistMuon), its configuration from the launch spec,
// the LR schedule, and snapshot shares.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numbers>
#include <string_view>
#include <system_error>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/util.h"
#include "ops/ops.h"
#include "stages/trainer/collective.h"
#include "stages/trainer/optim.h"
#include "stages/trainer/tensor_parallel.h"
#include "stages/trainer/train_step.h"

namespace megacpp::trainer {

namespace {

// After a host read of what the step's collectives made, before it is used: NCCL reports their
// failures only there (collective.h check_async_error). The data-parallel group, the
// tensor-parallel one and the job's.
void check_groups(std::string_view what, const c10::intrusive_ptr<c10d::Backend>& pg,
                  const TensorParallel& tp) {
  for (const auto* g : {&pg, &tp.group, &tp.job}) check_async_error(what, *g);
}

using Clock = std::chrono::steady_clock;

// The largest DistAdamW bucket that rides in DistMuon's exchange at a world above 2.
constexpr int64_t kRiderMaxNumel = int64_t{1} << 20;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The L2 norm of non-empty gradients together, a 0-D float32 tensor on their device, computed
// in float32 whatever their dtype (bf16-mixed: bfloat16 gradients).
at::Tensor norm_of(const std::vector<at::Tensor>& g) {
  return torch::stack(g.front().scalar_type() == at::kFloat
                          ? torch::_foreach_norm(g)
                          : torch::_foreach_norm(g, 2, at::kFloat))
      .norm();
}

}  // namespace

double lr_scale(const TrainConfig& t, uint32_t step, uint32_t total_steps) {
  if (t.warmup_steps > 0 && step <= t.warmup_steps) {
    return static_cast<double>(step) / static_cast<double>(t.warmup_steps);
  }
  double progress = 1.0;
  if (total_steps > t.warmup_steps) {
    progress = static_cast<double>(step - std::min(step, t.warmup_steps)) /
               static_cast<double>(total_steps - t.warmup_steps);
  }
  progress = std::clamp(progress, 0.0, 1.0);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine;
}

struct TrainStep::Impl {
  ModelConfig model_cfg;
  TrainConfig train_cfg;
  uint32_t total_steps;
  c10::intrusive_ptr<c10d::Backend> pg;
  at::Device device;
  TensorParallel tp;  // outlives every graph step() builds (tensor_parallel.h)
  OptimKernels kernels;
  uint32_t rank = 0;  // in the data-parallel group `pg`
  uint32_t world = 1;
  uint32_t layout_rank = 0;      // in the job: rank * tp.size + tp.rank
  uint32_t replicated_rank = 0;  // the job rank whose share holds the replicated state
  uint32_t layout_world = 1;
  Transformer model;
  std::vector<NamedTensor> params;  // registration order; alias the live parameters
  std::vector<ParamAssignment> assignment;
  // Parameter names in each optimizer's flattened order (DistAdamW: groups in order, then
  // parameters; DistMuon: per group, the given order) with the groups' labels and base LRs.
  std::vector<std::string> adam_names;
  std::vector<std::string> adam_group_labels;
  std::vector<double> adam_base_lr;
  int64_t adam_numel = 0;  // DistAdamW's parameters' elements
  std::vector<std::vector<std::string>> muon_names;
  std::vector<std::string> muon_group_labels;
  std::unique_ptr<DistAdamW> adamw;
  std::unique_ptr<DistMuon> muon;
  // Tensor-parallel weight shards (shard_model): by parameter name, the part of its matrix this
  // rank holds; parameters not named are whole on every rank.
  std::map<std::string, MatrixPart> parts;

  Impl(const ModelConfig& m, const TrainConfig& t, uint32_t steps,
       c10::intrusive_ptr<c10d::Backend> group, at::Device dev, TensorParallel tensor_parallel,
       OptimKernels optim_kernels)
      : model_cfg(m),
        train_cfg(t),
        total_steps(steps),
        pg(std::move(group)),
        device(dev),
        tp(std::move(tensor_parallel)),
        kernels(std::move(optim_kernels)),
        model(m, t.seed) {
    MEGACPP_CHECK(t.batch_size > 0, ErrorKind::kInvalidArgument, "train: batchSize must be > 0");
    MEGACPP_CHECK(steps > 0, ErrorKind::kInvalidArgument, "total steps must be > 0");
    if (pg) {
      rank = static_cast<uint32_t>(pg->getRank());
      world = static_cast<uint32_t>(pg->getSize());
    }
    MEGACPP_CHECK(
        tp.size >= 1 && tp.rank < tp.size &&
            (tp.size == 1 || (tp.group && tp.group->getSize() == static_cast<int>(tp.size) &&
                              tp.group->getRank() == static_cast<int>(tp.rank))),
        ErrorKind::kInvalidArgument,
        fmt::format("tensor-parallel rank {} of {} does not match its group", tp.rank, tp.size));
    model->set_recompute(recipe::recompute_mode(t.recompute));
    layout_rank = rank * tp.size + tp.rank;
    layout_world = world * tp.size;
    if (tp.size > 1) {
      const auto job_size = static_cast<int>(world * tp.size);
      MEGACPP_CHECK(!tp.job || (tp.job->getSize() == job_size &&
                                tp.job->getRank() == static_cast<int>(layout_rank)),
                    ErrorKind::kInvalidArgument,
                    fmt::format("the job group is rank {} of {}, expected {} of {}",
                                tp.job ? tp.job->getRank() : -1, tp.job ? tp.job->getSize() : 0,
                                layout_rank, job_size));
      MEGACPP_CHECK(tp.job || world == 1, ErrorKind::kInvalidArgument,
                    "tensor parallelism across data-parallel replicas needs the job's group");
    }
    if (!device.is_cpu()) model->to(device);
    for (auto& item : model->named_parameters()) params.emplace_back(item.key(), item.value());
    if (pg && world > 1) broadcast_parameters(pg);
    if (tp.size > 1) broadcast_parameters(tp.group);
    // The whole float32 values the optimizers' own copies start from: bf16-mixed's masters,
    // and under tensor parallelism DistMuon's whole copies of the matrices it owns. No copy:
    // shard_model and the cast give the parameters new storage (Tensor::set_data), the
    // detached tensors keep the whole float32 one until the optimizers have copied theirs.
    std::map<std::string, at::Tensor> whole;
    if (t.bf16_mixed() || tp.size > 1) {
      for (const auto& [name, p] : params) whole.emplace(name, p.detach());
    }
    if (tp.size > 1) parts = shard_model(*model, tp);
    if (t.bf16_mixed()) model->to(at::kBFloat16);
    params.clear();
    for (auto& item : model->named_parameters()) params.emplace_back(item.key(), item.value());
    build_optimizers(whole, t.bf16_mixed());
  }

  // `whole`: by parameter name, the float32 values the optimizers' own copies start from
  // (master weights when `mixed`, DistMuon's whole matrices under tensor parallelism).
  void build_optimizers(const std::map<std::string, at::Tensor>& whole, bool mixed) {
    const OptimConfig& o = train_cfg.optim;
    std::optional<at::ScalarType> reduce;
    if (mixed) reduce = train_cfg.grad_reduce == "bf16" ? at::kBFloat16 : at::kFloat;
    // Fixed group order on every rank: it is the collective order.
    const std::array<std::pair<const char*, double>, 3> adam_groups{
        {{"embed", o.embed_lr}, {"head", o.head_lr}, {"other", o.adam_lr}}};
    const std::array<const char*, 2> muon_groups{"qkv", "matrices"};
    std::map<std::string, std::vector<size_t>> members;  // group label -> param indices
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, p] = params[i];
      ParamAssignment a;
      a.name = name;
      if (name == "embed.weight") {
        a.optimizer = "adamw", a.group = "embed";
      } else if (name == "head.weight") {
        a.optimizer = "adamw", a.group = "head";
      } else if (name.starts_with("blocks.") && p.dim() == 2 && !name.ends_with(".router.weight")) {
        // Every 2-D matrix of a block, each expert's own included; the router, norms, SSM
        // scalars (A_log, D, dt_bias), conv weights and biases go to DistAdamW.
        a.optimizer = "muon";
        a.group = o.qkv_split && name.ends_with(".attn.qkv.weight") ? "qkv" : "matrices";
        a.sharded = true;
      } else {
        a.optimizer = "adamw", a.group = "other";
      }
      members[a.optimizer + "." + a.group].push_back(i);
      assignment.push_back(std::move(a));
    }
    std::vector<AdamWParamGroup> ag;
    std::vector<size_t> adam_index;  // flattened DistAdamW index -> parameter index
    for (const auto& [label, lr] : adam_groups) {
      const auto it = members.find(std::string("adamw.") + label);
      if (it == members.end()) continue;
      AdamWParamGroup g{.lr = lr,
                        .beta1 = o.adam_beta1,
                        .beta2 = o.adam_beta2,
                        .eps = o.adam_eps,
                        .weight_decay = o.adam_weight_decay};
      for (size_t i : it->second) {
        g.params.push_back(params[i].second);
        if (mixed) g.masters.push_back(whole.at(params[i].first));
        adam_names.push_back(params[i].first);
        adam_index.push_back(i);
      }
      adam_group_labels.emplace_back(label);
      adam_base_lr.push_back(lr);
      ag.push_back(std::move(g));
    }
    for (const auto& g : ag)
      for (const auto& p : g.params) adam_numel += p.numel();
    adamw = std::make_unique<DistAdamW>(std::move(ag), pg,
                                        DistAdamWOptions{.crossover_numel = o.adamw_crossover,
                                                         .master_weights = mixed,
                                                         .reduce_dtype = reduce,
                                                         .fused_update = kernels.adamw_step});
    for (size_t k = 0; k < adam_index.size(); ++k)
      assignment[adam_index[k]].sharded = adamw->is_sharded(k);

    const int64_t q_rows = int64_t{model_cfg.n_heads} * model_cfg.head_dim();
    const int64_t kv_rows = int64_t{model_cfg.kv_heads()} * model_cfg.head_dim();
    std::vector<MuonParamGroup> mg;
    for (const char* label : muon_groups) {
      const auto it = members.find(std::string("muon.") + label);
      if (it == members.end()) continue;
      MuonParamGroup g{.lr = o.muon_lr,
                       .momentum = o.muon_momentum,
                       .beta2 = o.muon_beta2,
                       .weight_decay = o.muon_weight_decay};
      if (std::string_view(label) == "qkv") g.qkv_split_sizes = {q_rows, kv_rows, kv_rows};
      std::vector<std::string> names;
      for (size_t i : it->second) {
        const auto& [name, p] = params[i];
        g.params.push_back(p);
        if (mixed || tp.size > 1) g.masters.push_back(whole.at(name));
        if (tp.size > 1) g.parts.push_back(part_of(name, p));
        names.push_back(name);
      }
      muon_names.push_back(std::move(names));
      muon_group_labels.emplace_back(label);
      mg.push_back(std::move(g));
    }
    // Under tensor parallelism every matrix is stepped whole by one rank of the job.
    muon = std::make_unique<DistMuon>(
        std::move(mg), tp.size > 1 ? (tp.job ? tp.job : tp.group) : pg,
        DistMuonOptions{.orthogonalizer = o.muon_orthogonalizer == "newton_schulz"
                                              ? Orthogonalizer::kNewtonSchulz
                                              : Orthogonalizer::kPolarExpress,
                        .ns_steps = static_cast<int>(o.muon_ns_steps),
                        .bf16_orthogonalization = o.muon_bf16,
                        .master_weights = mixed,
                        .reduce_dtype = reduce,
                        .bucket_numel = recipe::kMuonBucketNumel,
                        .replicas = tp.size > 1 ? world : 0,
                        .fused_tail = kernels.muon_tail});
  }

  // The part of `p`'s matrix this rank holds: shard_model's, or the whole (a matrix every rank
  // of the tensor-parallel group holds, its gradient summed over the group: given by one).
  MatrixPart part_of(const std::string& name, const at::Tensor& p) const {
    if (auto it = parts.find(name); it != parts.end()) return it->second;
    return MatrixPart{.full_shape = p.sizes().vec(),
                      .dim = 0,
                      .blocks = {{.full_offset = 0,
                                  .local_offset = 0,
                                  .size = p.size(0),
                                  .contributes = tp.rank == 0,
                                  .replicated = true}}};
  }

  // Every rank initialised from the same seed already; the broadcast makes rank 0's
  // parameters authoritative regardless (e.g. a torch build whose RNG stream differs). In
  // buckets of at most kBroadcastNumel elements (parameters in order, a larger one alone), so
  // the start-up holds no second copy of the whole model (nam56r: 25 GiB in float32).
  void broadcast_parameters(const c10::intrusive_ptr<c10d::Backend>& group) {
    torch::NoGradGuard no_grad;
    constexpr int64_t kBroadcastNumel = int64_t{1} << 26;
    size_t first = 0;
    while (first < params.size()) {
      size_t last = first;
      int64_t numel = 0;
      while (last < params.size() &&
             (last == first || numel + params[last].second.numel() <= kBroadcastNumel))
        numel += params[last++].second.numel();
      at::Tensor flat = torch::empty({numel}, torch::dtype(torch::kFloat32).device(device));
      int64_t off = 0;
      for (size_t i = first; i < last; ++i) {
        const at::Tensor& p = params[i].second;
        flat.narrow(0, off, p.numel()).copy_(p.reshape({-1}));
        off += p.numel();
      }
      std::vector<at::Tensor> bufs{flat};
      c10d::BroadcastOptions opts;
      opts.rootRank = 0;
      run_collective("broadcast of the parameters", group,
                     [&] { return group->broadcast(bufs, opts); });
      off = 0;
      for (size_t i = first; i < last; ++i) {
        at::Tensor& p = params[i].second;
        p.view({-1}).copy_(flat.narrow(0, off, p.numel()));
        off += p.numel();
      }
      first = last;
    }
  }

  // Sums over the tensor-parallel group what every rank of it holds: the whole parameters and
  // the blocks of split ones every rank holds (Mamba's B and C rows).
  void reduce_tensor_parallel_gradients() {
    std::vector<at::Tensor> tensors, blocks;
    tensors.reserve(params.size());
    for (auto& [name, p] : params) {
      const auto it = parts.find(name);
      if (it == parts.end()) {
        tensors.push_back(p);
        continue;
      }
      for (const auto& b : it->second.blocks) {
        if (!b.replicated) continue;
        if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
        blocks.push_back(p.grad().narrow(it->second.dim, b.local_offset, b.size));
      }
    }
    reduce_gradients(tensors, blocks, tp);
  }

  // Without tensor parallelism: the norm of every gradient (float32, 0-D, on the device) and
  // the clipping by a coefficient computed there, so nothing is read on the host; the caller
  // reads the norm with the step's other scalars. The same values as the host's clipping (as
  // grad_norm_and_clip_tensor_parallel's): the coefficient is its double-precision quotient (a
  // division, not a reciprocal), 1 where the norm is within the bound, applied as a host scalar
  // is (rounded to the gradients' dtype).
  at::Tensor grad_norm_and_clip_on_device() {
    std::vector<at::Tensor> grads;
    for (auto& [name, p] : params)
      if (p.grad().defined()) grads.push_back(p.grad());
    if (grads.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    const at::Tensor norm = norm_of(grads);
    if (train_cfg.grad_clip > 0) {
      const at::Tensor n = norm.to(at::kDouble);
      const at::Tensor clip = at::full_like(n, train_cfg.grad_clip);
      const at::Tensor coef = at::where(n > clip, clip.div(n + 1e-6), at::ones_like(n));
      // _foreach_mul_ by a host scalar rounds the scalar to the gradients' dtype first (bfloat16
      // gradients: a bfloat16 factor), so the factor goes in as that dtype, per dtype.
      std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
      for (const at::Tensor& g : grads) by_dtype[g.scalar_type()].push_back(g);
      for (auto& [dtype, group] : by_dtype) torch::_foreach_mul_(group, coef.to(dtype));
    }
    return norm;
  }

  // Under tensor parallelism (read on the host: the norm's square sums over the group): every
  // gradient, clipped together, split by what the norm sums — the whole parameters' (the same
  // on every rank of the group) and the blocks this rank contributes (summed over the group).
  double grad_norm_and_clip_tensor_parallel() {
    std::vector<at::Tensor> grads, whole, mine;
    for (auto& [name, p] : params) {
      if (!p.grad().defined()) continue;
      grads.push_back(p.grad());
      const auto it = parts.find(name);
      if (it == parts.end()) {
        whole.push_back(p.grad());
        continue;
      }
      for (const auto& b : it->second.blocks)
        if (b.contributes) mine.push_back(p.grad().narrow(it->second.dim, b.local_offset, b.size));
    }
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
    at::Tensor sq = mine.empty() ? at::zeros({}, opts) : norm_of(mine).square();
    sq = all_reduce_sum(sq, tp);
    if (!whole.empty()) sq = sq + norm_of(whole).square();
    const double norm = sq.sqrt().item<double>();
    if (grads.empty()) return norm;
    if (train_cfg.grad_clip > 0 && norm > train_cfg.grad_clip) {
      torch::_foreach_mul_(grads, train_cfg.grad_clip / (norm + 1e-6));
    }
    return norm;
  }

  // Named by the whole matrices' shape (a tensor-parallel rank's parts included).
  std::string muon_stack_name(size_t g, size_t st) const {
    const auto members = muon->stack_members(g, st);
    const std::string& first = muon_names[g][members.front()];
    for (const auto& [name, t] : params) {
      if (name != first) continue;
      const std::vector<int64_t> shape =
          parts.contains(name) ? parts.at(name).full_shape : t.sizes().vec();
      return fmt::format("optim.muon.{}.{}x{}", muon_group_labels[g], shape[0], shape[1]);
    }
    MEGACPP_FAIL(ErrorKind::kInternal, "muon stack member not found: {}", first);
  }

  // Maps an optimizer state entry to the snapshot's logical name: DistAdamW's per-parameter
  // entries to "optim.adamw.<param>.<field>", its group scalars to
  // "optim.adamw.<group>.<field>"; DistMuon's stack entries to
  // "optim.muon.<group>.<rows>x<cols>.<field>", its group scalars to
  // "optim.muon.<group>.<field>".
  std::string logical_name(bool is_adam, const StateKey& key) const {
    const std::string_view field = field_name(key.field);
    if (is_adam) {
      if (key.scope == StateScope::kParam)
        return fmt::format("optim.adamw.{}.{}", adam_names.at(key.param), field);
      return fmt::format("optim.adamw.{}.{}", adam_group_labels.at(key.group), field);
    }
    if (key.scope == StateScope::kStack)
      return fmt::format("{}.{}", muon_stack_name(key.group, key.stack), field);
    return fmt::format("optim.muon.{}.{}", muon_group_labels.at(key.group), field);
  }

  struct ShareEntry {
    std::string name;
    at::Tensor value;
    // A shard: a block of `logical` (of full_shape) along `dim` from index `offset`.
    bool sharded = false;
    std::string logical = {};
    std::vector<int64_t> full_shape = {};
    int64_t offset = 0;
    int64_t dim = 0;
  };

  // The share plus the reassembly data of its sharded entries. `views` keeps the optimizer
  // state the entries alias alive.
  std::vector<ShareEntry> share(std::array<OptimizerState, 2>& views) const {
    std::vector<ShareEntry> out;
    const bool replicated_writer = layout_rank == replicated_rank;
    // Under tensor parallelism the parts of the split matrices come from the ranks of the
    // replicated writer's group, each rank's blocks (a block every rank holds, from its rank
    // 0; a routed expert whole from the rank that runs it).
    const bool writer_group = rank == replicated_rank / tp.size;
    for (const auto& [name, p] : params) {
      const auto it = parts.find(name);
      if (it == parts.end()) {
        if (replicated_writer) out.push_back({.name = "model." + name, .value = p.detach()});
        continue;
      }
      if (!writer_group) continue;
      const MatrixPart& part = it->second;
      const int64_t full = part.full_shape[static_cast<size_t>(part.dim)];
      for (size_t k = 0; k < part.blocks.size(); ++k) {
        const MatrixPart::Block& b = part.blocks[k];
        if (b.replicated && tp.rank != 0) continue;
        const at::Tensor value = p.detach().narrow(part.dim, b.local_offset, b.size);
        if (b.size == full) {
          out.push_back({.name = "model." + name, .value = value});
          continue;
        }
        out.push_back({.name = fmt::format("model.{}.tp{}.{}", name, tp.rank, k),
                       .value = value,
                       .sharded = true,
                       .logical = "model." + name,
                       .full_shape = part.full_shape,
                       .offset = b.full_offset,
                       .dim = part.dim});
      }
    }
    views[0] = adamw->state_view();
    views[1] = muon->state_view();
    for (int k = 0; k < 2; ++k) {
      // DistAdamW's state is the same on every rank of a tensor-parallel group: its rank 0's.
      if (k == 0 && tp.rank != 0) continue;
      const uint32_t shard = k == 0 ? adamw->rank() : muon->rank();
      for (const auto& e : views[k].entries) {
        std::string logical = logical_name(k == 0, e.key);
        if (e.replicated) {
          if (replicated_writer) out.push_back({.name = logical, .value = e.value});
        } else {
          out.push_back({.name = fmt::format("{}.shard{}", logical, shard),
                         .value = e.value,
                         .sharded = true,
                         .logical = std::move(logical),
                         .full_shape = e.full_shape,
                         .offset = e.offset});
        }
      }
    }
    return out;
  }
};

TrainStep::TrainStep(const ModelConfig& model, const TrainConfig& train, uint32_t total_steps,
                     c10::intrusive_ptr<c10d::Backend> pg, at::Device device, TensorParallel tp,
                     OptimKernels kernels)
    : impl_(std::make_unique<Impl>(model, train, total_steps, std::move(pg), device, std::move(tp),
                                   std::move(kernels))) {}

TrainStep::~TrainStep() = default;

void TrainStep::set_replicated_rank(uint32_t job_rank) noexcept {
  impl_->replicated_rank = job_rank;
}

uint32_t TrainStep::rank() const noexcept {
  return impl_->layout_rank;
}
uint32_t TrainStep::world() const noexcept {
  return impl_->layout_world;
}
uint32_t TrainStep::total_steps() const noexcept {
  return impl_->total_steps;
}
const ModelConfig& TrainStep::model_config() const noexcept {
  return impl_->model_cfg;
}
const TrainConfig& TrainStep::train_config() const noexcept {
  return impl_->train_cfg;
}
Transformer& TrainStep::model() noexcept {
  return impl_->model;
}
std::vector<NamedTensor> TrainStep::parameters() const {
  return impl_->params;
}
std::vector<ParamAssignment> TrainStep::assignment() const {
  return impl_->assignment;
}

std::optional<std::string> TrainStep::first_nonfinite_state() const {
  torch::NoGradGuard no_grad;
  const auto share = snapshot_share();
  std::vector<at::Tensor> finite;
  std::vector<size_t> which;
  for (size_t i = 0; i < share.size(); ++i) {
    if (!share[i].second.is_floating_point()) continue;
    finite.push_back(torch::isfinite(share[i].second).all());
    which.push_back(i);
  }
  if (finite.empty()) return std::nullopt;
  // One read for the whole share (one synchronisation on a device, not one per tensor).
  const at::Tensor flags = torch::stack(finite).to(at::kCPU);
  check_groups("the state's finiteness check", impl_->pg, impl_->tp);
  const bool* f = flags.data_ptr<bool>();
  for (size_t k = 0; k < which.size(); ++k) {
    if (!f[k]) return share[which[k]].first;
  }
  return std::nullopt;
}

bool TrainStep::any_rank(bool local) {
  Impl& s = *impl_;
  std::vector<at::Tensor> flag{
      torch::full({1}, local ? 1 : 0, torch::dtype(torch::kInt32).device(s.device))};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  for (const auto& group : {s.world > 1 ? s.pg : nullptr, s.tp.size > 1 ? s.tp.group : nullptr}) {
    if (group)
      run_collective("stop agreement", group, [&] { return group->allreduce(flag, options); });
  }
  const bool any = flag[0].item<int32_t>() != 0;
  check_groups("stop agreement", s.pg, s.tp);
  return any;
}

namespace {

// What step() and evaluate() take: int64 [B, T + 1] with T <= seq_len.
void check_tokens(const at::Tensor& tokens, const ModelConfig& model) {
  MEGACPP_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 2 && tokens.size(1) >= 2 &&
                    tokens.size(1) - 1 <= model.seq_len,
                ErrorKind::kInvalidArgument,
                fmt::format("tokens must be int64 [B, T+1] with T <= {}, got {} {}", model.seq_len,
                            c10::toString(tokens.scalar_type()), c10::str(tokens.sizes())));
}

}  // namespace

TrainStep::EvalSum TrainStep::evaluate(const at::Tensor& tokens) {
  Impl& s = *impl_;
  check_tokens(tokens, s.model_cfg);
  torch::NoGradGuard no_grad;
  const int64_t T = tokens.size(1) - 1;
  const int64_t V = s.model_cfg.vocab_size;
  const at::Tensor on_device = tokens.device() == s.device ? tokens : tokens.to(s.device);
  const auto sum = torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum);
  at::Tensor loss;
  const TensorParallel& tp = s.tp;
  if (tp.size > 1) {
    const int64_t t = T / tp.size;
    const auto logits = forward_tensor_parallel(*s.model, on_device.narrow(1, 0, T), tp);
    loss = all_reduce_sum(torch::nn::functional::cross_entropy(
                              logits.reshape({-1, V}).to(at::kFloat),
                              on_device.narrow(1, 1 + tp.rank * t, t).reshape({-1}), sum),
                          tp);
  } else {
    const auto logits = s.model->forward(on_device.narrow(1, 0, T));
    loss = torch::nn::functional::cross_entropy(logits.reshape({-1, V}).to(at::kFloat),
                                                on_device.narrow(1, 1, T).reshape({-1}), sum);
  }
  const double loss_sum = loss.item<double>();
  check_groups("evaluation", s.pg, s.tp);
  return {loss_sum, static_cast<double>(tokens.size(0) * T)};
}

TrainStep::EvalSum TrainStep::sum_over_data_ranks(EvalSum local) {
  Impl& s = *impl_;
  if (!s.pg) return local;
  std::vector<at::Tensor> sums{
      torch::tensor({local.loss_sum, local.tokens}, torch::dtype(torch::kFloat64)).to(s.device)};
  run_collective("validation loss", s.pg, [&] { return s.pg->allreduce(sums); });
  const at::Tensor host = sums[0].to(at::kCPU);
  check_groups("validation loss", s.pg, s.tp);
  return {host[0].item<double>(), host[1].item<double>()};
}

StepTiming TrainStep::step(const at::Tensor& tokens, uint32_t step_index, const StepHooks& hooks) {
  Impl& s = *impl_;
  check_tokens(tokens, s.model_cfg);
  auto phase = [&](schema::Phase p) {
    if (hooks.on_phase) hooks.on_phase(p);
  };
  StepTiming out;
  const int64_t T = tokens.size(1) - 1;
  const at::Tensor on_device = tokens.device() == s.device ? tokens : tokens.to(s.device);
  // Without tensor parallelism the step's scalars (loss, auxiliary loss, gradient norm) stay on
  // the device until the agreement flags come back after the optimizers: one read of the host
  // per step, at its end (DESIGN.md "GPU lane (second part)"). The same values on a CPU.
  const bool one_read = s.tp.size == 1;
  at::Tensor loss_d, aux_d, norm_d;
  std::vector<at::Tensor> counts_d;  // MoE layers' tokens per expert (int64)
  // One MoE layer's counts (float64 on the host: exact below 2^53) into the step's record.
  const auto take_expert_counts = [&](const at::Tensor& host) {
    const double* c = host.data_ptr<double>();
    auto& mine = out.tokens_per_expert.emplace_back();
    for (int64_t e = 0; e < host.numel(); ++e) mine.push_back(static_cast<int64_t>(c[e]));
    // Each rank of a group routes the whole batch but runs n / tp of the experts.
    const size_t per_rank = mine.size() / s.tp.size;
    for (size_t e = 0; e < mine.size(); ++e)
      if (e / per_rank != s.tp.rank) mine[e] = 0;
  };

  phase(schema::Phase::FORWARD);
  auto t0 = Clock::now();
  for (auto& [name, p] : s.params) p.mutable_grad() = at::Tensor();
  at::Tensor loss;
  const int64_t V = s.model_cfg.vocab_size;
  const TensorParallel& tp = s.tp;
  if (tp.size > 1) {
    // This rank's share (tensor_parallel.h): the cross-entropy summed over its sequence shard,
    // divided by the tokens of the whole batch; the group's shares add up to the batch mean.
    const int64_t t = T / tp.size;
    const auto logits = forward_tensor_parallel(*s.model, on_device.narrow(1, 0, T), tp);
    loss = torch::nn::functional::cross_entropy(
               logits.reshape({-1, V}).to(at::kFloat),
               on_device.narrow(1, 1 + tp.rank * t, t).reshape({-1}),
               torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
           static_cast<double>(tokens.size(0) * T);
    torch::NoGradGuard no_grad;
    out.loss = all_reduce_sum(loss.detach(), tp).item<float>();
  } else {
    const auto logits = s.model->forward(on_device.narrow(1, 0, T));
    // The cross-entropy in float32 whatever the logits' dtype (bf16-mixed: bfloat16).
    loss = torch::nn::functional::cross_entropy(logits.reshape({-1, V}).to(at::kFloat),
                                                on_device.narrow(1, 1, T).reshape({-1}));
    loss_d = loss.detach();
  }
  if (const at::Tensor aux = s.model->aux_loss(); aux.defined()) {
    if (one_read)
      aux_d = aux.detach().to(at::kFloat);
    else
      out.aux_loss = aux.item<float>();
    // Computed whole on every rank of a tensor-parallel group: 1/tp of it on each.
    loss = loss + aux / static_cast<double>(tp.size);
    for (const at::Tensor& counts : s.model->tokens_per_expert()) {
      if (one_read)
        counts_d.push_back(counts.detach());
      else
        take_expert_counts(counts.to(at::kDouble).to(at::kCPU));
    }
  }
  out.forward_seconds = seconds_since(t0);

  phase(schema::Phase::BACKWARD);
  t0 = Clock::now();
  loss.backward();
  loss.reset();  // the graph (which saved the token indices) is gone after backward
  if (tp.size > 1) s.reduce_tensor_parallel_gradients();
  out.backward_seconds = seconds_since(t0);
  if (hooks.after_backward) hooks.after_backward();

  phase(schema::Phase::OPTIMIZER);
  if (hooks.before_update) hooks.before_update();
  t0 = Clock::now();
  {
    torch::NoGradGuard no_grad;
    if (hooks.poison_gradients && hooks.poison_gradients()) {
      for (auto& [name, p] : s.params) {
        if (p.grad().defined()) {
          p.mutable_grad().fill_(std::numeric_limits<float>::quiet_NaN());
          break;
        }
      }
    }
    if (one_read) {
      norm_d = s.grad_norm_and_clip_on_device();
    } else {
      out.grad_norm = s.grad_norm_and_clip_tensor_parallel();
      out.nonfinite = !std::isfinite(out.loss) || !std::isfinite(out.grad_norm);
    }
    out.clip_seconds = seconds_since(t0);
    out.lr_scale = lr_scale(s.train_cfg, step_index, s.total_steps);
    for (size_t g = 0; g < s.adam_base_lr.size(); ++g)
      s.adamw->set_lr(g, s.adam_base_lr[g] * out.lr_scale);
    for (size_t g = 0; g < s.muon->num_groups(); ++g)
      s.muon->set_lr(g, s.train_cfg.optim.muon_lr * out.lr_scale);
    // On Gloo DistAdamW's gradients ride in DistMuon's reduce-scatter: one exchange for both
    // optimizers. Each rider is sent to every rank, so a large one at a world above 2 reduces
    // on its own instead (the sums are the same bits either way).
    // Not under tensor parallelism: DistMuon's group is then the job, DistAdamW's the
    // data-parallel group.
    std::vector<at::Tensor> riders;
    if (s.tp.size == 1 && (s.world <= 2 || s.adam_numel <= kRiderMaxNumel)) {
      if (at::Tensor bucket = s.adamw->pack_for_exchange(); bucket.defined())
        riders.push_back(bucket);
    }
    // The ranks' agreements ride in the same exchange, summed over the ranks: [0] whether any
    // rank asked to stop, [1 + r] whether rank r's loss or gradient norm is non-finite. The
    // flags are their own rider, so a NaN gradient does not make them NaN.
    // Made on the device (a fill and a copy there, no host-to-device copy, which torch
    // synchronises for pageable memory): [0] the stop request, [1 + r] rank r's non-finite
    // loss or gradient norm.
    at::Tensor flags;
    if (one_read) {
      flags = at::zeros({1 + s.world}, at::TensorOptions().dtype(at::kFloat).device(s.device));
      if (hooks.stop_requested && hooks.stop_requested()) flags[0].fill_(1.0);
      flags.narrow(0, 1 + s.rank, 1)
          .copy_(at::logical_not(at::isfinite(loss_d) & at::isfinite(norm_d))
                     .to(at::kFloat)
                     .view({1}));
      riders.push_back(flags);
    }
    s.muon->step(&out.optimizer_phases, riders);
    s.adamw->step(&out.optimizer_phases);
    if (one_read) {
      // The agreement, this rank's scalars and its MoE counts in one device-to-host copy, as
      // float64 (exact for each: float32 values, counts below 2^53).
      std::vector<at::Tensor> parts{flags, loss_d.view({1}), norm_d.view({1})};
      if (aux_d.defined()) parts.push_back(aux_d.view({1}));
      for (const at::Tensor& c : counts_d) parts.push_back(c.reshape({-1}));
      for (at::Tensor& p : parts) p = p.to(at::kDouble);
      const at::Tensor host = at::cat(parts).to(at::kCPU);
      // Before anything read is used: a collective of the step that failed in NCCL left these
      // (and the update already applied) unfinished.
      check_groups(fmt::format("step {}", step_index), s.pg, s.tp);
      const double* f = host.data_ptr<double>();
      if (hooks.stop_requested) out.stop_agreed = f[0] > 0.0f;
      out.nonfinite_ranks.emplace();
      for (uint32_t r = 0; r < s.world; ++r)
        if (f[1 + r] > 0.0f) out.nonfinite_ranks->push_back(r);
      out.loss = static_cast<float>(f[1 + s.world]);
      out.grad_norm = f[2 + s.world];
      int64_t at_ = 3 + s.world;
      if (aux_d.defined()) out.aux_loss = static_cast<float>(f[at_++]);
      for (const at::Tensor& c : counts_d) {
        take_expert_counts(host.narrow(0, at_, c.numel()));
        at_ += c.numel();
      }
      out.nonfinite = !std::isfinite(out.loss) || !std::isfinite(out.grad_norm);
    }
  }
  out.optimizer_seconds = seconds_since(t0);
  return out;
}

std::vector<NamedTensor> TrainStep::snapshot_share() const {
  std::array<OptimizerState, 2> views;
  std::vector<NamedTensor> out;
  for (auto& e : impl_->share(views)) out.emplace_back(std::move(e.name), std::move(e.value));
  return out;
}

SnapshotLayout TrainStep::snapshot_layout() const {
  return layout_of(snapshot_share());
}

std::string TrainStep::snapshot_metadata() const {
  const Impl& s = *impl_;
  std::array<OptimizerState, 2> views;
  nlohmann::ordered_json shards = nlohmann::ordered_json::object();
  for (const auto& e : s.share(views)) {
    if (!e.sharded) continue;
    shards[e.name] = {{"logical", e.logical}, {"full_shape", e.full_shape}, {"offset", e.offset}};
    if (e.dim != 0) shards[e.name]["dim"] = e.dim;
  }
  nlohmann::ordered_json stacks = nlohmann::ordered_json::object();
  for (size_t g = 0; g < s.muon->num_groups(); ++g) {
    for (size_t st = 0; st < s.muon->num_stacks(g); ++st) {
      std::vector<std::string> names;
      for (size_t i : s.muon->stack_members(g, st)) names.push_back(s.muon_names[g][i]);
      stacks[s.muon_stack_name(g, st)] = names;
    }
  }
  return nlohmann::ordered_json{{"format", "megacpp.snapshot.v1"},
                                {"rank", s.layout_rank},
                                {"world", s.layout_world},
                                {"shards", shards},
                                {"muon_stacks", stacks}}
      .dump();
}

struct SnapshotCopy::State {
  struct Piece {
    std::byte* dst;
    const std::byte* src;
    uint64_t bytes;
  };
  std::vector<Piece> pieces;
  std::vector<at::Tensor> keep;  // what the pieces read, alive until the thread is joined
  std::atomic<bool> done{false};
  std::thread thread;
  // A staged copy: issued into this target, whose order_after_copy() is the join.
  StagingTarget* target = nullptr;

  void run() noexcept {
    // Streaming stores: the share is many multi-MB tensors, each below the size at which
    // memcpy streams by itself, and the staging region is not read by this process again.
    for (const Piece& p : pieces) ops::stream_copy(p.dst, p.src, p.bytes);
    done.store(true, std::memory_order_release);
  }
  void join() noexcept {
    if (thread.joinable()) thread.join();
    if (target != nullptr) {
      try {
        target->order_after_copy();
      } catch (const std::exception& e) {
        // A device that fails a stream wait has failed the rank; the next device call says so.
        log_error("ordering the update after the snapshot copy failed: {}", e.what());
      }
      target = nullptr;
    }
    keep.clear();
  }
  ~State() { join(); }
};

SnapshotCopy::SnapshotCopy() noexcept = default;
SnapshotCopy::SnapshotCopy(SnapshotCopy&&) noexcept = default;
SnapshotCopy& SnapshotCopy::operator=(SnapshotCopy&& other) noexcept {
  if (this != &other) {
    wait();
    s_ = std::move(other.s_);
  }
  return *this;
}
SnapshotCopy::~SnapshotCopy() = default;

bool SnapshotCopy::ready() const noexcept {
  return !s_ || s_->done.load(std::memory_order_acquire);
}

void SnapshotCopy::wait() noexcept {
  if (s_) s_->join();
}

namespace {
// Splits the copy of `share` into `region` per `layout`: contiguous host tensors become raw
// pieces of `state` (copied later, by anyone); the rest (device or strided tensors) are
// copied now through torch, which synchronizes with the device.
void plan_snapshot_copy(const std::vector<NamedTensor>& share, const SnapshotLayout& layout,
                        std::span<std::byte> region, SnapshotCopy::State& state);
}  // namespace

SnapshotCopy TrainStep::start_snapshot_copy(std::span<std::byte> region,
                                            SnapshotLayout* layout) const {
  const auto share = snapshot_share();
  *layout = layout_of(share);
  auto state = std::make_unique<SnapshotCopy::State>();
  plan_snapshot_copy(share, *layout, region, *state);
  SnapshotCopy copy;
  if (state->pieces.empty()) return copy;
  try {
    state->thread = std::thread([st = state.get()] { st->run(); });
  } catch (const std::system_error&) {
    state->run();  // no thread to be had: the copy blocks instead
  }
  copy.s_ = std::move(state);
  return copy;
}

SnapshotCopy TrainStep::start_staged_copy(StagingTarget& target, uint64_t step,
                                          SnapshotLayout* layout) const {
  const auto share = snapshot_share();
  *layout = layout_of(share);
  MEGACPP_CHECK(target.bytes() >= layout->total_bytes, ErrorKind::kInvalidArgument,
                fmt::format("a staging buffer of {} bytes cannot hold a {}-byte share",
                            target.bytes(), layout->total_bytes));
  auto state = std::make_unique<SnapshotCopy::State>();
  std::vector<StagingPiece> pieces;
  // What the target cannot read from where it lies is gathered into one host tensor first.
  std::vector<size_t> moved;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < share.size(); ++i) {
    const at::Tensor& src = share[i].second;
    const SnapshotEntry& e = layout->entries[i];
    const bool where = target.device() ? src.device().is_cuda() : src.device().is_cpu();
    if (!where) {
      moved.push_back(i);
      continue;
    }
    at::Tensor t = src.is_contiguous() ? src : src.contiguous();
    MEGACPP_CHECK(t.nbytes() == e.bytes, ErrorKind::kInternal,
                  fmt::format("{}: {} bytes, its layout says {}", e.name, t.nbytes(), e.bytes));
    pieces.push_back({e.offset, t.data_ptr(), e.bytes});
    state->keep.push_back(std::move(t));
  }
  MEGACPP_CHECK(moved.empty() || !target.device(), ErrorKind::kInvalidArgument,
                fmt::format("{} of the share's tensors are not on the device whose staging buffer "
                            "holds the share (the first: {})",
                            moved.size(), moved.empty() ? "" : layout->entries[moved[0]].name));
  for (size_t i : moved) {
    at::Tensor host = share[i].second.to(at::kCPU).contiguous();
    pieces.push_back({layout->entries[i].offset, host.data_ptr(), layout->entries[i].bytes});
    state->keep.push_back(std::move(host));
  }
  target.copy_async(pieces, step);
  state->target = &target;
  state->done.store(true, std::memory_order_release);
  SnapshotCopy copy;
  copy.s_ = std::move(state);
  return copy;
}

SnapshotLayout TrainStep::copy_snapshot(std::span<std::byte> region) const {
  const auto share = snapshot_share();
  SnapshotLayout layout = layout_of(share);
  SnapshotCopy::State state;
  plan_snapshot_copy(share, layout, region, state);
  state.run();
  return layout;
}

namespace {
void plan_snapshot_copy(const std::vector<NamedTensor>& share, const SnapshotLayout& layout,
                        std::span<std::byte> region, SnapshotCopy::State& state) {
  MEGACPP_CHECK(region.size() >= layout.total_bytes, ErrorKind::kInvalidArgument,
                fmt::format("staging region of {} bytes cannot hold a {}-byte share", region.size(),
                            layout.total_bytes));
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < share.size(); ++i) {
    const at::Tensor& src = share[i].second;
    const SnapshotEntry& e = layout.entries[i];
    if (src.is_contiguous() && src.device().is_cpu() && src.nbytes() == e.bytes) {
      state.pieces.push_back(
          {region.data() + e.offset, static_cast<const std::byte*>(src.data_ptr()), e.bytes});
      state.keep.push_back(src);
      continue;
    }
    at::Tensor dst = torch::from_blob(region.data() + e.offset, src.sizes(),
                                      torch::TensorOptions().dtype(src.scalar_type()));
    dst.copy_(src);
  }
}
}  // namespace

void TrainStep::restore(const checkpoint::CheckpointReader& ckpt) {
  Impl& s = *impl_;
  torch::NoGradGuard no_grad;
  // Fills `dst` (contiguous, rows [row, row + dst.size(0)) of `logical`, or all of a 0-D one).
  // A Muon stack is padded to chunk x world rows, so its row count may differ from a
  // checkpoint of another world size: only its trailing dimensions must match.
  auto fill = [&](const std::string& logical, at::Tensor dst, std::vector<int64_t> full_shape,
                  int64_t row, bool padded_rows) {
    const checkpoint::StoredTensor* t = ckpt.find(logical);
    MEGACPP_CHECK(t != nullptr, ErrorKind::kInvalidArgument,
                  fmt::format("checkpoint {} has no tensor {}: it was written by another model "
                              "or optimizer configuration",
                              ckpt.dir().string(), logical));
    const std::vector<uint64_t> want(full_shape.begin(), full_shape.end());
    const bool shape_fits =
        padded_rows ? !want.empty() && t->full_shape.size() == want.size() &&
                          std::equal(want.begin() + 1, want.end(), t->full_shape.begin() + 1)
                    : t->full_shape == want;
    MEGACPP_CHECK(
        t->dtype == safetensors_dtype(dst.scalar_type()) && shape_fits, ErrorKind::kInvalidArgument,
        fmt::format("checkpoint {}: {} is {} {}, this model needs {} {}", ckpt.dir().string(),
                    logical, t->dtype, nlohmann::json(t->full_shape).dump(),
                    safetensors_dtype(dst.scalar_type()), nlohmann::json(want).dump()));
    MEGACPP_CHECK(dst.is_contiguous(), ErrorKind::kInternal, logical + ": state not contiguous");
    const uint64_t rows = dst.dim() == 0 ? 1 : static_cast<uint64_t>(dst.size(0));
    // The files are read into host memory: a device tensor is filled through a host copy.
    at::Tensor host = dst.is_cpu() ? dst : at::empty_like(dst, at::TensorOptions(at::kCPU));
    ckpt.read_rows(*t, static_cast<uint64_t>(row), rows,
                   {static_cast<std::byte*>(host.data_ptr()), host.nbytes()});
    if (!dst.is_cpu()) dst.copy_(host);
  };
  for (auto& [name, p] : s.params) {
    const auto it = s.parts.find(name);
    if (it == s.parts.end()) {
      fill("model." + name, p.detach(), p.sizes().vec(), 0, false);
      continue;
    }
    // This rank's blocks of the whole matrix, whichever layout wrote it.
    const MatrixPart& part = it->second;
    at::Tensor whole;
    for (const auto& b : part.blocks) {
      const at::Tensor dst = p.detach().narrow(part.dim, b.local_offset, b.size);
      if (part.dim == 0) {
        fill("model." + name, dst, part.full_shape, b.full_offset, false);
        continue;
      }
      if (!whole.defined()) {
        whole = at::empty(part.full_shape, p.options().device(at::kCPU).requires_grad(false));
        fill("model." + name, whole, part.full_shape, 0, false);
      }
      dst.copy_(whole.narrow(1, b.full_offset, b.size));
    }
  }
  std::array<OptimizerState, 2> views{s.adamw->state_view(), s.muon->state_view()};
  for (int k = 0; k < 2; ++k) {
    for (auto& e : views[k].entries) {
      if (k == 1 && e.key.field == StateField::kMaster && !s.train_cfg.bf16_mixed()) {
        // DistMuon's whole copies of its matrices under tensor parallelism, in the
        // parameters' dtype: the whole parameters themselves.
        const auto members = s.muon->stack_members(e.key.group, e.key.stack);
        for (int64_t j = 0; j < e.value.size(0); ++j) {
          const auto entry = static_cast<size_t>(e.offset + j);
          if (entry >= members.size()) {
            e.value[j].zero_();
            continue;
          }
          const std::string& name = s.muon_names[e.key.group][members[entry]];
          fill("model." + name, e.value[j], e.value[j].sizes().vec(), 0, false);
        }
        continue;
      }
      fill(s.logical_name(k == 0, e.key), e.value, e.full_shape, e.replicated ? 0 : e.offset,
           e.key.scope == StateScope::kStack);
    }
  }
}

at::Tensor widen_batch(std::span<const std::byte> slot, const recipe::BatchSpec& spec,
                       uint64_t step, recipe::BatchHeader* header, at::Tensor into) {
  recipe::BatchHeader h;
  MEGACPP_CHECK(slot.size() == spec.slot_bytes(), ErrorKind::kProtocol,
                fmt::format("batch of step {} has {} bytes, expected {}", step, slot.size(),
                            spec.slot_bytes()));
  std::memcpy(&h, slot.data(), sizeof h);
  MEGACPP_CHECK(h.magic == recipe::kBatchMagic && h.token_bytes == spec.token_bytes &&
                    h.batch == spec.batch && h.row_tokens == spec.row_tokens() && h.step == step,
                ErrorKind::kProtocol,
                fmt::format("batch header of step {} says magic {:#x}, {}-byte tokens, [{}, {}], "
                            "step {}; expected {}-byte tokens, [{}, {}]",
                            step, h.magic, h.token_bytes, h.batch, h.row_tokens, h.step,
                            spec.token_bytes, spec.batch, spec.row_tokens()));
  at::Tensor out = into.defined() ? into : torch::empty(spec.shape(), torch::kInt64);
  MEGACPP_CHECK(out.scalar_type() == at::kLong && out.is_cpu() && out.is_contiguous() &&
                    out.sizes() == at::IntArrayRef(spec.shape()),
                ErrorKind::kInvalidArgument, "widen_batch: `into` is not the batch's int64 shape");
  int64_t* dst = out.data_ptr<int64_t>();
  const std::byte* src = slot.data() + sizeof h;
  const uint64_t n = spec.slot_tokens();
  if (spec.token_bytes == 2) {
    for (uint64_t i = 0; i < n; ++i) {
      uint16_t t;
      std::memcpy(&t, src + i * 2, 2);
      dst[i] = t;
    }
  } else {
    for (uint64_t i = 0; i < n; ++i) {
      uint32_t t;
      std::memcpy(&t, src + i * 4, 4);
      dst[i] = t;
    }
  }
  if (header != nullptr) *header = h;
  return out;
}

}  // namespace megacpp::trainer
