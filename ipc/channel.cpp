#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <kj/exception.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/ipc.h"
#include "ipc/ipc_internal.h"
#include "schemas/common.capnp.h"
#include "schemas/run_layout.h"

namespace megacpp::ipc {

namespace {

// Frames larger than this are refused by ZeroMQ itself (the peer is disconnected) before
// any memory is spent on them; control messages are a few KiB.
constexpr int64_t kMaxMessageBytes = int64_t{64} << 20;

// Owns one zmq_msg_t.
struct Msg {
  zmq_msg_t m;
  Msg() { zmq_msg_init(&m); }
  ~Msg() { zmq_msg_close(&m); }
  Msg(const Msg&) = delete;
  Msg& operator=(const Msg&) = delete;
};

void set_int(void* socket, int option, int value) {
  ZMQ_CHECK(zmq_setsockopt(socket, option, &value, sizeof value));
}

bool transient(int err) {
  return err == EAGAIN || err == EINTR;
}

}  // namespace

// ---------------------------------------------------------------------------------------

ZmqContext::ZmqContext() : ctx_(zmq_ctx_new()) {
  if (ctx_ == nullptr) megacpp::detail::throw_zmq("zmq_ctx_new", zmq_errno(), __FILE__, __LINE__);
  // Terminating the context must never wait on sockets a caller forgot to close.
  zmq_ctx_set(ctx_, ZMQ_BLOCKY, 0);
}

ZmqContext::~ZmqContext() {
  while (zmq_ctx_term(ctx_) == -1 && zmq_errno() == EINTR) {
  }
}

Received::Received(std::string peer, kj::Array<capnp::word> words)
    : peer_(std::move(peer)),
      words_(std::move(words)),
      reader_(words_.asPtr(), detail::reader_options(words_.size())) {}

// ---------------------------------------------------------------------------------------

Channel::Channel(ZmqContext& ctx, Kind kind, const std::string& endpoint,
                 const std::string& identity)
    : socket_(zmq_socket(ctx.get(), kind == Kind::kRouter ? ZMQ_ROUTER : ZMQ_DEALER)), kind_(kind) {
  if (socket_ == nullptr) megacpp::detail::throw_zmq("zmq_socket", zmq_errno(), __FILE__, __LINE__);
  try {
    set_int(socket_, ZMQ_LINGER, 0);
    ZMQ_CHECK(zmq_setsockopt(socket_, ZMQ_MAXMSGSIZE, &kMaxMessageBytes, sizeof kMaxMessageBytes));
    if (kind == Kind::kRouter) {
      // Unknown identities fail the send (EHOSTUNREACH) instead of being dropped silently;
      // a restarted stage that reconnects under its old identity takes the route over.
      set_int(socket_, ZMQ_ROUTER_MANDATORY, 1);
      set_int(socket_, ZMQ_ROUTER_HANDOVER, 1);
      ZMQ_CHECK(zmq_bind(socket_, endpoint.c_str()));
      std::string bound = this->endpoint();
      if (bound.starts_with("ipc://") && bound.size() > 6 && bound[6] != '@') {
        struct stat st {};
        ipc_path_ = bound.substr(6);
        SYSCALL_CHECK(::stat(ipc_path_.c_str(), &st));
        ipc_dev_ = st.st_dev;
        ipc_ino_ = st.st_ino;
      }
    } else {
      MEGACPP_CHECK(!identity.empty() && identity.size() <= 255 && identity[0] != '\0',
                    ErrorKind::kInvalidArgument,
                    fmt::format("DEALER identity '{}' must be 1..255 bytes", identity));
      ZMQ_CHECK(zmq_setsockopt(socket_, ZMQ_ROUTING_ID, identity.data(), identity.size()));
      ZMQ_CHECK(zmq_connect(socket_, endpoint.c_str()));
    }
  } catch (...) {
    zmq_close(socket_);
    throw;
  }
}

Channel::~Channel() {
  zmq_close(socket_);
  struct stat st {};
  if (!ipc_path_.empty() && ::stat(ipc_path_.c_str(), &st) == 0 && st.st_dev == ipc_dev_ &&
      st.st_ino == ipc_ino_) {
    ::unlink(ipc_path_.c_str());
  }
}

std::string Channel::endpoint() const {
  char buf[1024];
  size_t len = sizeof buf;
  ZMQ_CHECK(zmq_getsockopt(socket_, ZMQ_LAST_ENDPOINT, buf, &len));
  return std::string(buf, len > 0 ? len - 1 : 0);  // len counts the terminating NUL
}

void Channel::set_linger(Millis linger) {
  set_int(socket_, ZMQ_LINGER, static_cast<int>(linger.count()));
}

namespace {

// One attempt-and-wait loop shared by send and send_to. `peer` is empty for a DEALER.
bool send_words(void* socket, bool router, std::string_view peer, capnp::MessageBuilder& message,
                Millis timeout) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(message);
  auto bytes = words.asBytes();
  auto deadline = detail::Clock::now() + timeout;
  for (;;) {
    int rc;
    if (router) {
      rc = zmq_send(socket, peer.data(), peer.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
      // Once the identity frame is accepted the route is writable: the payload follows.
      if (rc >= 0) {
        ZMQ_CHECK(zmq_send(socket, bytes.begin(), bytes.size(), ZMQ_DONTWAIT));
        return true;
      }
    } else {
      rc = zmq_send(socket, bytes.begin(), bytes.size(), ZMQ_DONTWAIT);
      if (rc >= 0) return true;
    }
    int err = zmq_errno();
    if (err == EHOSTUNREACH) return false;  // ROUTER: no such peer connected
    if (!transient(err)) megacpp::detail::throw_zmq("zmq_send", err, __FILE__, __LINE__);
    long left = detail::remaining_ms(deadline);
    if (left == 0) return false;
    if (router) {
      // A ROUTER's POLLOUT says nothing about one particular peer's queue: retry shortly.
      std::this_thread::sleep_for(Millis(1));
    } else {
      zmq_pollitem_t item{socket, 0, ZMQ_POLLOUT, 0};
      ZMQ_CHECK(zmq_poll(&item, 1, left));
    }
  }
}

}  // namespace

bool Channel::send(capnp::MessageBuilder& message, Millis timeout) {
  MEGACPP_CHECK(kind_ == Kind::kDealer, ErrorKind::kInternal,
                "Channel::send on a ROUTER (use send_to)");
  return send_words(socket_, false, {}, message, timeout);
}

bool Channel::send_to(std::string_view peer, capnp::MessageBuilder& message, Millis timeout) {
  MEGACPP_CHECK(kind_ == Kind::kRouter, ErrorKind::kInternal,
                "Channel::send_to on a DEALER (use send)");
  if (peer.empty()) return false;
  return send_words(socket_, true, peer, message, timeout);
}

std::unique_ptr<Received> Channel::receive(Millis timeout) {
  auto deadline = detail::Clock::now() + timeout;
  for (;;) {
    zmq_pollitem_t item{socket_, 0, ZMQ_POLLIN, 0};
    if (ZMQ_CHECK(zmq_poll(&item, 1, detail::remaining_ms(deadline))) == 0) return nullptr;

    Msg part;
    if (zmq_msg_recv(&part.m, socket_, ZMQ_DONTWAIT) == -1) {
      int err = zmq_errno();
      if (transient(err)) continue;
      megacpp::detail::throw_zmq("zmq_msg_recv", err, __FILE__, __LINE__);
    }
    // ROUTER: [identity, payload]; DEALER: [payload]. Anything else is malformed, and every
    // part of a multipart message is drained so the next receive starts on a boundary.
    const size_t payload_index = kind_ == Kind::kRouter ? 1 : 0;
    std::string peer;
    kj::Array<capnp::word> words;
    std::string_view problem;
    for (size_t index = 0;; ++index) {
      size_t size = zmq_msg_size(&part.m);
      const void* data = zmq_msg_data(&part.m);
      if (kind_ == Kind::kRouter && index == 0) {
        peer.assign(static_cast<const char*>(data), size);
      } else if (index == payload_index) {
        if (size == 0 || size % sizeof(capnp::word) != 0) {
          problem = "frame size is not a positive multiple of 8";
        } else {
          words = kj::heapArray<capnp::word>(size / sizeof(capnp::word));
          std::memcpy(words.begin(), data, size);
        }
      } else {
        problem = "unexpected extra frame";
      }
      if (!zmq_msg_more(&part.m)) {
        if (index < payload_index) problem = "missing payload frame";
        break;
      }
      ZMQ_CHECK(zmq_msg_recv(&part.m, socket_, 0));
    }

    std::unique_ptr<Received> received;
    std::string detail_text;
    if (problem.empty()) {
      try {
        received = std::make_unique<Received>(peer, std::move(words));
        auto root = received->root();
        root.totalSize();  // walks every pointer: bounds are checked now, not in the caller
        uint32_t version = root.getSchemaVersion();
        if (version == 0 || version > schema::SCHEMA_VERSION) {
          detail_text = fmt::format("schema version {} (this build reads 1..{})", version,
                                    schema::SCHEMA_VERSION);
          received.reset();
        }
      } catch (const kj::Exception& e) {
        detail_text = e.getDescription().cStr();
        received.reset();
      }
    } else {
      detail_text = problem;
    }
    if (received) return received;

    ++malformed_;
    // Counted always; logged for the first few and then sparsely so a noisy peer cannot
    // flood the log.
    if (malformed_ <= 10 || malformed_ % 1000 == 0) {
      log_warn("control channel: skipped malformed message #{} from '{}': {}", malformed_, peer,
               detail_text);
    }
  }
}

// ---------------------------------------------------------------------------------------

ControlMessageBuilder::ControlMessageBuilder()
    : root_(message_.initRoot<schema::ControlMessage>()) {
  root_.setSchemaVersion(schema::SCHEMA_VERSION);
}

// ---------------------------------------------------------------------------------------

struct ControlClient::State {
  State(const std::string& endpoint, schema::StageKind stage_, uint32_t rank_, uint32_t generation_,
        Millis interval_)
      : channel(ctx, Channel::Kind::kDealer, endpoint, layout::process_name(stage_, rank_)),
        wake_fd(SYSCALL_CHECK(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK))),
        stage(stage_),
        rank(rank_),
        generation(generation_),
        interval(interval_) {}

