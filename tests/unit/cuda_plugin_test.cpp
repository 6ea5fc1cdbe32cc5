// The trainer's CUDA plugin loader (stages/trainer/cuda_plugin.h), on any machine: a missing or
// foreign library is refused in one line naming it, and the built plugin loads (with
// libtorch_cuda and NCCL) and answers on a machine without a GPU. On a device, its fused
// optimizer kernel against torch's operations (skipped without one). Training on a device is
// cuda_run's (label gpu).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdio.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "core/error.h"
#include "stages/trainer/collective.h"
#include "stages/trainer/cuda_plugin.h"
#include "stages/trainer/optim.h"

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

TEST(CudaPlugin, APluginOfAnotherAbiIsRefusedNamingBoth) {
  const std::string what = refusal(FOREIGN_PLUGIN_ABI);
  EXPECT_NE(what.find("was built for plugin ABI 1, this trainer needs " +
                      std::to_string(megacpp::trainer::kCudaPluginAbi)),
            std::string::npos)
      << what;
  EXPECT_EQ(what.find('\n'), std::string::npos) << what;
}

TEST(CudaPlugin, APluginBuiltAgainstAnotherTorchIsRefusedNamingBoth) {
  const std::string what = refusal(FOREIGN_PLUGIN_TORCH);
  EXPECT_NE(what.find("built against torch 1.0.0-another-torch, this trainer against torch " +
                      std::string(TORCH_VERSION)),
            std::string::npos)
      << what;
  EXPECT_EQ(what.find('\n'), std::string::npos) << what;
}

TEST(CudaPlugin, TheBuiltPluginLoadsWithoutAGpu) {
  const auto path = CudaPlugin::beside_executable();
  if (!std::filesystem::exists(path))
    GTEST_SKIP() << "this build has no CUDA plugin (" << path << "): torch without CUDA, or no "
                 << "CUDA/NCCL headers at configure time";
  CudaPlugin plugin(path);
  EXPECT_EQ(plugin.api().abi, megacpp::trainer::kCudaPluginAbi);
  EXPECT_STREQ(plugin.api().torch_version, TORCH_VERSION);
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

// The fused optimizer kernels on device 0 through the plugin, against torch's operations on the
// same device. Skips without a plugin, a device, or the ops' kernels in the plugin.
class CudaPluginGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto path = CudaPlugin::beside_executable();
    if (!std::filesystem::exists(path))
      GTEST_SKIP() << "this build has no CUDA plugin (" << path << ")";
    plugin_.emplace(path);
    if (plugin_->api().device_count() < 1) GTEST_SKIP() << "no CUDA device visible";
    if (plugin_->api().adamw_step == nullptr || plugin_->api().muon_tail == nullptr)
      GTEST_SKIP() << "the plugin was built without the ops' CUDA kernels (no nvcc)";
    plugin_->api().set_device(0);
  }
  // Float32 normal values of `shape` from `seed`, made on the host (the same on every device).
  static at::Tensor randn(const std::vector<int64_t>& shape, uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
  }
  static at::Tensor host(const at::Tensor& t) {
    return t.detach().to(at::kCPU).to(at::kFloat).contiguous();
  }
  static double max_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a - b).abs().max().item<double>();
  }
  std::optional<CudaPlugin> plugin_;
  const at::Device dev_{at::kCUDA, 0};
};

