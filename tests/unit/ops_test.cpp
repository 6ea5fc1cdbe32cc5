// ops: the CPU reference against a double-precision naive RMSNorm, and the CUDA kernel against
// the CPU reference. The OpsCuda.* cases carry the ctest label "gpu" and skip with the reason
// when the build has no CUDA or the host has no device.
#include "ops/ops.h"
#include "ops/optim_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"

#if defined(MEGACPP_HAVE_CUDA) && MEGACPP_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "ops/cuda_check.h"
#define OPS_TEST_HAVE_CUDA 1
#else
#define OPS_TEST_HAVE_CUDA 0
#endif

namespace mc = megacpp;
namespace ops = megacpp::ops;

namespace {

constexpr double kRelTol = 1e-5;

struct Shape {
  int64_t rows;
  int64_t cols;
};

// cols not a multiple of 32 (or of 4) exercise the tails; 4096 x 16 the vectorised path.
const std::vector<Shape> kShapes = {{1, 1},    {1, 7},     {3, 31},   {4, 32},
                                    {5, 33},   {2, 100},   {7, 255},  {8, 1024},
                                    {3, 4097}, {16, 4096}, {300, 24}, {2, 12288}};

std::vector<float> random_vector(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& e : v) e = dist(gen);
  return v;
}

std::vector<double> naive_rmsnorm(const std::vector<float>& x, const float* w, int64_t rows,
                                  int64_t cols, double eps) {
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double sum_sq = 0;
    for (int64_t c = 0; c < cols; ++c) sum_sq += double(x[r * cols + c]) * x[r * cols + c];
    const double rms = std::sqrt(sum_sq / double(cols) + eps);
    for (int64_t c = 0; c < cols; ++c) {
      y[r * cols + c] = double(x[r * cols + c]) / rms * (w != nullptr ? double(w[c]) : 1.0);
    }
  }
  return y;
}

// Element-wise relative comparison; every output element is a product of an input with
// factors, so its rounding error is relative to itself (exact zeros compare exactly).
template <typename Ref>
void expect_close(const std::vector<float>& got, const std::vector<Ref>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::abs(double(got[i]) - double(want[i]));
    if (!(diff <= kRelTol * std::abs(double(want[i])))) {
      if (++bad <= 5) {
        ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want " << want[i];
      }
    }
  }
  EXPECT_EQ(bad, 0u) << what;
}

std::string describe(const Shape& s, bool weighted, float eps) {
  return "rows=" + std::to_string(s.rows) + " cols=" + std::to_string(s.cols) +
         (weighted ? " w" : " no-w") + " eps=" + std::to_string(eps);
}

void expect_invalid(const std::function<void()>& call) {
  try {
    call();
    ADD_FAILURE() << "accepted invalid arguments";
  } catch (const mc::Error& e) {
    EXPECT_EQ(e.kind(), mc::ErrorKind::kInvalidArgument) << e.what();
  }
}

}  // namespace

TEST(OpsCpu, RmsnormMatchesDoubleNaive) {
  uint32_t seed = 1;
  for (const auto& shape : kShapes) {
    for (bool weighted : {false, true}) {
      for (float eps : {1e-6f, 1e-2f}) {
        const auto n = static_cast<size_t>(shape.rows * shape.cols);
        const auto x = random_vector(n, -3.f, 3.f, seed++);
        const auto w = random_vector(static_cast<size_t>(shape.cols), -2.f, 2.f, seed++);
        const float* wp = weighted ? w.data() : nullptr;
        std::vector<float> y(n, -1.f);
        ops::rmsnorm_cpu(x.data(), wp, y.data(), shape.rows, shape.cols, eps);
        expect_close(y, naive_rmsnorm(x, wp, shape.rows, shape.cols, eps),
                     describe(shape, weighted, eps));
      }
    }
  }
}

TEST(OpsCpu, RmsnormWideDynamicRange) {
  // Rows whose values span many orders of magnitude: the output keeps relative accuracy.
  const int64_t rows = 4, cols = 77;
  std::vector<float> x(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    x[i] = std::ldexp(1.f + 0.01f * float(i % 13), int(i % 41) - 20) * (i % 2 ? -1.f : 1.f);
  }
  std::vector<float> y(x.size());
  ops::rmsnorm_cpu(x.data(), nullptr, y.data(), rows, cols, 1e-6f);
  expect_close(y, naive_rmsnorm(x, nullptr, rows, cols, 1e-6), "wide range");
}

