// The staging region's step stamp (ipc/staging_stamp.h).
#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "ipc/staging_stamp.h"

namespace megacpp::ipc {

std::optional<uint32_t> read_staging_stamp(const std::byte* p) {
  auto* stamp = reinterpret_cast<StagingStamp*>(const_cast<std::byte*>(p));
  if (std::atomic_ref<uint64_t>(stamp->magic).load(std::memory_order_acquire) != kStagingStampMagic)
    return std::nullopt;
  return std::atomic_ref<uint32_t>(stamp->step).load(std::memory_order_acquire);
}

// The share is copied with non-temporal (streaming) stores (ops::stream_copy), which x86 does
// not order with ordinary stores, and a release fence is only a compiler barrier there. Both
// ends of the copy therefore take a full fence (MFENCE, which drains the write-combining buffers
// too): the cleared stamp is visible before any byte of the new share, and every byte of the
// share before the new stamp. Without them a reader could pair the old stamp with new bytes,
// or the new stamp with bytes still in flight: a torn snapshot that passes the stamp check.
namespace {
void full_fence() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_mfence();
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}
}  // namespace

void clear_staging_stamp(std::byte* p) {
  auto* stamp = reinterpret_cast<StagingStamp*>(p);
  std::atomic_ref<uint32_t>(stamp->step).store(0, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(stamp->magic).store(kStagingStampMagic, std::memory_order_relaxed);
  full_fence();
}

void set_staging_stamp(std::byte* p, uint32_t step) {
  auto* stamp = reinterpret_cast<StagingStamp*>(p);
  full_fence();
  std::atomic_ref<uint32_t>(stamp->step).store(step, std::memory_order_release);
}

}  // namespace megacpp::ipc
