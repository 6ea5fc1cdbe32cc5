// ipc/staging_stamp.h: the step stamp at the end of a rank's staging region, which the
// checkpointer checks before and after it writes a snapshot.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstring>

#include "ipc/staging_stamp.h"

namespace megacpp::ipc {
namespace {

// The stamp as the checkpointer finds it: the rank's region is zero until the rank clears it.
TEST(StagingStamp, ARegionWithoutAStampNamesNoStep) {
  alignas(8) std::array<std::byte, kStagingStampBytes> region{};
  EXPECT_EQ(read_staging_stamp(region.data()), std::nullopt);
}

// Clear before the copy (step 0: being written), set after it: the seqlock's two states.
TEST(StagingStamp, ClearNamesStepZeroAndSetNamesTheStep) {
  alignas(8) std::array<std::byte, kStagingStampBytes> region{};
  clear_staging_stamp(region.data());
  EXPECT_EQ(read_staging_stamp(region.data()), std::optional<uint32_t>(0));
  set_staging_stamp(region.data(), 7);
  EXPECT_EQ(read_staging_stamp(region.data()), std::optional<uint32_t>(7));
  clear_staging_stamp(region.data());
  EXPECT_EQ(read_staging_stamp(region.data()), std::optional<uint32_t>(0));
}

// The bytes are a contract between two processes (a rank and a checkpointer, possibly of
// different builds): the magic "MMCSTAMP", then the step, little-endian, within the reserved
// tail of the region.
TEST(StagingStamp, TheStampsBytesAreTheMagicThenTheStep) {
  static_assert(sizeof(StagingStamp) <= kStagingStampBytes);
  alignas(8) std::array<std::byte, kStagingStampBytes> region{};
  clear_staging_stamp(region.data());
  set_staging_stamp(region.data(), 0x01020304);
  EXPECT_EQ(std::memcmp(region.data(), "MMCSTAMP", 8), 0);
  const std::array<std::byte, 4> step{std::byte{4}, std::byte{3}, std::byte{2}, std::byte{1}};
  EXPECT_EQ(std::memcmp(region.data() + 8, step.data(), step.size()), 0);
}

// Set by one process in a shared mapping, read by another.
TEST(StagingStamp, AStampSetByAnotherProcessIsRead) {
  void* mapped = ::mmap(nullptr, kStagingStampBytes, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  auto* region = static_cast<std::byte*>(mapped);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    clear_staging_stamp(region);
    set_staging_stamp(region, 42);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(read_staging_stamp(region), std::optional<uint32_t>(42));
  ::munmap(mapped, kStagingStampBytes);
}

}  // namespace
}  // namespace megacpp::ipc
