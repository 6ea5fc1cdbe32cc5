// megacpp::trainer activation recomputation (recipe key train.recompute) — internal to the
// trainer: the regions the model's forward (model.cpp, moe.cpp, mamba.cpp, recurrent.cpp,
// tensor_parallel.cpp) runs without keeping their intermediates for backward.
//
// A region is a function of tensors to tensors. Its forward runs under no-grad and keeps only
// its inputs; its backward runs the function again with grad enabled on detached copies of the
// inputs and back-propagates the incoming gradients through that graph (torch::autograd::grad),
// returning each input's gradient to the outer graph. Parameters used inside a region are passed
// among its inputs; a leaf that requires grad is handed to the function as itself (not a detached
// copy), so the function may as well use its module's member. Its gradient is computed by the
// region, not accumulated there, and reaches the parameter through the outer graph as it would
// without recomputation. Inputs that do not require grad get no gradient; outputs whose gradient
// is undefined contribute nothing (not zeros).
//
// Bit-identity: the recomputation runs the same ops on the same values in the same order, so a
// region's outputs and gradients equal the unrecomputed ones bit for bit. That holds only for a
// deterministic, RNG-free function: the model has no dropout and draws no random number in
// forward. A function must not change state seen outside it (the MoE layer's aux loss is put back
// by its caller, model.cpp).
//
// Collectives: no region issues one. The tensor-parallel forward keeps gather_sequence,
// reduce_scatter_sequence and all_reduce_sum between regions and recomputes only the local
// compute between them, so backward issues exactly the collectives it issues without
// recomputation, in the same order on every rank.
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace megacpp::trainer::detail {

using RegionFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// fn(inputs), keeping only `inputs`; recomputed in backward.
std::vector<at::Tensor> recompute(RegionFn fn, std::vector<at::Tensor> inputs);

// at::linear(s, w) for each w of `weights` (2-D, no bias), where s = fn(inputs)[0], followed by
// fn's other outputs: the tail s is not kept. Backward recomputes s and applies the product's
// backward directly — the forward product is not run again — with the matrix products autograd's
// MmBackward0 runs, in the same layouts, so the gradients are autograd's bit for bit. s must be
// contiguous (every tail here ends in an element-wise op or a norm).
std::vector<at::Tensor> recompute_into_linear(RegionFn fn, std::vector<at::Tensor> inputs,
                                              std::vector<at::Tensor> weights);

// The element-wise tails the model recomputes under "selective"; relu2_linear and qk_norm_rope
// compute as without recomputation when `selective` is false.
// The projections of rms_norm(x) by each of `weights`, then x passed through for the block's
// residual (use it, not x, there: x's gradient then sums its terms in the unrecomputed order).
// The norm's output is not kept.
std::vector<at::Tensor> norm_linear(const at::Tensor& x, std::vector<at::Tensor> weights);
// linear(relu(f)^2, w): keeps f, the fc output.
at::Tensor relu2_linear(const at::Tensor& f, const at::Tensor& w, bool selective);
// QK-norm and RoPE of q, k [B, H, T, hd]: keeps q and k (views of the qkv output).
std::pair<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin,
                                               bool selective);

}  // namespace megacpp::trainer::detail
