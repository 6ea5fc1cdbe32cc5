// megacpp::checkpointer — the snapshot plane's receiving end (DESIGN.md "Decisions",
// "Failure model as implemented").
//
// Three layers, each usable alone:
//  * safetensors: a writer that streams tensors from a staging region straight to a file
//    with write(2) (no copy of the region), and a validating header reader.
//  * CheckpointStore: the commit protocol under RUN/checkpoints. Rank files are written
//    into step_NNNNNNNN.tmp/; when every rank of a step is in, checkpoint.json is written,
//    the directory is renamed to step_NNNNNNNN and LATEST is replaced atomically. A crash at
//    any point leaves either no checkpoint of that step or a complete, verified one. Older
//    checkpoints are pruned by a RetentionPolicy, only once a newer one is named by LATEST.
//  * Service: the message loop of the megacpp-checkpointer process — SnapshotReady in,
//    SnapshotAck out (ok=true releases the rank's staging lease; committed=true tells every
//    rank of the step that its checkpoint is durable). SnapshotReady is idempotent, so a
//    rank may re-send it until it gets the ack it needs — across a restart of this process.
//
// Torch-free: tensors are bytes plus dtype/shape metadata.
#pragma once

#include <chrono>
#include <cstddef>
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

#include "core/error.h"
#include "ipc/channel.h"
#include "ipc/journal.h"
#include "schemas/common.capnp.h"

namespace megacpp::checkpointer {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------
// safetensors

// Element size of a safetensors dtype name ("F32" -> 4, "BF16" -> 2, "BOOL" -> 1, ...);
// nullopt for a name the format does not define.
std::optional<size_t> dtype_size(std::string_view dtype);

// One tensor to write. `data` points at `bytes` bytes that stay valid and unchanged for
// the duration of the write (a leased staging region).
struct TensorView {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  const std::byte* data = nullptr;
  uint64_t bytes = 0;
};

struct WrittenFile {
  uint64_t bytes = 0;  // file size
  std::string xxh3;    // XXH3-64 hex of the whole file (same format as core xxh3_hex)
  uint32_t tensors = 0;
};

// Called with the bytes of the file written so far and the file's full size: once (0, total)
// before the file is created, then after every write(2) that reached the file (at most
// 1 MiB) and after the fsync. A slow write keeps calling it, a write blocked in the kernel
// does not (the checkpointer's progress stamp, judged by the supervisor). When a write fails,
// the last `written` reported is what reached the file.
using ProgressFn = std::function<void(uint64_t written, uint64_t total)>;

// Writes a safetensors file at `path` (created or truncated, mode 0644) and fsyncs it.
// Data is laid out in the order given. `metadata` lands in "__metadata__" after
// "format": "pt". Throws Error{kInvalidArgument} for an unknown dtype, a byte count that does
// not match the shape, or a duplicate/reserved name; Error{kSystem} with the errno kept on an
// I/O failure (the partial file is removed).
WrittenFile write_safetensors(const fs::path& path, std::span<const TensorView> tensors,
                              const std::map<std::string, std::string>& metadata = {},
                              const ProgressFn& on_chunk = {});

struct SafetensorsTensor {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;               // length of the JSON header (padding included)
  uint64_t data_bytes = 0;                 // size of the data section
  std::vector<SafetensorsTensor> tensors;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
};

// Parses and validates a header: `prefix` holds at least the first 8 + header_bytes bytes of
// a file of `file_size` bytes. Checks: JSON object, known dtypes, byte counts match shapes,
// offsets contiguous from 0 and covering exactly the data section. Throws
// Error{kCorruption} naming the problem.
SafetensorsHeader parse_safetensors_header(std::string_view prefix, uint64_t file_size);
// Reads only the header of the file at `path` and parses it as above.
SafetensorsHeader read_safetensors_header(const fs::path& path);

// XXH3-64 hex of a file, streamed (never the whole file in memory).
std::string xxh3_file(const fs::path& path);

// ---------------------------------------------------------------------------------------
// The commit protocol

struct VerifyResult {
  bool ok = false;
  std::vector<std::string> problems;  // empty when ok
};
// Checks a committed (or tmp) checkpoint directory: checkpoint.json parses, every listed
// file exists with the recorded size and xxh3, every safetensors header is consistent and
// its tensor count matches. Never throws for a damaged checkpoint; problems are listed.
VerifyResult verify_checkpoint(const fs::path& dir);

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
  // prunes (see prune()).
  CheckpointStore(fs::path run_dir, std::string run_id, std::string recipe_hash,
                  RetentionPolicy retention = {});
  CheckpointStore(const CheckpointStore&) = delete;
  CheckpointStore& operator=(const CheckpointStore&) = delete;

