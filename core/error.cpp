#include "core/error.h"

#include <cxxabi.h>
#include <execinfo.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "core/clock.h"

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
    case ErrorKind::kInterrupted:
      return "interrupted";
    case ErrorKind::kInternal:
      return "internal";
    case ErrorKind::kDiverged:
      return "diverged";
  }
  return "unknown";
}

// One answer per kind; no default, so a new kind does not compile (-Wswitch, -Werror) until
// it is given one.
ErrorAction action_of(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kSystem:   // ENOSPC, EMFILE, EIO: the next generation may find it gone
    case ErrorKind::kTimeout:  // an invariant deadline: the other side was slow, not gone
      return ErrorAction::kRetry;
    case ErrorKind::kZmq:          // the transport failed under the call
    case ErrorKind::kPeerFailure:  // another process failed: a victim, not the cause
      return ErrorAction::kReconnect;
    case ErrorKind::kInvalidArgument:  // the same input fails the same way
    case ErrorKind::kProtocol:         // the same peer sends the same malformed message
    case ErrorKind::kCorruption:       // durable data does not heal itself
    case ErrorKind::kInterrupted:      // a stop that was asked for is not undone
    case ErrorKind::kInternal:         // a bug
    case ErrorKind::kDiverged:         // the same step from the same state diverges again
      return ErrorAction::kGiveUp;
  }
  MEGACPP_FAIL(ErrorKind::kInternal, "action_of: ErrorKind {} is not an enumerator",
               static_cast<int>(kind));
}

std::string_view to_string(ErrorAction action) {
  switch (action) {
    case ErrorAction::kRetry:
      return "retry";
    case ErrorAction::kReconnect:
      return "reconnect";
    case ErrorAction::kGiveUp:
      return "give_up";
  }
  return "unknown";
}

namespace {

// Frames captured beyond kMaxBacktraceFrames: the constructor's own frame and up to two
// throw_* helpers, dropped when formatting.
constexpr int kExtraFrames = 3;
// A demangled template-heavy frame can run to kilobytes; a dump needs the start of it.
constexpr size_t kMaxFrameChars = 512;

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

// "object(mangled+0xoff) [0xaddr]" -> "demangled+0xoff in object [0xaddr]"; lines without a
// symbol name ("object(+0xoff) [0xaddr]") are kept as they are: addr2line reads them.
std::string format_frame(const char* raw) {
  std::string line(raw);
  const size_t lp = line.rfind('(');
  const size_t plus = lp == std::string::npos ? std::string::npos : line.find('+', lp);
  const size_t rp = lp == std::string::npos ? std::string::npos : line.find(')', lp);
  if (lp != std::string::npos && plus != std::string::npos && rp != std::string::npos &&
      plus > lp + 1 && rp > plus) {
    const std::string mangled = line.substr(lp + 1, plus - lp - 1);
    int status = 0;
    std::unique_ptr<char, FreeDeleter> demangled(
        abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status));
    const std::string name = status == 0 && demangled ? std::string(demangled.get()) : mangled;
    line = fmt::format("{}{} in {}{}", name, line.substr(plus, rp - plus), line.substr(0, lp),
                       line.substr(rp + 1));
  }
  if (line.size() > kMaxFrameChars) {
    line.resize(kMaxFrameChars - 3);
    line += "...";
  }
  return line;
}

}  // namespace

struct Error::Trace {
  std::array<void*, kMaxBacktraceFrames + kExtraFrames> frames;
  int count = 0;
  std::once_flag once;
  std::vector<std::string> lines;
};

std::vector<std::string> symbolize_frames(void* const* frames, int count) {
  std::vector<std::string> out;
  if (count <= 0) return out;
  std::unique_ptr<char*, FreeDeleter> symbols(::backtrace_symbols(frames, count));
  out.reserve(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    out.push_back(symbols ? format_frame(symbols.get()[i])
                          : fmt::format("[{}]", fmt::ptr(frames[i])));
  }
  return out;
}

Error::Error(ErrorKind kind, std::string message, const char* file, int line, int sys_errno)
    : Error(kind, message, message, file, line, sys_errno) {}

// noinline: frame 0 of the capture is always this constructor, whoever calls it (the
// delegating constructor above is a frame backtrace() skips by name).
__attribute__((noinline)) Error::Error(ErrorKind kind, std::string message, std::string logged,
                                       const char* file, int line, int sys_errno)
    : std::runtime_error(std::move(logged)),
      kind_(kind),
      message_(std::move(message)),
      file_(file),
      line_(line),
      errno_(sys_errno),
      mono_ns_(megacpp::mono_ns()),
      trace_(std::make_shared<Trace>()) {
  trace_->count = ::backtrace(trace_->frames.data(), static_cast<int>(trace_->frames.size()));
}

const std::vector<std::string>& Error::backtrace() const {
  static const std::vector<std::string> kNone;  // a moved-from Error has no trace
  if (!trace_) return kNone;
  std::call_once(trace_->once, [this] {
    Trace& t = *trace_;
    std::vector<std::string> all = symbolize_frames(t.frames.data(), t.count);
    size_t first = std::min<size_t>(1, all.size());  // this constructor
    while (first < all.size() && (all[first].starts_with("megacpp::detail::throw_") ||
                                  all[first].starts_with("megacpp::Error::Error"))) {
      ++first;
    }
    const size_t last = std::min(all.size(), first + kMaxBacktraceFrames);
    t.lines.assign(std::make_move_iterator(all.begin() + static_cast<std::ptrdiff_t>(first)),
                   std::make_move_iterator(all.begin() + static_cast<std::ptrdiff_t>(last)));
  });
  return trace_->lines;
}

std::string_view user_message(const std::exception& e) noexcept {
  if (const auto* error = dynamic_cast<const Error*>(&e)) return error->message();
  return e.what();
}

namespace detail {

void throw_syscall(const char* expr, int err, const char* file, int line) {
  std::string message = fmt::format("{} failed: {}", expr, std::strerror(err));
  std::string logged = fmt::format("{} ({}:{})", message, file, line);
  throw Error(ErrorKind::kSystem, std::move(message), std::move(logged), file, line, err);
}

void throw_syscall_path(const char* action, const std::string& path, const char* expr, int err,
                        const char* file, int line) {
  std::string message = fmt::format("cannot {} {}: {}", action, path, std::strerror(err));
  std::string logged = fmt::format("{} ({} at {}:{})", message, expr, file, line);
  throw Error(ErrorKind::kSystem, std::move(message), std::move(logged), file, line, err);
}

void throw_check(ErrorKind kind, const char* expr, const std::string& msg, const char* file,
                 int line) {
  throw Error(kind, msg, fmt::format("{} [check `{}` at {}:{}]", msg, expr, file, line), file, line,
              0);
}

void throw_fail(ErrorKind kind, std::string msg, const char* file, int line, int sys_errno) {
  throw Error(kind, std::move(msg), file, line, sys_errno);
}

}  // namespace detail
}  // namespace megacpp
