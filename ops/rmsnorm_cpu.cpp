#include <cmath>
#include <string>

#include "core/error.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"

namespace megacpp::ops {

namespace detail {

void check_rmsnorm_args(const char* op, const float* x, const float* y, int64_t rows,
                        int64_t cols) {
  const std::string name(op);
  MEGACPP_CHECK(rows >= 0, ErrorKind::kInvalidArgument,
                name + ": rows must be >= 0, got " + std::to_string(rows));
  MEGACPP_CHECK(cols >= 1, ErrorKind::kInvalidArgument,
                name + ": cols must be >= 1, got " + std::to_string(cols));
  MEGACPP_CHECK(rows == 0 || (x != nullptr && y != nullptr), ErrorKind::kInvalidArgument,
                name + ": x and y must not be null");
}

}  // namespace detail

void rmsnorm_cpu(const float* x, const float* w, float* y, int64_t rows, int64_t cols, float eps) {
  detail::check_rmsnorm_args("rmsnorm_cpu", x, y, rows, cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    // Double accumulation keeps the reference within a few float ulps of the exact result for
    // any row length; the CUDA kernel is judged against it. Four partial sums only break the
    // serial add dependency.
    double part[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t c = 0;
    for (; c + 4 <= cols; c += 4) {
      for (int k = 0; k < 4; ++k) part[k] += static_cast<double>(xr[c + k]) * xr[c + k];
    }
    for (; c < cols; ++c) part[0] += static_cast<double>(xr[c]) * xr[c];
    const double sum_sq = (part[0] + part[1]) + (part[2] + part[3]);
    const auto inv_rms =
        static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(cols) + eps));
    if (w != nullptr) {
      for (int64_t i = 0; i < cols; ++i) yr[i] = xr[i] * inv_rms * w[i];
    } else {
      for (int64_t i = 0; i < cols; ++i) yr[i] = xr[i] * inv_rms;
    }
  }
}

#if !(defined(MEGACPP_HAVE_CUDA) && MEGACPP_HAVE_CUDA)
int cuda_device_count() {
  return 0;
}
#endif

}  // namespace megacpp::ops
