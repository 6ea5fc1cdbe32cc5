// The fold proper: one journal record at a time into FoldState. Merge rules are chosen so the
// result does not depend on how records were split across polls: per-process facts keep the
// record with the greatest monotonic timestamp, per-journal facts follow that journal's own
// order, and every output is sorted by key.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "recipes/recipe.h"
#include "schemas/enums.h"
#include "schemas/run_layout.h"
#include "stages/collector/detail/fold_state.h"

namespace megacpp::collector::detail {

using schema::StageKind;

namespace {

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

StepData step_data(uint32_t attempt, schema::StepRecord::Reader s, int64_t wall) {
  StepData d{attempt,
             s.getLoss(),
             s.getTokens(),
             s.getStepSeconds(),
             s.getWaitSeconds(),
             wall,
             s.getDataEpoch(),
             s.getDataCursor(),
             s.getAuxLoss(),
             {},
             {},
             0,
             0};
  for (uint32_t n : s.getExpertTokens()) d.expert_tokens.push_back(n);
  d.memory_peak = s.getMemoryPeak();
  d.memory_baseline = s.getMemoryBaseline();
  d.memory_file = s.getMemoryFile();
  d.memory_baseline_file = s.getMemoryBaselineFile();
  d.device_memory_peak = s.getDeviceMemoryPeak();
  d.device_memory_reserved = s.getDeviceMemoryReserved();
  if (s.hasPhases()) {
    const auto p = s.getPhases();
    d.phases = {s.getForwardSeconds(),       s.getBackwardSeconds(), s.getOptimizerSeconds(),
                p.getHandoffSeconds(),       p.getClipSeconds(),     p.getReduceSeconds(),
                p.getOrthogonalizeSeconds(), p.getUpdateSeconds(),   p.getGatherSeconds(),
                p.getSnapshotSeconds(),      p.getBetweenSeconds()};
  }
  return d;
}

}  // namespace

schema::Provenance::Reader RunIdentity::build() const {
  return build_copy.getRoot<schema::Provenance>().asReader();
}

void read_identity(schema::LaunchContract::Reader l, RunIdentity& id) {
  id.run_id = l.getRunId();
  id.recipe = l.getRecipe().getName();
  id.recipe_hash = l.getRecipe().getHash();
  id.world = l.getWorld();
  // Contracts written before the fields: one node, every rank.
  id.first_rank = l.getLocalRanks() != 0 ? l.getFirstRank() : 0;
  id.ranks = l.getLocalRanks() != 0 ? l.getLocalRanks() : l.getWorld();
  id.attempt = l.getAttempt();
  const recipe::ModelConfig model = recipe::model_config(l.getRecipe());
  id.mode = model.mode;
  id.blocks = model.blocks;
  const recipe::TrainConfig train = recipe::train_config(l.getRecipe().getTrain());
  id.precision = train.precision;
  id.grad_reduce = train.grad_reduce;
  id.recompute = train.recompute;
  id.memory_declared = l.getRecipe().getTrain().hasMemory();
  const capnp::Text::Reader device = l.getDevice();
  id.device = device.size() > 0 ? std::string(device.begin(), device.size()) : "cpu";
  id.build_copy.setRoot(l.getProvenance());
}

schema::LaunchContract::Reader FoldState::launch() const {
  return launch_copy.getRoot<schema::LaunchContract>().asReader();
}

void FoldState::read_launch(schema::LaunchContract::Reader l) {
  read_identity(l, run);
  created_at = l.getCreatedAt();
  steps_planned = l.getSteps();
  resume_step = l.getResume().getStep();
  launch_copy.setRoot(l);
}

FoldState::FirstFailure FoldState::first_failure_of(schema::JournalRecord::Reader rec) {
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

std::optional<uint32_t> FoldState::from_step(uint32_t a) const {
  if (a == 0) return 0;
  if (a == run.attempt) return resume_step;
  auto it = attempts.find(a);
  if (it == attempts.end()) return std::nullopt;
  return it->second.from_step;
}

bool FoldState::stands(uint32_t a, uint32_t step) const {
  for (const auto& [k, info] : attempts) {
    if (k <= a) continue;
    if (auto from = from_step(k); from && *from < step) return false;
  }
  if (run.attempt > a && resume_step < step) return false;
  return true;
}

FoldState::Series FoldState::effective_steps() const {
  Series out;
  for (const auto& [rank, series] : steps) {
    for (const auto& [step, d] : series) {
      if (stands(d.attempt, step)) out[rank][step] = d;
    }
  }
  return out;
}

std::map<uint32_t, std::map<uint32_t, EvalData>> FoldState::effective_evaluations() const {
  std::map<uint32_t, std::map<uint32_t, EvalData>> out;
  for (const auto& [rank, series] : evaluations)
    for (const auto& [step, e] : series)
      if (stands(e.attempt, step)) out[step][rank] = e;
  return out;
}

void FoldState::fold_attempt(schema::JournalRecord::Reader rec) {
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

void FoldState::fold(schema::JournalRecord::Reader rec) {
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
  if (rec.isEvaluation() && stage == StageKind::TRAINER) {
    auto e = rec.getEvaluation();
    EvalData& d = evaluations[rank][e.getStep()];
    if (rec_attempt >= d.attempt)
      d = {.attempt = rec_attempt,
           .loss = e.getLoss(),
           .tokens = static_cast<double>(e.getTokens()),
           .seconds = e.getSeconds(),
           .wait_seconds = e.getWaitSeconds(),
           .wall_ns = wall};
  }
  if (rec_attempt != run.attempt) {
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
        steps[rank][s.getStep()] = step_data(run.attempt, s, wall);
      }
      break;
    }
    case schema::JournalRecord::CHECKPOINT_COMMITTED: {
      auto c = rec.getCheckpointCommitted();
      commits[{run.attempt, c.getStep()}] = c.getPath();
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
    case schema::JournalRecord::JOB_VIEW:
      if (stage == StageKind::SUPERVISOR) job_view = std::string(rec.getJobView().cStr());
      break;
    default:  // a record kind newer than this collector: its header was still folded
      break;
  }
}

uint32_t FoldState::steps_completed(const Series& eff) const {
  if (run.ranks == 0) return 0;
  uint32_t out = std::numeric_limits<uint32_t>::max();
  for (uint32_t r = run.first_rank; r < run.first_rank + run.ranks; ++r) {
    auto it = eff.find(r);
    out = std::min(out, it == eff.end() || it->second.empty() ? 0 : it->second.rbegin()->first);
  }
  return out;
}

bool FoldState::truncated(const Series& eff) const {
  for (const auto& [name, j] : journals) {
    if (j.trainer && j.torn_bytes > 0) return true;
  }
  uint32_t most = 0;
  for (const auto& [r, s] : eff) {
    if (!s.empty()) most = std::max(most, s.rbegin()->first);
  }
  for (uint32_t r = run.first_rank; r < run.first_rank + run.ranks; ++r) {
    auto it = eff.find(r);
    const uint32_t last = it == eff.end() || it->second.empty() ? 0 : it->second.rbegin()->first;
    if (last < most) return true;
  }
  return false;
}

}  // namespace megacpp::collector::detail
