// megacpp::ipc control client: the per-process link to the supervisor's control ROUTER.
//
// Lifetime: owns a ZeroMQ context, a DEALER and a heartbeat thread; Hello is queued by the
// constructor and the thread is joined by the destructor (bounded by one interval plus the
// linger given to a queued Failure, at most 1 s). Neither copyable nor movable.
// Blocking: every public call only stores into atomics or a mutex-guarded queue and wakes
// the thread; nothing the owning thread calls waits on the network. With no supervisor
// listening, heartbeats are dropped once the queue is full.
// Failure: an invalid argument throws megacpp::Error{kInvalidArgument} from the
// constructor; a failure inside the heartbeat thread is logged and stops the heartbeats
// (the supervisor then reports the process as heartbeat_lost), never thrown.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include "ipc/millis.h"
#include "schemas/common.capnp.h"

namespace megacpp::ipc {

// Who a process is to the supervisor: carried by Hello, every Heartbeat and every Failure.
// The DEALER's routing identity is layout::process_name(stage, rank) (e.g. "trainer-1").
struct Identity {
  schema::StageKind stage = schema::StageKind::SUPERVISOR;
  uint32_t rank = 0;
  uint32_t generation = 0;  // launch generation (restarts bump it)
};

// What the owning thread last published for the heartbeats to carry. Every field is optional
// in meaning: a stage fills the ones it measures and leaves the others at their defaults
// (see schemas/control.capnp Heartbeat for what each one means to the supervisor).
struct ProgressRecord {
  uint32_t step = 0;  // the stage's own count: steps, batches, polls
  double tokens = 0.0;
  float loss = std::numeric_limits<float>::quiet_NaN();
  double step_seconds = 0.0;
  double lag_seconds = 0.0;  // how far behind its input the stage's last result was
  // A trainer's newest held-out evaluation (README.md "Validation loss"): its loss, NaN before
  // the first, and the step it followed. A record with a new val_step is sent at once, not at
  // the next interval.
  float val_loss = std::numeric_limits<float>::quiet_NaN();
  uint32_t val_step = 0;
};

// The per-process control client: a DEALER to the supervisor, Hello on construction, then a
// background thread that sends a Heartbeat every `interval` carrying the phase, step and
// ProgressRecord the owning thread last published, and that records a Stop from the
// supervisor. Lifetime: the thread is joined in the destructor (bounded by one interval).
// The socket is used only by that thread (ZeroMQ sockets are not thread-safe).
class ControlClient {
 public:
  ControlClient(const std::string& endpoint, const Identity& identity, Millis interval);
  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  const Identity& identity() const noexcept;
  void set_phase(schema::Phase phase);  // also stamps phaseStartedMonoNs
  void set_step(uint32_t step);
  // Replaces the whole record; its step is published last, so a heartbeat that sees the new
  // step also sees the rest of the record.
  void publish(const ProgressRecord& record);
  // Called by the thread that does the stage's work, never by a helper thread: each call
  // stamps "progress now" (the supervisor judges a stage by the age of this stamp, since
  // heartbeats come from this client's own thread and go on while the work is wedged).
  // `work_done` counts finished units of work (folds, commits, batches); `pending_since_ns`
  // is when the oldest piece of work still owed arrived (CLOCK_MONOTONIC; 0: none owed).
  void report_progress(uint64_t work_done, int64_t pending_since_ns = 0);
  bool stop_requested() const noexcept { return stop_.load(std::memory_order_acquire); }
  // A Stop{afterCheckpoint}: finish the work in flight, make it durable, then exit 0.
  bool graceful_stop_requested() const noexcept { return drain_.load(std::memory_order_acquire); }
  std::string stop_reason() const;
  // What the supervisor's AbortCollectives does in this process (schemas/control.capnp): the
  // handler aborts the owner's process group on a thread of this client's own, and when it
  // returns this client's thread replies CollectivesAborted (its duration; what it threw, if it
  // did) once per request that arrived meanwhile (one run answers them all). So a process whose
  // own thread is stuck in a collective still aborts and answers, and its heartbeats go on
  // while the abort takes its time (ncclCommAbort may take seconds). Without a handler the
  // reply says the process has no group. Replacing the handler (an empty one removes it) waits
  // for a run of the old one in progress; a handler must stay callable until it is replaced.
  // The destructor waits for a run in progress.
  void set_abort_handler(std::function<void()> abort);
  // Sends a Failure message now (best effort, from the calling thread's point of view it
  // is queued to the heartbeat thread and flushed before the destructor returns).
  // `error_kind`: what was thrown (schemas::to_schema of a megacpp::Error's kind, or the
  // foreign kinds), NONE when the failure is no exception;
  // `mono_ns` is when the process met the failure (0: now).
  void report_failure(schema::FailureReport report, const std::string& message,
                      schema::ErrorKind error_kind = schema::ErrorKind::NONE, int64_t mono_ns = 0);

 private:
  struct State;
  std::unique_ptr<State> state_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> drain_{false};
};

}  // namespace megacpp::ipc
