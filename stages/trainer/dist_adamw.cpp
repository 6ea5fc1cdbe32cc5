// DistAdamW (README.md "Distributed optimizer"); contract in optim.h.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <tuple>

#include <fmt/format.h>

#include "core/error.h"
#include "stages/trainer/exchange.h"
#include "stages/trainer/optim_internal.h"

namespace megacpp::trainer {

using detail::add_scalar_entry;
using detail::Entries;
using detail::group_key;
using detail::load_entries;
using detail::param_key;
using detail::PhaseClock;
using detail::scalar_tensor;
using detail::shape_str;

// =======================================================================================
// DistAdamW

struct DistAdamW::Group {
  AdamWScalars s;
  bool decays = false;  // s.weight_decay != 0, known on the host (optim.h)
};

struct DistAdamW::Param {
  at::Tensor p;
  size_t group = 0;
  bool sharded = false;
  int64_t rows = 0;                    // rows owned per rank when sharded
  at::ScalarType reduce = at::kFloat;  // the dtype its gradient is summed in
  at::Tensor exp_avg, exp_avg_sq, step;
  at::Tensor master;  // master weights: float32 copy of the owned rows; else undefined
};

DistAdamW::DistAdamW(std::vector<AdamWParamGroup> groups, Exchange::Pg pg, DistAdamWOptions options)
    : exchange_(Exchange::over(std::move(pg))),
      rank_(exchange_->rank()),
      world_(exchange_->world()),
      host_decisions_(options.host_decisions),
      fused_update_(std::move(options.fused_update)) {
  MEGACPP_CHECK(!groups.empty(), ErrorKind::kInvalidArgument, "DistAdamW without groups");
  MEGACPP_CHECK(options.crossover_numel >= 0, ErrorKind::kInvalidArgument,
                "DistAdamW crossover_numel must be >= 0");
  std::optional<at::Device> device;
  at::NoGradGuard ng;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& g = groups[gi];
    MEGACPP_CHECK(!g.params.empty(), ErrorKind::kInvalidArgument,
                  fmt::format("DistAdamW group {} has no parameters", gi));
    MEGACPP_CHECK(
        g.masters.empty() || (options.master_weights && g.masters.size() == g.params.size()),
        ErrorKind::kInvalidArgument,
        fmt::format("DistAdamW group {}: masters need master_weights and one per "
                    "parameter",
                    gi));
    for (size_t pi = 0; pi < g.params.size(); ++pi) {
      const at::Tensor& p = g.params[pi];
      MEGACPP_CHECK(p.defined() && p.is_contiguous() && p.is_floating_point(),
                    ErrorKind::kInvalidArgument,
                    fmt::format("DistAdamW group {}: parameters must be defined, contiguous "
                                "floating-point tensors",
                                gi));
      if (!device) device = p.device();
      MEGACPP_CHECK(p.device() == *device, ErrorKind::kInvalidArgument,
                    "DistAdamW parameters on different devices");
      Param q;
      q.p = p;
      q.group = gi;
      // Explicit shape check: an indivisible first dimension cannot be reduce-scattered.
      q.sharded = world_ > 1 && p.dim() >= 1 && p.numel() >= options.crossover_numel &&
                  p.size(0) % world_ == 0;
      q.rows = q.sharded ? p.size(0) / world_ : (p.dim() >= 1 ? p.size(0) : 0);
      const at::Tensor owned =
          q.sharded ? p.detach().narrow(0, rank_ * q.rows, q.rows) : p.detach();
      const auto fopts = owned.options().dtype(at::kFloat);
      q.exp_avg = at::zeros(owned.sizes(), fopts);
      q.exp_avg_sq = at::zeros(owned.sizes(), fopts);
      q.step = scalar_tensor(0.0, p.device());
      q.reduce = options.reduce_dtype.value_or(p.scalar_type());
      if (options.master_weights) {
        const at::Tensor& from = g.masters.empty() ? p : g.masters[pi];
        MEGACPP_CHECK(from.sizes() == p.sizes(), ErrorKind::kInvalidArgument,
                      fmt::format("DistAdamW group {} parameter {}: master of shape {} for a "
                                  "parameter of shape {}",
                                  gi, pi, shape_str(from.sizes()), shape_str(p.sizes())));
        const at::Tensor whole = from.detach().to(p.device(), at::kFloat);
        q.master = (q.sharded ? whole.narrow(0, rank_ * q.rows, q.rows) : whole).clone();
      }
      params_.push_back(std::move(q));
    }
    Group grp;
    grp.s.lr = scalar_tensor(g.lr, *device);
    grp.s.beta1 = scalar_tensor(g.beta1, *device);
    grp.s.beta2 = scalar_tensor(g.beta2, *device);
    grp.s.eps = scalar_tensor(g.eps, *device);
    grp.s.weight_decay = scalar_tensor(g.weight_decay, *device);
    grp.decays = g.weight_decay != 0.0;
    groups_.push_back(std::move(grp));
  }
}

