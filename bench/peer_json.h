// A benchmark's Python peer as a child process: runs `python script args...` with
// OMP_NUM_THREADS set, collects its stdout and returns the last line parsed as JSON. Also the
// interpreter a peer runs in by default, and the median its timings are reported by.
//
// run_peer_json's contract: blocks until the peer exits or `deadline_s` passes (then it is killed
// with SIGKILL and the call throws). Throws std::runtime_error when the peer cannot start, exits
// non-zero, or its last line is not JSON. The peer's stderr is inherited (its errors reach the
// console).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace megacpp::bench {

// The repository's .venv interpreter (what `make` sets up, with torch), else python3 on PATH.
inline std::string default_peer_python(const std::filesystem::path& source_root) {
  const std::filesystem::path venv = source_root / ".venv/bin/python";
  return std::filesystem::exists(venv) ? venv.string() : "python3";
}

// The upper median of `v` (0 for none).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

inline nlohmann::json run_peer_json(const std::string& python, const std::string& script,
                                    const std::vector<std::string>& args, int threads,
                                    int deadline_s) {
  using Clock = std::chrono::steady_clock;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  std::fflush(stdout);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    if (::dup2(fds[1], STDOUT_FILENO) < 0) ::_exit(126);
    ::setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);
    std::vector<std::string> all = {python, script};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string text;
  bool killed = false;
  const auto deadline = Clock::now() + std::chrono::seconds(deadline_s);
  for (;;) {
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, 100) > 0) {
      char buf[4096];
      const ssize_t n = ::read(fds[0], buf, sizeof buf);
      if (n <= 0) break;
      text.append(buf, static_cast<size_t>(n));
    }
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      killed = true;
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (killed)
    throw std::runtime_error("the peer ran past its deadline of " + std::to_string(deadline_s) +
                             " s and was killed");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("the peer failed (wait status " + std::to_string(status) + ")");
  while (!text.empty() && text.back() == '\n') text.pop_back();
  const auto nl = text.rfind('\n');
  try {
    return nlohmann::json::parse(nl == std::string::npos ? text : text.substr(nl + 1));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(std::string("the peer's last line is not JSON: ") + e.what());
  }
}

}  // namespace megacpp::bench
