// HostAllocator: torch's CPU allocator for a trainer rank. Large tensors come from a cache of
// page-aligned anonymous mappings reused by size class (a quarter of the request's power of two,
// so a routed expert's varying token counts share mappings; the pages past a request are not
// touched, so not resident); small ones from c10's default allocator (glibc underneath).
//
// Why: under glibc a training step's large temporaries either fault fresh pages each time (above
// the mmap threshold) or, once the dynamic threshold has risen past them, land in heap arenas
// whose freed pieces the next step's different sizes cannot reuse — a rank's peak resident size
// then runs 1.2-1.4x the bytes it holds (bench/memory_plan.py), more than the plan can state.
//
// Policy: a request of at least Config::min_bytes takes an idle mapping of its class, or of the
// next one or two classes up (at most 1.5 x its class), when one exists (no system call, no page
// fault: a step that repeats the previous step's allocations makes none, and an expert whose
// tokens moved by a class finds last step's mapping). Otherwise a new mapping is made, after
// unmapping idle ones, least recently freed first, as far as needed to keep the mapped bytes
// within (1 + idle_fraction) x the most bytes ever live, counted by the requests' classes
// (Config). The mapped bytes grow only at a miss, so that bound holds throughout: the cache's
// resident size is the live classes' peak and a stated slack.
//
// Lifetime: install_host_allocator() makes the cache torch's CPU allocator for the rest of the
// process. It cannot be taken back: c10's allocator table is process-wide, and its raw interface
// (oneDNN's scratch buffers: raw_allocate now, raw_deallocate through whatever allocator is
// installed then, possibly during static destruction) frees through a stateless function. So
// the cache is the one object of the process reached through a global: it is never destroyed.
//
// Thread safety: allocate and free from any thread (one mutex; intra-op and Gloo threads do).
#pragma once

#include <c10/core/Allocator.h>

#include <cstdint>
#include <memory>

namespace megacpp::trainer {

struct HostAllocatorConfig {
  // Requests of at least this many bytes use the cache; 0 leaves torch's allocator in place.
  // 64 KiB: a small model's matrices and their optimizer state (128 x 128 floats) come here too;
  // below it glibc's heap holds them, its pieces reused by size no better than the cache's and
  // its free space never returned (tiny-hybrid: 20 MiB of heap above the tensors at 256 KiB).
  uint64_t min_bytes = 64 * 1024;
  // How far the mapped bytes may exceed the most bytes ever live: a miss unmaps idle mappings,
  // least recently freed first, only as far as needed to stay within (1 + idle_fraction) x that
  // peak. 0: the resident size is the live bytes' peak, and idle mappings of one size cannot
  // serve the peak of another; the slack lets a step whose sizes peak at different times find
  // most sizes idle. 1/16 (against 1/8: tiny-hybrid 0.147 against 0.155 GiB, the same speed):
  // a step then maps afresh about 2-6% of its requests (large: 82 of 4470, tiny-hybrid 49 of
  // 900, AMD EPYC) — a mapping and its page faults each, well under 1% of a step's time.
  double idle_fraction = 0.0625;
  // Mappings of 2 MiB and more start on a 2 MiB boundary and are advised for transparent huge
  // pages (MADV_HUGEPAGE).
  bool huge_pages = false;

  // MEGACPP_HOST_ALLOCATOR: "cache" (the defaults above) or "system" (min_bytes 0; the default
  // when unset in an AddressSanitizer build, which checks heap allocations only). Error
  // {kInvalidArgument} naming the knob for any other value. huge_pages when GLIBC_TUNABLES asks
  // glibc for them (glibc.malloc.hugetlb=1 or 2, as the supervisor tunes a trainer's malloc).
  static HostAllocatorConfig from_knobs();
  void validate() const;
};

struct HostAllocatorStats {
  uint64_t hits = 0;          // requests served by an idle mapping
  uint64_t misses = 0;        // requests that made a mapping
  uint64_t unmapped = 0;      // mappings returned to the system to make room
  uint64_t mapped_bytes = 0;  // bytes mapped now (live + idle)
  uint64_t idle_bytes = 0;    // of which idle
  uint64_t live_bytes = 0;    // the size classes of the requests served now (<= mapped - idle)
  uint64_t peak_mapped_bytes = 0;
  uint64_t peak_live_bytes = 0;  // of live_bytes
};

class HostAllocator;

// Installs the cache with `config` as torch's CPU allocator, or, installed already, changes its
// config (requests already served keep their mappings). nullptr, and nothing changed, when
// config.min_bytes is 0 and nothing is installed. Error{kInternal} when c10 holds an allocator
// of a higher priority.
HostAllocator* install_host_allocator(const HostAllocatorConfig& config);
// The installed cache, or nullptr.
HostAllocator* installed_host_allocator();

class HostAllocator final : public c10::Allocator {
 public:
  HostAllocatorConfig config() const;
  HostAllocatorStats stats() const;
  // Unmaps every idle mapping and restarts the peaks from the bytes mapped and live now.
  void release_idle();

  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // Only install_host_allocator() makes one (and never destroys it).
  explicit HostAllocator(const HostAllocatorConfig& config);
  ~HostAllocator() override;
  HostAllocator(const HostAllocator&) = delete;
  HostAllocator& operator=(const HostAllocator&) = delete;

 private:
  friend HostAllocator* install_host_allocator(const HostAllocatorConfig& config);
  struct State;
  // The deleter of a mapping's DataPtr, and the raw deleter (a mapping, else c10's).
  static void free_mapped(void* data);
  static void free_any(void* data);
  std::unique_ptr<State> state_;
};

}  // namespace megacpp::trainer
