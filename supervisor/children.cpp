// The children: spawn (with their generation), reap (the dying generation of a restart
// too), signals, stop, kill, and giving up on a process that outlives SIGKILL.
#include "supervisor/detail/run.h"

#include <signal.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/channel.h"
#include "schemas/run_layout.h"
#include "supervisor/process.h"

namespace megacpp::supervisor {

namespace detail {

namespace {

void set_child_event(schema::ChildEvent::Builder e, const Child& c, schema::ChildReason reason) {
  e.setStage(c.stage);
  e.setRank(c.rank);
  e.setPid(c.pid);
  e.setExitCode(c.exit_code);
  e.setSignal(c.signal);
  e.setGeneration(c.generation);
  e.setChildReason(reason);
}

}  // namespace

Child* Run::by_name(const std::string& n) {
  for (auto& c : children_) {
    if (c.name == n) return &c;
  }
  return nullptr;
}

Child* Run::by_dying_pid(pid_t pid) {
  for (auto& c : children_) {
    if (c.dying_pid == pid) return &c;
  }
  return nullptr;
}

Child* Run::by_pid(pid_t pid) {
  for (auto& c : children_) {
    if (c.pid == pid) return &c;
  }
  return nullptr;
}

void Run::launch(StageKind stage, uint32_t rank, uint32_t generation, schema::ChildReason reason,
                 const std::string& cause) {
  Child* c = by_name(layout::process_name(stage, rank));
  if (c == nullptr) {
    children_.push_back(Child{stage, rank, layout::process_name(stage, rank)});
    c = &children_.back();
    metrics_->declare_stage(stage, rank);
  }
  std::string exe_name = "megacpp-" + std::string(layout::stage_name(stage));
  std::replace(exe_name.begin(), exe_name.end(), '_', '-');
  auto exe = detail::self_exe_dir() / exe_name;
  std::vector<std::string> argv = {exe.string(),
                                   "--run-dir",
                                   run_.string(),
                                   "--rank",
                                   std::to_string(rank),
                                   "--generation",
                                   std::to_string(generation)};
  std::vector<std::string> env;
  if (stage == StageKind::TRAINER && (opt_.malloc_tuning || !collectives_.env.empty())) {
    env = detail::environment_with_tunables(opt_.malloc_tuning ? kTrainerMallocTunables
                                                               : std::vector<std::string>{});
    env.insert(env.end(), collectives_.env.begin(), collectives_.env.end());
  }
  c->pid = detail::spawn(argv, layout::log_path(run_, stage, rank), env);
  c->generation = generation;
  c->alive = true;
  c->seen = false;
  c->stop_sent = false;
  c->exit_code = 0;
  c->signal = 0;
  c->started_ns = mono_ns();
  c->heartbeat_ns = c->started_ns;
  c->phase_started_ns = c->started_ns;
  c->progress_ns = c->started_ns;
  c->phase = Phase::STARTUP;
  c->work_ns = 0;
  c->work_done = 0;
  c->pending_since_ns = 0;
  metrics_->set_up(stage, rank, true);
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto e = r.initChildStarted();
    e.setStage(stage);
    e.setRank(rank);
    e.setPid(c->pid);
    e.setGeneration(generation);
    e.setChildReason(reason);
    if (!cause.empty()) e.setCause(cause);
  });
}

void Run::journal_child_exited(const Child& c, schema::ChildReason reason) {
  journal_->append(
      [&](schema::JournalRecord::Builder r) { set_child_event(r.initChildExited(), c, reason); });
}

void Run::reaped_dying(Child& dying, int status) {
  const pid_t pid = dying.dying_pid;
  dying.dying_pid = 0;
  dying.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  dying.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  dying.restart_cause += fmt::format("; pid {} reaped {:.2f}s after SIGKILL", pid,
                                     static_cast<double>(mono_ns() - dying.dying_since_ns) / 1e9);
  journal_child_exited(dying, schema::ChildReason::RESTART);
  const bool drained = draining_ && dying.stage != StageKind::TRAINER;
  if (detected_ns_ == 0 && !done_ && !drained) {
    launch(dying.stage, dying.rank, dying.generation + 1, schema::ChildReason::RESTART,
           dying.restart_cause);
  }
}

void Run::reap_dying() {
  for (auto& c : children_) {
    if (c.dying_pid == 0) continue;
    int status = 0;
    if (::waitpid(c.dying_pid, &status, WNOHANG) == c.dying_pid) reaped_dying(c, status);
  }
}

