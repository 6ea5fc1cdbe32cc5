// megacpp::trainer tensor parallelism — the compute of the nemo_native layout (DESIGN.md "Hybrid
// recipes"): tensor parallel `tp` with sequence parallelism over a c10d group of `tp` ranks that
// all train on the same batch.
//
// Between blocks every rank holds its sequence shard [B, T/tp, D] (positions rank*T/tp onward):
// the residual stream, the norms, the embedding and the head (sequence parallelism). A block
// all-gathers its normed input along the sequence, runs its share — whole attention heads
// (column-parallel qkv, row-parallel proj), a slice of the MLP's hidden units, its routed experts
// (n_experts / tp, whole) and a slice of the shared expert, whole Mamba heads (B and C, shared by
// every head, are computed by every rank; the gated norm sums its squares across the group) —
// and reduce-scatters its partial output back to sequence shards. Each rank's loss is the
// cross-entropy summed over its shard, divided by the tokens of the whole batch, so the group's
// losses add up to the batch mean; the MoE balancing loss, computed whole on every rank, counts
// 1/tp on each.
//
// Parameters are held whole on every rank of the group (a rank computes with views of its
// slices); reduce_gradients() sums every gradient over the group after backward, so each rank
// ends with the gradient of the whole batch and the optimizers (over the data-parallel group)
// step identical parameters. What this layout shares out is the compute and the activations;
// parameter and optimizer memory is not yet divided by tp (recipes/plan.h still plans it so).
//
// Contract: every call is a collective of the group (same order on every rank); failures are
// run_collective's (Error{kPeerFailure} / {kTimeout}). The TensorParallel object must outlive
// every autograd graph built with it (its backward functions issue collectives on the group).
// The recurrence block (R) has no tensor-parallel form: nemo_native runs R on the Mamba block.
//
// Recomputation (model.h, recompute.h) keeps every collective outside its regions, so backward
// issues the collectives it issues without it. full: each branch's local compute between its
// gather and its reduce-scatter is one region (kept: the block input, the gathered normed input;
// the Mamba branch, split by its norm's all-reduce, also keeps the gated product and the mean of
// squares). selective: the tails of the one-rank model but the block norms, whose output only
// the all-gather reads and nothing keeps.
#pragma once

#include <cstdint>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "stages/trainer/model.h"

namespace megacpp::trainer {

struct TensorParallel {
  c10::intrusive_ptr<c10d::Backend> group;  // the tp ranks sharing a batch; null when size 1
  uint32_t rank = 0;
  uint32_t size = 1;
};

// Autograd collectives over the group along dim 1 (the sequence).
// [B, t, ...] -> [B, t * size, ...] (rank order); backward: the summed gradient's shard.
at::Tensor gather_sequence(const at::Tensor& x, const TensorParallel& tp);
// [B, T, ...] partial sums -> this rank's shard [B, T / size, ...] of their sum; backward:
// all-gather.
at::Tensor reduce_scatter_sequence(const at::Tensor& x, const TensorParallel& tp);
// The sum over the group; backward: the sum of the gradients over the group.
at::Tensor all_reduce_sum(const at::Tensor& x, const TensorParallel& tp);

// This rank's logits [B, T / size, V] for its sequence shard of `tokens` [B, T] (the same on
// every rank of the group). Throws Error{kInvalidArgument} when a dimension does not split
// evenly (the plan's gates name the same rules) or a layer is a recurrence block.
at::Tensor forward_tensor_parallel(TransformerImpl& model, const at::Tensor& tokens,
                                   const TensorParallel& tp);

// Sums every parameter's gradient over the group (undefined counts as zero); a parameter that
// no rank of the group has a gradient for keeps an undefined gradient. One all-reduce.
void reduce_gradients(const std::vector<at::Tensor>& params, const TensorParallel& tp);

}  // namespace megacpp::trainer