// DistAdamW on a device through the plugin's fused kernel (CudaPlugin::optim_kernels) against
// the same optimizer with torch's operations: the parameters and the state within float32
// rounding after steps with weight decay, a parameter without a gradient, and the decay switched
// off; a parameter without a gradient exactly unchanged.
TEST_F(CudaPluginGpu, FusedAdamWGivesTorchsValuesOnTheDevice) {
  namespace tr = megacpp::trainer;
  const at::Device dev = dev_;
  const std::vector<std::vector<int64_t>> shapes{{1024, 1000}, {7, 5}, {4099}, {}};
  struct Run {
    std::vector<at::Tensor> p;
    std::unique_ptr<tr::DistAdamW> adam;
  };
  const auto make = [&](tr::AdamWKernel kernel) {
    Run r;
    for (size_t i = 0; i < shapes.size(); ++i)
      r.p.push_back(randn(shapes[i], 61 + i).to(dev).requires_grad_(true));
    r.adam = std::make_unique<tr::DistAdamW>(
        std::vector<tr::AdamWParamGroup>{
            tr::AdamWParamGroup{.params = {r.p[0], r.p[1]}, .lr = 1e-2, .weight_decay = 0.1},
            tr::AdamWParamGroup{.params = {r.p[2], r.p[3]}, .lr = 3e-3}},
        nullptr, tr::DistAdamWOptions{.fused_update = std::move(kernel)});
    return r;
  };
  Run torch_ops = make(nullptr), fused = make(plugin_->optim_kernels(0).adamw_step);
  for (uint32_t step = 0; step < 6; ++step) {
    const bool skip = step == 1 || step == 4;  // the first parameter has no gradient
    const at::Tensor before = host(fused.p[0]);
    for (Run* r : {&torch_ops, &fused}) {
      for (size_t i = 0; i < r->p.size(); ++i) {
        r->p[i].mutable_grad() =
            skip && i == 0 ? at::Tensor() : randn(shapes[i], 1000 * step + i).to(dev);
      }
      if (step == 3) r->adam->set_weight_decay(0, 0.0);
      r->adam->step();
    }
    SCOPED_TRACE(::testing::Message() << "step " << step);
    for (size_t i = 0; i < shapes.size(); ++i)
      EXPECT_LE(max_diff(host(torch_ops.p[i]), host(fused.p[i])), 1e-5) << "parameter " << i;
    if (skip) {
      EXPECT_TRUE(at::equal(host(fused.p[0]), before));
    }
  }
  const auto a = torch_ops.adam->state_dict(), b = fused.adam->state_dict();
  ASSERT_EQ(a.entries.size(), b.entries.size());
  for (size_t e = 0; e < a.entries.size(); ++e)
    EXPECT_LE(max_diff(host(a.entries[e].value), host(b.entries[e].value)), 1e-5)
        << "state entry " << e;
}

// DistMuon on a device through the plugin's fused tail (CudaPlugin::optim_kernels) against the
// same optimizer with torch's operations, bf16 parameters with float32 masters as gpu-small
// trains: tall and wide stacks, a qkv group split in three, an entry without a gradient at
// steps 1 and 4. The masters within 1e-5 of torch's (float32 rounding of the same arithmetic;
// the orthogonalization is the same operations on both sides), the state within 1e-5.
TEST_F(CudaPluginGpu, FusedMuonTailGivesTorchsValuesOnTheDevice) {
  namespace tr = megacpp::trainer;
  const at::Device dev = dev_;
  const std::vector<std::vector<int64_t>> shapes{{512, 128}, {512, 128}, {128, 384}};
  const std::vector<std::vector<int64_t>> qkv_shapes{{384, 128}, {384, 128}};
  struct Run {
    std::vector<at::Tensor> p, q, pm, qm;
    std::unique_ptr<tr::DistMuon> muon;
  };
  int64_t calls = 0;
  const auto make = [&](tr::MuonTailKernel kernel) {
    Run r;
    for (size_t i = 0; i < shapes.size(); ++i) {
      r.pm.push_back(randn(shapes[i], 71 + i).mul_(0.02).to(dev));
      r.p.push_back(r.pm.back().to(at::kBFloat16).requires_grad_(true));
    }
    for (size_t i = 0; i < qkv_shapes.size(); ++i) {
      r.qm.push_back(randn(qkv_shapes[i], 81 + i).mul_(0.02).to(dev));
      r.q.push_back(r.qm.back().to(at::kBFloat16).requires_grad_(true));
    }
    r.muon = std::make_unique<tr::DistMuon>(
        std::vector<tr::MuonParamGroup>{
            tr::MuonParamGroup{.params = r.p, .masters = r.pm},
            tr::MuonParamGroup{.params = r.q, .qkv_split_sizes = {128, 128, 128}, .masters = r.qm}},
        nullptr,
        tr::DistMuonOptions{.bf16_orthogonalization = true,
                            .master_weights = true,
                            .reduce_dtype = at::kFloat,
                            .fused_tail = std::move(kernel)});
    return r;
  };
  const tr::MuonTailKernel kernel = plugin_->optim_kernels(0).muon_tail;
  Run torch_ops = make(nullptr), fused = make([&](const megacpp::ops::MuonTailArgs&a) {
                                   ++calls;
                                   kernel(a);
                                 });
  for (uint32_t step = 0; step < 6; ++step) {
    const bool skip = step == 1 || step == 4;  // the first entry of each group has no gradient
    for (Run* r : {&torch_ops, &fused}) {
      for (auto* set : {&r->p, &r->q}) {
        for (size_t i = 0; i < set->size(); ++i) {
          (*set)[i].mutable_grad() =
              skip && i == 0
                  ? at::Tensor()
                  : randn((*set)[i].sizes().vec(), 1000 * step + i).to(dev).to(at::kBFloat16);
        }
      }
      r->muon->step();
    }
    SCOPED_TRACE(::testing::Message() << "step " << step);
    // The tall stack, the wide one and the folded qkv stack, every step.
    EXPECT_EQ(calls, 3 * static_cast<int64_t>(step + 1));
    const auto a = torch_ops.muon->state_dict(), b = fused.muon->state_dict();
    ASSERT_EQ(a.entries.size(), b.entries.size());
    for (size_t e = 0; e < a.entries.size(); ++e)
      EXPECT_LE(max_diff(host(a.entries[e].value), host(b.entries[e].value)), 1e-5)
          << "state entry " << e;
  }
}

