#include "stages/trainer/mamba.h"

#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "stages/trainer/recompute.h"
#include "stages/trainer/ssd.h"

namespace megacpp::trainer {

void MambaConfig::validate() const {
  MEGACPP_CHECK(
      d_model > 0 && d_state > 0 && head_dim > 0 && expand > 0 && conv_kernel > 0 && chunk > 0,
      ErrorKind::kInvalidArgument,
      "mamba: dModel, dState, headDim, expand, convKernel and chunk must be > 0");
  MEGACPP_CHECK(d_inner() % head_dim == 0, ErrorKind::kInvalidArgument,
                fmt::format("mamba: expand x dModel = {} must be a multiple of headDim {}",
                            d_inner(), head_dim));
}

MambaImpl::MambaImpl(const MambaConfig& c) : config_(c) {
  c.validate();
  const int64_t H = c.n_heads(), conv_dim = c.d_inner() + 2 * c.d_state;
  in_proj = register_module(
      "in_proj",
      torch::nn::Linear(
          torch::nn::LinearOptions(c.d_model, 2 * c.d_inner() + 2 * c.d_state + H).bias(false)));
  conv = register_module(
      "conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(conv_dim, conv_dim, c.conv_kernel)
                                    .groups(conv_dim)
                                    .padding(c.conv_kernel - 1)
                                    .bias(true)));
  out_proj = register_module(
      "out_proj", torch::nn::Linear(torch::nn::LinearOptions(c.d_inner(), c.d_model).bias(false)));
  dt_bias = register_parameter("dt_bias", torch::zeros({H}));
  A_log = register_parameter("A_log", torch::zeros({H}));
  D = register_parameter("D", torch::ones({H}));
  norm_weight = register_parameter("norm_weight", torch::ones({c.d_inner()}));
}

void MambaImpl::initialise(at::Generator& gen, bool zero_out) {
  torch::NoGradGuard no_grad;
  const auto uniform = [&](at::Tensor& p, double bound) { p.uniform_(-bound, bound, gen); };
  uniform(in_proj->weight, std::sqrt(1.0 / static_cast<double>(config_.d_model)));
  uniform(conv->weight, std::sqrt(1.0 / static_cast<double>(config_.conv_kernel)));
  uniform(conv->bias, std::sqrt(1.0 / static_cast<double>(config_.conv_kernel)));
  if (zero_out) {
    out_proj->weight.zero_();
  } else {
    uniform(out_proj->weight, std::sqrt(1.0 / static_cast<double>(config_.d_inner())));
  }
  // dt = exp(U(log 1e-3, log 1e-1)); dt_bias is softplus's inverse of it.
  const at::Tensor dt =
      (at::empty_like(dt_bias).uniform_(0, 1, gen) * (std::log(0.1) - std::log(1e-3)) +
       std::log(1e-3))
          .exp();
  dt_bias.copy_(dt + at::log(-at::expm1(-dt)));
  A_log.copy_(at::empty_like(A_log).uniform_(1, 16, gen).log());
  D.fill_(1.0);
  norm_weight.fill_(1.0);
}

at::Tensor MambaImpl::forward(const at::Tensor& x, bool sequential) {
  return from_in_proj(in_proj(x), sequential);
}

at::Tensor MambaImpl::from_in_proj(const at::Tensor& zxbcdt, bool sequential) {
  if (!selective_) return out_proj(mix(zxbcdt, sequential));
  return detail::recompute_into_linear(
      [this, sequential](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
        return {mix(in[0], sequential)};
      },
      {zxbcdt, conv->weight, conv->bias, dt_bias, A_log, D, norm_weight}, {out_proj->weight})[0];
}

at::Tensor MambaImpl::mix(const at::Tensor& zxbcdt, bool sequential) {
  const MambaConfig& c = config_;
  const int64_t B = zxbcdt.size(0), T = zxbcdt.size(1);
  const int64_t H = c.n_heads(), P = c.head_dim, N = c.d_state, I = c.d_inner();
  const auto parts = zxbcdt.split_with_sizes({I, I + 2 * N, H}, -1);
  const at::Tensor& z = parts[0];
  // Causal: padded K-1 on both sides, the first T outputs see only positions <= t.
  const at::Tensor xbc =
      at::silu(conv(parts[1].transpose(1, 2)).narrow(2, 0, T).transpose(1, 2));  // [B, T, I+2N]
  const auto xbc_parts = xbc.split_with_sizes({I, N, N}, -1);
  const at::Tensor u = xbc_parts[0].reshape({B, T, H, P});
  const at::Tensor dt = at::softplus(parts[2] + dt_bias);  // [B, T, H]
  const at::Tensor A = -A_log.exp();                       // [H]
  const at::Tensor b = xbc_parts[1].unsqueeze(2).expand({B, T, H, N});
  const at::Tensor cc = xbc_parts[2].unsqueeze(2).expand({B, T, H, N});
  const at::Tensor xs = u * dt.unsqueeze(-1);
  const at::Tensor a = dt * A;
  const SsdResult r =
      sequential ? ssd_sequential(xs, a, b, cc) : ssd_chunked(xs, a, b, cc, c.chunk);
  const at::Tensor y = (r.y + u * D.view({1, 1, H, 1})).reshape({B, T, I});
  return at::rms_norm(y * at::silu(z), {I}, norm_weight, 1e-6);
}

}  // namespace megacpp::trainer
