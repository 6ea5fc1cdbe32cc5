// Internals shared by the CPU and CUDA implementations of the ops.
#pragma once

#include <cstdint>

namespace megacpp::ops::detail {

// The argument contract common to both rmsnorm implementations (see ops.h); throws
// Error{kInvalidArgument} naming `op` when broken.
void check_rmsnorm_args(const char* op, const float* x, const float* y, int64_t rows, int64_t cols);

}  // namespace megacpp::ops::detail
