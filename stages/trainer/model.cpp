// The transformer and its configuration from the launch spec.
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "stages/trainer/model.h"
#include "stages/trainer/model_internal.h"
#include "stages/trainer/recompute.h"

namespace megacpp::trainer {

void validate(const ModelConfig& m) {
  // seq_len is the recipe rule's (model.seq_len >= 2, checked once when the recipe is resolved;
  // forward() refuses a sequence longer than it).
  MEGACPP_CHECK(
      m.vocab_size > 0 && m.d_model > 0 && m.n_layers > 0 && m.n_heads > 0 && m.mlp_mult > 0,
      ErrorKind::kInvalidArgument,
      "model: vocabSize, dModel, nLayers, nHeads and mlpMult must be > 0");
  MEGACPP_CHECK(
      m.d_model % m.n_heads == 0, ErrorKind::kInvalidArgument,
      fmt::format("model: dModel {} must be a multiple of nHeads {}", m.d_model, m.n_heads));
  MEGACPP_CHECK((m.d_model / m.n_heads) % 2 == 0, ErrorKind::kInvalidArgument,
                fmt::format("model: head dimension {} must be even (RoPE)", m.d_model / m.n_heads));
  MEGACPP_CHECK(m.kv_heads() <= m.n_heads && m.n_heads % m.kv_heads() == 0,
                ErrorKind::kInvalidArgument,
                fmt::format("model: nKvHeads {} must divide nHeads {}", m.kv_heads(), m.n_heads));
  MEGACPP_CHECK(m.rope_theta > 0, ErrorKind::kInvalidArgument, "model: ropeTheta must be > 0");
  MEGACPP_CHECK(m.blocks.empty() || m.blocks.size() == m.n_layers, ErrorKind::kInvalidArgument,
                fmt::format("model: {} blocks for {} layers", m.blocks.size(), m.n_layers));
  for (char b : m.blocks) {
    MEGACPP_CHECK(std::string_view("AEFMR").find(b) != std::string_view::npos,
                  ErrorKind::kInvalidArgument, fmt::format("model: unknown block kind '{}'", b));
  }
}

using detail::linear;
using detail::rms_norm;
using detail::rope;

AttentionImpl::AttentionImpl(const ModelConfig& c)
    : n_heads_(c.n_heads), n_kv_heads_(c.kv_heads()), head_dim_(c.head_dim()) {
  qkv = register_module("qkv", linear(c.d_model, (n_heads_ + 2 * n_kv_heads_) * head_dim_));
  proj = register_module("proj", linear(n_heads_ * head_dim_, c.d_model));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin) {
  return from_qkv(qkv(x), cos, sin);
}

at::Tensor AttentionImpl::from_qkv(const at::Tensor& qkv_out, const at::Tensor& cos,
                                   const at::Tensor& sin) {
  const int64_t B = qkv_out.size(0), T = qkv_out.size(1);
  const int64_t q_width = n_heads_ * head_dim_, kv_width = n_kv_heads_ * head_dim_;
  at::Tensor q, k, v;
  if (n_kv_heads_ == n_heads_) {
    // [B, T, 3, H, hd] -> 3 x [B, H, T, hd]
    const auto parts =
        qkv_out.view({B, T, 3, n_heads_, head_dim_}).permute({2, 0, 3, 1, 4}).unbind(0);
    q = parts[0], k = parts[1], v = parts[2];
  } else {
    const auto parts = qkv_out.split_with_sizes({q_width, kv_width, kv_width}, -1);
    q = parts[0].view({B, T, n_heads_, head_dim_}).transpose(1, 2);
    k = parts[1].view({B, T, n_kv_heads_, head_dim_}).transpose(1, 2);
    v = parts[2].view({B, T, n_kv_heads_, head_dim_}).transpose(1, 2);
  }
  std::tie(q, k) = detail::qk_norm_rope(q, k, cos, sin, selective_);
  const auto y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                  /*is_causal=*/true, /*scale=*/{},
                                                  /*enable_gqa=*/n_kv_heads_ != n_heads_);
  return proj(y.transpose(1, 2).reshape({B, T, q_width}));
}

