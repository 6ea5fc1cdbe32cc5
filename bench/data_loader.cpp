// Data loader benchmark: the loader's fill path against a plain memcpy of the same bytes and
// against torch.utils.data.DataLoader (bench/peers/dataloader_peer.py) on the same llm.c
// shards, in one invocation, for two batch shapes: the default recipe's (recipes/tiny.toml)
// and a large one (B 64, T 1024).
//
// Per shape, in this order:
//   1. memcpy bound: N copies of one slot's token bytes from the mapped shards (sequential
//      offsets) into the rings' slot memory, one thread, no ring protocol;
//   2. sampler fill alone: the same N slots filled by data::Sampler::fill into the same slot
//      memory, one thread, no ring protocol (what the loader's own CPU time buys);
//   3. loader -> rings: the data loader's loop (stages/data_loader/main.cpp: round-robin over
//      the ranks' rings, try_acquire, fill, publish, its IdleNap when no ring has room, its
//      timer slack of 1 us; --legacy-wait: the fixed 200 us nap it had before) into
//      real ipc::SlotRings in real ipc::ShmRegions, one per rank, drained by one forked
//      consumer process per rank that attaches the region by name as a trainer does, peeks
//      (the trainer's wait: SlotRing::peek), widens the slot to int64 (widen_batch's loop,
//      into a reused buffer) and releases, as fast as it can. Consumers are processes, not
//      threads: a trainer is another process, so the ring is crossed between address spaces
//      and the consumers' CPU time competes with the loader's exactly as in a run.
//      Handoff latency: the producer stamps CLOCK_MONOTONIC into BatchHeader::reserved right
//      before publish; the consumer reads the clock when its peek returns. "handoff" counts
//      only the batches the consumer was already waiting for (its first try_peek found the
//      ring empty): publish -> consumer holds the batch. "age" counts every batch, so it
//      includes the time a batch sat in a full ring;
//   4. back-pressure: the same with the last rank's consumer sleeping --throttle-us after each
//      release (a slow rank): the loader waits on that ring, keeps the others full, and every
//      consumer checks it got every step in order (tags and headers), i.e. nothing is lost.
// Then the peer, once for all shapes: a Dataset over np.memmap of the same shards, random
// windows of T + 1 tokens, DataLoader(batch_size=B, num_workers=0/1/2) -> int64 [B, T + 1].
//
// Tokens/s counts B x T tokens per batch (what a step trains) on every side. The shards are
// written to a temporary directory and read once completely before any timing, so they are
// in the page cache (mincore's figure is printed). Timings are printed, never judged.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/sampler.h"
#include "data/shards.h"
#include "ipc/shm.h"
#include "ipc/slot_ring.h"
#include "recipes/batch_spec.h"
#include "recipes/recipe.h"
#include "stages/data_loader/idle_nap.h"

namespace mc = megacpp;
namespace md = megacpp::data;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const fs::path kSourceRoot = fs::path(MEGACPP_RECIPE_DIR).parent_path();

struct Options {
  uint32_t shards = 2;
  uint32_t shard_tokens = 32u << 20;
  uint32_t ranks = 2;
  uint32_t depth = 8;
  double seconds = 2.0;           // loader -> rings, per shape
  double alone_seconds = 0.5;     // sampler fill alone (sets N for the memcpy bound)
  double throttle_seconds = 1.0;  // back-pressure run, per shape
  uint32_t throttle_us = 1000;
  double peer_seconds = 3.0;  // per shape and num_workers
  uint32_t peer_batches = 20000;
  std::vector<int> workers = {0, 1, 2};
  bool peer = true;
  std::string peer_python;
  std::string peer_script = (kSourceRoot / "bench/peers/dataloader_peer.py").string();
  std::string recipe = "tiny";
  uint64_t seed = 1234;
  bool legacy_wait = false;
};

int64_t mono() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

double pct(std::vector<double>& v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
}

std::string rate(double tokens_per_s) {
  if (tokens_per_s >= 1e9) return fmt::format("{:.2f} G", tokens_per_s / 1e9);
  if (tokens_per_s >= 1e6) return fmt::format("{:.1f} M", tokens_per_s / 1e6);
  return fmt::format("{:.1f} k", tokens_per_s / 1e3);
}

