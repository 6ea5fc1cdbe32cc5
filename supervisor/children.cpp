// The children as the job controller sees them: a launch asked of the node agent and its
// `started` event, a child's exit (the dying generation of a restart too) judged, the
// graceful stop, and the commands that stop, kill and give up on a process.
#include "supervisor/detail/job_controller.h"

#include <signal.h>

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "core/knobs.h"
#include "core/util.h"
#include "ipc/channel.h"
#include "schemas/enums.h"
#include "schemas/json.h"
#include "schemas/run_layout.h"

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

// What a process that exited with a code said before it left: its failure dump, written before
// the exit, as the event its Failure message makes (policy::reported_failure). The message says
// the same but may be read after the exit is reaped, or not at all once the teardown has reaped
// every process. `victims_only`: only a victim's claim (policy::Evidence::kVictimClaim) —
// judged by the exit alone, a rank that only lost a peer would be taken for the cause (evidence
// of its own); a restartable stage's exit is judged by the exit (restart_or_fail), so only its
// claims are read.
std::optional<Event> reported_in_dump(const fs::path& dump_path, const Child& c, int64_t now,
                                      bool victims_only) {
  std::error_code ec;
  if (!fs::exists(dump_path, ec)) return std::nullopt;
  try {
    schemas::JsonFile<schema::FailureDump> file(dump_path);
    auto d = file.get();
    if (std::string_view(d.getKind().cStr()) != "exception" || d.getPid() != c.pid)
      return std::nullopt;
    Event ev = policy::reported_failure(
        schema::FailureReport::EXCEPTION,
        schemas::error_kind_named(d.getErrorKind().cStr()).value_or(schema::ErrorKind::NONE),
        d.getMessage().cStr(), d.getMonoNs(), now, d.getPhase(), d.getStep());
    if (victims_only && policy::evidence_of(ev) != policy::Evidence::kVictimClaim)
      return std::nullopt;
    return ev;
  } catch (const std::exception& e) {
    log_warn("unreadable failure dump {}: {}", dump_path.string(), e.what());
    return std::nullopt;
  }
}

}  // namespace

Child* JobController::by_name(const std::string& n) {
  for (auto& c : children_) {
    if (c.name == n) return &c;
  }
  return nullptr;
}

void JobController::launch(StageKind stage, uint32_t rank, uint32_t generation,
                           schema::ChildReason reason, const std::string& cause) {
  Child* c = by_name(layout::process_name(stage, rank));
  if (c == nullptr) {
    children_.push_back(Child{stage, rank, layout::process_name(stage, rank)});
    c = &children_.back();
    metrics_->declare_stage(stage, rank);
  }
  command([&](schema::NodeCommand::Builder cmd) {
    auto l = cmd.initLaunch();
    l.getProcess().setStage(stage);
    l.getProcess().setRank(rank);
    l.setGeneration(generation);
    l.setReason(reason);
    l.setCause(cause);
    if (stage == StageKind::TRAINER) {
      l.setTuneEnvironment(opt_.malloc_tuning);
      const std::vector<std::string> tunables =
          opt_.malloc_tuning ? kTrainerMallocTunables : std::vector<std::string>{};
      auto t = l.initTunables(static_cast<unsigned>(tunables.size()));
      for (size_t i = 0; i < tunables.size(); ++i) t.set(static_cast<unsigned>(i), tunables[i]);
      std::vector<std::string> env = collectives_.env;
      for (const std::string& kv : kTrainerLibraryEnv)
        if (!foreign_env(kv.substr(0, kv.find('=')))) env.push_back(kv);
      auto e = l.initExtraEnv(static_cast<unsigned>(env.size()));
      for (size_t i = 0; i < env.size(); ++i) e.set(static_cast<unsigned>(i), env[i]);
    }
  });
}

void JobController::on_started(schema::StageStarted::Reader s) {
  const StageKind stage = s.getProcess().getStage();
  const uint32_t rank = s.getProcess().getRank();
  Child* c = by_name(layout::process_name(stage, rank));
  if (c == nullptr) return;
  const uint32_t generation = s.getGeneration();
  c->pid = s.getPid();
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
    e.setChildReason(s.getReason());
    if (s.getCause().size() > 0) e.setCause(s.getCause());
  });
}

void JobController::journal_child_exited(const Child& c, schema::ChildReason reason) {
  journal_->append(
      [&](schema::JournalRecord::Builder r) { set_child_event(r.initChildExited(), c, reason); });
}

void JobController::reaped_dying(Child& dying, int exit_code, int signal) {
  const pid_t pid = dying.dying_pid;
  dying.dying_pid = 0;
  dying.exit_code = exit_code;
  dying.signal = signal;
  dying.restart_cause += fmt::format("; pid {} reaped {:.2f}s after SIGKILL", pid,
                                     static_cast<double>(mono_ns() - dying.dying_since_ns) / 1e9);
  journal_child_exited(dying, schema::ChildReason::RESTART);
  const bool drained = draining_ && dying.stage != StageKind::TRAINER;
  if (detected_ns_ == 0 && !done_ && !drained) {
    launch(dying.stage, dying.rank, dying.generation + 1, schema::ChildReason::RESTART,
           dying.restart_cause);
  }
}