  ZmqContext ctx;
  Channel channel;  // used by the constructor for Hello, then only by `thread`
  detail::Fd wake_fd;
  const schema::StageKind stage;
  const uint32_t rank;
  const uint32_t generation;
  std::atomic<double> lag_seconds{0};
  const Millis interval;

  std::atomic<uint16_t> phase{static_cast<uint16_t>(schema::Phase::STARTUP)};
  std::atomic<int64_t> phase_started_ns{mono_ns()};
  std::atomic<uint32_t> step{0};
  std::atomic<double> tokens{0.0};
  std::atomic<uint32_t> loss_bits{std::bit_cast<uint32_t>(std::numeric_limits<float>::quiet_NaN())};
  std::atomic<double> step_seconds{0.0};
  std::atomic<int64_t> progress_ns{0};
  std::atomic<uint64_t> work_done{0};
  std::atomic<int64_t> pending_since_ns{0};
  std::atomic<bool> quit{false};

  struct PendingFailure {
    std::string kind;
    std::string message;
    schema::ErrorKind error_kind;
    int64_t met_ns;  // CLOCK_MONOTONIC
  };
  std::mutex mu;  // guards stop_reason and failures
  std::string stop_reason;
  std::vector<PendingFailure> failures;  // to send
  bool lingering = false;

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
    hello.setStage(stage);
    hello.setRank(rank);
    hello.setPid(::getpid());
    hello.setGeneration(generation);
    // The DEALER queues it even before the supervisor's ROUTER exists (bounded by the HWM).
    channel.send(m.message(), Millis(0));
  }

  void send_heartbeat() {
    ControlMessageBuilder m;
    auto hb = m.root().initHeartbeat();
    hb.setStage(stage);
    hb.setRank(rank);
    hb.setStep(step.load(std::memory_order_acquire));
    hb.setPhase(static_cast<schema::Phase>(phase.load(std::memory_order_relaxed)));
    hb.setPhaseStartedMonoNs(phase_started_ns.load(std::memory_order_relaxed));
    hb.setMonoNs(mono_ns());
    hb.setTokens(tokens.load(std::memory_order_relaxed));
    hb.setLoss(std::bit_cast<float>(loss_bits.load(std::memory_order_relaxed)));
    hb.setStepSeconds(step_seconds.load(std::memory_order_relaxed));
    hb.setLagSeconds(lag_seconds.load(std::memory_order_relaxed));
    hb.setGeneration(generation);
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
      f.setStage(stage);
      f.setRank(rank);
      f.setKind(failure.kind);
      f.setMessage(failure.message);
      f.setPhase(static_cast<schema::Phase>(phase.load(std::memory_order_relaxed)));
      f.setStep(step.load(std::memory_order_acquire));
      f.setMonoNs(failure.met_ns);
      f.setErrorKind(failure.error_kind);
      if (!channel.send(m.message(), Millis(0))) {
        log_warn("control client: could not queue failure report '{}'", failure.kind);
      }
      // The process is probably on its way down: give closing a bounded chance to deliver
      // the report instead of discarding it (linger 0).
      if (!lingering) {
        channel.set_linger(std::min(interval, Millis(1000)));
        lingering = true;
      }
    }
  }

  void handle(Received& r, std::atomic<bool>& stop) {
    auto root = r.root();
    if (root.which() == schema::ControlMessage::STOP) {
      {
        std::lock_guard lock(mu);
        stop_reason = root.getStop().getReason().cStr();
      }
      stop.store(true, std::memory_order_release);
    }
  }

  void run(std::atomic<bool>& stop) noexcept {
    try {
      auto next = detail::Clock::now() + interval;
      for (;;) {
        bool quitting = quit.load(std::memory_order_acquire);
        flush_failures();
        if (quitting) return;
        auto now = detail::Clock::now();
        if (now >= next) {
          send_heartbeat();
          next += interval;
          if (next <= now) next = now + interval;
        }
        zmq_pollitem_t items[2] = {channel.pollitem(), {nullptr, wake_fd.get(), ZMQ_POLLIN, 0}};
        ZMQ_CHECK(zmq_poll(items, 2, detail::remaining_ms(next)));
        if (items[1].revents & ZMQ_POLLIN) {
          uint64_t count;
          if (::read(wake_fd.get(), &count, sizeof count) < 0) {
          }
        }
        if (items[0].revents & ZMQ_POLLIN) {
          while (auto r = channel.receive(Millis(0))) handle(*r, stop);
        }
      }
    } catch (const std::exception& e) {
      // No heartbeats from here on: the supervisor reports this process as heartbeat_lost.
      log_error("control client thread stopped: {}", e.what());
    }
  }
};

