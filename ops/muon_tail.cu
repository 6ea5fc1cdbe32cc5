// Muon's fused tail on the GPU (contract in ops.h), three kernels on one stream: each row's (or
// column's) mean of u^2 into the workspace; one block per matrix turning those into the
// matrix's scales (and updating its second moment); one grid-striding pass writing
// out = p - (u * scale) * lr. The matrix-sized arrays are read twice (u) and once (p) and
// written once (out), where torch's operations move about ten such arrays in about twenty
// kernels per stack of matrices.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "core/error.h"

#include "ops/cuda_check.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"

namespace megacpp::ops {

namespace {

using detail::kBlockThreads;
using detail::lerp_torch;

// torch's clamp_min: a NaN stays NaN (fmaxf would return the bound, turning a moment poisoned by
// one NaN step into a finite, silently wrong scale instead of a NaN update the loss shows).
__device__ float clamp_min(float x, float lo) {
  return x < lo ? lo : x;
}

// The sum of `v` over the block (every thread gets it). `shared` holds 32 floats; calls may
// follow one another (each begins with a barrier).
__device__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>((blockDim.x + 31) >> 5) ? shared[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

// One block per row (blockIdx.x = k * rows + r): the mean of the row's squares.
__global__ void row_means(const float* u, float* stats, int64_t cols) {
  __shared__ float shared[32];
  const float* row = u + static_cast<int64_t>(blockIdx.x) * cols;
  float acc = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) acc += row[c] * row[c];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) stats[blockIdx.x] = acc / static_cast<float>(cols);
}

// Blocks of 32 x 8 threads over 32 columns of matrix blockIdx.y: the mean of each column's
// squares (a warp reads 32 neighbouring floats of a row at a time).
__global__ void column_means(const float* u, float* stats, int64_t rows, int64_t cols) {
  __shared__ float part[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const float* m = u + static_cast<int64_t>(blockIdx.y) * rows * cols;
  float acc = 0.f;
  if (c < cols)
    for (int64_t r = threadIdx.y; r < rows; r += 8) acc += m[r * cols + c] * m[r * cols + c];
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int y = 1; y < 8; ++y) acc += part[y][threadIdx.x];
    stats[static_cast<int64_t>(blockIdx.y) * cols + c] = acc / static_cast<float>(rows);
  }
}

// One block per matrix: the norms before and after, the second moment's step, and each row's
// (or column's) scale in place of its mean.
__global__ void scales(float* stats, float* sec, int64_t n_stats, float red, const float* beta2,
                       const float* gate, int64_t per_gate) {
  __shared__ float shared[32];
  const int64_t k = blockIdx.x;
  float* st = stats + k * n_stats;
  float* se = sec + k * n_stats;
  float total = 0.f;
  for (int64_t j = threadIdx.x; j < n_stats; j += blockDim.x) total += st[j];
  const float v_norm = sqrtf(block_sum(total, shared) * red);
  const float w = (1.f - *beta2) * gate[k / per_gate];
  float scaled = 0.f;
  for (int64_t j = threadIdx.x; j < n_stats; j += blockDim.x) {
    const float vm = st[j];
    const float s1 = lerp_torch(se[j], vm, w);
    se[j] = s1;
    const float step = rsqrtf(clamp_min(s1, 1e-10f));
    st[j] = step;
    scaled += vm * red * (step * step);
  }
  const float ratio = v_norm / clamp_min(sqrtf(block_sum(scaled, shared)), 1e-10f);
  for (int64_t j = threadIdx.x; j < n_stats; j += blockDim.x) st[j] *= ratio;
}

// out = p - (u * scale) * (lr * aspect * gate), each product rounded as torch's mul_ does.
// Matrix blockIdx.y; its rows from blockIdx.x strided by gridDim.x, a row's columns strided by
// the threads: no index division per element (64-bit division is emulated, dozens of
// instructions, enough to make this bandwidth-bound pass compute-bound).
__global__ void update(const float* u, const float* p, float* out, const float* stats, int64_t rows,
                       int64_t cols, bool reduce_cols, const float* lr, float aspect,
                       const float* gate, int64_t per_gate) {
  const int64_t k = blockIdx.y;
  const float lr_k = __fmul_rn(__fmul_rn(*lr, aspect), gate[k / per_gate]);
  const float* st = stats + k * (reduce_cols ? rows : cols);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = (k * rows + r) * cols;
    const float s_row = reduce_cols ? st[r] : 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float s = reduce_cols ? s_row : st[c];
      out[base + c] = __fsub_rn(p[base + c], __fmul_rn(__fmul_rn(u[base + c], s), lr_k));
    }
  }
}

}  // namespace

void muon_tail_cuda(const MuonTailArgs& a, void* stream_ptr) {
  detail::check_muon_tail_args("muon_tail_cuda", a, /*workspace=*/true);
  if (a.count == 0) return;
  MEGACPP_CHECK(a.count <= detail::kMaxGridBlocks, ErrorKind::kInvalidArgument,
                "muon_tail_cuda: at most 65535 matrices a call, got " + std::to_string(a.count));
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (a.reduce_cols) {
    MEGACPP_CHECK(a.count * a.rows <= std::numeric_limits<int32_t>::max(),
                  ErrorKind::kInvalidArgument,
                  "muon_tail_cuda: at most 2^31 - 1 rows in all a call, got " +
                      std::to_string(a.count * a.rows));
    row_means<<<static_cast<unsigned>(a.count * a.rows), kBlockThreads, 0, stream>>>(
        a.u, a.workspace, a.cols);
  } else {
    const dim3 grid(static_cast<unsigned>((a.cols + 31) / 32), static_cast<unsigned>(a.count));
    column_means<<<grid, dim3(32, 8), 0, stream>>>(a.u, a.workspace, a.rows, a.cols);
  }
  CUDA_CHECK(cudaGetLastError());
  const int64_t n_stats = a.reduce_cols ? a.rows : a.cols;
  scales<<<static_cast<unsigned>(a.count), kBlockThreads, 0, stream>>>(
      a.workspace, a.sec, n_stats, static_cast<float>(a.reduce_cols ? a.cols : a.rows), a.beta2,
      a.gate, a.matrices_per_gate);
  CUDA_CHECK(cudaGetLastError());
  const dim3 rows_grid(static_cast<unsigned>(std::min(a.rows, detail::kMaxGridBlocks)),
                       static_cast<unsigned>(a.count));
  update<<<rows_grid, kBlockThreads, 0, stream>>>(a.u, a.p, a.out, a.workspace, a.rows, a.cols,
                                                  a.reduce_cols, a.lr, a.aspect, a.gate,
                                                  a.matrices_per_gate);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace megacpp::ops
