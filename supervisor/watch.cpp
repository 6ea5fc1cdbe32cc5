// The watch loop and the lifecycle of a run: launch, watch (control messages, liveness and
// progress judged by failure_policy.h), finish or tear down, fold, report.
#include "supervisor/detail/job_controller.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "checkpoint/store.h"
#include "core/error.h"
#include "core/util.h"
#include "ipc/channel.h"
#include "schemas/enums.h"
#include "schemas/run_layout.h"
#include "stages/collector/collector.h"
#include "supervisor/console.h"
#include "supervisor/failure_policy.h"
#include "supervisor/supervisor.h"

namespace megacpp::supervisor {

namespace detail {

double JobController::phase_budget(const Child& c) const {
  return policy::phase_budget(budgets_, c.stage, c.step, c.phase, step_samples_);
}

void JobController::on_message(const std::string& peer, schema::ControlMessage::Reader root) {
  Child* c = by_name(peer);
  if (c == nullptr) {
    log_warn("control message from unknown peer '{}' ignored", peer);
    return;
  }
  const int64_t now = mono_ns();
  switch (root.which()) {
    case schema::ControlMessage::HELLO:
      if (root.getHello().getPid() == c->pid) {
        c->heartbeat_ns = now;
        c->seen = true;
        // A graceful stop that began before this rank connected reaches it now.
        if (stop_signal_ != 0 && c->stage == StageKind::TRAINER && !ask_to_stop(*c))
          log_warn("could not ask {} to stop; the other ranks' agreement stops it", c->name);
      }
      break;
    case schema::ControlMessage::HEARTBEAT: {
      auto h = root.getHeartbeat();
      // A heartbeat queued by a previous generation (killed for a restart) proves nothing.
      if (!policy::heartbeat_counts(h.getGeneration(), c->generation)) break;
      c->heartbeat_ns = now;
      c->seen = true;
      if (h.getPhaseStartedMonoNs() > 0) c->phase_started_ns = h.getPhaseStartedMonoNs();
      if (h.getStep() != c->step) {
        c->progress_ns = now;
        c->last_step_wall = static_cast<double>(wall_ns()) / 1e9;
        if (c->stage == StageKind::TRAINER && h.getStep() > c->step && h.getStepSeconds() > 0) {
          step_samples_.push_back(h.getStepSeconds());
          if (step_samples_.size() > 512) step_samples_.erase(step_samples_.begin());
          metrics_->observe_step_seconds(c->rank, h.getStepSeconds());
        }
      }
      c->step = h.getStep();
      c->phase = h.getPhase();
      c->tokens = h.getTokens();
      c->loss = h.getLoss();
      c->val_loss = h.getValLoss();
      c->val_step = h.getValStep();
      c->step_seconds = h.getStepSeconds();
      c->lag_seconds = h.getLagSeconds();
      c->work_ns = h.getProgressMonoNs();
      c->work_done = h.getWorkDone();
      c->pending_since_ns = h.getPendingSinceMonoNs();
      break;
    }
    case schema::ControlMessage::FAILURE: {
      auto f = root.getFailure();
      const schema::ErrorKind error_kind = f.getErrorKind();
      const std::string_view report = schemas::name(f.getReport());
      const std::string said = error_kind == schema::ErrorKind::NONE
                                   ? std::string(report)
                                   : std::string(schemas::name(error_kind));
      log_warn("{} reports {} ({}): {}", c->name, report, said, f.getMessage().cStr());
      // A restartable stage's failure is acted on when it exits (restart or fail).
      if (policy::restartable(c->stage)) break;
      // A rank that failed because a peer or a collective did is a victim, not a cause
      // (policy::evidence_of): the Failure names its error kind. A rank whose loss, gradient or
      // parameters went non-finite: the run diverged (policy::reported_failure).
      record(*c, policy::reported_failure(f.getReport(), error_kind, f.getMessage().cStr(),
                                          f.getMonoNs(), now, f.getPhase(), f.getStep()));
      break;
    }
    case schema::ControlMessage::COLLECTIVES_ABORTED: {
      auto a = root.getCollectivesAborted();
      abort_replies_[c->name] =
          AbortReply{a.getHadGroup(), a.getOk(), a.getError().cStr(), a.getSeconds(), now};
      break;
    }
    default:
      break;
  }
}

void JobController::record(Child& c, Event ev) {
  if (detected_ns_ == 0) {
    detected_ns_ = ev.detected_ns;
    detected_what_ = fmt::format("{} {}: {}", c.name, schemas::name(ev.kind), ev.message);
    log_error("failure detected: {}", detected_what_);
    // Offered as the job's first failure: every other node reads it and tears down. A rank
    // that lost a peer claims to be a victim: its claim waits for the job's verdict
    // (adopt_job_verdict), or a rank of another node would be named for that node's failure.
    if (job_watch_ && policy::evidence_of(ev) != policy::Evidence::kVictimClaim)
      job_watch_->report(detected_what_);
  }
  // Keep the most telling event per process (policy::more_telling).
  if (!policy::admitted(ev, teardown_started_ns_)) return;
  auto it = events_.find(c.name);
  if (it == events_.end() || policy::more_telling(ev, it->second)) {
    events_[c.name] = std::move(ev);
  }
}

void JobController::restart_or_fail(Child& c, const std::string& why, Event ev) {
  if (draining_ && c.stage != StageKind::TRAINER) {
    log_warn("{}: {} after training ended and its final checkpoint committed; not restarted",
             c.name, why);
    if (c.alive) kill_child(c, SIGKILL);
    return;
  }
  const policy::Restart decision =
      policy::decide_restart(c.stage, c.restarts, opt_.max_restarts, detected_ns_ != 0, done_);
  if (decision == policy::Restart::kRestart) {
    ++c.restarts;
    log_warn("{}: {}; restarting it ({} of at most {})", c.name, why, c.restarts,
             opt_.max_restarts);
    metrics_->add_restart(c.stage, c.rank);
    c.restart_cause = fmt::format("generation {}: {}", c.generation, why);
    if (c.alive) {
      // Relaunched on its `exited` event once this pid is gone (bounded in check_liveness).
      command([&](schema::NodeCommand::Builder cmd) {
        auto r = cmd.initRestartStage();
        r.getProcess().setStage(c.stage);
        r.getProcess().setRank(c.rank);
      });
      c.alive = false;
      c.dying_pid = c.pid;
      c.dying_since_ns = mono_ns();
      return;
    }
    journal_child_exited(c, schema::ChildReason::RESTART);
    launch(c.stage, c.rank, c.generation + 1, schema::ChildReason::RESTART, c.restart_cause);
    return;
  }
  if (decision == policy::Restart::kExhausted) {
    ev.message += fmt::format(" (after {} restarts)", c.restarts);
  }
  record(c, std::move(ev));
}

double JobController::stall_budget(StageKind s) const {
  return policy::stall_budget(budgets_, s);
}

const Child* JobController::waited_on(const Child& trainer) {
  const auto stage = policy::waited_on(trainer.phase);
  return stage ? by_name(layout::process_name(*stage, 0)) : nullptr;
}

// A restartable stage is judged by its working thread's progress stamp, never by its
// heartbeats alone (they come from the control client's thread and go on while the work is
// wedged). Until its first report the start-up budget applies (libraries, shm, a built-in
// corpus written on first use).
void JobController::check_stage_progress(Child& c, int64_t now) {
  const bool reported = c.work_ns > 0;
  const int64_t since = reported ? c.work_ns : c.started_ns;
  const double limit = reported ? stall_budget(c.stage) : opt_.startup_budget_s;
  const double idle = static_cast<double>(now - since) / 1e9;
  if (idle <= limit) return;
  const char* unit = c.stage == StageKind::COLLECTOR     ? "folds"
                     : c.stage == StageKind::DATA_LOADER ? "batches"
                                                         : "commits";
  std::string what = fmt::format("made no progress for {:.1f}s in phase {} ({} {} done", idle,
                                 layout::phase_name(c.phase), c.work_done, unit);
  if (c.pending_since_ns > 0) {
    what += fmt::format("; oldest pending snapshot {:.1f}s old",
                        static_cast<double>(now - c.pending_since_ns) / 1e9);
  }
  what += fmt::format("; budget {:.0f}s{})", limit, reported ? "" : ", before its first report");
  Event ev{schema::FailureKind::HUNG,
           fmt::format("{} (pid {}) {}", c.name, c.pid, what),
           since,
           now,
           c.phase,
           c.step};
  ev.own_progress = true;
  restart_or_fail(c, "hung: " + what, std::move(ev));
}

void JobController::check_liveness() {
  const int64_t now = mono_ns();
  const std::vector<RingLevel> rings = link_->ring_levels();
  for (auto& c : children_) {
    if (c.dying_pid != 0 &&
        policy::restart_reap_overdue(static_cast<double>(now - c.dying_since_ns) / 1e9)) {
      record(c, Event{schema::FailureKind::UNKILLABLE,
                      fmt::format("{} (pid {}) did not exit within {:.0f}s of SIGKILL; its restart "
                                  "is abandoned (two generations would share its resources)",
                                  c.name, c.dying_pid, policy::kRestartReapBoundSeconds),
                      c.dying_since_ns, now, c.phase, c.step});
      give_up_on(c, policy::kRestartReapBoundSeconds);
      continue;
    }
    if (!c.alive || c.stop_sent) continue;
    const double budget = phase_budget(c);
    const double silent = static_cast<double>(now - c.heartbeat_ns) / 1e9;
    if (silent > policy::silence_limit(budgets_, c.seen, budget)) {
      restart_or_fail(
          c, fmt::format("stalled: no heartbeat for {:.1f}s", silent),
          Event{schema::FailureKind::HEARTBEAT_LOST,
                fmt::format("{} (pid {}) sent no heartbeat for {:.1f}s (phase {}, step {})", c.name,
                            c.pid, silent, layout::phase_name(c.phase), c.step),
                c.heartbeat_ns, now, c.phase, c.step});
      continue;
    }
    if (policy::restartable(c.stage)) {
      check_stage_progress(c, now);
      continue;
    }
    if (c.stage != StageKind::TRAINER) continue;
    const Child* dep = waited_on(c);
    const auto clock = policy::rank_clock(budgets_, c.phase_started_ns, c.progress_ns, budget,
                                          dep ? std::optional(dep->stage) : std::nullopt,
                                          dep ? dep->started_ns : 0);
    const int64_t since = clock.since_ns;
    const double rank_budget = clock.budget_s;
    const double in_phase = static_cast<double>(now - since) / 1e9;
    // The agent's rings are this node's ranks, the first at first_rank_.
    if (c.rank >= first_rank_ && c.rank - first_rank_ < rings.size()) {
      Child* loader = by_name(layout::process_name(StageKind::DATA_LOADER, 0));
      if (policy::loader_starves_rank(budgets_, c.phase, rings[c.rank - first_rank_].depth,
                                      in_phase, loader != nullptr && loader->alive)) {
        loader->heartbeat_ns = now;  // one restart per stall, not one per starving rank
        c.phase_started_ns = now;
        restart_or_fail(
            *loader, fmt::format("stalled: {} waited {:.1f}s on an empty ring", c.name, in_phase),
            Event{schema::FailureKind::STALLED,
                  fmt::format("{} waited {:.1f}s on an empty ring", c.name, in_phase), now, now,
                  loader->phase, loader->step});
        continue;
      }
    }
    if (in_phase > rank_budget) {
      record(
          c,
          Event{
              schema::FailureKind::HUNG,
              fmt::format(
                  "{} (pid {}) made no progress for {:.1f}s in phase {} (step {}; budget {:.1f}s)",
                  c.name, c.pid, in_phase, layout::phase_name(c.phase), c.step, rank_budget),
              since, now, c.phase, c.step});
    }
  }
  // The hang sweep (policy::swept_as_silent).
  if (detected_ns_ != 0) {
    for (auto& c : children_) {
      const double silent = static_cast<double>(now - c.heartbeat_ns) / 1e9;
      if (policy::swept_as_silent(budgets_, detected_ns_ != 0, c.alive, c.seen, c.stop_sent,
                                  events_.contains(c.name), silent)) {
        record(c, Event{schema::FailureKind::HEARTBEAT_LOST,
                        fmt::format("{} (pid {}) sent no heartbeat for {:.1f}s (phase {}, step {}) "
                                    "while a peer hung",
                                    c.name, c.pid, silent, layout::phase_name(c.phase), c.step),
                        c.heartbeat_ns, now, c.phase, c.step});
      }
    }
  }
}

bool JobController::all_trainers_done() const {
  for (const auto& c : children_) {
    if (c.stage == StageKind::TRAINER && (c.alive || c.exit_code != 0 || c.signal != 0))
      return false;
  }
  return true;
}

void JobController::pump(int timeout_ms) {
  link_->poll(timeout_ms);
}

Event JobController::job_verdict_event(const JobWatch::Verdict& v, int64_t now) const {
  uint32_t step = 0;  // the newest step a rank of this node reported
  for (const auto& c : children_)
    if (c.stage == StageKind::TRAINER) step = std::max(step, c.step);
  return Event{v.kind == JobWatch::Verdict::Kind::kNodeLost ? schema::FailureKind::NODE_LOST
                                                            : schema::FailureKind::NODE_FAILED,
               v.message,
               std::min(v.evidence_ns, now),
               now,
               Phase::OPTIMIZER,
               step};
}

void JobController::keep_spares() {
  // Not before every trainer finished a step of this attempt: a spare loading its libraries
  // then would compete with the ranks' own start for the node's CPUs.
  if (spares_kept_ || !opt_.spare_trainers || job_restarts_ >= opt_.max_job_restarts) return;
  const uint32_t from = resume_ ? resume_->step : 0;
  bool any = false;
  for (const auto& c : children_) {
    if (c.stage != StageKind::TRAINER) continue;
    if (!c.alive || c.step <= from) return;
    any = true;
  }
  if (!any) return;
  spares_kept_ = true;
  for (const auto& c : children_) {
    if (c.stage != StageKind::TRAINER) continue;
    command([&](schema::NodeCommand::Builder cmd) {
      auto r = cmd.initKeepSpare();
      r.setStage(c.stage);
      r.setRank(c.rank);
    });
  }
}

void JobController::check_job_watch() {
  if (!job_watch_ || detected_ns_ != 0) return;
  const auto v = job_watch_->verdict();
  if (!v) return;
  const int64_t now = mono_ns();
  detected_ns_ = now;
  detected_what_ = v->message;
  log_error("failure detected: {}", detected_what_);
  events_["supervisor-0"] = job_verdict_event(*v, now);
}

void JobController::adopt_job_verdict() {
  if (!job_watch_ || events_.contains("supervisor-0")) return;
  // Only when no process of this node has evidence of its own: ranks that lost a peer claim
  // to be victims, and the node whose silence caused it is named within the silence limit.
  for (const auto& [name, ev] : events_)
    if (policy::evidence_of(ev) == policy::Evidence::kOwn) return;
  job_watch_->suspect();  // a dead node is then named within a few beats
  const JobWatch::Options o;
  const int64_t deadline = mono_ns() + (o.silence_limit + 3 * o.beat).count() * 1'000'000;
  std::optional<JobWatch::Verdict> v;
  while (!(v = job_watch_->verdict()) && mono_ns() < deadline)
    std::this_thread::sleep_for(o.beat / 5);
  if (!v) {
    job_watch_->report(detected_what_);  // no other node named a cause: this one is the job's
    return;
  }
  log_error("the job's verdict: {}", v->message);
  // Detected when this node began its teardown: a recovery is timed from there.
  events_["supervisor-0"] = job_verdict_event(*v, detected_ns_ != 0 ? detected_ns_ : mono_ns());
}

void JobController::watch() {
  for (;;) {
    pump(100);
    if (detected_ns_ != 0) return;
    check_job_watch();
    if (detected_ns_ != 0) return;
    check_liveness();
    if (detected_ns_ != 0) return;
    keep_spares();
    update_metrics();
    if (opt_.detach && !detached_) {
      if (std::all_of(children_.begin(), children_.end(), [](const Child& c) { return c.seen; })) {
        detach_output();
      } else if (launcher_gone()) {
        // The launching command died before the stage graph was up (its terminal closed, an
        // ssh drop): the run goes on, telling its log instead.
        move_output_to_log();
        log_warn("the launching command is gone; the run goes on detached");
      }
    }
    if (console_) {
      std::vector<ConsoleRank> ranks;
      uint32_t up = 0;
      for (const auto& c : children_) {
        if (c.alive) ++up;
        if (c.stage == StageKind::TRAINER)
          ranks.push_back({c.step, c.tokens, c.loss, c.val_loss, c.val_step});
      }
      console_->update(ranks, up, static_cast<uint32_t>(children_.size()));
    }
    advance_job_latest();
    if (all_trainers_done()) return;
    if (stop_signal_ != 0 && mono_ns() > stop_deadline_ns_) {
      const int64_t now = mono_ns();
      detected_ns_ = now;
      events_["supervisor-0"] =
          Event{schema::FailureKind::INTERRUPTED,
                fmt::format("the graceful stop on {} did not finish within --stop-grace-s {:.0f}s",
                            strsignal(stop_signal_), opt_.stop_grace_s),
                now,
                now,
                Phase::SHUTDOWN,
                0};
      return;
    }
  }
}

void JobController::update_metrics() {
  const double now_wall = static_cast<double>(wall_ns()) / 1e9;
  const int64_t now = mono_ns();
  if (job_watch_) {
    metrics_->set_job_nodes(placement_.nodes, placement_.node_rank,
                            placement_.nodes - job_watch_->lost_nodes());
    publish_progress();
    if (placement_.node_rank == 0) {
      std::vector<uint32_t> steps;
      for (const auto& n : job_watch_->nodes()) steps.push_back(n.step);
      metrics_->set_job_steps(std::move(steps));
      write_job_manifest("running");
    }
  }
  for (const auto& c : children_) {
    metrics_->set_up(c.stage, c.rank, c.alive);
    metrics_->set_heartbeat(c.stage, c.rank,
                            now_wall - static_cast<double>(now - c.heartbeat_ns) / 1e9);
    if (c.work_ns > 0) {
      metrics_->set_progress(c.stage, c.rank,
                             now_wall - static_cast<double>(now - c.work_ns) / 1e9);
    }
    if (c.stage == StageKind::TRAINER) {
      if (c.last_step_wall > 0) metrics_->set_last_step(c.stage, c.rank, c.step, c.last_step_wall);
      metrics_->set_trainer_progress(c.rank, c.step, c.tokens);
      if (c.val_step > 0) metrics_->set_validation(c.val_step, c.val_loss);
    }
    if (c.stage == StageKind::COLLECTOR) metrics_->set_collector_lag(c.lag_seconds);
  }
  const std::vector<RingLevel> rings = link_->ring_levels();
  for (uint32_t r = 0; r < rings.size(); ++r) {
    metrics_->set_queue(fmt::format("data_loader->trainer-{}", global_rank(r)), rings[r].depth,
                        rings[r].slots);
  }
  poll_commits();
}

void JobController::poll_commits() {
  checkpoint_journal_->poll([&](schema::JournalRecord::Reader rec) {
    if (rec.isCheckpointCommitted()) {
      auto c = rec.getCheckpointCommitted();
      if (rec.getAttempt() == attempt_) committed_step_ = std::max(committed_step_, c.getStep());
      if (job_watch_ && rec.getAttempt() == attempt_) job_watch_->committed(committed_step_);
      metrics_->set_checkpoint(c.getStep(), c.getSeconds(),
                               static_cast<double>(rec.getWallNs()) / 1e9);
    }
  });
}

void JobController::publish_progress() {
  if (!job_watch_) return;
  uint32_t step = UINT32_MAX;  // this node's slowest rank's
  for (const auto& c : children_)
    if (c.stage == StageKind::TRAINER) step = std::min(step, c.step);
  if (step != UINT32_MAX) job_watch_->progress(step);
}

void JobController::advance_job_latest() {
  if (!job_watch_) return;
  const auto step = job_watch_->job_committed();
  if (!step || *step <= job_latest_) return;
  // Only a step this node holds: the fold is of what every node said it committed.
  const fs::path ckdir = layout::checkpoints_dir(run_);
  const std::string name = layout::checkpoint_dir_name(*step);
  if (!fs::is_directory(ckdir / name)) return;
  write_file_atomic(ckdir / checkpoint::kJobLatestName, name + "\n");
  job_latest_ = *step;
  log_info("step {} is committed on every node of the job ({} names it)", *step,
           checkpoint::kJobLatestName);
}

void JobController::finish_ok() {
  // Training is over; the loader and the checkpointer drain and exit, then the collector
  // folds the final state. A stage that does not stop within its bound is a failure.
  draining_ = true;
  for (auto& c : children_) {
    if (c.stage == StageKind::DATA_LOADER || c.stage == StageKind::CHECKPOINTER) stop_child(c);
  }
  const double drain_s = static_cast<double>(knob_int(Knob::kDrainTimeoutS));
  bool drained = wait_for(
      [&] {
        if (detected_ns_ != 0) return true;
        for (const auto& c : children_) {
          if ((c.stage == StageKind::DATA_LOADER || c.stage == StageKind::CHECKPOINTER) && c.alive)
            return false;
        }
        return true;
      },
      drain_s);
  if (!drained) {
    for (auto& c : children_) {
      if ((c.stage == StageKind::DATA_LOADER || c.stage == StageKind::CHECKPOINTER) && c.alive) {
        const int64_t now = mono_ns();
        record(c, Event{schema::FailureKind::HUNG,
                        fmt::format("{} did not stop within {:.0f}s of the end of training", c.name,
                                    drain_s),
                        now, now, c.phase, c.step});
      }
    }
  }
}

void JobController::launch_attempt() {
  launch(StageKind::COLLECTOR, 0, 0, schema::ChildReason::LAUNCH);
  launch(StageKind::CHECKPOINTER, 0, 0, schema::ChildReason::LAUNCH);
  launch(StageKind::DATA_LOADER, 0, 0, schema::ChildReason::LAUNCH);
  for (uint32_t r = 0; r < opt_.ranks; ++r) {
    launch(StageKind::TRAINER, global_rank(r), 0, schema::ChildReason::LAUNCH);
  }
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto s = r.initRunStarted();
    s.setWorld(world_);
    s.setStepsPlanned(opt_.steps);
  });
}