TEST(OpsCpu, RmsnormZeroRowIsZeroAndInPlaceWorks) {
  const int64_t rows = 3, cols = 45;
  auto x = random_vector(rows * cols, -1.f, 1.f, 99);
  for (int64_t c = 0; c < cols; ++c) x[cols + c] = 0.f;  // row 1: all zeros
  const auto want = naive_rmsnorm(x, nullptr, rows, cols, 1e-5);
  ops::rmsnorm_cpu(x.data(), nullptr, x.data(), rows, cols, 1e-5f);  // y aliases x
  expect_close(x, want, "in place");
  for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(x[cols + c], 0.f);
}

TEST(OpsCpu, RmsnormRejectsBadArguments) {
  std::vector<float> x(8, 1.f), y(8);
  expect_invalid([&] { ops::rmsnorm_cpu(x.data(), nullptr, y.data(), -1, 8, 1e-6f); });
  expect_invalid([&] { ops::rmsnorm_cpu(x.data(), nullptr, y.data(), 1, 0, 1e-6f); });
  expect_invalid([&] { ops::rmsnorm_cpu(nullptr, nullptr, y.data(), 1, 8, 1e-6f); });
  expect_invalid([&] { ops::rmsnorm_cpu(x.data(), nullptr, nullptr, 1, 8, 1e-6f); });
  // Zero rows is a valid empty batch, pointers unused.
  ops::rmsnorm_cpu(nullptr, nullptr, nullptr, 0, 8, 1e-6f);
}

// stream_copy against its reference, memcpy: byte-identical for every size (below, at and
// above the streaming threshold, with a tail) and every misalignment of either end, and it
// writes nothing outside [dst, dst + n).
TEST(OpsCpu, StreamCopyEqualsMemcpyAtEveryAlignment) {
  std::mt19937 gen(7);
  std::uniform_int_distribution<int> byte(0, 255);
  constexpr size_t kGuard = 64;
  for (const size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{4095}, size_t{4096},
                         size_t{4096 + 17}, size_t{1} << 16, (size_t{1} << 20) + 37}) {
    std::vector<unsigned char> src(n + 32), dst(n + 32 + 2 * kGuard), want;
    for (auto& b : src) b = static_cast<unsigned char>(byte(gen));
    for (size_t so : {size_t{0}, size_t{3}, size_t{16}}) {
      for (size_t dof : {size_t{0}, size_t{5}, size_t{8}, size_t{15}}) {
        std::fill(dst.begin(), dst.end(), 0xA5);
        want = dst;
        std::memcpy(want.data() + kGuard + dof, src.data() + so, n);
        mc::ops::stream_copy(dst.data() + kGuard + dof, src.data() + so, n);
        EXPECT_TRUE(dst == want) << "n=" << n << " src+" << so << " dst+" << dof;
      }
    }
  }
}

namespace {

// Scalar references for optim_kernels.h, written independently of the kernels: every
// operation's result is stored through a volatile float (no contraction, whatever this TU's
// flags), and bfloat16 rounding is spelled as "truncate, then round up when the dropped half is
// above the midpoint or at it with an odd kept half" (nearest even, torch's rounding).
float ref_from_bf16(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}
uint16_t ref_to_bf16(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint32_t kept = u >> 16, dropped = u & 0xFFFFu;
  const bool up = dropped > 0x8000u || (dropped == 0x8000u && (kept & 1u));
  return static_cast<uint16_t>(kept + (up ? 1u : 0u));
}
float ref_mul(float a, float b) {
  volatile float r = a * b;
  return r;
}
float ref_add(float a, float b) {
  volatile float r = a + b;
  return r;
}
float ref_div(float a, float b) {
  volatile float r = a / b;
  return r;
}

// Values that stress the roundings: random magnitudes over many binades, exact bfloat16
// midpoints, subnormals, zeros of both signs, infinities.
std::vector<float> optim_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(-2.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-30, 30);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (i % 8) {
      case 0:
        v[i] = std::bit_cast<float>((static_cast<uint32_t>(rng()) & 0xFFFF0000u) |
                                    0x8000u);  // a bf16 midpoint
        break;
      case 1:
        v[i] = std::ldexp(mant(rng), -140);  // subnormal
        break;
      default:
        v[i] = std::ldexp(mant(rng), expo(rng));
    }
  }
  if (n > 3) {
    v[0] = -0.0f;
    v[1] = std::numeric_limits<float>::infinity();
    v[2] = 0.0f;
  }
  return v;
}

std::vector<uint16_t> to_bf16_all(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = ref_to_bf16(v[i]);
  return out;
}

// Bit equality, so that -0 vs +0 and NaN payloads count.
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  // An empty vector's data() may be null, which memcmp must not be given even for 0 bytes.
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Lengths across the vector widths' tails (1..17) and a vectorized body.
constexpr size_t kOptimLengths[] = {0, 1, 7, 8, 15, 16, 17, 33, 1000, 4099};

}  // namespace

