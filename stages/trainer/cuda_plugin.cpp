// Loading the CUDA plugin (cuda_plugin.h). Torch-light: only c10d's Backend and Store types.
#include "stages/trainer/cuda_plugin.h"

#include <dlfcn.h>

#include <string_view>

#include <fmt/format.h>

#include "core/error.h"
#include "stages/trainer/optim.h"

namespace megacpp::trainer {

std::filesystem::path CudaPlugin::beside_executable() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path() /
         "libmegacpp_trainer_cuda.so";
}

CudaPlugin::CudaPlugin(const std::filesystem::path& library) {
  MEGACPP_CHECK(std::filesystem::exists(library), ErrorKind::kInvalidArgument,
                fmt::format("--device cuda: {} is missing: this build has no CUDA trainer "
                            "(torch without CUDA, or NCCL's headers not found at configure "
                            "time); build on a machine with both, or run with --device cpu",
                            library.string()));
  handle_ = ::dlopen(library.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle_ == nullptr) {
    const char* why = ::dlerror();
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "--device cuda: cannot load {}: {}", library.string(),
                 why != nullptr ? why : "unknown dlopen error");
  }
  using Entry = const CudaPluginApi* (*)();
  auto entry = reinterpret_cast<Entry>(::dlsym(handle_, "megacpp_cuda_plugin"));
  MEGACPP_CHECK(entry != nullptr, ErrorKind::kInvalidArgument,
                fmt::format("--device cuda: {} has no megacpp_cuda_plugin entry: it is not "
                            "this project's CUDA plugin; rebuild",
                            library.string()));
  api_ = entry();
  MEGACPP_CHECK(api_ != nullptr && api_->abi == kCudaPluginAbi, ErrorKind::kInvalidArgument,
                fmt::format("--device cuda: {} was built for plugin ABI {}, this trainer "
                            "needs {}: rebuild both from one tree",
                            library.string(), api_ != nullptr ? api_->abi : 0, kCudaPluginAbi));
  MEGACPP_CHECK(std::string_view(api_->torch_version) == TORCH_VERSION, ErrorKind::kInvalidArgument,
                fmt::format("--device cuda: {} was built against torch {}, this trainer against "
                            "torch {}: rebuild both against one torch",
                            library.string(), api_->torch_version, TORCH_VERSION));
}

OptimKernels CudaPlugin::optim_kernels(int index) const {
  OptimKernels k;
  if (const auto adamw = api_->adamw_step; adamw != nullptr) {
    k.adamw_step = [adamw, index](float* p, const float* g, float* m, float* v, int64_t n,
                                  const ops::AdamWStepScalars& s,
                                  bool decays) { adamw(p, g, m, v, n, &s, decays, index); };
  }
  if (const auto tail = api_->muon_tail; tail != nullptr)
    k.muon_tail = [tail, index](const ops::MuonTailArgs& a) { tail(&a, index); };
  return k;
}

}  // namespace megacpp::trainer
