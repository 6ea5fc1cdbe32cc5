// The optimizer's collectives (exchange.h): rank-ordered over per-link transports (shared
// memory for a peer of this host, the backend's send and receive for any other), or the
// backend's native collectives.
#include "stages/trainer/exchange.h"

#include <chrono>
#include <functional>
#include <string_view>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "core/error.h"
#include "ipc/peer_exchange.h"
#include "ops/optim_kernels.h"
#include "stages/trainer/collective.h"

namespace megacpp::trainer {

namespace {

using Pg = Exchange::Pg;

void backend_all_reduce(const Pg& pg, at::Tensor& t, c10d::ReduceOp op) {
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  run_collective("all_reduce", pg, [&] { return pg->allreduce(v, o); });
}

// Index of rank q's slot in a scratch of world - 1 slots (the own rank has none).
int64_t slot_of(uint32_t q, uint32_t rank) {
  return q < rank ? q : q - 1;
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

// A world of one: every operation leaves its buffer as it is; nothing travels, so nothing
// rides along (not rank-ordered).
class Alone final : public Exchange {
 public:
  explicit Alone(Pg pg) : Exchange(std::move(pg)) {}
  bool rank_ordered() const noexcept override { return false; }
  at::Tensor reduce_scatter(at::Tensor& flat, int64_t) override { return flat; }
  void all_gather(at::Tensor&) override {}
  void all_reduce(at::Tensor&) override {}
};

// The backend's own collectives (NCCL, or any backend but Gloo).
class Native final : public Exchange {
 public:
  explicit Native(Pg pg) : Exchange(std::move(pg)) {}
  bool rank_ordered() const noexcept override { return false; }

  at::Tensor reduce_scatter(at::Tensor& flat, int64_t mean_prefix) override {
    at::Tensor out = at::empty({flat.numel() / world()}, flat.options());
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    run_collective("reduce_scatter", group(),
                   [&] { return group()->_reduce_scatter_base(out, flat, o); });
    if (mean_prefix > 0) out.narrow(0, 0, mean_prefix).div_(static_cast<double>(world()));
    return out;
  }

  void all_gather(at::Tensor& flat) override {
    const int64_t seg = flat.numel() / world();
    // The backend's all-gather must not read what it writes.
    at::Tensor own = flat.narrow(0, rank() * seg, seg).clone();
    run_collective("all_gather", group(), [&] { return group()->_allgather_base(flat, own); });
  }

  void all_reduce(at::Tensor& flat) override {
    backend_all_reduce(group(), flat, c10d::ReduceOp::SUM);
  }
};

// Rank-ordered sums over point-to-point messages, each link through shared memory where the
// group's peer exchange reaches the peer, else through the backend's send and receive.
class RankOrdered final : public Exchange {
 public:
  explicit RankOrdered(Pg pg) : Exchange(std::move(pg)) {}
  bool rank_ordered() const noexcept override { return true; }

  // Segment `rank` of `flat` becomes the SUM over ranks, its first `mean_prefix` elements then
  // divided by the world (the mean); the other segments are left as they were.
  at::Tensor reduce_scatter(at::Tensor& flat, int64_t mean_prefix) override {
    const uint32_t rank = this->rank(), world = this->world();
    const int64_t seg = flat.numel() / world;
    at::Tensor scratch = scratch_for(seg * (world - 1), flat);
    auto part = [&](uint32_t q) { return scratch.narrow(0, slot_of(q, rank) * seg, seg); };
    exchange(
        "reduce_scatter", 2, [&](uint32_t q) { return flat.narrow(0, q * seg, seg); }, part);
    at::Tensor own = flat.narrow(0, rank * seg, seg);
    if (world == 2 && own.is_cpu() && own.scalar_type() == at::kFloat) {
      // One pass instead of two or three: a + b is b + a, and the division is the same one.
      auto* o = static_cast<float*>(own.data_ptr());
      const auto* t = static_cast<const float*>(part(1 - rank).const_data_ptr());
      const auto m = static_cast<size_t>(mean_prefix);
      ops::sum_and_divide(o, t, 2.0f, m);
      ops::sum_and_divide(o + m, t + m, 1.0f, static_cast<size_t>(seg) - m);
      return own;
    }
    sum_in_rank_order(own, rank, world, part);
    if (mean_prefix > 0) own.narrow(0, 0, mean_prefix).div_(static_cast<double>(world));
    return own;
  }

  void all_gather(at::Tensor& flat) override {
    const int64_t seg = flat.numel() / world();
    exchange(
        "all_gather", 3, [&](uint32_t) { return flat.narrow(0, rank() * seg, seg); },
        [&](uint32_t q) { return flat.narrow(0, q * seg, seg); });
  }

  // At world 2 one exchange of the buffer; larger worlds reduce-scatter and all-gather when
  // the buffer divides into segments, which moves 2 (world - 1) / world of it instead of
  // world - 1. The sums are the same bits.
  void all_reduce(at::Tensor& flat) override {
    const uint32_t rank = this->rank(), world = this->world();
    const int64_t n = flat.numel();
    if (world > 2 && n % world == 0 && n >= int64_t{1} << 16) {
      reduce_scatter(flat, 0);
      all_gather(flat);
      return;
    }
    at::Tensor scratch = scratch_for(n * (world - 1), flat);
    auto part = [&](uint32_t q) { return scratch.narrow(0, slot_of(q, rank) * n, n); };
    exchange(
        "all_reduce", 4, [&](uint32_t) { return flat; }, part);
    sum_in_rank_order(flat, rank, world, part);
  }

 private:
  // Receive space for `numel` elements of `like`'s type and device, kept from one call to the
  // next: a step allocates nothing of its buffers' size once the largest was seen.
  at::Tensor scratch_for(int64_t numel, const at::Tensor& like) {
    if (!scratch_.defined() || scratch_.numel() < numel ||
        scratch_.scalar_type() != like.scalar_type() || scratch_.device() != like.device())
      scratch_ = at::empty({numel}, like.options().requires_grad(false));
    return scratch_.narrow(0, 0, numel);
  }

  // Sends `send_to(q)` to rank q and receives `recv_from(q)` from it, for every q != rank, in
  // one round: the backend's sends and receives are issued first (its threads move them), then
  // the shared-memory transfers run on this thread, then the backend's are waited for.
  void exchange(std::string_view what, int tag, const std::function<at::Tensor(uint32_t)>& send_to,
                const std::function<at::Tensor(uint32_t)>& recv_from) {
    const uint32_t rank = this->rank(), world = this->world();
    const Pg& pg = group();
    ipc::PeerExchange* shared = peer_exchange_of(pg);
    auto via_shared_memory = [&](uint32_t q) { return shared != nullptr && shared->reaches(q); };
    std::vector<at::Tensor> keep;
    std::vector<ipc::PeerExchange::Transfer> near;
    std::vector<uint32_t> far;
    for (uint32_t k = 1; k < world; ++k) {
      const uint32_t q = (rank + k) % world;
      if (!via_shared_memory(q)) {
        far.push_back(q);
        continue;
      }
      const at::Tensor out = send_to(q), in = recv_from(q);
      MEGACPP_CHECK(out.is_cpu() && in.is_cpu() && out.is_contiguous() && in.is_contiguous(),
                    ErrorKind::kInternal,
                    fmt::format("{}: a shared-memory exchange takes contiguous CPU tensors", what));
      near.push_back({q,
                      {static_cast<const std::byte*>(out.const_data_ptr()), out.nbytes()},
                      {static_cast<std::byte*>(in.data_ptr()), in.nbytes()}});
      keep.push_back(out);
      keep.push_back(in);
    }
    // Shared memory: its failures are already typed as run_collective types the backend's
    // (peer failure, timeout, abort).
    auto exchange_near = [&] {
      if (near.empty()) return;
      shared->exchange(
          what, near,
          std::chrono::duration_cast<std::chrono::milliseconds>(pg->getBackendOptions()->timeout));
    };
    if (far.empty()) {
      exchange_near();
      return;
    }
    // `far` is in the order k = 1, 2, ...: receive from rank - k, send to rank + k, as every
    // rank posts them (a peer's send meets this rank's receive whatever the order of links).
    std::vector<std::vector<at::Tensor>> ins, outs;
    ins.reserve(far.size());
    outs.reserve(far.size());
    run_collectives(what, pg, [&] {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (uint32_t k = 1; k < world; ++k) {
        const uint32_t src = (rank + world - k) % world;
        if (via_shared_memory(src)) continue;
        ins.push_back({recv_from(src)});
        works.push_back(pg->recv(ins.back(), static_cast<int>(src), tag));
      }
      for (const uint32_t dst : far) {
        outs.push_back({send_to(dst)});
        works.push_back(pg->send(outs.back(), static_cast<int>(dst), tag));
      }
      exchange_near();
      return works;
    });
  }

  at::Tensor scratch_;
};

}  // namespace

Exchange::Exchange(Pg pg) : pg_(std::move(pg)) {
  rank_ = pg_ ? static_cast<uint32_t>(pg_->getRank()) : 0;
  world_ = pg_ ? static_cast<uint32_t>(pg_->getSize()) : 1;
}

std::unique_ptr<Exchange> Exchange::over(Pg pg) {
  if (!pg || pg->getSize() <= 1) return std::make_unique<Alone>(std::move(pg));
  if (pg->getBackendName() == "gloo") return std::make_unique<RankOrdered>(std::move(pg));
  return std::make_unique<Native>(std::move(pg));
}

// Stacked from a one and a zero made on the device (fills, not copies): a mask built in host
// memory and copied would be a pageable host-to-device copy inside the step, which waits for
// the device. NCCL reduces device tensors only.
at::Tensor Exchange::has_grad_mask(const std::vector<at::Tensor>& params,
                                   const at::Device& device) const {
  const auto opts = at::TensorOptions().dtype(at::kInt).device(device);
  const at::Tensor one = at::ones({}, opts);
  const at::Tensor zero = at::zeros({}, opts);
  std::vector<at::Tensor> flags;
  flags.reserve(params.size());
  for (const auto& p : params) flags.push_back(p.grad().defined() ? one : zero);
  at::Tensor mask = at::stack(flags);
  if (pg_) backend_all_reduce(pg_, mask, c10d::ReduceOp::MAX);
  return mask.gt(0);
}

}  // namespace megacpp::trainer
