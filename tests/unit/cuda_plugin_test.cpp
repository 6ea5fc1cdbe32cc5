// The trainer's CUDA plugin loader (stages/trainer/cuda_plugin.h), on any machine: a missing or
// foreign library is refused in one line naming it, and the built plugin loads (with
// libtorch_cuda and NCCL) and answers on a machine without a GPU. Training on a device is
// cuda_run's (label gpu).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdio.h>

#include <filesystem>
#include <string>

#include "core/error.h"
#include "stages/trainer/cuda_plugin.h"

using megacpp::Error;
using megacpp::ErrorKind;
using megacpp::trainer::CudaPlugin;

namespace {

std::string refusal(const std::filesystem::path& library) {
  try {
    CudaPlugin plugin(library);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << library << " was accepted";
  return {};
}

TEST(CudaPlugin, AMissingLibraryIsOneLineNamingIt) {
  const std::string what = refusal("/nonexistent/libmegacpp_trainer_cuda.so");
  EXPECT_NE(what.find("/nonexistent/libmegacpp_trainer_cuda.so is missing"), std::string::npos)
      << what;
  EXPECT_NE(what.find("--device cpu"), std::string::npos) << what;
  EXPECT_EQ(what.find('\n'), std::string::npos) << what;
}

TEST(CudaPlugin, ALibraryThatIsNotThePluginIsRefused) {
  Dl_info info{};
  ASSERT_NE(::dladdr(reinterpret_cast<void*>(&::fclose), &info), 0);
  const std::string what = refusal(info.dli_fname);
  EXPECT_NE(what.find("has no megacpp_cuda_plugin entry"), std::string::npos) << what;
}

TEST(CudaPlugin, TheBuiltPluginLoadsWithoutAGpu) {
  const auto path = CudaPlugin::beside_executable();
  if (!std::filesystem::exists(path))
    GTEST_SKIP() << "this build has no CUDA plugin (" << path << "): torch without CUDA, or no "
                 << "CUDA/NCCL headers at configure time";
  CudaPlugin plugin(path);
  EXPECT_EQ(plugin.api().abi, megacpp::trainer::kCudaPluginAbi);
  EXPECT_GE(plugin.api().device_count(), 0);
  const std::string versions = plugin.api().versions();
  EXPECT_EQ(versions.rfind("cuda ", 0), 0u) << versions;
  EXPECT_NE(versions.find(" nccl "), std::string::npos) << versions;
  EXPECT_NE(plugin.api().device_name, nullptr);
  // With a device, its name is the driver's (what backend_identity.json records).
  if (plugin.api().device_count() > 0) {
    const std::string name = plugin.api().device_name(0);
    EXPECT_FALSE(name.empty());
    EXPECT_EQ(name.find("cuda "), std::string::npos) << name;  // not the versions string
  }
}

}  // namespace
