// CUDA_CHECK: the check macro for every CUDA runtime call (internal to ops).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/error.h"

namespace megacpp::ops::detail {

[[noreturn]] inline void throw_cuda(const char* expr, cudaError_t err, const char* file, int line) {
  throw Error(ErrorKind::kSystem,
              std::string(expr) + " failed: " + cudaGetErrorString(err) + " (" +
                  cudaGetErrorName(err) + ") (" + file + ":" + std::to_string(line) + ")",
              file, line);
}

}  // namespace megacpp::ops::detail

// Evaluates `expr` (a cudaError_t) and throws Error{kSystem} naming the expression, the CUDA
// error text, file and line unless it is cudaSuccess.
#define CUDA_CHECK(expr)                                                                \
  do {                                                                                  \
    const cudaError_t megacpp_cuda_err_ = (expr);                                       \
    if (megacpp_cuda_err_ != cudaSuccess)                                               \
      ::megacpp::ops::detail::throw_cuda(#expr, megacpp_cuda_err_, __FILE__, __LINE__); \
  } while (0)
