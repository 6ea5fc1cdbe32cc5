// Roles and the run's end: the first failure classified, FailureObserved and RunFinished
// journaled, the report printed.
#include "supervisor/detail/job_controller.h"

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
#include "supervisor/commands/commands.h"
#include "supervisor/failure_policy.h"

namespace megacpp::supervisor {

namespace detail {

namespace {

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

void JobController::classify() {
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

void JobController::journal_run_finished(bool process_finished) {
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

int JobController::report() {
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
    // Held-out evaluation, its time apart from the training tokens/s.
    if (m.hasValidation()) {
      const auto v = m.getValidation();
      if (v.getEvaluations() > 0)
        out += fmt::format(
            "  validation  loss {:.3f} after step {} (best {:.3f} after step {}); {} evaluations "
            "of {:.0f} tokens took {:.2f}s, not in the tokens/s\n",
            v.getLastLoss(), v.getLastStep(), v.getBestLoss(), v.getBestStep(), v.getEvaluations(),
            v.getTokens(), v.getSeconds());
      else if (v.getOff().size() > 0)
        out += fmt::format("  validation  {}\n", v.getOff().cStr());
    }
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

}  // namespace megacpp::supervisor
