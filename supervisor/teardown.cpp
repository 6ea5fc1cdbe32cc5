// Teardown of a failed run and the cleanup every run ends with, as the job controller orders
// them from the node agent: signals with a grace period, bounded waits, the stage graph
// journaled, rings, sockets and the store released.
#include "supervisor/detail/job_controller.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

#include "core/util.h"
#include "ipc/channel.h"
#include "schemas/enums.h"
#include "supervisor/failure_policy.h"

namespace megacpp::supervisor {

namespace detail {

void JobController::journal_graph(const std::string& reason) {
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

void JobController::abort_collectives() {
  abort_replies_.clear();
  if (!opt_.abort_collectives) return;
  // A stopped rank cannot answer (its peers' abort is what frees them); a world of one has no
  // group. Neither is asked.
  std::vector<const Child*> asked;
  const int64_t sent_ns = mono_ns();
  for (const auto& c : children_) {
    if (c.stage != StageKind::TRAINER || !c.alive || world_ <= 1) continue;
    // The agent does not ask a stopped rank (state 'T').
    const bool sent = command([&](schema::NodeCommand::Builder cmd) {
      auto a = cmd.initAbortCollectives();
      a.getProcess().setStage(c.stage);
      a.getProcess().setRank(c.rank);
      a.setReason(fmt::format("teardown after {}",
                              detected_what_.empty() ? std::string("a stop") : detected_what_));
    });
    if (sent) asked.push_back(&c);
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

void JobController::teardown() {
  // Bounded: the collectives' abort, SIGTERM, a grace period while still listening (a
  // victim's own report of what it met may yet arrive), SIGKILL, one more second. Nothing here
  // waits without a deadline.
  teardown_started_ns_ = mono_ns();
  abort_collectives();
  command([&](schema::NodeCommand::Builder cmd) {
    auto t = cmd.initTearDown();
    // A stopped or silent process cannot act on SIGTERM: the agent sends it SIGKILL at once.
    std::vector<const Child*> silent;
    for (const auto& c : children_) {
      if (!c.alive) continue;
      auto ev = events_.find(c.name);
      if (ev != events_.end() && ev->second.kind == schema::FailureKind::HEARTBEAT_LOST)
        silent.push_back(&c);
    }
    auto s = t.initSilent(static_cast<unsigned>(silent.size()));
    for (size_t i = 0; i < silent.size(); ++i) {
      s[static_cast<unsigned>(i)].setStage(silent[i]->stage);
      s[static_cast<unsigned>(i)].setRank(silent[i]->rank);
    }
  });
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
  command([&](schema::NodeCommand::Builder cmd) {
    auto t = cmd.initTearDown();
    t.setKill(true);
    t.setGraceSeconds(opt_.teardown_grace_s);
  });
  if (!wait_for(none_alive, kKillWaitS)) {
    for (const auto& c : children_) {
      if (c.alive) give_up_on(c);
    }
  }
  torn_down();
}

void JobController::release_attempt_ipc() {
  command([](schema::NodeCommand::Builder cmd) { cmd.setReleaseAttempt(); });
}

void JobController::release_ipc() {
  if (released_) return;
  released_ = true;
  if (agent_) agent_->release();  // the control socket, the rings, the socket directory
  store_.reset();
}

void JobController::cleanup() {
  if (cleaned_) return;
  cleaned_ = true;
  // Bounded (NodeAgent::kill_remaining): SIGKILL to the children still alive, kKillWaitS for
  // them and for a generation killed for a restart to be reaped, then given up on.
  if (agent_) agent_->kill_remaining();
  release_ipc();
  metrics_server_.reset();
  if (agent_) agent_->close_signals();
}

}  // namespace detail

}  // namespace megacpp::supervisor
