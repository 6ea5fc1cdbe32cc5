// megacpp::trainer Mamba-2 block — family M of a hybrid pattern (and R in nemo_native mode): a
// selective state-space mixer, as Mamba-2 defines it, around the chunked SSD scan (ssd.h).
//
//   in_proj(x) -> z (gate), xBC, dt      per token: d_inner, d_inner + 2 N, n_heads values
//   xBC -> causal depthwise conv1d (kernel K, with bias) -> SiLU -> x [H, P], B [N], C [N]
//   dt  -> softplus(dt + dt_bias);  A = -exp(A_log);  the scan of (x * dt, A * dt, B, C)
//   y = scan + D * x;  y = RMSNorm(y * SiLU(z)) * norm_weight;  out_proj(y)
//
// Contract: a torch module (float32 or float64, CPU or device); forward is a pure function of its
// input and parameters, causal (position t depends on positions <= t only), and issues no
// collective. One group of B and C shared by every head. Parameter names: in_proj.weight,
// conv.weight [d_inner + 2N, 1, K], conv.bias, dt_bias [H], A_log [H], D [H], norm_weight
// [d_inner], out_proj.weight; the two projections are 2-D (DistMuon's), the rest are not.
// An invalid configuration is Error{kInvalidArgument} naming the rule.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace megacpp::trainer {

struct MambaConfig {
  int64_t d_model = 128;
  int64_t d_state = 16;   // N
  int64_t head_dim = 32;  // P; n_heads = expand * d_model / head_dim
  int64_t expand = 2;     // d_inner = expand * d_model
  int64_t conv_kernel = 4;
  int64_t chunk = 64;  // steps per chunk of the SSD scan

  int64_t d_inner() const { return expand * d_model; }
  int64_t n_heads() const { return d_inner() / head_dim; }
  void validate() const;
};

class MambaImpl : public torch::nn::Module {
 public:
  explicit MambaImpl(const MambaConfig& config);
  // x: [B, T, d_model] -> [B, T, d_model]. `sequential` runs the step-by-step recurrence
  // instead of the chunked scan (the reference of the tests).
  at::Tensor forward(const at::Tensor& x, bool sequential = false);
  // The rest of forward after in_proj: zxbcdt [B, T, 2 d_inner + 2N + H].
  at::Tensor from_in_proj(const at::Tensor& zxbcdt, bool sequential = false);
  // Recompute conv, SiLU, the scan and the gated norm with out_proj, keeping in_proj's output
  // (model.h "selective").
  void set_selective(bool on) noexcept { selective_ = on; }
  // Draws the parameters from `gen` as Mamba-2 initialises them: dt's softplus in
  // [1e-3, 1e-1] log-uniformly, A in [1, 16], D = 1, the conv and projections
  // U(+-sqrt(1 / fan_in)), out_proj zero when `zero_out` (a residual block starts as identity).
  void initialise(at::Generator& gen, bool zero_out);
  const MambaConfig& config() const noexcept { return config_; }

  torch::nn::Linear in_proj{nullptr};
  torch::nn::Conv1d conv{nullptr};
  torch::nn::Linear out_proj{nullptr};
  at::Tensor dt_bias, A_log, D, norm_weight;

 private:
  // conv, SiLU, the scan, the gating and the inner norm: out_proj's input.
  at::Tensor mix(const at::Tensor& zxbcdt, bool sequential);

  MambaConfig config_;
  bool selective_ = false;
};
TORCH_MODULE(Mamba);

}  // namespace megacpp::trainer
