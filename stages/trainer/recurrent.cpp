#include "stages/trainer/recurrent.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "recipes/recipe.h"
#include "stages/trainer/recompute.h"
#include "stages/trainer/ssd.h"

namespace megacpp::trainer {

namespace {

constexpr double kC = 8.0;

torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

}  // namespace

void RecurrentConfig::validate() const {
  MEGACPP_CHECK(d_model > 0 && width > 0 && conv_kernel > 0 && chunk > 0,
                ErrorKind::kInvalidArgument,
                "recurrent: dModel, width, convKernel and chunk must be > 0");
}

RecurrentImpl::RecurrentImpl(const RecurrentConfig& c) : config_(c) {
  c.validate();
  gate_proj = register_module("gate_proj", linear(c.d_model, c.width, false));
  in_proj = register_module("in_proj", linear(c.d_model, c.width, false));
  conv = register_module("conv",
                         torch::nn::Conv1d(torch::nn::Conv1dOptions(c.width, c.width, c.conv_kernel)
                                               .groups(c.width)
                                               .padding(c.conv_kernel - 1)
                                               .bias(true)));
  rec_gate = register_module("rec_gate", linear(c.width, c.width, true));
  in_gate = register_module("in_gate", linear(c.width, c.width, true));
  lambda = register_parameter("lambda", torch::zeros({c.width}));
  out_proj = register_module("out_proj", linear(c.width, c.d_model, false));
}

void RecurrentImpl::initialise(at::Generator& gen, bool zero_out) {
  torch::NoGradGuard no_grad;
  const auto uniform = [&](at::Tensor& p, int64_t fan_in) {
    const double bound = std::sqrt(1.0 / static_cast<double>(fan_in));
    p.uniform_(-bound, bound, gen);
  };
  uniform(gate_proj->weight, config_.d_model);
  uniform(in_proj->weight, config_.d_model);
  uniform(conv->weight, config_.conv_kernel);
  uniform(conv->bias, config_.conv_kernel);
  uniform(rec_gate->weight, config_.width);
  uniform(in_gate->weight, config_.width);
  rec_gate->bias.zero_();
  in_gate->bias.zero_();
  if (zero_out) {
    out_proj->weight.zero_();
  } else {
    uniform(out_proj->weight, config_.width);
  }
  // a^c = sigmoid(lambda)^c uniform in [0.9, 0.999]: sigmoid(lambda) = a^(1/c).
  const at::Tensor a = at::empty_like(lambda).uniform_(0.9, 0.999, gen).pow(1.0 / kC);
  lambda.copy_(at::log(a) - at::log1p(-a));
}

at::Tensor RecurrentImpl::forward(const at::Tensor& x, bool sequential) {
  if (selective_) return from_projections(gate_proj(x), in_proj(x), sequential);
  const int64_t T = x.size(1);
  const at::Tensor gate = at::gelu(gate_proj(x), "tanh");
  const at::Tensor u = conv(in_proj(x).transpose(1, 2)).narrow(2, 0, T).transpose(1, 2);
  const at::Tensor r = at::sigmoid(rec_gate(u));
  const at::Tensor i = at::sigmoid(in_gate(u));
  return out_proj(gate * recur(u, r, i, sequential));
}

at::Tensor RecurrentImpl::from_projections(const at::Tensor& gate_in, const at::Tensor& in,
                                           bool sequential) {
  const int64_t T = in.size(1);
  const at::Tensor u = conv(in.transpose(1, 2)).narrow(2, 0, T).transpose(1, 2);
  const at::Tensor r_in = rec_gate(u);
  const at::Tensor i_in = in_gate(u);
  return detail::recompute_into_linear(
      [this, sequential](const std::vector<at::Tensor>& v) -> std::vector<at::Tensor> {
        const at::Tensor gate = at::gelu(v[0], "tanh");
        return {gate * recur(v[1], at::sigmoid(v[2]), at::sigmoid(v[3]), sequential)};
      },
      {gate_in, u, r_in, i_in, lambda}, {out_proj->weight})[0];
}

at::Tensor RecurrentImpl::recur(const at::Tensor& u, const at::Tensor& r, const at::Tensor& i,
                                bool sequential) {
  const int64_t B = u.size(0), T = u.size(1), W = config_.width;
  const at::Tensor log_a = -kC * r * at::softplus(-lambda);  // < 0
  // sqrt(1 - a^2) from expm1 (exact near a = 1); bounded below so its gradient stays finite
  // where a rounds to 1.
  const at::Tensor scale = at::sqrt(at::clamp_min(-at::expm1(2 * log_a), 1e-12));
  const at::Tensor v = scale * i * u;  // [B, T, W]
  if (!sequential) return ssd_diagonal(v, log_a, recipe::recurrence_scan_chunk(T, config_.chunk));
  std::vector<at::Tensor> hs;
  hs.reserve(static_cast<size_t>(T));
  at::Tensor state = at::zeros({B, W}, u.options());
  for (int64_t t = 0; t < T; ++t) {
    state = log_a.select(1, t).exp() * state + v.select(1, t);
    hs.push_back(state);
  }
  return at::stack(hs, 1);
}

}  // namespace megacpp::trainer
