#include "supervisor/failure_policy.h"

#include <signal.h>

#include <algorithm>
#include <tuple>

#include "schemas/enums.h"

namespace megacpp::supervisor::policy {

using schema::ErrorKind;
using schema::FailureKind;
using schema::Phase;
using schema::StageKind;

Event reported_failure(schema::FailureReport report, ErrorKind error_kind, std::string_view message,
                       int64_t met_ns, int64_t now, Phase phase, uint32_t step) {
  const bool diverged = error_kind == ErrorKind::DIVERGED;
  const std::string_view said =
      error_kind == ErrorKind::NONE ? schemas::name(report) : schemas::name(error_kind);
  Event ev{diverged ? FailureKind::DIVERGED : FailureKind::EXCEPTION,
           diverged ? std::string(message) : std::string(said) + ": " + std::string(message),
           met_ns > 0 && met_ns <= now ? met_ns : now,
           now,
           phase,
           step};
  ev.error_kind = error_kind;
  return ev;
}

Evidence evidence_of(const Event& ev) {
  switch (ev.kind) {
    case FailureKind::EXITED:
    case FailureKind::SIGNALED:
    case FailureKind::HEARTBEAT_LOST:
    case FailureKind::INTERRUPTED:
    case FailureKind::UNKILLABLE:
    case FailureKind::STALLED:
    case FailureKind::DIVERGED:
    // A job across nodes: the node that went silent, or the first failure another node had,
    // is the cause for this node; its ranks that lost a peer only claim to be victims.
    case FailureKind::NODE_LOST:
    case FailureKind::NODE_FAILED:
      return Evidence::kOwn;
    case FailureKind::HUNG:
      return ev.own_progress ? Evidence::kOwn : Evidence::kHang;
    case FailureKind::EXCEPTION:
      switch (ev.error_kind) {
        case ErrorKind::PEER_FAILURE:
        case ErrorKind::TIMEOUT:
          return Evidence::kVictimClaim;
        case ErrorKind::INVALID_ARGUMENT:
        case ErrorKind::SYSTEM:
        case ErrorKind::ZMQ:
        case ErrorKind::PROTOCOL:
        case ErrorKind::CORRUPTION:
        case ErrorKind::INTERRUPTED:
        case ErrorKind::INTERNAL:
        case ErrorKind::CAPNP:
        case ErrorKind::C10:
        case ErrorKind::STD:
        case ErrorKind::UNKNOWN:
        case ErrorKind::NONE:
        case ErrorKind::DIVERGED:
          return Evidence::kOwn;
      }
      return Evidence::kOwn;  // an ErrorKind from a newer writer: the process's own
    case FailureKind::TORN_DOWN:
    case FailureKind::NONE:
    case FailureKind::INCOMPLETE:
    case FailureKind::ORPHANED:
      return Evidence::kTeardown;
  }
  return Evidence::kTeardown;
}

bool more_telling(const Event& a, const Event& b) {
  return std::make_tuple(evidence_of(a), a.evidence_ns) <
         std::make_tuple(evidence_of(b), b.evidence_ns);
}

bool admitted(const Event& ev, int64_t teardown_started_ns) {
  // A rank's non-finite loss, gradient or parameters are its own numbers: no teardown causes
  // them, however late its report comes (a slower rank of a diverged step reports after the
  // ranks that only learnt of it from the step's agreement).
  if (ev.kind == schema::FailureKind::DIVERGED) return true;
  return teardown_started_ns == 0 || ev.evidence_ns < teardown_started_ns;
}

Roles assign_roles(const std::map<std::string, Event>& events,
                   std::span<const std::string> exited_abnormally) {
  Roles roles;
  const Event* first = nullptr;
  for (const auto& [name, ev] : events) {
    if (first == nullptr || more_telling(ev, *first)) {
      first = &ev;
      roles.first_failure = name;
    }
  }
  for (const auto& [name, ev] : events) {
    if (name != roles.first_failure) roles.victims.push_back(name);
  }
  if (first == nullptr) return roles;
  for (const auto& name : exited_abnormally) {
    if (!events.contains(name)) roles.torn_down.push_back(name);
  }
  return roles;
}

bool restartable(StageKind stage) {
  switch (stage) {
    case StageKind::COLLECTOR:
    case StageKind::DATA_LOADER:
    case StageKind::CHECKPOINTER:
      return true;
    case StageKind::SUPERVISOR:
    case StageKind::TRAINER:
      return false;
  }
  return false;
}

Restart decide_restart(StageKind stage, uint32_t restarts, uint32_t max_restarts,
                       bool failure_detected, bool done) {
  if (!restartable(stage)) return Restart::kFail;
  if (restarts >= max_restarts) return Restart::kExhausted;
  if (failure_detected || done) return Restart::kFail;
  return Restart::kRestart;
}

bool heartbeat_counts(uint32_t heartbeat_generation, uint32_t child_generation) {
  return heartbeat_generation == child_generation;
}

double phase_budget(const Budgets& b, StageKind stage, uint32_t step, Phase phase,
                    std::span<const double> step_seconds) {
  if (stage != StageKind::TRAINER || step == 0 || phase == Phase::STARTUP) return b.startup_s;
  double median = 0;
  if (!step_seconds.empty()) {
    std::vector<double> v(step_seconds.begin(), step_seconds.end());
    std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
    median = v[v.size() / 2];
  }
  return std::max(b.hang_s, b.hang_multiple * median);
}

double stall_budget(const Budgets& b, StageKind stage) {
  switch (stage) {
    case StageKind::COLLECTOR:
      return b.collector_stall_s;
    case StageKind::DATA_LOADER:
      return b.loader_stall_s;
    case StageKind::CHECKPOINTER:
      return b.checkpointer_stall_s;
    case StageKind::SUPERVISOR:
    case StageKind::TRAINER:
      return b.startup_s;
  }
  return b.startup_s;
}

double silence_limit(const Budgets& b, bool said_hello, double phase_budget_s) {
  return said_hello ? std::min(b.heartbeat_timeout_s, phase_budget_s) : b.startup_s;
}

std::optional<StageKind> waited_on(Phase phase) {
  if (phase == Phase::WAIT_BATCH) return StageKind::DATA_LOADER;
  if (phase == Phase::SNAPSHOT) return StageKind::CHECKPOINTER;
  return std::nullopt;
}

RankClock rank_clock(const Budgets& b, int64_t phase_started_ns, int64_t progress_ns,
                     double phase_budget_s, std::optional<StageKind> dependency,
                     int64_t dependency_started_ns) {
  RankClock clock{std::max(phase_started_ns, progress_ns), phase_budget_s};
  if (dependency) {
    clock.since_ns = std::max(clock.since_ns, dependency_started_ns);
    clock.budget_s = std::max(phase_budget_s, stall_budget(b, *dependency) + b.heartbeat_timeout_s);
  }
  return clock;
}

bool loader_starves_rank(const Budgets& b, Phase phase, uint64_t ring_depth, double waited_s,
                         bool loader_alive) {
  return phase == Phase::WAIT_BATCH && ring_depth == 0 && waited_s > b.heartbeat_timeout_s &&
         loader_alive;
}

bool swept_as_silent(const Budgets& b, bool failure_detected, bool alive, bool said_hello,
                     bool stop_sent, bool has_event, double silent_s) {
  return failure_detected && alive && said_hello && !stop_sent && !has_event &&
         silent_s > 3.0 * b.heartbeat_interval_s;
}

bool restart_reap_overdue(double since_kill_s) {
  return since_kill_s > kRestartReapBoundSeconds;
}

int teardown_signal(bool silent, char proc_state) {
  return silent || proc_state == 'T' ? SIGKILL : SIGTERM;
}

}  // namespace megacpp::supervisor::policy
