#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/util.h"
#include "ipc/channel.h"
#include "ipc/control_client.h"
#include "ipc/detail/internal.h"
#include "schemas/enums.h"
#include "schemas/run_layout.h"

namespace megacpp::ipc {

struct ControlClient::State {
  State(const std::string& endpoint, const Identity& identity_, Millis interval_)
      : channel(ctx, Channel::Kind::kDealer, endpoint,
                layout::process_name(identity_.stage, identity_.rank)),
        wake_fd(SYSCALL_CHECK(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK))),
        identity(identity_),
        interval(interval_) {}

  ZmqContext ctx;
  Channel channel;  // used by the constructor for Hello, then only by `thread`
  detail::Fd wake_fd;
  const Identity identity;
  const Millis interval;

  std::atomic<uint16_t> phase{static_cast<uint16_t>(schema::Phase::STARTUP)};
  std::atomic<int64_t> phase_started_ns{mono_ns()};
  std::atomic<uint32_t> step{0};
  std::atomic<double> tokens{0.0};
  std::atomic<uint32_t> loss_bits{std::bit_cast<uint32_t>(std::numeric_limits<float>::quiet_NaN())};
  std::atomic<double> step_seconds{0.0};
  std::atomic<double> lag_seconds{0.0};
  std::atomic<uint32_t> val_loss_bits{
      std::bit_cast<uint32_t>(std::numeric_limits<float>::quiet_NaN())};
  std::atomic<uint32_t> val_step{0};
  // A published record the supervisor should see before the next interval (a new evaluation:
  // the last one of a run comes just before the rank exits).
  std::atomic<bool> heartbeat_now{false};
  std::atomic<int64_t> progress_ns{0};
  std::atomic<uint64_t> work_done{0};
  std::atomic<int64_t> pending_since_ns{0};
  std::atomic<bool> quit{false};

  struct PendingFailure {
    schema::FailureReport report;
    std::string message;
    schema::ErrorKind error_kind;
    int64_t met_ns;  // CLOCK_MONOTONIC
  };
  std::mutex mu;  // guards stop_reason and failures
  std::string stop_reason;
  std::vector<PendingFailure> failures;  // to send
  bool lingering = false;
  // Held while the abort handler runs: set_abort_handler waits for a run in progress.
  std::mutex abort_mu;
  std::function<void()> abort_handler;
  // The abort runs on a thread of its own (ncclCommAbort may take seconds, and heartbeats must
  // go on meanwhile); its outcome comes back here and this client's thread sends the replies,
  // one per request that arrived while it ran (the channel is this thread's alone).
  struct AbortOutcome {
    bool had_group = false;
    bool ok = false;
    std::string error;
    double seconds = 0;
  };
  std::thread aborter;      // touched by this client's thread only (and joined at the end)
  bool aborting = false;    // guarded by mu: a run in progress
  uint32_t abort_asks = 0;  // guarded by mu: requests that run answers
  std::vector<AbortOutcome> abort_replies;  // guarded by mu: to send, one per request

  std::thread thread;  // last: joined before anything above is destroyed

  // Never throws: losing a wake-up only delays the thread until its next heartbeat.
  void wake() noexcept {
    uint64_t one = 1;
    if (::write(wake_fd.get(), &one, sizeof one) < 0) {
    }
  }

  void send_hello() {
    ControlMessageBuilder m;
    auto hello = m.root().initHello();
    hello.setStage(identity.stage);
    hello.setRank(identity.rank);
    hello.setPid(::getpid());
    hello.setGeneration(identity.generation);
    // The DEALER queues it even before the supervisor's ROUTER exists (bounded by the HWM).
    channel.send(m.message(), Millis(0));
  }

  void send_heartbeat() {
    ControlMessageBuilder m;
    auto hb = m.root().initHeartbeat();
    hb.setStage(identity.stage);
    hb.setRank(identity.rank);
    hb.setStep(step.load(std::memory_order_acquire));
    hb.setPhase(static_cast<schema::Phase>(phase.load(std::memory_order_relaxed)));
    hb.setPhaseStartedMonoNs(phase_started_ns.load(std::memory_order_relaxed));
    hb.setMonoNs(mono_ns());
    hb.setTokens(tokens.load(std::memory_order_relaxed));
    hb.setLoss(std::bit_cast<float>(loss_bits.load(std::memory_order_relaxed)));
    hb.setStepSeconds(step_seconds.load(std::memory_order_relaxed));
    hb.setLagSeconds(lag_seconds.load(std::memory_order_relaxed));
    hb.setValLoss(std::bit_cast<float>(val_loss_bits.load(std::memory_order_relaxed)));
    hb.setValStep(val_step.load(std::memory_order_relaxed));
    hb.setGeneration(identity.generation);
    hb.setProgressMonoNs(progress_ns.load(std::memory_order_relaxed));
    hb.setWorkDone(work_done.load(std::memory_order_relaxed));
    hb.setPendingSinceMonoNs(pending_since_ns.load(std::memory_order_relaxed));
    // Never waits: with no supervisor the queue fills to the HWM and heartbeats are dropped.
    channel.send(m.message(), Millis(0));
  }

