// The orthogonalizations of DistMuon (Polar Express, Newton-Schulz); contract in optim.h.
#include <array>
#include <cstdint>
#include <utility>

#include "ops/optim_kernels.h"
#include "stages/trainer/optim_internal.h"

namespace megacpp::trainer::detail {

namespace {

at::Tensor frobenius(const at::Tensor& x) {
  return at::linalg_vector_norm(x, 2, at::IntArrayRef{-2, -1}, /*keepdim=*/true);
}

// Both contiguous CPU tensors of one shape and dtype, float32 or bfloat16: what the fused loops
// of ops/optim_kernels.h take.
bool fusable(const at::Tensor& x, const at::Tensor& y) {
  return x.is_cpu() && y.is_cpu() && x.scalar_type() == y.scalar_type() &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous() &&
         y.is_contiguous() && x.sizes() == y.sizes();
}

template <typename T>
T* data_of(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// `b * A + c * AA`, the same bits; A (a temporary) is overwritten when fused.
at::Tensor fused_scaled_sum(at::Tensor A, const at::Tensor& AA, double b, double c) {
  if (!fusable(A, AA)) return b * A + c * AA;
  const auto n = static_cast<size_t>(A.numel());
  const auto fb = static_cast<float>(b), fc = static_cast<float>(c);
  if (A.scalar_type() == at::kFloat)
    ops::scaled_sum(data_of<float>(A), data_of<float>(AA), fb, fc, n);
  else
    ops::scaled_sum(data_of<uint16_t>(A), data_of<uint16_t>(AA), fb, fc, n);
  return A;
}

// `a * x + y`, the same bits; x (a temporary) is overwritten when fused.
at::Tensor fused_scale_add(at::Tensor x, const at::Tensor& y, double a) {
  if (!fusable(x, y)) return a * x + y;
  const auto n = static_cast<size_t>(x.numel());
  if (x.scalar_type() == at::kFloat)
    ops::scale_add(data_of<float>(x), data_of<float>(y), static_cast<float>(a), n);
  else
    ops::scale_add(data_of<uint16_t>(x), data_of<uint16_t>(y), static_cast<float>(a), n);
  return x;
}

// x @ y, into `out` when it is given (a buffer reused across iterations: freeing a product of
// 128 KiB and more each time costs glibc a consolidation of its free lists). Batches of
// matrices go to bmm directly: matmul folds a batch of one into a single matrix product,
// which copies a transposed operand first (3x the product's time at 512 x 128). The same bits
// either way.
at::Tensor product(const at::Tensor& x, const at::Tensor& y, at::Tensor* out = nullptr) {
  if (x.dim() != 3 || y.dim() != 3) return x.matmul(y);
  if (out == nullptr) return at::bmm(x, y);
  if (!out->defined()) *out = at::empty({x.size(0), x.size(1), y.size(2)}, x.options());
  return at::bmm_out(*out, x, y);
}

// beta·s + alpha·(x @ y) by the product itself (addmm / baddbmm), into `out` (made at s's shape
// when undefined), which must alias none of s, x and y.
at::Tensor product_sum(const at::Tensor& s, const at::Tensor& x, const at::Tensor& y, double beta,
                       double alpha, at::Tensor* out) {
  if (!out->defined()) *out = at::empty(s.sizes(), s.options());
  return s.dim() == 2 ? at::addmm_out(*out, s, x, y, beta, alpha)
                      : at::baddbmm_out(*out, s, x, y, beta, alpha);
}

}  // namespace

// Every element-wise step after the normalization writes into a temporary of its own (x is a
// fresh tensor from the division on), through the fused loops where they apply; with the sums in
// the products, x and `next` trade places each iteration (a product's output aliases no input).
at::Tensor orthogonalize(const at::Tensor& g, Orthogonalizer which, int steps, bool bf16,
                         OrthoSums sums) {
  at::Tensor x = bf16 ? g.to(at::kBFloat16) : g;
  const bool tall = g.size(-2) > g.size(-1);
  const bool in_product =
      (g.dim() == 2 || g.dim() == 3) &&
      (sums == OrthoSums::kInProduct || (sums == OrthoSums::kAuto && !g.is_cpu()));
  // Each iteration's three products land in these (B is A, overwritten by the fused sum).
  at::Tensor gram, square, next;
  // b·A + c·A·A, then a·x + (B·x, or x·B when `right`).
  const auto iterate = [&](const at::Tensor& A, double a, double b, double c, bool right) {
    if (in_product) {
      const at::Tensor B = product_sum(A, A, A, b, c, &square);
      product_sum(x, right ? x : B, right ? B : x, a, 1.0, &next);
      std::swap(x, next);
      return;
    }
    const at::Tensor B = fused_scaled_sum(A, product(A, A, &square), b, c);
    x = fused_scale_add(x, right ? product(x, B, &next) : product(B, x, &next), a);
  };
  if (which == Orthogonalizer::kNewtonSchulz) {
    const auto [a, b, c] = kNewtonSchulz;
    if (tall) x = x.transpose(-2, -1);
    x = x / (frobenius(x) + 1e-7);
    for (int i = 0; i < steps; ++i) iterate(product(x, x.transpose(-2, -1), &gram), a, b, c, false);
    return tall ? x.transpose(-2, -1) : x;
  }
  x = x / (frobenius(x) * 1.02 + 1e-6);
  for (int i = 0; i < steps; ++i) {
    const auto [a, b, c] = kPolarExpress[static_cast<size_t>(i)];
    if (tall) {
      iterate(product(x.transpose(-2, -1), x, &gram), a, b, c, true);
    } else {
      iterate(product(x, x.transpose(-2, -1), &gram), a, b, c, false);
    }
  }
  return x;
}

}  // namespace megacpp::trainer::detail
