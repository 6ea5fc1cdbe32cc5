// ZeroMQ next to the code that calls it: the error check for libzmq's C API and access to
// the raw handles behind ZmqContext and Channel. Internal to ipc (and ipc's tests); never
// included from a public header.
#pragma once

#include <zmq.h>

#include <cerrno>
#include <string>
#include <string_view>

#include <capnp/message.h>
#include <kj/array.h>

#include "ipc/channel.h"

namespace megacpp::ipc::detail {

// Throws Error{kZmq} "<expr> failed: <zmq_strerror(err)> (<file>:<line>)".
[[noreturn]] void throw_zmq(const char* expr, int err, const char* file, int line);

// One message as it came off a socket: the sender's identity (a ROUTER's; empty on a DEALER)
// and the payload copied into word-aligned memory (ZeroMQ frames are not aligned).
struct Frame {
  std::string peer;
  kj::Array<capnp::word> words;
};
enum class FrameResult { kNone, kFrame, kMalformed };

// Sends `message` as one flat-array frame (a ROUTER prefixes `peer`'s identity frame), waiting
// at most `timeout` for room. False: not queued in time, or (ROUTER) no such peer connected.
bool send_frame(void* socket, bool router, std::string_view peer, capnp::MessageBuilder& message,
                Millis timeout);
// Waits at most `timeout` for one message: kNone when none came (or a signal interrupted the
// wait), kMalformed (and `problem` says why) when its frames are not [identity,] payload with
// a payload of whole words. Does not look inside the payload.
FrameResult receive_frame(void* socket, bool router, Millis timeout, Frame& frame,
                          std::string& problem);

struct ZmqAccess {
  static void* context(ZmqContext& ctx) noexcept { return ctx.ctx_; }
  static void* socket(const Channel& channel) noexcept { return channel.socket_; }
};

}  // namespace megacpp::ipc::detail

// Evaluates `expr` (retrying on EINTR) and throws Error{kZmq} naming the expression, file
// and line if it returned -1 (libzmq reports through zmq_errno). Yields the expression's value.
#define ZMQ_CHECK(expr)                                                          \
  ({                                                                             \
    auto megacpp_r_ = (expr);                                                    \
    while (megacpp_r_ == -1 && zmq_errno() == EINTR) megacpp_r_ = (expr);        \
    if (megacpp_r_ == -1)                                                        \
      ::megacpp::ipc::detail::throw_zmq(#expr, zmq_errno(), __FILE__, __LINE__); \
    megacpp_r_;                                                                  \
  })

// For a libzmq call whose failure is not "-1" (a null handle, an errno already read): throws
// the same Error{kZmq} naming `call` and `err`.
#define ZMQ_FAIL(call, err) ::megacpp::ipc::detail::throw_zmq((call), (err), __FILE__, __LINE__)