  // The model's execution layout every later commit records (the recipe's mode and
  // tensor-parallel degree; a checkpoint without them reads as author_dp, 1).
  void set_layout(std::string mode, uint32_t tensor_parallel) {
    mode_ = std::move(mode);
    tensor_parallel_ = tensor_parallel;
  }

  // Writes (or rewrites) rank_<rank>.safetensors of `step` into the step's tmp directory and
  // fsyncs it. `layout` (the rank's reassembly JSON, may be empty) is stored verbatim as the
  // "megacpp.layout" metadata entry. Throws Error{kProtocol} if `world` disagrees with an
  // earlier rank of the same step or rank >= world; write errors as write_safetensors, and
  // running out of space as the class comment says (the step is then no longer pending).
  const WrittenFile& write_rank(uint32_t step, uint32_t world, uint32_t rank,
                                std::span<const TensorView> tensors, std::string_view layout = {});
  bool complete(uint32_t step) const;  // every rank of the step written
  // The step's committed directory exists (committed by this or an earlier process).
  bool committed(uint32_t step) const;
  // Commits a complete step: checkpoint.json, fsyncs, rename, fsync of RUN/checkpoints, and
  // LATEST (only moved forward: an older step never replaces a newer LATEST). If the
  // committed directory already exists (a step re-sent after a restart), the tmp copy is
  // discarded and the existing one stands. Never deletes a committed checkpoint: prune() does.
  CommittedCheckpoint commit(uint32_t step);
  // Deletes every committed checkpoint the retention policy does not keep, oldest first: each
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
  // Removes the step's tmp directory (best effort), forgets the step and throws the
  // out-of-space error for `e`; `detail` says how far the write got.
  [[noreturn]] void fail_out_of_space(uint32_t step, const Error& e, std::string_view detail);
  fs::path run_dir_;
  fs::path dir_;
  std::string run_id_;
  std::string recipe_hash_;
  std::string mode_ = "author_dp";
  uint32_t tensor_parallel_ = 1;
  RetentionPolicy retention_;
  std::map<uint32_t, Pending> pending_;
  std::optional<uint32_t> latest_;
  std::function<void()> on_chunk_;
};

// ---------------------------------------------------------------------------------------
// The staging region's step stamp

// The last kStagingStampBytes of a rank's staging region say which step the region holds, so
// a SnapshotReady that outlived its lease (re-sent, queued, then delivered to a restarted
// checkpointer after the rank reused the region for a later step) is never written under the
// wrong step. A seqlock: the rank sets `step` to 0 before it copies a share and to the step
// after; the checkpointer writes a snapshot only if the stamp names the SnapshotReady's step
// before and after the write. `step` is accessed through std::atomic_ref (lock-free, so valid
// across processes).
struct StagingStamp {
  uint64_t magic;
  uint32_t step;  // 0: being written
  uint32_t reserved;
};
inline constexpr uint64_t kStagingStampMagic = 0x504d415453434d4dULL;  // "MMCSTAMP"
inline constexpr uint64_t kStagingStampBytes = 64;
// The step a stamp names; nullopt when `p` holds no stamp (wrong magic).
std::optional<uint32_t> read_staging_stamp(const std::byte* p);
// The rank's side: clear before the copy (writes after it cannot be seen before the clear),
// set after it (the copy is visible before the step).
void clear_staging_stamp(std::byte* p);
void set_staging_stamp(std::byte* p, uint32_t step);

// ---------------------------------------------------------------------------------------
// The process loop

