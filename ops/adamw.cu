// The fused AdamW step on the GPU (contract in ops.h): one grid-striding pass, each thread
// reading the step's scalars from device memory once (the same few words for every thread:
// served from cache) and its elements of p, g, m and v once, writing p, m and v once.
#include <algorithm>
#include <cstdint>

#include "ops/cuda_check.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"

namespace megacpp::ops {

namespace {

using detail::kBlockThreads;
using detail::lerp_torch;

struct Scalars {
  const float *lr, *beta1, *beta2, *eps, *weight_decay, *step, *gate;
};

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, Scalars s,
                             bool decays) {
  const float lr = *s.lr, beta1 = *s.beta1, beta2 = *s.beta2, eps = *s.eps;
  const float gate = *s.gate;
  const float t = fmaxf(*s.step, 1.f);
  const float bias1 = 1.f - powf(beta1, t), bias2 = 1.f - powf(beta2, t);
  const float decay = 1.f - lr * *s.weight_decay * gate;
  const float w1 = (1.f - beta1) * gate, w2 = (1.f - beta2) * gate;
  const float step_size = lr / bias1 * gate;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float pi = p[i];
    if (decays) pi *= decay;
    const float gi = g[i];
    const float mi = lerp_torch(m[i], gi, w1);
    const float vi = lerp_torch(v[i], gi * gi, w2);
    pi -= mi / (sqrtf(vi / bias2) + eps) * step_size;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace

void adamw_step_cuda(float* p, const float* g, float* m, float* v, int64_t n,
                     const AdamWStepScalars& s, bool decays, void* stream) {
  detail::check_adamw_args("adamw_step_cuda", p, g, m, v, n, s);
  if (n == 0) return;
  const auto blocks = static_cast<unsigned>(detail::grid_blocks(n));
  adamw_kernel<<<blocks, kBlockThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      p, g, m, v, n, Scalars{s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step, s.gate},
      decays);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace megacpp::ops
