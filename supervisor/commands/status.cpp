// `megacpp status RUN`: reconciles, folds, and prints the manifest readably.
#include <fmt/format.h>

#include "core/error.h"
#include "schemas/enums.h"
#include "schemas/json.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"
#include "stages/collector/collector.h"
#include "supervisor/commands/commands.h"

namespace megacpp::supervisor {

namespace fs = std::filesystem;
using schema::StageKind;

namespace detail {

std::string detection_text(schema::RunError::Reader e) {
  return e.getDetectionMeasured()
             ? fmt::format("detected {:.2f}s after the cause", e.getDetectionSeconds())
             : std::string("detection delay not measured (the kernel gives no exit time)");
}

}  // namespace detail

int status(const fs::path& run_dir) {
  if (!fs::exists(layout::launch_path(run_dir))) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{} holds no run (no launch.json)", run_dir.string());
  }
  if (reconcile(run_dir) || !fs::exists(layout::manifest_path(run_dir)))
    collector::collect_run(run_dir);
  schemas::JsonFile<schema::Manifest> manifest(layout::manifest_path(run_dir));
  auto m = manifest.get();
  auto phase_name = [](schema::Phase p) { return layout::phase_name(p); };
  fmt::print("run {}  ({})\n", m.getRunId().cStr(), run_dir.string());
  fmt::print("  state      {}\n", schemas::name(m.getState()));
  fmt::print("  recipe     {} ({})\n", m.getRecipe().cStr(), m.getRecipeHash().cStr());
  fmt::print("  steps      {}/{} on {} ranks\n", m.getStepsCompleted(), m.getStepsPlanned(),
             m.getWorld());
  fmt::print("  launched   {}\n  completed  {}\n  last seen  {}\n", m.getLaunchedAt().cStr(),
             m.getCompletedAt().cStr(), m.getLastPolledAt().cStr());
  if (m.getStopReason().size() > 0) fmt::print("  stopped    {}\n", m.getStopReason().cStr());
  if (m.hasValidation()) {
    const auto v = m.getValidation();
    if (v.getOff().size() > 0) {
      fmt::print("  validation {}\n", v.getOff().cStr());
    } else if (v.getEvaluations() == 0) {
      fmt::print("  validation none yet (every {} steps, {:.0f} tokens of the val split)\n",
                 v.getEvery(), v.getTokens());
    } else {
      fmt::print(
          "  validation loss {:.4f} after step {}, best {:.4f} after step {}; {} evaluations of "
          "{:.0f} tokens, {:.2f}s\n",
          v.getLastLoss(), v.getLastStep(), v.getBestLoss(), v.getBestStep(), v.getEvaluations(),
          v.getTokens(), v.getSeconds());
    }
  }
  if (m.getAttempts().size() > 1) {
    fmt::print("  attempts\n");
    for (auto a : m.getAttempts()) {
      std::string failure;
      if (a.hasError() && a.getError().getKind() != schema::FailureKind::NONE)
        failure = fmt::format(": {} in {}-{}", schemas::name(a.getError().getKind()),
                              layout::stage_name(a.getError().getStage()), a.getError().getRank());
      fmt::print("    {} {:<11} from step {:<6} to step {:<6} {}{}{}\n", a.getAttempt(),
                 a.getReason().cStr(), a.getFromStep(), a.getLastStep(),
                 schemas::name(a.getState()), failure,
                 a.getStepsLost() > 0 ? fmt::format(" ({} steps lost)", a.getStepsLost()) : "");
      if (a.hasRecovery()) {
        auto r = a.getRecovery();
        auto part = [](const char* name, double s) {
          return s < 0 ? std::string() : fmt::format(" {} {:.2f}s", name, s);
        };
        const std::string parts =
            part("teardown", r.getTeardownSeconds()) + part("prepare", r.getPrepareSeconds()) +
            part("relaunch", r.getRelaunchSeconds()) + part("restore", r.getRestoreSeconds()) +
            part("first step", r.getFirstStepSeconds());
        if (!parts.empty()) fmt::print("      recovery:{}\n", parts);
      }
    }
  }
  if (m.hasError() && m.getError().getKind() != schema::FailureKind::NONE) {
    auto e = m.getError();
    fmt::print("  first failure\n");
    fmt::print("    {} in {}-{} (pid {}), phase {}, step {}, at {}\n", schemas::name(e.getKind()),
               layout::stage_name(e.getStage()), e.getRank(), e.getPid(), phase_name(e.getPhase()),
               e.getStep(), e.getAt().cStr());
    fmt::print("    {}\n", e.getMessage().cStr());
    fmt::print("    {}; teardown took {:.2f}s\n", detail::detection_text(e),
               e.getTeardownSeconds());
    if (e.getFailureDump().size() > 0)
      fmt::print("    failure dump {}\n", (run_dir / e.getFailureDump().cStr()).string());
    if (e.getBacktrace().size() > 0) {
      fmt::print("    backtrace\n");
      for (auto l : e.getBacktrace()) fmt::print("      {}\n", l.cStr());
    }
    if (e.getStderrTail().size() > 0) {
      fmt::print("    stderr tail\n");
      for (auto l : e.getStderrTail()) fmt::print("      | {}\n", l.cStr());
    }
  }
  fmt::print("  stages\n");
  for (auto s : m.getStages()) {
    std::string how(schemas::name(s.getState()));
    if (s.getState() == schema::ProcessState::EXITED) how += fmt::format("({})", s.getExitCode());
    if (s.getState() == schema::ProcessState::SIGNALED) how += fmt::format("({})", s.getSignal());
    std::string role(schemas::name(s.getRole()));
    std::string restarts = s.getRestarts() > 0 ? fmt::format("restarts {}", s.getRestarts()) : "";
    fmt::print("    {:<16} pid {:<8} {:<13} step {:<6} {:<14} {:<11} last record {}\n",
               layout::process_name(s.getStage(), s.getRank()), s.getPid(), how, s.getLastStep(),
               role, restarts, s.getLastRecordAt().cStr());
    for (auto cause : s.getRestartCauses()) fmt::print("      restarted: {}\n", cause.cStr());
  }
  if (m.hasStageGraph() && m.getStageGraph().getEntries().size() > 0) {
    auto g = m.getStageGraph();
    fmt::print("  stage graph at {} ({})\n", g.getAt().cStr(), g.getReason().cStr());
    for (auto e : g.getEntries()) {
      fmt::print("    {:<16} {:<9} phase {:<10} for {:>6.1f}s  heartbeat {:>6.1f}s ago  step {}",
                 layout::process_name(e.getStage(), e.getRank()), e.getState().cStr(),
                 phase_name(e.getPhase()), e.getPhaseAgeSeconds(), e.getHeartbeatAgeSeconds(),
                 e.getStep());
      if (e.getStage() != StageKind::TRAINER && e.getProgressAgeSeconds() >= 0) {
        fmt::print("  progress {:.1f}s ago ({} done)", e.getProgressAgeSeconds(), e.getWorkDone());
      }
      fmt::print("\n");
    }
  }
  if (m.getLatestCheckpoint().size() > 0) {
    fmt::print("  checkpoint {} (step {})\n", m.getLatestCheckpoint().cStr(),
               m.getLatestCheckpointStep());
  }
  // Node 0 of a job across nodes: every node, as node 0 last heard from it (RUN/job.json).
  if (const fs::path job_file = run_dir / "job.json"; fs::exists(job_file)) {
    schemas::JsonFile<schema::JobManifest> doc(job_file);
    auto j = doc.get();
    fmt::print(
        "  job        {} nodes x {} ranks ({}{}), {}, slowest node at step {}, job LATEST {}\n",
        j.getNodes(), j.getRanksPerNode(), j.getSource().cStr(),
        j.getJobId().size() > 0 ? fmt::format(" job {}", j.getJobId().cStr()) : "",
        j.getState().cStr(), j.getSlowestStep(),
        j.getJobLatest() > 0 ? fmt::format("step {}", j.getJobLatest()) : "none yet");
    if (j.getFirstFailure().size() > 0)
      fmt::print("    first failure of the job: {}\n", j.getFirstFailure().cStr());
    for (auto n : j.getNodeList()) {
      fmt::print("    node {:<3} {:<16} ranks {:>3}-{:<3} step {:<6} committed {:<6} {:<9} {}\n",
                 n.getNode(), n.getHost().size() > 0 ? n.getHost().cStr() : "-", n.getFirstRank(),
                 n.getFirstRank() + n.getRanks() - 1, n.getStep(), n.getCommitted(),
                 n.getState().cStr(), n.getMetrics().cStr());
    }
    fmt::print("    (as of {})\n", j.getUpdatedAt().cStr());
  }
  return 0;
}

}  // namespace megacpp::supervisor
