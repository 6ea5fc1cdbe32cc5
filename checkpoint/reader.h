// megacpp::checkpoint reader — a committed checkpoint read back (resume, export), and the
// checkpoint a path a person passes names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace megacpp::checkpoint {

namespace fs = std::filesystem;

// A logical tensor of a checkpoint (DESIGN.md "Decisions": snapshot ownership), as it lies in
// the rank files: one replicated tensor, or the shards of several ranks, each a block of rows
// along dim 0 starting at `row`, or (a matrix's tensor-parallel parts) a block of columns
// along dim 1 of every row. A Muon stack's last shard may hold padding rows past
// full_shape[0]; they belong to no parameter.
struct StoredTensor {
  std::string name;  // logical name ("model.<param>", "optim.adamw.<param>.exp_avg", ...)
  std::string dtype;
  std::vector<uint64_t> full_shape;
  uint64_t row_bytes = 0;  // bytes of one row (of the whole tensor when it is 0-D)
  struct Piece {
    uint32_t rank = 0;
    uint64_t row = 0;
    uint64_t rows = 0;  // 1 for a 0-D tensor
    // The bytes of each of its rows it holds: [col_offset, col_offset + col_bytes) of
    // row_bytes (all of them but in a column block).
    uint64_t col_offset = 0;
    uint64_t col_bytes = 0;
    std::span<const std::byte> data;  // rows * col_bytes, inside the reader's mapping
  };
  std::vector<Piece> pieces;   // ascending row, then column
  bool column_blocks = false;  // some piece is a block of columns
};

// A committed checkpoint opened for reading: checkpoint.json, then every rank file mapped
// read-only and its header and `megacpp.layout` metadata parsed. It does not hash the files —
// call verify_checkpoint first (select_resume_checkpoint does). The spans it hands out live as
// long as the reader. Throws Error{kCorruption} naming the file and what is wrong.
class CheckpointReader {
 public:
  explicit CheckpointReader(const fs::path& dir);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const fs::path& dir() const noexcept { return dir_; }
  uint32_t step() const noexcept { return step_; }
  uint32_t world() const noexcept { return world_; }
  // The ranks whose files it holds: every rank of the world, or a node's part of a job across
  // nodes (first_rank() .. first_rank() + ranks() - 1; reading a row only another node's part
  // holds throws Error{kInvalidArgument}).
  uint32_t first_rank() const noexcept { return first_rank_; }
  uint32_t ranks() const noexcept { return ranks_; }
  const std::string& run_id() const noexcept { return run_id_; }
  const std::string& recipe_hash() const noexcept { return recipe_hash_; }
  // The model's execution layout: "author_dp", 1 for checkpoints written before it was recorded.
  const std::string& mode() const noexcept { return mode_; }
  uint32_t tensor_parallel() const noexcept { return tensor_parallel_; }
  const std::map<std::string, StoredTensor, std::less<>>& tensors() const noexcept {
    return tensors_;
  }
  const StoredTensor* find(std::string_view logical) const;
  // The members of every Muon stack, in stack order: "optim.muon.<group>.<r>x<c>" -> the
  // parameter names its rows belong to (rows past them are padding).
  const std::map<std::string, std::vector<std::string>>& muon_stacks() const noexcept {
    return muon_stacks_;
  }

  // Copies rows [row, row + rows) of a logical tensor into `out` (rows * row_bytes bytes; for
  // a 0-D tensor row 0, rows 1). Rows below full_shape[0] must be stored, else
  // Error{kCorruption}; padding rows at or past full_shape[0] are copied when a shard holds
  // them and zero-filled otherwise (a stack padded for another world size).
  void read_rows(const StoredTensor& t, uint64_t row, uint64_t rows,
                 std::span<std::byte> out) const;

 private:
  struct Mapping;
  fs::path dir_;
  uint32_t step_ = 0;
  uint32_t world_ = 0;
  uint32_t first_rank_ = 0;
  uint32_t ranks_ = 0;
  std::string run_id_;
  std::string recipe_hash_;
  std::string mode_;
  uint32_t tensor_parallel_ = 1;
  std::vector<std::unique_ptr<Mapping>> files_;
  std::map<std::string, StoredTensor, std::less<>> tensors_;
  std::map<std::string, std::vector<std::string>> muon_stacks_;
};

// A path a person passes for a checkpoint — a run directory (its LATEST), RUN/checkpoints/LATEST,
// or a step_N directory (or any directory holding checkpoint.json) — as the checkpoint
// directory it names. Throws Error{kInvalidArgument} with what to pass instead, also for a
// directory that is none of these.
fs::path resolve_checkpoint_dir(const fs::path& path);

}  // namespace megacpp::checkpoint
