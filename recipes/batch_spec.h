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
  constexpr bool operator==(const BatchSpec&) const = default;
};

// The batch geometry of one attempt: every rank's slot and how the ranks share the data. The
// supervisor resolves it once (recipes/recipe.h resolve_batch: the recipe, the world, a resume's
// batch per rank) and records it in the launch contract (LaunchContract.batch); it sizes the
// batch rings with it, the data pre-flight checks the window rule with it, and the data loader
// and the trainers read it back (recipes/recipe.h batch_geometry), never the recipe's batchSize.
struct BatchGeometry {
  BatchSpec slot;                // one rank's slot of one step (slot.batch: rows per rank)
  uint32_t world = 0;            // ranks
  uint32_t tensor_parallel = 1;  // consecutive ranks of a group train on one batch

  // Ranks with a batch of their own: rank r trains on data rank r / tensor_parallel.
  constexpr uint32_t data_ranks() const noexcept {
    return tensor_parallel ? world / tensor_parallel : 0;
  }
  // Windows one step takes from the data order: the global batch.
  constexpr uint64_t windows_per_step() const noexcept {
    return uint64_t{data_ranks()} * slot.batch;
  }
  // Rows over every rank, a tensor-parallel group's ranks each counted: what a resume at
  // another world size splits again (ranks x batch per rank stays the run's).
  constexpr uint64_t rank_rows() const noexcept { return uint64_t{world} * slot.batch; }
  constexpr bool operator==(const BatchGeometry&) const = default;
};

// How one evaluation's windows are shared out (README.md "Validation loss"): `windows` windows
// of the val split in one fixed order, cut into `data_ranks` contiguous parts, data rank d
// reading part d in slots of at most `batch` rows (the last slot of a part may hold fewer). The
// windows are the same at any world size; only which rank reads which changes. A rank with an
// empty part reads no slot. Slots are BatchSpec slots with the rows in their header's `batch`.
struct ValidationShare {
  uint64_t windows = 0;  // per evaluation, over all ranks; 0: the run does not evaluate
  uint32_t data_ranks = 1;
  uint32_t batch = 1;  // rows per slot at most: the training batch's rows per rank
  constexpr uint64_t first(uint32_t d) const noexcept {
    return static_cast<uint64_t>(static_cast<unsigned __int128>(windows) * d / data_ranks);
  }
  constexpr uint64_t count(uint32_t d) const noexcept { return first(d + 1) - first(d); }
  constexpr uint32_t slots(uint32_t d) const noexcept {
    return static_cast<uint32_t>((count(d) + batch - 1) / batch);
  }
  constexpr uint32_t rows(uint32_t d, uint32_t slot) const noexcept {
    const uint64_t left = count(d) - uint64_t{slot} * batch;
    return left < batch ? static_cast<uint32_t>(left) : batch;
  }
  constexpr bool operator==(const ValidationShare&) const = default;
};
// A validation ring slot's tag: the attempt's 0-based evaluation and the slot within its part.
constexpr uint64_t validation_tag(uint32_t evaluation, uint32_t slot) noexcept {
  return (uint64_t{evaluation} << 32) | slot;
}

}  // namespace megacpp::recipe
