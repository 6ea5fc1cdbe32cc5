// The supervisor's child environment (supervisor/process.h): a trainer's GLIBC_TUNABLES gets
// the malloc tunables added, and a value the user set for one of them is never replaced.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <string>
#include <vector>

#include "supervisor/process.h"

using megacpp::supervisor::detail::environment_with_tunables;

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