// The contract is bit-exact (torch's separate roundings, in float32 opmath): no tolerance.
TEST(OpsCpu, ScaledSumMatchesScalarReferenceBitExact) {
  const float b = -4.7750f, c = 2.0315f;
  for (size_t n : kOptimLengths) {
    const auto A = optim_values(n, 1), AA = optim_values(n, 2);
    std::vector<float> got = A, want(n);
    ops::scaled_sum(got.data(), AA.data(), b, c, n);
    for (size_t i = 0; i < n; ++i) want[i] = ref_add(ref_mul(b, A[i]), ref_mul(c, AA[i]));
    EXPECT_TRUE(same_bits(got, want)) << "float n " << n;

    const auto Ah = to_bf16_all(A), AAh = to_bf16_all(AA);
    std::vector<uint16_t> goth = Ah, wanth(n);
    ops::scaled_sum(goth.data(), AAh.data(), b, c, n);
    for (size_t i = 0; i < n; ++i) {
      const float left = ref_from_bf16(ref_to_bf16(ref_mul(b, ref_from_bf16(Ah[i]))));
      const float right = ref_from_bf16(ref_to_bf16(ref_mul(c, ref_from_bf16(AAh[i]))));
      wanth[i] = ref_to_bf16(ref_add(left, right));
    }
    EXPECT_TRUE(same_bits(goth, wanth)) << "bfloat16 n " << n;
  }
}

TEST(OpsCpu, ScaleAddMatchesScalarReferenceBitExact) {
  const float a = 3.4445f;
  for (size_t n : kOptimLengths) {
    const auto x = optim_values(n, 3), y = optim_values(n, 4);
    std::vector<float> got = x, want(n);
    ops::scale_add(got.data(), y.data(), a, n);
    for (size_t i = 0; i < n; ++i) want[i] = ref_add(ref_mul(a, x[i]), y[i]);
    EXPECT_TRUE(same_bits(got, want)) << "float n " << n;

    const auto xh = to_bf16_all(x), yh = to_bf16_all(y);
    std::vector<uint16_t> goth = xh, wanth(n);
    ops::scale_add(goth.data(), yh.data(), a, n);
    for (size_t i = 0; i < n; ++i) {
      const float scaled = ref_from_bf16(ref_to_bf16(ref_mul(a, ref_from_bf16(xh[i]))));
      wanth[i] = ref_to_bf16(ref_add(scaled, ref_from_bf16(yh[i])));
    }
    EXPECT_TRUE(same_bits(goth, wanth)) << "bfloat16 n " << n;
  }
}

TEST(OpsCpu, SumAndDivideMatchesScalarReferenceBitExact) {
  for (const float divisor : {2.0f, 1.0f, 3.0f}) {
    for (size_t n : kOptimLengths) {
      const auto own = optim_values(n, 5), theirs = optim_values(n, 6);
      std::vector<float> got = own, want(n);
      ops::sum_and_divide(got.data(), theirs.data(), divisor, n);
      for (size_t i = 0; i < n; ++i) want[i] = ref_div(ref_add(own[i], theirs[i]), divisor);
      EXPECT_TRUE(same_bits(got, want)) << "divisor " << divisor << " n " << n;
    }
  }
}

// The fused AdamW step's reference against the arithmetic by hand: a first step moves every
// parameter with a gradient by lr against its sign (m / (sqrt(v) + eps) = g / (|g| + eps)
// after bias correction), a decaying one first shrinks by 1 - lr * wd, and a gate of 0 keeps p, m
// and v bit for bit (a step without a gradient anywhere).
TEST(OpsCpu, AdamwStepFirstStepMovesByLrAgainstTheGradientSign) {
  const float lr = 0.01f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, wd = 0.1f, step = 1.f;
  for (const float gate : {1.f, 0.f}) {
    for (const bool decays : {false, true}) {
      std::vector<float> p = random_vector(1001, -2.f, 2.f, 3),
                         g = random_vector(1001, -1.f, 1.f, 4);
      std::vector<float> m(1001, 0.f), v(1001, 0.f);
      const std::vector<float> p0 = p;
      const ops::AdamWStepScalars s{&lr, &beta1, &beta2, &eps, &wd, &step, &gate};
      ops::adamw_step_cpu(p.data(), g.data(), m.data(), v.data(), 1001, s, decays);
      for (size_t i = 0; i < p.size(); ++i) {
        if (gate == 0.f) {
          ASSERT_EQ(std::memcmp(&p[i], &p0[i], sizeof(float)), 0) << i;
          ASSERT_EQ(m[i], 0.f);
          ASSERT_EQ(v[i], 0.f);
          continue;
        }
        const double shrunk = decays ? double(p0[i]) * (1.0 - double(lr) * wd) : double(p0[i]);
        const double want = shrunk - double(lr) * g[i] / (std::abs(double(g[i])) + eps);
        ASSERT_NEAR(p[i], want, 1e-6) << i << (decays ? " decays" : "");
        ASSERT_NEAR(m[i], (1.0 - beta1) * g[i], 1e-7);
        ASSERT_NEAR(v[i], (1.0 - beta2) * g[i] * g[i], 1e-9);
      }
    }
  }
  float x = 0;
  const ops::AdamWStepScalars none{};
  expect_invalid([&] { ops::adamw_step_cpu(&x, &x, &x, &x, 1, none, false); });
  expect_invalid([&] { ops::adamw_step_cpu(&x, &x, &x, &x, -1, none, false); });
  ops::adamw_step_cpu(nullptr, nullptr, nullptr, nullptr, 0, none, false);
}

