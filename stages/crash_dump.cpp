// Failure dumps: what a stage writes when it dies. An exception or std::terminate is
// described in-process (schema::FailureDump through the JSON codec); a fatal signal is
// written by an async-signal-safe path from buffers prepared before any thread existed.
// Contracts in stages/detail/stage_internal.h.
#include "stages/detail/stage_internal.h"

#include <cxxabi.h>
#include <execinfo.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <typeinfo>

#include <capnp/message.h>
#include <capnp/schema.h>
#include <kj/exception.h>

#include "core/error.h"
#include "core/fd.h"
#include "core/util.h"
#include "schemas/enums.h"
#include "schemas/journal.capnp.h"

namespace megacpp::stage::detail {

namespace fs = std::filesystem;

namespace {

constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
constexpr int kMaxSignalFrames = 64;
constexpr size_t kMaxPhases = 32;

// What the fatal-signal and terminate handlers read. Prepared once by arm_crash_handlers
// (before any thread exists) and then only read, except `ctx` (published by StageContext)
// and `dumping`. Plain arrays, no heap: the signal path may not allocate, and nothing here
// has a destructor that could run while another thread is still crashing.
struct CrashState {
  std::atomic<const StageContext*> ctx{nullptr};
  std::atomic<bool> dumping{false};  // first crashing thread owns the dump
  schema::StageKind stage = schema::StageKind::SUPERVISOR;
  uint32_t rank = 0;
  char dir[PATH_MAX];   // RUN/failures
  char path[PATH_MAX];  // RUN/failures/<stage>-<rank>.json
  char tmp[PATH_MAX];   // path + ".tmp.<pid>"
  char prefix[1024];    // the dump's JSON up to the message text
  char name[64];        // "<stage>-<rank>" for stderr
  char phase_names[kMaxPhases][32];
  char out[64 * 1024];     // the JSON being written
  char frames[48 * 1024];  // backtrace_symbols_fd output read back
  alignas(16) char alt_stack[64 * 1024];
};
CrashState g_crash;

// The JSON name of an enumerant (as Cap'n Proto's JSON codec writes it).
template <typename E>
std::string enumerant_name(E value) {
  for (auto e : capnp::Schema::from<E>().getEnumerants()) {
    if (e.getOrdinal() == static_cast<uint16_t>(value)) return e.getProto().getName().cStr();
  }
  return std::to_string(static_cast<uint16_t>(value));
}

std::string json_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out += c;
        }
    }
  }
  return out;
}

void copy_cstr(char* dst, size_t cap, std::string_view src) {
  const size_t n = std::min(src.size(), cap - 1);
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

// c10::Error::what() carries its own C++ stack trace after the message ("Exception raised
// from ... (most recent call first):" then "frame #N: ..." lines): split it off.
void split_embedded_trace(const std::string& what, DumpFields& f) {
  size_t at = what.find("\nException raised from ");
  if (at == std::string::npos) {
    f.message = what;
    return;
  }
  f.message = what.substr(0, at);
  size_t begin = at + 1;
  while (begin < what.size()) {
    size_t end = what.find('\n', begin);
    if (end == std::string::npos) end = what.size();
    if (end > begin) f.backtrace.push_back(what.substr(begin, end - begin));
    begin = end + 1;
  }
}

std::string demangled_type_name(const std::type_info& type) {
  int status = 0;
  char* raw = abi::__cxa_demangle(type.name(), nullptr, nullptr, &status);
  std::string name = status == 0 && raw != nullptr ? raw : type.name();
  std::free(raw);
  return name;
}

}  // namespace

