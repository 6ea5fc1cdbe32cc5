// Teardown of a failed run and the cleanup every run ends with: signals with a grace period,
// bounded waits, the stage graph journaled, rings, sockets and the store released.
#include "supervisor/detail/run.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

#include "core/util.h"
#include "ipc/channel.h"
#include "ipc/shm.h"
#include "schemas/enums.h"
#include "supervisor/failure_policy.h"
#include "supervisor/process.h"

namespace megacpp::supervisor {

namespace detail {

void Run::journal_graph(const std::string& reason) {
  const int64_t now = mono_ns();
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto g = r.initStageGraph();
    g.setReason(reason);
    auto entries = g.initEntries(static_cast<unsigned>(children_.size()));
    for (size_t i = 0; i < children_.size(); ++i) {
      const Child& c = children_[i];
      auto e = entries[static_cast<unsigned>(i)];
      e.setStage(c.stage);
      e.setRank(c.rank);
      e.setPid(c.pid);
      e.setGeneration(c.generation);
      e.setState(std::string(schemas::name(c.alive    ? schema::ProcessState::RUNNING
                                           : c.signal ? schema::ProcessState::SIGNALED
                                                      : schema::ProcessState::EXITED)));
      e.setHeartbeatAgeSeconds(static_cast<double>(now - c.heartbeat_ns) / 1e9);
      e.setPhaseAgeSeconds(static_cast<double>(now - c.phase_started_ns) / 1e9);
      e.setStep(c.step);
      e.setPhase(c.phase);
      e.setRestarts(c.restarts);
      e.setProgressAgeSeconds(c.work_ns > 0 ? static_cast<double>(now - c.work_ns) / 1e9 : -1.0);
      e.setWorkDone(c.work_done);
      e.setPendingAgeSeconds(
          c.pending_since_ns > 0 ? static_cast<double>(now - c.pending_since_ns) / 1e9 : 0.0);
    }
  });
}

void Run::abort_collectives() {
  abort_replies_.clear();
  if (!opt_.abort_collectives) return;
  // A stopped rank cannot answer (its peers' abort is what frees them); a world of one has no
  // group. Neither is asked.
  std::vector<const Child*> asked;
  const int64_t sent_ns = mono_ns();
  for (const auto& c : children_) {
    if (c.stage != StageKind::TRAINER || !c.alive || opt_.ranks <= 1) continue;
    if (detail::process_state(c.pid) == 'T') continue;
    ipc::ControlMessageBuilder b;
    b.root().initAbortCollectives().setReason(fmt::format(
        "teardown after {}", detected_what_.empty() ? std::string("a stop") : detected_what_));
    if (router_->send_to(c.name, b.message(), ipc::Millis(0))) asked.push_back(&c);
  }
  if (asked.empty()) return;
  auto settled = [&] {
    return std::ranges::all_of(
        asked, [&](const Child* c) { return !c->alive || abort_replies_.contains(c->name); });
  };
  wait_for(settled, opt_.abort_wait_s);
  for (const Child* c : asked) {
    const auto reply = abort_replies_.find(c->name);
    const bool answered = reply != abort_replies_.end();
    if (!answered) {
      log_warn("{} (pid {}) did not answer the abort of its collectives within {:.1f}s{}", c->name,
               c->pid, opt_.abort_wait_s, c->alive ? "" : " (it exited)");
    } else if (!reply->second.ok) {
      log_warn("{}: aborting its collectives failed: {}", c->name, reply->second.error);
    }
    journal_->append([&](schema::JournalRecord::Builder r) {
      auto a = r.initCollectivesAborted();
      a.setRank(c->rank);
      a.setAnswered(answered);
      if (answered) {
        a.setHadGroup(reply->second.had_group);
        a.setOk(reply->second.ok);
        a.setError(reply->second.error);
        a.setAbortSeconds(reply->second.abort_s);
        a.setReplySeconds(static_cast<double>(reply->second.received_ns - sent_ns) / 1e9);
      } else {
        a.setReplySeconds(-1);
        a.setError(c->alive ? fmt::format("no reply within {:.1f}s", opt_.abort_wait_s)
                            : std::string("exited before replying"));
      }
    });
  }
}

