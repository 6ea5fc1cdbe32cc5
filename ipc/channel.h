// megacpp::ipc control plane: ZeroMQ sockets carrying one schema::ControlMessage per frame.
//
// Lifetime: ZmqContext, Channel and Poller own their ZeroMQ (or poll) state and are neither
// copyable nor movable; a Channel must be destroyed before its ZmqContext, a Poller before
// the Channels it watches. Closing never blocks (linger 0 unless set_linger says otherwise;
// a context never waits on sockets left open).
// Blocking: every send, receive and wait takes a timeout and is bounded by it.
// Failure: a timeout, a full queue or an unknown peer is a return value (false / nullptr);
// a malformed incoming frame is counted and skipped; failed ZeroMQ calls throw
// megacpp::Error{kZmq}, broken invariants megacpp::Error{kInternal / kInvalidArgument}.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include "ipc/millis.h"
#include "schemas/control.capnp.h"

namespace megacpp::ipc {

namespace detail {
struct ZmqAccess;  // ipc/detail/zmq.h: the raw handles, for ipc's own translation units
}

class ZmqContext {
 public:
  ZmqContext();
  ~ZmqContext();
  ZmqContext(const ZmqContext&) = delete;
  ZmqContext& operator=(const ZmqContext&) = delete;

 private:
  friend struct detail::ZmqAccess;
  void* ctx_;
};

// A received control message. The frame is copied into a word-aligned buffer before it is
// read (ZeroMQ frames are not aligned). root() is valid for this object's lifetime.
class Received {
 public:
  Received(std::string peer, kj::Array<capnp::word> words);
  Received(const Received&) = delete;
  Received& operator=(const Received&) = delete;
  const std::string& peer() const noexcept { return peer_; }  // ROUTER side: sender identity
  schema::ControlMessage::Reader root() { return reader_.getRoot<schema::ControlMessage>(); }

 private:
  std::string peer_;
  kj::Array<capnp::word> words_;
  capnp::FlatArrayMessageReader reader_;
};

// ROUTER (bind) or DEALER (connect) socket. Linger is 0: closing never blocks. A ROUTER bound
// to ipc://PATH removes its socket file when destroyed.
// A DEALER's routing identity is `identity` (e.g. "trainer-1"); the ROUTER sees it as peer().
// Not thread-safe: one thread uses a Channel at a time (ZeroMQ sockets are not thread-safe).
class Channel {
 public:
  enum class Kind { kRouter, kDealer };
  Channel(ZmqContext& ctx, Kind kind, const std::string& endpoint,
          const std::string& identity = {});
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // DEALER: send to the bound peer. ROUTER: send_to a connected identity. Return false if
  // the message could not be queued within `timeout` or the peer is unknown (ROUTER).
  bool send(capnp::MessageBuilder& message, Millis timeout = Millis(1000));
  bool send_to(std::string_view peer, capnp::MessageBuilder& message,
               Millis timeout = Millis(1000));

  // Waits at most `timeout`; nullptr on timeout, and at once when a signal interrupts the
  // wait (a stop request is then seen promptly). A malformed frame or an unknown schema
  // version is counted in malformed() and skipped, never thrown.
  std::unique_ptr<Received> receive(Millis timeout);
  uint64_t malformed() const noexcept { return malformed_; }

  // The endpoint actually bound or connected (ZMQ_LAST_ENDPOINT): resolves a wildcard port
  // such as "tcp://127.0.0.1:*" to the port the kernel chose.
  std::string endpoint() const;
  // How long closing may wait to deliver queued messages (default 0). Used to flush a last
  // message (a Failure) before a process exits; it bounds the context's termination.
  void set_linger(Millis linger);

 private:
  friend struct detail::ZmqAccess;
  void* socket_;
  Kind kind_;
  uint64_t malformed_ = 0;
  // A bound ipc:// socket file, removed by the destructor (libzmq leaves it behind) unless
  // another socket has been bound at the same path since (different inode).
  std::string ipc_path_;
  uint64_t ipc_dev_ = 0;
  uint64_t ipc_ino_ = 0;
};

// Waits for input on Channels and file descriptors together (e.g. the supervisor's ROUTER
// and its signalfd). Sources are numbered 0, 1, ... in the order they were added; the
// Poller keeps references to its Channels, which must outlive it.
// Blocking: wait() blocks at most `timeout` (a negative timeout waits without bound).
// Failure: an interrupted wait (EINTR) returns 0 with nothing readable; any other failure
// of the underlying poll throws Error{kZmq}.
class Poller {
 public:
  Poller();
  ~Poller();
  Poller(const Poller&) = delete;
  Poller& operator=(const Poller&) = delete;

  size_t add(const Channel& channel);  // returns the source's index
  size_t add(int fd);                  // readable = POLLIN on the descriptor
  // Waits until a source is readable or `timeout` expires; returns how many are readable.
  size_t wait(Millis timeout);
  // Whether source `index` was readable at the last wait().
  bool readable(size_t index) const;

 private:
  struct Items;
  std::unique_ptr<Items> items_;
};

// Builds a ControlMessage with schemaVersion set; fill the union via root().
class ControlMessageBuilder {
 public:
  ControlMessageBuilder();
  schema::ControlMessage::Builder root() { return root_; }
  capnp::MessageBuilder& message() { return message_; }

 private:
  capnp::MallocMessageBuilder message_;
  schema::ControlMessage::Builder root_;
};

}  // namespace megacpp::ipc
