// DistMuon (README.md "Distributed optimizer"); contract in optim.h.
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
using detail::kPolarExpress;
using detail::load_entries;
using detail::PhaseClock;
using detail::scalar_tensor;
using detail::shape_str;
using detail::stack_key;

// =======================================================================================
// DistMuon

struct DistMuon::Stack {
  std::vector<at::Tensor> params;
  std::vector<size_t> members;  // index of each params entry in its group's given order
  int64_t rows = 0, cols = 0, chunk = 0;
  int red_dim = -1;
  at::Tensor momentum;  // (chunk, rows, cols): this rank's entries [rank*chunk, ...)
  at::Tensor second;    // (chunk, rows, 1) or (chunk, 1, cols)
  at::Tensor master;    // master weights: (chunk, rows, cols) float32 of the owned entries
  // Tensor-parallel parts (MatrixPart), one per entry; empty: every entry is whole. With parts
  // rows and cols are the whole matrix's, and `master` holds the owned entries whole.
  std::vector<MatrixPart> parts;

  // Entry i's gradient into its slot of the stacked buffer (rows * cols elements): the whole
  // gradient, or the contributing blocks of this rank's part with zeros elsewhere.
  void pack(size_t i, at::Tensor dst) const {
    const at::Tensor& grad = params[i].grad();
    if (parts.empty() && grad.defined()) {
      dst.copy_(grad.detach().reshape({-1}));
      return;
    }
    dst.zero_();
    if (!grad.defined()) return;
    const MatrixPart& part = parts[i];
    const at::Tensor whole = dst.view({rows, cols});
    for (const auto& b : part.blocks) {
      if (b.contributes)
        whole.narrow(part.dim, b.full_offset, b.size)
            .copy_(grad.detach().narrow(part.dim, b.local_offset, b.size));
    }
  }
  // Entry i's new value (the whole matrix, any shape of rows * cols elements) into the
  // parameter: all of it, or the blocks of this rank's part.
  void put(size_t i, const at::Tensor& value) const {
    const at::Tensor p = params[i].detach();
    if (parts.empty()) {
      p.view({-1}).copy_(value.reshape({-1}));
      return;
    }
    const MatrixPart& part = parts[i];
    const at::Tensor whole = value.view({rows, cols});
    for (const auto& b : part.blocks)
      p.narrow(part.dim, b.local_offset, b.size)
          .copy_(whole.narrow(part.dim, b.full_offset, b.size));
  }
};

struct DistMuon::Group {
  MuonScalars s;
  bool decays = false;  // s.weight_decay != 0, known on the host (optim.h)
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
  // The state and the parameters are updated in place: on the host when every entry had a
  // gradient (`every`), on a device always, the mask then a weight (`gate`, 1 or 0 per entry).
  bool in_place = false;
  at::Tensor gate;
  // The tail goes through DistMuonOptions::fused_tail (DistMuon::fused_tail): the gated path
  // without weight decay, with float32 parameters and state.
  bool fused = false;
  // x, times the gate where there is one: a step's weight that is 0 for an entry without a
  // gradient anywhere, so lerp_ keeps its state and the update subtracts 0.
  at::Tensor gated(const at::Tensor& x) const { return gate.defined() ? x * gate : x; }
  std::vector<int64_t> slices;  // row slices, each a matrix of its own
  std::vector<at::Tensor> u_parts, p_parts, sec_parts;
  std::vector<at::Tensor> ortho;  // orthogonalize(u_parts[i]) in P's dtype (orthogonalize_all)
};

