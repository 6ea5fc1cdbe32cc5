// libmegacpp_trainer_cuda.so: the CUDA side of a trainer rank (cuda_plugin.h). Built only where
// torch has CUDA and NCCL's headers are found; it links libtorch_cuda, so loading it registers
// torch's CUDA backend in the process.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <string>

#include "ops/ops.h"
#include "stages/trainer/cuda_plugin.h"

namespace {

using megacpp::trainer::CudaPluginApi;

int device_count() {
  return static_cast<int>(c10::cuda::device_count());
}

void set_device(int index) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
}

c10::intrusive_ptr<c10d::Backend> nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                       int world, int index, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
  // Bound: NCCL communicators are created eagerly for this device rather than at the first
  // collective, so a peer that never joins fails the rendezvous, not the first step.
  group->setBoundDeviceId(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index)));
  group->eagerConnectSingleDevice(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index)));
  return group;
}

void abort(const c10::intrusive_ptr<c10d::Backend>& group) {
  if (group) group->abort();
}

const char* versions() {
  static const std::string text = "cuda " + std::to_string(CUDA_VERSION / 1000) + "." +
                                  std::to_string(CUDA_VERSION % 1000 / 10) + " nccl " +
                                  c10d::getNcclVersion();
  return text.c_str();
}

void memory_peaks(int index, uint64_t* allocated, uint64_t* reserved) {
  using c10::CachingDeviceAllocator::StatType;
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  const auto all = static_cast<size_t>(StatType::AGGREGATE);
  *allocated = static_cast<uint64_t>(stats.allocated_bytes[all].peak);
  *reserved = static_cast<uint64_t>(stats.reserved_bytes[all].peak);
}

const char* device_name(int index) {
  return at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index))->name;
}

void* current_stream(int index) {
  return at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index)).stream();
}

#if defined(MEGACPP_HAVE_CUDA) && MEGACPP_HAVE_CUDA
void adamw_step(float* p, const float* g, float* m, float* v, int64_t n,
                const megacpp::ops::AdamWStepScalars* s, bool decays, int index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  megacpp::ops::adamw_step_cuda(p, g, m, v, n, *s, decays, current_stream(index));
}
constexpr auto kAdamwStep = &adamw_step;
void muon_tail(const megacpp::ops::MuonTailArgs* a, int index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  megacpp::ops::muon_tail_cuda(*a, current_stream(index));
}
constexpr auto kMuonTail = &muon_tail;
#else
constexpr decltype(CudaPluginApi::adamw_step) kAdamwStep = nullptr;
constexpr decltype(CudaPluginApi::muon_tail) kMuonTail = nullptr;
#endif

constexpr CudaPluginApi kApi{megacpp::trainer::kCudaPluginAbi,
                             TORCH_VERSION,
                             &device_count,
                             &set_device,
                             &nccl,
                             &abort,
                             &versions,
                             &memory_peaks,
                             &device_name,
                             &current_stream,
                             kAdamwStep,
                             kMuonTail};

}  // namespace

extern "C" __attribute__((visibility("default"))) const CudaPluginApi* megacpp_cuda_plugin() {
  return &kApi;
}

// The supervisor's query (supervisor.h cuda_device_memory_gib), torch-free on its side: the
// total memory of each visible device, in bytes, into `bytes[0, max)`; returns how many devices
// are visible (0 without a driver or a device). Never throws.
extern "C" __attribute__((visibility("default"))) int megacpp_cuda_device_memory(uint64_t* bytes,
                                                                                 int max) {
  try {
    const int n = static_cast<int>(c10::cuda::device_count());
    for (int i = 0; i < n && i < max; ++i)
      bytes[i] = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(i))->totalGlobalMem;
    return n;
  } catch (const std::exception&) {
    return 0;
  }
}
