// The supervisor's child environment (supervisor/process.h): a trainer's GLIBC_TUNABLES gets
// the malloc tunables added, and a value the user set for one of them is never replaced. And
// signal_process: a process the supervisor did not fork is signalled only when it is the one
// that started at the recorded time.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

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
