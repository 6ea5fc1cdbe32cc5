// Child processes of the supervisor (internal). A Child is a launched stage process; the
// supervisor learns of its exit through SIGCHLD on a signalfd, never by polling.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/fd.h"
#include "schemas/common.capnp.h"

namespace megacpp::supervisor::detail {

// fork + exec of `argv` with stdout and stderr appended to `log`, the signal mask reset,
// and PR_SET_PDEATHSIG(SIGKILL) so the child never outlives the supervisor. `env` ("K=V"
// entries) is the child's whole environment; empty: the supervisor's own.
// `stdin_fd` >= 0 becomes the child's stdin (a spare's go socket), else /dev/null.
// Throws Error{kSystem} if the fork fails; an exec failure shows as exit code 127.
pid_t spawn(const std::vector<std::string>& argv, const std::filesystem::path& log,
            const std::vector<std::string>& env, int stdin_fd = -1);

// The supervisor's environment with each of `tunables` ("glibc.malloc.hugetlb=1", ...) added to
// GLIBC_TUNABLES, except those GLIBC_TUNABLES already sets (the user's value wins).
std::vector<std::string> environment_with_tunables(const std::vector<std::string>& tunables);

// Blocks SIGCHLD, SIGINT, SIGTERM in the calling thread and returns a signalfd for them.
// Children get the original mask back before exec.
Fd block_signals_to_fd();

// Both ends of a pipe, close-on-exec.
struct Pipe {
  Fd read;
  Fd write;
};
// nullopt when pipe2 fails (errno says why).
std::optional<Pipe> open_pipe();

// Runs `argv` (PATH searched) with stdout captured and stdin/stderr on /dev/null, and
// returns its stdout if it exits 0 within `timeout_s`. Bounded: a command still running at
// the deadline is SIGKILLed and given at most one more second to be reaped, then left.
// nullopt on any failure.
std::optional<std::string> capture_output(const std::vector<std::string>& argv, double timeout_s);

std::filesystem::path self_exe_dir();

// Field 22 of /proc/<pid>/stat (start time in clock ticks since boot): with the pid it names
// one process, even after the pid is reused. 0 when the process does not exist.
uint64_t process_start_ticks(pid_t pid);

// Field 3 of /proc/<pid>/stat ('R', 'S', 'T' for stopped, ...); '?' when unreadable.
char process_state(pid_t pid);

// `pid` still names the process that started at `start_ticks` (a reused pid does not) and it
// has not exited: a zombie (state Z or X) is gone too. A detached supervisor is reaped by
// whatever adopted it, which in a container may never happen.
bool process_alive(pid_t pid, uint64_t start_ticks);

enum class SignalResult {
  kSent,     // delivered to the process that started at `start_ticks`
  kGone,     // no such process, or it has exited (a zombie): nothing to signal
  kNotOurs,  // `pid` names another process now (the pid was reused): nothing sent
  kRefused,  // the kernel refused (e.g. EPERM: another user's process); `error` says why
};
struct SignalOutcome {
  SignalResult result;
  int error = 0;  // errno of the refusal (kRefused)
};

// Sends `sig` to the process `pid` names only if it started at `start_ticks`: for a process
// the supervisor did not fork (a detached run's supervisor, found in launch.json), where a bare
// kill() after a start-time check could hit a process that took the pid in between. A pidfd
// pins the process first, the start time is read after, and the signal goes through the pidfd:
// if the pinned process was the recorded one the start times match, and if it exits and its
// pid is reused after the check, the pidfd still names the exited one and the signal fails
// (kGone). Never blocks. Kernels without pidfds (before 5.3) fall back to check-then-kill.
// `after_check` (tests) runs between the start-time check and the send: where a pid can be
// reused under a bare kill().
SignalOutcome signal_process(pid_t pid, uint64_t start_ticks, int sig,
                             const std::function<void()>& after_check = {});
}  // namespace megacpp::supervisor::detail