// Handles the snapshot plane over a bound ROUTER: for each SnapshotReady from a trainer
// rank, attaches the rank's staging region (once per name/size, cached), writes the rank's
// file, acks ok (the lease is released), and when a step is complete commits it, acks
// committed to every rank of the step, journals checkpointCommitted and prunes the store. A
// commit discards older steps still partially received (no rank will send them again).
// SnapshotReady is idempotent (ranks re-send it while they wait, and after a restart of this
// process): for a step already committed it acks ok+committed; for a rank already written in
// this process and a step not yet committed it re-acks ok without rewriting; for a step older
// than the newest commit (superseded) it acks ok without writing; anything else — a step
// this process never saw, e.g. whose tmp directory a restart discarded — is written
// normally. A duplicate never rewrites a file, commits twice or reads a released region.
// On a malformed snapshot or a write error it sends ok=false with the error text to the
// sender and rethrows (the stage fails; the supervisor decides).
class Service {
 public:
  using PhaseFn = std::function<void(schema::Phase)>;
  // Called with the step just before a rank file is written (a fault-injection point); it
  // may throw, which fails that snapshot like a write error.
  using WriteFn = std::function<void(uint32_t step)>;
  // `journal` may be null (no journaling); `on_phase` and `before_write` may be empty.
  Service(CheckpointStore& store, ipc::Channel& router, ipc::JournalWriter* journal,
          PhaseFn on_phase = {}, WriteFn before_write = {});
  ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // Waits at most `timeout` for one message and handles it. Returns false on timeout.
  bool poll(std::chrono::milliseconds timeout);
  bool has_pending() const { return !steps_.empty(); }  // a step partially received
  // Discards every partially received step (its tmp directory is removed).
  void discard_pending();
  uint64_t committed() const noexcept { return committed_; }  // checkpoints committed so far
  // When the oldest partially received step got its first snapshot (CLOCK_MONOTONIC); 0 when
  // no step is pending.
  int64_t oldest_pending_ns() const {
    return steps_.empty() ? 0 : steps_.begin()->second.first_mono_ns;
  }

 private:
  struct Attached;
  struct StepState {
    int64_t first_mono_ns = 0;
    uint32_t world = 0;
    std::map<uint32_t, std::string> peers;  // rank written -> routing identity
  };
  void handle_snapshot(const std::string& peer, schema::SnapshotReady::Reader ready);
  const std::byte* region_for(uint32_t rank, const std::string& name, uint64_t bytes);
  void ack(const std::string& peer, uint32_t rank, uint32_t step, bool ok, bool committed,
           const std::string& error);
  void set_phase(schema::Phase phase);
  void commit(uint32_t step, bool final);

  CheckpointStore& store_;
  ipc::Channel& router_;
  ipc::JournalWriter* journal_;
  PhaseFn on_phase_;
  WriteFn before_write_;
  std::map<uint32_t, std::unique_ptr<Attached>> regions_;  // by rank
  std::map<uint32_t, StepState> steps_;                    // partially received steps
  uint64_t committed_ = 0;
};

// ---------------------------------------------------------------------------------------
// Reading a committed checkpoint back (resume, export)

// A logical tensor of a checkpoint (DESIGN.md "Decisions": snapshot ownership), as it lies in
// the rank files: one replicated tensor, or the shards of several ranks, each a block of rows
// along dim 0 starting at `row`. A Muon stack's last shard may hold padding rows past
// full_shape[0]; they belong to no parameter.
struct StoredTensor {
  std::string name;  // logical name ("model.<param>", "optim.adamw.<param>.exp_avg", ...)
  std::string dtype;
  std::vector<uint64_t> full_shape;
  uint64_t row_bytes = 0;  // bytes of one row (of the whole tensor when it is 0-D)
  struct Piece {
    uint32_t rank = 0;
    uint64_t row = 0;
    uint64_t rows = 0;                // 1 for a 0-D tensor
    std::span<const std::byte> data;  // rows * row_bytes, inside the reader's mapping
  };
  std::vector<Piece> pieces;  // ascending row
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

struct ExportReport {
  uint32_t tensors = 0;
  uint64_t bytes = 0;  // of the file written
};
// `megacpp export`: one consolidated safetensors file of the model's parameters under the names
// the equivalent PyTorch module uses ("embed.weight", "blocks.0.attn.qkv.weight", ...: the
// checkpoint's "model." names without the prefix), every shard reassembled. With `optimizer`,
// the optimizer state too, per parameter: "optim.adamw.<param>.{exp_avg,exp_avg_sq,step}",
// "optim.muon.<param>.{momentum,second_momentum}" (a row of its stack), and the groups'
// scalars "optim.{adamw,muon}.<group>.<field>". Metadata: run_id, step, recipe_hash, world.
// Written to a temporary name, fsynced and renamed. The checkpoint must verify first.
ExportReport export_checkpoint(const CheckpointReader& ckpt, const fs::path& out, bool optimizer);

// The checkpoints of RUN/checkpoints, newest first, and the first of them that verifies —
// the one a resume starts from. A newer one that does not verify (torn, corrupt) is listed in
// `skipped` with its problems and is never loaded.
struct ResumeChoice {
  std::optional<CommittedCheckpoint> chosen;
  struct Skipped {
    uint32_t step = 0;
    std::string relative_path;
    std::vector<std::string> problems;
  };
  std::vector<Skipped> skipped;
};
ResumeChoice select_resume_checkpoint(const fs::path& run_dir);

}  // namespace megacpp::checkpointer
