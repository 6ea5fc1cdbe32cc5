#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"
#include "ipc/detail/internal.h"
#include "ipc/slot_ring.h"

namespace megacpp::ipc {

namespace {

constexpr uint64_t kRingMagic = 0x31474e49'52434d4dULL;  // "MMCRING1" little-endian
constexpr uint32_t kRingVersion = 1;
constexpr size_t kHeaderBytes = 256;
constexpr size_t kAlign = 64;

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the ring counters are shared across processes and must be lock-free");

// Per-slot metadata, written by the producer before the release-store of `produced` and
// read by the consumer after its acquire-load.
struct SlotMeta {
  uint32_t bytes;
  uint32_t reserved;
  uint64_t tag;
};
static_assert(sizeof(SlotMeta) == 16);

constexpr uint64_t round_up(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

struct Geometry {
  uint64_t stride;          // bytes between payloads
  uint64_t meta_offset;     // SlotMeta[slots]
  uint64_t payload_offset;  // first payload, 64-byte aligned
  uint64_t total;           // region bytes needed
};

Geometry geometry(uint32_t slots, uint64_t slot_bytes) {
  MEGACPP_CHECK(slots > 0 && slot_bytes > 0, ErrorKind::kInvalidArgument,
                fmt::format("ring geometry {}x{} must be non-empty", slots, slot_bytes));
  MEGACPP_CHECK(slot_bytes <= SlotRing::kMaxSlotBytes, ErrorKind::kInvalidArgument,
                fmt::format("ring slots of {} bytes exceed the {}-byte limit", slot_bytes,
                            SlotRing::kMaxSlotBytes));
  Geometry g{};
  g.stride = round_up(slot_bytes, kAlign);
  g.meta_offset = kHeaderBytes;
  g.payload_offset = round_up(g.meta_offset + uint64_t{slots} * sizeof(SlotMeta), kAlign);
  uint64_t payload = 0;
  bool overflow = __builtin_mul_overflow(g.stride, uint64_t{slots}, &payload) ||
                  __builtin_add_overflow(payload, g.payload_offset, &g.total);
  MEGACPP_CHECK(!overflow, ErrorKind::kInvalidArgument,
                fmt::format("ring geometry {}x{} overflows", slots, slot_bytes));
  return g;
}

// Spin briefly (the peer is usually mid-operation), then sleep 20us doubling to 50us: an idle
// wait costs a few percent of a core, and a consumer waiting on its producer holds the slot
// within ~50us of publication (the batch plane's handoff bound; bench_data_loader measures it;
// the waiting process should lower its timer slack, or Linux adds 50us to every nap). Returns
// the last attempt's result once `timeout` expires.
template <typename F>
auto wait_for(F&& attempt, Millis timeout) -> decltype(attempt()) {
  if (auto r = attempt()) return r;
  if (timeout <= Millis::zero()) return std::nullopt;
  auto deadline = detail::Clock::now() + timeout;
  for (int i = 0; i < 100; ++i) {
    detail::cpu_relax();
    if (auto r = attempt()) return r;
  }
  auto nap = std::chrono::microseconds(20);
  for (;;) {
    auto now = detail::Clock::now();
    if (now >= deadline) return attempt();
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
    std::this_thread::sleep_for(std::min(nap, left + std::chrono::microseconds(1)));
    if (auto r = attempt()) return r;
    nap = std::min(nap * 2, std::chrono::microseconds(50));
  }
}

}  // namespace

// Shared-memory header. Geometry is written once by format() and read-only afterwards; each
// counter has its own cache line so producer and consumer do not false-share.
struct SlotRing::Header {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint32_t slot_bytes;
  uint32_t reserved0;
  uint64_t stride;
  uint64_t meta_offset;
  uint64_t payload_offset;
  uint64_t total_bytes;
  alignas(64) std::atomic<uint64_t> produced;  // written by the producer only
  alignas(64) std::atomic<uint64_t> consumed;  // written by the consumer only
  alignas(64) uint8_t reserved1[64];
};
size_t SlotRing::region_bytes(uint32_t slots, uint64_t slot_bytes) {
  static_assert(sizeof(Header) == kHeaderBytes && alignof(Header) == 64);
  return geometry(slots, slot_bytes).total;
}

void SlotRing::format(ShmRegion& region, uint32_t slots, uint64_t slot_bytes) {
  Geometry g = geometry(slots, slot_bytes);
  MEGACPP_CHECK(region.size() >= g.total, ErrorKind::kInvalidArgument,
                fmt::format("shm {} holds {} bytes; a {}x{} ring needs {}", region.name(),
                            region.size(), slots, slot_bytes, g.total));
  auto* h = std::construct_at(reinterpret_cast<Header*>(region.data()));
  h->version = kRingVersion;
  h->slots = slots;
  h->slot_bytes = static_cast<uint32_t>(slot_bytes);  // <= kMaxSlotBytes: checked by geometry()
  h->stride = g.stride;
  h->meta_offset = g.meta_offset;
  h->payload_offset = g.payload_offset;
  h->total_bytes = g.total;
  h->produced.store(0, std::memory_order_relaxed);
  h->consumed.store(0, std::memory_order_relaxed);
  // The magic goes last (release) so an attacher that sees it also sees the geometry.
  std::atomic_ref<uint64_t>(h->magic).store(kRingMagic, std::memory_order_release);
}

SlotRing::SlotRing(ShmRegion& region) {
  MEGACPP_CHECK(region.size() >= kHeaderBytes, ErrorKind::kCorruption,
                fmt::format("shm {} is too small for a ring header", region.name()));
  header_ = std::launder(reinterpret_cast<Header*>(region.data()));
  uint64_t magic = std::atomic_ref<uint64_t>(header_->magic).load(std::memory_order_acquire);
  MEGACPP_CHECK(magic == kRingMagic, ErrorKind::kCorruption,
                fmt::format("shm {} is not a slot ring (bad magic)", region.name()));
  MEGACPP_CHECK(header_->version == kRingVersion, ErrorKind::kCorruption,
                fmt::format("shm {}: ring version {} (expected {})", region.name(),
                            header_->version, kRingVersion));
  bool valid_geometry = header_->slots > 0 && header_->slot_bytes > 0;
  if (valid_geometry) {
    Geometry g = geometry(header_->slots, header_->slot_bytes);
    valid_geometry = g.stride == header_->stride && g.meta_offset == header_->meta_offset &&
                     g.payload_offset == header_->payload_offset &&
                     g.total == header_->total_bytes && g.total <= region.size();
  }
  MEGACPP_CHECK(valid_geometry, ErrorKind::kCorruption,
                fmt::format("shm {}: ring geometry does not match the region", region.name()));
  uint64_t p = header_->produced.load(std::memory_order_acquire);
  uint64_t c = header_->consumed.load(std::memory_order_acquire);
  MEGACPP_CHECK(c <= p && p - c <= header_->slots, ErrorKind::kCorruption,
                fmt::format("shm {}: ring counters {}/{} are inconsistent", region.name(), p, c));
  slots_base_ = region.data() + header_->payload_offset;
}

uint32_t SlotRing::slots() const noexcept {
  return header_->slots;
}
uint32_t SlotRing::slot_bytes() const noexcept {
  return header_->slot_bytes;
}
uint64_t SlotRing::produced() const noexcept {
  return header_->produced.load(std::memory_order_acquire);
}
uint64_t SlotRing::consumed() const noexcept {
  return header_->consumed.load(std::memory_order_acquire);
}

namespace {
inline SlotMeta* meta_at(std::byte* base, uint64_t meta_offset, uint64_t index) {
  return reinterpret_cast<SlotMeta*>(base + meta_offset) + index;
}
}  // namespace

std::optional<std::span<std::byte>> SlotRing::try_acquire() {
  uint64_t p = header_->produced.load(std::memory_order_relaxed);
  // Acquire: the consumer's reads of the slot we are about to overwrite happened before.
  uint64_t c = header_->consumed.load(std::memory_order_acquire);
  if (p - c >= header_->slots) return std::nullopt;
  return std::span<std::byte>(slots_base_ + (p % header_->slots) * header_->stride,
                              header_->slot_bytes);
}

std::optional<std::span<std::byte>> SlotRing::acquire(Millis timeout) {
  return wait_for([this] { return try_acquire(); }, timeout);
}

void SlotRing::publish(uint32_t bytes, uint64_t tag) {
  MEGACPP_CHECK(bytes <= header_->slot_bytes, ErrorKind::kInvalidArgument,
                fmt::format("publish of {} bytes into {}-byte slots", bytes, header_->slot_bytes));
  uint64_t p = header_->produced.load(std::memory_order_relaxed);
  uint64_t c = header_->consumed.load(std::memory_order_acquire);
  MEGACPP_CHECK(p - c < header_->slots, ErrorKind::kInternal,
                "publish without a successfully acquired slot (ring full)");
  SlotMeta* m =
      meta_at(reinterpret_cast<std::byte*>(header_), header_->meta_offset, p % header_->slots);
  m->bytes = bytes;
  m->tag = tag;
  header_->produced.store(p + 1, std::memory_order_release);
}

std::optional<SlotRing::Slot> SlotRing::try_peek() {
  uint64_t c = header_->consumed.load(std::memory_order_relaxed);
  uint64_t p = header_->produced.load(std::memory_order_acquire);
  if (p == c) return std::nullopt;
  uint64_t index = c % header_->slots;
  const SlotMeta* m = meta_at(reinterpret_cast<std::byte*>(header_), header_->meta_offset, index);
  // A corrupt length must not hand out memory beyond the slot.
  uint32_t bytes = std::min(m->bytes, header_->slot_bytes);
  return Slot{std::span<std::byte>(slots_base_ + index * header_->stride, bytes), m->tag, c};
}

std::optional<SlotRing::Slot> SlotRing::peek(Millis timeout) {
  return wait_for([this] { return try_peek(); }, timeout);
}

void SlotRing::release() {
  uint64_t c = header_->consumed.load(std::memory_order_relaxed);
  uint64_t p = header_->produced.load(std::memory_order_acquire);
  MEGACPP_CHECK(p > c, ErrorKind::kInternal, "release of an empty ring");
  header_->consumed.store(c + 1, std::memory_order_release);
}

}  // namespace megacpp::ipc
