// megacpp::supervisor failure policy — the rules that turn what the supervisor observes into
// events, and events into roles (first failure, victim, torn down). Pure functions of their
// arguments: no clock, no processes, no I/O, so each rule is a case of a table-driven unit
// test (tests/unit/supervisor_test.cpp). The watch loop (watch.cpp) measures; this file judges.
//
// Times are CLOCK_MONOTONIC nanoseconds (comparable across the processes of one host);
// budgets are seconds.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "schemas/common.capnp.h"

namespace megacpp::supervisor::policy {

// One abnormal observation of one process.
struct Event {
  schema::FailureKind kind = schema::FailureKind::NONE;
  std::string message;
  int64_t evidence_ns = 0;  // when the cause happened
  int64_t detected_ns = 0;  // when the supervisor learned of it
  schema::Phase phase = schema::Phase::STARTUP;
  uint32_t step = 0;
  // False when evidence_ns is only the detection time (a death: the kernel gives an
  // unprivileged parent no exit time, so it is the reap time).
  bool evidence_measured = true;
  // kind exception: what the process said it met (peer_failure / timeout: a victim's claim).
  schema::ErrorKind error_kind = schema::ErrorKind::NONE;
  // kind hung: judged by the stage's own progress stamp (its working thread stalled), not a
  // process that made no progress in a phase, perhaps waiting on another.
  bool own_progress = false;
};

// The event a process's own failure report makes — its Failure message, or its failure dump
// when the message was not read before its exit was reaped: `diverged` in the rank's own words;
// otherwise `exception`, the message after the name of its error kind (of the report when it
// names none), with the error kind evidence_of reads for a victim's claim. Evidence: when the
// process met it (`met_ns`), `now` when that is unknown or later.
Event reported_failure(schema::FailureReport report, schema::ErrorKind error_kind,
                       std::string_view message, int64_t met_ns, int64_t now, schema::Phase phase,
                       uint32_t step);

// How telling an event is about the cause of a failure, most telling first.
enum class Evidence : uint8_t {
  kOwn,          // the process's own death, throw, silence or stalled work
  kHang,         // no progress in a phase: it may be waiting on another process
  kVictimClaim,  // it threw because a peer or a collective failed (peer_failure, timeout)
  kTeardown,     // a consequence of the teardown, or not an event the supervisor records
};
Evidence evidence_of(const Event& ev);

// a before b: the more telling class, then the earlier evidence.
bool more_telling(const Event& a, const Event& b);

// Whether an event observed now is kept at all: once the teardown has begun, only a
// process's own report of something it met before the first SIGTERM counts; everything
// later is a consequence of the teardown. A `diverged` report always counts.
bool admitted(const Event& ev, int64_t teardown_started_ns);

// The roles, once teardown is over. `events` holds the most telling event of each process
// (by process name); `exited_abnormally` names the processes that exited non-zero or by a
// signal. Exactly one first failure (when any event exists): the most telling event; every
// other process with an event is a victim; a process without one that exited abnormally was
// torn down; the rest have no role.
struct Roles {
  std::string first_failure;  // empty: no event, the run did not fail
  std::vector<std::string> victims;
  std::vector<std::string> torn_down;
};
Roles assign_roles(const std::map<std::string, Event>& events,
                   std::span<const std::string> exited_abnormally);

// ---------------------------------------------------------------------------------------
// Restartable stages and budgets.

// The collector, the data loader and the checkpointer are restarted on failure; a trainer
// rank or the supervisor never is.
bool restartable(schema::StageKind stage);

enum class Restart : uint8_t {
  kRestart,    // kill (if alive) and relaunch the stage as its next generation
  kFail,       // record the event: the run fails
  kExhausted,  // record the event, noting the restarts already spent
};
// Restarts happen only while the run is healthy (no failure detected) and not finishing.
Restart decide_restart(schema::StageKind stage, uint32_t restarts, uint32_t max_restarts,
                       bool failure_detected, bool done);

// A heartbeat counts only for the generation it came from: one queued by a generation killed
// for a restart proves nothing about its successor.
bool heartbeat_counts(uint32_t heartbeat_generation, uint32_t child_generation);

// The detection budgets of RunOptions (supervisor.h says what each means), in seconds.
struct Budgets {
  double startup_s = 0;
  double hang_s = 0;
  double hang_multiple = 0;
  double heartbeat_timeout_s = 0;
  double heartbeat_interval_s = 0;
  double collector_stall_s = 0;
  double loader_stall_s = 0;
  double checkpointer_stall_s = 0;
};

// The budget of a process's current phase: the start-up budget for a process that is not a
// trainer past its first step; for a trainer, max(hang_s, hang_multiple × median step time)
// over `step_seconds` (empty: hang_s).
double phase_budget(const Budgets& b, schema::StageKind stage, uint32_t step, schema::Phase phase,
                    std::span<const double> step_seconds);

// How long a restartable stage may go without progress (start-up budget for the others).
double stall_budget(const Budgets& b, schema::StageKind stage);

// How long a process may be silent: until its hello the start-up budget; then the heartbeat
// timeout, or its phase budget when that is shorter.
double silence_limit(const Budgets& b, bool said_hello, double phase_budget_s);

// The stage a trainer waits on in `phase` (the loader for a batch, the checkpointer for a
// snapshot), if any.
std::optional<schema::StageKind> waited_on(schema::Phase phase);

// A trainer's clock and budget in its current phase. A rank waiting on the loader or the
// checkpointer is not judged before that stage has had its own budget (and a restart) to
// act: its clock starts no earlier than the stage's latest launch, and its budget covers the
// stage's stall budget plus a heartbeat timeout.
struct RankClock {
  int64_t since_ns;
  double budget_s;
};
RankClock rank_clock(const Budgets& b, int64_t phase_started_ns, int64_t progress_ns,
                     double phase_budget_s, std::optional<schema::StageKind> dependency,
                     int64_t dependency_started_ns);

// A rank starved of batches while its ring is empty points at the loader (restartable):
// blame the loader once the rank has waited a heartbeat timeout, before its own budget.
bool loader_starves_rank(const Budgets& b, schema::Phase phase, uint64_t ring_depth,
                         double waited_s, bool loader_alive);

// The hang sweep. After the first detection, a rank hung in a collective usually waits on a
// peer that went silent a moment later, not yet past its own silence limit: a live process
// that has said hello, was not asked to stop, has no event yet and has been silent for three
// heartbeat intervals is recorded as heartbeat_lost, so the ranking names it, not its waiter.
bool swept_as_silent(const Budgets& b, bool failure_detected, bool alive, bool said_hello,
                     bool stop_sent, bool has_event, double silent_s);

// A generation killed for a restart must be reaped within this bound, else its restart is
// abandoned (two generations would share its ring, sockets and manifest) and it is unkillable.
inline constexpr double kRestartReapBoundSeconds = 10;
bool restart_reap_overdue(double since_kill_s);

// The teardown's first signal: SIGKILL to a process that cannot act on SIGTERM (silent, or
// stopped: /proc state 'T'), SIGTERM to the others.
int teardown_signal(bool silent, char proc_state);

}  // namespace megacpp::supervisor::policy
