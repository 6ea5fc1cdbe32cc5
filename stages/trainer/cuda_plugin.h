// megacpp::trainer CUDA plugin — the rank's access to CUDA devices and NCCL.
//
// The trainer links only libtorch_cpu and libc10, so a CPU rank never maps the CUDA libraries
// (a few hundred MB it would load at start and unmap at exit: both are on a recovery's path).
// A rank launched with `--device cuda` loads libmegacpp_trainer_cuda.so (built beside the
// stage executables wherever torch has CUDA and NCCL's headers are found); loading it loads
// libtorch_cuda, whose static initialisers register torch's CUDA backend, so at::kCUDA tensors
// work in this process from then on, and the plugin creates ProcessGroupNCCL for it.
//
// Lifetime: a CudaPlugin holds the dlopen handle and is neither copyable nor movable. It never
// dlcloses: torch's CUDA backend, once registered, cannot be unregistered, and tensors or
// groups made through the plugin may outlive the object; the library goes with the process.
// Failure: a plugin that is absent, or built for another ABI or against another torch, is
// Error{kInvalidArgument} with one line naming the file and what to do.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ops/ops.h"

namespace megacpp::trainer {

struct OptimKernels;  // optim.h

// Bumped whenever CudaPluginApi changes: a plugin of another build is refused by name.
inline constexpr uint32_t kCudaPluginAbi = 7;

// The plugin's entry points (extern "C" megacpp_cuda_plugin() returns its table). Every
// function may throw c10::Error or std::exception; they run on the caller's thread.
struct CudaPluginApi {
  uint32_t abi;
  // TORCH_VERSION of the headers the plugin was built against. c10d's types cross this table
  // by value and the plugin's libtorch_cuda binds to the libtorch_cpu the trainer already
  // mapped: a plugin of another torch (a mixed install) is refused before anything crosses.
  const char* torch_version;
  // CUDA devices visible to this process (CUDA_VISIBLE_DEVICES applies); 0 without a driver.
  int (*device_count)();
  // Makes `index` this thread's current device (collectives and new tensors use it).
  void (*set_device)(int index);
  // ProcessGroupNCCL over `store` for `rank` of `world`, bound to device `index`, with NCCL's
  // watchdog and async error handling on and collectives timing out after `timeout`.
  c10::intrusive_ptr<c10d::Backend> (*nccl)(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int world, int index,
                                            std::chrono::milliseconds timeout);
  // Aborts every communicator of a group made by nccl() (ncclCommAbort): kernels waiting in a
  // collective return, so a teardown leaves no process spinning on the device.
  void (*abort)(const c10::intrusive_ptr<c10d::Backend>& group);
  // The torch CUDA and NCCL versions the plugin was built against, e.g. "cuda 13.0 nccl 2.27.7".
  const char* (*versions)();
  // Device `index`'s memory through torch's caching allocator since the process started, bytes:
  // the most held by tensors at once (allocated) and the most the allocator held from the
  // driver (reserved: what runs out first).
  void (*memory_peaks)(int index, uint64_t* allocated, uint64_t* reserved);
  // Device `index`'s name as the driver reports it (cudaDeviceProp::name, e.g. "NVIDIA H100 80GB
  // HBM3"): what the receipts name the rank's device by. Valid as long as the plugin is loaded.
  const char* (*device_name)(int index);
  // The calling thread's current stream of device `index` as a cudaStream_t / CUstream (nullptr
  // for the legacy default stream): what a snapshot's side stream orders itself after
  // (trainer/staged_snapshot.h).
  void* (*current_stream)(int index);
  // ops.h adamw_step_cuda on device `index`'s current stream (pointers on that device); null
  // when the plugin was built without the ops' CUDA kernels (no nvcc at configure time).
  void (*adamw_step)(float* p, const float* g, float* m, float* v, int64_t n,
                     const ops::AdamWStepScalars* s, bool decays, int index);
  // ops.h muon_tail_cuda on device `index`'s current stream; null as adamw_step.
  void (*muon_tail)(const ops::MuonTailArgs* args, int index);
};

class CudaPlugin {
 public:
  // Loads `library` (RTLD_NOW | RTLD_GLOBAL: torch's CUDA operators must reach every library).
  explicit CudaPlugin(const std::filesystem::path& library);
  ~CudaPlugin() = default;
  CudaPlugin(const CudaPlugin&) = delete;
  CudaPlugin& operator=(const CudaPlugin&) = delete;

  // libmegacpp_trainer_cuda.so beside the running executable.
  static std::filesystem::path beside_executable();

  const CudaPluginApi& api() const noexcept { return *api_; }
  // The fused optimizer kernels on device `index` this plugin has (TrainStep's `kernels`).
  OptimKernels optim_kernels(int index) const;

 private:
  void* handle_ = nullptr;
  const CudaPluginApi* api_ = nullptr;
};

}  // namespace megacpp::trainer
