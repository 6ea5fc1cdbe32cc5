// HostAllocator (stages/trainer/host_allocator.h): torch's CPU tensors through the cache — reuse
// by size, unmapping only to stay within the bound, small requests to c10's allocator, the raw
// interface oneDNN uses, resize and copy-on-write, and concurrent use. The cache is installed
// once for the process: every test reconfigures it and starts from release_idle().
#include "stages/trainer/host_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <thread>
#include <vector>

#include "core/error.h"

namespace megacpp::trainer {
namespace {

constexpr int64_t kMiB = 1 << 20;

at::Tensor floats(int64_t bytes) {
  return torch::empty({bytes / 4}, torch::kFloat);
}

HostAllocator& fresh(const HostAllocatorConfig& config) {
  install_host_allocator({});  // installed with the defaults, then reconfigured
  HostAllocator* a = install_host_allocator(config);
  EXPECT_NE(a, nullptr);
  a->release_idle();
  return *a;
}

TEST(HostAllocator, IsTorchsCpuAllocatorOnceInstalled) {
  HostAllocator& host = fresh({});
  EXPECT_EQ(c10::GetCPUAllocator(), &host);
  EXPECT_EQ(installed_host_allocator(), &host);
  EXPECT_EQ(install_host_allocator({.min_bytes = 0}), &host) << "installed: only reconfigured";
  EXPECT_EQ(c10::GetCPUAllocator(), &host);
  EXPECT_THROW(install_host_allocator({.min_bytes = 100}), Error);
  EXPECT_THROW(install_host_allocator({.idle_fraction = 2.0}), Error);
}

TEST(HostAllocator, ReusesAFreedMappingOfTheSameSize) {
  HostAllocator& host = fresh({});
  const HostAllocatorStats before = host.stats();
  void* first = nullptr;
  {
    at::Tensor t = floats(4 * kMiB);
    first = t.data_ptr();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 4096, 0u) << "data is page-aligned";
    t.fill_(1.0f);
  }
  HostAllocatorStats s = host.stats();
  EXPECT_EQ(s.misses - before.misses, 1u);
  EXPECT_EQ(s.hits, before.hits);
  EXPECT_EQ(s.idle_bytes, uint64_t{4 * kMiB});
  at::Tensor again = floats(4 * kMiB);
  EXPECT_EQ(again.data_ptr(), first);
  s = host.stats();
  EXPECT_EQ(s.hits - before.hits, 1u);
  EXPECT_EQ(s.idle_bytes, 0u);
}

// A class is a quarter of the request's power of two: 2.1 and 2.4 MiB share a 2.5 MiB mapping
// (a routed expert's token count varies from step to step), 2.6 MiB does not.
TEST(HostAllocator, SizesOfOneClassShareAMapping) {
  HostAllocator& host = fresh({});
  const uint64_t misses = host.stats().misses;
  void* first = nullptr;
  {
    const at::Tensor a = floats(2 * kMiB + kMiB / 10);
    first = a.data_ptr();
  }
  {
    const at::Tensor b = floats(2 * kMiB + 4 * kMiB / 10);
    EXPECT_EQ(b.data_ptr(), first);
    EXPECT_EQ(host.stats().mapped_bytes, uint64_t{2 * kMiB + kMiB / 2});
  }
  const at::Tensor c = floats(2 * kMiB + 6 * kMiB / 10);
  EXPECT_EQ(host.stats().misses - misses, 2u);
}

// A request takes an idle mapping up to 1.5 x its class (a routed expert whose tokens moved by a
// class reuses last step's mapping) and counts as its own class: the live bytes and their peak,
// which the bound follows, are the requests', not the mappings'.
TEST(HostAllocator, ARequestTakesASomewhatLargerIdleMapping) {
  HostAllocator& host = fresh({.min_bytes = 256 * 1024, .idle_fraction = 0.0});
  const HostAllocatorStats before = host.stats();
  void* first = nullptr;
  {
    const at::Tensor a = floats(3 * kMiB);
    first = a.data_ptr();
  }
  {
    const at::Tensor b = floats(2 * kMiB);  // class 2 MiB; 3 MiB <= 1.5 x 2 MiB: taken
    EXPECT_EQ(b.data_ptr(), first);
    const HostAllocatorStats s = host.stats();
    EXPECT_EQ(s.misses - before.misses, 1u);
    EXPECT_EQ(s.live_bytes, uint64_t{2 * kMiB});
    EXPECT_EQ(s.mapped_bytes, uint64_t{3 * kMiB});
    EXPECT_EQ(s.idle_bytes, 0u);
  }
  EXPECT_EQ(host.stats().live_bytes, 0u);
  EXPECT_EQ(host.stats().peak_live_bytes, uint64_t{3 * kMiB});
  // 1.25 MiB: 3 MiB is more than 1.5 x its class, so a new mapping, and the bound (the peak, 3
  // MiB, at idle_fraction 0) unmaps the idle one first.
  const at::Tensor c = floats(kMiB + kMiB / 4);
  const HostAllocatorStats s = host.stats();
  EXPECT_EQ(s.misses - before.misses, 2u);
  EXPECT_EQ(s.unmapped - before.unmapped, 1u);
  EXPECT_EQ(s.mapped_bytes, uint64_t{kMiB + kMiB / 4});
  EXPECT_EQ(s.live_bytes, uint64_t{kMiB + kMiB / 4});
}

TEST(HostAllocator, HugePagesAlignLargeMappings) {
  fresh({.huge_pages = true});
  std::vector<at::Tensor> held;
  for (const int64_t bytes : {2 * kMiB, 3 * kMiB + 4096, 5 * kMiB}) {
    held.push_back(floats(bytes));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(held.back().data_ptr()) % (2 * kMiB), 0u) << bytes;
    held.back().fill_(2.0f);
  }
  const at::Tensor below = floats(kMiB);  // under 2 MiB: page-aligned only
  EXPECT_EQ(reinterpret_cast<uintptr_t>(below.data_ptr()) % 4096, 0u);
}

