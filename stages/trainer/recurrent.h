// megacpp::trainer recurrent block — family R of a hybrid pattern in author_dp mode: a gated
// linear recurrence (the real-gated linear recurrent unit of Griffin's recurrent block).
//
//   gate = GeLU(gate_proj(x));  u = causal depthwise conv1d(in_proj(x))        [B, T, W]
//   r_t = sigmoid(rec_gate(u_t)), i_t = sigmoid(in_gate(u_t))
//   log a_t = -c * r_t * softplus(-lambda)             (a_t = sigmoid(lambda)^(c r_t), c = 8)
//   h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * u_t)        (per channel; h_0 = 0)
//   out_proj(gate * h)
//
// The recurrence is diagonal, so it runs as the SSD scan (ssd.h) with one state per channel:
// chunked, or step by step for the tests. Contract as mamba.h: a torch module, causal, pure, no
// collective. Parameter names: gate_proj.weight, in_proj.weight, conv.weight [W, 1, K],
// conv.bias, rec_gate.weight, rec_gate.bias, in_gate.weight, in_gate.bias, lambda [W],
// out_proj.weight; the five matrices are 2-D (DistMuon's), the rest are not.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace megacpp::trainer {

struct RecurrentConfig {
  int64_t d_model = 128;
  int64_t width = 128;  // W: channels of the recurrence
  int64_t conv_kernel = 4;
  int64_t chunk = 64;
  void validate() const;
};

class RecurrentImpl : public torch::nn::Module {
 public:
  explicit RecurrentImpl(const RecurrentConfig& config);
  // x: [B, T, d_model] -> [B, T, d_model]; `sequential`: the step-by-step recurrence.
  at::Tensor forward(const at::Tensor& x, bool sequential = false);
  // forward from the two input projections, gate_proj(x) and in_proj(x), with the gates, the
  // scan and the gating recomputed with out_proj (model.h "selective"); the conv output u and
  // the gate projections rec_gate(u), in_gate(u) are kept.
  at::Tensor from_projections(const at::Tensor& gate_in, const at::Tensor& in,
                              bool sequential = false);
  void set_selective(bool on) noexcept { selective_ = on; }
  // Projections U(+-sqrt(1 / fan_in)) (out_proj zero when `zero_out`), gate biases zero,
  // lambda such that a = sigmoid(lambda)^c lies in [0.9, 0.999] (Griffin's range).
  void initialise(at::Generator& gen, bool zero_out);

  torch::nn::Linear gate_proj{nullptr}, in_proj{nullptr}, rec_gate{nullptr}, in_gate{nullptr},
      out_proj{nullptr};
  torch::nn::Conv1d conv{nullptr};
  at::Tensor lambda;

 private:
  // h [B, T, W] from the conv output u and the gates r, i (sigmoids of their projections).
  at::Tensor recur(const at::Tensor& u, const at::Tensor& r, const at::Tensor& i, bool sequential);

  RecurrentConfig config_;
  bool selective_ = false;
};
TORCH_MODULE(Recurrent);

}  // namespace megacpp::trainer
