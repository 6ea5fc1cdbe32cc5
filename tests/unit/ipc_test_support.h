// Helpers shared by the ipc unit tests (tests/unit/<module>_test.cpp, one per ipc/ module):
// a forked child that is always reaped, and a fixture whose shm names are unique to the test.
// Header-only; not part of any library.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ipc/shm.h"
#include "tests/unit/test_support.h"

namespace megacpp::ipc::test {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

using megacpp::test_support::TempDir;

// A forked child that is killed and reaped if the test leaves early.
class Child {
 public:
  explicit Child(pid_t pid) : pid_(pid) {}
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  // Exit status of the child (-1 if it did not exit normally).
  int wait() {
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  bool exited() {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      return true;
    }
    return pid_ == -1;
  }
  int exit_code() const { return exit_code_; }

 private:
  pid_t pid_;
  int exit_code_ = -1;
};

// Every test's shm names start with a prefix unique to this process and test; TearDown
// removes whatever a failing test left behind.
class ShmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    prefix_ = fmt::format("/megacpp-test-{}-{}-", ::getpid(), counter++);
  }
  void TearDown() override {
    unlink_shm(prefix_);
    EXPECT_TRUE(list_shm(prefix_).empty());
  }
  std::string prefix_;
};

}  // namespace megacpp::ipc::test