// What an in-flight exception says about itself. Never throws.
DumpFields classify(std::exception_ptr ep, schema::FailureReport report) noexcept {
  DumpFields f;
  try {
    f.kind = report;
    f.mono_ns = mono_ns();
    try {
      std::rethrow_exception(ep);
    } catch (const Error& e) {
      f.error_kind = schemas::to_schema(e.kind());
      f.message = e.what();
      f.backtrace = e.backtrace();
      f.mono_ns = e.mono_ns();
    } catch (const kj::Exception& e) {
      f.error_kind = schema::ErrorKind::CAPNP;
      f.message = fmt::format("{} ({}:{})", e.getDescription().cStr(), e.getFile(), e.getLine());
      auto trace = e.getStackTrace();
      f.backtrace = symbolize_frames(trace.begin(), static_cast<int>(trace.size()));
    } catch (const std::exception& e) {
      const std::string type = demangled_type_name(typeid(e));
      const bool c10 = type.starts_with("c10::");
      f.error_kind = c10 ? schema::ErrorKind::C10 : schema::ErrorKind::STD;
      split_embedded_trace(e.what(), f);
      if (!c10) f.message = fmt::format("{}: {}", type, f.message);
    } catch (...) {
      f.error_kind = schema::ErrorKind::UNKNOWN;
      const std::type_info* type = abi::__cxa_current_exception_type();
      f.message = fmt::format("exception of type {}",
                              type != nullptr ? demangled_type_name(*type) : "unknown");
    }
  } catch (...) {
    // Out of memory while describing the failure: the kind alone still goes out.
  }
  return f;
}

// The in-process dump (exceptions, terminate): schema::FailureDump through the JSON codec.
void write_failure_dump(const StageContext* ctx, schema::StageKind stage, uint32_t rank,
                        const fs::path& path, const DumpFields& f) noexcept {
  try {
    capnp::MallocMessageBuilder msg;
    auto d = msg.initRoot<schema::FailureDump>();
    d.setSchemaVersion(schema::SCHEMA_VERSION);
    d.setStage(stage);
    d.setRank(rank);
    d.setPid(::getpid());
    d.setKind(std::string(schemas::name(f.kind)));
    d.setErrorKind(f.error_kind_name());
    d.setMessage(f.message);
    if (ctx != nullptr) {
      d.setPhase(ctx->phase());
      d.setStep(ctx->step());
    }
    d.setMonoNs(f.mono_ns);
    d.setAt(rfc3339(wall_ns()));
    auto bt = d.initBacktrace(static_cast<unsigned>(f.backtrace.size()));
    for (size_t i = 0; i < f.backtrace.size(); ++i) {
      bt.set(static_cast<unsigned>(i), f.backtrace[i]);
    }
    fs::create_directories(path.parent_path());
    write_file_atomic(path, schemas::to_json(d.asReader()));
  } catch (const std::exception& e) {
    log_error("could not write the failure dump {}: {}", path.string(), e.what());
  }
}

void log_failure(const DumpFields& f) noexcept {
  try {
    log_error("{}", f.message);
    if (!f.backtrace.empty()) {
      log_error("backtrace ({} frames):\n  {}", f.backtrace.size(), fmt::join(f.backtrace, "\n  "));
    }
  } catch (...) {
  }
}

namespace {

// --- async-signal-safe pieces of the fatal-signal path -----------------------------------

// Appends into a fixed buffer; truncates silently. Only async-signal-safe operations.
struct SigBuf {
  char* p;
  size_t cap;
  size_t n = 0;

