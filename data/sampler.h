// megacpp::data::Sampler — the one global sequence of training windows, and the batch slots
// cut from it.
//
// A window is seq_len + 1 consecutive tokens of one shard; windows start every seq_len tokens
// (the last target of one window is the first input of the next). With pack = true windows
// run across document boundaries (one run per shard); with pack = false every window lies
// inside one document, and a document shorter than one window gives none (counted).
//
// Order: epoch e is a seeded bijection of [0, windows) chosen by (seed, e); position p of the
// global sequence is window perm_{p / windows}(p % windows). The global batch g takes the
// `batch` positions from start + g * batch, and rank r of W takes the global batches
// g = (step - 1) * W + r. So the sequence depends on the seed, the epoch and the position
// only — not on the world size — and a run may resume at another world size where the
// previous one stopped (state = (seed, epoch, cursor) = (seed, p / windows, p % windows)).
//
// Contract: immutable after construction, so fill() may run on several threads at once; the
// shards must outlive the sampler. Construction throws Error{kInvalidArgument} naming the rule
// "data.windows" when the shards hold fewer windows than one global batch.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "data/shards.h"
#include "recipes/batch_spec.h"

namespace megacpp::data {

struct SamplerConfig {
  // The batch geometry's (recipe::resolve_batch, recipe::batch_geometry): >= 2, bounded by the
  // recipe rule model.seq_len and not checked again here.
  uint32_t seq_len = 0;
  uint32_t batch = 0;  // rows per rank and step
  uint32_t world = 1;
  uint32_t token_bytes = 2;  // slot token width (recipe::slot_token_bytes)
  uint64_t seed = 0;
  bool pack = true;
  // The global position where step start_step + 1 begins: steps continue the data order from
  // there, world x batch windows a step. 0, 0 for a run from scratch; a run branched from
  // another's checkpoint at step S starts where the parent's data order stood after step S,
  // whatever its own world and batch (launch contract ResumePoint.dataPosition).
  uint64_t start = 0;
  uint32_t start_step = 0;
  // Whether construction holds the data to the rule data.windows (at least one global batch);
  // off for an index of windows only (ValidationSampler).
  bool windows_rule = true;
};

struct SamplerState {
  uint64_t seed = 0;
  uint64_t epoch = 0;
  uint64_t cursor = 0;  // windows of the epoch already taken
};

class Sampler {
 public:
  // For pack = false on llm.c shards, call Shard::find_documents first.
  Sampler(std::span<const Shard* const> shards, const SamplerConfig& config);
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;

  uint64_t windows() const noexcept { return windows_; }  // per epoch
  uint64_t documents_without_window() const noexcept { return short_docs_; }
  const recipe::BatchSpec& spec() const noexcept { return spec_; }
  const SamplerConfig& config() const noexcept { return config_; }

  // Global position of row 0 of (step, rank); step is 1-based.
  uint64_t position(uint32_t step, uint32_t rank) const noexcept;
  // The state once every rank has taken `step` (step 0: before the first).
  SamplerState state_after(uint32_t step) const noexcept;
  SamplerState state_at(uint64_t position) const noexcept;
  // The window at a global position: shard index and first token.
  struct Window {
    uint32_t shard;
    uint64_t start;
  };
  Window window_at(uint64_t position) const noexcept;

  // Writes the slot of (step, rank): a BatchHeader, then batch x (seq_len + 1) tokens of
  // spec().token_bytes. `slot` must hold spec().slot_bytes(); returns the bytes written.
  size_t fill(uint32_t step, uint32_t rank, std::span<std::byte> slot) const;

 private:
  friend class ValidationSampler;
  // Copies `rows` windows into `out` (rows x (seq_len + 1) tokens of spec().token_bytes): row
  // r is window window_of(r) of the file order (runs_), asked once per row in row order.
  template <typename WindowOf>
  void copy_rows(uint32_t rows, std::byte* out, WindowOf window_of) const;

  struct Run {
    uint32_t shard;
    uint64_t start;    // first token of the run's first window
    uint64_t windows;  // windows in the run
  };
  std::vector<const Shard*> shards_;
  SamplerConfig config_;
  recipe::BatchSpec spec_;
  std::vector<Run> runs_;
  std::vector<uint64_t> before_;  // prefix sums of runs_[i].windows
  uint64_t windows_ = 0;
  uint64_t short_docs_ = 0;
};

// The windows one evaluation reads (README.md "Validation loss"): `windows` windows of the val
// split, window i being the split's window i x split / windows in file order — spread evenly over
// the whole split, the same at any world size and in every evaluation — shared out by
// recipe::ValidationShare. Immutable after construction (fill() may run on several threads);
// the shards must outlive it. Construction throws Error{kInvalidArgument} when the split holds
// no window.
struct ValidationConfig {
  uint32_t seq_len = 0;
  uint32_t batch = 0;  // rows per slot at most (the training batch's rows per rank)
  uint32_t data_ranks = 1;
  uint32_t token_bytes = 2;
  bool pack = true;
  uint64_t windows = 0;  // asked for per evaluation; at most the split's are read
};

class ValidationSampler {
 public:
  ValidationSampler(std::span<const Shard* const> shards, const ValidationConfig& config);
  uint64_t split_windows() const noexcept { return index_.windows(); }
  const recipe::ValidationShare& share() const noexcept { return share_; }
  const recipe::BatchSpec& spec() const noexcept { return index_.spec(); }  // full slots
  // Writes slot `slot` of data rank `data_rank`'s part: a BatchHeader (batch = the slot's
  // rows, step = `tag`, position = the evaluation's index of its first row, windows = the
  // evaluation's windows), then its rows. `out` must hold spec().slot_bytes(); returns the
  // bytes written (a short last slot writes fewer).
  size_t fill(uint32_t data_rank, uint32_t slot, uint64_t tag, std::span<std::byte> out) const;

 private:
  Sampler index_;  // the split's windows (batch 1, world 1: only its order is used)
  recipe::ValidationShare share_;
};

}  // namespace megacpp::data
