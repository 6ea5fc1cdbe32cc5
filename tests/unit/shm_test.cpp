// ipc/shm.h: POSIX shared memory segments, shared with a forked process.
// Against the real thing; timings are never asserted, every wait is bounded.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "ipc/shm.h"
#include "tests/unit/ipc_test_support.h"
#include "tests/unit/test_support.h"

namespace megacpp::ipc {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using megacpp::test_support::TempDir;
using test::Child;
using test::ShmTest;

// ---------------------------------------------------------------------------------------
// Shared memory

TEST_F(ShmTest, CreateAttachAndUnlinkOnOwnerExit) {
  const std::string name = prefix_ + "a";
  {
    ShmRegion created(ShmRegion::Create{}, name, 8192);
    EXPECT_TRUE(created.owner());
    EXPECT_EQ(created.size(), 8192u);
    EXPECT_EQ(created.name(), name);
    for (size_t i = 0; i < created.size(); ++i) ASSERT_EQ(created.data()[i], std::byte{0});
    std::memcpy(created.data(), "hello", 5);

    ShmRegion attached(ShmRegion::Attach{}, name);
    EXPECT_FALSE(attached.owner());
    EXPECT_EQ(attached.size(), 8192u);
    EXPECT_EQ(std::memcmp(attached.data(), "hello", 5), 0);
    attached.data()[100] = std::byte{42};
    EXPECT_EQ(created.data()[100], std::byte{42});
    EXPECT_EQ(list_shm(prefix_), std::vector<std::string>{name});
  }
  EXPECT_TRUE(list_shm(prefix_).empty());
  try {
    ShmRegion gone(ShmRegion::Attach{}, name);
    FAIL() << "attached a removed segment";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kSystem);
  }
}

TEST_F(ShmTest, StaleSegmentIsReplaced) {
  const std::string name = prefix_ + "stale";
  ShmRegion first(ShmRegion::Create{}, name, 4096);
  std::memset(first.data(), 0xab, first.size());
  ShmRegion second(ShmRegion::Create{}, name, 8192);
  EXPECT_EQ(second.size(), 8192u);
  EXPECT_EQ(second.data()[0], std::byte{0});
  ShmRegion attached(ShmRegion::Attach{}, name);
  EXPECT_EQ(attached.size(), 8192u);
}

TEST_F(ShmTest, InvalidNamesAreRejected) {
  EXPECT_THROW(ShmRegion(ShmRegion::Create{}, "no-slash", 64), Error);
  EXPECT_THROW(ShmRegion(ShmRegion::Create{}, prefix_ + "a/b", 64), Error);
  EXPECT_THROW(ShmRegion(ShmRegion::Create{}, prefix_ + "empty", 0), Error);
}

TEST_F(ShmTest, ListAndUnlinkByPrefix) {
  auto a = std::make_unique<ShmRegion>(ShmRegion::Create{}, prefix_ + "ring-0", 4096);
  auto b = std::make_unique<ShmRegion>(ShmRegion::Create{}, prefix_ + "ring-1", 4096);
  auto c = std::make_unique<ShmRegion>(ShmRegion::Create{}, prefix_ + "stage-0", 4096);
  EXPECT_EQ(list_shm(prefix_), (std::vector<std::string>{prefix_ + "ring-0", prefix_ + "ring-1",
                                                         prefix_ + "stage-0"}));
  EXPECT_EQ(list_shm(prefix_ + "ring-").size(), 2u);
  EXPECT_EQ(unlink_shm(prefix_ + "ring-"), 2u);
  EXPECT_EQ(list_shm(prefix_), std::vector<std::string>{prefix_ + "stage-0"});
  // Mappings outlive the name; the owners' later unlink of a removed name is harmless.
  std::memset(a->data(), 1, a->size());
  a.reset();
  b.reset();
  EXPECT_EQ(unlink_shm(prefix_), 1u);
  c.reset();
  EXPECT_TRUE(list_shm(prefix_).empty());
  EXPECT_EQ(unlink_shm(prefix_), 0u);
}

}  // namespace
}  // namespace megacpp::ipc