// A second moment poisoned by a NaN (one step of NaN gradients) must keep its matrix's update NaN,
// as torch's clamp_min does, not turn into a finite scale that gives one row the whole update.
// `tail` runs the tail on host vectors (2 matrices of 4 x 3, a gate of 1 each) and returns out.
namespace {
void expect_a_nan_moment_poisons_its_matrix(
    const std::function<std::vector<float>(const std::vector<float>& u, const std::vector<float>& p,
                                           const std::vector<float>& sec, bool reduce_cols)>&
        tail) {
  const int64_t rows = 4, cols = 3;
  for (const bool reduce_cols : {true, false}) {
    const auto u = random_vector(static_cast<size_t>(2 * rows * cols), -1.f, 1.f, 31);
    const auto p = random_vector(u.size(), -2.f, 2.f, 32);
    auto sec = random_vector(static_cast<size_t>(2 * (reduce_cols ? rows : cols)), 0.01f, 0.5f, 33);
    sec[1] = std::numeric_limits<float>::quiet_NaN();
    const auto out = tail(u, p, sec, reduce_cols);
    for (size_t i = 0; i < out.size(); ++i) {
      if (i < static_cast<size_t>(rows * cols))
        EXPECT_TRUE(std::isnan(out[i])) << "element " << i << " of the poisoned matrix: " << out[i];
      else
        EXPECT_TRUE(std::isfinite(out[i])) << "element " << i << " of the clean matrix: " << out[i];
    }
  }
}
}  // namespace

TEST(OpsCpu, MuonTailKeepsANaNMomentNaN) {
  expect_a_nan_moment_poisons_its_matrix([](const std::vector<float>& u, std::vector<float> p,
                                            std::vector<float> sec, bool reduce_cols) {
    const float lr = 0.02f, beta2 = 0.95f, gate[2] = {1.f, 1.f};
    ops::muon_tail_cpu({.u = u.data(),
                        .p = p.data(),
                        .out = p.data(),
                        .sec = sec.data(),
                        .count = 2,
                        .rows = 4,
                        .cols = 3,
                        .reduce_cols = reduce_cols,
                        .lr = &lr,
                        .beta2 = &beta2,
                        .gate = gate,
                        .matrices_per_gate = 1,
                        .aspect = 1.f});
    return p;
  });
}

