// bench_orthogonalize: DistMuon's orthogonalization (stages/trainer/orthogonalize.cpp, Polar
// Express in bfloat16 as the recipes run it on a GPU) against the bfloat16 matrix-product rate
// of the same device, in one invocation: the physical limit its products could reach. For each
// group of same-shape matrices DistMuon batches at a recipe's shapes (by default gpu-small's:
// 12 layers of d_model 1024, q, k, v and the output projection 1024 x 1024, the MLP 4096 x 1024
// and 1024 x 4096), it times orthogonalize() and a batched product of the iteration's largest
// shape ([batch, m, n] x [batch, n, m], m <= n), and prints both rates and their ratio; then the
// total against the same products and against one large square product (the device's practical
// peak). Issue 32's goal: Polar Express at >= 70% of the bfloat16 matmul rate on a GPU.
//
// FLOP count of one Polar Express iteration on an m x n matrix (m <= n: a tall one is worked
// through its transpose): the Gram matrix A = X Xᵀ (2 m² n), A·A (2 m³) and B·X (2 m² n). The
// element-wise parts (the norm, the scaled sums) are not counted: they are what the
// orthogonalization costs beyond its products. A device takes the scaled sums in the products
// (detail::OrthoSums::kInProduct), the CPU as separate operations; the last line times the other
// choice beside the default.
//
// --device cuda loads the trainer's CUDA plugin (libmegacpp_trainer_cuda.so beside this
// executable), as a rank does; a device's work is timed to its completion by reading a scalar
// of the result back (one synchronising copy per timed batch of calls). Nothing is asserted:
// timings are reported, never tested.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "bench/peer_json.h"
#include "core/util.h"
#include "stages/trainer/cuda_plugin.h"
#include "stages/trainer/optim.h"

namespace {

using Clock = std::chrono::steady_clock;
using megacpp::bench::median;
using megacpp::trainer::Orthogonalizer;

struct Config {
  std::string device = "cpu";
  int64_t d_model = 1024, mlp_mult = 4, layers = 12;
  int steps = 5;       // Polar Express iterations (the recipes' muon_ns_steps)
  int repeats = 5;     // timed batches (the median is printed)
  int calls = 3;       // calls per timed batch
  int64_t square = 0;  // the square product's size; 0: 8192 on a GPU, 1024 on a CPU
  int threads = 1;
};

// Seconds per call of fn (median over the repeats of batches of `calls`), the device's work
// done: `done` reads a scalar of the last result back.
template <typename F>
double seconds_per_call(const Config& c, F&& fn) {
  std::vector<double> out;
  for (int r = 0; r <= c.repeats; ++r) {  // the first batch is a warm-up
    const auto t0 = Clock::now();
    at::Tensor last;
    for (int i = 0; i < c.calls; ++i) last = fn();
    (void)last.flatten()[0].item<float>();  // a device's stream done
    if (r > 0) out.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / c.calls);
  }
  return median(out);
}

