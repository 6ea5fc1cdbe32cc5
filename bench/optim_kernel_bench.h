// What bench_adamw_step and bench_muon_tail share: the device a fused optimizer kernel is timed
// on (the CPU with the kernel's reference, or CUDA device 0 through the trainer's CUDA plugin
// as a rank loads it), a median of timed calls each run to its completion, and the time of a
// device copy of a number of bytes (the physical limit an element-wise pass cannot beat).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "bench/peer_json.h"
#include "core/util.h"
#include "stages/trainer/cuda_plugin.h"
#include "stages/trainer/optim.h"

namespace megacpp::bench {

struct KernelBenchDevice {
  std::optional<trainer::CudaPlugin> plugin;  // loaded for cuda
  at::Device device{at::kCPU};
  std::string name;               // the CPU's model or the card's name
  trainer::OptimKernels kernels;  // the plugin's; empty on the CPU
};

// Opens `which` ("cpu" or "cuda") into `d`. False, after one line on stderr naming `bench`, when
// cuda finds no device or a plugin built without the ops' kernels.
inline bool open_kernel_bench_device(const std::string& which, const char* bench,
                                     KernelBenchDevice& d) {
  if (which != "cuda") {
    d.name = cpu_model();
    return true;
  }
  d.plugin.emplace(trainer::CudaPlugin::beside_executable());
  if (d.plugin->api().device_count() < 1) {
    std::fprintf(stderr, "%s: --device cuda but no CUDA device is visible\n", bench);
    return false;
  }
  d.kernels = d.plugin->optim_kernels(0);
  if (!d.kernels.adamw_step || !d.kernels.muon_tail) {
    std::fprintf(stderr,
                 "%s: the CUDA plugin was built without the ops' kernels (no nvcc at configure "
                 "time)\n",
                 bench);
    return false;
  }
  d.plugin->api().set_device(0);
  d.device = at::Device(at::kCUDA, 0);
  d.name = d.plugin->api().device_name(0);
  return true;
}

// The median milliseconds of `steps` calls of `call` after two unmeasured ones; each call is
// timed to its completion by reading a scalar of `done` back (the device's stream drained).
template <typename F>
double median_call_ms(int steps, const at::Tensor& done, F&& call) {
  std::vector<double> out;
  for (int i = 0; i < steps + 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    (void)done.flatten()[0].item<float>();
    if (i >= 2)
      out.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(out);
}

// The median milliseconds of copying bytes / 2 bytes on `device` (reading and writing them:
// `bytes` moved).
inline double copy_ms(const at::Device& device, int64_t bytes, int steps) {
  const at::Tensor src =
      at::empty({bytes / 2}, at::TensorOptions().dtype(at::kByte).device(device));
  at::Tensor dst = at::empty_like(src);
  return median_call_ms(steps, dst, [&] { dst.copy_(src); });
}

}  // namespace megacpp::bench
