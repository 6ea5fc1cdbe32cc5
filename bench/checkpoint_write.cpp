// Checkpoint write throughput, torch-free: the checkpointer's durable path for one rank's share
// against `dd bs=1M conv=fsync` of the same bytes on the same filesystem, in one invocation.
//
// The share is --mb MB in --tensors F32 tensors of uneven sizes (defaults: ~362 MB in 58, the
// size and count of bench_checkpoint's default TrainStep share) in a POSIX shm segment filled
// with pseudo-random bytes, as a rank's staging region is. Each repeat runs, in turn:
//
//   1. megacpp: CheckpointStore::write_rank (safetensors streamed from the segment, XXH3 of
//      every byte, fsync) + commit (checkpoint.json, fsyncs, rename, fsync of the directory,
//      LATEST), through a fresh attach of the segment (as the checkpointer attaches a rank's
//      region);
//   2. `dd if=/dev/zero bs=1M count=<the checkpoint's MiB> conv=fsync` (bench_checkpoint's
//      peer: dd's cheapest source);
//   3. the same dd reading the segment itself: the same bytes from the same pages.
//
// Every output is removed (untimed) before the next, and one untimed round runs first, so
// all three write into space the filesystem has just freed. That matters on thin-provisioned
// virtual disks, where the first write to a block can cost several times a rewrite
// (DESIGN.md "Checkpoint write path"). Timings are printed, never judged; the ratio against
// the faster dd (medians) is what to compare across machines. Goal: >= 80%.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "checkpoint/safetensors.h"
#include "checkpoint/store.h"
#include "core/error.h"
#include "core/util.h"
#include "ipc/shm.h"

namespace mc = megacpp;
namespace ck = megacpp::checkpoint;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  double mb = 361.9;
  uint32_t tensors = 58;
  int repeats = 7;
  std::string dir = fs::temp_directory_path().string();
};

struct Stats {
  double best = 0, median = 0;
};
Stats stats(std::vector<double> s) {
  std::sort(s.begin(), s.end());
  return {s.front(), s[s.size() / 2]};
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Runs argv to completion; throws when it fails.
void run(std::vector<std::string> args) {
  std::fflush(stdout);
  const pid_t pid = ::fork();
  MEGACPP_CHECK(pid >= 0, mc::ErrorKind::kSystem, "fork");
  if (pid == 0) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  MEGACPP_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, mc::ErrorKind::kSystem,
                fmt::format("{} failed (status {:#x})", args[0], status));
}

