// megacpp::ipc slot ring: single producer, single consumer, fixed-size slots, in a ShmRegion.
//
// Lifetime: a SlotRing is a view over a ShmRegion the caller owns and keeps alive; it owns
// nothing itself. Neither copyable nor movable.
// Blocking: try_* never wait; acquire/peek spin briefly, then sleep in short steps, and
// return nullopt when their timeout expires (ring full / empty is a return value).
// Failure: a bad geometry throws Error{kInvalidArgument}, a header that does not match
// (magic, version, geometry) throws Error{kCorruption}.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "ipc/millis.h"
#include "ipc/shm.h"

namespace megacpp::ipc {

// Layout: a 256-byte header (magic, version, geometry, producer and consumer counters on
// separate cache lines) followed by `slots` slots of `slot_bytes` payload each, every
// payload 64-byte aligned. Producer and consumer may live in different processes; the
// counters are lock-free 64-bit atomics (acquire/release). Waiting is a bounded spin then
// short sleeps; every wait takes a timeout and returns nullopt when it expires.
class SlotRing {
 public:
  // The header stores a slot's size in 32 bits.
  static constexpr uint64_t kMaxSlotBytes = UINT32_MAX;
  // Throws Error{kInvalidArgument} for an empty geometry or slot_bytes > kMaxSlotBytes.
  static size_t region_bytes(uint32_t slots, uint64_t slot_bytes);
  // Writes a fresh header into `region` (creator side). Throws if the region is too small.
  static void format(ShmRegion& region, uint32_t slots, uint64_t slot_bytes);
  // Validates magic/version/geometry; throws Error{kCorruption} on mismatch.
  explicit SlotRing(ShmRegion& region);
  SlotRing(const SlotRing&) = delete;
  SlotRing& operator=(const SlotRing&) = delete;

  uint32_t slots() const noexcept;
  uint32_t slot_bytes() const noexcept;
  uint64_t produced() const noexcept;  // slots published so far
  uint64_t consumed() const noexcept;  // slots released so far
  uint32_t depth() const noexcept { return static_cast<uint32_t>(produced() - consumed()); }

  // Producer. acquire returns the next free slot's payload, or nullopt (ring full until
  // timeout). publish makes it visible with `bytes` used and a caller-defined `tag`.
  std::optional<std::span<std::byte>> try_acquire();
  std::optional<std::span<std::byte>> acquire(Millis timeout);
  void publish(uint32_t bytes, uint64_t tag);

  // Consumer. peek returns the oldest published slot without freeing it (its memory stays
  // valid and unchanged until release()); nullopt when empty until timeout.
  struct Slot {
    std::span<std::byte> data;  // `bytes` long as published
    uint64_t tag;
    uint64_t seq;  // 0-based publication index
  };
  std::optional<Slot> try_peek();
  std::optional<Slot> peek(Millis timeout);
  void release();

 private:
  struct Header;
  Header* header_;
  std::byte* slots_base_;
};

}  // namespace megacpp::ipc
