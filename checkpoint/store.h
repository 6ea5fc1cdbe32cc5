// megacpp::checkpoint store — the commit protocol under RUN/checkpoints (DESIGN.md
// "Decisions", "Failure model as implemented").
//
// Rank files are written into step_NNNNNNNN.tmp/; when every rank of a step is in,
// checkpoint.json is written, the directory is renamed to step_NNNNNNNN and LATEST is replaced
// atomically. A crash at any point leaves either no checkpoint of that step or a complete,
// verified one. Older checkpoints are pruned by a RetentionPolicy, only once a newer one is
// named by LATEST. Every file operation goes through a Storage (checkpoint/storage.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/safetensors.h"
#include "checkpoint/storage.h"
#include "core/error.h"

namespace megacpp::checkpoint {

namespace fs = std::filesystem;

// RUN/checkpoints/JOB_LATEST: in a job across nodes, the newest step every node committed its
// part of (the job's LATEST, written by the node's supervisor once the job agreed on it;
// LATEST is this node's part). A resume of the job starts from a step every node has.
inline constexpr std::string_view kJobLatestName = "JOB_LATEST";

// The errnos of a write that failed for lack of space: the filesystem is full (ENOSPC), a
// quota is (EDQUOT), or the file outgrew the process's RLIMIT_FSIZE (EFBIG).
bool is_out_of_space(int err) noexcept;

// Which committed checkpoints a CheckpointStore keeps: the newest `keep` steps (0: every one)
// plus every step that is a multiple of `keep_every` (0: none pinned). The step LATEST names is
// always kept.
struct RetentionPolicy {
  uint32_t keep = 0;
  uint32_t keep_every = 0;
};

struct CommittedCheckpoint {
  uint32_t step = 0;
  fs::path dir;               // absolute: RUN/checkpoints/step_NNNNNNNN
  std::string relative_path;  // "checkpoints/step_NNNNNNNN" (relative to the run directory)
  uint64_t bytes = 0;         // rank files + checkpoint.json
};

// Owns RUN/checkpoints. Not thread-safe (one owner: the checkpointer's loop).
//
// Running out of space (is_out_of_space) while a step is written or committed throws
// Error{kSystem} (errno kept) naming the step, RUN/checkpoints, how far the write got and what
// to do; the step's tmp directory is removed first (best effort), so the earlier checkpoints
// and LATEST are as they were.
class CheckpointStore {
 public:
  // Creates RUN/checkpoints if absent and removes every leftover "*.tmp" and "*.deleting"
  // directory in it: an uncommitted checkpoint of an earlier process is discarded, a pruning
  // it had begun is finished; committed ones stay. A LATEST that lags the newest committed
  // directory (a process killed between the rename and LATEST) is moved forward to it. Then
  // prunes (see prune()). Every file of the store lives in `storage`.
  CheckpointStore(fs::path run_dir, std::string run_id, std::string recipe_hash,
                  RetentionPolicy retention = {},
                  std::unique_ptr<Storage> storage = std::make_unique<PosixStorage>());
  CheckpointStore(const CheckpointStore&) = delete;
  CheckpointStore& operator=(const CheckpointStore&) = delete;

  // The model's execution layout every later commit records (the recipe's mode and
  // tensor-parallel degree; a checkpoint without them reads as author_dp, 1).
  void set_layout(std::string mode, uint32_t tensor_parallel) {
    mode_ = std::move(mode);
    tensor_parallel_ = tensor_parallel;
  }

  // The ranks this store commits: ranks first .. first + count - 1 of every step's world (a
  // node of a job across nodes commits its own ranks; the manifest records which). Unset: every
  // rank of the world. Set, pruning keeps every step from JOB_LATEST's on (every step while
  // there is none): a step this node committed may be the job's newest only later.
  void set_ranks(uint32_t first, uint32_t count) {
    first_rank_ = first;
    ranks_ = count;
  }

  // Writes (or rewrites) rank_<rank>.safetensors of `step` into the step's tmp directory and
  // fsyncs it. `layout` (the rank's reassembly JSON, may be empty) is stored verbatim as the
  // "megacpp.layout" metadata entry. Throws Error{kProtocol} if `world` disagrees with an
  // earlier rank of the same step or rank >= world; write errors as write_safetensors, and
  // running out of space as the class comment says (the step is then no longer pending).
  const WrittenFile& write_rank(uint32_t step, uint32_t world, uint32_t rank,
                                std::span<const TensorView> tensors, std::string_view layout = {});
  bool complete(uint32_t step) const;  // every rank of the step this store commits written
  // The step's committed directory exists (committed by this or an earlier process).
  bool committed(uint32_t step) const;
  // Commits a complete step: checkpoint.json, fsyncs, rename, fsync of RUN/checkpoints, and
  // LATEST (only moved forward: an older step never replaces a newer LATEST). If the
  // committed directory already exists (a step re-sent after a restart), the tmp copy is
  // discarded and the existing one stands. Never deletes a committed checkpoint: prune() does.
  CommittedCheckpoint commit(uint32_t step);
  // Deletes every committed checkpoint the retention policy does not keep (never the step
  // JOB_LATEST names or a later one), oldest first: each
  // is renamed to "step_NNNNNNNN.deleting", RUN/checkpoints is fsynced, then the tree is
  // removed, so a crash leaves a whole checkpoint or a ".deleting" leftover, never a damaged
  // step_NNNNNNNN. Returns the steps deleted. Throws Error{kSystem} if a rename or removal
  // fails (what was deleted before stays deleted).
  std::vector<uint32_t> prune();
  void discard(uint32_t step);  // removes the step's tmp directory; no-op if unknown
  void discard_all();
  std::vector<uint32_t> pending() const;  // steps with a tmp directory, ascending
  std::optional<uint32_t> latest() const { return latest_; }  // newest committed step
  const fs::path& dir() const noexcept { return dir_; }
  const RetentionPolicy& retention() const noexcept { return retention_; }
  // Called while rank files are written: after every write(2) and fsync (see ProgressFn).
  void set_progress(std::function<void()> on_chunk) { on_chunk_ = std::move(on_chunk); }

 private:
  struct Pending {
    uint32_t world = 0;
    std::map<uint32_t, WrittenFile> files;  // by rank
  };
  fs::path tmp_dir(uint32_t step) const;
  std::vector<uint32_t> committed_steps() const;  // ascending
  void remove_tree(const fs::path& p);            // Error{kSystem} when it cannot
  // Removes the step's tmp directory (best effort), forgets the step and throws the
  // out-of-space error for `e`; `detail` says how far the write got.
  [[noreturn]] void fail_out_of_space(uint32_t step, const Error& e, std::string_view detail);
  std::unique_ptr<Storage> storage_;
  fs::path run_dir_;
  fs::path dir_;
  std::string run_id_;
  std::string recipe_hash_;
  std::string mode_ = "author_dp";
  uint32_t tensor_parallel_ = 1;
  uint32_t first_rank_ = 0;
  uint32_t ranks_ = 0;  // 0: every rank of the world
  RetentionPolicy retention_;
  std::map<uint32_t, Pending> pending_;
  std::optional<uint32_t> latest_;
  std::function<void()> on_chunk_;
};

}  // namespace megacpp::checkpoint
