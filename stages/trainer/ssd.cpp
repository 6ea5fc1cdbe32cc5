#include "stages/trainer/ssd.h"

#include <limits>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"

namespace megacpp::trainer {

namespace {

void check_shapes(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                  const at::Tensor& c, const at::Tensor& initial_state) {
  const bool ok = x.dim() == 4 && a.dim() == 3 && b.dim() == 4 && c.dim() == 4 &&
                  a.sizes() == x.sizes().slice(0, 3) &&
                  b.sizes().slice(0, 3) == x.sizes().slice(0, 3) && c.sizes() == b.sizes() &&
                  (!initial_state.defined() ||
                   initial_state.sizes().vec() ==
                       std::vector<int64_t>{x.size(0), x.size(2), x.size(3), b.size(3)});
  MEGACPP_CHECK(ok, ErrorKind::kInvalidArgument,
                fmt::format("ssd: x [B, L, H, P], a [B, L, H], b and c [B, L, H, N] and the "
                            "initial state [B, H, P, N] disagree: x {}, a {}, b {}, c {}, state {}",
                            c10::str(x.sizes()), c10::str(a.sizes()), c10::str(b.sizes()),
                            c10::str(c.sizes()),
                            initial_state.defined() ? c10::str(initial_state.sizes()) : "none"));
}

// out[..., i, j] = x[..., j+1] + ... + x[..., i] for i >= j (0 on the diagonal), -inf above it:
// the log of the decay from step j to step i. Summed from the masked terms rather than as a
// difference of two cumulative sums, which would cancel catastrophically over long chunks.
at::Tensor segment_sums(const at::Tensor& x) {
  const int64_t T = x.size(-1);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.push_back(T);
  const auto bools = at::TensorOptions().dtype(at::kBool).device(x.device());
  const at::Tensor strictly_below = at::ones({T, T}, bools).tril(-1);
  const at::Tensor on_or_below = at::ones({T, T}, bools).tril(0);
  at::Tensor terms = x.unsqueeze(-1).expand(sizes).masked_fill(strictly_below.logical_not(), 0);
  return terms.cumsum(-2).masked_fill(on_or_below.logical_not(),
                                      -std::numeric_limits<double>::infinity());
}

}  // namespace

SsdResult ssd_chunked(const at::Tensor& x_in, const at::Tensor& a_in, const at::Tensor& b_in,
                      const at::Tensor& c_in, int64_t chunk, const at::Tensor& initial_state) {
  check_shapes(x_in, a_in, b_in, c_in, initial_state);
  MEGACPP_CHECK(chunk > 0, ErrorKind::kInvalidArgument, "ssd: chunk must be > 0");
  const int64_t B = x_in.size(0), L = x_in.size(1), H = x_in.size(2), P = x_in.size(3);
  const int64_t N = b_in.size(3);
  const int64_t pad = (chunk - L % chunk) % chunk;
  // Padded steps: a = 0 (no decay) and x = 0 (nothing added), so the final state is the
  // state after step L; their outputs are cut off.
  auto padded = [&](const at::Tensor& t) {
    if (pad == 0) return t;
    std::vector<int64_t> sizes = t.sizes().vec();
    sizes[1] = pad;
    return at::cat({t, at::zeros(sizes, t.options())}, 1);
  };
  const int64_t C = (L + pad) / chunk;
  const at::Tensor x = padded(x_in).reshape({B, C, chunk, H, P});
  const at::Tensor b = padded(b_in).reshape({B, C, chunk, H, N});
  const at::Tensor c = padded(c_in).reshape({B, C, chunk, H, N});
  const at::Tensor a = padded(a_in).reshape({B, C, chunk, H}).permute({0, 3, 1, 2});  // b h c l
  const at::Tensor a_cumsum = a.cumsum(-1);

  // 1. Within each chunk: y_i = sum_{j<=i} C_i . B_j exp(a_{j+1} + ... + a_i) x_j.
  const at::Tensor decay = segment_sums(a).exp();  // b h c l s
  const at::Tensor y_diag = at::einsum("bclhn,bcshn,bhcls,bcshp->bclhp", {c, b, decay, x});
  // 2. Each chunk's own final state, as if it began from zero.
  const at::Tensor decay_to_end = (a_cumsum.narrow(-1, chunk - 1, 1) - a_cumsum).exp();
  at::Tensor states = at::einsum("bclhn,bhcl,bclhp->bchpn", {b, decay_to_end, x});
  // 3. Across chunks: the state entering each chunk, and the final state.
  const at::Tensor start = initial_state.defined() ? initial_state.unsqueeze(1)
                                                   : at::zeros({B, 1, H, P, N}, x.options());
  states = at::cat({start, states}, 1);  // b (c+1) h p n
  const at::Tensor chunk_totals =
      at::constant_pad_nd(a_cumsum.select(-1, chunk - 1), {1, 0});  // b h (c+1)
  const at::Tensor chunk_decay = segment_sums(chunk_totals).exp();  // b h (c+1) (c+1)
  const at::Tensor entering = at::einsum("bhzc,bchpn->bzhpn", {chunk_decay, states});
  // 4. What the entering state contributes to each step of its chunk.
  const at::Tensor y_off =
      at::einsum("bclhn,bchpn,bhcl->bclhp", {c, entering.narrow(1, 0, C), a_cumsum.exp()});
  at::Tensor y = (y_diag + y_off).reshape({B, C * chunk, H, P});
  if (pad != 0) y = y.narrow(1, 0, L);
  return {y, entering.select(1, C)};
}

at::Tensor ssd_diagonal(const at::Tensor& x_in, const at::Tensor& a_in, int64_t chunk) {
  MEGACPP_CHECK(x_in.dim() == 3 && a_in.sizes() == x_in.sizes() && chunk > 0,
                ErrorKind::kInvalidArgument,
                fmt::format("ssd_diagonal: x and a must be [B, L, W] alike and chunk > 0: x {}, "
                            "a {}, chunk {}",
                            c10::str(x_in.sizes()), c10::str(a_in.sizes()), chunk));
  const int64_t B = x_in.size(0), L = x_in.size(1), W = x_in.size(2);
  const int64_t pad = (chunk - L % chunk) % chunk;
  const int64_t C = (L + pad) / chunk;
  // [B, L, W] -> [B, W, C, chunk], padded with steps that neither decay nor add.
  auto chunked = [&](const at::Tensor& t) {
    at::Tensor u = t.transpose(1, 2);
    if (pad != 0) u = at::constant_pad_nd(u, {0, pad});
    return u.reshape({B, W, C, chunk});
  };
  const at::Tensor x = chunked(x_in), a = chunked(a_in);
  const at::Tensor a_cumsum = a.cumsum(-1);
  // Within each chunk: h_i = sum_{j<=i} exp(a_{j+1} + ... + a_i) x_j.
  const at::Tensor y_diag = at::matmul(segment_sums(a).exp(), x.unsqueeze(-1)).squeeze(-1);
  // Each chunk's final state from zero, then the state entering each chunk.
  const at::Tensor states =
      ((a_cumsum.narrow(-1, chunk - 1, 1) - a_cumsum).exp() * x).sum(-1);  // b w c
  const at::Tensor chunk_totals = at::constant_pad_nd(a_cumsum.select(-1, chunk - 1), {1, 0});
  const at::Tensor entering = at::matmul(segment_sums(chunk_totals).exp(),
                                         at::constant_pad_nd(states, {1, 0}).unsqueeze(-1))
                                  .squeeze(-1);  // b w (c+1)
  const at::Tensor y = y_diag + a_cumsum.exp() * entering.narrow(-1, 0, C).unsqueeze(-1);
  return y.reshape({B, W, C * chunk}).narrow(2, 0, L).transpose(1, 2);
}

SsdResult ssd_sequential(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                         const at::Tensor& c, const at::Tensor& initial_state) {
  check_shapes(x, a, b, c, initial_state);
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), P = x.size(3), N = b.size(3);
  at::Tensor state = initial_state.defined() ? initial_state : at::zeros({B, H, P, N}, x.options());
  std::vector<at::Tensor> ys;
  ys.reserve(static_cast<size_t>(L));
  for (int64_t t = 0; t < L; ++t) {
    state = a.select(1, t).exp().view({B, H, 1, 1}) * state +
            x.select(1, t).unsqueeze(-1) * b.select(1, t).unsqueeze(-2);
    ys.push_back(at::einsum("bhpn,bhn->bhp", {state, c.select(1, t)}));
  }
  return {at::stack(ys, 1), state};
}

}  // namespace megacpp::trainer
