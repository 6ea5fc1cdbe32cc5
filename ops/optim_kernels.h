// The optimizer's fused element-wise loops (the trainer's orthogonalization and world-2
// exchange call them; optim_kernels.cpp). Torch-free: raw pointers, float32 or bfloat16 bits.
//
// Each loop computes what a sequence of torch's element-wise operations on float32 or
// bfloat16 tensors computes, to the bit: every operation in float32 (torch's opmath for both),
// each result rounded to the tensors' dtype (bfloat16: round to nearest even) before the next,
// in one pass instead of one pass (and one allocation) per operation. Their translation unit is
// built with -ffp-contract=off: a multiply and an add stay two roundings, as they are in torch.
// Blocking: pure loops. Failure: none (the callers check dtypes, sizes and contiguity).
#pragma once

#include <cstddef>
#include <cstdint>

namespace megacpp::ops {

// A = b*A + c*AA (torch: `b * A + c * AA`), in place; AA does not alias A.
void scaled_sum(float* A, const float* AA, float b, float c, size_t n);
void scaled_sum(uint16_t* A, const uint16_t* AA, float b, float c, size_t n);
// x = a*x + y (torch: `x = a * x + y`), in place; y does not alias x.
void scale_add(float* x, const float* y, float a, size_t n);
void scale_add(uint16_t* x, const uint16_t* y, float a, size_t n);
// own = (own + theirs) / divisor (torch: `own.add_(theirs).div_(divisor)`; the sum is the
// world-2 sum in rank order either way round), in place; theirs does not alias own.
void sum_and_divide(float* own, const float* theirs, float divisor, size_t n);

}  // namespace megacpp::ops
