// The transformer and its configuration from the launch spec.
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include <fmt/format.h>

#include "core/error.h"
#include "stages/trainer/model.h"

namespace megacpp::trainer {

void validate(const ModelConfig& m) {
  MEGACPP_CHECK(m.vocab_size > 0 && m.seq_len > 0 && m.d_model > 0 && m.n_layers > 0 &&
                    m.n_heads > 0 && m.mlp_mult > 0,
                ErrorKind::kInvalidArgument,
                "model: vocabSize, seqLen, dModel, nLayers, nHeads and mlpMult must be > 0");
  MEGACPP_CHECK(
      m.d_model % m.n_heads == 0, ErrorKind::kInvalidArgument,
      fmt::format("model: dModel {} must be a multiple of nHeads {}", m.d_model, m.n_heads));
  MEGACPP_CHECK((m.d_model / m.n_heads) % 2 == 0, ErrorKind::kInvalidArgument,
                fmt::format("model: head dimension {} must be even (RoPE)", m.d_model / m.n_heads));
}

namespace {

torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

at::Tensor rms_norm(const at::Tensor& x) {
  return at::rms_norm(x, {x.size(-1)}, {}, 1e-6);
}

// Rotates pairs (x[..., i], x[..., i + half]) by the position's angle. x: [B, H, T, hd].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const auto x1 = x.narrow(-1, 0, half);
  const auto x2 = x.narrow(-1, half, half);
  return torch::cat({x1 * cos + x2 * sin, x2 * cos - x1 * sin}, -1);
}

}  // namespace

AttentionImpl::AttentionImpl(const ModelConfig& c)
    : n_heads_(c.n_heads), head_dim_(c.d_model / c.n_heads) {
  qkv = register_module("qkv", linear(c.d_model, 3 * int64_t{c.d_model}));
  proj = register_module("proj", linear(c.d_model, c.d_model));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  // [B, T, 3, H, hd] -> 3 x [B, H, T, hd]
  const auto parts = qkv(x).view({B, T, 3, n_heads_, head_dim_}).permute({2, 0, 3, 1, 4}).unbind(0);
  const auto q = rope(rms_norm(parts[0]), cos, sin);
  const auto k = rope(rms_norm(parts[1]), cos, sin);
  const auto y = at::scaled_dot_product_attention(q, k, parts[2], /*attn_mask=*/{},
                                                  /*dropout_p=*/0.0, /*is_causal=*/true);
  return proj(y.transpose(1, 2).reshape({B, T, D}));
}

MlpImpl::MlpImpl(const ModelConfig& c) {
  const int64_t hidden = int64_t{c.mlp_mult} * c.d_model;
  fc = register_module("fc", linear(c.d_model, hidden));
  proj = register_module("proj", linear(hidden, c.d_model));
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  return proj(torch::relu(fc(x)).square());
}

BlockImpl::BlockImpl(const ModelConfig& c) {
  attn = register_module("attn", Attention(c));
  mlp = register_module("mlp", Mlp(c));
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto h = x + attn(rms_norm(x), cos, sin);
  return h + mlp(rms_norm(h));
}

TransformerImpl::TransformerImpl(const ModelConfig& c, uint32_t seed) : config_(c) {
  validate(c);
  embed = register_module("embed", torch::nn::Embedding(c.vocab_size, c.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (uint32_t i = 0; i < c.n_layers; ++i) blocks->push_back(Block(c));
  head = register_module("head", linear(c.d_model, c.vocab_size));

  const int64_t half = c.d_model / c.n_heads / 2;
  const auto inv_freq =
      torch::pow(10000.0, -torch::arange(half, torch::kFloat64) / static_cast<double>(half));
  const auto angles = torch::outer(torch::arange(int64_t{c.seq_len}, torch::kFloat64), inv_freq);
  rope_cos_ = register_buffer("rope_cos", angles.cos().to(torch::kFloat32));
  rope_sin_ = register_buffer("rope_sin", angles.sin().to(torch::kFloat32));

  // Init: embedding N(0, 1); input projections U(+-sqrt(3 / fan_in)) (unit-variance
  // outputs); residual output projections zero (each block starts as the identity); head
  // N(0, 0.001). Drawn in registration order from one private generator.
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    if (name == "embed.weight") {
      p.normal_(0.0, 1.0, gen);
    } else if (name == "head.weight") {
      p.normal_(0.0, 0.001, gen);
    } else if (name.ends_with(".proj.weight")) {
      p.zero_();
    } else {
      const double bound = std::sqrt(3.0 / static_cast<double>(p.size(1)));
      p.uniform_(-bound, bound, gen);
    }
  }
}

at::Tensor TransformerImpl::forward(const at::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  MEGACPP_CHECK(T >= 1 && T <= config_.seq_len, ErrorKind::kInvalidArgument,
                fmt::format("sequence length {} outside [1, {}]", T, config_.seq_len));
  const auto cos = rope_cos_.narrow(0, 0, T);
  const auto sin = rope_sin_.narrow(0, 0, T);
  auto x = rms_norm(embed(tokens));
  for (const auto& block : *blocks) x = block->as<Block>()->forward(x, cos, sin);
  return head(rms_norm(x));
}

}  // namespace megacpp::trainer