std::optional<std::string> JobController::job_restart_refusal() const {
  if (opt_.max_job_restarts == 0) return "--max-job-restarts is 0";
  if (stop_signal_ != 0) return "a graceful stop was under way";
  if (job_restarts_ >= opt_.max_job_restarts)
    return fmt::format("all {} job restarts (--max-job-restarts) are used", opt_.max_job_restarts);
  switch (failure_->kind) {
    case schema::FailureKind::INTERRUPTED:
      return "the run was interrupted";
    case schema::FailureKind::UNKILLABLE:
      return "a process outlived SIGKILL";
    default:
      break;
  }
  if (!unkillable_.empty()) return "a process outlived SIGKILL";
  // A lost node's supervisor is dead or out of reach: it cannot restart its part. The engine
  // restarts such a job (torchrun --max-restarts, a requeued Slurm job), each node resuming.
  if (failure_->kind == schema::FailureKind::NODE_LOST)
    return "a node was lost: restart the job through its engine, every node with --resume";
  if (previous_progress_ && failed_progress_ && *previous_progress_ == *failed_progress_)
    return fmt::format("repeating: the previous attempt failed after step {} too",
                       *failed_progress_);
  return std::nullopt;
}

uint32_t JobController::journaled_progress() const {
  uint32_t progress = UINT32_MAX;
  for (uint32_t r = first_rank_; r < first_rank_ + opt_.ranks; ++r) {
    uint32_t last = resume_ ? resume_->step : 0;
    ipc::JournalReader::read_all(layout::journal_path(run_, StageKind::TRAINER, r),
                                 [&](schema::JournalRecord::Reader rec) {
                                   if (rec.getAttempt() == attempt_ && rec.isStep())
                                     last = std::max(last, rec.getStep().getStep());
                                 });
    progress = std::min(progress, last);
  }
  return progress == UINT32_MAX ? 0 : progress;
}

