// megacpp::checkpointer — the snapshot plane's receiving end, the megacpp-checkpointer
// process (DESIGN.md "Decisions", "Failure model as implemented"): its message loop over the
// checkpoint library (checkpoint/store.h) and the ranks' staging regions (ipc/shm.h,
// ipc/staging_stamp.h). SnapshotReady in, SnapshotAck out (ok=true releases the rank's staging
// lease; committed=true tells every rank of the step that its checkpoint is durable).
// SnapshotReady is idempotent, so a rank may re-send it until it gets the ack it needs —
// across a restart of this process.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "checkpoint/store.h"
#include "ipc/channel.h"
#include "ipc/journal.h"
#include "schemas/common.capnp.h"
#include "stages/checkpointer/staging_imports.h"

namespace megacpp::checkpointer {

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
// sender and rethrows (the stage fails; the supervisor decides). A snapshot staged in an
// exported buffer (StagingImports) whose descriptor has not arrived or whose copy has not
// finished is acked ok=false without failing (the rank re-sends it); one from a rank that died
// (its handle connection closed) is logged by name and dropped, unacked.
class Service {
 public:
  using PhaseFn = std::function<void(schema::Phase)>;
  // Called with the step just before a rank file is written (a fault-injection point); it
  // may throw, which fails that snapshot like a write error.
  using WriteFn = std::function<void(uint32_t step)>;
  // `journal` may be null (no journaling); `on_phase` and `before_write` may be empty.
  Service(checkpoint::CheckpointStore& store, ipc::Channel& router, ipc::JournalWriter* journal,
          PhaseFn on_phase = {}, WriteFn before_write = {});
  ~Service();
  Service(const Service&) = delete;
  // Where snapshots staged in an exported buffer (SnapshotReady.stagedGeneration) are read from;
  // without it such a snapshot is refused as a protocol error. Kept by reference; may be null.
  void set_staging_imports(StagingImports* imports) noexcept { imports_ = imports; }
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
  // `staging_refused`: SnapshotAck.stagingRefused (with ok = false).
  void ack(const std::string& peer, uint32_t rank, uint32_t step, bool ok, bool committed,
           const std::string& error, bool staging_refused = false);
  void set_phase(schema::Phase phase);
  void commit(uint32_t step, bool final);

  checkpoint::CheckpointStore& store_;
  ipc::Channel& router_;
  ipc::JournalWriter* journal_;
  StagingImports* imports_ = nullptr;
  PhaseFn on_phase_;
  WriteFn before_write_;
  std::map<uint32_t, std::unique_ptr<Attached>> regions_;  // by rank
  std::map<uint32_t, StepState> steps_;                    // partially received steps
  uint64_t committed_ = 0;
};

}  // namespace megacpp::checkpointer
