// The fold. Merge rules are chosen so the result does not depend on how records were split
// across polls: per-process facts keep the record with the greatest monotonic timestamp,
// per-journal facts follow that journal's own order, and every output is sorted by key.
#include "stages/collector/collector.h"

#include <capnp/message.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/util.h"
#include "ipc/journal.h"
#include "recipes/recipe.h"
#include "schemas/common.capnp.h"
#include "schemas/enums.h"
#include "schemas/journal.capnp.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"

namespace megacpp::collector {

namespace fs = std::filesystem;
using schema::StageKind;

namespace {

constexpr std::string_view kManifest = "manifest.json";
constexpr std::string_view kBenchResult = "bench_result.json";
constexpr std::string_view kBenchTelemetry = "bench_telemetry.json";
constexpr std::string_view kBackendIdentity = "backend_identity.json";
constexpr std::string_view kRuntimeProvenance = "runtime_provenance.json";
constexpr std::string_view kFirstForward = "first_forward.json";
constexpr std::string_view kJournalSuffix = ".journal";

// The typed kind and role of a supervisor record; a journal written before the enum fields
// carries only the obsolete Text field, read through the enum's name.
template <typename Reader>
schema::FailureKind failure_kind(Reader r) {
  if (r.getFailureKind() != schema::FailureKind::NONE || !r.hasKindText())
    return r.getFailureKind();
  return schemas::failure_kind_named(r.getKindText().cStr()).value_or(schema::FailureKind::NONE);
}

schema::FailureRole failure_role(schema::FailureEvent::Reader r) {
  if (r.getFailureRole() != schema::FailureRole::NONE || !r.hasRoleText())
    return r.getFailureRole();
  return schemas::failure_role_named(r.getRoleText().cStr()).value_or(schema::FailureRole::NONE);
}

// What is known about one process (stage, rank).
struct Process {
  // pid of the record/event with the greatest monoNs (ties: greatest pid).
  std::optional<std::pair<int64_t, int32_t>> pid;
  std::optional<int64_t> started_mono;   // latest processStarted / childStarted
  std::optional<int64_t> finished_mono;  // latest processFinished
  struct Exit {
    int64_t mono;
    int32_t code;
    int32_t signal;
    auto key() const { return std::tie(mono, code, signal); }
  };
  std::optional<Exit> exited;              // latest childExited
  std::optional<int64_t> unkillable_mono;  // latest childUnkillable
  uint32_t last_step = 0;
  std::optional<int64_t> last_wall;         // newest wallNs among the process's own records
  uint32_t restarts = 0;                    // childStarted records with reason "restart"
  std::vector<std::string> restart_causes;  // their causes, in journal order
  uint32_t generation = 0;
  schema::FailureRole role =
      schema::FailureRole::NONE;  // from the supervisor's failureObserved records

  void see_pid(int64_t mono, int32_t p) {
    if (!pid || std::make_pair(mono, p) > *pid) pid = std::make_pair(mono, p);
  }
  static void latest(std::optional<int64_t>& slot, int64_t mono) {
    if (!slot || mono > *slot) slot = mono;
  }
};

constexpr size_t kStepPhaseParts = 11;

struct StepData {
  uint32_t attempt = 0;  // the run attempt that trained it (a later attempt's record wins)
  double loss = 0;
  uint32_t tokens = 0;
  double step_seconds = 0;
  double wait_seconds = 0;
  int64_t wall_ns = 0;
  double data_epoch = 0;  // the sampler state after the step (schema StepRecord)
  double data_cursor = 0;
  double aux_loss = 0;                  // MoE models (schema StepRecord)
  std::vector<uint32_t> expert_tokens;  // empty without MoE
  // The parts of the step (schema StepPhasePoint's order), when the trainer journaled them.
  std::optional<std::array<double, kStepPhaseParts>> phases;
};

StepData step_data(uint32_t attempt, schema::StepRecord::Reader s, int64_t wall) {
  StepData d{attempt, s.getLoss(),      s.getTokens(),     s.getStepSeconds(), s.getWaitSeconds(),
             wall,    s.getDataEpoch(), s.getDataCursor(), s.getAuxLoss(),     {},
             {}};
  for (uint32_t n : s.getExpertTokens()) d.expert_tokens.push_back(n);
  if (s.hasPhases()) {
    const auto p = s.getPhases();
    d.phases = {s.getForwardSeconds(),       s.getBackwardSeconds(), s.getOptimizerSeconds(),
                p.getHandoffSeconds(),       p.getClipSeconds(),     p.getReduceSeconds(),
                p.getOrthogonalizeSeconds(), p.getUpdateSeconds(),   p.getGatherSeconds(),
                p.getSnapshotSeconds(),      p.getBetweenSeconds()};
  }
  return d;
}

void set_phases(schema::StepPhasePoint::Builder b, const std::array<double, kStepPhaseParts>& v) {
  b.setForwardSeconds(v[0]);
  b.setBackwardSeconds(v[1]);
  b.setOptimizerSeconds(v[2]);
  b.setHandoffSeconds(v[3]);
  b.setClipSeconds(v[4]);
  b.setReduceSeconds(v[5]);
  b.setOrthogonalizeSeconds(v[6]);
  b.setUpdateSeconds(v[7]);
  b.setGatherSeconds(v[8]);
  b.setSnapshotSeconds(v[9]);
  b.setBetweenSeconds(v[10]);
}

struct JournalFile {
  std::unique_ptr<ipc::JournalReader> reader;
  bool trainer = false;  // named trainer-<rank>.journal
};

uint32_t clamp32(uint64_t v) {
  return static_cast<uint32_t>(std::min<uint64_t>(v, std::numeric_limits<uint32_t>::max()));
}

}  // namespace

struct Collector::State {
  // From launch.json.
  std::string run_id, recipe, recipe_hash, created_at;
  std::string mode, blocks;  // the recipe's mode and expanded pattern (launch contract)
  uint32_t world = 0;
  uint32_t steps_planned = 0;
  // The dataset and volumes, copied into the bench receipt. Written once, in the constructor;
  // mutable only because a message builder hands out its root through a non-const accessor.
  mutable capnp::MallocMessageBuilder launch_copy;

  std::map<std::string, JournalFile> journals;  // by file name: the fold order

