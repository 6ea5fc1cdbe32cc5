#include "supervisor/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/error.h"
#include "core/util.h"

#include <algorithm>
#include <cerrno>
#include <optional>
#include <sstream>

#include <fmt/format.h>

namespace megacpp::supervisor::detail {

// In a forked child before exec: closes every descriptor above stderr, so a process started
// here holds only its standard three — not the supervisor's sockets, signalfd or log files,
// nor what the supervisor itself inherited without close-on-exec (a descriptor a stage held
// would keep what it names open as long as the stage lives). Async-signal-safe: one system
// call, or a loop of close() where the kernel lacks close_range (before Linux 5.9).
namespace {
void close_inherited() {
  if (::syscall(SYS_close_range, 3U, ~0U, 0U) == 0) return;
  const long max = ::sysconf(_SC_OPEN_MAX);
  for (long fd = 3; fd < (max > 0 ? max : 1024); ++fd) ::close(static_cast<int>(fd));
}
}  // namespace

pid_t spawn(const std::vector<std::string>& argv, const std::filesystem::path& log,
            const std::vector<std::string>& env, int stdin_fd) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // Built before the fork: the child may only make async-signal-safe calls.
  std::vector<char*> envp;
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const Fd log_fd(SYSCALL_CHECK(
      ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0644)));
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) SYSCALL_FAIL("fork", errno);
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec (no destructor runs: exec or _exit).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(126);
    ::dup2(log_fd.get(), STDOUT_FILENO);
    ::dup2(log_fd.get(), STDERR_FILENO);
    if (stdin_fd >= 0) {
      ::dup2(stdin_fd, STDIN_FILENO);
    } else {
      int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
    }
    close_inherited();
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    // An ignored signal stays ignored across exec: a detached supervisor ignores SIGPIPE.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    ::sigaction(SIGPIPE, &dfl, nullptr);
    ::setpgid(0, 0);
    if (env.empty()) {
      ::execv(args[0], args.data());
    } else {
      ::execve(args[0], args.data(), envp.data());
    }
    ::_exit(127);
  }
  return pid;
}

std::vector<std::string> environment_with_tunables(const std::vector<std::string>& tunables) {
  auto name_of = [](const std::string& item) { return item.substr(0, item.find('=')); };
  std::vector<std::string> env;
  size_t at_entry = SIZE_MAX;
  for (char** e = environ; *e != nullptr; ++e) {
    env.emplace_back(*e);
    if (env.back().starts_with("GLIBC_TUNABLES=")) at_entry = env.size() - 1;
  }
  if (at_entry == SIZE_MAX) {
    env.emplace_back("GLIBC_TUNABLES=");
    at_entry = env.size() - 1;
  }
  std::string* entry = &env[at_entry];  // env does not grow from here on
  // Tunables are name=value pairs joined by ':'.
  const std::string value = entry->substr(sizeof("GLIBC_TUNABLES=") - 1);
  std::vector<std::string> named;
  for (size_t at = 0; at < value.size();) {
    const size_t end = std::min(value.find(':', at), value.size());
    named.push_back(name_of(value.substr(at, end - at)));
    at = end + 1;
  }
  for (const auto& t : tunables) {
    if (std::ranges::find(named, name_of(t)) != named.end()) continue;
    *entry += (entry->back() == '=' ? "" : ":") + t;
  }
  return env;
}

Fd block_signals_to_fd() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  SYSCALL_CHECK(::sigprocmask(SIG_BLOCK, &set, nullptr));
  return Fd(SYSCALL_CHECK(::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC)));
}

std::optional<Pipe> open_pipe() {
  int ends[2];
  if (::pipe2(ends, O_CLOEXEC) != 0) return std::nullopt;
  return Pipe{Fd(ends[0]), Fd(ends[1])};
}

