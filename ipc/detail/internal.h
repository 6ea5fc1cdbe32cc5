// Internals shared by the ipc translation units. Not part of the public API.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include <capnp/message.h>

namespace megacpp::ipc::detail {

// Owns one file descriptor; closes it on destruction. Close errors are ignored: by then the
// descriptor is released either way and a destructor must not throw.
class Fd {
 public:
  explicit Fd(int fd = -1) noexcept : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const noexcept { return fd_; }
  // Gives up ownership (the caller closes it).
  int release() noexcept {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

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