  // Attempts. Records of the current attempt (launch.json's) feed every field below; records
  // of other attempts feed only their attempt's summary, the step series and the checkpoints.
  uint32_t attempt = 0;
  uint32_t resume_step = 0;  // launch.json's: where the current attempt began
  struct FirstFailure {
    schema::FailureKind kind = schema::FailureKind::NONE;
    std::string message;
    StageKind stage = StageKind::SUPERVISOR;
    uint32_t rank = 0;
    schema::Phase phase = schema::Phase::STARTUP;
    uint32_t step = 0;
    int32_t pid = 0;
    int64_t evidence_wall = 0;
    int64_t detected_mono = 0, detected_wall = 0;
    double detection_seconds = 0;
    bool detection_measured = false;
    std::vector<std::string> backtrace, stderr_tail;
  };
  // The failureObserved record of a first failure, as the manifest reports it.
  static FirstFailure first_failure_of(schema::JournalRecord::Reader rec);
  struct Attempt {
    std::optional<int64_t> started_wall;  // attemptStarted, else runStarted
    std::optional<int64_t> ended_wall;    // runFinished or runOrphaned
    std::optional<uint32_t> from_step;    // attemptStarted
    std::string checkpoint, reason;
    uint32_t world = 0;
    std::vector<std::string> skipped;
    std::optional<bool> ok;    // runFinished
    bool interrupted = false;  // runFinished of a graceful stop
    schema::FailureKind finished_kind = schema::FailureKind::NONE;
    std::string finished_reason;
    StageKind finished_stage = StageKind::SUPERVISOR;
    uint32_t finished_rank = 0;
    bool orphaned = false;
    std::optional<FirstFailure> first_failure;  // the current attempt's is the manifest's
    std::map<uint32_t, uint32_t> last_step;     // trainer rank -> newest step it journaled
    // The recovery's timeline (monotonic ns of one node).
    std::optional<int64_t> started_mono;                         // attemptStarted
    std::optional<double> teardown_seconds;                      // runFinished of a failure
    std::map<uint32_t, std::pair<int64_t, int64_t>> restored;    // rank -> restore begin, end
    std::map<uint32_t, std::pair<int64_t, int64_t>> first_step;  // rank -> mono, wall
  };
  std::map<uint32_t, Attempt> attempts;
  // Committed checkpoints: (attempt, step) -> path.
  std::map<std::pair<uint32_t, uint32_t>, std::string> commits;

  std::optional<int64_t> run_started_wall;
  struct Finished {
    bool ok = false;
    std::string reason;
    schema::FailureKind kind = schema::FailureKind::NONE;
    StageKind stage = StageKind::SUPERVISOR;
    uint32_t rank = 0;
    int64_t wall_ns = 0;
    int32_t stopped_by_signal = 0;  // a graceful stop
  };
  std::optional<Finished> finished;
  std::optional<int64_t> newest_wall;
  std::map<std::pair<StageKind, uint32_t>, Process> processes;
  std::map<uint32_t, std::map<uint32_t, StepData>> steps;  // trainer rank -> step -> data
  std::map<uint32_t, double> first_forward;                // trainer rank -> seconds
  // The current attempt's start-up, per trainer rank (receipts/first_forward.json): wall ns of
  // its process start, groups joined, first forward and first backward done; and the launch,
  // the earliest stage the supervisor started in the attempt.
  struct StartUp {
    std::optional<int64_t> process, rendezvous, forward, backward;
  };
  std::map<uint32_t, StartUp> start_up;
  std::optional<int64_t> launch_wall;
  // The current attempt's trainer ranks' BackendIdentity records (receipts/backend_identity.json).
  std::map<uint32_t, std::unique_ptr<capnp::MallocMessageBuilder>> identities;
  double teardown_seconds = 0;
  struct Graph {
    std::string reason;
    int64_t wall = 0;
    capnp::MallocMessageBuilder message;
  };
  std::unique_ptr<Graph> graph;
  std::optional<std::pair<int64_t, std::string>> orphaned;  // wall, reason
  // The current attempt's teardown abort of the ranks' collectives, one record per rank asked.
  struct Abort {
    uint32_t rank = 0;
    bool answered = false, had_group = false, ok = false;
    std::string error;
    double abort_seconds = 0, reply_seconds = -1;
  };
  std::vector<Abort> aborts;

