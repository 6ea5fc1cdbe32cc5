#include "ipc/curve_channel.h"

#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <kj/exception.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/detail/internal.h"
#include "ipc/detail/zmq.h"

namespace megacpp::ipc {

namespace {

// Frames larger than this are refused by ZeroMQ itself (the peer is disconnected) before any
// memory is spent on them; node commands and events are a few KiB.
constexpr int64_t kMaxMessageBytes = int64_t{64} << 20;
constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";
constexpr const char* kStopEndpoint = "inproc://megacpp-zap-stop";

void set_int(void* socket, int option, int value) {
  ZMQ_CHECK(zmq_setsockopt(socket, option, &value, sizeof value));
}

void set_key(void* socket, int option, const std::string& z85) {
  // 41 bytes: libzmq reads a Z85 key with its terminating NUL.
  ZMQ_CHECK(zmq_setsockopt(socket, option, z85.c_str(), z85.size() + 1));
}

void* open_socket(ZmqContext& ctx, int type) {
  void* s = zmq_socket(detail::ZmqAccess::context(ctx), type);
  if (s == nullptr) ZMQ_FAIL("zmq_socket", zmq_errno());
  set_int(s, ZMQ_LINGER, 0);
  return s;
}

void close_socket(void*& s) noexcept {
  if (s != nullptr) zmq_close(s);
  s = nullptr;
}

// tcp://HOST:PORT with HOST one interface: a wildcard would listen on every network the host
// is on, which the job did not name.
void check_endpoint(const std::string& endpoint) {
  const std::string_view e = endpoint;
  const size_t colon = e.rfind(':');
  const bool tcp = e.starts_with("tcp://") && colon != std::string_view::npos && colon > 6;
  const std::string_view host = tcp ? e.substr(6, colon - 6) : std::string_view{};
  if (!tcp) {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("control endpoint '{}' is not tcp://ADDRESS:PORT; name the "
                            "interface the job's nodes reach each other on",
                            endpoint));
  }
  if (host == "*" || host == "0.0.0.0" || host == "[::]" || host == "::" || host == "[*]") {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("control endpoint '{}' listens on every interface; name the one "
                            "the job's nodes reach each other on (its address or name)",
                            endpoint));
  }
}

// Owns one zmq_msg_t.
struct Msg {
  zmq_msg_t m;
  Msg() { zmq_msg_init(&m); }
  ~Msg() { zmq_msg_close(&m); }
  Msg(const Msg&) = delete;
  Msg& operator=(const Msg&) = delete;
};

// One receive through detail::receive_frame, counting and logging what is malformed.
std::unique_ptr<ReceivedFrame> receive_on(void* socket, bool router, Millis timeout,
                                          uint64_t& malformed) {
  const auto deadline = detail::Clock::now() + timeout;
  for (;;) {
    detail::Frame frame;
    std::string problem;
    switch (detail::receive_frame(socket, router, Millis(detail::remaining_ms(deadline)), frame,
                                  problem)) {
      case detail::FrameResult::kNone:
        return nullptr;
      case detail::FrameResult::kFrame:
        try {
          // Reading the segment table may already find the message malformed.
          return std::make_unique<ReceivedFrame>(frame.peer, std::move(frame.words));
        } catch (const kj::Exception& e) {
          problem = e.getDescription().cStr();
        }
        [[fallthrough]];
      case detail::FrameResult::kMalformed:
        ++malformed;
        if (malformed <= 10 || malformed % 1000 == 0) {
          log_warn("node link: skipped malformed frame #{} from '{}': {}", malformed, frame.peer,
                   problem);
        }
        break;
    }
  }
}

}  // namespace

ReceivedFrame::ReceivedFrame(std::string peer, kj::Array<capnp::word> words)
    : peer_(std::move(peer)),
      words_(std::move(words)),
      reader_(words_.asPtr(), detail::reader_options(words_.size())) {}

// ---------------------------------------------------------------------------------------

CurveRouter::CurveRouter(const JobKeys& keys, const std::string& endpoint) {
  check_endpoint(endpoint);
  std::array<uint8_t, 32> raw{};
  if (zmq_z85_decode(raw.data(), keys.client.public_key.c_str()) == nullptr ||
      keys.client.public_key.size() != 40) {
    throw Error(ErrorKind::kInvalidArgument, "the job's client public key is not a Z85 key");
  }
  client_public_.assign(reinterpret_cast<const char*>(raw.data()), raw.size());
  try {
    // The ZAP handler is bound before the router exists, so no handshake ever finds it absent
    // (libzmq would then let any client in).
    zap_ = open_socket(ctx_, ZMQ_REP);
    ZMQ_CHECK(zmq_bind(zap_, kZapEndpoint));
    stop_rx_ = open_socket(ctx_, ZMQ_PAIR);
    ZMQ_CHECK(zmq_bind(stop_rx_, kStopEndpoint));
    stop_tx_ = open_socket(ctx_, ZMQ_PAIR);
    ZMQ_CHECK(zmq_connect(stop_tx_, kStopEndpoint));

    socket_ = open_socket(ctx_, ZMQ_ROUTER);
    ZMQ_CHECK(zmq_setsockopt(socket_, ZMQ_MAXMSGSIZE, &kMaxMessageBytes, sizeof kMaxMessageBytes));
    // Unknown identities fail the send (EHOSTUNREACH) instead of being dropped silently; a
    // node that reconnects under its name takes its route over.
    set_int(socket_, ZMQ_ROUTER_MANDATORY, 1);
    set_int(socket_, ZMQ_ROUTER_HANDOVER, 1);
    set_int(socket_, ZMQ_CURVE_SERVER, 1);
    set_key(socket_, ZMQ_CURVE_SECRETKEY, keys.server.secret_key);
    ZMQ_CHECK(zmq_setsockopt(socket_, ZMQ_ZAP_DOMAIN, kZapDomain.data(), kZapDomain.size()));
    ZMQ_CHECK(zmq_bind(socket_, endpoint.c_str()));
  } catch (...) {
    close_socket(socket_);
    close_socket(stop_tx_);
    close_socket(stop_rx_);
    close_socket(zap_);
    throw;
  }
  zap_thread_ = std::thread([this] { serve_zap(); });
}