ControlClient::ControlClient(const std::string& endpoint, schema::StageKind stage, uint32_t rank,
                             uint32_t generation, Millis interval) {
  MEGACPP_CHECK(interval > Millis::zero(), ErrorKind::kInvalidArgument,
                "heartbeat interval must be positive");
  state_ = std::make_unique<State>(endpoint, stage, rank, generation, interval);
  state_->send_hello();
  // Thread creation is the memory barrier that hands the socket over to the thread.
  state_->thread = std::thread([this] { state_->run(stop_); });
}

ControlClient::~ControlClient() {
  state_->quit.store(true, std::memory_order_release);
  state_->wake();
  if (state_->thread.joinable()) state_->thread.join();
}

void ControlClient::set_phase(schema::Phase phase) {
  state_->phase_started_ns.store(mono_ns(), std::memory_order_relaxed);
  state_->phase.store(static_cast<uint16_t>(phase), std::memory_order_relaxed);
}

void ControlClient::set_step(uint32_t step) {
  state_->step.store(step, std::memory_order_release);
}

void ControlClient::set_progress(uint32_t step, double tokens, float loss, double step_seconds) {
  state_->tokens.store(tokens, std::memory_order_relaxed);
  state_->loss_bits.store(std::bit_cast<uint32_t>(loss), std::memory_order_relaxed);
  state_->step_seconds.store(step_seconds, std::memory_order_relaxed);
  state_->step.store(step, std::memory_order_release);  // last: publishes the fields above
}

std::string ControlClient::stop_reason() const {
  std::lock_guard lock(state_->mu);
  return state_->stop_reason;
}

void ControlClient::report_failure(const std::string& kind, const std::string& message,
                                   schema::ErrorKind error_kind, int64_t met_ns) {
  {
    std::lock_guard lock(state_->mu);
    state_->failures.push_back({kind, message, error_kind, met_ns != 0 ? met_ns : mono_ns()});
  }
  state_->wake();
}

}  // namespace megacpp::ipc

namespace megacpp::ipc {
void ControlClient::report_progress(uint64_t work_done, int64_t pending_since_ns) {
  state_->work_done.store(work_done, std::memory_order_relaxed);
  state_->pending_since_ns.store(pending_since_ns, std::memory_order_relaxed);
  state_->progress_ns.store(mono_ns(), std::memory_order_relaxed);
}

void ControlClient::set_lag(double seconds) {
  state_->lag_seconds.store(seconds, std::memory_order_relaxed);
}
}  // namespace megacpp::ipc
