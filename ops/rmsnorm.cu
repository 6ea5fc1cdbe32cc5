// RMSNorm forward on the GPU: one block per row (grid-striding when rows exceed the grid
// limit). Pass 1 reduces the row's sum of squares (per-thread partial sums, a warp-shuffle
// reduction, then one warp over the per-warp sums in shared memory); pass 2 scales the row,
// re-reading x (normally from L2). float4 loads/stores when every row start is 16-byte aligned.
#include <algorithm>
#include <cstdint>

#include "ops/cuda_check.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"

namespace megacpp::ops {

namespace {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 512;  // a multiple of kWarp; <= kWarp * kWarp (one reducing warp)
constexpr int64_t kMaxGrid = 0x7fffffff;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Requires blockDim.x to be a multiple of kWarp (every lane takes part in the shuffles). With
// kVec4, cols % 4 == 0 and x, y, w are 16-byte aligned.
template <bool kVec4>
__global__ void rmsnorm_kernel(const float* x, const float* w, float* y, int64_t rows, int64_t cols,
                               float eps) {
  __shared__ float warp_sums[kWarp];
  __shared__ float inv_rms_shared;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  const int64_t stride = blockDim.x;

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* xr = x + row * cols;
    float* yr = y + row * cols;

    float sum_sq = 0.f;
    if constexpr (kVec4) {
      const auto* x4 = reinterpret_cast<const float4*>(xr);
      for (int64_t i = threadIdx.x; i < cols / 4; i += stride) {
        const float4 v = x4[i];
        sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
    } else {
      for (int64_t c = threadIdx.x; c < cols; c += stride) sum_sq += xr[c] * xr[c];
    }
    sum_sq = warp_sum(sum_sq);
    if (lane == 0) warp_sums[warp] = sum_sq;
    __syncthreads();
    if (warp == 0) {
      float total = lane < warps ? warp_sums[lane] : 0.f;
      total = warp_sum(total);
      // IEEE sqrt and division (nvcc's defaults without --use_fast_math), as the reference.
      if (lane == 0) inv_rms_shared = 1.f / sqrtf(total / static_cast<float>(cols) + eps);
    }
    __syncthreads();
    // No barrier is needed before the next row: warp 0 reads warp_sums before the barrier above
    // and no warp rewrites it until past that barrier; inv_rms_shared is rewritten only after
    // the next row's first barrier, which every thread reaches after its read below.
    const float inv_rms = inv_rms_shared;

    if constexpr (kVec4) {
      const auto* x4 = reinterpret_cast<const float4*>(xr);
      const auto* w4 = reinterpret_cast<const float4*>(w);
      auto* y4 = reinterpret_cast<float4*>(yr);
      for (int64_t i = threadIdx.x; i < cols / 4; i += stride) {
        float4 v = x4[i];
        v.x *= inv_rms;
        v.y *= inv_rms;
        v.z *= inv_rms;
        v.w *= inv_rms;
        if (w != nullptr) {
          const float4 g = w4[i];
          v.x *= g.x;
          v.y *= g.y;
          v.z *= g.z;
          v.w *= g.w;
        }
        y4[i] = v;
      }
    } else {
      for (int64_t c = threadIdx.x; c < cols; c += stride) {
        const float v = xr[c] * inv_rms;
        yr[c] = w != nullptr ? v * w[c] : v;
      }
    }
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

void rmsnorm_cuda(const float* x, const float* w, float* y, int64_t rows, int64_t cols, float eps,
                  void* stream) {
  detail::check_rmsnorm_args("rmsnorm_cuda", x, y, rows, cols);
  if (rows == 0) return;
  const bool vec4 = cols % 4 == 0 && aligned16(x) && aligned16(y) && (w == nullptr || aligned16(w));
  const int64_t units = vec4 ? cols / 4 : cols;
  const auto threads =
      static_cast<unsigned>(std::min<int64_t>(kMaxThreads, (units + kWarp - 1) / kWarp * kWarp));
  const auto blocks = static_cast<unsigned>(std::min(rows, kMaxGrid));
  auto s = static_cast<cudaStream_t>(stream);
  if (vec4) {
    rmsnorm_kernel<true><<<blocks, threads, 0, s>>>(x, w, y, rows, cols, eps);
  } else {
    rmsnorm_kernel<false><<<blocks, threads, 0, s>>>(x, w, y, rows, cols, eps);
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace megacpp::ops