  void fold(schema::JournalRecord::Reader rec);
  void fold_attempt(schema::JournalRecord::Reader rec);
  // Where attempt `a` began (0 for the first), from its attemptStarted or launch.json.
  std::optional<uint32_t> from_step(uint32_t a) const;
  // A record of attempt `a` about step `step` still stands unless a later attempt began from
  // an earlier checkpoint (the state it describes was rolled back and trained again).
  bool stands(uint32_t a, uint32_t step) const;
  using Series = std::map<uint32_t, std::map<uint32_t, StepData>>;  // rank -> step -> data
  Series effective_steps() const;
  uint32_t steps_completed(const Series& eff) const;
  bool truncated(const Series& eff) const;
  void render_attempts(capnp::List<schema::AttemptSummary>::Builder out,
                       const fs::path& run_dir) const;
  void render_recovery(uint32_t a, schema::Recovery::Builder out) const;
};

void Collector::State::render_recovery(uint32_t a, schema::Recovery::Builder out) const {
  out.setTeardownSeconds(-1);
  out.setPrepareSeconds(-1);
  out.setRelaunchSeconds(-1);
  out.setRestoreSeconds(-1);
  out.setFirstStepSeconds(-1);
  auto it = attempts.find(a);
  if (it == attempts.end() || !it->second.started_mono) return;
  const Attempt& at = it->second;
  const int64_t started = *at.started_mono;
  auto seconds = [](int64_t from, int64_t to) { return static_cast<double>(to - from) / 1e9; };
  if (auto prev = attempts.find(a - 1); at.reason == "job_restart" && prev != attempts.end() &&
                                        prev->second.first_failure &&
                                        prev->second.teardown_seconds) {
    const FirstFailure& f = *prev->second.first_failure;
    out.setDetectedAt(rfc3339(f.detected_wall));
    out.setTeardownSeconds(*prev->second.teardown_seconds);
    out.setPrepareSeconds(seconds(f.detected_mono, started) - *prev->second.teardown_seconds);
  }
  // Every rank of the attempt must have spoken; the slowest one sets each boundary.
  const uint32_t ranks = at.world;
  const bool from_checkpoint = from_step(a).value_or(0) > 0;
  int64_t ready = started;
  if (from_checkpoint) {
    if (ranks == 0 || at.restored.size() < ranks) return;
    int64_t begin = 0, end = 0;
    for (const auto& [rank, be] : at.restored) {
      begin = std::max(begin, be.first);
      end = std::max(end, be.second);
    }
    out.setRelaunchSeconds(seconds(started, begin));
    out.setRestoreSeconds(seconds(begin, end));
    ready = end;
  }
  if (ranks == 0 || at.first_step.size() < ranks) return;
  std::pair<int64_t, int64_t> last{0, 0};
  for (const auto& [rank, mw] : at.first_step) last = std::max(last, mw);
  out.setFirstStepSeconds(seconds(ready, last.first));
  out.setFirstStepAt(rfc3339(last.second));
}

void Collector::State::render_attempts(capnp::List<schema::AttemptSummary>::Builder out,
                                       const fs::path& run_dir) const {
  for (uint32_t a = 0; a <= attempt; ++a) {
    auto sum = out[a];
    sum.setAttempt(a);
    auto it = attempts.find(a);
    const Attempt none;
    const Attempt& at = it == attempts.end() ? none : it->second;
    sum.setReason(a == 0 ? "launch" : at.reason);
    sum.setFromStep(from_step(a).value_or(0));
    sum.setCheckpoint(at.checkpoint);
    sum.setWorld(a == attempt && at.world == 0 ? world : at.world);
    if (at.started_wall) sum.setStartedAt(rfc3339(*at.started_wall));
    if (at.ended_wall) sum.setEndedAt(rfc3339(*at.ended_wall));
    const bool ok = at.ok && *at.ok;
    sum.setState(at.interrupted    ? schema::RunState::INTERRUPTED
                 : at.ok           ? (ok ? schema::RunState::OK : schema::RunState::ERROR)
                 : at.orphaned     ? schema::RunState::ORPHANED
                 : at.started_wall ? schema::RunState::RUNNING
                                   : schema::RunState::LAUNCHED);
    uint32_t last_all = 0, last_any = 0;
    if (!at.last_step.empty()) {
      last_all = std::numeric_limits<uint32_t>::max();
      for (const auto& [rank, step] : at.last_step) {
        last_all = std::min(last_all, step);
        last_any = std::max(last_any, step);
      }
    }
    sum.setLastStep(last_all);
    if (a < attempt) {
      if (auto next = from_step(a + 1); next && last_any > *next)
        sum.setStepsLost(last_any - *next);
    }
    if (at.ok && !ok && !at.interrupted) {
      auto e = sum.initError();
      e.setKind(at.finished_kind);
      e.setStage(at.finished_stage);
      e.setRank(at.finished_rank);
      e.setMessage(at.finished_reason);
      if (at.first_failure) {
        const auto& f = *at.first_failure;
        e.setKind(f.kind);
        e.setStage(f.stage);
        e.setRank(f.rank);
        e.setMessage(f.message);
        e.setPhase(f.phase);
        e.setStep(f.step);
        e.setPid(f.pid);
        e.setAt(rfc3339(f.evidence_wall));
        // An earlier attempt's failure dumps were moved aside when the next one began.
        const fs::path dump =
            a == attempt
                ? layout::failure_path(run_dir, f.stage, f.rank)
                : run_dir / "attempts" / std::to_string(a) /
                      fs::relative(layout::failure_path(run_dir, f.stage, f.rank), run_dir);
        if (fs::exists(dump)) e.setFailureDump(fs::relative(dump, run_dir).string());
      }
    } else if (at.orphaned && !at.ok) {
      auto e = sum.initError();
      e.setKind(schema::FailureKind::ORPHANED);
      e.setMessage("the supervisor vanished before the attempt ended");
    }
    auto sk = sum.initSkippedCheckpoints(static_cast<unsigned>(at.skipped.size()));
    for (size_t i = 0; i < at.skipped.size(); ++i) sk.set(static_cast<unsigned>(i), at.skipped[i]);
    if (a > 0) render_recovery(a, sum.initRecovery());
  }
}

Collector::State::FirstFailure Collector::State::first_failure_of(
    schema::JournalRecord::Reader rec) {
  auto f = rec.getFailureObserved();
  FirstFailure ff;
  ff.kind = failure_kind(f);
  ff.message = f.getMessage();
  ff.stage = f.getStage();
  ff.rank = f.getRank();
  ff.phase = f.getPhase();
  ff.step = f.getStep();
  ff.pid = f.getPid();
  // Wall time of the cause: this record's wall clock minus how long ago, monotonically.
  ff.evidence_wall = rec.getWallNs() - (rec.getMonoNs() - f.getEvidenceMonoNs());
  ff.detected_mono = f.getDetectedMonoNs();
  ff.detected_wall = rec.getWallNs() - (rec.getMonoNs() - f.getDetectedMonoNs());
  ff.detection_measured = !f.getEvidenceUnmeasured();
  ff.detection_seconds =
      ff.detection_measured
          ? static_cast<double>(f.getDetectedMonoNs() - f.getEvidenceMonoNs()) / 1e9
          : 0.0;
  for (auto l : f.getBacktrace()) ff.backtrace.emplace_back(l.cStr());
  for (auto l : f.getStderrTail()) ff.stderr_tail.emplace_back(l.cStr());
  return ff;
}

std::optional<uint32_t> Collector::State::from_step(uint32_t a) const {
  if (a == 0) return 0;
  if (a == attempt) return resume_step;
  auto it = attempts.find(a);
  if (it == attempts.end()) return std::nullopt;
  return it->second.from_step;
}

bool Collector::State::stands(uint32_t a, uint32_t step) const {
  for (const auto& [k, info] : attempts) {
    if (k <= a) continue;
    if (auto from = from_step(k); from && *from < step) return false;
  }
  if (attempt > a && resume_step < step) return false;
  return true;
}

Collector::State::Series Collector::State::effective_steps() const {
  Series out;
  for (const auto& [rank, series] : steps) {
    for (const auto& [step, d] : series) {
      if (stands(d.attempt, step)) out[rank][step] = d;
    }
  }
  return out;
}

void Collector::State::fold_attempt(schema::JournalRecord::Reader rec) {
  const uint32_t a = rec.getAttempt();
  const int64_t wall = rec.getWallNs();
  const bool from_supervisor = rec.getStage() == StageKind::SUPERVISOR && rec.getRank() == 0;
  Attempt& at = attempts[a];
  switch (rec.which()) {
    case schema::JournalRecord::ATTEMPT_STARTED:
      if (from_supervisor && !at.from_step) {
        auto s = rec.getAttemptStarted();
        at.from_step = s.getFromStep();
        at.checkpoint = s.getCheckpoint();
        at.reason = s.getReason();
        at.world = s.getWorld();
        for (auto t : s.getSkipped()) at.skipped.emplace_back(t.cStr());
        at.started_wall = wall;
        at.started_mono = rec.getMonoNs();
      }
      break;
    case schema::JournalRecord::RUN_STARTED:
      if (from_supervisor) {
        if (!at.started_wall) at.started_wall = wall;
        if (at.world == 0) at.world = rec.getRunStarted().getWorld();
      }
      break;
    case schema::JournalRecord::RUN_FINISHED:
      if (from_supervisor && !at.ok) {
        auto f = rec.getRunFinished();
        at.ok = f.getOk();
        at.interrupted = f.getStoppedBySignal() != 0;
        at.finished_kind = failure_kind(f);
        at.finished_reason = f.getReason();
        at.finished_stage = f.getStage();
        at.finished_rank = f.getRank();
        at.ended_wall = wall;
        if (!f.getOk()) at.teardown_seconds = f.getTeardownSeconds();
      }
      break;
    case schema::JournalRecord::RUN_ORPHANED:
      if (!at.ok && !at.orphaned) {
        at.orphaned = true;
        at.ended_wall = wall;
      }
      break;
    case schema::JournalRecord::FAILURE_OBSERVED:
      if (from_supervisor && !at.first_failure) {
        auto f = rec.getFailureObserved();
        if (failure_role(f) == schema::FailureRole::FIRST_FAILURE)
          at.first_failure = first_failure_of(rec);
      }
      break;
    case schema::JournalRecord::STEP:
      if (rec.getStage() == StageKind::TRAINER) {
        uint32_t& last = at.last_step[rec.getRank()];
        last = std::max(last, rec.getStep().getStep());
        auto [first, fresh] =
            at.first_step.try_emplace(rec.getRank(), rec.getMonoNs(), rec.getWallNs());
        if (!fresh && rec.getMonoNs() < first->second.first)
          first->second = {rec.getMonoNs(), rec.getWallNs()};
      }
      break;
    case schema::JournalRecord::CHECKPOINT_RESTORED:
      if (rec.getStage() == StageKind::TRAINER) {
        const auto ns = static_cast<int64_t>(rec.getCheckpointRestored().getSeconds() * 1e9);
        at.restored[rec.getRank()] = {rec.getMonoNs() - ns, rec.getMonoNs()};
      }
      break;
    default:
      break;
  }
}

void Collector::State::fold(schema::JournalRecord::Reader rec) {
  MEGACPP_CHECK(rec.getSchemaVersion() <= schema::SCHEMA_VERSION, ErrorKind::kInvalidArgument,
                fmt::format("a journal record of {}-{} is in run format version {}; this megacpp "
                            "reads versions up to {}: collect the run with a newer megacpp",
                            layout::stage_name(rec.getStage()), rec.getRank(),
                            rec.getSchemaVersion(), schema::SCHEMA_VERSION));
  const int64_t mono = rec.getMonoNs();
  const int64_t wall = rec.getWallNs();
  const StageKind stage = rec.getStage();
  const uint32_t rank = rec.getRank();
  if (!newest_wall || wall > *newest_wall) newest_wall = wall;

  fold_attempt(rec);
  const uint32_t rec_attempt = rec.getAttempt();
  if (rec_attempt != attempt) {
    // Another attempt: its steps and commits join the run's history; the rest was summarised.
    if (rec.isStep() && stage == StageKind::TRAINER) {
      auto s = rec.getStep();
      StepData& d = steps[rank][s.getStep()];
      if (rec_attempt >= d.attempt) d = step_data(rec_attempt, s, wall);
    } else if (rec.isCheckpointCommitted()) {
      auto c = rec.getCheckpointCommitted();
      commits[{rec_attempt, c.getStep()}] = c.getPath();
    }
    return;
  }
  Process& self = processes[{stage, rank}];
  self.see_pid(mono, rec.getPid());
  if (!self.last_wall || wall > *self.last_wall) self.last_wall = wall;

  const bool from_supervisor = stage == StageKind::SUPERVISOR && rank == 0;
  switch (rec.which()) {
    case schema::JournalRecord::PROCESS_STARTED:
      Process::latest(self.started_mono, mono);
      break;
    case schema::JournalRecord::PROCESS_FINISHED:
      Process::latest(self.finished_mono, mono);
      break;
    case schema::JournalRecord::STEP: {
      auto s = rec.getStep();
      self.last_step = std::max(self.last_step, s.getStep());
      if (stage == StageKind::TRAINER) {
        steps[rank][s.getStep()] = step_data(attempt, s, wall);
      }
      break;
    }
    case schema::JournalRecord::CHECKPOINT_COMMITTED: {
      auto c = rec.getCheckpointCommitted();
      commits[{attempt, c.getStep()}] = c.getPath();
      break;
    }
    case schema::JournalRecord::CHILD_STARTED: {
      auto ev = rec.getChildStarted();
      if (from_supervisor && (!launch_wall || wall < *launch_wall)) launch_wall = wall;
      Process& child = processes[{ev.getStage(), ev.getRank()}];
      child.see_pid(mono, ev.getPid());
      Process::latest(child.started_mono, mono);
      // A journal written before ChildReason carries the reason as text in `note`.
      const schema::ChildReason reason = ev.getChildReason() != schema::ChildReason::NONE
                                             ? ev.getChildReason()
                                             : schemas::child_reason_named(ev.getNote().cStr())
                                                   .value_or(schema::ChildReason::NONE);
      const bool restart = reason == schema::ChildReason::RESTART;
      if (restart) {
        ++child.restarts;
        child.restart_causes.emplace_back(ev.hasCause() ? ev.getCause().cStr() : "");
      }
      child.generation = std::max(child.generation, ev.getGeneration());
      break;
    }
    case schema::JournalRecord::FAILURE_OBSERVED:
      if (from_supervisor) {
        auto f = rec.getFailureObserved();
        Process& p = processes[{f.getStage(), f.getRank()}];
        p.role = failure_role(f);
      }
      break;
    case schema::JournalRecord::STAGE_GRAPH:
      if (from_supervisor && !graph) {
        graph = std::make_unique<Graph>();
        auto g = rec.getStageGraph();
        graph->reason = g.getReason();
        graph->wall = wall;
        graph->message.setRoot(g);
      }
      break;
    case schema::JournalRecord::RUN_ORPHANED:
      if (!orphaned)
        orphaned = std::make_pair(wall, std::string(rec.getRunOrphaned().getReason().cStr()));
      break;
    case schema::JournalRecord::CHILD_EXITED: {
      auto ev = rec.getChildExited();
      Process& child = processes[{ev.getStage(), ev.getRank()}];
      child.see_pid(mono, ev.getPid());
      Process::Exit e{mono, ev.getExitCode(), ev.getSignal()};
      if (!child.exited || e.key() > child.exited->key()) child.exited = e;
      break;
    }
    case schema::JournalRecord::CHILD_UNKILLABLE: {
      auto ev = rec.getChildUnkillable();
      Process& child = processes[{ev.getStage(), ev.getRank()}];
      child.see_pid(mono, ev.getPid());
      Process::latest(child.unkillable_mono, mono);
      break;
    }
    case schema::JournalRecord::RUN_STARTED:
      if (from_supervisor && !run_started_wall) run_started_wall = wall;
      break;
    case schema::JournalRecord::RUN_FINISHED:
      if (from_supervisor && !finished) {
        auto f = rec.getRunFinished();
        finished = Finished{f.getOk(),   f.getReason(), failure_kind(f),       f.getStage(),
                            f.getRank(), wall,          f.getStoppedBySignal()};
        teardown_seconds = f.getTeardownSeconds();
      }
      break;
    case schema::JournalRecord::COLLECTIVES_ABORTED:
      if (from_supervisor) {
        auto a = rec.getCollectivesAborted();
        aborts.push_back(Abort{a.getRank(), a.getAnswered(), a.getHadGroup(), a.getOk(),
                               a.getError(), a.getAbortSeconds(), a.getReplySeconds()});
      }
      break;
    case schema::JournalRecord::FIRST_FORWARD:
      if (stage == StageKind::TRAINER && !first_forward.contains(rank)) {
        first_forward[rank] = rec.getFirstForward().getSeconds();
      }
      if (stage == StageKind::TRAINER && !start_up[rank].forward) start_up[rank].forward = wall;
      break;
    case schema::JournalRecord::RENDEZVOUS_DONE:
      if (stage == StageKind::TRAINER && !start_up[rank].rendezvous) {
        StartUp& su = start_up[rank];
        su.rendezvous = wall;
        su.process =
            wall - static_cast<int64_t>(std::llround(rec.getRendezvousDone().getSeconds() * 1e9));
      }
      break;
    case schema::JournalRecord::FIRST_BACKWARD:
      if (stage == StageKind::TRAINER && !start_up[rank].backward) start_up[rank].backward = wall;
      break;
    case schema::JournalRecord::BACKEND_IDENTITY:
      if (stage == StageKind::TRAINER && !identities.contains(rank)) {
        auto m = std::make_unique<capnp::MallocMessageBuilder>();
        m->setRoot(rec.getBackendIdentity());
        identities[rank] = std::move(m);
      }
      break;
    default:  // a record kind newer than this collector: its header was still folded
      break;
  }
}

uint32_t Collector::State::steps_completed(const Series& eff) const {
  if (world == 0) return 0;
  uint32_t out = std::numeric_limits<uint32_t>::max();
  for (uint32_t r = 0; r < world; ++r) {
    auto it = eff.find(r);
    out = std::min(out, it == eff.end() || it->second.empty() ? 0 : it->second.rbegin()->first);
  }
  return out;
}

bool Collector::State::truncated(const Series& eff) const {
  for (const auto& [name, j] : journals) {
    if (j.trainer && j.reader->stats().torn_bytes > 0) return true;
  }
  uint32_t most = 0;
  for (const auto& [r, s] : eff) {
    if (!s.empty()) most = std::max(most, s.rbegin()->first);
  }
  for (uint32_t r = 0; r < world; ++r) {
    auto it = eff.find(r);
    const uint32_t last = it == eff.end() || it->second.empty() ? 0 : it->second.rbegin()->first;
    if (last < most) return true;
  }
  return false;
}

namespace {

schema::ProcessState stage_state(const Process& p, int32_t& exit_code, int32_t& signal) {
  exit_code = 0;
  signal = 0;
  auto after_start = [&](int64_t mono) { return !p.started_mono || mono >= *p.started_mono; };
  const bool finished = p.finished_mono && after_start(*p.finished_mono);
  if (p.unkillable_mono && after_start(*p.unkillable_mono) &&
      (!p.exited || p.exited->mono < *p.unkillable_mono)) {
    return schema::ProcessState::UNKILLABLE;
  }
  if (p.exited && after_start(p.exited->mono)) {
    exit_code = p.exited->code;
    signal = p.exited->signal;
    if (signal != 0) return schema::ProcessState::SIGNALED;
    if (exit_code == 0 && finished) return schema::ProcessState::FINISHED;
    return schema::ProcessState::EXITED;
  }
  return finished ? schema::ProcessState::FINISHED : schema::ProcessState::STARTED;
}

}  // namespace

Collector::Collector(fs::path run_dir)
    : run_dir_(std::move(run_dir)), state_(std::make_unique<State>()) {
  schemas::JsonFile<schema::LaunchContract> launch(layout::launch_path(run_dir_));
  auto l = launch.get();
  // A newer format may mean what this build cannot know (tests/schema_snapshots): refused by
  // name, never folded into a manifest that would look complete.
  MEGACPP_CHECK(l.getSchemaVersion() <= schema::SCHEMA_VERSION, ErrorKind::kInvalidArgument,
                fmt::format("run {} was written in run format version {}; this megacpp reads "
                            "versions up to {}: collect it with a newer megacpp",
                            run_dir_.string(), l.getSchemaVersion(), schema::SCHEMA_VERSION));
  state_->run_id = l.getRunId();
  state_->recipe = l.getRecipe().getName();
  state_->recipe_hash = l.getRecipe().getHash();
  {
    const recipe::ModelConfig model = recipe::model_config(l.getRecipe());
    state_->mode = model.mode;
    state_->blocks = model.blocks;
  }
  state_->created_at = l.getCreatedAt();
  state_->world = l.getWorld();
  state_->steps_planned = l.getSteps();
  state_->attempt = l.getAttempt();
  state_->resume_step = l.getResume().getStep();
  state_->launch_copy.setRoot(l);
}

Collector::~Collector() = default;

bool Collector::poll(const std::function<void()>& after_journal) {
  const fs::path dir = layout::journal_dir(run_dir_);
  const fs::path root = fs::weakly_canonical(run_dir_);
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir, ec))) layout::require_inside(root, dir);
  if (fs::is_directory(dir, ec)) {
    fs::directory_iterator it(dir, ec);
    if (ec) {
      MEGACPP_FAIL_SYS(ec.value(), "cannot list {}: {}", dir.string(), ec.message());
    }
    for (const auto& entry : it) {
      const std::string name = entry.path().filename().string();
      if (!name.ends_with(kJournalSuffix) || !entry.is_regular_file() ||
          state_->journals.contains(name)) {
        continue;
      }
      layout::require_inside(root, entry.path());
      JournalFile j;
      j.reader = std::make_unique<ipc::JournalReader>(entry.path());
      j.trainer = name.starts_with(std::string(layout::stage_name(StageKind::TRAINER)) + "-");
      state_->journals.emplace(name, std::move(j));
    }
  }
  for (auto& [name, j] : state_->journals) {
    j.reader->poll([this](schema::JournalRecord::Reader rec) { state_->fold(rec); });
    if (after_journal) after_journal();
  }
  auto before = std::move(outputs_);
  render();
  return before != outputs_;
}