void JobController::restart_job() {
  // The failed attempt ends in the journal as a run would (its first failure is already
  // there; its batch plane went with the teardown); the next one starts from the newest
  // checkpoint that verifies.
  journal_run_finished(/*process_finished=*/false);
  choose_checkpoint("job restart");  // none verifies: the attempt starts from scratch
  previous_progress_ = failed_progress_;
  previous_attempt_ = attempt_;
  ++attempt_;
  ++job_restarts_;
  agree_checkpoint("job restart");  // a job across nodes: a step every node's part has
  archive_attempt();
  metrics_->add_job_restart();
  log_warn("job restart {} of {}: {} {}-{} after step {}; relaunching every stage from {}",
           job_restarts_, opt_.max_job_restarts, schemas::name(failure_->kind),
           layout::stage_name(failure_->stage), failure_->rank, failed_progress_.value_or(0),
           resume_ ? resume_->relative_path : std::string("scratch (no checkpoint yet)"));
  journal_->set_attempt(attempt_);
  journal_attempt_started("job_restart");

  // A fresh batch plane under the next attempt's shm prefix, and its launch contract.
  shm_prefix_ = layout::shm_prefix(run_id_, attempt_);
  create_rings();
  write_launch_contract();

  command([](schema::NodeCommand::Builder cmd) { cmd.setEndAttempt(); });
  children_.clear();
  events_.clear();
  detected_ns_ = 0;
  teardown_started_ns_ = 0;
  teardown_done_ns_ = 0;
  failure_.reset();
  step_samples_.clear();
  committed_step_ = 0;
  failed_progress_.reset();
  spares_kept_ = false;
  if (job_watch_) start_job_watch();
}

