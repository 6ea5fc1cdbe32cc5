// megacpp::trainer model internals shared by the model's translation units (model.cpp, moe.cpp,
// tensor_parallel.cpp): not part of the trainer's public interface.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <torch/torch.h>

namespace megacpp::trainer {
class BlockImpl;
}  // namespace megacpp::trainer

namespace megacpp::trainer::detail {

// A bias-free linear layer (every projection outside the M and R blocks).
inline torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

// RMSNorm over the last dimension, without a weight.
inline at::Tensor rms_norm(const at::Tensor& x) {
  return at::rms_norm(x, {x.size(-1)}, {}, 1e-6);
}

// Rotates pairs (x[..., i], x[..., i + half]) by the position's angle. x: [B, H, T, hd]; cos,
// sin: [T, hd / 2].
inline at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const auto x1 = x.narrow(-1, 0, half);
  const auto x2 = x.narrow(-1, half, half);
  return torch::cat({x1 * cos + x2 * sin, x2 * cos - x1 * sin}, -1);
}

// train.recompute = full: `body(inputs)` as one recomputed region (recompute.h) whose inputs are
// `inputs` followed by `block`'s parameters. The MoE layer's aux loss is the region's second
// output: the recomputation in backward puts back the one the forward recorded. `body` must
// capture by value what it reads (it runs again in backward). BlockImpl's full forward and the
// tensor-parallel branch's use it (model.cpp).
at::Tensor recompute_block(BlockImpl& block, std::vector<at::Tensor> inputs,
                           std::function<at::Tensor(const std::vector<at::Tensor>&)> body);

}  // namespace megacpp::trainer::detail