DistAdamW::~DistAdamW() = default;

size_t DistAdamW::num_groups() const {
  return groups_.size();
}
AdamWScalars& DistAdamW::scalars(size_t group) {
  return groups_.at(group).s;
}
void DistAdamW::set_lr(size_t group, double lr) {
  groups_.at(group).s.lr.fill_(lr);
}
void DistAdamW::set_weight_decay(size_t group, double wd) {
  groups_.at(group).s.weight_decay.fill_(wd);
  groups_.at(group).decays = wd != 0.0;
}
bool DistAdamW::is_sharded(size_t index) const {
  return params_.at(index).sharded;
}

bool DistAdamW::exchanges_by_point_to_point() const {
  return exchange_->rank_ordered() &&
         std::all_of(params_.begin(), params_.end(),
                     [](const Param& q) { return q.reduce == at::kFloat; });
}

void DistAdamW::pack_bucket() {
  const auto n = static_cast<int64_t>(params_.size());
  int64_t total = n;
  for (const auto& q : params_) total += q.p.numel();
  const auto opts = params_.front().p.options().dtype(at::kFloat).requires_grad(false);
  if (bucket_.numel() != total) {
    bucket_ = at::empty({total}, opts);
  }
  std::vector<float> had(static_cast<size_t>(n), 0.0f);
  int64_t off = n;
  for (int64_t i = 0; i < n; ++i) {
    const Param& q = params_[static_cast<size_t>(i)];
    const at::Tensor& grad = q.p.grad();
    at::Tensor dst = bucket_.narrow(0, off, q.p.numel());
    if (grad.defined()) {
      dst.copy_(grad.detach().reshape({-1}));
      had[static_cast<size_t>(i)] = 1.0f;
    } else {
      dst.zero_();
    }
    off += q.p.numel();
  }
  bucket_.narrow(0, 0, n).copy_(
      at::from_blob(had.data(), {n}, at::TensorOptions().dtype(at::kFloat)));
}

at::Tensor DistAdamW::pack_for_exchange() {
  if (!exchanges_by_point_to_point()) return {};
  at::NoGradGuard ng;
  pack_bucket();
  packed_ = true;
  return bucket_;
}

