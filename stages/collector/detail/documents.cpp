// One function per document of a run (detail/documents.h).
#include "stages/collector/detail/documents.h"

#include <capnp/message.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/util.h"
#include "schemas/json.h"
#include "schemas/manifest.capnp.h"

namespace megacpp::collector::detail {

namespace fs = std::filesystem;
using schema::StageKind;

namespace {

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

uint32_t clamp32(uint64_t v) {
  return static_cast<uint32_t>(std::min<uint64_t>(v, std::numeric_limits<uint32_t>::max()));
}

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

void render_recovery(const FoldState& s, uint32_t a, schema::Recovery::Builder out) {
  out.setTeardownSeconds(-1);
  out.setPrepareSeconds(-1);
  out.setRelaunchSeconds(-1);
  out.setRestoreSeconds(-1);
  out.setFirstStepSeconds(-1);
  auto it = s.attempts.find(a);
  if (it == s.attempts.end() || !it->second.started_mono) return;
  const FoldState::Attempt& at = it->second;
  const int64_t started = *at.started_mono;
  auto seconds = [](int64_t from, int64_t to) { return static_cast<double>(to - from) / 1e9; };
  if (auto prev = s.attempts.find(a - 1); at.reason == "job_restart" && prev != s.attempts.end() &&
                                          prev->second.first_failure &&
                                          prev->second.teardown_seconds) {
    const FoldState::FirstFailure& f = *prev->second.first_failure;
    out.setDetectedAt(rfc3339(f.detected_wall));
    out.setTeardownSeconds(*prev->second.teardown_seconds);
    out.setPrepareSeconds(seconds(f.detected_mono, started) - *prev->second.teardown_seconds);
  }
  // Every rank of the attempt must have spoken; the slowest one sets each boundary.
  // A node of a job across nodes folds its own ranks.
  const uint32_t ranks = s.run.ranks != s.run.world ? s.run.ranks : at.world;
  const bool from_checkpoint = s.from_step(a).value_or(0) > 0;
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

void render_attempts(const FoldState& s, capnp::List<schema::AttemptSummary>::Builder out,
                     const fs::path& run_dir) {
  for (uint32_t a = 0; a <= s.run.attempt; ++a) {
    auto sum = out[a];
    sum.setAttempt(a);
    auto it = s.attempts.find(a);
    const FoldState::Attempt none;
    const FoldState::Attempt& at = it == s.attempts.end() ? none : it->second;
    sum.setReason(a == 0 ? "launch" : at.reason);
    sum.setFromStep(s.from_step(a).value_or(0));
    sum.setCheckpoint(at.checkpoint);
    sum.setWorld(a == s.run.attempt && at.world == 0 ? s.run.world : at.world);
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
    if (a < s.run.attempt) {
      if (auto next = s.from_step(a + 1); next && last_any > *next)
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
            a == s.run.attempt
                ? layout::failure_path(run_dir, f.stage, f.rank)
                : layout::attempt_dir(run_dir, a) /
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
    if (a > 0) render_recovery(s, a, sum.initRecovery());
  }
}

}  // namespace

// The run's held-out evaluations against its launch contract's validation set.
void render_validation(schema::LaunchContract::Reader contract, const RunView& v,
                       schema::ValidationResult::Builder out) {
  const auto launch = contract.getValidation();
  out.setEvery(launch.getEvery());
  out.setWindows(launch.getWindows());
  out.setDigest(launch.getDigest());
  out.setOff(launch.getOff());
  out.setTokens(static_cast<double>(launch.getWindows()) *
                static_cast<double>(contract.getRecipe().getModel().getSeqLen()));
  out.setEvaluations(static_cast<uint32_t>(v.evaluations.size()));
  double seconds = 0;
  std::optional<std::pair<double, uint32_t>> best;
  for (const auto& [step, e] : v.evaluations) {
    seconds += e.seconds;
    out.setTokens(e.tokens);
    out.setLastLoss(e.loss);
    out.setLastStep(step);
    if (!best || e.loss < best->first) best = {e.loss, step};
  }
  if (best) {
    out.setBestLoss(best->first);
    out.setBestStep(best->second);
  }
  out.setSeconds(seconds);
}

RunView view_of(const FoldState& s) {
  RunView v;
  v.effective = s.effective_steps();
  v.completed = s.steps_completed(v.effective);
  v.terminal = s.finished.has_value() || s.orphaned.has_value();
  v.short_of_plan = s.finished && s.finished->ok && v.completed < s.steps_planned;
  for (const auto& [step, ranks] : s.effective_evaluations()) {
    RunView::Evaluation& e = v.evaluations[step];
    e.loss = ranks.begin()->second.loss;
    e.tokens = ranks.begin()->second.tokens;
    e.first_wall_ns = ranks.begin()->second.wall_ns;
    for (const auto& [rank, d] : ranks) {
      e.seconds = std::max(e.seconds, d.seconds);
      e.wait_seconds = std::max(e.wait_seconds, d.wait_seconds);
      e.first_wall_ns = std::min(e.first_wall_ns, d.wall_ns);
    }
  }
  if (!v.terminal) return v;
  std::optional<int64_t> first_start, rank0_start, last_end;
  for (const auto& [rank, series] : v.effective) {
    for (const auto& [step, d] : series) {
      StepPoint& p = v.points[step];
      p.loss_sum += d.loss;
      p.ranks += 1;
      p.step_max = std::max(p.step_max, d.step_seconds);
      p.wait_max = std::max(p.wait_max, d.wait_seconds);
      p.data_epoch = d.data_epoch;
      p.data_cursor = d.data_cursor;
      p.aux_sum += d.aux_loss;
      if (p.expert_tokens.size() < d.expert_tokens.size())
        p.expert_tokens.resize(d.expert_tokens.size());
      for (size_t e = 0; e < d.expert_tokens.size(); ++e) p.expert_tokens[e] += d.expert_tokens[e];
      if (d.phases) {
        for (size_t k = 0; k < kStepPhaseParts; ++k) p.phase_sum[k] += (*d.phases)[k];
        p.phase_ranks += 1;
      }
      v.tokens += d.tokens;
      v.memory_peak = std::max(v.memory_peak, static_cast<double>(d.memory_peak));
      v.device_memory_peak =
          std::max(v.device_memory_peak, static_cast<double>(d.device_memory_peak));
      v.device_memory_reserved =
          std::max(v.device_memory_reserved, static_cast<double>(d.device_memory_reserved));
      // The rank's own memory: file-backed pages (libtorch's code) out of both ends when the
      // record has them (journal.capnp StepRecord).
      const uint64_t own_peak = d.memory_peak - std::min(d.memory_peak, d.memory_file);
      const uint64_t own_baseline =
          d.memory_baseline - std::min(d.memory_baseline, d.memory_baseline_file);
      if (own_peak >= own_baseline && d.memory_baseline > 0)
        v.memory_above_baseline =
            std::max(v.memory_above_baseline, static_cast<double>(own_peak - own_baseline));
      const int64_t start = d.wall_ns - static_cast<int64_t>(std::llround(d.step_seconds * 1e9));
      if (!first_start || start < *first_start) first_start = start;
      if (rank == 0 && step == 1) rank0_start = start;
      if (!last_end || d.wall_ns > *last_end) last_end = d.wall_ns;
    }
  }
  if (last_end) {
    const int64_t start = rank0_start ? *rank0_start : *first_start;
    v.wall_seconds = std::max(0.0, static_cast<double>(*last_end - start) / 1e9);
  }
  // An evaluation that ended before the last step did lies inside the training wall time.
  for (const auto& [step, e] : v.evaluations)
    if (last_end && e.first_wall_ns < *last_end) v.eval_seconds_inside += e.seconds;
  for (uint32_t step = 1; step <= v.completed; ++step) {
    auto it = v.points.find(step);
    if (it != v.points.end()) v.step_seconds_sum += it->second.step_max;
  }
  return v;
}

std::string manifest_document(const FoldState& s, const RunView& v, const fs::path& run_dir) {
  capnp::MallocMessageBuilder message;
  auto m = message.initRoot<schema::Manifest>();
  stamp_identity(m, s.run);
  m.setStepsPlanned(s.steps_planned);
  m.setStepsCompleted(v.completed);
  if (s.finished && s.finished->stopped_by_signal != 0) {
    m.setState(schema::RunState::INTERRUPTED);
    m.setStopReason(s.finished->reason);
  } else if (s.finished) {
    m.setState(s.finished->ok && !v.short_of_plan ? schema::RunState::OK : schema::RunState::ERROR);
  } else if (s.orphaned) {
    m.setState(schema::RunState::ORPHANED);
  } else {
    m.setState(s.run_started_wall ? schema::RunState::RUNNING : schema::RunState::LAUNCHED);
  }
  m.setLaunchedAt(s.created_at);
  if (s.run_started_wall) m.setRunningAt(rfc3339(*s.run_started_wall));
  if (s.finished) m.setCompletedAt(rfc3339(s.finished->wall_ns));
  if (s.newest_wall) m.setLastPolledAt(rfc3339(*s.newest_wall));
  if (v.short_of_plan) {
    auto e = m.initError();
    e.setKind(schema::FailureKind::INCOMPLETE);
    e.setStage(StageKind::SUPERVISOR);
    e.setMessage(fmt::format("the run finished with {} of {} planned steps completed", v.completed,
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
    const auto current = s.attempts.find(s.run.attempt);
    if (current != s.attempts.end() && current->second.first_failure) {
      const auto& f = *current->second.first_failure;
      e.setPhase(f.phase);
      e.setStep(f.step);
      e.setPid(f.pid);
      e.setAt(rfc3339(f.evidence_wall));
      e.setDetectionSeconds(f.detection_seconds);
      e.setDetectionMeasured(f.detection_measured);
      auto dump = layout::failure_path(run_dir, f.stage, f.rank);
      if (fs::exists(dump)) e.setFailureDump(fs::relative(dump, run_dir).string());
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
  render_attempts(s, m.initAttempts(s.run.attempt + 1), run_dir);
  if (s.launch().hasValidation()) render_validation(s.launch(), v, m.initValidation());
  if (const auto launch = s.launch(); launch.hasParent() && launch.getParent().hasRunId()) {
    m.setParent(launch.getParent());
  }
  if (v.terminal) {
    auto receipts = m.initReceipts(static_cast<unsigned>(kReceipts.size()));
    for (unsigned k = 0; k < kReceipts.size(); ++k)
      receipts.set(k, capnp::Text::Reader(kReceipts[k].name.data(), kReceipts[k].name.size()));
  }
  auto journals = m.initJournals(static_cast<unsigned>(s.journals.size()));
  i = 0;
  for (const auto& [name, j] : s.journals) {
    auto js = journals[i++];
    js.setName(name);
    js.setRecords(clamp32(j.records));
    js.setTornBytes(clamp32(j.torn_bytes));
  }
  return schemas::to_json(m.asReader());
}

std::string bench_result_document(const FoldState& s, const RunView& v) {
  auto mean_loss_at = [&](uint32_t step) {
    auto it = v.points.find(step);
    return it == v.points.end() || it->second.ranks == 0 ? 0.0
                                                         : it->second.loss_sum / it->second.ranks;
  };
  capnp::MallocMessageBuilder message;
  auto r = message.initRoot<schema::BenchResult>();
  stamp_identity(r, s.run);
  r.setSteps(v.completed);
  r.setTokens(v.tokens);
  // A --from branch starts after its parent's step: its first step is the one it trained.
  r.setFirstLoss(v.points.empty() ? 0.0 : mean_loss_at(v.points.begin()->first));
  r.setLastLoss(v.completed > 0 ? mean_loss_at(v.completed) : 0.0);
  r.setWallSeconds(v.wall_seconds);
  // The training time: the evaluations inside the wall time are not in tokens/s.
  const double training = std::max(0.0, v.wall_seconds - v.eval_seconds_inside);
  r.setTokensPerSecond(training > 0 ? v.tokens / training : 0.0);
  r.setMeanStepSeconds(v.completed > 0 ? v.step_seconds_sum / v.completed : 0.0);
  if (v.memory_peak > 0) {
    auto memory = r.initMemory();
    memory.setPeak(v.memory_peak);
    memory.setAboveBaseline(v.memory_above_baseline);
    memory.setDevicePeak(v.device_memory_peak);
    memory.setDeviceReserved(v.device_memory_reserved);
  }
  const auto launch = s.launch();
  if (launch.hasValidation()) {
    auto validation = r.initValidation();
    render_validation(launch, v, validation);
    validation.setTrainingSeconds(training);
  }
  r.setDataset(launch.getDataset());
  r.setVolumes(launch.getVolumes());
  r.setCollectives(launch.getCollectives());
  return schemas::to_json(r.asReader());
}

std::string bench_telemetry_document(const FoldState& s, const RunView& v) {
  capnp::MallocMessageBuilder message;
  auto t = message.initRoot<schema::BenchTelemetry>();
  stamp_identity(t, s.run);
  auto list = t.initSteps(static_cast<unsigned>(v.points.size()));
  unsigned i = 0;
  for (const auto& [step, p] : v.points) {
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
      for (double& x : mean) x /= p.phase_ranks;
      set_phases(sp.initPhases(), mean);
    }
  }
  // This node's ranks, in order (the world on one node).
  auto ff = t.initFirstForwardSeconds(s.run.ranks);
  for (uint32_t i = 0; i < s.run.ranks; ++i) {
    auto it = s.first_forward.find(s.run.first_rank + i);
    ff.set(i, it == s.first_forward.end() ? 0.0 : it->second);
  }
  t.setTelemetryTruncated(s.truncated(v.effective));
  // Absent without an evaluation (as in receipts written before evaluation existed).
  auto evals = v.evaluations.empty()
                   ? capnp::List<schema::EvaluationPoint>::Builder()
                   : t.initEvaluations(static_cast<unsigned>(v.evaluations.size()));
  i = 0;
  for (const auto& [step, e] : v.evaluations) {
    auto ep = evals[i++];
    ep.setStep(step);
    ep.setLoss(e.loss);
    ep.setTokens(e.tokens);
    ep.setSeconds(e.seconds);
    ep.setWaitSeconds(e.wait_seconds);
  }
  return schemas::to_json(t.asReader());
}

std::string backend_identity_document(const FoldState& s, const RunView&) {
  capnp::MallocMessageBuilder message;
  auto bi = message.initRoot<schema::BackendIdentityReceipt>();
  stamp_identity(bi, s.run);
  auto ranks = bi.initRanks(s.run.ranks);
  for (uint32_t i = 0; i < s.run.ranks; ++i) {
    const uint32_t rank = s.run.first_rank + i;
    ranks[i].setRank(rank);
    ranks[i].setAttempt(s.run.attempt);
    if (auto it = s.identities.find(rank); it != s.identities.end())
      ranks[i].setIdentity(it->second->getRoot<schema::BackendIdentity>().asReader());
  }
  return schemas::to_json(bi.asReader());
}

std::string runtime_provenance_document(const FoldState& s, const RunView&) {
  capnp::MallocMessageBuilder message;
  auto rp = message.initRoot<schema::RuntimeProvenance>();
  stamp_identity(rp, s.run);
  const auto launch = s.launch();
  rp.setArgv(launch.getArgv());
  rp.setEnv(launch.getEnv());
  rp.setHostname(launch.getProvenance().getHostname());
  rp.setKernel(launch.getProvenance().getKernel());
  rp.setCpuModel(launch.getProvenance().getCpuModel());
  rp.setCpuCount(launch.getProvenance().getCpuCount());
  rp.setVolumes(launch.getVolumes());
  rp.setDataset(launch.getDataset());
  // Contracts written before the field have none; their receipt stays as it was.
  if (launch.hasPlacement()) rp.setPlacement(launch.getPlacement());
  return schemas::to_json(rp.asReader());
}

std::string first_forward_document(const FoldState& s, const RunView&) {
  capnp::MallocMessageBuilder message;
  auto fr = message.initRoot<schema::FirstForwardReceipt>();
  stamp_identity(fr, s.run);
  auto ranks = fr.initRanks(s.run.ranks);
  auto since_launch = [&](const std::optional<int64_t>& at) {
    return at && s.launch_wall ? static_cast<double>(*at - *s.launch_wall) / 1e9 : -1.0;
  };
  int32_t slowest = -1;
  double fastest_backward = 0, slowest_backward = 0;
  for (uint32_t i = 0; i < s.run.ranks; ++i) {
    const uint32_t rank = s.run.first_rank + i;
    const auto it = s.start_up.find(rank);
    const FoldState::StartUp su = it == s.start_up.end() ? FoldState::StartUp{} : it->second;
    ranks[i].setRank(rank);
    ranks[i].setProcessStartSeconds(since_launch(su.process));
    ranks[i].setRendezvousSeconds(since_launch(su.rendezvous));
    ranks[i].setFirstForwardSeconds(since_launch(su.forward));
    const double backward = since_launch(su.backward);
    ranks[i].setFirstBackwardSeconds(backward);
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
  return schemas::to_json(fr.asReader());
}

std::map<std::string, std::string> render_documents(const FoldState& s, const fs::path& run_dir) {
  const RunView v = view_of(s);
  std::map<std::string, std::string> out;
  // Keys are the layout's paths under an empty run directory: paths relative to the run.
  out[layout::manifest_path(fs::path()).string()] = manifest_document(s, v, run_dir);
  // A job across nodes (node 0): the job's manifest, every node's section, as last journaled.
  if (s.job_view) out["job.json"] = *s.job_view;
  if (v.terminal) {
    for (const Receipt& r : kReceipts)
      out[layout::receipt_path(fs::path(), r.name).string()] = r.render(s, v);
  }
  return out;
}

}  // namespace megacpp::collector::detail