// Uneven tensor sizes summing to `total` floats: a few embedding-sized ones and many smaller,
// like a model's parameters and their optimizer moments.
std::vector<uint64_t> tensor_elements(uint64_t total, uint32_t count) {
  std::vector<uint64_t> weight(count);
  uint64_t sum = 0;
  for (uint32_t i = 0; i < count; ++i) sum += weight[i] = (i % 6 == 0) ? 16 : 1 + (i % 5);
  std::vector<uint64_t> out(count);
  uint64_t used = 0;
  for (uint32_t i = 0; i < count; ++i) used += out[i] = total * weight[i] / sum;
  out.back() += total - used;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"checkpoint write + commit throughput vs dd conv=fsync of the same bytes"};
  app.add_option("--mb", o.mb, "size of the share in MB (10^6 bytes)")
      ->check(CLI::Range(1.0, 1e6))
      ->capture_default_str();
  app.add_option("--tensors", o.tensors, "tensors in the share")
      ->check(CLI::Range(1u, 100000u))
      ->capture_default_str();
  app.add_option("--repeats", o.repeats, "interleaved repetitions (best and median)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--dir", o.dir, "where checkpoints are written (its filesystem is measured)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const uint64_t floats = static_cast<uint64_t>(o.mb * 1e6) / 4;
    const std::vector<uint64_t> elements = tensor_elements(floats, o.tensors);
    const uint64_t bytes = floats * 4;
    constexpr uint64_t kMiB = 1ull << 20;

    // The staging region: pseudo-random bytes (a model's state does not compress), rounded
    // up to whole MiB so dd can read the checkpoint's byte count from it.
    const std::string shm = fmt::format("/megacpp-bench-ckpt-source-{}", ::getpid());
    mc::ipc::ShmRegion staging(mc::ipc::ShmRegion::Create{}, shm, (bytes + 2 * kMiB) / kMiB * kMiB);
    {
      auto* words = reinterpret_cast<uint64_t*>(staging.data());
      uint64_t x = 0x9e3779b97f4a7c15ull;
      for (size_t i = 0; i < staging.size() / 8; ++i) {
        x += 0x9e3779b97f4a7c15ull;  // splitmix64
        uint64_t z = x;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        words[i] = z ^ (z >> 31);
      }
    }

    const fs::path work = fs::path(o.dir) / fmt::format("megacpp-bench-ckpt-write-{}", ::getpid());
    fs::create_directories(work);
    const fs::path dd_file = work / "dd.bin";
    std::vector<double> total_s, write_s, commit_s, zero_s, same_s;
    uint64_t written = 0;
    {
      ck::CheckpointStore store(work, "bench", "hash");
      auto dd = [&](const std::string& source, std::vector<double>* into) {
        const uint64_t count = (written + kMiB - 1) / kMiB;
        const auto t0 = Clock::now();
        run({"dd", "if=" + source, fmt::format("of={}", dd_file.string()), "bs=1M",
             fmt::format("count={}", count), "conv=fsync", "status=none"});
        if (into) into->push_back(seconds_since(t0));
        fs::remove(dd_file);
      };
      for (int i = 0; i <= o.repeats; ++i) {  // round 0 is the untimed warm-up
        const bool timed = i > 0;
        const auto step = static_cast<uint32_t>(i + 1);
        {
          mc::ipc::ShmRegion source(mc::ipc::ShmRegion::Attach{}, shm);
          std::vector<ck::TensorView> views;
          uint64_t offset = 0;
          for (uint32_t t = 0; t < o.tensors; ++t) {
            views.push_back({fmt::format("t{}", t),
                             "F32",
                             {elements[t]},
                             source.data() + offset,
                             elements[t] * 4});
            offset += elements[t] * 4;
          }
          const auto t0 = Clock::now();
          store.write_rank(step, 1, 0, views);
          const double w = seconds_since(t0);
          const auto t1 = Clock::now();
          const ck::CommittedCheckpoint done = store.commit(step);
          if (timed) {
            commit_s.push_back(seconds_since(t1));
            write_s.push_back(w);
            total_s.push_back(seconds_since(t0));
          }
          written = done.bytes;
          fs::remove_all(done.dir);
        }
        dd("/dev/zero", timed ? &zero_s : nullptr);
        dd("/dev/shm/" + shm.substr(1), timed ? &same_s : nullptr);
      }
    }
    fs::remove_all(work);

    const uint64_t dd_bytes = (written + kMiB - 1) / kMiB * kMiB;
    const Stats total = stats(total_s), write = stats(write_s), commit = stats(commit_s),
                zero = stats(zero_s), same = stats(same_s);
    const double ours = written / total.median;
    const double peer = dd_bytes / std::min(zero.median, same.median);
    fmt::print("cpu: {} ({} online)\n", mc::cpu_model(), ::sysconf(_SC_NPROCESSORS_ONLN));
    fmt::print("write to {} ({}): {} tensors, {:.1f} MB per checkpoint, {} interleaved repeats\n",
               o.dir, mc::filesystem_type(o.dir), o.tensors, written / 1e6, o.repeats);
    fmt::print("\n{:<44} {:>10} {:>10}   {}\n", "", "best s", "median s", "median GB/s");
    fmt::print("{:<44} {:>10.4f} {:>10.4f}   {:.2f}\n", "megacpp write_rank + commit (fsyncs)",
               total.best, total.median, ours / 1e9);
    fmt::print("{:<44} {:>10.4f} {:>10.4f}\n", "  of which write_rank (write, XXH3, fsync)",
               write.best, write.median);
    fmt::print("{:<44} {:>10.4f} {:>10.4f}\n", "  of which commit (manifest, rename, LATEST)",
               commit.best, commit.median);
    fmt::print("{:<44} {:>10.4f} {:>10.4f}   {:.2f}\n", "dd if=/dev/zero bs=1M conv=fsync",
               zero.best, zero.median, dd_bytes / zero.median / 1e9);
    fmt::print("{:<44} {:>10.4f} {:>10.4f}   {:.2f}\n", "dd if=<the segment> bs=1M conv=fsync",
               same.best, same.median, dd_bytes / same.median / 1e9);
    fmt::print("megacpp {:.0f}% of the faster dd (medians) (goal >= 80%)\n", 100.0 * ours / peer);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_checkpoint_write: {}\n", e.what());
    return 1;
  }
  return 0;
}