void DistAdamW::step(OptimizerPhaseTimes* times) {
  at::NoGradGuard ng;
  PhaseClock clock(times);
  // On a rank-ordered exchange (Gloo, shared memory) every gradient and the has-grad flags
  // travel in one buffer, all-reduced by one exchange (summed in rank order, so a parameter's sums
  // do not depend on what else is in the buffer: the sharded placement and its replicated mirror
  // agree bit for bit) or by the caller's (pack_for_exchange); a sharded parameter then steps its
  // own rows and all-gathers them. Elsewhere one has-grad mask, then one collective per parameter.
  const bool p2p = exchanges_by_point_to_point();
  const auto n = static_cast<int64_t>(params_.size());
  at::Tensor mask;
  at::Tensor bucket;
  if (p2p) {
    if (!packed_) {
      pack_bucket();
      exchange_->all_reduce(bucket_);
    }
    packed_ = false;
    bucket = bucket_;
    mask = bucket.narrow(0, 0, n) > 0;
  } else {
    std::vector<at::Tensor> ps;
    ps.reserve(params_.size());
    for (const auto& q : params_) ps.push_back(q.p);
    mask = exchange_->has_grad_mask(ps, params_.front().p.device());
  }
  clock.lap(&OptimizerPhaseTimes::reduce);

  // On the CPU, when every parameter had a gradient somewhere and no group decays (the
  // recipes' default), the update runs in place (DistMuon::begin_update says why it is
  // exact). One host read of the mask per step. On a device (or without
  // host_decisions) a float32 target is updated in place with the mask as a 0/1 weight of
  // each step (the moments' lerp_ weights, the step count, the decay and the learning rate):
  // nothing read on the host, no select holding a second copy of a parameter and its moments.
  const bool host = mask.is_cpu() && host_decisions_;
  bool in_place = host && mask.all().item<bool>();
  for (const Param& q : params_)
    in_place = in_place && (q.master.defined() || q.p.scalar_type() == at::kFloat) &&
               !groups_[q.group].decays;

  int64_t off = n;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& q = params_[i];
    const AdamWScalars& s = groups_[q.group].s;
    at::Tensor g;
    at::Tensor p_owned;
    if (p2p) {
      g = bucket.narrow(0, off, q.p.numel()).view(q.p.sizes());
      off += q.p.numel();
      if (q.sharded) g = g.narrow(0, rank_ * q.rows, q.rows);
      p_owned = q.sharded ? q.p.detach().narrow(0, rank_ * q.rows, q.rows) : q.p.detach();
    } else {
      const at::Tensor& grad = q.p.grad();
      // A private, contiguous copy: collectives reduce in place and must not touch .grad.
      at::Tensor full = grad.defined() ? grad.detach().to(q.reduce).contiguous().clone()
                                       : at::zeros_like(q.p.detach(), q.reduce);
      if (q.sharded) {
        std::vector<int64_t> rows = full.sizes().vec();
        rows[0] = q.rows;
        at::Tensor flat = full.view({-1});
        g = exchange_->reduce_scatter(flat).view(rows);
        p_owned = q.p.detach().narrow(0, rank_ * q.rows, q.rows);
      } else {
        at::Tensor flat = full.view({-1});  // the exchange takes 1-D buffers
        exchange_->all_reduce(flat);
        g = full;
        p_owned = q.p.detach();
      }
    }
    if (world_ > 1) g = g / static_cast<double>(world_);
    const at::Tensor m = mask[static_cast<int64_t>(i)];
    // With master weights the update runs on the float32 master; the parameter gets its cast.
    const at::Tensor target = q.master.defined() ? q.master : p_owned;
    const bool gated = !host && target.scalar_type() == at::kFloat;
    if ((in_place || gated) && g.scalar_type() != at::kFloat) g = g.to(at::kFloat);
    clock.lap(&OptimizerPhaseTimes::reduce);

    const bool fused = gated && fused_update_ && target.is_contiguous() && g.is_contiguous() &&
                       q.exp_avg.is_contiguous() && q.exp_avg_sq.is_contiguous() &&
                       g.numel() == target.numel();
    if (fused) {
      // The gated path's arithmetic in one pass (ops.h adamw_step_cpu): 4 parameter-sized
      // arrays read and 3 written by one kernel, where torch's operations below move about 22
      // in about 20 kernels (a scalar's included).
      const at::Tensor gate = m.to(at::kFloat);
      q.step.add_(gate);
      const auto f = [](const at::Tensor& t) { return t.data_ptr<float>(); };
      fused_update_(f(target), f(g), f(q.exp_avg), f(q.exp_avg_sq), target.numel(),
                    ops::AdamWStepScalars{.lr = f(s.lr),
                                          .beta1 = f(s.beta1),
                                          .beta2 = f(s.beta2),
                                          .eps = f(s.eps),
                                          .weight_decay = f(s.weight_decay),
                                          .step = f(q.step),
                                          .gate = f(gate)},
                    groups_[q.group].decays);
      clock.lap(&OptimizerPhaseTimes::update);
    } else if (in_place || gated) {
      // The general path's operations (below), in place and without the selects, each step's
      // weight times the gate: an entry with a gradient gets the same values, one without
      // keeps its own (lerp_ by 0, the step count plus 0, the decay factor 1 - 0, minus 0). On
      // the host's in-place path the gate is 1 and nothing decays (the decay factor is exactly
      // 1): the same bits.
      const at::Tensor gate = m.to(at::kFloat);
      q.step.add_(gate);
      const at::Tensor tc = q.step.clamp_min(1.0);
      if (groups_[q.group].decays) target.mul_(1 - s.lr * s.weight_decay * gate);
      q.exp_avg.lerp_(g, (1 - s.beta1) * gate);
      q.exp_avg_sq.lerp_(g.square(), (1 - s.beta2) * gate);
      const at::Tensor bias1 = 1 - s.beta1.pow(tc);
      const at::Tensor bias2 = 1 - s.beta2.pow(tc);
      at::Tensor step = (q.exp_avg_sq / bias2).sqrt_().add_(s.eps);
      at::div_out(step, q.exp_avg, step);
      target.sub_(step.mul_(s.lr / bias1 * gate));
      clock.lap(&OptimizerPhaseTimes::update);
    } else {
      const at::Tensor g32 = g.to(at::kFloat);
      const at::Tensor p32 = target.to(at::kFloat);
      const at::Tensor t = q.step + m.to(at::kFloat);
      const at::Tensor tc = t.clamp_min(1.0);  // a skipped first step must not divide by zero
      at::Tensor p_new = p32 * (1 - s.lr * s.weight_decay);
      const at::Tensor ea = q.exp_avg.lerp(g32, 1 - s.beta1);
      const at::Tensor eas = q.exp_avg_sq.lerp(g32.square(), 1 - s.beta2);
      const at::Tensor bias1 = 1 - s.beta1.pow(tc);
      const at::Tensor bias2 = 1 - s.beta2.pow(tc);
      const at::Tensor denom = (eas / bias2).sqrt() + s.eps;
      p_new = p_new - (ea / denom) * (s.lr / bias1);

      target.copy_(at::where(m, p_new, p32));
      q.exp_avg.copy_(at::where(m, ea, q.exp_avg));
      q.exp_avg_sq.copy_(at::where(m, eas, q.exp_avg_sq));
      q.step.copy_(t);
      clock.lap(&OptimizerPhaseTimes::update);
    }
    if (q.master.defined()) p_owned.copy_(q.master);
    if (q.sharded) {
      at::Tensor rows = q.p.detach().view({-1});
      exchange_->all_gather(rows);
      clock.lap(&OptimizerPhaseTimes::gather);
    }
  }
}

