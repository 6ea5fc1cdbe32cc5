// ipc/slot_ring.h: the batch ring in shared memory, its producer in a forked process.
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
#include "ipc/slot_ring.h"
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
// Slot ring

using RingTest = ShmTest;

TEST_F(RingTest, FormatValidatesGeometry) {
  EXPECT_GE(SlotRing::region_bytes(4, 100), 256u + 4 * 128);
  EXPECT_THROW(SlotRing::region_bytes(0, 100), Error);
  // Sizes are 64-bit: a slot one byte over the 32-bit limit is refused, not truncated to 1.
  EXPECT_THROW(SlotRing::region_bytes(4, SlotRing::kMaxSlotBytes + 2), Error);
  EXPECT_GT(SlotRing::region_bytes(2, SlotRing::kMaxSlotBytes), 2 * SlotRing::kMaxSlotBytes);
  ShmRegion small(ShmRegion::Create{}, prefix_ + "small", 512);
  EXPECT_THROW(SlotRing::format(small, 16, 1024), Error);
  try {
    SlotRing unformatted(small);
    FAIL() << "accepted an unformatted region";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kCorruption);
  }

  ShmRegion region(ShmRegion::Create{}, prefix_ + "ring", SlotRing::region_bytes(4, 100));
  SlotRing::format(region, 4, 100);
  SlotRing ring(region);
  EXPECT_EQ(ring.slots(), 4u);
  EXPECT_EQ(ring.slot_bytes(), 100u);
  EXPECT_EQ(ring.depth(), 0u);
  // Corrupting the geometry is detected by the next attacher.
  reinterpret_cast<uint32_t*>(region.data())[3] = 7;  // slots
  EXPECT_THROW(SlotRing again(region), Error);
}

TEST_F(RingTest, FullAndEmptyAreReturnValues) {
  ShmRegion region(ShmRegion::Create{}, prefix_ + "ring", SlotRing::region_bytes(4, 100));
  SlotRing::format(region, 4, 100);
  SlotRing ring(region);

  EXPECT_FALSE(ring.try_peek().has_value());
  EXPECT_FALSE(ring.peek(Millis(20)).has_value());
  EXPECT_THROW(ring.release(), Error);

  for (uint32_t i = 0; i < 4; ++i) {
    auto slot = ring.try_acquire();
    ASSERT_TRUE(slot.has_value());
    EXPECT_EQ(slot->size(), 100u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(slot->data()) % 64, 0u) << "payload not 64-byte aligned";
    (*slot)[0] = std::byte(i);
    ring.publish(1, 100 + i);
  }
  EXPECT_EQ(ring.depth(), 4u);
  EXPECT_FALSE(ring.try_acquire().has_value());
  EXPECT_FALSE(ring.acquire(Millis(20)).has_value());
  EXPECT_THROW(ring.publish(1, 0), Error);

  auto head = ring.try_peek();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->seq, 0u);
  EXPECT_EQ(head->tag, 100u);
  EXPECT_EQ(head->data.size(), 1u);
  ring.release();
  ASSERT_TRUE(ring.try_acquire().has_value());
  EXPECT_THROW(ring.publish(101, 0), Error);  // larger than a slot
  ring.publish(100, 7);
  EXPECT_EQ(ring.produced(), 5u);
  EXPECT_EQ(ring.consumed(), 1u);
}

TEST_F(RingTest, ProducerInChildProcessConsumerInParent) {
  constexpr uint32_t kSlots = 8;
  constexpr uint32_t kSlotBytes = 200;
  constexpr uint64_t kItems = 20000;  // wraps the ring 2500 times
  const std::string name = prefix_ + "ring-0";
  ShmRegion region(ShmRegion::Create{}, name, SlotRing::region_bytes(kSlots, kSlotBytes));
  SlotRing::format(region, kSlots, kSlotBytes);

  auto bytes_for = [](uint64_t i) { return static_cast<uint32_t>(8 + i % (kSlotBytes - 7)); };
  auto byte_at = [](uint64_t i, uint32_t k) { return std::byte((i * 31 + k) & 0xff); };

  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 0;
    try {
      ShmRegion attached(ShmRegion::Attach{}, name);
      SlotRing ring(attached);
      for (uint64_t i = 0; i < kItems && code == 0; ++i) {
        auto slot = ring.acquire(Millis(10000));
        if (!slot) {
          code = 2;
          break;
        }
        uint32_t bytes = bytes_for(i);
        std::memcpy(slot->data(), &i, sizeof i);
        for (uint32_t k = 8; k < bytes; ++k) (*slot)[k] = byte_at(i, k);
        ring.publish(bytes, i * 3 + 1);
      }
    } catch (...) {
      code = 3;
    }
    ::_exit(code);
  }
  Child child(pid);

  SlotRing ring(region);
  for (uint64_t i = 0; i < kItems; ++i) {
    auto slot = ring.peek(Millis(10000));
    ASSERT_TRUE(slot.has_value()) << "producer stalled at item " << i;
    ASSERT_EQ(slot->seq, i);
    ASSERT_EQ(slot->tag, i * 3 + 1);
    ASSERT_EQ(slot->data.size(), bytes_for(i));
    uint64_t seq;
    std::memcpy(&seq, slot->data.data(), sizeof seq);
    ASSERT_EQ(seq, i);
    bool same = true;
    for (uint32_t k = 8; k < slot->data.size(); ++k) same = same && slot->data[k] == byte_at(i, k);
    ASSERT_TRUE(same) << "payload of item " << i << " differs";
    ring.release();
  }
  EXPECT_EQ(child.wait(), 0);
  EXPECT_EQ(ring.produced(), kItems);
  EXPECT_EQ(ring.consumed(), kItems);
  EXPECT_FALSE(ring.peek(Millis(10)).has_value());
}

}  // namespace
}  // namespace megacpp::ipc
