// Numeric kernels. Each op has a CPU reference and, in builds with the CUDA toolkit, a CUDA
// version with the same signature apart from the trailing stream; the two are tested against
// each other. Raw pointers only: this header needs neither torch nor the CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace megacpp::ops {

// Copies n bytes like std::memcpy (its CPU reference: the result is byte-identical) but, on
// x86-64, with streaming (non-temporal) stores: destination cache lines are written without
// being read first and without evicting the caches. glibc's memcpy does that only for one copy
// larger than a fraction of the last-level cache, so copying many multi-MB tensors one by one
// runs at about 0.6x the bandwidth of one large copy; this keeps every copy at the large-copy
// rate. For bulk copies into memory nobody reads soon (a snapshot's staging region). Ends with
// a store fence, so the bytes are visible before any later store (a release of a stamp).
// Copies under 4 KiB and other architectures use memcpy. The regions must not overlap.
void stream_copy(void* dst, const void* src, size_t n) noexcept;
// Whether stream_copy uses streaming stores on this build (false: it is memcpy).
bool stream_copy_streams() noexcept;

// RMSNorm forward over the rows of a row-major [rows, cols] float32 matrix:
//   y[r, c] = x[r, c] / sqrt(mean_c(x[r, :]^2) + eps) * (w ? w[c] : 1)
// `w` (cols elements) may be null. `y` may alias `x` exactly (in place); no other overlap.
// Throws Error{kInvalidArgument} for rows < 0, cols < 1, or null x/y with rows > 0.
// The CPU reference accumulates the sum of squares in double.
void rmsnorm_cpu(const float* x, const float* w, float* y, int64_t rows, int64_t cols, float eps);

// One AdamW step over n float32 elements: DistAdamW's update on a device (the gated path of
// stages/trainer/dist_adamw.cpp) fused into one pass over p, g, m, v. Per element, with
// t = max(step, 1):
//   p *= 1 - lr * weight_decay * gate                 (only when `decays`)
//   m = lerp(m, g, (1 - beta1) * gate)
//   v = lerp(v, g * g, (1 - beta2) * gate)
//   p -= m / (sqrt(v / (1 - beta2^t)) + eps) * (lr / (1 - beta1^t) * gate)
// lerp(a, b, w) is torch's: a + w (b - a) for w < 0.5, else b - (b - a)(1 - w). The scalars are
// read from memory (device memory for the CUDA version: they are the optimizer's 0-D tensors, so
// a step reads nothing on the host); `step` already counts this step; `gate` is 1 when some
// rank had a gradient, else 0 (then p, m and v keep their values).
struct AdamWStepScalars {
  const float* lr = nullptr;
  const float* beta1 = nullptr;
  const float* beta2 = nullptr;
  const float* eps = nullptr;
  const float* weight_decay = nullptr;
  const float* step = nullptr;
  const float* gate = nullptr;
};
// The CPU reference: every element computed in double, stored as float. Throws
// Error{kInvalidArgument} for n < 0, or a null array or scalar with n > 0.
void adamw_step_cpu(float* p, const float* g, float* m, float* v, int64_t n,
                    const AdamWStepScalars& s, bool decays);

// Muon's tail: the variance reduction and update of stages/trainer/dist_muon.cpp's
// finish_update (its in-place path without weight decay) fused, for `count` float32 matrices of
// rows x cols, row-major and one after another. The reduced dimension is the columns
// (`reduce_cols`: one statistic per row, red = cols) or the rows (one per column, red = rows).
// For matrix k, with j a row (or a column) and gate = gate[k / matrices_per_gate]:
//   v_mean[j]  = mean over the reduced dimension of u[k]^2
//   v_norm     = sqrt(sum_j(v_mean[j]) * red)
//   sec[k][j]  = lerp(sec[k][j], v_mean[j], (1 - beta2) * gate)
//   step[j]    = 1 / sqrt(max(sec[k][j], 1e-10))
//   v_norm_new = sqrt(sum_j(v_mean[j] * red * step[j]^2))
//   scale[j]   = step[j] * (v_norm / max(v_norm_new, 1e-10))
//   out[k]     = p[k] - (u[k] * scale) * (lr * aspect * gate)
// lerp is torch's (adamw_step_cpu). `sec` holds count x (rows or cols) floats; `lr`, `beta2`
// (0-D tensors' storage) and `gate` (count / matrices_per_gate flags, 1 where some rank had a
// gradient, 0 where none did: then out = p and sec keep their values) are read from memory
// (device memory for the CUDA version). `out` may alias `p` exactly; nothing else overlaps.
struct MuonTailArgs {
  const float* u = nullptr;  // the orthogonalized update
  const float* p = nullptr;
  float* out = nullptr;
  float* sec = nullptr;  // the factored second moment, updated in place
  int64_t count = 0, rows = 0, cols = 0;
  bool reduce_cols = true;
  const float* lr = nullptr;
  const float* beta2 = nullptr;
  const float* gate = nullptr;
  int64_t matrices_per_gate = 1;  // matrices sharing one gate (row slices of one entry)
  float aspect = 1.f;             // the learning rate's shape factor
  // Scratch of muon_tail_workspace(...) floats: device memory for the CUDA version; the CPU
  // reference needs none (null).
  float* workspace = nullptr;
};
// Floats of scratch the CUDA version needs: one statistic per row (or column) of every matrix.
int64_t muon_tail_workspace(int64_t count, int64_t rows, int64_t cols, bool reduce_cols);
// The CPU reference, in double, stored as float. Throws Error{kInvalidArgument} for a negative
// count, rows or cols < 1, matrices_per_gate < 1 or not dividing count, or a null array or
// scalar with count > 0.
void muon_tail_cpu(const MuonTailArgs& a);

// Number of CUDA devices visible to this process; 0 when there is no driver or no device, or
// when built without CUDA. Never throws.
int cuda_device_count();

#if defined(MEGACPP_HAVE_CUDA) && MEGACPP_HAVE_CUDA
// The same op on the GPU. x, w, y are device pointers on the current device; `stream` is a
// cudaStream_t (nullptr: the legacy default stream). Asynchronous: returns after the launch,
// so errors raised while the kernel runs surface at the next synchronising CUDA call.
// Throws Error{kInvalidArgument} as rmsnorm_cpu, Error{kSystem} when the launch fails.
void rmsnorm_cuda(const float* x, const float* w, float* y, int64_t rows, int64_t cols, float eps,
                  void* stream);
// adamw_step_cpu on the GPU in float32 (IEEE division and square root): every pointer, the
// scalars' included, in device memory of the current device. Asynchronous, as rmsnorm_cuda.
void adamw_step_cuda(float* p, const float* g, float* m, float* v, int64_t n,
                     const AdamWStepScalars& s, bool decays, void* stream);
// muon_tail_cpu on the GPU in float32 (three kernels: the statistics, each matrix's scale, the
// update); every pointer in device memory of the current device, the workspace included
// (muon_tail_workspace floats; it also throws Error{kInvalidArgument} when that is null).
// Asynchronous, as rmsnorm_cuda.
void muon_tail_cuda(const MuonTailArgs& a, void* stream);
#endif

}  // namespace megacpp::ops
