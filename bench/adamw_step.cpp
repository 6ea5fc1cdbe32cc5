// bench_adamw_step: DistAdamW::step() at world 1 on a recipe's AdamW parameters (by default
// gpu-small's: the embedding and the head, 50304 x 1024 each; its norms have no weights)
// through torch's operations (the gated path a device takes) against the same step through the
// fused kernel (DistAdamWOptions::fused_update: on a GPU the plugin's ops.h adamw_step_cuda), in
// one invocation, with the physical limit beside them: a device copy of the bytes the update
// must move (4 arrays read and 3 written per element). Prints each step's median milliseconds
// and the ratios. Issue 32: a fused kernel is wired in only where it beats torch's.
//
// On the CPU the fused side is ops.h adamw_step_cpu, the kernel's double-precision reference:
// the figure keeps the bench working where there is no GPU, not a case for using it there.
// --device cuda loads the trainer's CUDA plugin as a rank does. A step is timed to its
// completion by reading a scalar of a parameter back. Nothing is asserted.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "bench/optim_kernel_bench.h"
#include "ops/ops.h"
#include "stages/trainer/optim.h"

namespace {

namespace tr = megacpp::trainer;

struct Config {
  std::string device = "cpu";
  int64_t d_model = 1024, vocab = 50304;
  int64_t vectors = 0;  // further d_model-sized parameters (a model with norm weights)
  int steps = 10;       // timed steps (the median is printed) after two unmeasured ones
};

struct Setup {
  std::vector<at::Tensor> params;
  std::unique_ptr<tr::DistAdamW> adam;
};

// The recipe's AdamW groups as TrainStep makes them: embedding, head, and every other
// parameter, each group with its own learning rate; gradients set once.
Setup make(const Config& c, const at::Device& device, tr::AdamWKernel kernel) {
  Setup s;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  s.params.push_back(at::randn({c.vocab, c.d_model}, opts).requires_grad_(true));
  s.params.push_back(at::randn({c.vocab, c.d_model}, opts).requires_grad_(true));
  for (int64_t i = 0; i < c.vectors; ++i)
    s.params.push_back(at::ones({c.d_model}, opts).requires_grad_(true));
  for (auto& p : s.params) p.mutable_grad() = at::randn_like(p) * 1e-2;
  std::vector<tr::AdamWParamGroup> groups{
      tr::AdamWParamGroup{.params = {s.params[0]}, .lr = 0.2},
      tr::AdamWParamGroup{.params = {s.params[1]}, .lr = 0.004}};
  if (c.vectors > 0) {
    groups.push_back(tr::AdamWParamGroup{
        .params = std::vector<at::Tensor>(s.params.begin() + 2, s.params.end()), .lr = 0.004});
  }
  s.adam = std::make_unique<tr::DistAdamW>(
      std::move(groups), nullptr,
      // host_decisions off: the CPU takes the device's (gated) path too.
      tr::DistAdamWOptions{.host_decisions = false, .fused_update = std::move(kernel)});
  return s;
}

double step_ms(const Config& c, Setup& s) {
  return megacpp::bench::median_call_ms(c.steps, s.params[0], [&] { s.adam->step(); });
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"DistAdamW's update: torch's operations against the fused kernel"};
  app.add_option("--device", c.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--d-model", c.d_model, "model width (gpu-small: 1024)")
      ->check(CLI::PositiveNumber);
  app.add_option("--vocab", c.vocab, "vocabulary (gpu-small: 50304)")->check(CLI::PositiveNumber);
  app.add_option("--vectors", c.vectors, "further d_model-sized parameters (gpu-small: 0)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", c.steps, "timed steps")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  megacpp::bench::KernelBenchDevice d;
  if (!megacpp::bench::open_kernel_bench_device(c.device, "bench_adamw_step", d)) return 1;
  const at::Device device = d.device;
  const std::string& name = d.name;
  tr::AdamWKernel kernel = d.kernels.adamw_step;
  if (!kernel) {
    kernel = [](float* p, const float* g, float* m, float* v, int64_t n,
                const megacpp::ops::AdamWStepScalars& s,
                bool decays) { megacpp::ops::adamw_step_cpu(p, g, m, v, n, s, decays); };
  }

  Setup torch_ops = make(c, device, nullptr);
  Setup fused = make(c, device, kernel);
  int64_t numel = 0;
  for (const auto& p : fused.params) numel += p.numel();
  const double ms_torch = step_ms(c, torch_ops);
  const double ms_fused = step_ms(c, fused);
  // The physical limit: copying the bytes the update moves (p, g, m, v read; p, m, v written).
  const int64_t bytes = 7 * 4 * numel;
  const double ms_copy = megacpp::bench::copy_ms(device, bytes, c.steps);

  fmt::print(
      "bench_adamw_step: {} ({}), DistAdamW world 1, {} parameters ({:.1f} M elements), median of "
      "{} steps\n",
      c.device, name, fused.params.size(), numel / 1e6, c.steps);
  fmt::print("  torch's operations (gated path) {:9.3f} ms\n", ms_torch);
  fmt::print("  fused update {:<19} {:9.3f} ms   torch / fused = {:.2f}\n",
             c.device == "cuda" ? "(adamw_step_cuda)" : "(CPU reference)", ms_fused,
             ms_torch / ms_fused);
  fmt::print(
      "  copy of the {:.0f} MB the update moves {:7.3f} ms   fused / copy = {:.2f} (the step also "
      "copies each gradient: 1.29 would be the memory's rate)\n",
      bytes / 1e6, ms_copy, ms_fused / ms_copy);
  return 0;
}