// NCCL at world 1, what one GPU allows of it: the plugin's group connects eagerly on device 0,
// an all-reduce gives its value, the group's error state reads clean after the host read
// (check_async_error, as the step reads it), and the plugin's abort — ncclCommAbort, what the
// supervisor's AbortCollectives runs on a GPU rank — returns, after which the group is released
// without hanging. A rank at world 1 trains without a group, so this is where NCCL and its abort
// run on a one-GPU machine; across ranks they need two GPUs.
TEST(CudaPluginNccl, AGroupAtWorldOneReducesAndItsAbortReturns) {
  const auto path = CudaPlugin::beside_executable();
  if (!std::filesystem::exists(path))
    GTEST_SKIP() << "this build has no CUDA plugin (" << path << ")";
  CudaPlugin plugin(path);
  if (plugin.api().device_count() < 1) GTEST_SKIP() << "no CUDA device visible";
  plugin.api().set_device(0);
  using Clock = std::chrono::steady_clock;
  const auto store = c10::make_intrusive<c10d::HashStore>();
  const auto connect = Clock::now();
  c10::intrusive_ptr<c10d::Backend> group =
      plugin.api().nccl(store, /*rank=*/0, /*world=*/1, /*index=*/0, std::chrono::seconds(30));
  ASSERT_TRUE(group);
  EXPECT_EQ(group->getBackendName(), "nccl");
  std::printf("NCCL (%s) at world 1 connected in %.3f s\n", plugin.api().versions(),
              std::chrono::duration<double>(Clock::now() - connect).count());
  const at::Tensor expected = at::arange(4096, at::TensorOptions().dtype(at::kFloat));
  std::vector<at::Tensor> tensors{expected.to(at::Device(at::kCUDA, 0))};
  group->allreduce(tensors)->wait();
  const at::Tensor back = tensors[0].to(at::kCPU);
  EXPECT_NO_THROW(megacpp::trainer::check_async_error("the world-1 all-reduce", group));
  EXPECT_TRUE(at::equal(back, expected));
  const auto abort = Clock::now();
  plugin.api().abort(group);
  const double abort_s = std::chrono::duration<double>(Clock::now() - abort).count();
  std::printf("ncclCommAbort through the plugin returned in %.3f s\n", abort_s);
  group.reset();  // released after the abort: a hang here is the test's timeout
}

}  // namespace
