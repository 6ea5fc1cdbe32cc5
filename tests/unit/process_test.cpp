// The supervisor's child environment (supervisor/process.h): a trainer's GLIBC_TUNABLES gets
// the malloc tunables added, and a value the user set for one of them is never replaced. And
// signal_process: a process the supervisor did not fork is signalled only when it is the one
// that started at the recorded time.
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>

#include <algorithm>
#include <string>
#include <vector>

#include "supervisor/process.h"

using megacpp::supervisor::detail::environment_with_tunables;
namespace sd = megacpp::supervisor::detail;

namespace {

const std::vector<std::string> kTwo = {"glibc.malloc.hugetlb=1",
                                       "glibc.malloc.mmap_threshold=33554432"};

std::vector<std::string> tunables(const std::vector<std::string>& env) {
  std::vector<std::string> out;
  std::ranges::copy_if(env, std::back_inserter(out),
                       [](const std::string& e) { return e.starts_with("GLIBC_TUNABLES="); });
  return out;
}

TEST(ChildEnvironment, AddsTheTunablesWhenNoneIsSet) {
  ::unsetenv("GLIBC_TUNABLES");
  ::setenv("MEGACPP_PROCESS_TEST_KEEP", "1", 1);
  auto env = environment_with_tunables(kTwo);
  EXPECT_EQ(tunables(env),
            std::vector<std::string>{
                "GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432"});
  EXPECT_NE(std::ranges::find(env, "MEGACPP_PROCESS_TEST_KEEP=1"), env.end());
}

TEST(ChildEnvironment, AppendsToTheUsersOtherTunables) {
  ::setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2", 1);
  EXPECT_EQ(tunables(environment_with_tunables(kTwo)),
            std::vector<std::string>{"GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc."
                                     "hugetlb=1:glibc.malloc.mmap_threshold=33554432"});
}

TEST(ChildEnvironment, TheUsersValueForTheSameTunableWins) {
  ::setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1:glibc.malloc.hugetlb=0", 1);
  EXPECT_EQ(tunables(environment_with_tunables(kTwo)),
            std::vector<std::string>{"GLIBC_TUNABLES=glibc.malloc.trim_threshold=1:glibc.malloc."
                                     "hugetlb=0:glibc.malloc.mmap_threshold=33554432"});
}

TEST(ChildEnvironment, APrefixOfTheNameIsAnotherTunable) {
  ::setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlbx=3", 1);
  EXPECT_EQ(
      tunables(environment_with_tunables({"glibc.malloc.hugetlb=1"})),
      std::vector<std::string>{"GLIBC_TUNABLES=glibc.malloc.hugetlbx=3:glibc.malloc.hugetlb=1"});
}

TEST(ChildEnvironment, AnEmptyValueTakesTheTunablesAlone) {
  ::setenv("GLIBC_TUNABLES", "", 1);
  EXPECT_EQ(tunables(environment_with_tunables({"glibc.malloc.hugetlb=1"})),
            std::vector<std::string>{"GLIBC_TUNABLES=glibc.malloc.hugetlb=1"});
}

}  // namespace

namespace {

// A child that sleeps until signalled; the test reaps it.
pid_t sleeping_child() {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::pause();
    ::_exit(0);
  }
  return pid;
}

}  // namespace

TEST(SignalProcess, SignalsOnlyTheProcessThatStartedAtTheRecordedTime) {
  const pid_t pid = sleeping_child();
  ASSERT_GT(pid, 0);
  const uint64_t ticks = sd::process_start_ticks(pid);
  ASSERT_NE(ticks, 0u);
  // Another start time: the pid is taken as reused and nothing is sent.
  EXPECT_EQ(sd::signal_process(pid, ticks + 1, SIGTERM).result, sd::SignalResult::kNotOurs);
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, WNOHANG), 0) << "the child was signalled";
  // Its own start time: signalled.
  EXPECT_EQ(sd::signal_process(pid, ticks, SIGTERM).result, sd::SignalResult::kSent);
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
  // Reaped: gone, whatever the start time.
  EXPECT_EQ(sd::signal_process(pid, ticks, SIGTERM).result, sd::SignalResult::kGone);
}

