// Typed errors and the check macros for every foreign API.
//
// Contract: broken invariants and failed system/library calls throw megacpp::Error,
// categorised by ErrorKind so the supervisor can map a failure dump to a typed reason.
// Expected conditions (a timeout, EAGAIN, a full ring) are never thrown: the APIs that
// can meet them return a value saying so.
#pragma once

#include <cerrno>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace megacpp {

enum class ErrorKind {
  kInvalidArgument,  // bad user input: CLI flag, recipe, run directory
  kSystem,           // a failed syscall (errno recorded)
  kZmq,              // a failed ZeroMQ call
  kProtocol,         // a malformed or unexpected message
  kCorruption,       // a checksum or format violation in durable data
  kTimeout,          // a deadline that is an invariant (not an expected poll timeout)
  kPeerFailure,      // another process failed and this one cannot go on
  kInterrupted,      // asked to stop (SIGTERM/SIGINT, a Stop) before its work was done
  kInternal,         // a bug
  kDiverged,         // training produced a non-finite loss, gradient or parameter
};

// How many ErrorKinds there are (the enumerators are 0 .. kErrorKindCount - 1).
inline constexpr int kErrorKindCount = static_cast<int>(ErrorKind::kDiverged) + 1;

std::string_view to_string(ErrorKind kind);

// What whoever catches an Error (or reads a stage's Failure) should do about it, the shape of
// KJ's exception types: retrying, reconnecting and giving up are the only three answers a
// restart policy needs, and each ErrorKind has exactly one (action_of).
enum class ErrorAction : uint8_t {
  // KJ OVERLOADED: the operation may succeed if tried again unchanged, after a pause (a
  // deadline passed, a resource ran short: a full disk, too many files). Retry within a budget.
  kRetry,
  // KJ DISCONNECTED: a peer process or a connection went away. Re-establish it (restart or
  // rejoin the peer) and go on from the last durable state.
  kReconnect,
  // KJ FAILED: repeating cannot help (bad input, corrupt data, a bug, a diverged model, or a
  // stop that was asked for). Report it, with the user's line, and stop.
  kGiveUp,
};

ErrorAction action_of(ErrorKind kind);
std::string_view to_string(ErrorAction action);

// Every Error records, at construction, when it was raised (CLOCK_MONOTONIC, the evidence
// time of a first failure) and the raw return addresses of the native stack (at most
// kMaxBacktraceFrames, the constructor's own frames and the throw_* helpers excluded).
// Capturing costs one unwinder walk and no formatting; backtrace() symbolises on first call.
//
// Two texts: message() is the user's line (what, which file or key, what to do), with no
// failed expression and no source location; what() is the text logs and failure dumps record,
// the message plus, for SYSCALL_CHECK and MEGACPP_CHECK, the expression and where it failed.
// A command line prints message(); whoever records a failure for later diagnosis keeps what().
class Error : public std::runtime_error {
 public:
  static constexpr int kMaxBacktraceFrames = 32;

  // what() == message().
  Error(ErrorKind kind, std::string message, const char* file = "", int line = 0,
        int sys_errno = 0);
  // what() == logged: the message with what only a log wants (the expression, the location).
  Error(ErrorKind kind, std::string message, std::string logged, const char* file, int line,
        int sys_errno);
  ErrorKind kind() const noexcept { return kind_; }
  ErrorAction action() const { return action_of(kind_); }
  const std::string& message() const noexcept { return message_; }
  const std::string& file() const noexcept { return file_; }
  int line() const noexcept { return line_; }
  int sys_errno() const noexcept { return errno_; }
  int64_t mono_ns() const noexcept { return mono_ns_; }
  // One line per frame, innermost first: "function+0xoff in object [0xaddr]" (demangled) when
  // the symbol is known, else the object and offset as backtrace_symbols prints them.
  // Symbol names of executables need -rdynamic (megacpp::core adds it for its consumers).
  // Thread-safe; copies of an Error share the captured trace.
  const std::vector<std::string>& backtrace() const;