DistMuon::DistMuon(std::vector<MuonParamGroup> groups, Exchange::Pg pg, DistMuonOptions options)
    : exchange_(Exchange::over(std::move(pg))),
      options_(options),
      rank_(exchange_->rank()),
      world_(exchange_->world()) {
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
    const bool parted = !group.parts.empty();
    MEGACPP_CHECK(!parted || group.parts.size() == group.params.size(), ErrorKind::kInvalidArgument,
                  fmt::format("DistMuon group {}: {} parts for {} parameters", gi,
                              group.parts.size(), group.params.size()));
    std::vector<int64_t> whole = p.sizes().vec();
    if (parted) {
      const MatrixPart& part = group.parts[i];
      whole = part.full_shape;
      const int64_t other = 1 - part.dim;
      bool fits = whole.size() == 2 && (part.dim == 0 || part.dim == 1) &&
                  (part.blocks.empty() || p.size(other) == whole[static_cast<size_t>(other)]);
      for (const auto& b : part.blocks) {
        fits = fits && b.size > 0 && b.local_offset >= 0 && b.full_offset >= 0 &&
               b.local_offset + b.size <= p.size(part.dim) &&
               b.full_offset + b.size <= whole[static_cast<size_t>(part.dim)];
      }
      MEGACPP_CHECK(fits, ErrorKind::kInvalidArgument,
                    fmt::format("DistMuon group {} parameter {} of shape {}: its part does not "
                                "fit a matrix of shape {}",
                                gi, i, shape_str(p.sizes()), shape_str(whole)));
    }
    MEGACPP_CHECK(parted ? group.masters.size() == group.params.size() &&
                               group.masters[i].sizes().vec() == whole
                         : group.masters.empty() || (options_.master_weights &&
                                                     group.masters.size() == group.params.size() &&
                                                     group.masters[i].sizes() == p.sizes()),
                  ErrorKind::kInvalidArgument,
                  fmt::format("DistMuon group {}: masters need master_weights (or parts) and one "
                              "per parameter of its whole shape",
                              gi));
    if (!group.qkv_split_sizes.empty()) {
      int64_t sum = 0;
      for (int64_t v : group.qkv_split_sizes) {
        MEGACPP_CHECK(v > 0, ErrorKind::kInvalidArgument, "qkv_split_sizes must be positive");
        sum += v;
      }
      MEGACPP_CHECK(sum == whole[0], ErrorKind::kInvalidArgument,
                    fmt::format("qkv_split_sizes sum to {} but group {} parameter {} has shape {}",
                                sum, gi, i, shape_str(p.sizes())));
    }
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
  }
  Group g;
  const at::Device device = first.device();
  g.s.lr = scalar_tensor(group.lr, device);
  g.s.momentum = scalar_tensor(group.momentum, device);
  g.s.beta2 = scalar_tensor(group.beta2, device);
  g.s.weight_decay = scalar_tensor(group.weight_decay, device);
  g.decays = group.weight_decay != 0.0;
  g.qkv = group.qkv_split_sizes;
  const bool parted = !group.parts.empty();
  std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> by_shape;  // sorted shapes
  for (size_t i = 0; i < group.params.size(); ++i) {
    if (parted) {
      by_shape[{group.parts[i].full_shape[0], group.parts[i].full_shape[1]}].push_back(i);
    } else {
      by_shape[{group.params[i].size(0), group.params[i].size(1)}].push_back(i);
    }
  }
  for (auto& [shape, members] : by_shape) {
    Stack s;
    s.rows = shape.first;
    s.cols = shape.second;
    for (size_t i : members) {
      s.params.push_back(group.params[i]);
      if (parted) s.parts.push_back(group.parts[i]);
    }
    s.members = std::move(members);
    const auto n = static_cast<int64_t>(s.params.size());
    s.chunk = options_.replicated ? n : (n + world_ - 1) / world_;
    s.red_dim = !g.qkv.empty() || s.rows >= s.cols ? -1 : -2;
    auto opts = first.options().requires_grad(false);
    if (options_.master_weights) opts = opts.dtype(at::kFloat);
    s.momentum = at::zeros({s.chunk, s.rows, s.cols}, opts);
    s.second = s.red_dim == -1 ? at::zeros({s.chunk, s.rows, 1}, opts)
                               : at::zeros({s.chunk, 1, s.cols}, opts);
    if (options_.master_weights || parted) {
      // The entries this rank will own (step(): sharded from rank * chunk, else all).
      s.master = at::zeros({s.chunk, s.rows, s.cols}, opts);
      const int64_t start = options_.replicated ? 0 : int64_t{rank_} * s.chunk;
      const int64_t owned = std::clamp<int64_t>(n - start, 0, s.chunk);
      for (int64_t e = 0; e < owned; ++e) {
        const size_t member = s.members[static_cast<size_t>(start + e)];
        const at::Tensor& from =
            group.masters.empty() ? group.params[member] : group.masters[member];
        s.master[e].copy_(from.detach());
      }
    }
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
  groups_.at(group).decays = wd != 0.0;
}

