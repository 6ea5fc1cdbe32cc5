// megacpp::trainer exchange — the optimizer's collectives over one process group, behind one
// interface whatever carries them (README.md "Distributed optimizer").
//
// Two implementations, chosen from the group:
// - rank-ordered (a Gloo group): every element is summed x[0] + x[1] + ... + x[world-1] in
//   rank order, whatever its place in the buffer and whichever rank sums it, so the same
//   values give the same bits in any layout (a bucket of several parameters or one alone, a
//   sharded or a replicated placement) and on every rank. Each rank sends every other rank
//   what it needs and receives its own in one round; each link is chosen on its own: a peer
//   whose outbox this rank attached (the group's shared-memory peer exchange, ranks of one
//   host: ipc/peer_exchange.h) through shared memory, every other peer through the backend's
//   send and receive. The transport moves bytes and never sums, so the bits do not depend on
//   which links went which way (tested: all through Gloo, all through shared memory, and two
//   hosts of two ranks each with both kinds of link, bit for bit).
// - native (any other backend, NCCL): the backend's reduce-scatter, all-gather and all-reduce;
//   sums in the backend's order.
//
// Collective: every rank of the group calls the same operations, in the same order, with
// buffers of the same size. Buffers are contiguous and 1-D. Blocking and failure: those of
// run_collective (collective.h) and ipc::PeerExchange — a peer's failure or a timeout is an
// Error{kPeerFailure} / Error{kTimeout} naming the operation; after a failure the group is done.
// Not thread-safe: one exchange per optimizer, used from its step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace megacpp::trainer {

class Exchange {
 public:
  using Pg = c10::intrusive_ptr<c10d::Backend>;

  // The exchange over `pg`; a null group is a world of one, whose operations leave their
  // buffers as they are. Issues no collective.
  static std::unique_ptr<Exchange> over(Pg pg);

  virtual ~Exchange() = default;
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  uint32_t rank() const noexcept { return rank_; }
  uint32_t world() const noexcept { return world_; }

  // True when every sum is taken in rank order (see above): the optimizers then carry their
  // has-grad flags and riders inside the buffers they reduce instead of separate collectives.
  // False for a world of one, where nothing travels.
  virtual bool rank_ordered() const noexcept = 0;

  // `flat`'s numel divides into `world` segments, segment q being rank q's. Returns this rank's
  // segment summed over the ranks, its first `mean_prefix` elements then divided by the world:
  // a view of `flat` (rank-ordered) or a tensor of its own (native). The other segments of
  // `flat` are unspecified afterwards.
  virtual at::Tensor reduce_scatter(at::Tensor& flat, int64_t mean_prefix = 0) = 0;
  // Segment `rank` of `flat` is copied into every rank's `flat` (segments as above).
  virtual void all_gather(at::Tensor& flat) = 0;
  // `flat` (any size) becomes the sum over the ranks.
  virtual void all_reduce(at::Tensor& flat) = 0;

  // The has-grad flags of `params` made rank-symmetric (true where some rank has a gradient),
  // as bool on `device`: one all-reduce MAX through the backend.
  at::Tensor has_grad_mask(const std::vector<at::Tensor>& params, const at::Device& device) const;

 protected:
  explicit Exchange(Pg pg);
  const Pg& group() const noexcept { return pg_; }

 private:
  Pg pg_;
  uint32_t rank_ = 0;
  uint32_t world_ = 1;
};

}  // namespace megacpp::trainer
