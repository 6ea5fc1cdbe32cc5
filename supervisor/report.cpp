// Roles and the run's end: the first failure classified, FailureObserved and RunFinished
// journaled, the report printed; and `megacpp status`.
#include "supervisor/detail/run.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "schemas/enums.h"
#include "schemas/json.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"
#include "stages/collector/collector.h"
#include "supervisor/failure_policy.h"

namespace megacpp::supervisor {

namespace detail {

namespace {

std::string detection_text(schema::RunError::Reader e) {
  return e.getDetectionMeasured()
             ? fmt::format("detected {:.2f}s after the cause", e.getDetectionSeconds())
             : std::string("detection delay not measured (the kernel gives no exit time)");
}

std::vector<std::string> tail_lines(const fs::path& path, size_t n) {
  std::vector<std::string> out;
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error&) {
    return out;
  }
  if (text.size() > 16384) text = text.substr(text.size() - 16384);
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  if (out.size() > n) out.erase(out.begin(), out.end() - static_cast<long>(n));
  return out;
}

}  // namespace

void Run::classify() {
  // Exactly one first failure (policy::assign_roles).
  std::vector<std::string> abnormal;
  for (const auto& c : children_) {
    if (c.exit_code != 0 || c.signal != 0) abnormal.push_back(c.name);
  }
  const policy::Roles roles = policy::assign_roles(events_, abnormal);
  if (roles.first_failure.empty()) return;
  const std::string& first_name = roles.first_failure;
  const Event* first = &events_.at(first_name);
  auto stage_rank = [&](const std::string& name) -> std::pair<StageKind, uint32_t> {
    if (name == "supervisor-0") return {StageKind::SUPERVISOR, 0};
    Child* c = by_name(name);
    return {c->stage, c->rank};
  };
  auto [fs_stage, fs_rank] = stage_rank(first_name);
  failure_ = Failure{first->kind, fs_stage, fs_rank, first->message, first->step};
  auto journal_event = [&](const std::string& name, const Event& ev, schema::FailureRole role) {
    // Not a structured binding: clang before 16 cannot capture one in the lambda below.
    const auto stage_and_rank = stage_rank(name);
    const StageKind stage = stage_and_rank.first;
    const uint32_t rank = stage_and_rank.second;
    Child* c = by_name(name);
    journal_->append([&](schema::JournalRecord::Builder r) {
      auto f = r.initFailureObserved();
      f.setStage(stage);
      f.setRank(rank);
      f.setFailureKind(ev.kind);
      f.setMessage(ev.message);
      f.setFailureRole(role);
      f.setEvidenceMonoNs(ev.evidence_ns);
      f.setDetectedMonoNs(ev.detected_ns);
      f.setEvidenceUnmeasured(!ev.evidence_measured);
      f.setPhase(ev.phase);
      f.setStep(ev.step);
      f.setPid(c ? c->pid : ::getpid());
      if (role == schema::FailureRole::FIRST_FAILURE && c != nullptr) {
        auto tail = tail_lines(layout::log_path(run_, stage, rank), 20);
        auto t = f.initStderrTail(static_cast<unsigned>(tail.size()));
        for (size_t i = 0; i < tail.size(); ++i) t.set(static_cast<unsigned>(i), tail[i]);
        auto dump_path = layout::failure_path(run_, stage, rank);
        if (fs::exists(dump_path)) {
          try {
            schemas::JsonFile<schema::FailureDump> dump(dump_path);
            auto bt = dump.get().getBacktrace();
            auto out = f.initBacktrace(bt.size());
            for (unsigned i = 0; i < bt.size(); ++i) out.set(i, bt[i]);
          } catch (const std::exception& e) {
            log_warn("unreadable failure dump {}: {}", dump_path.string(), e.what());
          }
        }
      }
    });
  };
  journal_event(first_name, *first, schema::FailureRole::FIRST_FAILURE);
  for (const auto& name : roles.victims) {
    journal_event(name, events_.at(name), schema::FailureRole::VICTIM);
  }
  for (const auto& name : roles.torn_down) {
    const Child& c = *by_name(name);
    journal_event(
        c.name,
        Event{schema::FailureKind::TORN_DOWN, fmt::format("{} was stopped by the teardown", c.name),
              teardown_started_ns_, teardown_started_ns_, c.phase, c.step},
        schema::FailureRole::TORN_DOWN);
  }
}

void Run::journal_run_finished(bool process_finished) {
  const int64_t torn_down = teardown_done_ns_ != 0 ? teardown_done_ns_ : mono_ns();
  const double teardown_s =
      detected_ns_ != 0 ? static_cast<double>(torn_down - detected_ns_) / 1e9 : 0.0;
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto f = r.initRunFinished();
    f.setOk(!failure_ && stop_signal_ == 0);
    if (!failure_ && stop_signal_ != 0) {
      poll_commits();
      f.setFailureKind(schema::FailureKind::INTERRUPTED);
      f.setStoppedBySignal(stop_signal_);
      auto sig_name = [](int signo) {
        const char* abbrev = sigabbrev_np(signo);
        return abbrev ? fmt::format("SIG{}", abbrev) : std::to_string(signo);
      };
      if (stop_at_once_signal_ != 0) {
        f.setReason(fmt::format(
            "stopped by {}, then at once by a second {}; the newest committed checkpoint is "
            "step {}",
            sig_name(stop_signal_), sig_name(stop_at_once_signal_), committed_step_));
      } else {
        f.setReason(fmt::format("stopped by {} after step {}, its checkpoint committed",
                                sig_name(stop_signal_), committed_step_));
      }
    } else if (failure_) {
      f.setFailureKind(failure_->kind);
      f.setStage(failure_->stage);
      f.setRank(failure_->rank);
      f.setReason(failure_->message);
      f.setTeardownSeconds(teardown_s);
    } else {
      f.setReason("completed");
    }
  });
  if (process_finished)
    journal_->append([](schema::JournalRecord::Builder r) { r.setProcessFinished(); });
  journal_->sync();
}

