// The optimizer's collectives (README.md "Distributed optimizer"): over Gloo, the ranks'
// shared-memory peer exchange (ipc/peer_exchange.h) or another c10d backend; declared in
// optim_internal.h.
#include <functional>
#include <string>

#include <fmt/format.h>

#include "core/error.h"
#include "ipc/peer_exchange.h"
#include "ops/optim_kernels.h"
#include "stages/trainer/collective.h"
#include "stages/trainer/optim_internal.h"

namespace megacpp::trainer::detail {

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

namespace {

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

}  // namespace

// Segment `rank` of `flat` becomes the SUM over ranks, its first `mean_prefix` elements then
// divided by the world (the mean); the other segments are left as they were.
void exchange_reduce_scatter(const Pg& pg, at::Tensor& flat, at::Tensor& scratch, uint32_t rank,
                             uint32_t world, int64_t mean_prefix) {
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

void rank_and_world(const Pg& pg, uint32_t& rank, uint32_t& world) {
  rank = pg ? static_cast<uint32_t>(pg->getRank()) : 0;
  world = pg ? static_cast<uint32_t>(pg->getSize()) : 1;
}

}  // namespace megacpp::trainer::detail
