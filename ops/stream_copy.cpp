#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define MEGACPP_STREAM_STORES 1
#else
#define MEGACPP_STREAM_STORES 0
#endif

#include "ops/ops.h"

namespace megacpp::ops {

bool stream_copy_streams() noexcept {
  return MEGACPP_STREAM_STORES != 0;
}

void stream_copy(void* dst, const void* src, size_t n) noexcept {
#if MEGACPP_STREAM_STORES
  constexpr size_t kMinStreamed = 4096;
  if (n < kMinStreamed) {
    std::memcpy(dst, src, n);
    return;
  }
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // Streaming stores need a 16-byte-aligned destination: the head goes through memcpy.
  const size_t head = (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16;
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace megacpp::ops