// One step of every stack in buckets of at most options_.bucket_numel buffer elements, two
// collectives per bucket: a bucket's stacked gradients share one buffer laid out rank-major —
// rank q's segment holds, of each stack (or part of a stack) in the bucket, the entries at
// positions [lo, hi) of q's chunk [q*c, (q+1)*c), c = ceil(n / world) — so a single
// reduce-scatter hands each rank the gradients of the entries it owns, and a single all-gather
// of the segments returns every updated entry. A stack too large for a bucket is split by
// positions in the chunks, so its entries keep their owners. The replicated placement (and a
// world of one) all-reduces the same buffer and reads every segment; replicated stacks are
// never split.
//
// On Gloo those are the point-to-point exchanges above, and every segment of the first bucket
// also carries each rank's has-grad flags for all entries (1 or 0; summed, > 0 is "some rank
// had one"), so the mask needs no collective of its own, and the riders. Elsewhere the
// backend's native collectives, after a has-grad mask of their own. Every element is summed in
// rank order whatever its bucket (exchange.h), so the bucket size does not change the bits.
// The buffers are allocated once, for the largest bucket, and reused: a step allocates nothing
// of their size.
void DistMuon::step(OptimizerPhaseTimes* times, std::span<const at::Tensor> riders) {
  at::NoGradGuard ng;
  PhaseClock clock(times);
  std::vector<at::Tensor> all;
  for (const Group& g : groups_)
    for (const Stack& s : g.stacks) all.insert(all.end(), s.params.begin(), s.params.end());
  const bool distributed = world_ > 1;
  const bool sharded = !options_.replicated && distributed;
  const bool p2p = exchange_->rank_ordered();
  const at::Device device = all.front().device();
  const at::ScalarType reduce = options_.reduce_dtype.value_or(all.front().scalar_type());
  // Riders keep float32: in a buffer of another dtype they are summed on their own.
  const bool riders_inside = p2p && reduce == at::kFloat;
  const uint32_t divisor = options_.replicas > 0 ? options_.replicas : world_;
  at::Tensor mask = p2p ? at::Tensor() : exchange_->has_grad_mask(all, device);

  // A stack, or the part of one whose entries sit at positions [lo, hi) of their chunks.
  struct Slot {
    Group* g;
    Stack* s;
    int64_t n, c, lo, hi, numel, off, base;  // entries, chunk, positions, entry size, offsets
  };
  struct Bucket {
    std::vector<Slot> slots;
    int64_t seg = 0;  // elements per rank segment
  };
  std::vector<Bucket> buckets(1);
  const int64_t seg_limit = std::max<int64_t>(1, options_.bucket_numel / world_);
  int64_t base = 0;
  for (Group& g : groups_) {
    for (Stack& s : g.stacks) {
      const auto n = static_cast<int64_t>(s.params.size());
      const int64_t c = (n + world_ - 1) / world_;
      const int64_t numel = s.rows * s.cols;
      const int64_t piece = options_.replicated ? c : std::max<int64_t>(1, seg_limit / numel);
      for (int64_t lo = 0; lo < c; lo += piece) {
        const int64_t hi = std::min(c, lo + piece);
        if (buckets.back().seg > 0 && buckets.back().seg + (hi - lo) * numel > seg_limit)
          buckets.emplace_back();
        Bucket& b = buckets.back();
        b.slots.push_back({&g, &s, n, c, lo, hi, numel, b.seg, base});
        b.seg += (hi - lo) * numel;
      }
      base += n;
    }
  }
  const int64_t flags = p2p ? base : 0;  // per segment of the first bucket, after its entries
  int64_t rider_numel = 0;
  for (const at::Tensor& r : riders) {
    MEGACPP_CHECK(
        r.dim() == 1 && r.is_contiguous() && r.scalar_type() == at::kFloat && r.device() == device,
        ErrorKind::kInvalidArgument,
        "DistMuon riders must be contiguous 1-D float32 tensors on the parameters' device");
    rider_numel += r.numel();
  }
  const int64_t ride = riders_inside ? rider_numel : 0;  // per segment, after the flags
  int64_t largest = 0, largest_seg = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    largest = std::max(largest, buckets[b].seg + (b == 0 ? flags + ride : 0));
    largest_seg = std::max(largest_seg, buckets[b].seg);
  }
  const auto opts = all.front().options().requires_grad(false);
  if (grad_buf_.numel() != largest * world_ || grad_buf_.scalar_type() != reduce) {
    grad_buf_ = at::zeros({largest * world_}, opts.dtype(reduce));
    param_buf_ = sharded ? at::zeros({largest_seg * world_}, opts) : at::Tensor();
  }
  if (distributed && !riders_inside) {
    for (const at::Tensor& r : riders) {
      at::Tensor t = r;
      exchange_->all_reduce(t);
    }
  }
  // Every entry's flag, before the first bucket carries them all.
  std::vector<float> had(static_cast<size_t>(flags), 0.0f);
  if (p2p) {
    for (size_t i = 0; i < all.size(); ++i)
      if (all[i].grad().defined()) had[i] = 1.0f;
  }

  for (size_t b = 0; b < buckets.size(); ++b) {
    const Bucket& bucket = buckets[b];
    const int64_t seg = bucket.seg;
    const int64_t bflags = b == 0 ? flags : 0, bride = b == 0 ? ride : 0;
    const int64_t stride = seg + bflags + bride;
    at::Tensor flat = grad_buf_.narrow(0, 0, stride * world_);
    // Entry i of a slot's stack (i % c in [lo, hi)) sits at (i / c) * stride + off + (i % c -
    // lo) * numel; positions past the stack's end are padding, zero.
    for (const Slot& sl : bucket.slots) {
      for (uint32_t q = 0; q < world_; ++q) {
        for (int64_t pos = sl.lo; pos < sl.hi; ++pos) {
          const int64_t i = q * sl.c + pos;
          at::Tensor dst = flat.narrow(0, q * stride + sl.off + (pos - sl.lo) * sl.numel, sl.numel);
          if (i < sl.n) {
            sl.s->pack(static_cast<size_t>(i), dst);
          } else {
            dst.zero_();
          }
        }
      }
    }
    if (bflags > 0) {
      const at::Tensor local =
          at::from_blob(had.data(), {flags}, at::TensorOptions().dtype(at::kFloat))
              .to(flat.options());
      for (uint32_t q = 0; q < world_; ++q) {
        flat.narrow(0, q * stride + seg, flags).copy_(local);
        int64_t at_ = q * stride + seg + flags;
        for (const at::Tensor& r : riders) {
          if (!riders_inside) break;
          flat.narrow(0, at_, r.numel()).copy_(r);
          at_ += r.numel();
        }
      }
    }
    // After the reduction: the riders' sums, out of segment `q` of the reduced buffer.
    auto unload_riders = [&](uint32_t q) {
      if (bride == 0) return;
      int64_t at_ = q * stride + seg + flags;
      for (const at::Tensor& r : riders) {
        at::Tensor(r).copy_(flat.narrow(0, at_, r.numel()));
        at_ += r.numel();
      }
    };
    at::Tensor mine = flat;  // sharded: this rank's segment; otherwise the whole buffer
    if (sharded) {
      mine = exchange_->reduce_scatter(flat, /*mean_prefix=*/divisor == world_ ? seg : 0);
      if (divisor != world_) mine.narrow(0, 0, seg).div_(static_cast<double>(divisor));
      if (bflags > 0) {
        mask = flat.narrow(0, rank_ * stride + seg, flags) > 0;
        unload_riders(rank_);
      }
    } else if (distributed) {
      if (p2p) {
        exchange_->reduce_scatter(flat);
        exchange_->all_gather(flat);
        if (bflags > 0) {
          mask = flat.narrow(0, seg, flags) > 0;
          unload_riders(0);
        }
      } else {
        exchange_->all_reduce(flat);
      }
      mine = flat.div_(static_cast<double>(divisor));
    }
    clock.lap(&OptimizerPhaseTimes::reduce);

    // Every slot's element-wise math before the orthogonalization, the orthogonalization of
    // all of them together, then every slot's math after it (phases `update`, `orthogonalize`).
    at::Tensor gathered = sharded ? param_buf_.narrow(0, 0, seg * world_) : at::Tensor();
    at::Tensor out_seg = sharded ? gathered.narrow(0, rank_ * seg, seg) : at::Tensor();
    std::vector<Update> updates;
    std::vector<std::pair<const Slot*, int64_t>> updated;  // slot, first entry
    for (const Slot& sl : bucket.slots) {
      const int64_t start = (sharded ? rank_ * sl.c : 0) + sl.lo;
      const int64_t last = sharded ? std::min(sl.n, rank_ * sl.c + sl.hi)
                                   : (options_.replicated ? sl.n : std::min(sl.n, sl.hi));
      const int64_t owned = std::max<int64_t>(0, last - start);
      if (owned == 0) continue;
      at::Tensor grad;
      if (sharded) {
        grad = mine.narrow(0, sl.off, owned * sl.numel);
      } else {
        std::vector<at::Tensor> parts;
        for (int64_t q = 0; q * sl.c + sl.lo < last; ++q)
          parts.push_back(mine.narrow(0, q * stride + sl.off,
                                      std::min(sl.hi - sl.lo, last - q * sl.c - sl.lo) * sl.numel));
        grad = parts.size() == 1 ? parts.front() : at::cat(parts);
      }
      grad = grad.view({owned, sl.s->rows, sl.s->cols});
      updates.push_back(begin_update(*sl.g, *sl.s, grad, mask.narrow(0, sl.base + start, owned),
                                     start, owned, /*row=*/sl.lo));
      updated.emplace_back(&sl, start);
    }
    clock.lap(&OptimizerPhaseTimes::update);
    orthogonalize_all(updates);
    clock.lap(&OptimizerPhaseTimes::orthogonalize);
    for (size_t k = 0; k < updates.size(); ++k) {
      const Slot& sl = *updated[k].first;
      const int64_t start = updated[k].second, owned = updates[k].owned;
      at::Tensor dest = sharded ? out_seg.narrow(0, sl.off, owned * sl.numel) : at::Tensor();
      auto write_params = [&](const at::Tensor& values) {
        for (int64_t i = 0; i < owned; ++i) sl.s->put(static_cast<size_t>(start + i), values[i]);
      };
      if (sl.s->master.defined()) {
        // The new values go to the master; the parameters (through the all-gather) get its cast.
        const at::Tensor master = sl.s->master.narrow(0, sl.lo, owned);
        const at::Tensor values = finish_update(updates[k], master.view({-1}));
        if (values.data_ptr() != master.data_ptr()) master.copy_(values.view(master.sizes()));
        if (sharded) {
          dest.copy_(master.reshape({-1}));
        } else {
          write_params(master);
        }
        continue;
      }
      const at::Tensor values = finish_update(updates[k], dest);
      if (sharded) {
        if (!values.is_same(dest)) dest.copy_(values.reshape({-1}));
      } else {
        write_params(values);
      }
    }
    clock.lap(&OptimizerPhaseTimes::update);
    if (!sharded) continue;
    clock = PhaseClock(times);
    exchange_->all_gather(gathered);
    for (const Slot& sl : bucket.slots) {
      for (uint32_t q = 0; q < world_; ++q) {
        for (int64_t pos = sl.lo; pos < sl.hi && q * sl.c + pos < sl.n; ++pos) {
          sl.s->put(static_cast<size_t>(q * sl.c + pos),
                    gathered.narrow(0, q * seg + sl.off + (pos - sl.lo) * sl.numel, sl.numel));
        }
      }
    }
    clock.lap(&OptimizerPhaseTimes::gather);
  }
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
// after). On a device the decisions stay on tensors (no host synchronisation): the same
// operations run in place with the mask as a 0/1 weight of each step (the momentum's and second
// moment's lerp_ weights, the learning rate), which gives an entry with a gradient the same
// values and leaves one without unchanged; no select keeps a second copy of the bucket's
// momentum or parameters (DistMuonOptions::host_decisions takes this path on the CPU too).