  size_t room() const { return cap - n; }
  void put(const char* s, size_t len) {
    const size_t k = len < room() ? len : room();
    std::memcpy(p + n, s, k);
    n += k;
  }
  void str(const char* s) { put(s, std::strlen(s)); }
  void u64(uint64_t v, int min_digits = 1) {
    char tmp[24];
    int i = 0;
    do {
      tmp[i++] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v != 0 || i < min_digits);
    while (i > 0) put(&tmp[--i], 1);
  }
  void i64(int64_t v) {
    if (v < 0) {
      put("-", 1);
      u64(static_cast<uint64_t>(-(v + 1)) + 1);
    } else {
      u64(static_cast<uint64_t>(v));
    }
  }
  void hex(uintptr_t v) {
    static constexpr char kDigits[] = "0123456789abcdef";
    char tmp[2 + 2 * sizeof v];
    int i = 0;
    do {
      tmp[i++] = kDigits[v & 0xf];
      v >>= 4;
    } while (v != 0);
    put("0x", 2);
    while (i > 0) put(&tmp[--i], 1);
  }
  // A JSON string literal with escapes.
  void json(const char* s, size_t len) {
    put("\"", 1);
    for (size_t i = 0; i < len; ++i) {
      const unsigned char c = static_cast<unsigned char>(s[i]);
      if (c == '"' || c == '\\') {
        const char esc[2] = {'\\', static_cast<char>(c)};
        put(esc, 2);
      } else if (c < 0x20) {
        static constexpr char kDigits[] = "0123456789abcdef";
        const char esc[6] = {'\\', 'u', '0', '0', kDigits[c >> 4], kDigits[c & 0xf]};
        put(esc, 6);
      } else {
        put(reinterpret_cast<const char*>(&c), 1);
      }
    }
    put("\"", 1);
  }
};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGILL:
      return "SIGILL";
    case SIGABRT:
      return "SIGABRT";
  }
  return "signal";
}

// RFC 3339 UTC with milliseconds, without gmtime (not async-signal-safe).
void put_rfc3339(SigBuf& b, int64_t ns) {
  const int64_t secs = ns / 1'000'000'000;
  int64_t days = secs / 86400;
  const int64_t sod = secs % 86400;
  // civil_from_days (H. Hinnant): proleptic Gregorian date of a day count since 1970-01-01.
  days += 719468;
  const int64_t era = (days >= 0 ? days : days - 146096) / 146097;
  const int64_t doe = days - era * 146097;
  const int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
  const int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
  const int64_t mp = (5 * doy + 2) / 153;
  const int64_t d = doy - (153 * mp + 2) / 5 + 1;
  const int64_t m = mp < 10 ? mp + 3 : mp - 9;
  const int64_t y = yoe + era * 400 + (m <= 2 ? 1 : 0);
  b.u64(static_cast<uint64_t>(y), 4);
  b.put("-", 1);
  b.u64(static_cast<uint64_t>(m), 2);
  b.put("-", 1);
  b.u64(static_cast<uint64_t>(d), 2);
  b.put("T", 1);
  b.u64(static_cast<uint64_t>(sod / 3600), 2);
  b.put(":", 1);
  b.u64(static_cast<uint64_t>(sod / 60 % 60), 2);
  b.put(":", 1);
  b.u64(static_cast<uint64_t>(sod % 60), 2);
  b.put(".", 1);
  b.u64(static_cast<uint64_t>(ns / 1'000'000 % 1000), 3);
  b.put("Z", 1);
}