 private:
  struct Trace;
  ErrorKind kind_;
  std::string message_;
  std::string file_;
  int line_;
  int errno_;
  int64_t mono_ns_;
  std::shared_ptr<Trace> trace_;
};

// Symbolises raw return addresses the way Error::backtrace() does (for stacks captured
// elsewhere, e.g. kj::Exception::getStackTrace()). Allocates; not async-signal-safe.
std::vector<std::string> symbolize_frames(void* const* frames, int count);

// The user's line of any exception: Error::message() for an Error, else what().
std::string_view user_message(const std::exception& e) noexcept;

namespace detail {
[[noreturn]] void throw_syscall(const char* expr, int err, const char* file, int line);
[[noreturn]] void throw_syscall_path(const char* action, const std::string& path, const char* expr,
                                     int err, const char* file, int line);
[[noreturn]] void throw_check(ErrorKind kind, const char* expr, const std::string& msg,
                              const char* file, int line);
[[noreturn]] void throw_fail(ErrorKind kind, std::string msg, const char* file, int line,
                             int sys_errno = 0);
}  // namespace detail

}  // namespace megacpp

// Evaluates `expr` (retrying on EINTR) and throws Error{kSystem} naming the expression,
// file and line if it returned -1. Yields the expression's value.
#define SYSCALL_CHECK(expr)                                                                   \
  ({                                                                                          \
    auto megacpp_r_ = (expr);                                                                 \
    while (megacpp_r_ == -1 && errno == EINTR) megacpp_r_ = (expr);                           \
    if (megacpp_r_ == -1) ::megacpp::detail::throw_syscall(#expr, errno, __FILE__, __LINE__); \
    megacpp_r_;                                                                               \
  })

// SYSCALL_CHECK for a call on a file the user named or can act on: the message is the user's
// line "cannot <action> <path>: <strerror>" (action: "open", "create", "read", ...); the
// expression and source location go to what() only.
#define SYSCALL_CHECK_PATH(expr, action, path)                                                  \
  ({                                                                                            \
    auto megacpp_r_ = (expr);                                                                   \
    while (megacpp_r_ == -1 && errno == EINTR) megacpp_r_ = (expr);                             \
    if (megacpp_r_ == -1) {                                                                     \
      const int megacpp_err_ = errno; /* before `path` is evaluated */                          \
      ::megacpp::detail::throw_syscall_path((action), ::std::string(path), #expr, megacpp_err_, \
                                            __FILE__, __LINE__);                                \
    }                                                                                           \
    megacpp_r_;                                                                                 \
  })

// For an OS call whose failure is not "-1 and errno" (a null or MAP_FAILED result, an error
// code returned or saved): throws the same Error{kSystem} naming `call` and `err`.
#define SYSCALL_FAIL(call, err) ::megacpp::detail::throw_syscall((call), (err), __FILE__, __LINE__)

// Raises Error{kind} with a fmt-formatted message (the user-facing line: what, which file or
// key, what to do), recording file and line for the failure dump. The one way megacpp throws.
#define MEGACPP_FAIL(kind, ...) \
  ::megacpp::detail::throw_fail((kind), ::fmt::format(__VA_ARGS__), __FILE__, __LINE__)
// The same for a failed OS call reported as an error code (std::error_code, a returned errno):
// kind kSystem, the code kept as Error::sys_errno().
#define MEGACPP_FAIL_SYS(err, ...)                                                         \
  ::megacpp::detail::throw_fail(::megacpp::ErrorKind::kSystem, ::fmt::format(__VA_ARGS__), \
                                __FILE__, __LINE__, (err))

// Re-raises a caught Error's kind and errno under a new message (context known only here).
#define MEGACPP_FAIL_LIKE(error, ...)                                                           \
  ::megacpp::detail::throw_fail((error).kind(), ::fmt::format(__VA_ARGS__), __FILE__, __LINE__, \
                                (error).sys_errno())

// An invariant: throws Error{kind} with the expression text and message when false.
#define MEGACPP_CHECK(cond, kind, msg)                                                     \
  do {                                                                                     \
    if (!(cond)) ::megacpp::detail::throw_check((kind), #cond, (msg), __FILE__, __LINE__); \
  } while (0)
