#include "stages/trainer/host_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "core/knobs.h"

namespace megacpp::trainer {

namespace {

// A mapping of the cache: live (handed out) or idle (in its size's list and the LRU list).
struct Block {
  size_t bytes = 0;       // mapped
  size_t used = 0;        // live: the size class of the request it serves (<= bytes)
  void* older = nullptr;  // idle blocks by the time they were freed (their data pointers)
  void* newer = nullptr;
};

size_t page_size() {
  static const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// The mapping a request of n bytes takes: n rounded up to a quarter of its power of two, in
// pages (256 KiB -> steps of 64 KiB, 2 MiB -> 512 KiB). Sizes that vary from step to step (a
// routed expert's tokens) then share mappings; the pages beyond a request are not touched, so
// they cost address space, not resident memory, unless a larger request of the class touched
// them before.
size_t size_class(size_t n) {
  const size_t page = page_size();
  const size_t pages = (n + page - 1) / page;
  const size_t step = std::max<size_t>(1, std::bit_floor(pages) / 4);
  return (pages + step - 1) / step * step * page;
}

constexpr size_t kHugePage = size_t{2} << 20;

// A request may take an idle mapping up to this much larger than its class (1 + 1/2): the next
// one or two classes up. A routed expert's token count moves by a class from step to step; with
// an exact match only, each move unmapped one mapping and faulted a new one.
size_t reuse_limit(size_t bytes) {
  return bytes + bytes / 2;
}

// `bytes` of fresh anonymous memory, or nullptr (errno set). With `huge`, a mapping of at least
// 2 MiB starts on a 2 MiB boundary and is advised for transparent huge pages, as the trainer's
// tuned glibc heap is (glibc.malloc.hugetlb=1): faulted and freed 2 MiB at a time.
void* map_bytes(size_t bytes, bool huge) {
  const int prot = PROT_READ | PROT_WRITE;
  const int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (!huge || bytes < kHugePage) {
    void* p = ::mmap(nullptr, bytes, prot, flags, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  void* p = ::mmap(nullptr, bytes + kHugePage, prot, flags, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) SYSCALL_CHECK(::munmap(p, aligned - start));
  const uintptr_t tail = start + kHugePage - aligned;  // what the head did not take
  if (tail > 0) SYSCALL_CHECK(::munmap(reinterpret_cast<void*>(aligned + bytes), tail));
  // Advice only: a kernel without THP leaves 4 KiB pages.
  (void)::madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(aligned);
}

// Mappings taken out of the cache under its lock, unmapped after it is released.
using Evicted = std::vector<std::pair<void*, size_t>>;

void unmap(const Evicted& evicted) {
  // munmap of a mapping this cache made fails only on a bug.
  for (const auto& [data, bytes] : evicted) SYSCALL_CHECK(::munmap(data, bytes));
}

// The installed cache: the raw deleter is a plain function, so it is reached through this.
std::atomic<HostAllocator*> g_installed{nullptr};

}  // namespace

struct HostAllocator::State {
  mutable std::mutex mu;
  HostAllocatorConfig config;
  // config's min_bytes and huge_pages, read without the lock: every allocation reads them,
  // most of them small ones that never take it.
  std::atomic<uint64_t> min_bytes{0};
  std::atomic<bool> huge_pages{false};

  void configure(const HostAllocatorConfig& c) {
    config = c;
    min_bytes.store(c.min_bytes, std::memory_order_relaxed);
    huge_pages.store(c.huge_pages, std::memory_order_relaxed);
  }
  std::unordered_map<void*, Block> blocks;    // every mapping, by its data
  std::map<size_t, std::vector<void*>> idle;  // by mapped size, oldest first; no empty lists
  void* oldest = nullptr;
  void* newest = nullptr;
  HostAllocatorStats stats;

  void unlink(Block& b) {
    (b.older != nullptr ? blocks.at(b.older).newer : oldest) = b.newer;
    (b.newer != nullptr ? blocks.at(b.newer).older : newest) = b.older;
    b.older = b.newer = nullptr;
  }

  // A mapping for a request of class `bytes`: an idle one of the smallest mapped size from
  // `bytes` to reuse_limit(bytes) (of that size, the most recently freed), else nullptr after
  // unmapping idle ones (collected in `evicted`) as far as the bound needs. The live bytes and
  // their peak count request classes, not the mappings that serve them: a larger mapping taken
  // raises neither, and the bound stays (1 + idle_fraction) x the classes' peak.
  void* take_or_evict(size_t bytes, Evicted& evicted) {
    auto it = idle.lower_bound(bytes);
    if (it != idle.end() && it->first <= reuse_limit(bytes)) {
      void* data = it->second.back();
      it->second.pop_back();
      if (it->second.empty()) idle.erase(it);
      Block& b = blocks.at(data);
      unlink(b);
      b.used = bytes;
      stats.idle_bytes -= b.bytes;
      stats.live_bytes += bytes;
      ++stats.hits;
      stats.peak_live_bytes = std::max(stats.peak_live_bytes, stats.live_bytes);
      return data;
    }
    ++stats.misses;
    stats.peak_live_bytes = std::max(stats.peak_live_bytes, stats.live_bytes + bytes);
    const auto bound = static_cast<uint64_t>((1.0 + config.idle_fraction) *
                                             static_cast<double>(stats.peak_live_bytes));
    while (oldest != nullptr && stats.mapped_bytes + bytes > bound) evict_oldest(evicted);
    // Counted as mapped and live now, before the mmap outside the lock, so that a concurrent
    // miss sees it.
    stats.mapped_bytes += bytes;
    stats.live_bytes += bytes;
    stats.peak_mapped_bytes = std::max(stats.peak_mapped_bytes, stats.mapped_bytes);
    return nullptr;
  }

  void evict_oldest(Evicted& evicted) {
    void* data = oldest;
    auto node = blocks.find(data);
    const size_t bytes = node->second.bytes;
    auto same = idle.find(bytes);
    same->second.erase(std::find(same->second.begin(), same->second.end(), data));  // its first
    if (same->second.empty()) idle.erase(same);
    unlink(node->second);
    blocks.erase(node);
    stats.idle_bytes -= bytes;
    stats.mapped_bytes -= bytes;
    ++stats.unmapped;
    evicted.emplace_back(data, bytes);
  }

  void evict_all(Evicted& evicted) {
    while (oldest != nullptr) evict_oldest(evicted);
  }

  void add(void* data, size_t bytes) { blocks.emplace(data, Block{.bytes = bytes, .used = bytes}); }

  void give(void* data) {
    Block& b = blocks.at(data);
    stats.live_bytes -= b.used;
    b.used = 0;
    idle[b.bytes].push_back(data);
    b.older = newest;
    b.newer = nullptr;
    (newest != nullptr ? blocks.at(newest).newer : oldest) = data;
    newest = data;
    stats.idle_bytes += b.bytes;
  }
};

HostAllocatorConfig HostAllocatorConfig::from_knobs() {
  HostAllocatorConfig c;
  std::string v = knob_string(Knob::kHostAllocator);
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer checks heap allocations only: unless asked, every tensor stays on them.
  if (!knob_value(Knob::kHostAllocator)) v = "system";
#endif
  if (v == "system") {
    c.min_bytes = 0;
  } else {
    MEGACPP_CHECK(
        v == "cache", ErrorKind::kInvalidArgument,
        fmt::format("MEGACPP_HOST_ALLOCATOR={} is not an allocator: use cache or system", v));
  }
  // The trainer's glibc heap is on transparent huge pages when its malloc is tuned so
  // (the supervisor's kTrainerMallocTunables): the cache's mappings follow it.
  const std::string tunables = foreign_env("GLIBC_TUNABLES").value_or("");
  c.huge_pages = tunables.find("glibc.malloc.hugetlb=1") != std::string::npos ||
                 tunables.find("glibc.malloc.hugetlb=2") != std::string::npos;
  c.validate();
  return c;
}

void HostAllocatorConfig::validate() const {
  MEGACPP_CHECK(min_bytes == 0 || min_bytes >= 4096, ErrorKind::kInvalidArgument,
                fmt::format("host allocator: min_bytes {} is below a page; use 0 (off) or >= 4096",
                            min_bytes));
  MEGACPP_CHECK(
      idle_fraction >= 0.0 && idle_fraction <= 1.0, ErrorKind::kInvalidArgument,
      fmt::format("host allocator: idle_fraction {} is not within [0, 1]", idle_fraction));
}

HostAllocator::HostAllocator(const HostAllocatorConfig& config)
    : state_(std::make_unique<State>()) {
  config.validate();
  state_->configure(config);
}

HostAllocator::~HostAllocator() = default;

HostAllocator* install_host_allocator(const HostAllocatorConfig& config) {
  config.validate();
  if (HostAllocator* installed = g_installed.load()) {
    const std::lock_guard lock(installed->state_->mu);
    installed->state_->configure(config);
    return installed;
  }
  if (config.min_bytes == 0) return nullptr;
  // Never destroyed (see the header): constructed in static storage, not on the heap, so no
  // leak checker reports it.
  alignas(HostAllocator) static unsigned char storage[sizeof(HostAllocator)];
  HostAllocator* a = std::construct_at(reinterpret_cast<HostAllocator*>(storage), config);
  c10::SetCPUAllocator(a, 0);
  MEGACPP_CHECK(c10::GetCPUAllocator() == a, ErrorKind::kInternal,
                "another CPU allocator of a higher priority is installed in torch");
  g_installed.store(a);
  return a;
}

HostAllocator* installed_host_allocator() {
  return g_installed.load();
}

HostAllocatorConfig HostAllocator::config() const {
  const std::lock_guard lock(state_->mu);
  return state_->config;
}

HostAllocatorStats HostAllocator::stats() const {
  const std::lock_guard lock(state_->mu);
  return state_->stats;
}

void HostAllocator::release_idle() {
  Evicted evicted;
  {
    const std::lock_guard lock(state_->mu);
    state_->evict_all(evicted);
    HostAllocatorStats& s = state_->stats;
    s.peak_mapped_bytes = s.mapped_bytes;
    s.peak_live_bytes = s.live_bytes;
  }
  unmap(evicted);
}

c10::DataPtr HostAllocator::allocate(size_t n) {
  const uint64_t min_bytes = state_->min_bytes.load(std::memory_order_relaxed);
  if (min_bytes == 0 || n < min_bytes) return c10::GetDefaultCPUAllocator()->allocate(n);
  const bool huge = state_->huge_pages.load(std::memory_order_relaxed);
  const size_t bytes = size_class(n);
  Evicted evicted;
  void* data = nullptr;
  {
    const std::lock_guard lock(state_->mu);
    data = state_->take_or_evict(bytes, evicted);
  }
  unmap(evicted);
  if (data == nullptr) {
    data = map_bytes(bytes, huge);
    if (data == nullptr && errno == ENOMEM) {
      Evicted idle;
      {
        const std::lock_guard lock(state_->mu);
        state_->evict_all(idle);
      }
      unmap(idle);
      data = map_bytes(bytes, huge);
    }
    if (data == nullptr) {
      const int err = errno;
      {
        const std::lock_guard lock(state_->mu);
        state_->stats.mapped_bytes -= bytes;
        state_->stats.live_bytes -= bytes;
      }
      TORCH_CHECK_WITH(OutOfMemoryError, false, "megacpp host allocator: cannot map ", bytes,
                       " bytes for a tensor (", std::strerror(err), ")");
    }
    const std::lock_guard lock(state_->mu);
    state_->add(data, bytes);
  }
  return {data, data, &free_mapped, c10::Device(c10::DeviceType::CPU)};
}

void HostAllocator::free_mapped(void* data) {
  HostAllocator* a = g_installed.load();
  const std::lock_guard lock(a->state_->mu);
  a->state_->give(data);
}

void HostAllocator::free_any(void* data) {
  if (data == nullptr) return;
  HostAllocator* a = g_installed.load();
  {
    const std::lock_guard lock(a->state_->mu);
    if (a->state_->blocks.contains(data)) {
      a->state_->give(data);
      return;
    }
  }
  c10::GetDefaultCPUAllocator()->raw_deleter()(data);
}

c10::DeleterFnPtr HostAllocator::raw_deleter() const {
  return &free_any;
}

void HostAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

}  // namespace megacpp::trainer