int64_t clock_now_ns(clockid_t id) {
  timespec ts{};
  ::clock_gettime(id, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// The symbolised frames as backtrace_symbols_fd prints them, read back through a memfd;
// the raw addresses when that is not possible. Returns the bytes in g_crash.frames.
size_t symbolised_frames(void* const* frames, int count) {
  const Fd fd(::memfd_create("megacpp-backtrace", MFD_CLOEXEC));
  if (!fd.valid()) return 0;
  ::backtrace_symbols_fd(frames, count, fd.get());
  size_t n = 0;
  if (::lseek(fd.get(), 0, SEEK_SET) == 0) {
    while (n < sizeof g_crash.frames) {
      const ssize_t r = ::read(fd.get(), g_crash.frames + n, sizeof g_crash.frames - n);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      n += static_cast<size_t>(r);
    }
  }
  return n;
}

// The minimal dump of a fatal signal: async-signal-safe calls only (open, write, fsync,
// rename, memfd, backtrace after it was warmed up at start-up; Fd's destructor is a close).
void write_signal_dump(int sig, const siginfo_t* info, void* const* frames, int count) {
  SigBuf b{g_crash.out, sizeof g_crash.out};
  b.str(g_crash.prefix);
  b.str("fatal signal ");
  b.str(signal_name(sig));
  b.str(" (");
  b.u64(static_cast<uint64_t>(sig));
  b.str(")");
  if (info != nullptr) {
    if (info->si_code <= 0) {
      b.str(" sent by pid ");
      b.i64(info->si_pid);
    } else if (sig != SIGABRT) {
      b.str(" at address ");
      b.hex(reinterpret_cast<uintptr_t>(info->si_addr));
    }
  }
  const StageContext* ctx = g_crash.ctx.load();
  const uint16_t phase = ctx != nullptr ? static_cast<uint16_t>(ctx->phase()) : 0;
  const uint32_t step = ctx != nullptr ? ctx->step() : 0;
  b.str("\", \"phase\": ");
  if (phase < kMaxPhases && g_crash.phase_names[phase][0] != '\0') {
    b.json(g_crash.phase_names[phase], std::strlen(g_crash.phase_names[phase]));
  } else {
    b.u64(phase);
  }
  b.str(", \"step\": ");
  b.u64(step);
  b.str(", \"monoNs\": \"");
  b.i64(clock_now_ns(CLOCK_MONOTONIC));
  b.str("\", \"at\": \"");
  put_rfc3339(b, clock_now_ns(CLOCK_REALTIME));
  b.str("\", \"backtrace\": [");

  constexpr size_t kTail = 8;  // "]}\n" always fits
  const size_t text = symbolised_frames(frames, count);
  bool first = true;
  if (text > 0) {
    size_t begin = 0;
    while (begin < text) {
      size_t end = begin;
      while (end < text && g_crash.frames[end] != '\n') ++end;
      const size_t len = end - begin;
      if (len > 0) {
        if (b.room() < len * 6 + 4 + kTail) break;
        if (!first) b.put(", ", 2);
        b.json(g_crash.frames + begin, len);
        first = false;
      }
      begin = end + 1;
    }
  } else {
    for (int i = 0; i < count && b.room() > 32 + kTail; ++i) {
      if (!first) b.put(", ", 2);
      b.put("\"", 1);
      b.hex(reinterpret_cast<uintptr_t>(frames[i]));
      b.put("\"", 1);
      first = false;
    }
  }
  b.str("]}\n");

  ::mkdir(g_crash.dir, 0755);
  {
    const Fd fd(::open(g_crash.tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd.valid()) return;
    write_all(fd.get(), b.p, b.n);
    ::fsync(fd.get());
  }  // closed before the rename publishes the dump
  ::rename(g_crash.tmp, g_crash.path);
}

void on_fatal_signal(int sig, siginfo_t* info, void*) {
  if (!g_crash.dumping.exchange(true)) {
    void* frames[kMaxSignalFrames];
    int count = ::backtrace(frames, kMaxSignalFrames);
    // Frame 0 is this handler; the next is the kernel's signal trampoline, then the fault.
    void* const* from = count > 1 ? frames + 1 : frames;
    count = count > 1 ? count - 1 : count;
    write_signal_dump(sig, info, from, count);
    SigBuf b{g_crash.out, sizeof g_crash.out};
    b.str("[");
    b.str(g_crash.name);
    b.str("] fatal signal ");
    b.str(signal_name(sig));
    b.str("; failure dump ");
    b.str(g_crash.path);
    b.str("; backtrace:\n");
    write_all(STDERR_FILENO, b.p, b.n);
    ::backtrace_symbols_fd(from, count, STDERR_FILENO);
  } else {
    // Another thread is writing the dump; it re-raises with the default action and ends the
    // process. A fault inside the handler itself is fatal at once (the signal is blocked).
    for (;;) ::pause();
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
  // Pending until the handler returns (the signal is blocked while it runs); a hardware
  // fault would also recur on return, now with the default action.
  ::raise(sig);
}

[[noreturn]] void on_terminate() noexcept {
  if (!g_crash.dumping.exchange(true)) {
    DumpFields f;
    if (auto ep = std::current_exception()) {
      f = classify(ep, schema::FailureReport::TERMINATE);
      try {
        f.message = "uncaught exception: " + f.message;
      } catch (...) {
      }
    } else {
      f.kind = schema::FailureReport::TERMINATE;
      f.error_kind = schema::ErrorKind::UNKNOWN;
      f.message = "std::terminate called without an active exception";
      f.mono_ns = mono_ns();
    }
    if (f.backtrace.empty()) {
      try {
        void* frames[Error::kMaxBacktraceFrames + 1];
        const int count = ::backtrace(frames, Error::kMaxBacktraceFrames + 1);
        if (count > 1) f.backtrace = symbolize_frames(frames + 1, count - 1);  // minus this one
      } catch (...) {
      }
    }
    log_failure(f);
    try {
      write_failure_dump(g_crash.ctx.load(), g_crash.stage, g_crash.rank, g_crash.path, f);
    } catch (...) {
    }
  }
  // The abort below is this handler's own: its dump is written, so SIGABRT must not replace it.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGABRT, &dfl, nullptr);
  std::abort();
}

}  // namespace

// Prepares every path and text the crash handlers need, then installs them. Called once,
// before any thread exists.
void arm_crash_handlers(schema::StageKind stage, const StageArgs& args) {
  CrashState& c = g_crash;
  c.stage = stage;
  c.rank = args.rank;
  const fs::path path = fs::absolute(layout::failure_path(args.run_dir, stage, args.rank));
  const std::string tmp = fmt::format("{}.tmp.{}", path.string(), ::getpid());
  MEGACPP_CHECK(tmp.size() < sizeof c.tmp, ErrorKind::kInvalidArgument,
                fmt::format("run directory path too long for a failure dump: {}", tmp));
  copy_cstr(c.dir, sizeof c.dir, path.parent_path().string());
  copy_cstr(c.path, sizeof c.path, path.string());
  copy_cstr(c.tmp, sizeof c.tmp, tmp);
  copy_cstr(c.name, sizeof c.name, layout::process_name(stage, args.rank));
  copy_cstr(c.prefix, sizeof c.prefix,
            fmt::format("{{\"schemaVersion\": {}, \"stage\": \"{}\", \"rank\": {}, \"pid\": {}, "
                        "\"kind\": \"signal\", \"message\": \"",
                        schema::SCHEMA_VERSION, json_escape(enumerant_name(stage)), args.rank,
                        ::getpid()));
  for (auto e : capnp::Schema::from<schema::Phase>().getEnumerants()) {
    if (e.getOrdinal() < kMaxPhases) {
      copy_cstr(c.phase_names[e.getOrdinal()], sizeof c.phase_names[0],
                e.getProto().getName().cStr());
    }
  }
  // backtrace() loads libgcc's unwinder on first use (dlopen, malloc): do that now, not in a
  // signal handler.
  void* warm[4];
  ::backtrace(warm, 4);

  stack_t ss{};
  ss.ss_sp = c.alt_stack;
  ss.ss_size = sizeof c.alt_stack;
  SYSCALL_CHECK(::sigaltstack(&ss, nullptr));
  struct sigaction sa {};
  sa.sa_sigaction = on_fatal_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int sig : kFatalSignals) SYSCALL_CHECK(::sigaction(sig, &sa, nullptr));
  std::set_terminate(on_terminate);
}

void publish_context(const StageContext* ctx) noexcept {
  g_crash.ctx.store(ctx);
}

void retract_context(const StageContext* ctx) noexcept {
  const StageContext* self = ctx;
  g_crash.ctx.compare_exchange_strong(self, nullptr);
}

}  // namespace megacpp::stage::detail