void Run::reap() {
  for (;;) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    if (Child* dying = by_dying_pid(pid)) {
      reaped_dying(*dying, status);
      continue;
    }
    Child* cp = by_pid(pid);
    if (cp == nullptr || !cp->alive) continue;
    Child& c = *cp;
    const int64_t now = mono_ns();
    c.alive = false;
    metrics_->set_up(c.stage, c.rank, false);
    if (WIFEXITED(status)) {
      c.exit_code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      c.exit_code = -1;
      c.signal = WTERMSIG(status);
    }
    const bool clean = c.exit_code == 0 && c.signal == 0;
    const bool expected = (c.stage == StageKind::TRAINER && clean) || (c.stop_sent && clean);
    const bool torn_down = teardown_started_ns_ != 0;
    const schema::ChildReason reason =
        expected    ? (c.stop_sent ? schema::ChildReason::STOP : schema::ChildReason::EXIT)
        : torn_down ? schema::ChildReason::TEARDOWN
                    : schema::ChildReason::EXIT;
    metrics_->add_exit(c.stage, clean       ? schema::FailureKind::NONE
                                : torn_down ? schema::FailureKind::TORN_DOWN
                                : c.signal  ? schema::FailureKind::SIGNALED
                                            : schema::FailureKind::EXITED);
    if (!done_) {
      journal_child_exited(c, reason);
    }
    if (expected || torn_down) continue;
    std::string what =
        c.signal != 0 ? fmt::format("was killed by signal {} ({})", c.signal, strsignal(c.signal))
                      : fmt::format("exited with code {}", c.exit_code);
    // 128 + N: a stage that left at once on signal N (a trainer stopped inside a step).
    if (c.signal == 0 && c.exit_code > 128 && c.exit_code < 128 + NSIG)
      what += fmt::format(" (128 + {}: it was sent {})", c.exit_code - 128,
                          strsignal(c.exit_code - 128));
    // The evidence of a death is its reap: neither SIGCHLD, waitid nor a pidfd says when the
    // process exited, so the detection delay of a death is not measured. Step and phase are
    // what its last heartbeat said (the step is the last one it completed; before its first
    // step of an attempt that began from a checkpoint, that checkpoint's step).
    const uint32_t step = c.step == 0 && resume_ ? resume_->step : c.step;
    Event ev{c.signal != 0 ? schema::FailureKind::SIGNALED : schema::FailureKind::EXITED,
             fmt::format("{} (pid {}) {} after step {} (last reported phase {})", c.name, c.pid,
                         what, step, layout::phase_name(c.phase)),
             now,
             now,
             c.phase,
             step,
             false};
    restart_or_fail(c, what, std::move(ev));
  }
}

void Run::on_signals() {
  signalfd_siginfo si{};
  while (::read(sigfd_, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    if (si.ssi_signo == SIGCHLD) {
      reap();
    } else if (detected_ns_ == 0 && stop_signal_ == 0) {
      begin_graceful_stop(static_cast<int>(si.ssi_signo));
    } else if (detected_ns_ == 0) {
      // Asked twice: stop at once. Not a failure: nothing went wrong but the user's patience.
      stop_at_once_signal_ = static_cast<int>(si.ssi_signo);
      detected_ns_ = mono_ns();
      poll_commits();
      log_warn(
          "{} again during the graceful stop: stopping at once; the newest committed "
          "checkpoint (step {}) stays as it is",
          strsignal(stop_at_once_signal_), committed_step_);
    }
  }
  reap();
}

void Run::begin_graceful_stop(int signo) {
  stop_signal_ = signo;
  stop_deadline_ns_ = mono_ns() + static_cast<int64_t>(opt_.stop_grace_s * 1e9);
  log_warn(
      "{}: the ranks finish the step in flight and commit its checkpoint, then stop "
      "(again to stop at once; at most {:.0f}s)",
      strsignal(signo), opt_.stop_grace_s);
  for (auto& c : children_) {
    if (c.stage != StageKind::TRAINER || !c.alive) continue;
    // A rank whose control socket has not connected yet (the stop came during start-up) is
    // told on its hello (Run::on_message); one that cannot be told at all is stopped by the
    // agreement of the others: every rank checks after each step whether any was asked.
    if (!ask_to_stop(c))
      log_info("{} is not connected yet; it is asked to stop when it says hello", c.name);
  }
}

bool Run::ask_to_stop(Child& c) {
  if (c.stop_asked) return true;
  ipc::ControlMessageBuilder b;
  auto stop = b.root().initStop();
  stop.setReason(fmt::format("graceful stop on {}", strsignal(stop_signal_)));
  stop.setAfterCheckpoint(true);
  c.stop_asked = router_->send_to(c.name, b.message(), ipc::Millis(200));
  return c.stop_asked;
}

bool Run::wait_for(const std::function<bool()>& done, double seconds) {
  const int64_t deadline = mono_ns() + static_cast<int64_t>(seconds * 1e9);
  while (!done()) {
    const int64_t left_ms = (deadline - mono_ns()) / 1'000'000;
    if (left_ms <= 0) return false;
    pump(static_cast<int>(std::min<int64_t>(left_ms, 20)));
  }
  return true;
}

void Run::stop_child(Child& c) {
  if (!c.alive) return;
  c.stop_sent = true;
  ipc::ControlMessageBuilder b;
  b.root().initStop().setReason("run complete");
  if (!router_->send_to(c.name, b.message(), ipc::Millis(200))) ::kill(c.pid, SIGTERM);
}

// MEGACPP_TEST_UNKILLABLE=<process> makes this a no-op for that process: to the supervisor
// it is then what a process in uninterruptible sleep is, one that survives SIGKILL. The
// hook exists to test that no wait for such a process is unbounded.
void Run::kill_child(const Child& c, int sig) {
  if (c.name == unkillable_for_test_) return;
  ::kill(c.pid, sig);
}

void Run::give_up_on(const Child& c, double waited_s) {
  if (!unkillable_.insert(c.pid).second) return;
  log_error("{} (pid {}) survived SIGKILL for {:.1f}s; unkillable, not waiting for it", c.name,
            c.pid, waited_s);
  if (!journal_) return;
  journal_->append([&](schema::JournalRecord::Builder r) {
    set_child_event(r.initChildUnkillable(), c, schema::ChildReason::SURVIVED_KILL);
  });
}

}  // namespace detail

}  // namespace megacpp::supervisor
