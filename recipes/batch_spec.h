// megacpp::recipe::BatchSpec — the one definition of a rank's batch slot geometry.
//
// One slot holds one rank's batch of one step: a 64-byte BatchHeader, then `batch` rows, each
// seq_len + 1 tokens (inputs tokens[:, :seq_len], targets tokens[:, 1:]), row-major, each token
// `token_bytes` wide (2 = uint16 when the vocabulary fits, else 4 = uint32; the trainer widens
// to int64 on its side). The data loader writes exactly this, the trainer reads it, the
// supervisor sizes the batch rings (and the launch contract's ringSlotBytes) with it, the
// recipe rules bound it, and the benchmarks build their batches with it.
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
inline constexpr uint32_t kBatchMagic = 0x6d634254;  // "TBcm"

// The first 64 bytes of every batch slot: what the slot holds and where in the one global
// window sequence it was taken (data/sampler.h). Positions count windows over all epochs:
// epoch = position / windows, cursor = position % windows.
struct BatchHeader {
  uint32_t magic = kBatchMagic;
  uint32_t token_bytes = 0;
  uint32_t batch = 0;
  uint32_t row_tokens = 0;
  uint64_t step = 0;           // 1-based; equals the ring slot's tag
  uint64_t seed = 0;           // the sampler's seed
  uint64_t windows = 0;        // windows per epoch
  uint64_t position = 0;       // global position of this batch's row 0
  uint64_t next_position = 0;  // where step + 1 begins over all ranks: the state after the step
  uint64_t reserved = 0;
};
static_assert(sizeof(BatchHeader) == 64);

// Slot token width for a vocabulary: uint16 when every id fits, else uint32.
constexpr uint32_t slot_token_bytes(uint64_t vocab_size) noexcept {
  return vocab_size <= 65536 ? 2 : 4;
}

struct BatchSpec {
  uint32_t batch = 0;        // rows per rank and step (train.batch_size)
  uint32_t seq_len = 0;      // model.seq_len
  uint32_t token_bytes = 2;  // slot_token_bytes(model.vocab_size)

  // Tokens of one row: seq_len inputs plus the one-token-shifted last target.
  constexpr uint64_t row_tokens() const noexcept { return uint64_t{seq_len} + 1; }
  // Tokens of one slot: batch x (seq_len + 1).
  constexpr uint64_t slot_tokens() const noexcept { return uint64_t{batch} * row_tokens(); }
  // Bytes of one slot: the header, then the tokens.
  constexpr uint64_t slot_bytes() const noexcept {
    return sizeof(BatchHeader) + slot_tokens() * token_bytes;
  }
  // Whether a slot fits a batch ring's slot (kMaxBatchSlotBytes).
  constexpr bool fits_slot() const noexcept { return slot_bytes() <= kMaxBatchSlotBytes; }
  // The tokens as a tensor shape: {batch, seq_len + 1}.
  constexpr std::array<int64_t, 2> shape() const noexcept {
    return {int64_t{batch}, static_cast<int64_t>(row_tokens())};
  }
};

}  // namespace megacpp::recipe