int Run::report() {
  schemas::JsonFile<schema::Manifest> manifest(layout::manifest_path(run_));
  auto m = manifest.get();
  bool ok = m.getState() == schema::RunState::OK;
  const bool interrupted = m.getState() == schema::RunState::INTERRUPTED;
  std::string out;
  if (interrupted) {
    out += fmt::format("run interrupted: {}; continue it with `megacpp run --resume {}`\n",
                       m.getStopReason().cStr(), run_.string());
  } else if (ok) {
    double first = NAN, last = NAN, tps = NAN;
    auto br = layout::receipt_path(run_, layout::kBenchResult);
    if (fs::exists(br)) {
      schemas::JsonFile<schema::BenchResult> b(br);
      first = b.get().getFirstLoss();
      last = b.get().getLastLoss();
      tps = b.get().getTokensPerSecond();
    }
    out += fmt::format("run ok: {} steps on {} ranks, loss {:.3f} -> {:.3f}, {:.0f} tokens/s",
                       m.getStepsCompleted(), m.getWorld(), first, last, tps);
    if (m.getRestarts() > 0) out += fmt::format(" ({} stage restarts)", m.getRestarts());
    out += "\n";
  } else {
    auto e = m.getError();
    out += fmt::format("run error: first failure {} in {}-{}: {}\n", schemas::name(e.getKind()),
                       layout::stage_name(e.getStage()), e.getRank(), e.getMessage().cStr());
    out += fmt::format("  {}; every process gone and shm/sockets removed {:.2f}s later\n",
                       detection_text(e), e.getTeardownSeconds());
    if (e.getCollectivesAborted().size() > 0) {
      std::string ranks;
      uint32_t answered = 0;
      double slowest = 0;
      for (auto a : e.getCollectivesAborted()) {
        ranks += fmt::format("{}{}{}", ranks.empty() ? "" : ", ", a.getRank(),
                             !a.getAnswered() ? " (no reply)"
                             : !a.getOk()     ? " (failed)"
                                              : "");
        if (a.getAnswered()) ++answered;
        slowest = std::max(slowest, a.getReplySeconds());
      }
      out += fmt::format(
          "  collectives of rank(s) {} aborted before any signal ({} replied, the "
          "slowest after {:.3f}s)\n",
          ranks, answered, slowest);
    }
  }
  for (auto st : m.getStages()) {
    if (st.getState() == schema::ProcessState::UNKILLABLE) {
      out += fmt::format("  unkillable  {} (pid {}) outlived SIGKILL and was not waited for\n",
                         layout::process_name(st.getStage(), st.getRank()), st.getPid());
    }
  }
  out += fmt::format("  manifest    {}\n", layout::manifest_path(run_).string());
  std::string receipts;
  for (auto r : m.getReceipts()) receipts += (receipts.empty() ? "" : ", ") + std::string(r.cStr());
  out += fmt::format("  receipts    {}/ ({})\n", layout::receipts_dir(run_).string(),
                     receipts.empty() ? "none" : receipts);
  if (m.getLatestCheckpoint().size() > 0) {
    out += fmt::format("  checkpoint  {}\n", (run_ / m.getLatestCheckpoint().cStr()).string());
  }
  out += fmt::format("  logs        {}/\n", layout::logs_dir(run_).string());
  if (!ok && !interrupted) out += fmt::format("  details     megacpp status {}\n", run_.string());
  fmt::print("{}", out);
  std::fflush(stdout);
  // A graceful stop exits as a shell reports death by that signal (130, 143).
  if (interrupted && stop_signal_ != 0) return 128 + stop_signal_;
  return ok ? 0 : 1;
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
  return 0;
}

}  // namespace megacpp::supervisor
