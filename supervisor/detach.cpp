// `megacpp run --detach` (README.md "Detached runs"); the commands that look after a detached
// run (stop, status --watch, list) are in supervisor/commands/.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "core/error.h"
#include "core/fd.h"
#include "supervisor/process.h"
#include "supervisor/supervisor.h"

namespace megacpp::supervisor {

namespace {

void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // our own terminal went away: nothing left to tell
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

int run_detached(RunOptions options) {
  std::optional<detail::Pipe> out = detail::open_pipe();
  std::optional<detail::Pipe> err = out ? detail::open_pipe() : std::nullopt;
  if (!out || !err) MEGACPP_FAIL(ErrorKind::kSystem, "--detach: pipe: {}", std::strerror(errno));
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) MEGACPP_FAIL(ErrorKind::kSystem, "--detach: fork: {}", std::strerror(errno));
  if (pid == 0) {
    // The supervisor: its own session (no controlling terminal, so no SIGHUP when the
    // terminal closes); its output reaches the launching command until the stage graph is up,
    // then RUN/logs/supervisor.log (JobController::detach_output).
    ::setsid();
    // The launching command may die before the stage graph is up (a closed terminal, an ssh
    // drop): a write to its pipe must fail, not kill the run (JobController::launcher_gone moves
    // the output to the log). Stages get SIGPIPE back at their exec (spawn).
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ign, nullptr);
    Fd devnull(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (devnull.valid()) ::dup2(devnull.get(), STDIN_FILENO);
    ::dup2(out->write.get(), STDOUT_FILENO);
    ::dup2(err->write.get(), STDERR_FILENO);
    // A descriptor that came out as 0, 1 or 2 (the launcher had closed it) is now the
    // supervisor's stdio: kept, not closed.
    for (Fd* fd : {&out->read, &out->write, &err->read, &err->write, &devnull}) {
      if (fd->get() > STDERR_FILENO) {
        fd->reset();
      } else {
        fd->release();
      }
    }
    options.detach = true;
    options.progress = "none";
    int rc = 1;
    try {
      rc = run(std::move(options));
    } catch (const Error& e) {
      std::fflush(stdout);
      fmt::print(stderr, "megacpp: error: {}\n", e.message());
      rc = e.kind() == ErrorKind::kInvalidArgument ? 2 : 1;
    } catch (const std::exception& e) {
      fmt::print(stderr, "megacpp: error: {}\n", e.what());
    }
    std::fflush(stdout);
    std::fflush(stderr);
    ::_exit(rc);
  }
  out->write.reset();
  err->write.reset();
  // Relay the supervisor's output until it says it detached (kDetachedMarker on stdout) or
  // both pipes close; the marker line itself is not shown.
  bool detached = false;
  std::string pending;
  Fd* const reads[2] = {&out->read, &err->read};
  pollfd fds[2] = {{out->read.get(), POLLIN, 0}, {err->read.get(), POLLIN, 0}};
  int open_pipes = 2;
  char buf[4096];
  while (open_pipes > 0) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        reads[i]->reset();
        fds[i].fd = -1;
        --open_pipes;
        continue;
      }
      if (i == 1) {
        write_all(STDERR_FILENO, buf, static_cast<size_t>(n));
        continue;
      }
      pending.append(buf, static_cast<size_t>(n));
      for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
        const std::string line = pending.substr(0, nl + 1);
        pending.erase(0, nl + 1);
        if (line == std::string(kDetachedMarker) + "\n") {
          detached = true;
        } else {
          write_all(STDOUT_FILENO, line.data(), line.size());
        }
      }
    }
  }
  write_all(STDOUT_FILENO, pending.data(), pending.size());
  if (detached) return 0;
  // It ended before the stage graph was up (a refusal, a failed launch): its status is ours.
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

}  // namespace megacpp::supervisor