// Muon's fused tail's reference against what the variance reduction promises: the update keeps
// the Frobenius norm of u (times lr * aspect), and from a zero second moment every row (or
// column) of it has the same norm; the second moment is the lerp toward the means of u^2; a
// gate of 0 keeps p and the second moment bit for bit; out may be p itself.
TEST(OpsCpu, MuonTailKeepsTheNormAndEvensTheRows) {
  const int64_t count = 4, rows = 6, cols = 5;
  const float lr = 0.02f, beta2 = 0.95f;
  const std::vector<float> gate{1.f, 0.f};  // two matrices per gate: an entry of two slices
  for (const bool reduce_cols : {true, false}) {
    const int64_t n_stats = reduce_cols ? rows : cols;
    for (const bool from_zero : {true, false}) {
      auto u = random_vector(static_cast<size_t>(count * rows * cols), -1.f, 1.f, 21);
      // Rows (columns) of very different sizes: the reduction has something to even out.
      for (int64_t i = 0; i < count * rows * cols; ++i)
        u[static_cast<size_t>(i)] *=
            1.f + static_cast<float>(reduce_cols ? (i / cols) % rows : i % cols);
      auto p = random_vector(u.size(), -2.f, 2.f, 22);
      std::vector<float> sec =
          from_zero ? std::vector<float>(static_cast<size_t>(count * n_stats))
                    : random_vector(static_cast<size_t>(count * n_stats), 0.01f, 0.5f, 23);
      const auto p0 = p, sec0 = sec;
      ops::MuonTailArgs a{.u = u.data(),
                          .p = p.data(),
                          .out = p.data(),
                          .sec = sec.data(),
                          .count = count,
                          .rows = rows,
                          .cols = cols,
                          .reduce_cols = reduce_cols,
                          .lr = &lr,
                          .beta2 = &beta2,
                          .gate = gate.data(),
                          .matrices_per_gate = 2,
                          .aspect = 1.5f};
      ops::muon_tail_cpu(a);
      const std::string what = std::string(reduce_cols ? "rows" : "columns") +
                               (from_zero ? " from zero" : " from a second moment");
      for (int64_t k = 0; k < count; ++k) {
        const int64_t n = rows * cols;
        if (gate[static_cast<size_t>(k / 2)] == 0.f) {
          EXPECT_EQ(std::memcmp(p.data() + k * n, p0.data() + k * n, n * sizeof(float)), 0);
          EXPECT_EQ(std::memcmp(sec.data() + k * n_stats, sec0.data() + k * n_stats,
                                n_stats * sizeof(float)),
                    0);
          continue;
        }
        std::vector<double> mean(static_cast<size_t>(n_stats)), moved(mean.size());
        double u_sq = 0, moved_sq = 0;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const size_t i = static_cast<size_t>(k * n + r * cols + c);
            const auto j = static_cast<size_t>(reduce_cols ? r : c);
            const double d = (double(p0[i]) - p[i]) / (double(lr) * 1.5);
            mean[j] += double(u[i]) * u[i] / double(reduce_cols ? cols : rows);
            moved[j] += d * d;
            u_sq += double(u[i]) * u[i];
            moved_sq += d * d;
          }
        EXPECT_NEAR(std::sqrt(moved_sq), std::sqrt(u_sq), 1e-4 * std::sqrt(u_sq)) << what;
        for (int64_t j = 0; j < n_stats; ++j) {
          const auto jj = static_cast<size_t>(j), at = static_cast<size_t>(k * n_stats + j);
          EXPECT_NEAR(sec[at], sec0[at] + (1.0 - beta2) * (mean[jj] - sec0[at]),
                      1e-6 * mean[jj] + 1e-9)
              << what;
          if (from_zero) {
            EXPECT_NEAR(moved[jj], moved_sq / double(n_stats), 1e-3 * moved_sq / double(n_stats))
                << what << " row/column " << j;
          }
        }
      }
    }
  }
  float x = 0;
  expect_invalid([&] {
    ops::muon_tail_cpu({.u = &x, .p = &x, .out = &x, .sec = &x, .count = 1, .rows = 1, .cols = 1});
  });  // no scalars
  expect_invalid(
      [&] { ops::muon_tail_cpu({.count = 3, .rows = 1, .cols = 1, .matrices_per_gate = 2}); });
  expect_invalid([&] { ops::muon_tail_cpu({.count = 0, .rows = 0, .cols = 1}); });
  ops::muon_tail_cpu({.count = 0, .rows = 1, .cols = 1});
}

TEST(OpsCpu, CudaDeviceCountNeverThrows) {
  int n = -1;
  EXPECT_NO_THROW(n = ops::cuda_device_count());
  EXPECT_GE(n, 0);
#if !OPS_TEST_HAVE_CUDA
  EXPECT_EQ(n, 0);
#endif
}

#if OPS_TEST_HAVE_CUDA
// Needs the CUDA runtime library only (no device): the error text comes from cudart.
TEST(OpsCpu, CudaCheckThrowsSystemErrorWithContext) {
  try {
    CUDA_CHECK(cudaErrorInvalidValue);
    ADD_FAILURE() << "CUDA_CHECK did not throw";
  } catch (const mc::Error& e) {
    EXPECT_EQ(e.kind(), mc::ErrorKind::kSystem);
    const std::string what = e.what();
    EXPECT_NE(what.find("cudaErrorInvalidValue"), std::string::npos) << what;
    EXPECT_NE(what.find(cudaGetErrorString(cudaErrorInvalidValue)), std::string::npos) << what;
    EXPECT_NE(what.find("ops_test.cpp"), std::string::npos) << what;
    EXPECT_NE(e.file().find("ops_test.cpp"), std::string::npos);
    EXPECT_GT(e.line(), 0);
  }
  EXPECT_NO_THROW(CUDA_CHECK(cudaSuccess));
}
#endif