BlockImpl::BlockImpl(const ModelConfig& c, char kind) : kind_(kind) {
  switch (kind) {
    case recipe::kBlockAttention:
      attn = register_module("attn", Attention(c));
      mlp = register_module("mlp", Mlp(c.d_model, c.ffn()));
      break;
    case recipe::kBlockMoe:
      moe = register_module("moe", Moe(c.d_model, c.moe));
      break;
    case recipe::kBlockMlp:
      mlp = register_module("mlp", Mlp(c.d_model, c.ffn()));
      break;
    case recipe::kBlockMamba:
      mamba = register_module("mamba", Mamba(MambaConfig{.d_model = c.d_model,
                                                         .d_state = c.ssm.d_state,
                                                         .head_dim = c.ssm.head_dim,
                                                         .expand = c.ssm.expand,
                                                         .conv_kernel = c.ssm.conv_kernel,
                                                         .chunk = c.ssm.chunk}));
      break;
    case recipe::kBlockRecurrent:
      rnn = register_module("rnn", Recurrent(RecurrentConfig{.d_model = c.d_model,
                                                             .width = c.rnn_width(),
                                                             .conv_kernel = c.rnn.conv_kernel,
                                                             .chunk = c.ssm.chunk}));
      break;
    default:
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "model: unknown block kind '{}'", kind);
  }
}

void BlockImpl::initialise(at::Generator& gen) {
  if (mamba) return mamba->initialise(gen, /*zero_out=*/true);
  if (rnn) return rnn->initialise(gen, /*zero_out=*/true);
  // Input projections (qkv, fc, the router) U(+-sqrt(3 / fan_in)): unit-variance outputs;
  // residual output projections zero: the block starts as the identity.
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    at::Tensor& p = item.value();
    if (item.key().ends_with("proj.weight")) {
      p.zero_();
    } else {
      const double bound = std::sqrt(3.0 / static_cast<double>(p.size(1)));
      p.uniform_(-bound, bound, gen);
    }
  }
}

void BlockImpl::set_recompute(recipe::Recompute mode) {
  recompute_ = mode;
  const bool selective = mode == recipe::Recompute::kSelective;
  if (attn) attn->set_selective(selective);
  if (mlp) mlp->set_selective(selective);
  if (moe) moe->set_selective(selective);
  if (mamba) mamba->set_selective(selective);
  if (rnn) rnn->set_selective(selective);
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  switch (recompute_) {
    case recipe::Recompute::kFull:
      return forward_full(x, cos, sin);
    case recipe::Recompute::kSelective:
      return forward_selective(x, cos, sin);
    default:
      return forward_none(x, cos, sin);
  }
}

at::Tensor BlockImpl::forward_none(const at::Tensor& x, const at::Tensor& cos,
                                   const at::Tensor& sin) {
  switch (kind_) {
    case recipe::kBlockAttention: {
      const auto h = x + attn(rms_norm(x), cos, sin);
      return h + mlp(rms_norm(h));
    }
    case recipe::kBlockMoe:
      return x + moe(rms_norm(x));
    case recipe::kBlockMlp:
      return x + mlp(rms_norm(x));
    case recipe::kBlockMamba:
      return x + mamba(rms_norm(x));
    default:
      return x + rnn(rms_norm(x));
  }
}