void JobController::on_exited(schema::StageExited::Reader x) {
  Child* cp = by_name(layout::process_name(x.getProcess().getStage(), x.getProcess().getRank()));
  if (cp != nullptr && x.getRestart() && cp->dying_pid == x.getPid()) {
    reaped_dying(*cp, x.getExitCode(), x.getSignal());
    return;
  }
  if (cp == nullptr || !cp->alive || cp->pid != x.getPid()) return;
  {
    Child& c = *cp;
    const int64_t now = mono_ns();
    c.alive = false;
    metrics_->set_up(c.stage, c.rank, false);
    c.exit_code = x.getExitCode();
    c.signal = x.getSignal();
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
    // What it said before it left, read once from its dump. A rank that met its own failure as
    // the teardown began (a diverged rank whose peers reported first: they all read the same
    // agreement) may exit before its Failure message is read, and the teardown stops reading
    // once every process is reaped: its dump says what it met, and policy::admitted judges it
    // as it would the message.
    std::optional<Event> said;
    if (!clean && c.signal == 0 && !run_.empty())
      said = reported_in_dump(layout::failure_path(run_, c.stage, c.rank), c, now,
                              /*victims_only=*/policy::restartable(c.stage));
    if (torn_down && said && !policy::restartable(c.stage)) record(c, *said);
    if (expected || torn_down) return;
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
    if (said) {
      restart_or_fail(c, what, std::move(*said));
      return;
    }
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

void JobController::on_stop_request(int signo) {
  if (detected_ns_ == 0 && stop_signal_ == 0) {
    begin_graceful_stop(signo);
  } else if (detected_ns_ == 0) {
    // Asked twice: stop at once. Not a failure: nothing went wrong but the user's patience.
    stop_at_once_signal_ = signo;
    detected_ns_ = mono_ns();
    poll_commits();
    log_warn(
        "{} again during the graceful stop: stopping at once; the newest committed "
        "checkpoint (step {}) stays as it is",
        strsignal(stop_at_once_signal_), committed_step_);
  }
}

void JobController::begin_graceful_stop(int signo) {
  stop_signal_ = signo;
  stop_deadline_ns_ = mono_ns() + static_cast<int64_t>(opt_.stop_grace_s * 1e9);
  log_warn(
      "{}: the ranks finish the step in flight and commit its checkpoint, then stop "
      "(again to stop at once; at most {:.0f}s)",
      strsignal(signo), opt_.stop_grace_s);
  for (auto& c : children_) {
    if (c.stage != StageKind::TRAINER || !c.alive) continue;
    // A rank whose control socket has not connected yet (the stop came during start-up) is
    // told on its hello (JobController::on_message); one that cannot be told at all is stopped by
    // the agreement of the others: every rank checks after each step whether any was asked.
    if (!ask_to_stop(c))
      log_info("{} is not connected yet; it is asked to stop when it says hello", c.name);
  }
}

bool JobController::ask_to_stop(Child& c) {
  if (c.stop_asked) return true;
  c.stop_asked = command([&](schema::NodeCommand::Builder cmd) {
    auto stop = cmd.initStop();
    stop.getProcess().setStage(c.stage);
    stop.getProcess().setRank(c.rank);
    stop.setReason(fmt::format("graceful stop on {}", strsignal(stop_signal_)));
    stop.setAfterCheckpoint(true);
  });
  return c.stop_asked;
}

bool JobController::wait_for(const std::function<bool()>& done, double seconds) {
  const int64_t deadline = mono_ns() + static_cast<int64_t>(seconds * 1e9);
  while (!done()) {
    const int64_t left_ms = (deadline - mono_ns()) / 1'000'000;
    if (left_ms <= 0) return false;
    pump(static_cast<int>(std::min<int64_t>(left_ms, 20)));
  }
  return true;
}

void JobController::stop_child(Child& c) {
  if (!c.alive) return;
  c.stop_sent = true;
  command([&](schema::NodeCommand::Builder cmd) {
    auto stop = cmd.initStop();
    stop.getProcess().setStage(c.stage);
    stop.getProcess().setRank(c.rank);
    stop.setReason("run complete");
    stop.setSigtermIfUnreachable(true);
  });
}

void JobController::kill_child(const Child& c, int sig) {
  command([&](schema::NodeCommand::Builder cmd) {
    auto k = cmd.initSignal();
    k.getProcess().setStage(c.stage);
    k.getProcess().setRank(c.rank);
    k.setSignal(sig);
  });
}

void JobController::give_up_on(const Child& c, double waited_s) {
  command([&](schema::NodeCommand::Builder cmd) {
    auto g = cmd.initGiveUp();
    g.getProcess().setStage(c.stage);
    g.getProcess().setRank(c.rank);
    g.setWaitedSeconds(waited_s);
  });
}

void JobController::on_event(schema::NodeEvent::Reader e) {
  switch (e.which()) {
    case schema::NodeEvent::STARTED:
      on_started(e.getStarted());
      break;
    case schema::NodeEvent::EXITED:
      on_exited(e.getExited());
      break;
    case schema::NodeEvent::MESSAGE:
      on_message(e.getMessage().getPeer(), e.getMessage().getMessage());
      break;
    case schema::NodeEvent::UNKILLABLE: {
      // The agent logged it; the journal records it once.
      auto u = e.getUnkillable();
      unkillable_.insert(u.getPid());
      const Child* c =
          by_name(layout::process_name(u.getProcess().getStage(), u.getProcess().getRank()));
      if (!journal_ || c == nullptr) break;
      journal_->append([&](schema::JournalRecord::Builder r) {
        set_child_event(r.initChildUnkillable(), *c, schema::ChildReason::SURVIVED_KILL);
      });
      break;
    }
    case schema::NodeEvent::STOP_REQUESTED:
      on_stop_request(e.getStopRequested());
      break;
  }
}

}  // namespace detail

}  // namespace megacpp::supervisor