TEST(HostAllocator, SmallRequestsGoToC10sAllocator) {
  HostAllocator& host = fresh({.min_bytes = 256 * 1024});
  const HostAllocatorStats before = host.stats();
  std::vector<at::Tensor> small;
  for (int i = 0; i < 16; ++i) small.push_back(floats(4096 * (i + 1)));
  EXPECT_EQ(host.stats().misses, before.misses);
  EXPECT_EQ(host.stats().mapped_bytes, before.mapped_bytes);
  HostAllocator& off = fresh({.min_bytes = 0});
  const at::Tensor large = floats(8 * kMiB);
  EXPECT_EQ(off.stats().mapped_bytes, before.mapped_bytes) << "min_bytes 0: nothing cached";
}

// idle_fraction 0: a miss unmaps idle mappings, oldest first, as far as needed to keep the
// mapped bytes within the most bytes ever live.
TEST(HostAllocator, UnmapsIdleMappingsOnlyToStayWithinThePeak) {
  HostAllocator& host = fresh({.min_bytes = 256 * 1024, .idle_fraction = 0.0});
  const uint64_t unmapped = host.stats().unmapped;
  { at::Tensor a = floats(8 * kMiB); }  // the peak: 8 MiB
  { at::Tensor b = floats(2 * kMiB); }  // 8 + 2 mapped would exceed it: a goes
  HostAllocatorStats s = host.stats();
  EXPECT_EQ(s.unmapped - unmapped, 1u);
  EXPECT_EQ(s.mapped_bytes, uint64_t{2 * kMiB});
  EXPECT_EQ(s.peak_mapped_bytes, uint64_t{8 * kMiB});
  {
    at::Tensor c = floats(2 * kMiB);  // the idle 2 MiB
    at::Tensor d = floats(2 * kMiB);  // new: 4 MiB mapped, within the peak
  }
  { at::Tensor e = floats(3 * kMiB); }  // 7 MiB mapped, still within: nothing unmapped
  s = host.stats();
  EXPECT_EQ(s.unmapped - unmapped, 1u);
  EXPECT_EQ(s.mapped_bytes, uint64_t{7 * kMiB});
  EXPECT_EQ(s.idle_bytes, s.mapped_bytes);
  { at::Tensor f = floats(6 * kMiB); }  // 7 + 6 > 8: 2, 2 and 3 MiB go, oldest first
  s = host.stats();
  EXPECT_EQ(s.unmapped - unmapped, 4u);
  EXPECT_EQ(s.mapped_bytes, uint64_t{6 * kMiB});
  EXPECT_EQ(s.peak_mapped_bytes, uint64_t{8 * kMiB});
}