DistMuon::Update DistMuon::begin_update(Group& g, Stack& s, const at::Tensor& gr,
                                        const at::Tensor& mask, int64_t start, int64_t owned,
                                        int64_t row) {
  Update u;
  u.g = &g;
  u.s = &s;
  u.owned = owned;
  if (s.master.defined()) {
    // Master weights: the update runs on the float32 copies of the owned entries.
    u.P = s.master.narrow(0, row, owned);
  } else {
    std::vector<at::Tensor> mine(s.params.begin() + start, s.params.begin() + start + owned);
    for (auto& t : mine) t = t.detach();
    // One entry (a rank's share of a small stack) is a view of the parameter: no copy.
    u.P = owned == 1 ? mine.front().unsqueeze(0) : at::stack(mine);
  }
  u.m = mask.view({owned, 1, 1});
  const bool host = u.m.is_cpu() && options_.host_decisions;
  u.every = host && u.m.all().item<bool>();
  u.no_decay = !g.decays;
  u.in_place = u.every || !host;
  u.mom = s.momentum.narrow(0, row, owned);
  u.sec = s.second.narrow(0, row, owned);
  if (!host) u.gate = u.m.to(u.mom.scalar_type());
  const auto f32 = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.is_contiguous();
  };
  u.fused = options_.fused_tail && u.gate.defined() && u.no_decay && f32(u.P) && f32(u.sec) &&
            f32(u.gate);
  const at::Tensor mu = g.s.momentum.to(u.P.scalar_type());

  // Nesterov momentum (in the state's dtype: float32 with master weights).
  const at::Tensor grad = gr.scalar_type() == u.mom.scalar_type() ? gr : gr.to(u.mom.scalar_type());
  u.mom_new = u.in_place ? u.mom.lerp_(grad, u.gated(1 - mu)) : u.mom.lerp(grad, 1 - mu);
  at::Tensor upd = at::Tensor(grad).lerp_(u.mom_new, mu);

  // Each matrix, or each row slice of a split group, is a matrix of its own from here on:
  // orthogonalized alone, variance-reduced preserving its own Frobenius norm, and stepped with
  // the lr scale of its own shape. The second moment of a split group is per row (each row
  // lies in one slice), so its slices share the state tensor without sharing a statistic.
  u.slices = g.qkv.empty() ? std::vector<int64_t>{s.rows} : std::vector<int64_t>(g.qkv);
  // Slices of one size (q, k and v without grouped-query attention) are matrices of one
  // stack: on the in-place path they go through each part below once, as [owned x slices]
  // matrices, instead of once per slice.
  // (On the gated path only into the fused tail, which takes a gate per entry of k matrices.)
  const bool uniform = (u.every || u.fused) && u.no_decay && s.red_dim == -1 &&
                       u.slices.size() > 1 &&
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

