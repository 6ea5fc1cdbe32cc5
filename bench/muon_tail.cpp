// bench_muon_tail: DistMuon::step() at world 1 on a recipe's Muon matrices (by default
// gpu-small's: 12 layers of d_model 1024 — qkv 3072 x 1024 split in three, the attention's
// projection 1024 x 1024, the MLP's 4096 x 1024 and 1024 x 4096 — bf16 parameters with float32
// masters) with its tail (variance reduction and update) through torch's operations against the
// same step through the fused kernel (DistMuonOptions::fused_tail: on a GPU the plugin's ops.h
// muon_tail_cuda), in one invocation, with the physical limit of the tail beside them: a device
// copy of the bytes the fused tail must move (u read twice, P read, P written). Prints each
// step's median milliseconds, their difference (the tail's saving: the rest of the step, the
// orthogonalization above all, is the same work) and the ratios. Issue 32: a fused kernel is
// wired in only where it beats torch's.
//
// On the CPU the fused side is ops.h muon_tail_cpu, the kernel's double-precision reference:
// the figure keeps the bench working where there is no GPU, not a case for using it there.
// --device cuda loads the trainer's CUDA plugin as a rank does. A step is timed to its
// completion by reading a scalar of a parameter back. Nothing is asserted.
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
  int64_t d_model = 1024, layers = 12;
  int steps = 10;  // timed steps (the median is printed) after two unmeasured ones
};

struct Setup {
  std::vector<at::Tensor> params, masters;
  std::unique_ptr<tr::DistMuon> muon;
};

// gpu-small's Muon groups as TrainStep makes them (bf16-mixed): the qkv projections split in
// three, every other block matrix whole; gradients set once.
Setup make(const Config& c, const at::Device& device, tr::MuonTailKernel kernel) {
  Setup s;
  const int64_t d = c.d_model;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  std::vector<at::Tensor> qkv, rest;
  for (int64_t l = 0; l < c.layers; ++l) {
    for (const auto& shape :
         std::vector<std::vector<int64_t>>{{3 * d, d}, {d, d}, {4 * d, d}, {d, 4 * d}}) {
      const at::Tensor master = at::randn(shape, f32) * 0.02;
      at::Tensor p = master.to(at::kBFloat16).requires_grad_(true);
      p.mutable_grad() = (at::randn(shape, f32) * 1e-2).to(at::kBFloat16);
      s.params.push_back(p);
      s.masters.push_back(master);
      (shape[0] == 3 * d ? qkv : rest).push_back(p);
    }
  }
  std::vector<at::Tensor> qkv_m, rest_m;
  for (size_t i = 0; i < s.params.size(); ++i)
    (s.params[i].size(0) == 3 * d ? qkv_m : rest_m).push_back(s.masters[i]);
  s.muon = std::make_unique<tr::DistMuon>(
      std::vector<tr::MuonParamGroup>{
          tr::MuonParamGroup{.params = rest, .masters = rest_m},
          tr::MuonParamGroup{.params = qkv, .qkv_split_sizes = {d, d, d}, .masters = qkv_m}},
      nullptr,
      // host_decisions off: the CPU takes the device's (gated) path too.
      tr::DistMuonOptions{.bf16_orthogonalization = device.is_cuda(),
                          .master_weights = true,
                          .reduce_dtype = at::kFloat,
                          .host_decisions = false,
                          .fused_tail = std::move(kernel)});
  return s;
}

double step_ms(const Config& c, Setup& s) {
  return megacpp::bench::median_call_ms(c.steps, s.params[0], [&] { s.muon->step(); });
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"DistMuon's tail: torch's operations against the fused kernel"};
  app.add_option("--device", c.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--d-model", c.d_model, "model width (gpu-small: 1024)")
      ->check(CLI::PositiveNumber);
  app.add_option("--layers", c.layers, "blocks (gpu-small: 12)")->check(CLI::PositiveNumber);
  app.add_option("--steps", c.steps, "timed steps")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  megacpp::bench::KernelBenchDevice d;
  if (!megacpp::bench::open_kernel_bench_device(c.device, "bench_muon_tail", d)) return 1;
  const at::Device device = d.device;
  const std::string& name = d.name;
  tr::MuonTailKernel kernel = d.kernels.muon_tail;
  if (!kernel) kernel = [](const megacpp::ops::MuonTailArgs& a) { megacpp::ops::muon_tail_cpu(a); };

  Setup torch_ops = make(c, device, nullptr);
  int64_t calls = 0;
  Setup fused = make(c, device, [&calls, kernel](const megacpp::ops::MuonTailArgs& a) {
    ++calls;
    kernel(a);
  });
  int64_t numel = 0;
  for (const auto& p : fused.params) numel += p.numel();
  const double ms_torch = step_ms(c, torch_ops);
  calls = 0;
  const double ms_fused = step_ms(c, fused);
  // The physical limit of the fused tail: copying the bytes it moves (u twice, P, the new P).
  const int64_t bytes = 4 * 4 * numel;
  const double ms_copy = megacpp::bench::copy_ms(device, bytes, c.steps);

  fmt::print(
      "bench_muon_tail: {} ({}), DistMuon world 1, {} matrices ({:.1f} M elements, bf16 with "
      "float32 masters), median of {} steps; {} fused calls a step\n",
      c.device, name, fused.params.size(), numel / 1e6, c.steps,
      calls / static_cast<int64_t>(c.steps + 2));
  fmt::print("  step, tail through torch's operations {:9.3f} ms\n", ms_torch);
  fmt::print("  step, fused tail {:<22} {:9.3f} ms   torch / fused = {:.3f}; saved {:.3f} ms\n",
             c.device == "cuda" ? "(muon_tail_cuda)" : "(CPU reference)", ms_fused,
             ms_torch / ms_fused, ms_torch - ms_fused);
  fmt::print("  copy of the {:.0f} MB the fused tail moves {:7.3f} ms (its lower bound)\n",
             bytes / 1e6, ms_copy);
  return 0;
}
