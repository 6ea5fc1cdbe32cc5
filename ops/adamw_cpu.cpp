// The CPU reference of the fused AdamW step (contract in ops.h).
#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"

namespace megacpp::ops {

namespace detail {

void check_adamw_args(const char* op, const float* p, const float* g, const float* m,
                      const float* v, int64_t n, const AdamWStepScalars& s) {
  const std::string name(op);
  MEGACPP_CHECK(n >= 0, ErrorKind::kInvalidArgument,
                name + ": n must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  MEGACPP_CHECK(p != nullptr && g != nullptr && m != nullptr && v != nullptr,
                ErrorKind::kInvalidArgument, name + ": p, g, m and v must not be null");
  MEGACPP_CHECK(s.lr != nullptr && s.beta1 != nullptr && s.beta2 != nullptr && s.eps != nullptr &&
                    s.weight_decay != nullptr && s.step != nullptr && s.gate != nullptr,
                ErrorKind::kInvalidArgument, name + ": every scalar pointer must be set");
}

}  // namespace detail

void adamw_step_cpu(float* p, const float* g, float* m, float* v, int64_t n,
                    const AdamWStepScalars& s, bool decays) {
  detail::check_adamw_args("adamw_step_cpu", p, g, m, v, n, s);
  if (n == 0) return;
  const double lr = *s.lr, beta1 = *s.beta1, beta2 = *s.beta2, eps = *s.eps;
  const double wd = *s.weight_decay, gate = *s.gate;
  const double t = std::max(static_cast<double>(*s.step), 1.0);
  const double bias1 = 1.0 - std::pow(beta1, t), bias2 = 1.0 - std::pow(beta2, t);
  const double decay = 1.0 - lr * wd * gate;
  const double w1 = (1.0 - beta1) * gate, w2 = (1.0 - beta2) * gate;
  const double step_size = lr / bias1 * gate;
  for (int64_t i = 0; i < n; ++i) {
    double pi = p[i];
    if (decays) pi *= decay;
    const double gi = g[i];
    const double mi = detail::lerp_torch<double>(m[i], gi, w1);
    const double vi = detail::lerp_torch<double>(v[i], gi * gi, w2);
    pi -= mi / (std::sqrt(vi / bias2) + eps) * step_size;
    p[i] = static_cast<float>(pi);
    m[i] = static_cast<float>(mi);
    v[i] = static_cast<float>(vi);
  }
}

}  // namespace megacpp::ops
