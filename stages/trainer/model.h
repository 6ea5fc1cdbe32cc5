// megacpp::trainer model — the recipe's model configuration and the decoder-only hybrid model.
//
// Contract: pure torch modules on CPU in float32. Construction is deterministic from a seed and
// never touches the global torch RNG; forward() does not block on anything but compute and
// issues no collective. Invalid configurations are rejected by validate() with
// Error{kInvalidArgument}; torch errors (c10::Error) from forward propagate. A module is used
// by one thread at a time; it lives as long as its owner (TrainStep, a test, a benchmark).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "recipes/recipe.h"
#include "schemas/launch.capnp.h"
#include "stages/trainer/mamba.h"
#include "stages/trainer/moe.h"
#include "stages/trainer/recurrent.h"

namespace megacpp::trainer {

// The recipe's own type (recipes/recipe.h), so a recipe, a launch spec and a test all build
// the same model.
using ModelConfig = recipe::ModelConfig;

using recipe::model_config;
// Throws Error{kInvalidArgument} naming the rule: every size > 0 but seq_len (the recipe rule
// model.seq_len bounds it, once; forward() refuses a longer sequence), d_model % n_heads == 0,
// an even head dimension (RoPE rotates pairs), n_kv_heads dividing n_heads, one block per layer,
// and a valid configuration for each block kind the layers use.
void validate(const ModelConfig& model);

// ---------------------------------------------------------------------------------------
// Model: decoder-only. Embedding -> RMSNorm -> n_layers blocks -> RMSNorm -> untied head. A
// layer's block is config.block(i) (recipes/recipe.h):
//   A  x + attn(norm(x)), then x + mlp(norm(x))     attention: fused QKV with n_kv_heads key/value
//                                                   heads (grouped-query), QK-norm, RoPE with
//                                                   rope_theta, causal SDPA; MLP relu^2, ffn()
//   E  x + moe(norm(x))                             moe.h
//   F  x + mlp(norm(x))                             an E layer with MoE off
//   M  x + mamba(norm(x))                           mamba.h
//   R  x + rnn(norm(x))                             recurrent.h
// RMSNorm carries no weight (the Mamba block's inner norm does). No biases outside M and R.
//
// Activation recomputation (train.recompute, set_recompute; the regions are recompute.h's):
//   none       every tensor autograd saves is kept (no region).
//   full       each block's forward (norms, mixer, MLP, residuals) is one region: the block's
//              input is kept, its forward runs again in backward. The MoE layer's aux loss is an
//              output of its block's region.
//   selective  every matrix product's output is kept, the element-wise tails between products
//              are recomputed and their results not kept:
//                A, F  each RMSNorm with the projection(s) it feeds (keeps the block or branch
//                      input); QK-norm + RoPE (keeps q and k); relu^2 with the MLP's proj (keeps
//                      the fc output)
//                E     each expert's and the shared expert's relu^2 with its proj; the norm
//                      output is kept (the router, the token gather and the shared expert read it)
//                M     the norm with in_proj; conv, SiLU, the SSD scan and the gated norm with
//                      out_proj (keeps in_proj's output)
//                R     the norm with gate_proj and in_proj; the gates, the scan and the gating
//                      with out_proj (keeps gate_proj's output, the conv output u and the two
//                      gate projections; the conv keeps in_proj's output)
// The three give the same losses and gradients bit for bit (recompute.h). The model has no
// dropout: every region is RNG-free.
// Parameter names: embed.weight, blocks.<i>.attn.qkv.weight, blocks.<i>.attn.proj.weight,
// blocks.<i>.mlp.{fc,proj}.weight, blocks.<i>.moe.* (moe.h), blocks.<i>.mamba.* (mamba.h),
// blocks.<i>.rnn.* (recurrent.h), head.weight.

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const ModelConfig& config);
  // x: [B, T, D]; cos, sin: [T, head_dim / 2].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  // The rest of forward after the qkv projection: qkv_out [B, T, (H + 2 KV) hd].
  at::Tensor from_qkv(const at::Tensor& qkv_out, const at::Tensor& cos, const at::Tensor& sin);
  // Recompute QK-norm and RoPE (the block's "selective").
  void set_selective(bool on) noexcept { selective_ = on; }
  bool selective() const noexcept { return selective_; }

  torch::nn::Linear qkv{nullptr};  // [(n_heads + 2 n_kv_heads) * head_dim, D]: q, k, v rows
  torch::nn::Linear proj{nullptr};

 private:
  int64_t n_heads_;
  int64_t n_kv_heads_;
  int64_t head_dim_;
  bool selective_ = false;
};
TORCH_MODULE(Attention);

class BlockImpl : public torch::nn::Module {
 public:
  // `kind` is one of recipe::kBlock*.
  BlockImpl(const ModelConfig& config, char kind);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  // Draws this block's parameters from `gen` (registration order), residual outputs zero.
  void initialise(at::Generator& gen);
  char kind() const noexcept { return kind_; }
  // Sets this block's mode and its mixers' selective regions (see above).
  void set_recompute(recipe::Recompute mode);
  recipe::Recompute recompute() const noexcept { return recompute_; }

  Attention attn{nullptr};
  Mlp mlp{nullptr};
  Moe moe{nullptr};
  Mamba mamba{nullptr};
  Recurrent rnn{nullptr};

 private:
  at::Tensor forward_none(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  at::Tensor forward_selective(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  at::Tensor forward_full(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  char kind_;
  recipe::Recompute recompute_ = recipe::Recompute::kNone;
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
  // train.recompute for every block (none at construction); forward and the tensor-parallel
  // forward follow it.
  void set_recompute(recipe::Recompute mode);
  recipe::Recompute recompute() const noexcept { return recompute_; }
  // The MoE layers' load-balancing losses of the last forward, each times aux_loss_coef, summed
  // (0-D, differentiable); undefined when the model has no MoE layer.
  at::Tensor aux_loss() const;
  // Per MoE layer, in layer order: int64 [n_experts] token assignments of the last forward.
  std::vector<at::Tensor> tokens_per_expert() const;
  // The RoPE tables of the first T positions: cos, sin [T, head_dim / 2].
  std::pair<at::Tensor, at::Tensor> rope(int64_t T) const {
    return {rope_cos_.narrow(0, 0, T), rope_sin_.narrow(0, 0, T)};
  }

  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  ModelConfig config_;
  recipe::Recompute recompute_ = recipe::Recompute::kNone;
  at::Tensor rope_cos_;  // [seq_len, head_dim / 2]
  at::Tensor rope_sin_;
};
TORCH_MODULE(Transformer);

}  // namespace megacpp::trainer
