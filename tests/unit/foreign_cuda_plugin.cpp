// A library with the CUDA plugin's entry point that is not this build's plugin: built twice,
// once for another plugin ABI (FOREIGN_ABI) and once for this ABI against another torch
// (FOREIGN_TORCH). cuda_plugin_test checks that the loader refuses each before it calls any
// entry. The table is the loader's layout up to the two fields it reads first; every entry
// after them is null, so a loader that went on would crash rather than pass.
#include <cstdint>

namespace {

struct ForeignApi {
  uint32_t abi;
  const char* torch_version;
  void* entries[11];
};

constexpr ForeignApi kApi{FOREIGN_ABI, FOREIGN_TORCH, {}};

}  // namespace

extern "C" __attribute__((visibility("default"))) const ForeignApi* megacpp_cuda_plugin() {
  return &kApi;
}
