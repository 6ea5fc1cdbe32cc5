// megacpp::ipc across hosts: a ROUTER and a DEALER over TCP that speak only CurveZMQ with the
// job's keys (ipc/job_keys.h), each frame one Cap'n Proto flat-array message of the caller's
// schema. The job controller binds the CurveRouter, each node agent connects a CurveDealer.
// DESIGN.md "The control channel across hosts".
//
// What CURVE gives here: every frame encrypted and authenticated; the server proven to the
// client (a client checks the server's public key); the client proven to the server by the
// CurveRouter's ZAP handler, which accepts only the job's client public key. libzmq's CURVE
// server without a ZAP handler accepts ANY client that knows the server's public key, so the
// handler is not optional; it runs on a thread of the router's own ZeroMQ context (one ZAP
// handler per context), so handshakes complete whatever the owner's poll cadence.
//
// Lifetime: each owns its ZeroMQ context, sockets and (router) the ZAP thread; neither copyable
// nor movable. Closing never blocks (linger 0); the router's destructor joins its ZAP thread.
// Threads: a CurveRouter or CurveDealer is used by one thread at a time.
// Blocking: every send and receive takes a timeout and is bounded by it.
// Failure: a timeout or an unknown peer is a return value; a frame that is not one whole-word
// payload with a readable segment table is counted in malformed() and skipped (what the payload
// says is the caller's to check); a refused handshake is counted in refused() and never reaches the
// caller; a wildcard or unparsable endpoint is Error{kInvalidArgument}; failed ZeroMQ calls throw
// Error{kZmq}.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include "ipc/channel.h"
#include "ipc/job_keys.h"
#include "ipc/millis.h"

namespace megacpp::ipc {

// A received frame: who sent it (the ROUTER side's peer identity; empty on a DEALER) and its
// message, copied into word-aligned memory. Nothing inside it has been read yet: a reader
// that walks it (getRoot, totalSize) may throw kj::Exception on a malformed message.
class ReceivedFrame {
 public:
  ReceivedFrame(std::string peer, kj::Array<capnp::word> words);
  ReceivedFrame(const ReceivedFrame&) = delete;
  ReceivedFrame& operator=(const ReceivedFrame&) = delete;
  const std::string& peer() const noexcept { return peer_; }
  capnp::MessageReader& message() noexcept { return reader_; }

 private:
  std::string peer_;
  kj::Array<capnp::word> words_;
  capnp::FlatArrayMessageReader reader_;
};

// The job controller's end: binds `endpoint`, a tcp:// address the job names (an interface's
// address or name, e.g. tcp://10.0.0.1:29501 or tcp://eth1:29501; port * picks a free one).
// A wildcard address (*, 0.0.0.0, [::]) is refused: the channel listens on one interface.
class CurveRouter {
 public:
  // ZAP domain the router's handshakes are checked in.
  static constexpr std::string_view kZapDomain = "megacpp-job";

  CurveRouter(const JobKeys& keys, const std::string& endpoint);
  ~CurveRouter();
  CurveRouter(const CurveRouter&) = delete;
  CurveRouter& operator=(const CurveRouter&) = delete;

  // To a connected peer's identity; false when none is connected under it or the message
  // could not be queued within `timeout`.
  bool send_to(std::string_view peer, capnp::MessageBuilder& message,
               Millis timeout = Millis(1000));
  std::unique_ptr<ReceivedFrame> receive(Millis timeout);
  std::string endpoint() const;  // as bound: the port a `*` resolved to
  uint64_t malformed() const noexcept { return malformed_; }
  uint64_t refused() const noexcept { return refused_.load(std::memory_order_relaxed); }

 private:
  void serve_zap();

  ZmqContext ctx_;
  std::string client_public_;  // raw 32 bytes: the one key the ZAP handler accepts
  void* zap_ = nullptr;        // REP at inproc://zeromq.zap.01: the ZAP thread's
  void* stop_rx_ = nullptr;    // PAIR: the ZAP thread's stop signal
  void* stop_tx_ = nullptr;
  void* socket_ = nullptr;
  std::atomic<uint64_t> refused_{0};
  uint64_t malformed_ = 0;
  std::thread zap_thread_;
};

// A node agent's end: connects to the controller's endpoint as `identity` (the node's name),
// presenting the job's client key pair and expecting the job's server key. Messages sent
// before the handshake completes wait in ZeroMQ's queue; a server with another key never
// completes it, so they are never delivered to it.
class CurveDealer {
 public:
  CurveDealer(const JobKeys& keys, const std::string& endpoint, const std::string& identity);
  ~CurveDealer();
  CurveDealer(const CurveDealer&) = delete;
  CurveDealer& operator=(const CurveDealer&) = delete;

  bool send(capnp::MessageBuilder& message, Millis timeout = Millis(1000));
  std::unique_ptr<ReceivedFrame> receive(Millis timeout);
  uint64_t malformed() const noexcept { return malformed_; }

 private:
  ZmqContext ctx_;
  void* socket_ = nullptr;
  uint64_t malformed_ = 0;
};

}  // namespace megacpp::ipc