  void flush_failures() {
    std::vector<PendingFailure> batch;
    {
      std::lock_guard lock(mu);
      batch.swap(failures);
    }
    for (const auto& failure : batch) {
      ControlMessageBuilder m;
      auto f = m.root().initFailure();
      f.setStage(identity.stage);
      f.setRank(identity.rank);
      f.setReport(failure.report);
      f.setKind(std::string(schemas::name(failure.report)));
      f.setMessage(failure.message);
      f.setPhase(static_cast<schema::Phase>(phase.load(std::memory_order_relaxed)));
      f.setStep(step.load(std::memory_order_acquire));
      f.setMonoNs(failure.met_ns);
      f.setErrorKind(failure.error_kind);
      if (!channel.send(m.message(), Millis(0))) {
        log_warn("control client: could not queue failure report '{}'",
                 schemas::name(failure.report));
      }
      // The process is probably on its way down: give closing a bounded chance to deliver
      // the report instead of discarding it (linger 0).
      if (!lingering) {
        channel.set_linger(std::min(interval, Millis(1000)));
        lingering = true;
      }
    }
  }

  void handle(Received& r, std::atomic<bool>& stop, std::atomic<bool>& drain) {
    auto root = r.root();
    if (root.which() == schema::ControlMessage::STOP) {
      {
        std::lock_guard lock(mu);
        stop_reason = root.getStop().getReason().cStr();
      }
      (root.getStop().getAfterCheckpoint() ? drain : stop).store(true, std::memory_order_release);
    } else if (root.which() == schema::ControlMessage::ABORT_COLLECTIVES) {
      abort_collectives(root.getAbortCollectives().getReason().cStr());
    }
  }

  // On this client's thread: starts the abort's run, or counts the request in the run going on.
  void abort_collectives(const std::string& reason) {
    {
      std::lock_guard lock(mu);
      ++abort_asks;
      if (aborting) return;
      aborting = true;
    }
    if (aborter.joinable()) aborter.join();  // an earlier run, finished
    try {
      aborter = std::thread([this, reason] { run_abort(reason); });
    } catch (const std::system_error&) {
      run_abort(reason);  // no thread to be had: heartbeats wait for the abort instead
    }
  }

  // Runs the handler (if any) and hands its outcome to this client's thread.
  void run_abort(const std::string& reason) noexcept {
    AbortOutcome out;
    {
      std::lock_guard lock(abort_mu);
      if (abort_handler) {
        log_warn("aborting this process's collectives: {}", reason);
        out.had_group = true;
        const int64_t begin = mono_ns();
        try {
          abort_handler();
          out.ok = true;
        } catch (const std::exception& e) {
          out.error = e.what();
        }
        out.seconds = static_cast<double>(mono_ns() - begin) / 1e9;
      } else {
        out.ok = true;
      }
    }
    {
      std::lock_guard lock(mu);
      abort_replies.insert(abort_replies.end(), abort_asks, out);
      abort_asks = 0;
      aborting = false;
    }
    wake();
  }

  // On this client's thread: the CollectivesAborted replies of finished runs.
  void flush_abort_replies() {
    std::vector<AbortOutcome> replies;
    {
      std::lock_guard lock(mu);
      replies.swap(abort_replies);
    }
    for (const AbortOutcome& o : replies) {
      ControlMessageBuilder m;
      auto reply = m.root().initCollectivesAborted();
      reply.setRank(identity.rank);
      reply.setHadGroup(o.had_group);
      reply.setOk(o.ok);
      if (!o.error.empty()) reply.setError(o.error);
      reply.setSeconds(o.seconds);
      if (!channel.send(m.message(), Millis(0)))
        log_warn("control client: could not queue the abort's reply");
    }
  }

