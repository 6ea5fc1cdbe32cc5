// The CPU reference of Muon's fused tail (contract in ops.h).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"

namespace megacpp::ops {

namespace detail {

void check_muon_tail_args(const char* op, const MuonTailArgs& a, bool workspace) {
  const std::string name(op);
  MEGACPP_CHECK(a.count >= 0, ErrorKind::kInvalidArgument,
                name + ": count must be >= 0, got " + std::to_string(a.count));
  MEGACPP_CHECK(a.rows >= 1 && a.cols >= 1, ErrorKind::kInvalidArgument,
                name + ": rows and cols must be >= 1, got " + std::to_string(a.rows) + " x " +
                    std::to_string(a.cols));
  MEGACPP_CHECK(a.matrices_per_gate >= 1 && a.count % a.matrices_per_gate == 0,
                ErrorKind::kInvalidArgument,
                name + ": matrices_per_gate must be >= 1 and divide count " +
                    std::to_string(a.count) + ", got " + std::to_string(a.matrices_per_gate));
  if (a.count == 0) return;
  MEGACPP_CHECK(a.u != nullptr && a.p != nullptr && a.out != nullptr && a.sec != nullptr,
                ErrorKind::kInvalidArgument, name + ": u, p, out and sec must not be null");
  MEGACPP_CHECK(a.lr != nullptr && a.beta2 != nullptr && a.gate != nullptr,
                ErrorKind::kInvalidArgument, name + ": lr, beta2 and gate must be set");
  MEGACPP_CHECK(!workspace || a.workspace != nullptr, ErrorKind::kInvalidArgument,
                name + ": needs a workspace of muon_tail_workspace() floats");
}

}  // namespace detail

int64_t muon_tail_workspace(int64_t count, int64_t rows, int64_t cols, bool reduce_cols) {
  return count * (reduce_cols ? rows : cols);
}

void muon_tail_cpu(const MuonTailArgs& a) {
  detail::check_muon_tail_args("muon_tail_cpu", a, /*workspace=*/false);
  if (a.count == 0) return;
  const int64_t rows = a.rows, cols = a.cols, n = rows * cols;
  const int64_t stats = a.reduce_cols ? rows : cols;
  const double red = static_cast<double>(a.reduce_cols ? cols : rows);
  const double beta2 = *a.beta2, lr = static_cast<double>(*a.lr) * a.aspect;
  std::vector<double> v_mean(static_cast<size_t>(stats)), scale(static_cast<size_t>(stats));
  for (int64_t k = 0; k < a.count; ++k) {
    const float* u = a.u + k * n;
    const float* p = a.p + k * n;
    float* out = a.out + k * n;
    float* sec = a.sec + k * stats;
    const double gate = a.gate[k / a.matrices_per_gate];
    std::fill(v_mean.begin(), v_mean.end(), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const double x = u[r * cols + c];
        v_mean[static_cast<size_t>(a.reduce_cols ? r : c)] += x * x;
      }
    double total = 0;
    for (auto& v : v_mean) total += (v /= red);
    const double v_norm = std::sqrt(total * red);
    const double w = (1.0 - beta2) * gate;
    double scaled = 0;
    for (int64_t j = 0; j < stats; ++j) {
      const double s0 = sec[j], vm = v_mean[static_cast<size_t>(j)];
      const double s1 = detail::lerp_torch(s0, vm, w);
      sec[j] = static_cast<float>(s1);
      // std::max keeps a NaN first argument, as torch's clamp_min does.
      const double step = 1.0 / std::sqrt(std::max(s1, 1e-10));
      scale[static_cast<size_t>(j)] = step;
      scaled += vm * red * step * step;
    }
    const double ratio = v_norm / std::max(std::sqrt(scaled), 1e-10);
    const double lr_k = lr * gate;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = r * cols + c;
        const double s = scale[static_cast<size_t>(a.reduce_cols ? r : c)] * ratio;
        out[i] = static_cast<float>(static_cast<double>(p[i]) - u[i] * s * lr_k);
      }
  }
}

}  // namespace megacpp::ops