// ---------------------------------------------------------------------------------------------
// CUDA vs the CPU reference.

#if OPS_TEST_HAVE_CUDA
namespace {

// Device memory owned for one test; frees on scope exit.
class DeviceFloats {
 public:
  // Room for `n` floats at any offset up to 4.
  explicit DeviceFloats(size_t n) {
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), (n + 4) * sizeof(float)));
  }
  ~DeviceFloats() { (void)cudaFree(p_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  DeviceFloats(DeviceFloats&&) = delete;
  DeviceFloats& operator=(DeviceFloats&&) = delete;

  // `offset` floats into the allocation (offset 1 breaks 16-byte alignment on purpose).
  float* at(size_t offset) { return p_ + offset; }
  void upload(const std::vector<float>& v, size_t offset) {
    CUDA_CHECK(cudaMemcpy(at(offset), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  std::vector<float> download(size_t n, size_t offset) {
    std::vector<float> v(n);
    CUDA_CHECK(cudaMemcpy(v.data(), at(offset), n * sizeof(float), cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  float* p_ = nullptr;
};

void compare_cuda_to_cpu(const Shape& shape, bool weighted, float eps, size_t offset, bool in_place,
                         void* stream, uint32_t seed) {
  const auto n = static_cast<size_t>(shape.rows * shape.cols);
  const auto x = random_vector(n, -3.f, 3.f, seed);
  const auto w = random_vector(static_cast<size_t>(shape.cols), -2.f, 2.f, seed + 1000);
  std::vector<float> want(n);
  ops::rmsnorm_cpu(x.data(), weighted ? w.data() : nullptr, want.data(), shape.rows, shape.cols,
                   eps);

  DeviceFloats dx(n), dy(n), dw(w.size());
  dx.upload(x, offset);
  dw.upload(w, offset);
  float* out = in_place ? dx.at(offset) : dy.at(offset);
  ops::rmsnorm_cuda(dx.at(offset), weighted ? dw.at(offset) : nullptr, out, shape.rows, shape.cols,
                    eps, stream);
  CUDA_CHECK(cudaDeviceSynchronize());
  auto got = in_place ? dx.download(n, offset) : dy.download(n, offset);
  expect_close(got, want,
               "cuda " + describe(shape, weighted, eps) + " offset=" + std::to_string(offset) +
                   (in_place ? " in-place" : ""));
}

}  // namespace
#endif

#if OPS_TEST_HAVE_CUDA
#define SKIP_WITHOUT_CUDA_DEVICE()                                                                \
  do {                                                                                            \
    if (ops::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device (cuda_device_count()==0)"; \
  } while (0)
#else
#define SKIP_WITHOUT_CUDA_DEVICE() GTEST_SKIP() << "built without CUDA"
#endif

TEST(OpsCuda, RmsnormMatchesCpuReference) {
  SKIP_WITHOUT_CUDA_DEVICE();
#if OPS_TEST_HAVE_CUDA
  uint32_t seed = 7;
  for (const auto& shape : kShapes) {
    for (bool weighted : {false, true}) {
      compare_cuda_to_cpu(shape, weighted, 1e-6f, 0, false, nullptr, seed++);
    }
  }
#endif
}

TEST(OpsCuda, RmsnormUnalignedInPlaceAndOnAStream) {
  SKIP_WITHOUT_CUDA_DEVICE();
#if OPS_TEST_HAVE_CUDA
  // offset 1: cols % 4 == 0 but not 16-byte aligned, so the scalar path runs.
  compare_cuda_to_cpu({9, 256}, true, 1e-5f, 1, false, nullptr, 11);
  compare_cuda_to_cpu({9, 256}, true, 1e-5f, 0, true, nullptr, 12);
  compare_cuda_to_cpu({5, 33}, false, 1e-5f, 0, true, nullptr, 13);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  compare_cuda_to_cpu({70, 1000}, true, 1e-5f, 0, false, stream, 14);
  CUDA_CHECK(cudaStreamDestroy(stream));
  // Many short rows: the grid is one block per row.
  compare_cuda_to_cpu({100000, 8}, true, 1e-5f, 0, false, nullptr, 15);
#endif
}

// The fused AdamW step on the device against its CPU reference: random p, g, m, v over sizes
// with tails (not a multiple of a block) and one past a full grid, gate 1 and 0, with and
// without decay, at step 1 and a later step; scalars in device memory. Each of p, m, v within
// 1e-5 relative plus 1e-7 (float32 against double); with gate 0 the arrays stay bit for bit.
TEST(OpsCuda, AdamwStepMatchesCpuReference) {
  SKIP_WITHOUT_CUDA_DEVICE();
#if OPS_TEST_HAVE_CUDA
  uint32_t seed = 40;
  for (const int64_t n : {int64_t{1}, int64_t{257}, int64_t{1000003}, int64_t{256} * 65535 + 9}) {
    for (const float gate : {1.f, 0.f}) {
      for (const bool decays : {false, true}) {
        for (const float step : {1.f, 37.f}) {
          const auto un = static_cast<size_t>(n);
          auto p = random_vector(un, -2.f, 2.f, seed++), g = random_vector(un, -1.f, 1.f, seed++);
          auto m = random_vector(un, -0.1f, 0.1f, seed++),
               v = random_vector(un, 0.f, 0.01f, seed++);
          const std::vector<float> scalars{3e-3f, 0.8f, 0.95f, 1e-10f, 0.1f, step, gate};
          DeviceFloats dp(un), dg(un), dm(un), dv(un), ds(scalars.size());
          dp.upload(p, 0);
          dg.upload(g, 0);
          dm.upload(m, 0);
          dv.upload(v, 0);
          ds.upload(scalars, 0);
          const auto scalars_at = [](const float* b) {
            return ops::AdamWStepScalars{b, b + 1, b + 2, b + 3, b + 4, b + 5, b + 6};
          };
          ops::adamw_step_cuda(dp.at(0), dg.at(0), dm.at(0), dv.at(0), n, scalars_at(ds.at(0)),
                               decays, nullptr);
          CUDA_CHECK(cudaDeviceSynchronize());
          const auto p0 = p, m0 = m, v0 = v;
          ops::adamw_step_cpu(p.data(), g.data(), m.data(), v.data(), n, scalars_at(scalars.data()),
                              decays);
          const std::string what = "n=" + std::to_string(n) + " gate=" + std::to_string(gate) +
                                   (decays ? " decays" : "") + " step=" + std::to_string(step);
          for (auto [got, want, before] : {std::tuple{dp.download(un, 0), &p, &p0},
                                           {dm.download(un, 0), &m, &m0},
                                           {dv.download(un, 0), &v, &v0}}) {
            size_t bad = 0;
            for (size_t i = 0; i < un; ++i) {
              const bool ok = gate == 0.f ? std::memcmp(&got[i], &(*before)[i], sizeof(float)) == 0
                                          : std::abs(double(got[i]) - (*want)[i]) <=
                                                1e-5 * std::abs(double((*want)[i])) + 1e-7;
              if (!ok && ++bad <= 5)
                ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want "
                              << (*want)[i];
            }
            EXPECT_EQ(bad, 0u) << what;
          }
        }
      }
    }
  }
#endif
}

TEST(OpsCuda, RmsnormRejectsBadArgumentsAndAcceptsEmpty) {
  SKIP_WITHOUT_CUDA_DEVICE();
#if OPS_TEST_HAVE_CUDA
  DeviceFloats d(8);
  expect_invalid([&] { ops::rmsnorm_cuda(d.at(0), nullptr, d.at(0), 1, 0, 1e-6f, nullptr); });
  expect_invalid([&] { ops::rmsnorm_cuda(nullptr, nullptr, d.at(0), 1, 8, 1e-6f, nullptr); });
  ops::rmsnorm_cuda(nullptr, nullptr, nullptr, 0, 8, 1e-6f, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
#endif
}

// Muon's fused tail on the device against its CPU reference: both reductions, shapes whose rows
// and columns are not multiples of a warp or a block, out as p itself and apart, two matrices
// per gate with one gate 0, on a stream. out within 1e-5 of |p| plus 1e-4 of the largest step,
// the second moment within 1e-5 relative; under a gate of 0 both bit for bit.
TEST(OpsCuda, MuonTailMatchesCpuReference) {
  SKIP_WITHOUT_CUDA_DEVICE();
#if OPS_TEST_HAVE_CUDA
  struct Case {
    int64_t count, rows, cols;
  };
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint32_t seed = 90;
  for (const Case c : {Case{2, 3, 5}, Case{4, 300, 77}, Case{6, 1024, 1024}, Case{2, 33, 4096}}) {
    for (const bool reduce_cols : {true, false}) {
      for (const bool in_place : {true, false}) {
        const auto un = static_cast<size_t>(c.count * c.rows * c.cols);
        const int64_t ws = ops::muon_tail_workspace(c.count, c.rows, c.cols, reduce_cols);
        const auto us = static_cast<size_t>(ws);
        auto u = random_vector(un, -1.f, 1.f, seed++), p = random_vector(un, -2.f, 2.f, seed++);
        auto sec = random_vector(us, 0.f, 0.1f, seed++);
        std::vector<float> scalars{0.02f, 0.95f}, gate(static_cast<size_t>(c.count / 2), 1.f);
        gate.back() = 0.f;
        DeviceFloats du(un), dp(un), dout(un), dsec(us), dws(us), ds(2), dg(gate.size());
        du.upload(u, 0);
        dp.upload(p, 0);
        dsec.upload(sec, 0);
        ds.upload(scalars, 0);
        dg.upload(gate, 0);
        ops::muon_tail_cuda({.u = du.at(0),
                             .p = dp.at(0),
                             .out = in_place ? dp.at(0) : dout.at(0),
                             .sec = dsec.at(0),
                             .count = c.count,
                             .rows = c.rows,
                             .cols = c.cols,
                             .reduce_cols = reduce_cols,
                             .lr = ds.at(0),
                             .beta2 = ds.at(1),
                             .gate = dg.at(0),
                             .matrices_per_gate = 2,
                             .aspect = 1.25f,
                             .workspace = dws.at(0)},
                            stream);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        const auto p0 = p, sec0 = sec;
        ops::muon_tail_cpu({.u = u.data(),
                            .p = p.data(),
                            .out = p.data(),
                            .sec = sec.data(),
                            .count = c.count,
                            .rows = c.rows,
                            .cols = c.cols,
                            .reduce_cols = reduce_cols,
                            .lr = &scalars[0],
                            .beta2 = &scalars[1],
                            .gate = gate.data(),
                            .matrices_per_gate = 2,
                            .aspect = 1.25f});
        const auto got = in_place ? dp.download(un, 0) : dout.download(un, 0);
        const auto got_sec = dsec.download(us, 0);
        double largest = 0;
        for (size_t i = 0; i < un; ++i) largest = std::max(largest, std::abs(double(p0[i]) - p[i]));
        const std::string what = std::to_string(c.count) + " x " + std::to_string(c.rows) + " x " +
                                 std::to_string(c.cols) + (reduce_cols ? " rows" : " columns") +
                                 (in_place ? " in place" : "");
        const int64_t last = c.count - 2;  // the matrices of the gate of 0
        size_t bad = 0;
        for (size_t i = 0; i < un; ++i) {
          const bool gated_off = int64_t(i) >= last * c.rows * c.cols;
          const bool ok = gated_off ? std::memcmp(&got[i], &p0[i], sizeof(float)) == 0
                                    : std::abs(double(got[i]) - p[i]) <=
                                          1e-5 * std::abs(double(p[i])) + 1e-4 * largest;
          if (!ok && ++bad <= 5)
            ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want " << p[i];
        }
        for (size_t i = 0; i < us; ++i) {
          const bool gated_off = int64_t(i) >= last * (ws / c.count);
          const bool ok = gated_off ? std::memcmp(&got_sec[i], &sec0[i], sizeof(float)) == 0
                                    : std::abs(double(got_sec[i]) - sec[i]) <=
                                          1e-5 * std::abs(double(sec[i])) + 1e-12;
          if (!ok && ++bad <= 10)
            ADD_FAILURE() << what << ": second moment " << i << " got " << got_sec[i] << " want "
                          << sec[i];
        }
        EXPECT_EQ(bad, 0u) << what;
      }
    }
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
#endif
}

TEST(OpsCuda, MuonTailKeepsANaNMomentNaN) {
  SKIP_WITHOUT_CUDA_DEVICE();
#if OPS_TEST_HAVE_CUDA
  expect_a_nan_moment_poisons_its_matrix([](const std::vector<float>& u,
                                            const std::vector<float>& p,
                                            const std::vector<float>& sec, bool reduce_cols) {
    const int64_t ws = ops::muon_tail_workspace(2, 4, 3, reduce_cols);
    DeviceFloats du(u.size()), dp(p.size()), dsec(sec.size()), dws(static_cast<size_t>(ws)), ds(2),
        dg(2);
    du.upload(u, 0);
    dp.upload(p, 0);
    dsec.upload(sec, 0);
    ds.upload({0.02f, 0.95f}, 0);
    dg.upload({1.f, 1.f}, 0);
    ops::muon_tail_cuda({.u = du.at(0),
                         .p = dp.at(0),
                         .out = dp.at(0),
                         .sec = dsec.at(0),
                         .count = 2,
                         .rows = 4,
                         .cols = 3,
                         .reduce_cols = reduce_cols,
                         .lr = ds.at(0),
                         .beta2 = ds.at(1),
                         .gate = dg.at(0),
                         .matrices_per_gate = 1,
                         .aspect = 1.f,
                         .workspace = dws.at(0)},
                        nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    return dp.download(p.size(), 0);
  });
#endif
}
