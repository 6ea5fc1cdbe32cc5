// DistAdamW and DistMuon (README.md "Distributed optimizer"); contracts in optim.h.
#include "stages/trainer/optim.h"

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
#include "ipc/peer_exchange.h"
#include "ops/optim_kernels.h"
#include "stages/trainer/collective.h"

namespace megacpp::trainer {

namespace {

using Pg = c10::intrusive_ptr<c10d::Backend>;

// Adds the wall time since the previous lap (or construction) to the field a lap names; does
// nothing, not even read the clock, without `times`.
class PhaseClock {
 public:
  explicit PhaseClock(OptimizerPhaseTimes* times) : times_(times) {
    if (times_ != nullptr) last_ = std::chrono::steady_clock::now();
  }
  void lap(double OptimizerPhaseTimes::*field) {
    if (times_ == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    times_->*field += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  OptimizerPhaseTimes* times_;
  std::chrono::steady_clock::time_point last_;
};

at::Tensor scalar_tensor(double v, const at::Device& device) {
  return at::full({}, v, at::TensorOptions().dtype(at::kFloat).device(device));
}

std::string shape_str(at::IntArrayRef s) {
  return c10::str(s);
}

bool is_gloo(const Pg& pg) {
  return pg && pg->getBackendName() == "gloo";
}

void all_reduce(const Pg& pg, at::Tensor& t, c10d::ReduceOp op) {
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  run_collective("all_reduce", pg, [&] { return pg->allreduce(v, o); });
}

// SUM over ranks of `full` (contiguous, dim 0 divisible by world); returns this rank's rows.
// `full` is a scratch buffer the caller owns (Gloo reduces it in place).
at::Tensor reduce_scatter_sum(const Pg& pg, at::Tensor& full, uint32_t rank, uint32_t world) {
  const int64_t rows = full.size(0) / world;
  if (is_gloo(pg)) {
    all_reduce(pg, full, c10d::ReduceOp::SUM);
    return full.narrow(0, rank * rows, rows);
  }
  std::vector<int64_t> shape = full.sizes().vec();
  shape[0] = rows;
  at::Tensor out = at::empty(shape, full.options());
  c10d::ReduceScatterOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  run_collective("reduce_scatter", pg, [&] { return pg->_reduce_scatter_base(out, full, o); });
  return out;
}

// Collectives over Gloo's point-to-point send and receive, on `flat`: a contiguous 1-D buffer
// of `world` equal segments, segment q being rank q's. Gloo has no reduce-scatter of its own
// (torch's `_reduce_scatter_base` on Gloo is an all-reduce and a narrow), its `_allgather_base`
// moves each byte more than once, and each of its collectives costs a round of its worker
// threads. Here every rank sends to and receives from every other rank at once, in one round
// (at world 2, one exchange with the peer).
//
// Every element is summed in rank order, x[0] + x[1] + ... + x[world-1], whatever its place
// in the buffer and whichever rank sums it: the same values give the same bits in any layout
// (a bucket of several parameters, a parameter alone, a sharded or a replicated placement),
// and on every rank. At world 2 that is a + b, as any all-reduce's.
//
// All are collectives: every rank calls them with buffers of the same size. `scratch` holds
// world - 1 segments (exchange_reduce_scatter) or world - 1 buffers (exchange_all_reduce).

// Sends `send_to(q)` to rank q and receives `recv_from(q)` from it, for every q != rank, in one
// round.
void exchange(const Pg& pg, std::string_view what, int tag, uint32_t rank, uint32_t world,
              const std::function<at::Tensor(uint32_t)>& send_to,
              const std::function<at::Tensor(uint32_t)>& recv_from) {
  if (ipc::PeerExchange* shared = peer_exchange_of(pg)) {
    // Ranks of one host: through shared memory (ipc/peer_exchange.h); its failures are
    // already typed as run_collective types Gloo's (peer failure, timeout, abort).
    std::vector<at::Tensor> keep;
    std::vector<ipc::PeerExchange::Transfer> transfers;
    for (uint32_t k = 1; k < world; ++k) {
      const uint32_t q = (rank + k) % world;
      const at::Tensor out = send_to(q), in = recv_from(q);
      MEGACPP_CHECK(out.is_cpu() && in.is_cpu() && out.is_contiguous() && in.is_contiguous(),
                    ErrorKind::kInternal,
                    fmt::format("{}: a shared-memory exchange takes contiguous CPU tensors", what));
      transfers.push_back({q,
                           {static_cast<const std::byte*>(out.const_data_ptr()), out.nbytes()},
                           {static_cast<std::byte*>(in.data_ptr()), in.nbytes()}});
      keep.push_back(out);
      keep.push_back(in);
    }
    shared->exchange(
        what, transfers,
        std::chrono::duration_cast<std::chrono::milliseconds>(pg->getBackendOptions()->timeout));
    return;
  }
  std::vector<std::vector<at::Tensor>> ins, outs;
  ins.reserve(world);
  outs.reserve(world);
  run_collectives(what, pg, [&] {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (uint32_t k = 1; k < world; ++k) {
      const uint32_t src = (rank + world - k) % world;
      ins.push_back({recv_from(src)});
      works.push_back(pg->recv(ins.back(), static_cast<int>(src), tag));
    }
    for (uint32_t k = 1; k < world; ++k) {
      const uint32_t dst = (rank + k) % world;
      outs.push_back({send_to(dst)});
      works.push_back(pg->send(outs.back(), static_cast<int>(dst), tag));
    }
    return works;
  });
}

// `own` += the other ranks' `theirs(q)`, summed in rank order with `own` at place `rank`.
void sum_in_rank_order(at::Tensor own, uint32_t rank, uint32_t world,
                       const std::function<at::Tensor(uint32_t)>& theirs) {
  if (rank == 0) {
    for (uint32_t q = 1; q < world; ++q) own.add_(theirs(q));
    return;
  }
  at::Tensor acc = theirs(0);  // a scratch view: summed into in place
  for (uint32_t q = 1; q < world; ++q) acc.add_(q == rank ? own : theirs(q));
  own.copy_(acc);
}

// Index of rank q's slot in a scratch of world - 1 slots (the own rank has none).
int64_t slot_of(uint32_t q, uint32_t rank) {
  return q < rank ? q : q - 1;
}

// Segment `rank` of `flat` becomes the SUM over ranks, its first `mean_prefix` elements then
// divided by the world (the mean); the other segments are left as they were.
void exchange_reduce_scatter(const Pg& pg, at::Tensor& flat, at::Tensor& scratch, uint32_t rank,
                             uint32_t world, int64_t mean_prefix = 0) {
  const int64_t seg = flat.numel() / world;
  auto part = [&](uint32_t q) { return scratch.narrow(0, slot_of(q, rank) * seg, seg); };
  exchange(
      pg, "reduce_scatter", 2, rank, world,
      [&](uint32_t q) { return flat.narrow(0, q * seg, seg); }, part);
  at::Tensor own = flat.narrow(0, rank * seg, seg);
  if (world == 2 && own.is_cpu() && own.scalar_type() == at::kFloat) {
    // One pass instead of two or three: a + b is b + a, and the division is the same one.
    auto* o = static_cast<float*>(own.data_ptr());
    const auto* t = static_cast<const float*>(part(1 - rank).const_data_ptr());
    const auto m = static_cast<size_t>(mean_prefix);
    ops::sum_and_divide(o, t, 2.0f, m);
    ops::sum_and_divide(o + m, t + m, 1.0f, static_cast<size_t>(seg) - m);
    return;
  }
  sum_in_rank_order(own, rank, world, part);
  if (mean_prefix > 0) own.narrow(0, 0, mean_prefix).div_(static_cast<double>(world));
}

// Every rank's segment of `flat` is copied into the others' `flat`.
void exchange_all_gather(const Pg& pg, at::Tensor& flat, uint32_t rank, uint32_t world) {
  const int64_t seg = flat.numel() / world;
  exchange(
      pg, "all_gather", 3, rank, world, [&](uint32_t) { return flat.narrow(0, rank * seg, seg); },
      [&](uint32_t q) { return flat.narrow(0, q * seg, seg); });
}

// The whole of `flat` becomes the SUM over ranks (any size). At world 2 one exchange of the
// buffer; larger worlds reduce-scatter and all-gather when the buffer divides into segments,
// which moves 2 (world - 1) / world of it instead of world - 1. The sums are the same bits.
// `scratch` holds world - 1 buffers of `flat`'s size.
void exchange_all_reduce(const Pg& pg, at::Tensor& flat, at::Tensor& scratch, uint32_t rank,
                         uint32_t world) {
  const int64_t n = flat.numel();
  if (world > 2 && n % world == 0 && n >= int64_t{1} << 16) {
    exchange_reduce_scatter(pg, flat, scratch, rank, world);
    exchange_all_gather(pg, flat, rank, world);
    return;
  }
  auto part = [&](uint32_t q) { return scratch.narrow(0, slot_of(q, rank) * n, n); };
  exchange(
      pg, "all_reduce", 4, rank, world, [&](uint32_t) { return flat; }, part);
  sum_in_rank_order(flat, rank, world, part);
}

// Gathers every rank's `slice` (contiguous, not aliasing `out`) into `out` along dim 0.
void all_gather(const Pg& pg, at::Tensor& out, at::Tensor& slice) {
  run_collective("all_gather", pg, [&] { return pg->_allgather_base(out, slice); });
}

// Local has-grad flags -> rank-symmetric flags (MAX over ranks), as bool on `device`. Stacked
// from a one and a zero made on the device (fills, not copies): a mask built in host memory
// and copied would be a pageable host-to-device copy inside the step, which waits for the
// device. NCCL reduces device tensors only.
at::Tensor global_mask(const Pg& pg, const std::vector<at::Tensor>& params,
                       const at::Device& device) {
  const auto opts = at::TensorOptions().dtype(at::kInt).device(device);
  const at::Tensor one = at::ones({}, opts);
  const at::Tensor zero = at::zeros({}, opts);
  std::vector<at::Tensor> flags;
  flags.reserve(params.size());
  for (const auto& p : params) flags.push_back(p.grad().defined() ? one : zero);
  at::Tensor mask = at::stack(flags);
  if (pg) all_reduce(pg, mask, c10d::ReduceOp::MAX);
  return mask.gt(0);
}

constexpr std::array<std::array<double, 3>, 5> kPolarExpress{{
    {8.156554524902461, -22.48329292557795, 15.878769915207462},
    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
}};
constexpr std::array<double, 3> kNewtonSchulz{3.4445, -4.7750, 2.0315};

at::Tensor frobenius(const at::Tensor& x) {
  return at::linalg_vector_norm(x, 2, at::IntArrayRef{-2, -1}, /*keepdim=*/true);
}

// One entry of a state dict while it is being collected: `value` is the live tensor.
using Entries = std::vector<OptimizerStateEntry>;

void load_entries(const std::string& kind, uint32_t rank, uint32_t world, const Entries& live,
                  const OptimizerState& state) {
  MEGACPP_CHECK(state.kind == kind, ErrorKind::kInvalidArgument,
                fmt::format("state dict of kind '{}' loaded into {}", state.kind, kind));
  MEGACPP_CHECK(state.rank == rank && state.world == world, ErrorKind::kInvalidArgument,
                fmt::format("state dict of rank {}/{} loaded into rank {}/{}", state.rank,
                            state.world, rank, world));
  MEGACPP_CHECK(state.entries.size() == live.size(), ErrorKind::kInvalidArgument,
                fmt::format("state dict has {} entries, the optimizer {}", state.entries.size(),
                            live.size()));
  for (size_t i = 0; i < live.size(); ++i) {
    const auto& in = state.entries[i];
    const auto& to = live[i];
    MEGACPP_CHECK(in.key == to.key && in.value.defined() && in.value.sizes() == to.value.sizes() &&
                      in.offset == to.offset && in.full_shape == to.full_shape &&
                      in.replicated == to.replicated,
                  ErrorKind::kInvalidArgument,
                  fmt::format("state entry {} ('{}') does not match the optimizer's '{}'", i,
                              entry_name(in.key), entry_name(to.key)));
  }
  at::NoGradGuard ng;
  for (size_t i = 0; i < live.size(); ++i) {
    at::Tensor dst = live[i].value;
    dst.copy_(state.entries[i].value);
  }
}

void add_scalar_entry(Entries& out, StateKey key, const at::Tensor& t) {
  out.push_back(OptimizerStateEntry{
      .key = key, .value = t, .full_shape = {}, .offset = 0, .replicated = true});
}

StateKey param_key(size_t param, StateField field) {
  return StateKey::of_param(static_cast<uint32_t>(param), field);
}
StateKey group_key(size_t group, StateField field) {
  return StateKey::of_group(static_cast<uint32_t>(group), field);
}
StateKey stack_key(size_t group, size_t stack, StateField field) {
  return StateKey::of_stack(static_cast<uint32_t>(group), static_cast<uint32_t>(stack), field);
}

void rank_and_world(const Pg& pg, uint32_t& rank, uint32_t& world) {
  rank = pg ? static_cast<uint32_t>(pg->getRank()) : 0;
  world = pg ? static_cast<uint32_t>(pg->getSize()) : 1;
}

}  // namespace

std::string_view field_name(StateField field) {
  switch (field) {
    case StateField::kExpAvg:
      return "exp_avg";
    case StateField::kExpAvgSq:
      return "exp_avg_sq";
    case StateField::kStep:
      return "step";
    case StateField::kMomentum:
      return "momentum";
    case StateField::kSecondMomentum:
      return "second_momentum";
    case StateField::kLr:
      return "lr";
    case StateField::kBeta1:
      return "beta1";
    case StateField::kBeta2:
      return "beta2";
    case StateField::kEps:
      return "eps";
    case StateField::kWeightDecay:
      return "weight_decay";
  }
  MEGACPP_FAIL(ErrorKind::kInternal, "unknown optimizer state field {}", static_cast<int>(field));
}

std::string entry_name(const StateKey& key) {
  switch (key.scope) {
    case StateScope::kParam:
      return fmt::format("p{}.{}", key.param, field_name(key.field));
    case StateScope::kGroup:
      return fmt::format("g{}.{}", key.group, field_name(key.field));
    case StateScope::kStack:
      return fmt::format("g{}.s{}.{}", key.group, key.stack, field_name(key.field));
  }
  MEGACPP_FAIL(ErrorKind::kInternal, "unknown optimizer state scope {}",
               static_cast<int>(key.scope));
}

namespace detail {

namespace {

// Both contiguous CPU tensors of one shape and dtype, float32 or bfloat16: what the fused loops
// of ops/optim_kernels.h take.
bool fusable(const at::Tensor& x, const at::Tensor& y) {
  return x.is_cpu() && y.is_cpu() && x.scalar_type() == y.scalar_type() &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous() &&
         y.is_contiguous() && x.sizes() == y.sizes();
}

template <typename T>
T* data_of(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// `b * A + c * AA`, the same bits; A (a temporary) is overwritten when fused.
at::Tensor fused_scaled_sum(at::Tensor A, const at::Tensor& AA, double b, double c) {
  if (!fusable(A, AA)) return b * A + c * AA;
  const auto n = static_cast<size_t>(A.numel());
  const auto fb = static_cast<float>(b), fc = static_cast<float>(c);
  if (A.scalar_type() == at::kFloat)
    ops::scaled_sum(data_of<float>(A), data_of<float>(AA), fb, fc, n);
  else
    ops::scaled_sum(data_of<uint16_t>(A), data_of<uint16_t>(AA), fb, fc, n);
  return A;
}

// `a * x + y`, the same bits; x (a temporary) is overwritten when fused.
at::Tensor fused_scale_add(at::Tensor x, const at::Tensor& y, double a) {
  if (!fusable(x, y)) return a * x + y;
  const auto n = static_cast<size_t>(x.numel());
  if (x.scalar_type() == at::kFloat)
    ops::scale_add(data_of<float>(x), data_of<float>(y), static_cast<float>(a), n);
  else
    ops::scale_add(data_of<uint16_t>(x), data_of<uint16_t>(y), static_cast<float>(a), n);
  return x;
}

// x @ y, into `out` when it is given (a buffer reused across iterations: freeing a product of
// 128 KiB and more each time costs glibc a consolidation of its free lists). Batches of
// matrices go to bmm directly: matmul folds a batch of one into a single matrix product,
// which copies a transposed operand first (3x the product's time at 512 x 128). The same bits
// either way.
at::Tensor product(const at::Tensor& x, const at::Tensor& y, at::Tensor* out = nullptr) {
  if (x.dim() != 3 || y.dim() != 3) return x.matmul(y);
  if (out == nullptr) return at::bmm(x, y);
  if (!out->defined()) *out = at::empty({x.size(0), x.size(1), y.size(2)}, x.options());
  return at::bmm_out(*out, x, y);
}

}  // namespace

// Every element-wise step after the normalization writes into a temporary of its own (x is a
// fresh tensor from the division on), through the fused loops where they apply.
at::Tensor orthogonalize(const at::Tensor& g, Orthogonalizer which, int steps, bool bf16) {
  at::Tensor x = bf16 ? g.to(at::kBFloat16) : g;
  const bool tall = g.size(-2) > g.size(-1);
  // Each iteration's three products land in these (B is A, overwritten by the fused sum).
  at::Tensor gram, square, next;
  if (which == Orthogonalizer::kNewtonSchulz) {
    const auto [a, b, c] = kNewtonSchulz;
    if (tall) x = x.transpose(-2, -1);
    x = x / (frobenius(x) + 1e-7);
    for (int i = 0; i < steps; ++i) {
      at::Tensor A = product(x, x.transpose(-2, -1), &gram);
      at::Tensor B = fused_scaled_sum(A, product(A, A, &square), b, c);
      x = fused_scale_add(x, product(B, x, &next), a);
    }
    return tall ? x.transpose(-2, -1) : x;
  }
  x = x / (frobenius(x) * 1.02 + 1e-6);
  for (int i = 0; i < steps; ++i) {
    const auto [a, b, c] = kPolarExpress[static_cast<size_t>(i)];
    if (tall) {
      at::Tensor A = product(x.transpose(-2, -1), x, &gram);
      const at::Tensor B = fused_scaled_sum(A, product(A, A, &square), b, c);
      x = fused_scale_add(x, product(x, B, &next), a);
    } else {
      at::Tensor A = product(x, x.transpose(-2, -1), &gram);
      const at::Tensor B = fused_scaled_sum(A, product(A, A, &square), b, c);
      x = fused_scale_add(x, product(B, x, &next), a);
    }
  }
  return x;
}

}  // namespace detail

// =======================================================================================
// DistAdamW

struct DistAdamW::Group {
  AdamWScalars s;
};

struct DistAdamW::Param {
  at::Tensor p;
  size_t group = 0;
  bool sharded = false;
  int64_t rows = 0;  // rows owned per rank when sharded
  at::Tensor exp_avg, exp_avg_sq, step;
};

DistAdamW::DistAdamW(std::vector<AdamWParamGroup> groups, Pg pg, DistAdamWOptions options)
    : pg_(std::move(pg)) {
  rank_and_world(pg_, rank_, world_);
  MEGACPP_CHECK(!groups.empty(), ErrorKind::kInvalidArgument, "DistAdamW without groups");
  MEGACPP_CHECK(options.crossover_numel >= 0, ErrorKind::kInvalidArgument,
                "DistAdamW crossover_numel must be >= 0");
  std::optional<at::Device> device;
  at::NoGradGuard ng;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& g = groups[gi];
    MEGACPP_CHECK(!g.params.empty(), ErrorKind::kInvalidArgument,
                  fmt::format("DistAdamW group {} has no parameters", gi));
    for (const auto& p : g.params) {
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
      params_.push_back(std::move(q));
    }
    Group grp;
    grp.s.lr = scalar_tensor(g.lr, *device);
    grp.s.beta1 = scalar_tensor(g.beta1, *device);
    grp.s.beta2 = scalar_tensor(g.beta2, *device);
    grp.s.eps = scalar_tensor(g.eps, *device);
    grp.s.weight_decay = scalar_tensor(g.weight_decay, *device);
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
}
bool DistAdamW::is_sharded(size_t index) const {
  return params_.at(index).sharded;
}

bool DistAdamW::exchanges_by_point_to_point() const {
  return pg_ && world_ > 1 && is_gloo(pg_) &&
         std::all_of(params_.begin(), params_.end(),
                     [](const Param& q) { return q.p.scalar_type() == at::kFloat; });
}

void DistAdamW::pack_bucket() {
  const auto n = static_cast<int64_t>(params_.size());
  int64_t total = n;
  for (const auto& q : params_) total += q.p.numel();
  const auto opts = params_.front().p.options().dtype(at::kFloat).requires_grad(false);
  if (bucket_.numel() != total) {
    bucket_ = at::empty({total}, opts);
    bucket_scratch_ = at::empty({total * (world_ - 1)}, opts);
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
  // On Gloo every gradient and the has-grad flags travel in one buffer, all-reduced by one
  // exchange (summed in rank order, so a parameter's sums do not depend on what else is in
  // the buffer: the sharded placement and its replicated mirror agree bit for bit) or by the
  // caller's (pack_for_exchange); a sharded parameter then steps its own rows and all-gathers
  // them. Elsewhere one has-grad mask, then one collective per parameter.
  const bool p2p = exchanges_by_point_to_point();
  const auto n = static_cast<int64_t>(params_.size());
  at::Tensor mask;
  at::Tensor bucket;
  if (p2p) {
    if (!packed_) {
      pack_bucket();
      exchange_all_reduce(pg_, bucket_, bucket_scratch_, rank_, world_);
    }
    packed_ = false;
    bucket = bucket_;
    mask = bucket.narrow(0, 0, n) > 0;
  } else {
    std::vector<at::Tensor> ps;
    ps.reserve(params_.size());
    for (const auto& q : params_) ps.push_back(q.p);
    mask = global_mask(pg_, ps, params_.front().p.device());
  }
  clock.lap(&OptimizerPhaseTimes::reduce);

  // On the CPU, when every parameter had a gradient somewhere and no group decays (the
  // recipes' default), the update runs in place (DistMuon::begin_update says why it is
  // exact). One host read of the mask and the decays per step.
  bool in_place = mask.is_cpu() && mask.all().item<bool>();
  for (const Param& q : params_)
    in_place = in_place && q.p.scalar_type() == at::kFloat &&
               groups_[q.group].s.weight_decay.item<float>() == 0.0f;

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
      at::Tensor full = grad.defined() ? grad.detach().to(q.p.dtype()).contiguous().clone()
                                       : at::zeros_like(q.p.detach());
      if (q.sharded) {
        g = reduce_scatter_sum(pg_, full, rank_, world_);
        p_owned = q.p.detach().narrow(0, rank_ * q.rows, q.rows);
      } else {
        if (pg_ && world_ > 1) all_reduce(pg_, full, c10d::ReduceOp::SUM);
        g = full;
        p_owned = q.p.detach();
      }
    }
    if (world_ > 1) g = g / static_cast<double>(world_);
    clock.lap(&OptimizerPhaseTimes::reduce);

    const at::Tensor m = mask[static_cast<int64_t>(i)];
    if (in_place) {
      // The same operations on the same operands as below, in place and without the selects
      // (m is true; the decay factor 1 - lr * 0 is exactly 1): the same bits.
      q.step.add_(1.0);
      const at::Tensor tc = q.step.clamp_min(1.0);
      q.exp_avg.lerp_(g, 1 - s.beta1);
      q.exp_avg_sq.lerp_(g.square(), 1 - s.beta2);
      const at::Tensor bias1 = 1 - s.beta1.pow(tc);
      const at::Tensor bias2 = 1 - s.beta2.pow(tc);
      at::Tensor step = (q.exp_avg_sq / bias2).sqrt_().add_(s.eps);
      at::div_out(step, q.exp_avg, step);
      p_owned.sub_(step.mul_(s.lr / bias1));
      clock.lap(&OptimizerPhaseTimes::update);
    } else {
      const at::Tensor g32 = g.to(at::kFloat);
      const at::Tensor p32 = p_owned.to(at::kFloat);
      const at::Tensor t = q.step + m.to(at::kFloat);
      const at::Tensor tc = t.clamp_min(1.0);  // a skipped first step must not divide by zero
      at::Tensor p_new = p32 * (1 - s.lr * s.weight_decay);
      const at::Tensor ea = q.exp_avg.lerp(g32, 1 - s.beta1);
      const at::Tensor eas = q.exp_avg_sq.lerp(g32.square(), 1 - s.beta2);
      const at::Tensor bias1 = 1 - s.beta1.pow(tc);
      const at::Tensor bias2 = 1 - s.beta2.pow(tc);
      const at::Tensor denom = (eas / bias2).sqrt() + s.eps;
      p_new = p_new - (ea / denom) * (s.lr / bias1);

      p_owned.copy_(at::where(m, p_new, p32));
      q.exp_avg.copy_(at::where(m, ea, q.exp_avg));
      q.exp_avg_sq.copy_(at::where(m, eas, q.exp_avg_sq));
      q.step.copy_(t);
      clock.lap(&OptimizerPhaseTimes::update);
    }
    if (q.sharded) {
      if (p2p) {
        at::Tensor rows = q.p.detach().view({-1});
        exchange_all_gather(pg_, rows, rank_, world_);
      } else {
        at::Tensor slice = p_owned.clone();
        at::Tensor out = q.p.detach();
        all_gather(pg_, out, slice);
      }
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
    for (const at::Tensor& t : {q.exp_avg, q.exp_avg_sq, q.step}) {
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
}

// =======================================================================================
// DistMuon

struct DistMuon::Stack {
  std::vector<at::Tensor> params;
  std::vector<size_t> members;  // index of each params entry in its group's given order
  int64_t rows = 0, cols = 0, chunk = 0;
  int red_dim = -1;
  at::Tensor momentum;  // (chunk, rows, cols): this rank's entries [rank*chunk, ...)
  at::Tensor second;    // (chunk, rows, 1) or (chunk, 1, cols)
};

struct DistMuon::Group {
  MuonScalars s;
  std::vector<int64_t> qkv;
  std::vector<Stack> stacks;
};

// A stack's update between begin_update and finish_update (below).
struct DistMuon::Update {
  Group* g = nullptr;
  Stack* s = nullptr;
  int64_t owned = 0;
  at::Tensor P, m, mom, mom_new, sec;
  bool every = false, no_decay = false;
  std::vector<int64_t> slices;  // row slices, each a matrix of its own
  std::vector<at::Tensor> u_parts, p_parts, sec_parts;
  std::vector<at::Tensor> ortho;  // orthogonalize(u_parts[i]) in P's dtype (orthogonalize_all)
};

DistMuon::DistMuon(std::vector<MuonParamGroup> groups, Pg pg, DistMuonOptions options)
    : pg_(std::move(pg)), options_(options) {
  rank_and_world(pg_, rank_, world_);
  MEGACPP_CHECK(
      options_.ns_steps >= 1 && (options_.orthogonalizer == Orthogonalizer::kNewtonSchulz ||
                                 options_.ns_steps <= static_cast<int>(kPolarExpress.size())),
      ErrorKind::kInvalidArgument,
      fmt::format("DistMuon ns_steps {} out of range", options_.ns_steps));
  MEGACPP_CHECK(!groups.empty(), ErrorKind::kInvalidArgument, "DistMuon without groups");
  for (auto& g : groups) add_param_group(std::move(g));
}

DistMuon::~DistMuon() = default;

void DistMuon::add_param_group(MuonParamGroup group) {
  const size_t gi = groups_.size();
  MEGACPP_CHECK(!group.params.empty(), ErrorKind::kInvalidArgument,
                fmt::format("DistMuon group {} has no parameters", gi));
  const at::Tensor& first = group.params.front();
  for (size_t i = 0; i < group.params.size(); ++i) {
    const at::Tensor& p = group.params[i];
    MEGACPP_CHECK(p.defined(), ErrorKind::kInvalidArgument,
                  fmt::format("DistMuon group {} parameter {} is undefined", gi, i));
    MEGACPP_CHECK(p.dim() == 2, ErrorKind::kInvalidArgument,
                  fmt::format("DistMuon takes 2-D parameters only: group {} parameter {} has "
                              "shape {} ({}-D); give it to AdamW or reshape it to a matrix",
                              gi, i, shape_str(p.sizes()), p.dim()));
    MEGACPP_CHECK(p.is_floating_point() && p.is_contiguous() && p.device() == first.device() &&
                      p.scalar_type() == first.scalar_type(),
                  ErrorKind::kInvalidArgument,
                  fmt::format("DistMuon group {}: parameters must be contiguous floating-point "
                              "tensors of one dtype and device",
                              gi));
    if (!groups_.empty()) {
      const at::Tensor& any = groups_.front().stacks.front().params.front();
      MEGACPP_CHECK(p.device() == any.device(), ErrorKind::kInvalidArgument,
                    "DistMuon parameters on different devices");
    }
    if (!group.qkv_split_sizes.empty()) {
      int64_t sum = 0;
      for (int64_t v : group.qkv_split_sizes) {
        MEGACPP_CHECK(v > 0, ErrorKind::kInvalidArgument, "qkv_split_sizes must be positive");
        sum += v;
      }
      MEGACPP_CHECK(sum == p.size(0), ErrorKind::kInvalidArgument,
                    fmt::format("qkv_split_sizes sum to {} but group {} parameter {} has shape {}",
                                sum, gi, i, shape_str(p.sizes())));
    }
  }
  Group g;
  const at::Device device = first.device();
  g.s.lr = scalar_tensor(group.lr, device);
  g.s.momentum = scalar_tensor(group.momentum, device);
  g.s.beta2 = scalar_tensor(group.beta2, device);
  g.s.weight_decay = scalar_tensor(group.weight_decay, device);
  g.qkv = group.qkv_split_sizes;
  std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> by_shape;  // sorted shapes
  for (size_t i = 0; i < group.params.size(); ++i)
    by_shape[{group.params[i].size(0), group.params[i].size(1)}].push_back(i);
  for (auto& [shape, members] : by_shape) {
    Stack s;
    s.rows = shape.first;
    s.cols = shape.second;
    for (size_t i : members) s.params.push_back(group.params[i]);
    s.members = std::move(members);
    const auto n = static_cast<int64_t>(s.params.size());
    s.chunk = options_.replicated ? n : (n + world_ - 1) / world_;
    s.red_dim = !g.qkv.empty() || s.rows >= s.cols ? -1 : -2;
    const auto opts = first.options().requires_grad(false);
    s.momentum = at::zeros({s.chunk, s.rows, s.cols}, opts);
    s.second = s.red_dim == -1 ? at::zeros({s.chunk, s.rows, 1}, opts)
                               : at::zeros({s.chunk, 1, s.cols}, opts);
    g.stacks.push_back(std::move(s));
  }
  groups_.push_back(std::move(g));
}

size_t DistMuon::num_groups() const {
  return groups_.size();
}
size_t DistMuon::num_stacks(size_t group) const {
  return groups_.at(group).stacks.size();
}
int64_t DistMuon::chunk_size(size_t group, size_t stack) const {
  return groups_.at(group).stacks.at(stack).chunk;
}
std::vector<size_t> DistMuon::stack_members(size_t group, size_t stack) const {
  return groups_.at(group).stacks.at(stack).members;
}
int64_t DistMuon::stack_len(size_t group, size_t stack) const {
  return static_cast<int64_t>(groups_.at(group).stacks.at(stack).params.size());
}
MuonScalars& DistMuon::scalars(size_t group) {
  return groups_.at(group).s;
}
void DistMuon::set_lr(size_t group, double lr) {
  groups_.at(group).s.lr.fill_(lr);
}
void DistMuon::set_momentum(size_t group, double m) {
  groups_.at(group).s.momentum.fill_(m);
}
void DistMuon::set_weight_decay(size_t group, double wd) {
  groups_.at(group).s.weight_decay.fill_(wd);
}

// One step of every stack with two collectives for all of them: the stacked gradients of every
// stack share one buffer laid out rank-major — rank q's segment holds entries [q*c, (q+1)*c) of
// each stack, c = ceil(n / world) — so a single reduce-scatter hands each rank the gradients of
// the entries it owns, and a single all-gather of the segments returns every updated entry.
// The replicated placement all-reduces the same buffer and reads every segment.
//
// On Gloo those are the point-to-point exchanges above, and every segment also carries each
// rank's has-grad flags for all entries (1 or 0; summed, > 0 is "some rank had one"), so the
// mask needs no collective of its own. Elsewhere the backend's native collectives, after a
// has-grad mask of their own. The buffers are allocated once and reused: a step allocates
// nothing of their size.
void DistMuon::step(OptimizerPhaseTimes* times, std::span<const at::Tensor> riders) {
  at::NoGradGuard ng;
  PhaseClock clock(times);
  std::vector<at::Tensor> all;
  for (const Group& g : groups_)
    for (const Stack& s : g.stacks) all.insert(all.end(), s.params.begin(), s.params.end());
  const bool distributed = pg_ && world_ > 1;
  const bool sharded = !options_.replicated && distributed;
  const bool p2p = distributed && is_gloo(pg_);
  const at::Device device = all.front().device();
  at::Tensor mask = p2p ? at::Tensor() : global_mask(pg_, all, device);

  struct Slot {
    Group* g;
    Stack* s;
    int64_t n, c, numel, off, base;  // entries, entries per segment, entry size, offsets
  };
  std::vector<Slot> slots;
  int64_t seg = 0, base = 0;
  for (Group& g : groups_) {
    for (Stack& s : g.stacks) {
      const auto n = static_cast<int64_t>(s.params.size());
      const int64_t c = (n + world_ - 1) / world_;
      slots.push_back({&g, &s, n, c, s.rows * s.cols, seg, base});
      seg += c * s.rows * s.cols;
      base += n;
    }
  }
  const int64_t flags = p2p ? base : 0;  // per segment, after its entries
  int64_t rider_numel = 0;
  for (const at::Tensor& r : riders) {
    MEGACPP_CHECK(
        r.dim() == 1 && r.is_contiguous() && r.scalar_type() == at::kFloat && r.device() == device,
        ErrorKind::kInvalidArgument,
        "DistMuon riders must be contiguous 1-D float32 tensors on the parameters' device");
    rider_numel += r.numel();
  }
  const int64_t ride = p2p ? rider_numel : 0;  // per segment, after the flags
  const int64_t stride = seg + flags + ride;
  const auto opts = all.front().options().requires_grad(false);
  if (grad_buf_.numel() != stride * world_) {
    // Padding entries are zero from here on: packing never writes them, and sums and copies
    // of zeros keep them zero.
    grad_buf_ = at::zeros({stride * world_}, opts);
    param_buf_ = sharded ? at::zeros({seg * world_}, opts) : at::Tensor();
    recv_buf_ = p2p ? at::empty({stride * (world_ - 1)}, opts) : at::Tensor();
  }
  at::Tensor& flat = grad_buf_;
  std::vector<float> had(static_cast<size_t>(flags), 0.0f);
  for (const Slot& sl : slots) {
    for (int64_t i = 0; i < sl.n; ++i) {
      const at::Tensor& grad = sl.s->params[static_cast<size_t>(i)].grad();
      const int64_t at_ = (i / sl.c) * stride + sl.off + (i % sl.c) * sl.numel;
      at::Tensor dst = flat.narrow(0, at_, sl.numel);
      if (grad.defined()) {
        dst.copy_(grad.detach().reshape({-1}));
        if (p2p) had[static_cast<size_t>(sl.base + i)] = 1.0f;
      } else {
        dst.zero_();
      }
    }
  }
  if (p2p) {
    const at::Tensor local =
        at::from_blob(had.data(), {flags}, at::TensorOptions().dtype(at::kFloat)).to(opts);
    for (uint32_t q = 0; q < world_; ++q) {
      flat.narrow(0, q * stride + seg, flags).copy_(local);
      int64_t at_ = q * stride + seg + flags;
      for (const at::Tensor& r : riders) {
        flat.narrow(0, at_, r.numel()).copy_(r);
        at_ += r.numel();
      }
    }
  } else if (distributed) {
    for (const at::Tensor& r : riders) {
      at::Tensor t = r;
      all_reduce(pg_, t, c10d::ReduceOp::SUM);
    }
  }
  // After the reduction: the riders' sums, out of segment `q` of the reduced buffer.
  auto unload_riders = [&](uint32_t q) {
    int64_t at_ = q * stride + seg + flags;
    for (const at::Tensor& r : riders) {
      at::Tensor(r).copy_(flat.narrow(0, at_, r.numel()));
      at_ += r.numel();
    }
  };
  at::Tensor mine = flat;  // sharded: this rank's segment; otherwise the whole buffer
  if (sharded) {
    if (p2p) {
      exchange_reduce_scatter(pg_, flat, recv_buf_, rank_, world_, /*mean_prefix=*/seg);
      mask = flat.narrow(0, rank_ * stride + seg, flags) > 0;
      unload_riders(rank_);
      mine = flat.narrow(0, rank_ * stride, stride);
    } else {
      mine = reduce_scatter_sum(pg_, flat, rank_, world_) / static_cast<double>(world_);
    }
  } else if (distributed) {
    if (p2p) {
      exchange_reduce_scatter(pg_, flat, recv_buf_, rank_, world_);
      exchange_all_gather(pg_, flat, rank_, world_);
      mask = flat.narrow(0, seg, flags) > 0;
      unload_riders(0);
    } else {
      all_reduce(pg_, flat, c10d::ReduceOp::SUM);
    }
    mine = flat.div_(static_cast<double>(world_));
  }
  clock.lap(&OptimizerPhaseTimes::reduce);

  // Every stack's element-wise math before the orthogonalization, the orthogonalization of
  // all of them together, then every stack's math after it (phases `update`, `orthogonalize`).
  at::Tensor out_seg = sharded ? param_buf_.narrow(0, rank_ * seg, seg) : at::Tensor();
  std::vector<Update> updates;
  std::vector<const Slot*> updated_slots;
  for (const Slot& sl : slots) {
    const int64_t start = sharded ? rank_ * sl.c : 0;
    const int64_t owned = std::clamp<int64_t>(sl.n - start, 0, sharded ? sl.c : sl.n);
    if (owned == 0) continue;
    at::Tensor grad;
    if (sharded) {
      grad = mine.narrow(0, sl.off, owned * sl.numel);
    } else {
      std::vector<at::Tensor> parts;
      for (int64_t q = 0; q * sl.c < sl.n; ++q)
        parts.push_back(
            mine.narrow(0, q * stride + sl.off, std::min(sl.c, sl.n - q * sl.c) * sl.numel));
      grad = at::cat(parts);
    }
    grad = grad.view({owned, sl.s->rows, sl.s->cols});
    updates.push_back(
        begin_update(*sl.g, *sl.s, grad, mask.narrow(0, sl.base + start, owned), start, owned));
    updated_slots.push_back(&sl);
  }
  clock.lap(&OptimizerPhaseTimes::update);
  orthogonalize_all(updates);
  clock.lap(&OptimizerPhaseTimes::orthogonalize);
  for (size_t k = 0; k < updates.size(); ++k) {
    const Slot& sl = *updated_slots[k];
    at::Tensor dest =
        sharded ? out_seg.narrow(0, sl.off, updates[k].owned * sl.numel) : at::Tensor();
    const at::Tensor updated = finish_update(updates[k], dest);
    if (sharded) {
      if (!updated.is_same(dest)) dest.copy_(updated.reshape({-1}));
    } else {
      for (int64_t i = 0; i < updates[k].owned; ++i)
        sl.s->params[static_cast<size_t>(i)].detach().copy_(updated[i]);
    }
  }
  clock.lap(&OptimizerPhaseTimes::update);
  if (!sharded) return;
  clock = PhaseClock(times);
  at::Tensor gathered = param_buf_;
  if (p2p) {
    exchange_all_gather(pg_, gathered, rank_, world_);
  } else {
    at::Tensor slice = out_seg.clone();  // the native all-gather's input must not alias it
    all_gather(pg_, gathered, slice);
  }
  for (const Slot& sl : slots) {
    for (int64_t i = 0; i < sl.n; ++i) {
      const int64_t at_ = (i / sl.c) * seg + sl.off + (i % sl.c) * sl.numel;
      sl.s->params[static_cast<size_t>(i)].detach().view({-1}).copy_(
          gathered.narrow(0, at_, sl.numel));
    }
  }
  clock.lap(&OptimizerPhaseTimes::gather);
}

// A stack's update in two halves around the orthogonalization, which step() runs for every
// stack at once (orthogonalize_all): `owned` entries starting at entry `start` (their state is
// rows [0, owned) of the stack's state tensors), from their averaged gradients [owned, rows,
// cols] (a scratch view this may overwrite); `mask` says which of them some rank had a
// gradient for. finish_update returns the new values.
//
// On the CPU, when every entry had a gradient somewhere (the usual step) and the weight decay
// is 0 (the recipes' default), the same arithmetic runs in place and without the masks'
// selects: each kept operation is the one the general path runs, on the same operands, so the
// results are the same bits (but for the sign of a parameter that is exactly zero before and
// after). Elsewhere the decisions stay on tensors: no host synchronisation on a device.

DistMuon::Update DistMuon::begin_update(Group& g, Stack& s, const at::Tensor& gr,
                                        const at::Tensor& mask, int64_t start, int64_t owned) {
  Update u;
  u.g = &g;
  u.s = &s;
  u.owned = owned;
  std::vector<at::Tensor> mine(s.params.begin() + start, s.params.begin() + start + owned);
  for (auto& t : mine) t = t.detach();
  // One entry (a rank's share of a small stack) is a view of the parameter: no copy.
  u.P = owned == 1 ? mine.front().unsqueeze(0) : at::stack(mine);
  u.m = mask.view({owned, 1, 1});
  const bool host = u.m.is_cpu();
  u.every = host && u.m.all().item<bool>();
  u.no_decay = host && g.s.weight_decay.item<float>() == 0.0f;
  u.mom = s.momentum.narrow(0, 0, owned);
  u.sec = s.second.narrow(0, 0, owned);
  const at::Tensor mu = g.s.momentum.to(u.P.scalar_type());

  // Nesterov momentum.
  u.mom_new = u.every ? u.mom.lerp_(gr, 1 - mu) : u.mom.lerp(gr, 1 - mu);
  at::Tensor upd = at::Tensor(gr).lerp_(u.mom_new, mu);

  // Each matrix, or each row slice of a split group, is a matrix of its own from here on:
  // orthogonalized alone, variance-reduced preserving its own Frobenius norm, and stepped with
  // the lr scale of its own shape. The second moment of a split group is per row (each row
  // lies in one slice), so its slices share the state tensor without sharing a statistic.
  u.slices = g.qkv.empty() ? std::vector<int64_t>{s.rows} : std::vector<int64_t>(g.qkv);
  // Slices of one size (q, k and v without grouped-query attention) are matrices of one
  // stack: on the in-place path they go through each part below once, as [owned x slices]
  // matrices, instead of once per slice.
  const bool uniform = u.every && u.no_decay && u.slices.size() > 1 &&
                       std::all_of(u.slices.begin(), u.slices.end(),
                                   [&](int64_t r) { return r == u.slices.front(); });
  at::Tensor Pv = u.P, sec = u.sec;
  if (uniform) {
    const auto k = static_cast<int64_t>(u.slices.size());
    const int64_t r = u.slices.front();
    upd = upd.view({owned * k, r, s.cols});
    Pv = u.P.view({owned * k, r, s.cols});
    sec = sec.view({owned * k, r, 1});
    u.slices = {r};
  }
  u.u_parts = upd.split_with_sizes(u.slices, -2);
  u.p_parts = Pv.split_with_sizes(u.slices, -2);
  u.sec_parts = s.red_dim == -1 ? sec.split_with_sizes(u.slices, -2) : std::vector<at::Tensor>{sec};
  return u;
}

// Orthogonalizes the u_parts of every update, matrices of one shape together: the batched
// products compute each matrix as they would alone (the same bits), in fewer, larger calls.
void DistMuon::orthogonalize_all(std::vector<Update>& updates) const {
  std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<size_t, size_t>>> by_shape;
  for (size_t k = 0; k < updates.size(); ++k) {
    updates[k].ortho.resize(updates[k].u_parts.size());
    for (size_t i = 0; i < updates[k].u_parts.size(); ++i) {
      const at::Tensor& part = updates[k].u_parts[i];
      by_shape[{part.size(-2), part.size(-1)}].push_back({k, i});
    }
  }
  for (const auto& [shape, members] : by_shape) {
    std::vector<at::Tensor> parts;
    for (const auto& [k, i] : members) parts.push_back(updates[k].u_parts[i]);
    const at::Tensor out = detail::orthogonalize(parts.size() == 1 ? parts.front() : at::cat(parts),
                                                 options_.orthogonalizer, options_.ns_steps,
                                                 options_.bf16_orthogonalization);
    int64_t at_ = 0;
    for (const auto& [k, i] : members) {
      const int64_t n = updates[k].u_parts[i].size(0);
      updates[k].ortho[i] = out.narrow(0, at_, n).to(updates[k].P.scalar_type());
      at_ += n;
    }
  }
}

at::Tensor DistMuon::finish_update(Update& u, at::Tensor dest) {
  const Group& g = *u.g;
  const Stack& s = *u.s;
  const at::Tensor beta2 = g.s.beta2.to(u.P.scalar_type());
  const at::Tensor wd = g.s.weight_decay.to(u.P.scalar_type());
  std::vector<at::Tensor> sec_new_parts, p_new_parts;
  for (size_t i = 0; i < u.slices.size(); ++i) {
    at::Tensor ui = u.ortho[i];

    // Variance reduction (factored second moment, norm preserving).
    const at::Tensor v_mean = ui.to(at::kFloat).square().mean(s.red_dim, /*keepdim=*/true);
    const double red_size = static_cast<double>(ui.size(s.red_dim));
    const at::Tensor v_norm = (v_mean.sum({-2, -1}, true) * red_size).sqrt();
    at::Tensor seci = u.sec_parts[s.red_dim == -1 ? i : 0];
    const at::Tensor sec_new = u.every ? seci.lerp_(v_mean.to(seci.scalar_type()), 1 - beta2)
                                       : seci.lerp(v_mean.to(seci.scalar_type()), 1 - beta2);
    const at::Tensor step_size = sec_new.clamp_min(1e-10).rsqrt();
    const at::Tensor scaled_sq_sum = (v_mean * red_size) * step_size.to(at::kFloat).square();
    const at::Tensor v_norm_new = scaled_sq_sum.sum({-2, -1}, true).sqrt();
    const at::Tensor final_scale = step_size * (v_norm / v_norm_new.clamp_min(1e-10));
    ui.mul_(final_scale.to(ui.scalar_type()));

    // Cautious weight decay (parameter-sign agreement gates the decay, never the update:
    // DESIGN.md "Decisions": the cautious gate) and the update.
    const double aspect = std::sqrt(std::max(1.0, static_cast<double>(u.slices[i]) / s.cols));
    const at::Tensor lr = (g.s.lr * aspect).to(u.P.scalar_type());
    const at::Tensor& Pi = u.p_parts[i];
    if (u.no_decay && u.every && u.slices.size() == 1 && dest.defined()) {
      // The only slice, into its destination: the subtraction's own output, no copy after.
      at::Tensor into = dest.view(Pi.sizes());
      at::sub_out(into, Pi, ui.mul_(lr));
      return dest;
    }
    if (u.no_decay) {
      p_new_parts.push_back(Pi - ui.mul_(lr));
    } else {
      const at::Tensor cautious = (ui * Pi) >= 0;
      p_new_parts.push_back(Pi - (lr * ui + lr * wd * Pi * cautious));
    }
    sec_new_parts.push_back(sec_new);
  }
  const at::Tensor P_new =
      p_new_parts.size() == 1 ? p_new_parts[0].view(u.P.sizes()) : at::cat(p_new_parts, -2);
  at::Tensor out = P_new;
  if (!u.every) {
    const at::Tensor sec_new =
        sec_new_parts.size() == 1 ? sec_new_parts[0] : at::cat(sec_new_parts, -2);
    u.mom.copy_(at::where(u.m, u.mom_new, u.mom));
    u.sec.copy_(at::where(u.m, sec_new, u.sec));
    out = at::where(u.m, P_new, u.P);
  }
  return out;
}

OptimizerState DistMuon::state_dict() const {
  OptimizerState s = state_view();
  for (auto& e : s.entries) e.value = e.value.detach().clone();
  return s;
}

OptimizerState DistMuon::state_view() const {
  Entries live;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    for (size_t si = 0; si < g.stacks.size(); ++si) {
      const Stack& s = g.stacks[si];
      const int64_t padded = options_.replicated ? s.chunk : s.chunk * world_;
      const int64_t off = options_.replicated ? 0 : rank_ * s.chunk;
      live.push_back(OptimizerStateEntry{.key = stack_key(gi, si, StateField::kMomentum),
                                         .value = s.momentum,
                                         .full_shape = {padded, s.rows, s.cols},
                                         .offset = off,
                                         .replicated = options_.replicated});
      std::vector<int64_t> second_full = s.second.sizes().vec();
      second_full[0] = padded;
      live.push_back(OptimizerStateEntry{.key = stack_key(gi, si, StateField::kSecondMomentum),
                                         .value = s.second,
                                         .full_shape = second_full,
                                         .offset = off,
                                         .replicated = options_.replicated});
    }
    add_scalar_entry(live, group_key(gi, StateField::kLr), g.s.lr);
    add_scalar_entry(live, group_key(gi, StateField::kMomentum), g.s.momentum);
    add_scalar_entry(live, group_key(gi, StateField::kBeta2), g.s.beta2);
    add_scalar_entry(live, group_key(gi, StateField::kWeightDecay), g.s.weight_decay);
  }
  return OptimizerState{.kind = "dist_muon", .rank = rank_, .world = world_, .entries = live};
}

void DistMuon::load_state_dict(const OptimizerState& state) {
  OptimizerState live = state_dict();
  size_t k = 0;
  for (Group& g : groups_) {
    for (Stack& s : g.stacks) {
      live.entries[k++].value = s.momentum;
      live.entries[k++].value = s.second;
    }
    for (const at::Tensor& t : {g.s.lr, g.s.momentum, g.s.beta2, g.s.weight_decay})
      live.entries[k++].value = t;
  }
  load_entries("dist_muon", rank_, world_, live.entries, state);
}

}  // namespace megacpp::trainer
