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
// Weight shards: shard_model() cuts every split matrix to this rank's slice, so a rank holds
// (and computes gradients for) only its part: attention's q, k and v rows of its heads and
// proj's matching columns, the MLP's (and the shared expert's) hidden rows of fc and columns
// of proj, Mamba in_proj's z, x and dt rows of its heads (B and C rows whole on every rank) and
// out_proj's columns, and only its routed experts (the others' tensors are empty). Everything
// else — embedding, head, router, Mamba's conv, dt_bias, A_log, D and norm weight — is whole on
// every rank. reduce_gradients() sums over the group the gradients every rank holds whole or
// in part (the whole parameters, the B and C rows), so those are the whole batch's; a slice's
// gradient already is. The optimizers then step: DistAdamW the whole parameters over the
// data-parallel group, DistMuon every matrix whole over the job's group (optim.h MatrixPart).
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
#include <map>
#include <string>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "stages/trainer/model.h"
#include "stages/trainer/optim.h"

namespace megacpp::trainer {

struct TensorParallel {
  c10::intrusive_ptr<c10d::Backend> group = {};  // the tp ranks sharing a batch; null when size 1
  uint32_t rank = 0;
  uint32_t size = 1;
  // Every rank of the job (data parallel x tensor parallel, rank = dp_rank * size + rank):
  // DistMuon steps the split matrices over it. Null: the job is this group (one replica).
  c10::intrusive_ptr<c10d::Backend> job = {};
};

// Cuts the model's split matrices to this rank's slices (Tensor::set_data: the modules keep
// their parameters, now of the slice's shape; a routed expert of another rank becomes an empty
// [0, cols] tensor) and returns, by parameter name, the part of the whole matrix each of those
// holds (the optimizer's MatrixPart; parameters not named are whole on every rank). Call once,
// on the model every rank initialised alike, before the optimizers take its parameters;
// afterwards the model computes through forward_tensor_parallel only. Throws
// Error{kInvalidArgument} when a dimension does not split evenly or a layer is a recurrence
// block.
std::map<std::string, MatrixPart> shard_model(TransformerImpl& model, const TensorParallel& tp);

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

// Sums over the group every gradient of `params` (undefined counts as zero; a parameter that no
// rank of the group has a gradient for keeps an undefined gradient) and every tensor of
// `blocks` (defined gradient views, summed in place). One all-reduce.
void reduce_gradients(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& blocks,
                      const TensorParallel& tp);

}  // namespace megacpp::trainer
