#include "core/error.h"

#include <zmq.h>

#include <cstring>

#include <fmt/format.h>

namespace megacpp {

std::string_view to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return "invalid_argument";
    case ErrorKind::kSystem:
      return "system";
    case ErrorKind::kZmq:
      return "zmq";
    case ErrorKind::kProtocol:
      return "protocol";
    case ErrorKind::kCorruption:
      return "corruption";
    case ErrorKind::kTimeout:
      return "timeout";
    case ErrorKind::kPeerFailure:
      return "peer_failure";
    case ErrorKind::kInternal:
      return "internal";
  }
  return "unknown";
}

Error::Error(ErrorKind kind, std::string message, const char* file, int line, int sys_errno)
    : std::runtime_error(std::move(message)),
      kind_(kind),
      file_(file),
      line_(line),
      errno_(sys_errno) {}

namespace detail {

void throw_syscall(const char* expr, int err, const char* file, int line) {
  throw Error(ErrorKind::kSystem,
              fmt::format("{} failed: {} ({}:{})", expr, std::strerror(err), file, line), file,
              line, err);
}

void throw_zmq(const char* expr, int err, const char* file, int line) {
  throw Error(ErrorKind::kZmq,
              fmt::format("{} failed: {} ({}:{})", expr, zmq_strerror(err), file, line), file, line,
              err);
}

void throw_check(ErrorKind kind, const char* expr, const std::string& msg, const char* file,
                 int line) {
  throw Error(kind, fmt::format("{} [check `{}` at {}:{}]", msg, expr, file, line), file, line);
}

}  // namespace detail
}  // namespace megacpp
