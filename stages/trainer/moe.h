// megacpp::trainer mixture of experts — family E of a hybrid pattern when the recipe enables MoE:
// a router picks top_k of n_experts routed experts per token, plus an always-on shared expert.
//
//   probs = softmax(router(x))                         [N, E] (N = B * T tokens)
//   (w, e) = top_k(probs); w /= sum(w)                 each token's experts and their weights
//   y = sum_j w_j * expert_{e_j}(x) + shared(x)        experts: relu^2 MLPs (fc, proj)
//   aux = E * sum_e f_e * P_e                          f_e: share of the N * k assignments routed
//                                                      to e; P_e: mean router probability of e
//
// Dropless: every assignment is computed (no capacity factor, no token dropped). Tokens are
// sorted by expert and each expert runs one matrix product over its tokens; an expert that
// receives no token on this rank is not called, so its parameters get no gradient here — the
// rank-asymmetric case the distributed optimizers resolve with their has-grad mask.
//
// Contract: a torch module (float32 or float64, CPU or device); forward issues no collective and
// reads one small tensor back to the host (the per-expert token counts, to split the sorted
// tokens). Each expert is its own pair of 2-D parameters (experts.<e>.fc.weight [h, D],
// experts.<e>.proj.weight [D, h]), so DistMuon orthogonalizes every expert matrix alone, never an
// expert stack as one 3-D tensor. Parameter names: router.weight [E, D], experts.<e>.fc.weight,
// experts.<e>.proj.weight, shared.fc.weight [s, D], shared.proj.weight [D, s] (s > 0 only).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "recipes/recipe.h"

namespace megacpp::trainer {

// A relu^2 MLP: proj(relu(fc(x))^2), no biases. The A block's MLP, a dense E layer, an expert.
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(int64_t d_model, int64_t hidden);
  at::Tensor forward(const at::Tensor& x);
  // The rest of forward after fc: proj(relu(f)^2).
  at::Tensor from_fc(const at::Tensor& f);
  // Recompute relu^2 with proj, keeping the fc output (model.h "selective").
  void set_selective(bool on) noexcept { selective_ = on; }
  bool selective() const noexcept { return selective_; }

  torch::nn::Linear fc{nullptr};
  torch::nn::Linear proj{nullptr};

 private:
  bool selective_ = false;
};
TORCH_MODULE(Mlp);

class MoeImpl : public torch::nn::Module {
 public:
  // Throws Error{kInvalidArgument} unless n_experts >= 1, 1 <= top_k <= n_experts and
  // expert_hidden >= 1.
  MoeImpl(int64_t d_model, const recipe::MoeConfig& config);
  // x: [B, T, D] -> [B, T, D]. Sets aux_loss() and tokens_per_expert() for this call.
  at::Tensor forward(const at::Tensor& x);

  // The load-balancing loss of the last forward (0-D, differentiable through the router;
  // unweighted: the caller applies aux_loss_coef). Undefined before the first forward.
  const at::Tensor& aux_loss() const noexcept { return aux_loss_; }
  // int64 [E]: how many of the last forward's token assignments each expert received.
  const at::Tensor& tokens_per_expert() const noexcept { return tokens_per_expert_; }
  const recipe::MoeConfig& config() const noexcept { return config_; }
  // Every expert's and the shared expert's relu^2 recomputed (MlpImpl::set_selective).
  void set_selective(bool on);
  // Replaces aux_loss(): a block recomputed whole (model.h "full") takes its aux loss from its
  // region's output, and its recomputation in backward puts back the one forward recorded.
  void set_aux_loss(at::Tensor aux) { aux_loss_ = std::move(aux); }

  // The routing of `flat` [N, D]: its N * top_k assignments sorted by expert (stable: token
  // order within an expert), so expert e's assignments are one run of count[e]. Sets aux_loss()
  // and tokens_per_expert(); reads the per-expert counts back to the host once.
  struct Dispatch {
    at::Tensor order;            // int64 [N * k]: assignment indices (token = index / k)
    at::Tensor weights;          // [N * k]: each assignment's routing weight, unsorted
    std::vector<int64_t> count;  // assignments per expert
  };
  Dispatch dispatch(const at::Tensor& flat);
  // Experts [first, last) over their runs of `d`, each output times its weight and summed per
  // token: [N, D] (zeros where no assignment of these experts falls). forward() combines every
  // expert; the tensor-parallel forward (tensor_parallel.h) combines its rank's.
  at::Tensor combine(const Dispatch& d, const at::Tensor& flat, int64_t first, int64_t last);

  torch::nn::Linear router{nullptr};
  torch::nn::ModuleList experts{nullptr};
  Mlp shared{nullptr};

 private:
  void record_routing(const at::Tensor& probs, const at::Tensor& counts);

  recipe::MoeConfig config_;
  at::Tensor aux_loss_;
  at::Tensor tokens_per_expert_;
};
TORCH_MODULE(Moe);

// The same mixture computed densely (every expert on every token, weighted by a zero-filled
// top-k weight matrix): the reference the dropless forward is tested against.
at::Tensor moe_reference(MoeImpl& moe, const at::Tensor& x);

}  // namespace megacpp::trainer
