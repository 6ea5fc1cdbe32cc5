// megacpp::trainer SSD scan — the selective state-space recurrence of the Mamba-2 block (family
// M of a hybrid pattern), computed by chunks in its state-space-dual form: within a chunk, a
// decay-weighted causal product (matrix multiplications); across chunks, a short recurrence over
// the chunks' final states.
//
// The recurrence, for each batch row and head, with a state S of [head_dim P, state_dim N]:
//   S_t = exp(a_t) S_{t-1} + x_t B_t^T        y_t = S_t C_t
// where a_t = dt_t * A <= 0 is the step's log-decay and x_t = dt_t * u_t the step's input.
//
// Contract: pure functions of their tensors (float32 or float64, one device), differentiable by
// autograd (cumsum, exp, einsum, masked_fill: no custom backward). Shapes: x [B, L, H, P],
// a [B, L, H], b and c [B, L, H, N] (a group's B and C expanded to its heads), initial_state
// [B, H, P, N] or undefined (zeros). L need not be a multiple of `chunk`: the tail is padded with
// steps that neither decay nor add. A shape mismatch is Error{kInvalidArgument}.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

namespace megacpp::trainer {

struct SsdResult {
  at::Tensor y;            // [B, L, H, P]
  at::Tensor final_state;  // [B, H, P, N]: the state after step L, for the next segment
};

// The chunked (state-space-dual) scan; `chunk` > 0 steps per chunk.
SsdResult ssd_chunked(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& c, int64_t chunk, const at::Tensor& initial_state = {});

// The scan of a diagonal recurrence, h_t = exp(a_t) h_{t-1} + x_t per channel (the SSD scan with
// head_dim = state_dim = 1 and b = c = 1, as the R block runs it): x and a [B, L, W], returns
// h [B, L, W]. The same chunked algorithm without the outer products: within a chunk the decay
// matrix times the inputs, across chunks the chunks' final states.
at::Tensor ssd_diagonal(const at::Tensor& x, const at::Tensor& a, int64_t chunk);

// The same recurrence one step at a time: the reference the chunked scan is tested against
// (and the peer of its benchmark).
SsdResult ssd_sequential(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                         const at::Tensor& c, const at::Tensor& initial_state = {});

}  // namespace megacpp::trainer
