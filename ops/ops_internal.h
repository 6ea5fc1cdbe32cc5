// Internals shared by the CPU and CUDA implementations of the ops.
#pragma once

#include <cstdint>

namespace megacpp::ops {
struct AdamWStepScalars;  // ops.h
struct MuonTailArgs;      // ops.h
}  // namespace megacpp::ops

namespace megacpp::ops::detail {

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