CurveRouter::~CurveRouter() {
  char stop = 0;
  zmq_send(stop_tx_, &stop, 1, ZMQ_DONTWAIT);
  zap_thread_.join();
  close_socket(socket_);
  close_socket(stop_tx_);
  close_socket(stop_rx_);
  close_socket(zap_);
}

// ZAP (RFC 27): request [version, request id, domain, address, identity, mechanism,
// credentials...]; reply [version, request id, status code, status text, user id, metadata].
// Accepts CURVE with the job's client key in the router's domain; refuses everything else.
// Runs on zap_thread_, which alone uses zap_ and stop_rx_ until the destructor joins it.
void CurveRouter::serve_zap() {
  for (;;) {
    std::array<zmq_pollitem_t, 2> items{{{zap_, 0, ZMQ_POLLIN, 0}, {stop_rx_, 0, ZMQ_POLLIN, 0}}};
    const int n = zmq_poll(items.data(), 2, -1);
    if (n == -1) {
      if (zmq_errno() == EINTR) continue;
      return;  // the context is going away
    }
    if (items[1].revents & ZMQ_POLLIN) return;
    if (!(items[0].revents & ZMQ_POLLIN)) continue;
    std::vector<std::string> parts;
    for (;;) {
      Msg part;
      if (zmq_msg_recv(&part.m, zap_, 0) == -1) {
        if (zmq_errno() == EINTR) continue;
        return;
      }
      parts.emplace_back(static_cast<const char*>(zmq_msg_data(&part.m)), zmq_msg_size(&part.m));
      if (!zmq_msg_more(&part.m)) break;
    }
    const bool accepted = parts.size() >= 7 && parts[0] == "1.0" && parts[2] == kZapDomain &&
                          parts[5] == "CURVE" && parts[6] == client_public_;
    if (!accepted) {
      const uint64_t count = refused_.fetch_add(1, std::memory_order_relaxed) + 1;
      if (count <= 10 || count % 1000 == 0) {
        log_warn("node link: refused a peer without the job's keys (#{}, from {}, mechanism {})",
                 count, parts.size() > 3 ? parts[3] : "?", parts.size() > 5 ? parts[5] : "?");
      }
    }
    const std::string request_id = parts.size() > 1 ? parts[1] : "";
    const std::array<std::string, 6> reply{
        "1.0", request_id, accepted ? "200" : "400", accepted ? "OK" : "not a key of this job",
        "",    ""};
    for (size_t i = 0; i < reply.size(); ++i) {
      if (zmq_send(zap_, reply[i].data(), reply[i].size(),
                   i + 1 < reply.size() ? ZMQ_SNDMORE : 0) == -1) {
        return;
      }
    }
  }
}

bool CurveRouter::send_to(std::string_view peer, capnp::MessageBuilder& message, Millis timeout) {
  if (peer.empty()) return false;
  return detail::send_frame(socket_, true, peer, message, timeout);
}

std::unique_ptr<ReceivedFrame> CurveRouter::receive(Millis timeout) {
  return receive_on(socket_, true, timeout, malformed_);
}

std::string CurveRouter::endpoint() const {
  char buf[1024];
  size_t len = sizeof buf;
  ZMQ_CHECK(zmq_getsockopt(socket_, ZMQ_LAST_ENDPOINT, buf, &len));
  return std::string(buf, len > 0 ? len - 1 : 0);
}

// ---------------------------------------------------------------------------------------

CurveDealer::CurveDealer(const JobKeys& keys, const std::string& endpoint,
                         const std::string& identity) {
  MEGACPP_CHECK(!identity.empty() && identity.size() <= 255 && identity[0] != '\0',
                ErrorKind::kInvalidArgument,
                fmt::format("DEALER identity '{}' must be 1..255 bytes", identity));
  socket_ = open_socket(ctx_, ZMQ_DEALER);
  try {
    ZMQ_CHECK(zmq_setsockopt(socket_, ZMQ_MAXMSGSIZE, &kMaxMessageBytes, sizeof kMaxMessageBytes));
    set_key(socket_, ZMQ_CURVE_SERVERKEY, keys.server.public_key);
    set_key(socket_, ZMQ_CURVE_PUBLICKEY, keys.client.public_key);
    set_key(socket_, ZMQ_CURVE_SECRETKEY, keys.client.secret_key);
    ZMQ_CHECK(zmq_setsockopt(socket_, ZMQ_ROUTING_ID, identity.data(), identity.size()));
    ZMQ_CHECK(zmq_connect(socket_, endpoint.c_str()));
  } catch (...) {
    close_socket(socket_);
    throw;
  }
}

CurveDealer::~CurveDealer() {
  close_socket(socket_);
}

bool CurveDealer::send(capnp::MessageBuilder& message, Millis timeout) {
  return detail::send_frame(socket_, false, {}, message, timeout);
}

std::unique_ptr<ReceivedFrame> CurveDealer::receive(Millis timeout) {
  return receive_on(socket_, false, timeout, malformed_);
}

}  // namespace megacpp::ipc