struct Scratch {
  Scratch() {
    std::string tmpl = (fs::temp_directory_path() / "megacpp-bench-loader-XXXXXX").string();
    MEGACPP_CHECK(::mkdtemp(tmpl.data()) != nullptr, mc::ErrorKind::kSystem, "mkdtemp");
    path = tmpl;
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

// ---- shards ------------------------------------------------------------------------------

std::vector<fs::path> write_shards(const fs::path& dir, const Options& o) {
  std::vector<fs::path> paths;
  std::vector<uint32_t> tokens(o.shard_tokens);
  uint64_t s = o.seed;
  for (uint32_t i = 0; i < o.shards; ++i) {
    for (auto& t : tokens) {  // splitmix64 below the GPT-2 vocabulary
      uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      t = static_cast<uint32_t>((z ^ (z >> 31)) % 50257);
    }
    paths.push_back(dir / fmt::format("shard_{:06d}.bin", i));
    md::write_llmc_shard(paths.back(), tokens, md::TokenWidth::kU16);
  }
  return paths;
}

// Reads every byte of `path` (so it is in the page cache) and returns the fraction of its pages
// resident afterwards (mincore).
double warm_page_cache(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MEGACPP_CHECK(fd >= 0, mc::ErrorKind::kSystem, fmt::format("open {}", path.string()));
  std::vector<char> buf(1 << 20);
  while (::read(fd, buf.data(), buf.size()) > 0) {
  }
  struct stat st {};
  ::fstat(fd, &st);
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  MEGACPP_CHECK(map != MAP_FAILED, mc::ErrorKind::kSystem, "mmap");
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((bytes + page - 1) / page);
  ::mincore(map, bytes, vec.data());
  ::munmap(map, bytes);
  size_t resident = 0;
  for (unsigned char v : vec) resident += v & 1;
  return vec.empty() ? 1.0 : static_cast<double>(resident) / static_cast<double>(vec.size());
}

// ---- rings and consumers -----------------------------------------------------------------

constexpr size_t kMaxSamples = size_t{1} << 22;  // per rank and run

// One consumer's results, in a MAP_SHARED page the parent reads after the child exits.
struct RankStats {
  uint64_t batches = 0;
  uint64_t errors = 0;  // a tag, step or header that is not the next one expected
  uint64_t checksum = 0;
  uint64_t samples = 0;
  int64_t busy_ns = 0;  // widen + release
  // publish -> peek returned, ns; negative when the consumer was already waiting for it.
  int32_t lat_ns[kMaxSamples];
};

struct Rings {
  std::vector<std::unique_ptr<mc::ipc::ShmRegion>> regions;
  std::vector<std::unique_ptr<mc::ipc::SlotRing>> rings;
  std::vector<std::string> names;
};

Rings make_rings(uint32_t ranks, uint32_t depth, uint64_t slot_bytes, const std::string& tag) {
  Rings r;
  for (uint32_t i = 0; i < ranks; ++i) {
    r.names.push_back(fmt::format("/megacpp-bench-loader-{}-{}-r{}", ::getpid(), tag, i));
    r.regions.push_back(
        std::make_unique<mc::ipc::ShmRegion>(mc::ipc::ShmRegion::Create{}, r.names.back(),
                                             mc::ipc::SlotRing::region_bytes(depth, slot_bytes)));
    mc::ipc::SlotRing::format(*r.regions.back(), depth, slot_bytes);
    r.rings.push_back(std::make_unique<mc::ipc::SlotRing>(*r.regions.back()));
  }
  return r;
}

// The trainer's side of one ring, in a forked process: attach by name, peek, check the header,
// widen to int64 (widen_batch's loop), release; optionally nap after the release (a slow
// rank's compute). Ends on tag 0.
[[noreturn]] void consume(const std::string& name, const mc::recipe::BatchSpec& spec,
                          uint32_t nap_us, RankStats* st) {
  try {
    ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // as a trainer rank does (its wait_batch)
    mc::ipc::ShmRegion region(mc::ipc::ShmRegion::Attach{}, name);
    mc::ipc::SlotRing ring(region);
    std::vector<int64_t> wide(spec.slot_tokens());
    uint64_t expect = 1;
    for (;;) {
      bool waited = false;
      auto slot = ring.try_peek();
      if (!slot) {
        waited = true;
        while (!(slot = ring.peek(mc::ipc::Millis(100)))) {
        }
      }
      const int64_t now = mono();
      if (slot->tag == 0) {
        ring.release();
        break;
      }
      mc::recipe::BatchHeader h;
      std::memcpy(&h, slot->data.data(), sizeof h);
      if (slot->tag != expect || h.step != expect || h.magic != mc::recipe::kBatchMagic ||
          slot->data.size() != spec.slot_bytes())
        ++st->errors;
      ++expect;
      if (st->samples < kMaxSamples) {
        const int64_t lat = std::min<int64_t>(now - static_cast<int64_t>(h.reserved), INT32_MAX);
        st->lat_ns[st->samples++] = static_cast<int32_t>(waited ? -std::max<int64_t>(lat, 1) : lat);
      }
      const std::byte* src = slot->data.data() + sizeof h;
      const uint64_t n = spec.slot_tokens();
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t t;
        std::memcpy(&t, src + i * 2, 2);
        wide[i] = t;
      }
      st->checksum += static_cast<uint64_t>(wide[n / 2]);
      ring.release();
      st->busy_ns += mono() - now;
      if (nap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(nap_us));
    }
    st->batches = expect - 1;
    ::_exit(0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_data_loader consumer: %s\n", e.what());
    ::_exit(1);
  }
}

struct LoopResult {
  uint64_t batches = 0;
  double seconds = 0;
  double fill_s = 0;  // inside Sampler::fill
  double nap_s = 0;   // no ring had room
  uint64_t naps = 0;
};

// stages/data_loader/main.cpp's produce loop (without its control-plane calls), until `seconds`
// have passed, with the publish time stamped into the header; then every ring gets an end marker
// (tag 0).
LoopResult loader_loop(const md::Sampler& sampler, Rings& r, double seconds, bool legacy_wait) {
  LoopResult out;
  const uint32_t world = static_cast<uint32_t>(r.rings.size());
  const int64_t t0 = mono();
  const int64_t deadline = t0 + static_cast<int64_t>(seconds * 1e9);
  int64_t fill_ns = 0, nap_ns = 0;
  uint64_t logged_epoch = 0;
  megacpp::data_loader::IdleNap idle;
  for (;;) {
    if (mono() >= deadline) break;
    bool produced = false;
    for (uint32_t rank = 0; rank < world; ++rank) {
      const auto step = static_cast<uint32_t>(r.rings[rank]->produced()) + 1;
      auto slot = r.rings[rank]->try_acquire();
      if (!slot) continue;
      const int64_t a = mono();
      const auto bytes = sampler.fill(step, rank, *slot);
      const int64_t b = mono();
      fill_ns += b - a;
      const uint64_t stamp = static_cast<uint64_t>(mono());
      std::memcpy(slot->data() + offsetof(mc::recipe::BatchHeader, reserved), &stamp, sizeof stamp);
      r.rings[rank]->publish(static_cast<uint32_t>(bytes), step);
      const uint64_t epoch = sampler.state_at(sampler.position(step, rank)).epoch;
      if (epoch > logged_epoch) logged_epoch = epoch;
      produced = true;
      ++out.batches;
    }
    if (produced) {
      idle.reset();
    } else {
      const int64_t a = mono();
      if (legacy_wait)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      else
        idle.wait();
      nap_ns += mono() - a;
      ++out.naps;
    }
  }
  out.seconds = static_cast<double>(mono() - t0) / 1e9;
  for (auto& ring : r.rings) {
    while (!ring->acquire(mc::ipc::Millis(100))) {
    }
    ring->publish(0, 0);
  }
  out.fill_s = static_cast<double>(fill_ns) / 1e9;
  out.nap_s = static_cast<double>(nap_ns) / 1e9;
  return out;
}

struct PipelineResult {
  LoopResult loop;
  std::vector<uint64_t> batches, errors;
  std::vector<double> consumer_busy_s;
  std::vector<double> handoff_us, age_us;  // all ranks
};

PipelineResult run_pipeline(const md::Sampler& sampler, uint32_t ranks, uint32_t depth,
                            double seconds, uint32_t slow_rank_nap_us, bool legacy_wait,
                            const std::string& tag) {
  const auto& spec = sampler.spec();
  Rings r = make_rings(ranks, depth, spec.slot_bytes(), tag);
  const size_t stats_bytes = sizeof(RankStats) * ranks;
  void* mem =
      ::mmap(nullptr, stats_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  MEGACPP_CHECK(mem != MAP_FAILED, mc::ErrorKind::kSystem, "mmap stats");
  auto* stats = static_cast<RankStats*>(mem);
  std::vector<pid_t> pids;
  std::fflush(stdout);
  for (uint32_t i = 0; i < ranks; ++i) {
    const uint32_t nap = i + 1 == ranks ? slow_rank_nap_us : 0;
    const pid_t pid = ::fork();
    MEGACPP_CHECK(pid >= 0, mc::ErrorKind::kSystem, "fork");
    if (pid == 0) consume(r.names[i], spec, nap, &stats[i]);
    pids.push_back(pid);
  }
  PipelineResult out;
  // The loader lowers its timer slack (stages/data_loader/main.cpp), and so do the consumers,
  // as trainer ranks do.
  if (!legacy_wait) ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  out.loop = loader_loop(sampler, r, seconds, legacy_wait);
  ::prctl(PR_SET_TIMERSLACK, 0UL, 0, 0, 0);  // back to the default
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    MEGACPP_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, mc::ErrorKind::kInternal,
                  "a consumer process failed");
  }
  for (uint32_t i = 0; i < ranks; ++i) {
    const RankStats& st = stats[i];
    out.batches.push_back(st.batches);
    out.errors.push_back(st.errors + (st.batches == r.rings[i]->produced() - 1 ? 0 : 1));
    out.consumer_busy_s.push_back(static_cast<double>(st.busy_ns) / 1e9);
    for (uint64_t k = 0; k < st.samples; ++k) {
      const int32_t v = st.lat_ns[k];
      const double us = std::abs(static_cast<double>(v)) / 1e3;
      out.age_us.push_back(us);
      if (v < 0) out.handoff_us.push_back(us);
    }
  }
  ::munmap(mem, stats_bytes);
  return out;
}

// ---- fill alone and the memcpy bound ------------------------------------------------------

struct Bound {
  uint64_t batches = 0;
  double fill_s = 0;
  double memcpy_s = 0;
};

Bound fill_and_memcpy(const md::Sampler& sampler, const std::vector<const md::Shard*>& shards,
                      uint32_t ranks, uint32_t depth, double seconds) {
  const auto& spec = sampler.spec();
  Rings r = make_rings(ranks, depth, spec.slot_bytes(), "bound");
  std::vector<std::span<std::byte>> slots;  // every slot of every ring, as try_acquire gives
  for (uint32_t i = 0; i < ranks; ++i)
    for (uint32_t k = 0; k < depth; ++k) {
      slots.push_back(*r.rings[i]->try_acquire());
      r.rings[i]->publish(0, 1);
    }
  Bound b;
  // Fill: time-bounded; its count is the memcpy's count.
  const int64_t t0 = mono();
  const int64_t deadline = t0 + static_cast<int64_t>(seconds * 1e9);
  uint64_t n = 0;
  do {
    for (uint32_t k = 0; k < 64; ++k, ++n) {
      const uint32_t rank = static_cast<uint32_t>(n % ranks);
      const uint32_t step = static_cast<uint32_t>(n / ranks) + 1;
      sampler.fill(step, rank, slots[rank * depth + (step - 1) % depth]);
    }
  } while (mono() < deadline);
  b.fill_s = static_cast<double>(mono() - t0) / 1e9;
  b.batches = n;
  // memcpy: the same count of slot-sized token copies, sequential offsets through the shards.
  const uint64_t bytes = spec.slot_tokens() * spec.token_bytes;
  std::vector<uint64_t> offset(shards.size(), 0);
  const int64_t t1 = mono();
  for (uint64_t i = 0; i < n; ++i) {
    const size_t s = i % shards.size();
    const uint64_t avail = shards[s]->tokens() * 2;
    if (offset[s] + bytes > avail) offset[s] = 0;
    const uint32_t rank = static_cast<uint32_t>(i % ranks);
    std::byte* dst =
        slots[rank * depth + (i / ranks) % depth].data() + sizeof(mc::recipe::BatchHeader);
    std::memcpy(dst, shards[s]->token_bytes() + offset[s], bytes);
    offset[s] += bytes;
  }
  b.memcpy_s = static_cast<double>(mono() - t1) / 1e9;
  return b;
}

// ---- the peer ------------------------------------------------------------------------------

json run_peer(const Options& o, const std::vector<fs::path>& shards,
              const std::vector<mc::recipe::BatchSpec>& shapes) {
  json spec = {{"shards", json::array()},   {"shapes", json::array()},   {"workers", o.workers},
               {"batches", o.peer_batches}, {"seconds", o.peer_seconds}, {"seed", o.seed}};
  for (const auto& p : shards) spec["shards"].push_back(p.string());
  for (const auto& s : shapes) spec["shapes"].push_back({s.batch, s.seq_len});
  int fds[2];
  MEGACPP_CHECK(::pipe2(fds, O_CLOEXEC) == 0, mc::ErrorKind::kSystem, "pipe");
  std::fflush(stdout);
  const pid_t pid = ::fork();
  MEGACPP_CHECK(pid >= 0, mc::ErrorKind::kSystem, "fork");
  if (pid == 0) {
    if (::dup2(fds[1], STDOUT_FILENO) < 0) ::_exit(126);
    ::setenv("OMP_NUM_THREADS", "1", 1);
    std::vector<std::string> args = {o.peer_python, o.peer_script, "--spec", spec.dump()};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "bench_data_loader: exec %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n > 0) {
      text.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error(fmt::format("the peer failed (status {:#x})", status));
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  const auto nl = text.rfind('\n');
  const std::string last = nl == std::string::npos ? text : text.substr(nl + 1);
  if (last.empty() || last.front() != '{') throw std::runtime_error("the peer printed no JSON");
  return json::parse(last);
}

// ---- report --------------------------------------------------------------------------------

struct ShapeResult {
  std::string label;
  mc::recipe::BatchSpec spec;
  Bound bound;
  PipelineResult pipe, slow;
};

void print_shape(const Options& o, ShapeResult& s, const json* peer) {
  const double tok = static_cast<double>(s.spec.batch) * s.spec.seq_len;
  const double memcpy_rate = tok * static_cast<double>(s.bound.batches) / s.bound.memcpy_s;
  const double alone_rate = tok * static_cast<double>(s.bound.batches) / s.bound.fill_s;
  const auto& L = s.pipe.loop;
  const double ring_rate = tok * static_cast<double>(L.batches) / L.seconds;
  const double fill_busy_rate = tok * static_cast<double>(L.batches) / L.fill_s;
  fmt::print("\n{}: B={} T={}, slot {} bytes, {} ranks x ring depth {}\n", s.label, s.spec.batch,
             s.spec.seq_len, s.spec.slot_bytes(), o.ranks, o.depth);
  fmt::print("  {:<44} {:>10} {:>10}  {}\n", "", "tokens/s", "batches", "");
  fmt::print(
      "  {:<44} {:>10} {:>10}  {:.2f} GB/s of token bytes\n", "memcpy bound (1 thread)",
      rate(memcpy_rate), s.bound.batches,
      static_cast<double>(s.bound.batches * s.spec.slot_tokens() * 2) / s.bound.memcpy_s / 1e9);
  fmt::print("  {:<44} {:>10} {:>10}  {:.1f}% of memcpy\n", "sampler fill alone (1 thread)",
             rate(alone_rate), s.bound.batches, 100.0 * alone_rate / memcpy_rate);
  fmt::print(
      "  {:<44} {:>10} {:>10}  {:.1f}% of memcpy; loader in fill {:.0f}%, napping {:.0f}% ({} "
      "naps)\n",
      fmt::format("megacpp loader -> rings, {} consumer procs", o.ranks), rate(ring_rate),
      L.batches, 100.0 * ring_rate / memcpy_rate, 100.0 * L.fill_s / L.seconds,
      100.0 * L.nap_s / L.seconds, L.naps);
  fmt::print("  {:<44} {:>10} {:>10}  (tokens / time inside Sampler::fill in that run)\n",
             "  its fill rate while consumers run", rate(fill_busy_rate), "");
  uint64_t errors = 0;
  for (auto e : s.pipe.errors) errors += e;
  std::string per_rank;
  for (size_t i = 0; i < s.pipe.batches.size(); ++i)
    per_rank += fmt::format("{}{} ({:.0f}% busy)", i ? ", " : "", s.pipe.batches[i],
                            100.0 * s.pipe.consumer_busy_s[i] / L.seconds);
  fmt::print("  consumers: batches per rank {}; errors {}\n", per_rank, errors);
  auto& h = s.pipe.handoff_us;
  auto& a = s.pipe.age_us;
  std::sort(h.begin(), h.end());
  std::sort(a.begin(), a.end());
  fmt::print(
      "  handoff publish -> peek returned (consumer was waiting, {} of {} batches): p50 {:.1f} "
      "us, p99 {:.1f} us, max {:.1f} us\n",
      h.size(), a.size(), pct(h, 50), pct(h, 99), h.empty() ? NAN : h.back());
  fmt::print(
      "  age at pickup, every batch (includes time queued in a full ring): p50 {:.1f} us, "
      "p99 {:.1f} us\n",
      pct(a, 50), pct(a, 99));
  // Back-pressure.
  const auto& S = s.slow.loop;
  uint64_t slow_errors = 0;
  for (auto e : s.slow.errors) slow_errors += e;
  std::string slow_rank;
  for (size_t i = 0; i < s.slow.batches.size(); ++i)
    slow_rank += fmt::format("{}rank {} {:.0f}/s", i ? ", " : "", i,
                             static_cast<double>(s.slow.batches[i]) / S.seconds);
  fmt::print(
      "  back-pressure (rank {} naps {} us per batch, {:.1f} s): {}; loader napping {:.0f}% of "
      "the time, in fill {:.0f}%; every batch received in order: {} ({} errors)\n",
      o.ranks - 1, o.throttle_us, S.seconds, slow_rank, 100.0 * S.nap_s / S.seconds,
      100.0 * S.fill_s / S.seconds, slow_errors == 0 ? "yes" : "NO", slow_errors);
  // Peer.
  std::vector<std::pair<int, double>> peer_rates;
  if (peer != nullptr) {
    for (const auto& r : (*peer)["results"]) {
      if (r["batch"] != s.spec.batch || r["seq_len"] != s.spec.seq_len) continue;
      auto lat = r["lat_us"].get<std::vector<double>>();
      const double pr = tok * r["batches"].get<double>() / r["seconds"].get<double>();
      peer_rates.push_back({r["workers"].get<int>(), pr});
      fmt::print(
          "  {:<44} {:>10} {:>10}  per batch p50 {:.0f} us, p99 {:.0f} us; first batch "
          "{:.0f} ms\n",
          fmt::format("torch DataLoader num_workers={}", r["workers"].get<int>()), rate(pr),
          r["batches"].get<uint64_t>(), pct(lat, 50), pct(lat, 99), r["first_ms"].get<double>());
    }
  }
  std::string ratios;
  for (auto [w, pr] : peer_rates)
    ratios += fmt::format("{}megacpp / DataLoader(w={}) = {:.0f}x", ratios.empty() ? "" : ", ", w,
                          ring_rate / pr);
  fmt::print("  ratios: {}{}megacpp / memcpy = {:.2f} (fill alone / memcpy = {:.2f})\n", ratios,
             ratios.empty() ? "" : ", ", ring_rate / memcpy_rate, alone_rate / memcpy_rate);
  fmt::print(
      "  goals: >= 1 G tokens/s into the rings: {}; >= 15% of memcpy: {}; handoff p99 <= "
      "100 us: {}\n",
      ring_rate >= 1e9 ? "met" : "not met", ring_rate >= 0.15 * memcpy_rate ? "met" : "not met",
      pct(h, 99) <= 100.0 ? "met" : "not met");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const fs::path venv_python = kSourceRoot / ".venv/bin/python";
  o.peer_python = fs::exists(venv_python) ? venv_python.string() : "python3";
  CLI::App app{"the data loader's fill path vs memcpy and torch's DataLoader, same shards"};
  app.add_option("--shards", o.shards, "llm.c uint16 shards to write")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  app.add_option("--shard-tokens", o.shard_tokens, "tokens per shard")
      ->check(CLI::Range(1u << 20, 1u << 30))
      ->capture_default_str();
  app.add_option("--ranks", o.ranks, "rings and consumer processes")
      ->check(CLI::Range(1u, 16u))
      ->capture_default_str();
  app.add_option("--depth", o.depth, "ring slots")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  app.add_option("--seconds", o.seconds, "loader -> rings, per shape")->capture_default_str();
  app.add_option("--alone-seconds", o.alone_seconds, "fill alone (sets the memcpy count)")
      ->capture_default_str();
  app.add_option("--throttle-seconds", o.throttle_seconds, "back-pressure run, per shape")
      ->capture_default_str();
  app.add_option("--throttle-us", o.throttle_us, "the slow rank's nap per batch")
      ->capture_default_str();
  app.add_option("--peer-seconds", o.peer_seconds, "DataLoader, per shape and num_workers")
      ->capture_default_str();
  app.add_option("--peer-batches", o.peer_batches, "DataLoader, at most, per config")
      ->capture_default_str();
  app.add_option("--workers", o.workers, "DataLoader num_workers values")
      ->delimiter(',')
      ->capture_default_str();
  app.add_flag("!--no-peer", o.peer, "skip the torch DataLoader peer");
  app.add_flag("--legacy-wait", o.legacy_wait,
               "the loader's wait before IdleNap: a fixed 200 us nap, default timer slack");
  app.add_option("--peer-python", o.peer_python, "python with torch and numpy")
      ->capture_default_str();
  app.add_option("--peer-script", o.peer_script, "the peer")->capture_default_str();
  app.add_option("--recipe", o.recipe, "the recipe whose batch shape is the first shape")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    ::signal(SIGPIPE, SIG_IGN);
    const auto t_start = mono();
    const mc::recipe::Recipe recipe =
        mc::recipe::load(mc::recipe::resolve(o.recipe, MEGACPP_RECIPE_DIR));
    std::vector<ShapeResult> shapes(2);
    shapes[0].label = fmt::format("recipe {}", recipe.name);
    shapes[0].spec = {.batch = recipe.train.batch_size, .seq_len = recipe.model.seq_len};
    shapes[1].label = "large";
    shapes[1].spec = {.batch = 64, .seq_len = 1024};

    Scratch dir;
    const auto t0 = mono();
    const auto paths = write_shards(dir.path, o);
    const double write_s = static_cast<double>(mono() - t0) / 1e9;
    double resident = 1.0;
    for (const auto& p : paths) resident = std::min(resident, warm_page_cache(p));
    std::vector<std::unique_ptr<md::Shard>> owned;
    std::vector<const md::Shard*> views;
    for (const auto& p : paths) {
      owned.push_back(std::make_unique<md::Shard>(p, md::ShardFormat::kLlmc));
      views.push_back(owned.back().get());
    }
    fmt::print(
        "bench_data_loader: {} llm.c uint16 shards x {} M tokens ({:.0f} MB) in {} (written in "
        "{:.1f} s), read once before timing: {:.1f}% of their pages in the page cache\n"
        "{} ranks, ring depth {}, consumers are forked processes; tokens/s counts B x T per "
        "batch on every side\n",
        o.shards, o.shard_tokens >> 20,
        static_cast<double>(o.shards) * (md::kLlmcHeaderBytes + o.shard_tokens * 2.0) / 1e6,
        dir.path.string(), write_s, 100.0 * resident, o.ranks, o.depth);

    for (auto& s : shapes) {
      md::Sampler sampler(views, {.seq_len = s.spec.seq_len,
                                  .batch = s.spec.batch,
                                  .world = o.ranks,
                                  .token_bytes = 2,
                                  .seed = o.seed});
      s.bound = fill_and_memcpy(sampler, views, o.ranks, o.depth, o.alone_seconds);
      s.pipe = run_pipeline(sampler, o.ranks, o.depth, o.seconds, 0, o.legacy_wait, "pipe");
      s.slow = run_pipeline(sampler, o.ranks, o.depth, o.throttle_seconds, o.throttle_us,
                            o.legacy_wait, "slow");
    }
    json peer;
    bool have_peer = false;
    if (o.peer) {
      std::vector<mc::recipe::BatchSpec> specs;
      for (const auto& s : shapes) specs.push_back(s.spec);
      try {
        peer = run_peer(o, paths, specs);
        have_peer = true;
        fmt::print(
            "peer: torch {}, numpy {}; Dataset over np.memmap of the same shards, random "
            "windows, default collate, pin_memory=False\n",
            peer["torch"].get<std::string>(), peer["numpy"].get<std::string>());
      } catch (const std::exception& e) {
        fmt::print("peer skipped: {}\n", e.what());
      }
    }
    for (auto& s : shapes) print_shape(o, s, have_peer ? &peer : nullptr);
    fmt::print("\ntotal {:.1f} s\n", static_cast<double>(mono() - t_start) / 1e9);
    return 0;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "bench_data_loader: %s\n", e.what());
    return 1;
  }
}
