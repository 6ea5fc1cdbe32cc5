// Internals shared by the CPU and CUDA implementations of the ops.
#pragma once

#include <algorithm>
#include <cstdint>

namespace megacpp::ops {
struct AdamWStepScalars;  // ops.h
struct MuonTailArgs;      // ops.h
}  // namespace megacpp::ops

namespace megacpp::ops::detail {

#if defined(__CUDACC__)
#define MEGACPP_OPS_HOST_DEVICE __host__ __device__
#else
#define MEGACPP_OPS_HOST_DEVICE
#endif

// torch's lerp: a + w (b - a) for w < 0.5, else b - (b - a)(1 - w). The CPU references take it
// in double, the kernels in float.
template <typename T>
MEGACPP_OPS_HOST_DEVICE inline T lerp_torch(T a, T b, T w) {
  return w < T(0.5) ? a + w * (b - a) : b - (b - a) * (T(1) - w);
}

// The grid of a grid-striding element-wise kernel over n elements: kBlockThreads a block, at
// most kMaxGridBlocks blocks (the threads stride over the rest).
inline constexpr int kBlockThreads = 256;
inline constexpr int64_t kMaxGridBlocks = 65535;
constexpr int64_t grid_blocks(int64_t n) {
  return std::min(kMaxGridBlocks, (n + kBlockThreads - 1) / kBlockThreads);
}

// The argument contract common to both rmsnorm implementations (see ops.h); throws
// Error{kInvalidArgument} naming `op` when broken.
void check_rmsnorm_args(const char* op, const float* x, const float* y, int64_t rows, int64_t cols);

// The argument contract of adamw_step_cpu and adamw_step_cuda (see ops.h), thrown the same way.
void check_adamw_args(const char* op, const float* p, const float* g, const float* m,
                      const float* v, int64_t n, const AdamWStepScalars& s);

// The argument contract of muon_tail_cpu and muon_tail_cuda (see ops.h); `workspace` says
// whether the op needs one.
void check_muon_tail_args(const char* op, const MuonTailArgs& a, bool workspace);

}  // namespace megacpp::ops::detail