at::Tensor DistMuon::fused_tail(Update& u, const at::Tensor& dest) const {
  const Stack& s = *u.s;
  if (!u.fused || u.slices.size() != 1) return {};
  const at::Tensor ui = u.ortho[0].contiguous();
  const at::Tensor& Pi = u.p_parts[0];
  const at::Tensor& seci = u.sec_parts[0];
  const bool reduce_cols = s.red_dim == -1;
  const int64_t count = ui.size(0), rows = ui.size(1), cols = ui.size(2);
  const int64_t stats = ops::muon_tail_workspace(count, rows, cols, reduce_cols);
  // begin_update decided on u.fused (and a fold of equal slices that only this path takes).
  MEGACPP_CHECK(ui.scalar_type() == at::kFloat && ui.sizes() == Pi.sizes() && Pi.is_contiguous() &&
                    seci.is_contiguous() && seci.numel() == stats && count % u.owned == 0 &&
                    (!dest.defined() || (dest.scalar_type() == at::kFloat && dest.is_contiguous())),
                ErrorKind::kInternal, "DistMuon: the fused tail's operands are not as decided");
  // The variance reduction and the update of finish_update's in-place path (below) in three
  // kernels: u read twice and P once, the new values written once, where torch's operations
  // move about ten such arrays in about twenty kernels.
  at::Tensor out = dest.defined() ? dest.view(Pi.sizes()) : at::empty_like(Pi);
  at::Tensor workspace = at::empty({stats}, ui.options());
  const double aspect = std::sqrt(std::max(1.0, static_cast<double>(u.slices[0]) / s.cols));
  const auto f = [](const at::Tensor& t) { return t.data_ptr<float>(); };
  options_.fused_tail(ops::MuonTailArgs{.u = f(ui),
                                        .p = f(Pi),
                                        .out = f(out),
                                        .sec = f(seci),
                                        .count = count,
                                        .rows = rows,
                                        .cols = cols,
                                        .reduce_cols = reduce_cols,
                                        .lr = f(u.g->s.lr),
                                        .beta2 = f(u.g->s.beta2),
                                        .gate = f(u.gate),
                                        .matrices_per_gate = count / u.owned,
                                        .aspect = static_cast<float>(aspect),
                                        .workspace = f(workspace)});
  return dest.defined() ? dest : out.view(u.P.sizes());
}