// A step's allocations repeated: once the slack covers the sizes whose peaks fall at different
// times (here 8 live 2 MiB temporaries in forward, 1 MiB ones in backward: 1.25 x the live
// peak), no mapping is made after the first two steps (the first creates the gradient) and the
// peak mapped bytes stay where they were, within the bound.
TEST(HostAllocator, ARepeatedStepMakesNoMapping) {
  HostAllocator& host = fresh({.min_bytes = 256 * 1024, .idle_fraction = 0.25});
  torch::manual_seed(1);
  const at::Tensor w = torch::randn({512, 512}, torch::requires_grad());
  const auto step = [&] {
    at::Tensor x = torch::randn({1024, 512});
    at::Tensor h = torch::relu(torch::matmul(x, w));
    at::Tensor loss = torch::matmul(h, w).square().mean();
    loss.backward();
    w.mutable_grad().zero_();
  };
  step();
  step();
  const HostAllocatorStats first = host.stats();
  for (int i = 0; i < 5; ++i) step();
  const HostAllocatorStats later = host.stats();
  EXPECT_EQ(later.misses, first.misses);
  EXPECT_GT(later.hits, first.hits);
  EXPECT_EQ(later.peak_mapped_bytes, first.peak_mapped_bytes);
  EXPECT_LE(static_cast<double>(later.peak_mapped_bytes),
            1.25 * static_cast<double>(later.peak_live_bytes) + 2 * kMiB);
}

TEST(HostAllocator, ResultsEqualTheSystemAllocators) {
  const auto compute = [] {
    torch::manual_seed(7);
    at::Tensor a = torch::randn({300, 700});
    at::Tensor b = torch::randn({700, 400});
    return torch::matmul(a, b).tanh().sum(0);
  };
  fresh({.min_bytes = 0});
  const at::Tensor system = compute();
  HostAllocator& host = fresh({});
  const uint64_t misses = host.stats().misses;
  EXPECT_TRUE(torch::equal(compute(), system));
  EXPECT_GT(host.stats().misses, misses) << "the cache served the computation";
}

// oneDNN (bfloat16 matmuls on CPU) allocates through raw_allocate and frees through the raw
// deleter: both sizes, and the same pointers through allocate's DataPtr.
TEST(HostAllocator, RawInterfaceFreesBothKinds) {
  HostAllocator& host = fresh({});
  c10::Allocator* a = c10::GetCPUAllocator();
  ASSERT_NE(a->raw_deleter(), nullptr);
  void* small = a->raw_allocate(1000);
  void* large = a->raw_allocate(3 * kMiB);
  EXPECT_EQ(host.stats().mapped_bytes - host.stats().idle_bytes, uint64_t{3 * kMiB});
  std::memset(small, 1, 1000);
  std::memset(large, 1, 3 * kMiB);
  a->raw_deallocate(small);
  a->raw_deallocate(large);
  EXPECT_EQ(host.stats().idle_bytes, host.stats().mapped_bytes);
  torch::manual_seed(3);
  const at::Tensor x = torch::randn({512, 1024}).to(torch::kBFloat16);
  const at::Tensor w = torch::randn({1024, 1024}).to(torch::kBFloat16);
  const at::Tensor y = torch::matmul(x, w).to(torch::kFloat);
  const at::Tensor want = torch::matmul(x.to(torch::kFloat), w.to(torch::kFloat));
  EXPECT_TRUE(torch::allclose(y, want, 2e-2, 1.0));
}

TEST(HostAllocator, ResizeAndCopyOnWriteKeepTheData) {
  fresh({});
  at::Tensor t = torch::arange(100000, torch::kFloat);
  const at::Tensor want = t.clone();
  t.resize_({400000});  // a larger storage from the allocator; the old data copied
  EXPECT_TRUE(torch::equal(t.narrow(0, 0, 100000), want));
  at::Tensor lazy = at::_lazy_clone(t);
  t.narrow(0, 0, 1).fill_(-1.0f);  // materializes t's copy; lazy keeps the old values
  EXPECT_TRUE(torch::equal(lazy.narrow(0, 0, 100000), want));
  EXPECT_EQ(t[0].item<float>(), -1.0f);
}

TEST(HostAllocator, ThreadsAllocateAndFreeConcurrently) {
  HostAllocator& host = fresh({});
  const HostAllocatorStats before = host.stats();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) {
        at::Tensor a = floats((1 + (i + t) % 5) * kMiB);
        a.fill_(static_cast<float>(t));
        EXPECT_EQ(a[0].item<float>(), static_cast<float>(t));
      }
    });
  }
  for (auto& th : threads) th.join();
  const HostAllocatorStats s = host.stats();
  EXPECT_EQ(s.hits + s.misses - before.hits - before.misses, 800u);
  EXPECT_EQ(s.mapped_bytes, s.idle_bytes) << "nothing live";
  EXPECT_LE(
      static_cast<double>(s.peak_mapped_bytes),
      (1.0 + host.config().idle_fraction) * static_cast<double>(s.peak_live_bytes) + 5 * kMiB);
}

}  // namespace
}  // namespace megacpp::trainer