OptimizerState DistAdamW::state_dict() const {
  OptimizerState s = state_view();
  for (auto& e : s.entries) e.value = e.value.detach().clone();
  return s;
}

OptimizerState DistAdamW::state_view() const {
  Entries live;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& q = params_[i];
    const std::vector<int64_t> full = q.p.sizes().vec();
    const int64_t off = q.sharded ? rank_ * q.rows : 0;
    const std::array<std::pair<StateField, at::Tensor>, 2> moments{
        {{StateField::kExpAvg, q.exp_avg}, {StateField::kExpAvgSq, q.exp_avg_sq}}};
    for (const auto& [field, t] : moments) {
      live.push_back(OptimizerStateEntry{.key = param_key(i, field),
                                         .value = t,
                                         .full_shape = full,
                                         .offset = off,
                                         .replicated = !q.sharded});
    }
    if (q.master.defined()) {
      live.push_back(OptimizerStateEntry{.key = param_key(i, StateField::kMaster),
                                         .value = q.master,
                                         .full_shape = full,
                                         .offset = off,
                                         .replicated = !q.sharded});
    }
    add_scalar_entry(live, param_key(i, StateField::kStep), q.step);
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto& s = groups_[g].s;
    add_scalar_entry(live, group_key(g, StateField::kLr), s.lr);
    add_scalar_entry(live, group_key(g, StateField::kBeta1), s.beta1);
    add_scalar_entry(live, group_key(g, StateField::kBeta2), s.beta2);
    add_scalar_entry(live, group_key(g, StateField::kEps), s.eps);
    add_scalar_entry(live, group_key(g, StateField::kWeightDecay), s.weight_decay);
  }
  return OptimizerState{.kind = "dist_adamw", .rank = rank_, .world = world_, .entries = live};
}

void DistAdamW::load_state_dict(const OptimizerState& state) {
  OptimizerState live = state_dict();  // the layout (clones; replaced by the live tensors)
  Entries targets;
  size_t k = 0;
  for (const Param& q : params_) {
    std::vector<at::Tensor> mine{q.exp_avg, q.exp_avg_sq};
    if (q.master.defined()) mine.push_back(q.master);
    mine.push_back(q.step);
    for (const at::Tensor& t : mine) {
      OptimizerStateEntry e = live.entries[k++];
      e.value = t;
      targets.push_back(std::move(e));
    }
  }
  for (const Group& g : groups_) {
    for (const at::Tensor& t : {g.s.lr, g.s.beta1, g.s.beta2, g.s.eps, g.s.weight_decay}) {
      OptimizerStateEntry e = live.entries[k++];
      e.value = t;
      targets.push_back(std::move(e));
    }
  }
  load_entries("dist_adamw", rank_, world_, targets, state);
  for (Group& g : groups_) g.decays = g.s.weight_decay.item<float>() != 0.0f;
}

}  // namespace megacpp::trainer