int64_t Collector::newest_record_wall_ns() const {
  return state_->newest_wall.value_or(0);
}

void Collector::finish() {
  for (auto& [name, j] : state_->journals) {
    j.reader->finish([this](schema::JournalRecord::Reader rec) { state_->fold(rec); });
  }
  render();
}

void Collector::render() {
  const State& s = *state_;
  std::map<std::string, std::string> out;
  const State::Series eff = s.effective_steps();
  const uint32_t completed = s.steps_completed(eff);
  const bool terminal = s.finished.has_value() || s.orphaned.has_value();
  // `ok` is earned, not reported: a run that finished without error but short of its
  // planned steps (a rank that left early and still exited 0) is an error.
  const bool short_of_plan = s.finished && s.finished->ok && completed < s.steps_planned;

  {
    capnp::MallocMessageBuilder message;
    auto m = message.initRoot<schema::Manifest>();
    m.setSchemaVersion(schema::SCHEMA_VERSION);
    m.setRunId(s.run_id);
    m.setRecipe(s.recipe);
    m.setRecipeHash(s.recipe_hash);
    m.setWorld(s.world);
    m.setMode(s.mode);
    m.setBlocks(s.blocks);
    m.setStepsPlanned(s.steps_planned);
    m.setStepsCompleted(completed);
    if (s.finished && s.finished->stopped_by_signal != 0) {
      m.setState(schema::RunState::INTERRUPTED);
      m.setStopReason(s.finished->reason);
    } else if (s.finished) {
      m.setState(s.finished->ok && !short_of_plan ? schema::RunState::OK : schema::RunState::ERROR);
    } else if (s.orphaned) {
      m.setState(schema::RunState::ORPHANED);
    } else {
      m.setState(s.run_started_wall ? schema::RunState::RUNNING : schema::RunState::LAUNCHED);
    }
    m.setLaunchedAt(s.created_at);
    if (s.run_started_wall) m.setRunningAt(rfc3339(*s.run_started_wall));
    if (s.finished) m.setCompletedAt(rfc3339(s.finished->wall_ns));
    if (s.newest_wall) m.setLastPolledAt(rfc3339(*s.newest_wall));
    if (short_of_plan) {
      auto e = m.initError();
      e.setKind(schema::FailureKind::INCOMPLETE);
      e.setStage(StageKind::SUPERVISOR);
      e.setMessage(fmt::format("the run finished with {} of {} planned steps completed", completed,
                               s.steps_planned));
    } else if (s.finished && !s.finished->ok && s.finished->stopped_by_signal == 0) {
      auto e = m.initError();
      e.setKind(s.finished->kind);
      e.setStage(s.finished->stage);
      e.setRank(s.finished->rank);
      e.setMessage(s.finished->reason);
      e.setTeardownSeconds(s.teardown_seconds);
      auto aborted = e.initCollectivesAborted(static_cast<unsigned>(s.aborts.size()));
      for (size_t k = 0; k < s.aborts.size(); ++k) {
        const auto& a = s.aborts[k];
        auto out = aborted[static_cast<unsigned>(k)];
        out.setRank(a.rank);
        out.setAnswered(a.answered);
        out.setHadGroup(a.had_group);
        out.setOk(a.ok);
        out.setError(a.error);
        out.setAbortSeconds(a.abort_seconds);
        out.setReplySeconds(a.reply_seconds);
      }
      const auto current = s.attempts.find(s.attempt);
      if (current != s.attempts.end() && current->second.first_failure) {
        const auto& f = *current->second.first_failure;
        e.setPhase(f.phase);
        e.setStep(f.step);
        e.setPid(f.pid);
        e.setAt(rfc3339(f.evidence_wall));
        e.setDetectionSeconds(f.detection_seconds);
        e.setDetectionMeasured(f.detection_measured);
        auto dump = layout::failure_path(run_dir_, f.stage, f.rank);
        if (fs::exists(dump)) e.setFailureDump(fs::relative(dump, run_dir_).string());
        auto bt = e.initBacktrace(static_cast<unsigned>(f.backtrace.size()));
        for (size_t k = 0; k < f.backtrace.size(); ++k)
          bt.set(static_cast<unsigned>(k), f.backtrace[k]);
        auto tail = e.initStderrTail(static_cast<unsigned>(f.stderr_tail.size()));
        for (size_t k = 0; k < f.stderr_tail.size(); ++k)
          tail.set(static_cast<unsigned>(k), f.stderr_tail[k]);
      }
    } else if (!s.finished && s.orphaned) {
      auto e = m.initError();
      e.setKind(schema::FailureKind::ORPHANED);
      e.setMessage(s.orphaned->second);
    }
    auto stages = m.initStages(static_cast<unsigned>(s.processes.size()));
    unsigned i = 0;
    uint32_t total_restarts = 0;
    for (const auto& [key, p] : s.processes) {
      auto snap = stages[i++];
      snap.setStage(key.first);
      snap.setRank(key.second);
      snap.setPid(p.pid ? p.pid->second : 0);
      int32_t code = 0, signal = 0;
      snap.setState(stage_state(p, code, signal));
      snap.setExitCode(code);
      snap.setSignal(signal);
      snap.setLastStep(p.last_step);
      if (p.last_wall) snap.setLastRecordAt(rfc3339(*p.last_wall));
      snap.setRole(p.role);
      snap.setRestarts(p.restarts);
      snap.setGeneration(p.generation);
      if (!p.restart_causes.empty()) {
        auto causes = snap.initRestartCauses(static_cast<unsigned>(p.restart_causes.size()));
        for (size_t j = 0; j < p.restart_causes.size(); ++j)
          causes.set(static_cast<unsigned>(j), p.restart_causes[j]);
      }
      total_restarts += p.restarts;
    }
    m.setRestarts(total_restarts);
    if (s.graph) {
      auto g = m.initStageGraph();
      g.setReason(s.graph->reason);
      g.setAt(rfc3339(s.graph->wall));
      g.setEntries(s.graph->message.getRoot<schema::StageGraph>().getEntries());
    }
    // The newest commit that still stands (a later attempt may have set a newer one aside).
    std::optional<std::pair<uint32_t, std::string>> latest;
    for (const auto& [key, path] : s.commits) {
      const auto [a, step] = key;
      if (s.stands(a, step) && (!latest || step >= latest->first)) latest = {step, path};
    }
    if (latest) {
      m.setLatestCheckpoint(latest->second);
      m.setLatestCheckpointStep(latest->first);
    }
    m.setAttempt(s.attempt);
    s.render_attempts(m.initAttempts(s.attempt + 1), run_dir_);
    if (const auto launch = s.launch_copy.getRoot<schema::LaunchContract>().asReader();
        launch.hasParent() && launch.getParent().hasRunId()) {
      m.setParent(launch.getParent());
    }
    if (terminal) {
      auto receipts = m.initReceipts(5);
      receipts.set(0, std::string(kBenchResult));
      receipts.set(1, std::string(kBenchTelemetry));
      receipts.set(2, std::string(kBackendIdentity));
      receipts.set(3, std::string(kRuntimeProvenance));
      receipts.set(4, std::string(kFirstForward));
    }
    auto journals = m.initJournals(static_cast<unsigned>(s.journals.size()));
    i = 0;
    for (const auto& [name, j] : s.journals) {
      auto js = journals[i++];
      js.setName(name);
      js.setRecords(clamp32(j.reader->stats().records));
      js.setTornBytes(clamp32(j.reader->stats().torn_bytes));
    }
    out[std::string(kManifest)] = schemas::to_json(m.asReader());
  }

  if (terminal) {
    // Per-step series over every step any rank recorded.
    struct Point {
      double loss_sum = 0;
      uint32_t ranks = 0;
      double step_max = 0;
      double wait_max = 0;
      double data_epoch = 0, data_cursor = 0;  // every rank reports the same global state
      double aux_sum = 0;
      std::vector<uint32_t> expert_tokens;  // summed over ranks
      std::array<double, kStepPhaseParts> phase_sum{};
      uint32_t phase_ranks = 0;
    };
    std::map<uint32_t, Point> points;
    double tokens = 0;
    std::optional<int64_t> first_start, rank0_start, last_end;
    for (const auto& [rank, series] : eff) {
      for (const auto& [step, d] : series) {
        Point& p = points[step];
        p.loss_sum += d.loss;
        p.ranks += 1;
        p.step_max = std::max(p.step_max, d.step_seconds);
        p.wait_max = std::max(p.wait_max, d.wait_seconds);
        p.data_epoch = d.data_epoch;
        p.data_cursor = d.data_cursor;
        p.aux_sum += d.aux_loss;
        if (p.expert_tokens.size() < d.expert_tokens.size())
          p.expert_tokens.resize(d.expert_tokens.size());
        for (size_t e = 0; e < d.expert_tokens.size(); ++e)
          p.expert_tokens[e] += d.expert_tokens[e];
        if (d.phases) {
          for (size_t k = 0; k < kStepPhaseParts; ++k) p.phase_sum[k] += (*d.phases)[k];
          p.phase_ranks += 1;
        }
        tokens += d.tokens;
        const int64_t start = d.wall_ns - static_cast<int64_t>(std::llround(d.step_seconds * 1e9));
        if (!first_start || start < *first_start) first_start = start;
        if (rank == 0 && step == 1) rank0_start = start;
        if (!last_end || d.wall_ns > *last_end) last_end = d.wall_ns;
      }
    }
    auto mean_loss_at = [&](uint32_t step) {
      auto it = points.find(step);
      return it == points.end() || it->second.ranks == 0 ? 0.0
                                                         : it->second.loss_sum / it->second.ranks;
    };
    double wall_seconds = 0;
    if (last_end) {
      const int64_t start = rank0_start ? *rank0_start : *first_start;
      wall_seconds = std::max(0.0, static_cast<double>(*last_end - start) / 1e9);
    }
    double step_seconds_sum = 0;
    for (uint32_t step = 1; step <= completed; ++step) {
      auto it = points.find(step);
      if (it != points.end()) step_seconds_sum += it->second.step_max;
    }

    capnp::MallocMessageBuilder result_message;
    auto r = result_message.initRoot<schema::BenchResult>();
    r.setSchemaVersion(schema::SCHEMA_VERSION);
    r.setRunId(s.run_id);
    r.setRecipe(s.recipe);
    r.setRecipeHash(s.recipe_hash);
    r.setWorld(s.world);
    r.setSteps(completed);
    r.setTokens(tokens);
    // A --from branch starts after its parent's step: its first step is the one it trained.
    r.setFirstLoss(points.empty() ? 0.0 : mean_loss_at(points.begin()->first));
    r.setLastLoss(completed > 0 ? mean_loss_at(completed) : 0.0);
    r.setWallSeconds(wall_seconds);
    r.setTokensPerSecond(wall_seconds > 0 ? tokens / wall_seconds : 0.0);
    r.setMeanStepSeconds(completed > 0 ? step_seconds_sum / completed : 0.0);
    const auto launch = s.launch_copy.getRoot<schema::LaunchContract>().asReader();
    r.setDataset(launch.getDataset());
    r.setVolumes(launch.getVolumes());
    r.setDevice(launch.getDevice().size() > 0 ? launch.getDevice() : capnp::Text::Reader("cpu"));
    r.setCollectives(launch.getCollectives());
    r.setMode(s.mode);
    r.setBlocks(s.blocks);
    out["receipts/" + std::string(kBenchResult)] = schemas::to_json(r.asReader());

    capnp::MallocMessageBuilder telemetry_message;
    auto t = telemetry_message.initRoot<schema::BenchTelemetry>();
    t.setSchemaVersion(schema::SCHEMA_VERSION);
    t.setRunId(s.run_id);
    auto list = t.initSteps(static_cast<unsigned>(points.size()));
    unsigned i = 0;
    for (const auto& [step, p] : points) {
      auto sp = list[i++];
      sp.setStep(step);
      sp.setLoss(p.loss_sum / p.ranks);
      sp.setStepSeconds(p.step_max);
      sp.setWaitSeconds(p.wait_max);
      sp.setDataEpoch(p.data_epoch);
      sp.setDataCursor(p.data_cursor);
      if (!p.expert_tokens.empty()) {
        auto moe = sp.initMoe();
        moe.setAuxLoss(p.aux_sum / p.ranks);
        auto et = moe.initExpertTokens(static_cast<unsigned>(p.expert_tokens.size()));
        for (unsigned e = 0; e < et.size(); ++e) et.set(e, p.expert_tokens[e]);
      }
      if (p.phase_ranks > 0) {
        std::array<double, kStepPhaseParts> mean = p.phase_sum;
        for (double& v : mean) v /= p.phase_ranks;
        set_phases(sp.initPhases(), mean);
      }
    }
    auto ff = t.initFirstForwardSeconds(s.world);
    for (uint32_t rank = 0; rank < s.world; ++rank) {
      auto it = s.first_forward.find(rank);
      ff.set(rank, it == s.first_forward.end() ? 0.0 : it->second);
    }
    t.setTelemetryTruncated(s.truncated(eff));
    out["receipts/" + std::string(kBenchTelemetry)] = schemas::to_json(t.asReader());

    capnp::MallocMessageBuilder identity_message;
    auto bi = identity_message.initRoot<schema::BackendIdentityReceipt>();
    bi.setSchemaVersion(schema::SCHEMA_VERSION);
    bi.setRunId(s.run_id);
    bi.setBuild(launch.getProvenance());
    auto bir = bi.initRanks(s.world);
    for (uint32_t rank = 0; rank < s.world; ++rank) {
      bir[rank].setRank(rank);
      bir[rank].setAttempt(s.attempt);
      if (auto it = s.identities.find(rank); it != s.identities.end())
        bir[rank].setIdentity(it->second->getRoot<schema::BackendIdentity>().asReader());
    }
    out["receipts/" + std::string(kBackendIdentity)] = schemas::to_json(bi.asReader());

    capnp::MallocMessageBuilder provenance_message;
    auto rp = provenance_message.initRoot<schema::RuntimeProvenance>();
    rp.setSchemaVersion(schema::SCHEMA_VERSION);
    rp.setRunId(s.run_id);
    rp.setRecipe(s.recipe);
    rp.setRecipeHash(s.recipe_hash);
    rp.setArgv(launch.getArgv());
    rp.setEnv(launch.getEnv());
    rp.setHostname(launch.getProvenance().getHostname());
    rp.setKernel(launch.getProvenance().getKernel());
    rp.setCpuModel(launch.getProvenance().getCpuModel());
    rp.setCpuCount(launch.getProvenance().getCpuCount());
    rp.setVolumes(launch.getVolumes());
    rp.setDataset(launch.getDataset());
    rp.setDevice(launch.getDevice().size() > 0 ? launch.getDevice() : capnp::Text::Reader("cpu"));
    rp.setAttempt(s.attempt);
    out["receipts/" + std::string(kRuntimeProvenance)] = schemas::to_json(rp.asReader());

    capnp::MallocMessageBuilder first_message;
    auto fr = first_message.initRoot<schema::FirstForwardReceipt>();
    fr.setSchemaVersion(schema::SCHEMA_VERSION);
    fr.setRunId(s.run_id);
    fr.setAttempt(s.attempt);
    auto frr = fr.initRanks(s.world);
    auto since_launch = [&](const std::optional<int64_t>& at) {
      return at && s.launch_wall ? static_cast<double>(*at - *s.launch_wall) / 1e9 : -1.0;
    };
    int32_t slowest = -1;
    double fastest_backward = 0, slowest_backward = 0;
    for (uint32_t rank = 0; rank < s.world; ++rank) {
      const auto it = s.start_up.find(rank);
      const State::StartUp su = it == s.start_up.end() ? State::StartUp{} : it->second;
      frr[rank].setRank(rank);
      frr[rank].setProcessStartSeconds(since_launch(su.process));
      frr[rank].setRendezvousSeconds(since_launch(su.rendezvous));
      frr[rank].setFirstForwardSeconds(since_launch(su.forward));
      const double backward = since_launch(su.backward);
      frr[rank].setFirstBackwardSeconds(backward);
      if (backward < 0) continue;
      const bool first = slowest < 0;
      if (first || backward > slowest_backward) {
        slowest = static_cast<int32_t>(rank);
        slowest_backward = backward;
      }
      if (first || backward < fastest_backward) fastest_backward = backward;
    }
    fr.setSlowestRank(slowest);
    fr.setSpreadSeconds(slowest < 0 ? 0.0 : slowest_backward - fastest_backward);
    out["receipts/" + std::string(kFirstForward)] = schemas::to_json(fr.asReader());
  }
  outputs_ = std::move(out);
}

void Collector::write() {
  const fs::path root = fs::weakly_canonical(run_dir_);
  for (const auto& [rel, bytes] : outputs_) {
    auto known = on_disk_.find(rel);
    if (known != on_disk_.end() && known->second == bytes) continue;
    const fs::path path = run_dir_ / rel;
    layout::require_inside(root, path);
    std::error_code ec;
    bool same = false;
    if (fs::exists(path, ec)) {
      try {
        same = read_file(path) == bytes;
      } catch (const Error&) {
        same = false;  // unreadable: replace it
      }
    }
    if (!same) {
      fs::create_directories(path.parent_path(), ec);
      if (ec) {
        MEGACPP_FAIL_SYS(ec.value(), "cannot create {}: {}", path.parent_path().string(),
                         ec.message());
      }
      write_file_atomic(path, bytes);
    }
    on_disk_[rel] = bytes;
  }
}

void collect_run(const fs::path& run_dir) {
  Collector c(run_dir);
  c.poll();
  c.finish();
  c.write();
}

}  // namespace megacpp::collector