struct Group {
  int64_t batch, rows, cols;
};

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"DistMuon's Polar Express against the bfloat16 matrix-product rate"};
  app.add_option("--device", c.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--d-model", c.d_model, "model width (gpu-small: 1024)");
  app.add_option("--mlp-mult", c.mlp_mult, "MLP width over d_model (gpu-small: 4)");
  app.add_option("--layers", c.layers, "layers (gpu-small: 12)");
  app.add_option("--steps", c.steps, "Polar Express iterations (1..5)")->check(CLI::Range(1, 5));
  app.add_option("--repeats", c.repeats, "timed batches")->check(CLI::PositiveNumber);
  app.add_option("--calls", c.calls, "calls per timed batch")->check(CLI::PositiveNumber);
  app.add_option("--square", c.square, "the square product's size (0: 8192 GPU, 1024 CPU)");
  app.add_option("--threads", c.threads, "intra-op threads on the CPU")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(c.threads);

  std::optional<megacpp::trainer::CudaPlugin> plugin;
  at::Device device(at::kCPU);
  std::string name = "CPU";
  if (c.device == "cuda") {
    plugin.emplace(megacpp::trainer::CudaPlugin::beside_executable());
    if (plugin->api().device_count() < 1) {
      std::fprintf(stderr, "bench_orthogonalize: --device cuda but no CUDA device is visible\n");
      return 1;
    }
    plugin->api().set_device(0);
    device = at::Device(at::kCUDA, 0);
    name = plugin->api().device_name(0);
  } else {
    name = megacpp::cpu_model();
  }
  if (c.square == 0) c.square = c.device == "cuda" ? 8192 : 1024;

  // DistMuon's batches at these shapes: q, k, v (split) and the output projection are d x d,
  // the MLP's up projection (mlp x d) and down projection (d x mlp) are stacks of their own.
  const int64_t d = c.d_model, mlp = c.mlp_mult * c.d_model;
  const std::vector<Group> groups{{4 * c.layers, d, d}, {c.layers, mlp, d}, {c.layers, d, mlp}};
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(device);
  fmt::print(
      "bench_orthogonalize: {} ({}), Polar Express {} iterations in bfloat16, d_model {}, "
      "{} layers; {} x {} calls a shape, median\n",
      c.device, name, c.steps, d, c.layers, c.repeats, c.calls);
  fmt::print("{:>22} {:>10} {:>10} {:>12} {:>12} {:>7}\n", "matrices", "ortho ms", "ortho TF/s",
             "matmul ms", "matmul TF/s", "ratio");
  double ortho_flop = 0, ortho_s = 0, mm_flop = 0, mm_s = 0, alt_s = 0;
  using megacpp::trainer::detail::OrthoSums;
  const bool on_device = c.device == "cuda";  // the default: sums in the products on a device
  const OrthoSums alt = on_device ? OrthoSums::kSeparate : OrthoSums::kInProduct;
  for (const Group& g : groups) {
    const int64_t m = std::min(g.rows, g.cols), n = std::max(g.rows, g.cols);
    const at::Tensor x = at::randn({g.batch, g.rows, g.cols}, opts);
    const double s = seconds_per_call(c, [&] {
      return megacpp::trainer::detail::orthogonalize(x, Orthogonalizer::kPolarExpress, c.steps,
                                                     /*bf16=*/true);
    });
    const double flop =
        static_cast<double>(g.batch) * c.steps *
        (4.0 * static_cast<double>(m) * m * n + 2.0 * static_cast<double>(m) * m * m);
    // The iteration's largest product at this shape, on its own.
    const at::Tensor a = at::randn({g.batch, m, n}, bf16), b = at::randn({g.batch, n, m}, bf16);
    const double ms = seconds_per_call(c, [&] { return at::bmm(a, b); });
    const double mflop = 2.0 * static_cast<double>(g.batch) * m * m * n;
    fmt::print("{:>22} {:>10.3f} {:>10.2f} {:>12.3f} {:>12.2f} {:>7.2f}\n",
               fmt::format("{} x {}x{}", g.batch, g.rows, g.cols), 1e3 * s, flop / s / 1e12,
               1e3 * ms, mflop / ms / 1e12, (flop / s) / (mflop / ms));
    // The other place for the scaled sums (detail::OrthoSums): what the default saves.
    alt_s += seconds_per_call(c, [&] {
      return megacpp::trainer::detail::orthogonalize(x, Orthogonalizer::kPolarExpress, c.steps,
                                                     /*bf16=*/true, alt);
    });
    ortho_flop += flop;
    ortho_s += s;
    mm_flop += mflop;
    mm_s += ms;
  }
  const int64_t q = c.square;
  const at::Tensor sa = at::randn({q, q}, bf16), sb = at::randn({q, q}, bf16);
  const double sq_s = seconds_per_call(c, [&] { return at::mm(sa, sb); });
  const double sq_rate = 2.0 * static_cast<double>(q) * q * q / sq_s;
  const double rate = ortho_flop / ortho_s, mm_rate = mm_flop / mm_s;
  fmt::print(
      "total: Polar Express {:.2f} TFLOP/s over {:.3f} ms a step; the same shapes' bfloat16 "
      "products {:.2f} TFLOP/s: {:.2f} of their rate\n",
      rate / 1e12, 1e3 * ortho_s, mm_rate / 1e12, rate / mm_rate);
  fmt::print(
      "total: a {}x{} bfloat16 product {:.2f} TFLOP/s: Polar Express at {:.2f} of it "
      "(goal >= 0.70 on a GPU)\n",
      q, q, sq_rate / 1e12, rate / sq_rate);
  fmt::print(
      "total: scaled sums {} (this device's default) {:.3f} ms a step, {} {:.3f} ms: the "
      "default takes {:.2f} of the other's time\n",
      on_device ? "in the products" : "as separate operations", 1e3 * ortho_s,
      on_device ? "as separate operations" : "in the products", 1e3 * alt_s, ortho_s / alt_s);
  return 0;
}
