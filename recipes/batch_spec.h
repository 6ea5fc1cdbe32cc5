// megacpp::recipe::BatchSpec — the one definition of a rank's batch slot geometry.
//
// One slot holds one rank's batch of one step: `batch` rows, each seq_len + 1 int64 tokens
// (inputs tokens[:, :seq_len], targets tokens[:, 1:]), row-major, with no per-slot header (the
// ring's own header and alignment are ipc::SlotRing's). The data loader writes exactly this,
// the trainer reads it, the supervisor sizes the batch rings (and the launch contract's
// ringSlotBytes) with it, the recipe rules bound it, and the benchmarks build their batches
// with it.
//
// Contract: plain constexpr arithmetic in 64 bits (batch x (seq_len + 1) never wraps), no
// allocation, nothing that blocks or throws, torch-free.
#pragma once

#include <array>
#include <cstdint>

namespace megacpp::recipe {

// The largest batch a rank's ring slot holds: the ring's slot size and the launch contract's
// ringSlotBytes are 32-bit (ipc::SlotRing::kMaxSlotBytes).
inline constexpr uint64_t kMaxBatchSlotBytes = UINT32_MAX;

struct BatchSpec {
  uint32_t batch = 0;    // rows per rank and step (train.batch_size)
  uint32_t seq_len = 0;  // model.seq_len

  // Tokens of one row: seq_len inputs plus the one-token-shifted last target.
  constexpr uint64_t row_tokens() const noexcept { return uint64_t{seq_len} + 1; }
  // Tokens of one slot: batch x (seq_len + 1).
  constexpr uint64_t slot_tokens() const noexcept { return uint64_t{batch} * row_tokens(); }
  // Bytes of one slot: int64 tokens.
  constexpr uint64_t slot_bytes() const noexcept { return slot_tokens() * sizeof(int64_t); }
  // Whether a slot fits a batch ring's slot (kMaxBatchSlotBytes).
  constexpr bool fits_slot() const noexcept { return slot_bytes() <= kMaxBatchSlotBytes; }
  // The slot as a tensor shape: {batch, seq_len + 1}.
  constexpr std::array<int64_t, 2> shape() const noexcept {
    return {int64_t{batch}, static_cast<int64_t>(row_tokens())};
  }
};

}  // namespace megacpp::recipe