std::optional<std::string> capture_output(const std::vector<std::string>& argv, double timeout_s) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::optional<Pipe> out = open_pipe();
  if (!out) return std::nullopt;
  const pid_t pid = ::fork();
  if (pid < 0) return std::nullopt;
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec (no destructor runs: exec or _exit).
    ::dup2(out->write.get(), STDOUT_FILENO);
    int devnull = ::open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      ::dup2(devnull, STDIN_FILENO);
      ::dup2(devnull, STDERR_FILENO);
    }
    close_inherited();
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  out->write.reset();
  const int64_t deadline = mono_ns() + static_cast<int64_t>(timeout_s * 1e9);
  std::string text;
  for (;;) {
    const int64_t left_ms = (deadline - mono_ns()) / 1'000'000;
    if (left_ms <= 0) break;
    pollfd p{out->read.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left_ms)) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(out->read.get(), buf, sizeof buf);
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  out->read.reset();  // a command still writing now gets SIGPIPE, not a full pipe
  int status = 0;
  auto reaped_by = [&](int64_t until) {
    for (;;) {
      if (::waitpid(pid, &status, WNOHANG) != 0) return true;
      if (mono_ns() >= until) return false;
      ::usleep(5'000);
    }
  };
  if (!reaped_by(deadline)) {
    ::kill(pid, SIGKILL);
    reaped_by(mono_ns() + 1'000'000'000);
    return std::nullopt;
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  return text;
}

std::filesystem::path self_exe_dir() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path();
}

namespace {
// The fields of /proc/<pid>/stat after the command name (field 2, parenthesised, may hold
// spaces, so the split is at its last ')'): field 3 comes first. Empty when unreadable.
std::string stat_after_comm(pid_t pid) {
  std::string stat;
  try {
    stat = read_file(fmt::format("/proc/{}/stat", pid));
  } catch (const Error&) {
    return {};
  }
  auto close = stat.rfind(')');
  return close == std::string::npos || close + 2 >= stat.size() ? std::string()
                                                                : stat.substr(close + 2);
}
}  // namespace

uint64_t process_start_ticks(pid_t pid) {
  std::istringstream in(stat_after_comm(pid));
  std::string field;
  for (int i = 3; i <= 22 && (in >> field); ++i) {
    if (i == 22) return std::stoull(field);
  }
  return 0;
}

char process_state(pid_t pid) {
  std::string rest = stat_after_comm(pid);
  return rest.empty() ? '?' : rest[0];
}

bool process_alive(pid_t pid, uint64_t start_ticks) {
  if (pid <= 0 || process_start_ticks(pid) != start_ticks) return false;
  const char state = process_state(pid);
  return state != 'Z' && state != 'X';
}

SignalOutcome signal_process(pid_t pid, uint64_t start_ticks, int sig,
                             const std::function<void()>& after_check) {
  if (pid <= 0) return {SignalResult::kGone};
  // The start time read after the pidfd pins a process: a match means the fd holds the
  // recorded process (or one that has exited since, which the send then reports as ESRCH).
  auto checked = [&]() -> std::optional<SignalOutcome> {
    const uint64_t ticks = process_start_ticks(pid);
    if (ticks == 0) return SignalOutcome{SignalResult::kGone};
    if (ticks != start_ticks) return SignalOutcome{SignalResult::kNotOurs};
    const char state = process_state(pid);
    if (state == 'Z' || state == 'X' || state == '?') return SignalOutcome{SignalResult::kGone};
    return std::nullopt;
  };
  auto sent = [](long rc) -> SignalOutcome {
    if (rc == 0) return {SignalResult::kSent};
    if (errno == ESRCH) return {SignalResult::kGone};
    return {SignalResult::kRefused, errno};
  };
  const int raw = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (raw < 0 && errno == ESRCH) return {SignalResult::kGone};
  if (raw < 0 && errno != ENOSYS) return {SignalResult::kRefused, errno};
  if (raw < 0) {
    if (auto refused = checked()) return *refused;
    if (after_check) after_check();
    return sent(::kill(pid, sig));
  }
  const Fd pidfd(raw);
  if (auto refused = checked()) return *refused;
  if (after_check) after_check();
  return sent(::syscall(SYS_pidfd_send_signal, pidfd.get(), sig, nullptr, 0));
}
}  // namespace megacpp::supervisor::detail