at::Tensor BlockImpl::forward_selective(const at::Tensor& x, const at::Tensor& cos,
                                        const at::Tensor& sin) {
  using detail::norm_linear;
  // norm_linear's last output is x passed through for the residual.
  switch (kind_) {
    case recipe::kBlockAttention: {
      const auto a = norm_linear(x, {attn->qkv->weight});
      const auto h = a[1] + attn->from_qkv(a[0], cos, sin);
      const auto m = norm_linear(h, {mlp->fc->weight});
      return m[1] + mlp->from_fc(m[0]);
    }
    case recipe::kBlockMoe:
      return x + moe(rms_norm(x));
    case recipe::kBlockMlp: {
      const auto m = norm_linear(x, {mlp->fc->weight});
      return m[1] + mlp->from_fc(m[0]);
    }
    case recipe::kBlockMamba: {
      const auto m = norm_linear(x, {mamba->in_proj->weight});
      return m[1] + mamba->from_in_proj(m[0]);
    }
    default: {
      const auto p = norm_linear(x, {rnn->gate_proj->weight, rnn->in_proj->weight});
      return p[2] + rnn->from_projections(p[0], p[1]);
    }
  }
}

at::Tensor detail::recompute_block(BlockImpl& block, std::vector<at::Tensor> inputs,
                                   std::function<at::Tensor(const std::vector<at::Tensor>&)> body) {
  for (const at::Tensor& p : block.parameters()) inputs.push_back(p);
  MoeImpl* moe = block.moe ? block.moe.get() : nullptr;
  const auto out = detail::recompute(
      [body = std::move(body), moe](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
        if (!moe) return {body(in)};
        const at::Tensor recorded = moe->aux_loss();
        at::Tensor y = body(in);
        at::Tensor aux = moe->aux_loss();
        moe->set_aux_loss(recorded);
        return {std::move(y), std::move(aux)};
      },
      std::move(inputs));
  if (moe) moe->set_aux_loss(out[1]);
  return out[0];
}

at::Tensor BlockImpl::forward_full(const at::Tensor& x, const at::Tensor& cos,
                                   const at::Tensor& sin) {
  return detail::recompute_block(*this, {x, cos, sin}, [this](const std::vector<at::Tensor>& in) {
    return forward_none(in[0], in[1], in[2]);
  });
}

TransformerImpl::TransformerImpl(const ModelConfig& c, uint32_t seed) : config_(c) {
  validate(c);
  embed = register_module("embed", torch::nn::Embedding(c.vocab_size, c.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (uint32_t i = 0; i < c.n_layers; ++i) blocks->push_back(Block(c, c.block(i)));
  head = register_module("head", linear(c.d_model, c.vocab_size));

  const int64_t half = c.head_dim() / 2;
  const auto inv_freq =
      torch::pow(c.rope_theta, -torch::arange(half, torch::kFloat64) / static_cast<double>(half));
  const auto angles = torch::outer(torch::arange(int64_t{c.seq_len}, torch::kFloat64), inv_freq);
  rope_cos_ = register_buffer("rope_cos", angles.cos().to(torch::kFloat32));
  rope_sin_ = register_buffer("rope_sin", angles.sin().to(torch::kFloat32));

  // Init, drawn in registration order from one private generator: embedding N(0, 1); each
  // block as BlockImpl::initialise; head N(0, 0.001).
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  embed->weight.normal_(0.0, 1.0, gen);
  for (const auto& block : *blocks) block->as<Block>()->initialise(gen);
  head->weight.normal_(0.0, 0.001, gen);
}

void TransformerImpl::set_recompute(recipe::Recompute mode) {
  recompute_ = mode;
  for (const auto& block : *blocks) block->as<Block>()->set_recompute(mode);
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

at::Tensor TransformerImpl::aux_loss() const {
  at::Tensor total;
  for (const auto& block : *blocks) {
    const auto* b = block->as<Block>();
    if (!b->moe || !b->moe->aux_loss().defined()) continue;
    const at::Tensor term = b->moe->aux_loss() * config_.moe.aux_loss_coef;
    total = total.defined() ? total + term : term;
  }
  return total;
}

std::vector<at::Tensor> TransformerImpl::tokens_per_expert() const {
  std::vector<at::Tensor> out;
  for (const auto& block : *blocks) {
    const auto* b = block->as<Block>();
    if (b->moe && b->moe->tokens_per_expert().defined()) out.push_back(b->moe->tokens_per_expert());
  }
  return out;
}

}  // namespace megacpp::trainer