at::Tensor DistMuon::finish_update(Update& u, at::Tensor dest) {
  if (at::Tensor fused = fused_tail(u, dest); fused.defined()) return fused;
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
    const at::Tensor sec_new = u.in_place
                                   ? seci.lerp_(v_mean.to(seci.scalar_type()), u.gated(1 - beta2))
                                   : seci.lerp(v_mean.to(seci.scalar_type()), 1 - beta2);
    const at::Tensor step_size = sec_new.clamp_min(1e-10).rsqrt();
    const at::Tensor scaled_sq_sum = (v_mean * red_size) * step_size.to(at::kFloat).square();
    const at::Tensor v_norm_new = scaled_sq_sum.sum({-2, -1}, true).sqrt();
    const at::Tensor final_scale = step_size * (v_norm / v_norm_new.clamp_min(1e-10));
    ui.mul_(final_scale.to(ui.scalar_type()));

    // Cautious weight decay (parameter-sign agreement gates the decay, never the update:
    // DESIGN.md "Decisions": the cautious gate) and the update.
    const double aspect = std::sqrt(std::max(1.0, static_cast<double>(u.slices[i]) / s.cols));
    const at::Tensor lr = u.gated((g.s.lr * aspect).to(u.P.scalar_type()));
    const at::Tensor& Pi = u.p_parts[i];
    if (u.no_decay && u.in_place && u.slices.size() == 1 && dest.defined()) {
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
  if (!u.in_place) {
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
      if (s.master.defined()) {
        live.push_back(OptimizerStateEntry{.key = stack_key(gi, si, StateField::kMaster),
                                           .value = s.master,
                                           .full_shape = {padded, s.rows, s.cols},
                                           .offset = off,
                                           .replicated = options_.replicated});
      }
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
      if (s.master.defined()) live.entries[k++].value = s.master;
    }
    for (const at::Tensor& t : {g.s.lr, g.s.momentum, g.s.beta2, g.s.weight_decay})
      live.entries[k++].value = t;
  }
  load_entries("dist_muon", rank_, world_, live.entries, state);
  for (Group& g : groups_) g.decays = g.s.weight_decay.item<float>() != 0.0f;
}

}  // namespace megacpp::trainer