TEST(SignalProcess, AZombieIsGone) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ASSERT_GT(pid, 0);
  const uint64_t ticks = sd::process_start_ticks(pid);
  while (sd::process_state(pid) != 'Z') ::usleep(1000);
  EXPECT_EQ(sd::signal_process(pid, ticks, SIGTERM).result, sd::SignalResult::kGone);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status)) << status;
}

// The race a pidfd closes: the recorded process exits and its pid is taken by another between
// the start-time check and the signal. Made deterministic in a pid namespace of its own (pids
// there are 1, 2, ... and ns_last_pid hands the dead one's pid to the next fork): the signal
// must not reach the newcomer. Check-then-kill() sent it there.
TEST(SignalProcess, APidReusedAfterTheCheckIsNotSignalled) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root for a pid and mount namespace";
  const pid_t outer = ::fork();
  ASSERT_GE(outer, 0);
  if (outer == 0) {
    // Exit codes: 0 ok, 10 + n a failed expectation, 90+ a set-up step (then skipped).
    if (::unshare(CLONE_NEWPID | CLONE_NEWNS) != 0) ::_exit(90);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) ::_exit(91);
    const pid_t init = ::fork();  // pid 1 of the new namespace
    if (init < 0) ::_exit(92);
    if (init > 0) {
      int st = 0;
      ::waitpid(init, &st, 0);
      ::_exit(WIFEXITED(st) ? WEXITSTATUS(st) : 99);
    }
    if (::mount("proc", "/proc", "proc", 0, nullptr) != 0) ::_exit(93);
    const pid_t first = sleeping_child();
    const uint64_t ticks = sd::process_start_ticks(first);
    if (first <= 0 || ticks == 0) ::_exit(94);
    pid_t newcomer = -1;
    const auto outcome = sd::signal_process(first, ticks, SIGTERM, [&] {
      ::kill(first, SIGKILL);
      ::waitpid(first, nullptr, 0);
      std::ofstream("/proc/sys/kernel/ns_last_pid") << first - 1;
      newcomer = sleeping_child();
    });
    if (newcomer != first) ::_exit(95);  // the pid was not reused: nothing was tested
    int st = 0;
    const bool untouched = ::waitpid(newcomer, &st, WNOHANG) == 0;
    ::kill(newcomer, SIGKILL);
    ::waitpid(newcomer, nullptr, 0);
    if (!untouched) ::_exit(11);
    ::_exit(outcome.result == sd::SignalResult::kGone ? 0 : 12);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(outer, &status, 0), outer);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  const int code = WEXITSTATUS(status);
  if (code >= 90)
    GTEST_SKIP() << "could not set up a pid namespace with a reused pid (step " << code << ")";
  EXPECT_NE(code, 11) << "the process that took the pid after the check was signalled";
  EXPECT_NE(code, 12) << "the signal to the exited process was not reported as gone";
  EXPECT_EQ(code, 0);
}

namespace {

// The descriptors of a spawned `ls`, as it lists them: its standard three and the one it
// reads /proc/self/fd through (3).
std::string descriptors_of_a_spawned_ls() {
  char tmpl[] = "/tmp/megacpp-spawn-fds-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return "mkdtemp failed";
  const std::string log = std::string(tmpl) + "/log";
  const pid_t pid = sd::spawn({"/bin/ls", "-1", "/proc/self/fd"}, log, {});
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream in(log);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove_all(tmpl);
  return text;
}

}  // namespace

TEST(Spawn, AStageInheritsOnlyItsStandardDescriptors) {
  // stdin is /dev/null, stdout and stderr the log; nothing else crosses exec (a descriptor
  // left open in every stage would keep what it names alive as long as the stage).
  EXPECT_EQ(descriptors_of_a_spawned_ls(), "0\n1\n2\n3\n");
}

TEST(CaptureOutput, TheCommandInheritsOnlyItsStandardDescriptors) {
  const auto out = sd::capture_output({"ls", "-1", "/proc/self/fd"}, 10);
  ASSERT_TRUE(out);
  EXPECT_EQ(*out, "0\n1\n2\n3\n");
}
