// megacpp::trainer model — the recipe's model configuration and the decoder-only transformer.
//
// Contract: pure torch modules on CPU in float32. Construction is deterministic from a seed and
// never touches the global torch RNG; forward() does not block on anything but compute and
// issues no collective. Invalid configurations are rejected by validate() with
// Error{kInvalidArgument}; torch errors (c10::Error) from forward propagate. A module is used
// by one thread at a time; it lives as long as its owner (TrainStep, a test, a benchmark).
#pragma once

#include <cstdint>

#include <torch/torch.h>

#include "recipes/recipe.h"
#include "schemas/launch.capnp.h"

namespace megacpp::trainer {

// The recipe's own type (recipes/recipe.h), so a recipe, a launch spec and a test all build
// the same model.
using ModelConfig = recipe::ModelConfig;

using recipe::model_config;
// Throws Error{kInvalidArgument} naming the rule: every size > 0, d_model % n_heads == 0,
// an even head dimension (RoPE rotates pairs).
void validate(const ModelConfig& model);

// ---------------------------------------------------------------------------------------
// Model: decoder-only transformer. Embedding -> RMSNorm -> n_layers x [x + attn(norm(x)),
// x + mlp(norm(x))] -> RMSNorm -> untied head. Attention: fused QKV, QK-norm, RoPE, causal
// SDPA. MLP: relu(x)^2, hidden = mlp_mult * d_model. RMSNorm carries no weight. No biases.
// Parameter names: embed.weight, blocks.<i>.attn.qkv.weight, blocks.<i>.attn.proj.weight,
// blocks.<i>.mlp.fc.weight, blocks.<i>.mlp.proj.weight, head.weight.

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const ModelConfig& config);
  // x: [B, T, D]; cos, sin: [T, head_dim / 2].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear proj{nullptr};

 private:
  int64_t n_heads_;
  int64_t head_dim_;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const ModelConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear fc{nullptr};
  torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const ModelConfig& config);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  Attention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

class TransformerImpl : public torch::nn::Module {
 public:
  // Parameters are initialised deterministically from `seed` with a private generator
  // (the global torch RNG is neither read nor changed): same seed, same weights.
  TransformerImpl(const ModelConfig& config, uint32_t seed);
  // tokens: int64 [B, T] with T <= seq_len (any strides); returns float logits [B, T, V].
  at::Tensor forward(const at::Tensor& tokens);
  const ModelConfig& config() const noexcept { return config_; }

  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  ModelConfig config_;
  at::Tensor rope_cos_;  // [seq_len, head_dim / 2]
  at::Tensor rope_sin_;
};
TORCH_MODULE(Transformer);

}  // namespace megacpp::trainer