  void run(std::atomic<bool>& stop, std::atomic<bool>& drain) noexcept {
    try {
      Poller poller;
      const size_t kChannel = poller.add(channel);
      const size_t kWake = poller.add(wake_fd.get());
      auto next = detail::Clock::now() + interval;
      for (;;) {
        bool quitting = quit.load(std::memory_order_acquire);
        flush_failures();
        flush_abort_replies();
        if (quitting) return;
        auto now = detail::Clock::now();
        const bool due = now >= next;
        if (heartbeat_now.exchange(false, std::memory_order_acq_rel) || due) {
          send_heartbeat();
          if (due) {  // an early one leaves the schedule as it was
            next += interval;
            if (next <= now) next = now + interval;
          }
        }
        poller.wait(Millis(detail::remaining_ms(next)));
        if (poller.readable(kWake)) {
          uint64_t count;
          if (::read(wake_fd.get(), &count, sizeof count) < 0) {
          }
        }
        if (poller.readable(kChannel)) {
          while (auto r = channel.receive(Millis(0))) handle(*r, stop, drain);
        }
      }
    } catch (const std::exception& e) {
      // No heartbeats from here on: the supervisor reports this process as heartbeat_lost.
      log_error("control client thread stopped: {}", e.what());
    }
  }
};

ControlClient::ControlClient(const std::string& endpoint, const Identity& identity,
                             Millis interval) {
  MEGACPP_CHECK(interval > Millis::zero(), ErrorKind::kInvalidArgument,
                "heartbeat interval must be positive");
  state_ = std::make_unique<State>(endpoint, identity, interval);
  state_->send_hello();
  // Thread creation is the memory barrier that hands the socket over to the thread.
  state_->thread = std::thread([this] { state_->run(stop_, drain_); });
}

ControlClient::~ControlClient() {
  state_->quit.store(true, std::memory_order_release);
  state_->wake();
  if (state_->thread.joinable()) state_->thread.join();
  // An abort still running holds its handler (set_abort_handler({}) would wait for it too).
  if (state_->aborter.joinable()) state_->aborter.join();
}

void ControlClient::set_phase(schema::Phase phase) {
  state_->phase_started_ns.store(mono_ns(), std::memory_order_relaxed);
  state_->phase.store(static_cast<uint16_t>(phase), std::memory_order_relaxed);
}

void ControlClient::set_step(uint32_t step) {
  state_->step.store(step, std::memory_order_release);
}

const Identity& ControlClient::identity() const noexcept {
  return state_->identity;
}

void ControlClient::publish(const ProgressRecord& record) {
  state_->tokens.store(record.tokens, std::memory_order_relaxed);
  state_->loss_bits.store(std::bit_cast<uint32_t>(record.loss), std::memory_order_relaxed);
  state_->step_seconds.store(record.step_seconds, std::memory_order_relaxed);
  state_->lag_seconds.store(record.lag_seconds, std::memory_order_relaxed);
  state_->val_loss_bits.store(std::bit_cast<uint32_t>(record.val_loss), std::memory_order_relaxed);
  const bool new_evaluation =
      state_->val_step.exchange(record.val_step, std::memory_order_relaxed) != record.val_step;
  state_->step.store(record.step, std::memory_order_release);  // last: publishes the above
  if (new_evaluation) {
    state_->heartbeat_now.store(true, std::memory_order_release);
    state_->wake();
  }
}

void ControlClient::set_abort_handler(std::function<void()> abort) {
  std::lock_guard lock(state_->abort_mu);
  state_->abort_handler = std::move(abort);
}

std::string ControlClient::stop_reason() const {
  std::lock_guard lock(state_->mu);
  return state_->stop_reason;
}

void ControlClient::report_failure(schema::FailureReport report, const std::string& message,
                                   schema::ErrorKind error_kind, int64_t met_ns) {
  {
    std::lock_guard lock(state_->mu);
    state_->failures.push_back({report, message, error_kind, met_ns != 0 ? met_ns : mono_ns()});
  }
  state_->wake();
}

void ControlClient::report_progress(uint64_t work_done, int64_t pending_since_ns) {
  state_->work_done.store(work_done, std::memory_order_relaxed);
  state_->pending_since_ns.store(pending_since_ns, std::memory_order_relaxed);
  state_->progress_ns.store(mono_ns(), std::memory_order_relaxed);
}

}  // namespace megacpp::ipc
