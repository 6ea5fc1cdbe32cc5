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
#include "ipc/channel.h"
#include "ipc/detail/internal.h"
#include "ipc/detail/zmq.h"
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
  if (ctx_ == nullptr) ZMQ_FAIL("zmq_ctx_new", zmq_errno());
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
    : socket_(zmq_socket(detail::ZmqAccess::context(ctx),
                         kind == Kind::kRouter ? ZMQ_ROUTER : ZMQ_DEALER)),
      kind_(kind) {
  if (socket_ == nullptr) ZMQ_FAIL("zmq_socket", zmq_errno());
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

bool Channel::send(capnp::MessageBuilder& message, Millis timeout) {
  MEGACPP_CHECK(kind_ == Kind::kDealer, ErrorKind::kInternal,
                "Channel::send on a ROUTER (use send_to)");
  return detail::send_frame(socket_, false, {}, message, timeout);
}

bool Channel::send_to(std::string_view peer, capnp::MessageBuilder& message, Millis timeout) {
  MEGACPP_CHECK(kind_ == Kind::kRouter, ErrorKind::kInternal,
                "Channel::send_to on a DEALER (use send)");
  if (peer.empty()) return false;
  return detail::send_frame(socket_, true, peer, message, timeout);
}

std::unique_ptr<Received> Channel::receive(Millis timeout) {
  auto deadline = detail::Clock::now() + timeout;
  for (;;) {
    detail::Frame frame;
    std::string detail_text;
    switch (detail::receive_frame(socket_, kind_ == Kind::kRouter,
                                  Millis(detail::remaining_ms(deadline)), frame, detail_text)) {
      case detail::FrameResult::kNone:
        return nullptr;
      case detail::FrameResult::kMalformed:
        break;
      case detail::FrameResult::kFrame: {
        std::unique_ptr<Received> received;
        try {
          received = std::make_unique<Received>(frame.peer, std::move(frame.words));
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
        if (received) return received;
        break;
      }
    }
    ++malformed_;
    // Counted always; logged for the first few and then sparsely so a noisy peer cannot
    // flood the log.
    if (malformed_ <= 10 || malformed_ % 1000 == 0) {
      log_warn("control channel: skipped malformed message #{} from '{}': {}", malformed_,
               frame.peer, detail_text);
    }
  }
}

// ---------------------------------------------------------------------------------------

ControlMessageBuilder::ControlMessageBuilder()
    : root_(message_.initRoot<schema::ControlMessage>()) {
  root_.setSchemaVersion(schema::SCHEMA_VERSION);
}

// ---------------------------------------------------------------------------------------

struct Poller::Items {
  std::vector<zmq_pollitem_t> items;
};

Poller::Poller() : items_(std::make_unique<Items>()) {}

Poller::~Poller() = default;

size_t Poller::add(const Channel& channel) {
  items_->items.push_back(zmq_pollitem_t{detail::ZmqAccess::socket(channel), 0, ZMQ_POLLIN, 0});
  return items_->items.size() - 1;
}

size_t Poller::add(int fd) {
  items_->items.push_back(zmq_pollitem_t{nullptr, fd, ZMQ_POLLIN, 0});
  return items_->items.size() - 1;
}

size_t Poller::wait(Millis timeout) {
  auto& items = items_->items;
  for (auto& item : items) item.revents = 0;
  int n =
      zmq_poll(items.data(), static_cast<int>(items.size()), static_cast<long>(timeout.count()));
  if (n < 0) {
    int err = zmq_errno();
    if (err == EINTR) return 0;
    ZMQ_FAIL("zmq_poll", err);
  }
  return static_cast<size_t>(n);
}

bool Poller::readable(size_t index) const {
  MEGACPP_CHECK(index < items_->items.size(), ErrorKind::kInvalidArgument,
                fmt::format("poller has no source #{}", index));
  return (items_->items[index].revents & ZMQ_POLLIN) != 0;
}

// ---------------------------------------------------------------------------------------

namespace detail {

bool send_frame(void* socket, bool router, std::string_view peer, capnp::MessageBuilder& message,
                Millis timeout) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(message);
  auto bytes = words.asBytes();
  auto deadline = Clock::now() + timeout;
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
    if (!transient(err)) ZMQ_FAIL("zmq_send", err);
    long left = remaining_ms(deadline);
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

FrameResult receive_frame(void* socket, bool router, Millis timeout, Frame& frame,
                          std::string& problem) {
  const auto deadline = Clock::now() + timeout;
  Msg part;
  for (;;) {
    zmq_pollitem_t item{socket, 0, ZMQ_POLLIN, 0};
    const int ready = zmq_poll(&item, 1, remaining_ms(deadline));
    // A signal (SIGTERM: stop) ends the wait early, so the caller's stop check runs now
    // rather than after the rest of the timeout.
    if (ready == -1 && zmq_errno() == EINTR) return FrameResult::kNone;
    if (ready == -1) ZMQ_FAIL("zmq_poll", zmq_errno());
    if (ready == 0) return FrameResult::kNone;
    if (zmq_msg_recv(&part.m, socket, ZMQ_DONTWAIT) != -1) break;
    const int err = zmq_errno();
    if (!transient(err)) ZMQ_FAIL("zmq_msg_recv", err);
  }
  // ROUTER: [identity, payload]; DEALER: [payload]. Anything else is malformed, and every
  // part of a multipart message is drained so the next receive starts on a boundary.
  const size_t payload_index = router ? 1 : 0;
  problem.clear();
  for (size_t index = 0;; ++index) {
    size_t size = zmq_msg_size(&part.m);
    const void* data = zmq_msg_data(&part.m);
    if (router && index == 0) {
      frame.peer.assign(static_cast<const char*>(data), size);
    } else if (index == payload_index) {
      if (size == 0 || size % sizeof(capnp::word) != 0) {
        problem = "frame size is not a positive multiple of 8";
      } else {
        frame.words = kj::heapArray<capnp::word>(size / sizeof(capnp::word));
        std::memcpy(frame.words.begin(), data, size);
      }
    } else {
      problem = "unexpected extra frame";
    }
    if (!zmq_msg_more(&part.m)) {
      if (index < payload_index) problem = "missing payload frame";
      break;
    }
    ZMQ_CHECK(zmq_msg_recv(&part.m, socket, 0));
  }
  return problem.empty() ? FrameResult::kFrame : FrameResult::kMalformed;
}

void throw_zmq(const char* expr, int err, const char* file, int line) {
  throw Error(ErrorKind::kZmq,
              fmt::format("{} failed: {} ({}:{})", expr, zmq_strerror(err), file, line), file, line,
              err);
}

}  // namespace detail

}  // namespace megacpp::ipc
