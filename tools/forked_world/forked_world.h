// megacpp forked world — a process that runs its own W ranks: it hosts the c10d TCPStore they
// rendezvous through, forks them, and reaps them within a bound. Shared by the unit tests
// (tests/unit/test_support.h, optim_test, trainer_test), the optimizer stress harness
// (tools/stress_optimizer) and the optimizer benchmark (bench/optimizer.cpp).
//
// Contract: this header is torch-free (the store is behind ForkedWorld's pimpl, built in
// megacpp::forked_world), so torch-free tests can include it for fork_rank() and reap().
// fork_rank() returns at once in the parent; the child runs its body and _exits with the body's
// return value (no destructors, no atexit: the parent's objects, e.g. the store server, live in
// the child's image too). reap() blocks until every child was waited for, never longer than the
// deadline (or the grace after a first failure) plus the time to SIGKILL and wait the rest: a
// hung child cannot hang its parent. fork_rank() and reap() never throw; failures are reported in
// ReapResult and through the callbacks, which run on the calling thread. One thread drives a
// ForkedWorld.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <system_error>
#include <thread>
#include <vector>

namespace c10d {
class Store;
}

namespace megacpp::forked_world {

using Clock = std::chrono::steady_clock;

// The exit status of a child whose body threw instead of returning.
inline constexpr int kBodyThrew = 125;

// Forks a child that runs `body` and _exits with its return value (kBodyThrew, the exception
// printed to stderr, when it throws). Pending stdio output is flushed before the fork, so the
// child does not write the parent's buffered output again, and in the child before it exits.
// Returns the child's pid in the parent, or -1 (errno set) when fork fails.
inline pid_t fork_rank(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  int rc = kBodyThrew;
  try {
    rc = body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forked rank %d: uncaught exception: %s\n", static_cast<int>(::getpid()),
                 e.what());
  } catch (...) {
    std::fprintf(stderr, "forked rank %d: uncaught exception\n", static_cast<int>(::getpid()));
  }
  std::fflush(nullptr);
  ::_exit(rc);
}

struct ReapOptions {
  // Children still running past this point are SIGKILLed.
  Clock::time_point deadline = {};
  // Once a child exits other than with status 0, the others get this long (then are
  // SIGKILLed); zero kills them at once. Unset: only the deadline bounds them.
  std::optional<Clock::duration> grace_after_failure = {};
  // Runs at the start of every pass (it must not block for long); when set, the passes do
  // not sleep in between.
  std::function<void()> poll_once = {};
  // Called for the first child that exits other than with status 0, with its wait status.
  std::function<void(size_t index, int status)> on_first_failure = {};
  // Called for each child SIGKILLed, `at_deadline` telling the deadline from the grace.
  std::function<void(size_t index, bool at_deadline)> on_kill = {};
};

struct ReapResult {
  std::vector<int> status;   // wait status of each child, in the order of the pids
  std::vector<bool> killed;  // SIGKILLed by reap()
  bool any_killed() const {
    for (bool k : killed)
      if (k) return true;
    return false;
  }
};

// Waits for every child in `pids`, bounded as ReapOptions says.
inline ReapResult reap(std::span<const pid_t> pids, const ReapOptions& options) {
  ReapResult out{std::vector<int>(pids.size(), -1), std::vector<bool>(pids.size(), false)};
  std::optional<Clock::time_point> first_failure;
  for (size_t done = 0; done < pids.size();) {
    if (options.poll_once) options.poll_once();
    for (size_t r = 0; r < pids.size(); ++r) {
      int st = 0;
      if (out.status[r] != -1 || ::waitpid(pids[r], &st, WNOHANG) != pids[r]) continue;
      out.status[r] = st;
      ++done;
      if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0) && !first_failure) {
        first_failure = Clock::now();
        if (options.on_first_failure) options.on_first_failure(r, st);
      }
    }
    const auto now = Clock::now();
    const bool late = now > options.deadline;
    const bool graced_out = first_failure && options.grace_after_failure &&
                            now >= *first_failure + *options.grace_after_failure;
    if (done < pids.size() && (late || graced_out)) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (out.status[r] != -1) continue;
        ::kill(pids[r], SIGKILL);
        ::waitpid(pids[r], &out.status[r], 0);
        out.killed[r] = true;
        ++done;
        if (options.on_kill) options.on_kill(r, late);
      }
    }
    if (!options.poll_once) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return out;
}

// W ranks of this process and the c10d TCPStore they rendezvous through: a server on
// 127.0.0.1 at a port the kernel picks, in a process of its own forked by the constructor (so
// the ranks are forked from a process without the server's thread), for as long as the
// ForkedWorld lives; store() is this process's client of it.
// run() may be called any number of times; each forks a fresh set of ranks.
class ForkedWorld {
 public:
  // Starts the store's process; `store_timeout` bounds every store operation. Throws
  // std::system_error when it cannot listen or fork, c10::Error (c10d's) when its client
  // cannot connect.
  ForkedWorld(uint32_t size, std::chrono::milliseconds store_timeout);
  ~ForkedWorld();
  ForkedWorld(const ForkedWorld&) = delete;
  ForkedWorld& operator=(const ForkedWorld&) = delete;

  uint32_t size() const noexcept { return size_; }
  // The store's port, for the ranks' clients (trainer::GlooOptions::store_port).
  uint16_t store_port() const;
  // This process's handle on the store (e.g. to read what the ranks left there).
  c10d::Store& store() const;

  // Forks size() ranks, rank r running body(r) (fork_rank), and reaps them as `options`
  // bounds. When a fork fails, the ranks already forked are SIGKILLed and reaped, and
  // std::system_error is thrown.
  ReapResult run(const std::function<int(uint32_t rank)>& body, const ReapOptions& options) const {
    std::vector<pid_t> pids;
    for (uint32_t r = 0; r < size_; ++r) {
      const pid_t pid = fork_rank([&] { return body(r); });
      if (pid < 0) {
        const int err = errno;
        for (const pid_t p : pids) {
          ::kill(p, SIGKILL);
          ::waitpid(p, nullptr, 0);
        }
        throw std::system_error(err, std::generic_category(), "fork of a rank");
      }
      pids.push_back(pid);
    }
    return reap(pids, options);
  }

 private:
  struct Impl;
  uint32_t size_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megacpp::forked_world