void JobController::detach_output() {
  detached_ = true;
  const fs::path log = layout::logs_dir(run_) / "supervisor.log";
  // Raw writes, errors ignored: the launching command may be gone (its terminal closed), and
  // SIGPIPE is ignored in a detached supervisor (run_detached), so a write only fails.
  const std::string text = fmt::format(
      "megacpp: run {} is up ({} stages, supervisor pid {}); it goes on detached, logging to {}\n"
      "  metrics   {}\n  progress  megacpp status {} --watch\n  stop      megacpp stop {}\n{}\n",
      run_.string(), children_.size(), ::getpid(), log.string(),
      metrics_endpoint_.empty() ? "-" : metrics_endpoint_, run_.string(), run_.string(),
      kDetachedMarker);
  std::fflush(stdout);
  std::fflush(stderr);
  if (::write(STDOUT_FILENO, text.data(), text.size()) < 0) {
    // Nothing to do: the log below is where the run goes on telling.
  }
  move_output_to_log();
}

bool JobController::launcher_gone() const {
  // The write end of a pipe whose every reader closed polls POLLERR.
  pollfd pfd{STDOUT_FILENO, 0, 0};
  return ::poll(&pfd, 1, 0) == 1 && (pfd.revents & POLLERR) != 0;
}

void JobController::move_output_to_log() {
  detached_ = true;
  std::fflush(stdout);
  std::fflush(stderr);
  const fs::path log = layout::logs_dir(run_) / "supervisor.log";
  const Fd fd(::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (fd.get() < 0) {
    // Nowhere to log: the launching command still gets its EOF and returns.
    const Fd devnull(::open("/dev/null", O_WRONLY | O_CLOEXEC));
    ::dup2(devnull.get(), STDOUT_FILENO);
    ::dup2(devnull.get(), STDERR_FILENO);
    return;
  }
  ::dup2(fd.get(), STDOUT_FILENO);
  ::dup2(fd.get(), STDERR_FILENO);
}

JobController::JobController(RunOptions o)
    : opt_(std::move(o)),
      budgets_(budgets_of(opt_)),
      spawner_(std::make_unique<SystemSpawner>()),
      agent_(std::make_unique<NodeAgent>(*spawner_)),
      in_process_(std::make_unique<InProcessLink>(*agent_)),
      link_(in_process_.get()) {
  link_->connect([this](schema::NodeEvent::Reader e) { on_event(e); });
}

JobController::JobController(RunOptions o, NodeAgentLink& link, const fs::path& run)
    : opt_(std::move(o)), budgets_(budgets_of(opt_)), run_(run), link_(&link) {
  world_ = opt_.ranks;  // one node
  link_->connect([this](schema::NodeEvent::Reader e) { on_event(e); });
  metrics_ = std::make_unique<Metrics>(MEGACPP_VERSION, "test", "none");
  for (const auto& d : {layout::journal_dir(run_), layout::logs_dir(run_)})
    fs::create_directories(d);
  open_journals();
}

std::optional<Failure> JobController::supervise() {
  for (;;) {
    launch_attempt();
    watch();
    if (detected_ns_ == 0) finish_ok();
    if (detected_ns_ != 0) {
      journal_graph(stop_at_once_signal_ != 0 ? "stop at once" : "failure detected");
      teardown();
      adopt_job_verdict();
      classify();
    }
    if (!failure_) break;
    failed_progress_ = journaled_progress();
    if (auto refusal = agree_job_restart(job_restart_refusal())) {
      if (opt_.max_job_restarts > 0) log_warn("no job restart: {}", *refusal);
      if (refusal->starts_with("repeating")) failure_->message += " (" + *refusal + ")";
      break;
    }
    restart_job();
  }
  return failure_;
}

int JobController::execute() {
  prepare();
  console_ = make_console(opt_.progress, opt_.steps, recipe_.name, run_.string());
  if (console_ && !metrics_endpoint_.empty())
    fmt::print("megacpp: metrics at {}\n", metrics_endpoint_);
  supervise();
  if (console_) console_->finish();
  // A job across nodes: this node's part is done once its final checkpoint is committed (its
  // silence from then on is no loss). Node 0 hosts the job's store: it stays until every node
  // finished; every node then names the job's final step in JOB_LATEST.
  if (job_watch_ && !failure_) {
    poll_commits();
    // The final step as the ranks journaled it: a rank's last heartbeat may precede it.
    job_watch_->progress(journaled_progress());
    job_watch_->finish();
    if (!job_watch_->wait_finished(std::chrono::seconds(60)))
      log_warn("{}", placement_.node_rank == 0
                         ? "not every node of the job said it finished within 60 s; node 0's "
                           "store goes"
                         : "node 0 did not say within 60 s that every node committed the final "
                           "step");
    advance_job_latest();
  }
  if (job_watch_) write_job_manifest(failure_ ? "error" : "ok");
  if (!failure_) {
    // The live collector folds the final state; the in-process fold below is the same pure
    // function, so it changes nothing when the collector finished.
    if (Child* col = by_name(layout::process_name(StageKind::COLLECTOR, 0)); col && col->alive) {
      stop_child(*col);
      if (!wait_for([&] { return !col->alive; }, 10.0)) {
        kill_child(*col, SIGKILL);
        if (!wait_for([&] { return !col->alive; }, kKillWaitS)) give_up_on(*col);
      }
    }
  }
  release_ipc();
  journal_run_finished();
  done_ = true;
  // Always fold in-process as well: when the collector was the failing process this is
  // what guarantees the manifest never stays `running`.
  collector::collect_run(run_);
  for (const auto& c : children_) metrics_->set_up(c.stage, c.rank, c.alive);
  int rc = report();
  if (opt_.metrics_linger_s > 0) {
    fmt::print("megacpp: serving {} for {:.0f}s more (--metrics-linger-s)\n", metrics_endpoint_,
               opt_.metrics_linger_s);
    std::fflush(stdout);
    // Interruptible: SIGINT/SIGTERM (blocked into the signalfd) end the linger early.
    pollfd pfd{agent_->signal_fd(), POLLIN, 0};
    ::poll(&pfd, 1, static_cast<int>(opt_.metrics_linger_s * 1000));
  }
  cleanup();
  return rc;
}

}  // namespace detail

int run(RunOptions options) {
  detail::JobController r(std::move(options));
  return r.execute();
}

}  // namespace megacpp::supervisor