void Run::teardown() {
  // Bounded: the collectives' abort, SIGTERM, a grace period while still listening (a
  // victim's own report of what it met may yet arrive), SIGKILL, one more second. Nothing here
  // waits without a deadline.
  teardown_started_ns_ = mono_ns();
  abort_collectives();
  for (auto& c : children_) {
    if (!c.alive) continue;
    // A stopped or silent process cannot act on SIGTERM: waiting out the grace for it only
    // delays the teardown.
    auto ev = events_.find(c.name);
    bool silent = ev != events_.end() && ev->second.kind == schema::FailureKind::HEARTBEAT_LOST;
    kill_child(c, policy::teardown_signal(silent, detail::process_state(c.pid)));
  }
  auto none_alive = [&] {
    for (const auto& c : children_) {
      if (c.alive) return false;
    }
    return true;
  };
  // The attempt's batch plane goes with its processes; the end of the teardown is what
  // teardownSeconds measures (what follows, classification and a job restart's preparation,
  // is not teardown).
  auto torn_down = [&] {
    release_attempt_ipc();
    teardown_done_ns_ = mono_ns();
  };
  if (wait_for(none_alive, opt_.teardown_grace_s)) return torn_down();
  for (auto& c : children_) {
    if (c.alive) {
      log_warn("{} (pid {}) still alive {:.1f}s after SIGTERM: SIGKILL", c.name, c.pid,
               opt_.teardown_grace_s);
      kill_child(c, SIGKILL);
    }
  }
  if (!wait_for(none_alive, kKillWaitS)) {
    for (const auto& c : children_) {
      if (c.alive) give_up_on(c);
    }
  }
  torn_down();
}

void Run::release_attempt_ipc() {
  ring_views_.clear();
  rings_.clear();
  if (!shm_prefix_.empty()) ipc::unlink_shm(shm_prefix_);
}

void Run::release_ipc() {
  if (released_) return;
  released_ = true;
  router_.reset();
  zmq_.reset();
  release_attempt_ipc();
  if (sock_dir_private_) {
    std::error_code ec;
    fs::remove_all(sock_dir_, ec);
  }
  store_.reset();
}

void Run::cleanup() {
  if (cleaned_) return;
  cleaned_ = true;
  // No blocking wait: a child that outlives SIGKILL would hang `megacpp run` forever. The
  // children still alive get SIGKILL and, together, kKillWaitS to be reaped; one already
  // given up on is not waited for again. A generation killed for a restart gets the same
  // bound to be reaped and journaled.
  std::vector<Child*> waiting;
  for (auto& c : children_) {
    if (!c.alive || unkillable_.contains(c.pid)) continue;
    kill_child(c, SIGKILL);
    waiting.push_back(&c);
  }
  const int64_t deadline = mono_ns() + static_cast<int64_t>(kKillWaitS * 1e9);
  for (;;) {
    std::erase_if(waiting, [](Child* c) {
      const pid_t r = ::waitpid(c->pid, nullptr, WNOHANG);
      if (r == 0) return false;
      c->alive = false;  // reaped, or not our child any more (ECHILD)
      return true;
    });
    reap_dying();
    const bool any_dying =
        std::ranges::any_of(children_, [](const Child& c) { return c.dying_pid != 0; });
    if ((waiting.empty() && !any_dying) || mono_ns() >= deadline) break;
    ::usleep(10'000);
  }
  for (const Child* c : waiting) give_up_on(*c);
  release_ipc();
  metrics_server_.reset();
  if (sigfd_ >= 0) ::close(sigfd_);
  sigfd_ = -1;
}

}  // namespace detail

}  // namespace megacpp::supervisor
