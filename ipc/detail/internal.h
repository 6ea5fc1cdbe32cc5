// Internals shared by the ipc translation units. Not part of the public API.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

#include <capnp/message.h>

#include "core/fd.h"

namespace megacpp::ipc::detail {

// The one owned-descriptor type (core/fd.h), under the name the ipc sources use.
using Fd = ::megacpp::Fd;

using Clock = std::chrono::steady_clock;

// The pause of a spin-wait (ring.cpp's waits, peer_exchange.cpp's): lets the sibling
// hyperthread run and saves power while a counter in shared memory is polled.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Milliseconds left until `deadline`, rounded up so a sub-millisecond remainder still waits,
// and never negative (0 means "poll once").
inline long remaining_ms(Clock::time_point deadline) {
  auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  return static_cast<long>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
}

// Reader options for a message of `words` words: every message is walked twice (validated
// with totalSize(), then read by the caller), so the traversal limit must cover both passes
// even for messages near the 64 MiB frame limit.
inline capnp::ReaderOptions reader_options(size_t words) {
  capnp::ReaderOptions options;
  options.traversalLimitInWords =
      std::max<uint64_t>(options.traversalLimitInWords, uint64_t{words} * 4);
  return options;
}

}  // namespace megacpp::ipc::detail
