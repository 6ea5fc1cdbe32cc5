// The fused element-wise loops of optim_kernels.h. Built with -O3 -ffp-contract=off
// (ops/CMakeLists.txt): vectorized, and a contracted multiply-add would round once where torch's
// separate operations round twice. The two arrays of a call never alias.
#include <bit>
#include <cstdint>

#include "ops/optim_kernels.h"

namespace megacpp::ops {

namespace {

inline float from_bf16(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// Round to nearest even, as c10::BFloat16 and torch's vectorized conversions round every
// value that is not a NaN. A NaN here is the result of arithmetic on bfloat16 values (its low
// 16 bits hold no payload, its quiet bit is set), so the carry cannot reach the exponent: it
// stays a NaN, though not necessarily torch's NaN.
inline uint16_t to_bf16(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float round_bf16(float v) {
  return from_bf16(to_bf16(v));
}

}  // namespace

// Built for AVX-512 and AVX2 as well as the baseline, the best picked at load time.
#if defined(__x86_64__)
#define MEGACPP_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MEGACPP_VECTOR_CLONES
#endif

MEGACPP_VECTOR_CLONES
void scaled_sum(float* __restrict A, const float* __restrict AA, float b, float c, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float left = b * A[i];
    const float right = c * AA[i];
    A[i] = left + right;
  }
}

MEGACPP_VECTOR_CLONES
void scaled_sum(uint16_t* __restrict A, const uint16_t* __restrict AA, float b, float c, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float left = round_bf16(b * from_bf16(A[i]));
    const float right = round_bf16(c * from_bf16(AA[i]));
    A[i] = to_bf16(left + right);
  }
}

MEGACPP_VECTOR_CLONES
void scale_add(float* __restrict x, const float* __restrict y, float a, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float scaled = a * x[i];
    x[i] = scaled + y[i];
  }
}

MEGACPP_VECTOR_CLONES
void scale_add(uint16_t* __restrict x, const uint16_t* __restrict y, float a, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] = to_bf16(round_bf16(a * from_bf16(x[i])) + from_bf16(y[i]));
}

MEGACPP_VECTOR_CLONES
void sum_and_divide(float* __restrict own, const float* __restrict theirs, float divisor,
                    size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float sum = own[i] + theirs[i];
    own[i] = sum / divisor;
  }
}

}  // namespace megacpp::ops
