// Checkpoint benchmark: what a checkpoint costs the training loop and how fast it reaches the
// disk, against the physical limits and what a PyTorch user would use, in one invocation.
//
// The state is a TrainStep's snapshot share (parameters + DistAdamW/DistMuon state) of a model
// sized by --d-model/--layers/--vocab (defaults: ~360 MB), after one real step so the moments
// are not zero. World 1: one rank's share is the whole state.
//
//   1. memcpy bound: the share's bytes memcpy'd from a private buffer into a shm region (best
//      of --repeats): bytes / memcpy bandwidth, the floor for any in-memory snapshot;
//   2. the copy: TrainStep::copy_snapshot into the (already mapped) staging region plus the
//      step stamp, inline, as a multiple of (1). Goal: <= 1.2. The stall: what a snapshot
//      blocks the loop for once the lease is free, as the trainer takes it (SnapshotPlane) —
//      TrainStep::start_snapshot_copy after a step, then the next step's wait for that copy at
//      StepHooks::before_update and the stamp — with the cost that does not block: the median
//      time that step takes beyond a step without a snapshot (steps alternate);
//      The same stall staged in an exported buffer (the memfd stand-in of device staging,
//      TrainStep::start_staged_copy), as a multiple of the shm region's;
//   3. write: the checkpointer's path for the same share — CheckpointStore::write_rank
//      (safetensors streamed from staging with write(2), fsync) and commit (checkpoint.json,
//      rename, fsyncs, LATEST) — in bytes/s, against `dd if=/dev/zero bs=1M conv=fsync` of the
//      same byte count on the same filesystem, the two alternating (medians). Goal: >= 80%;
//   4. the peer (bench/peers/checkpoint_peer.py, .venv's python): the same tensors saved with
//      torch.save and with torch.distributed.checkpoint.async_save; the loop is blocked for
//      torch.save's whole write and for async_save's staging copy. Goal: the stall of (2) >= 5x
//      lower than async_save's blocking time (best against best).
// Timings are printed, never judged; ratios are what to compare across machines.
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
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "checkpoint/store.h"
#include "core/error.h"
#include "core/util.h"
#include "ipc/shm.h"
#include "ipc/staging_stamp.h"
#include "stages/trainer/train_step.h"

namespace mc = megacpp;
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

const fs::path kSourceRoot = fs::path(MEGACPP_RECIPE_DIR).parent_path();

struct Options {
  uint32_t d_model = 640, layers = 6, vocab = 8192, seq = 128;
  int repeats = 5;
  std::string dir = fs::temp_directory_path().string();
  std::string peer_python, peer_script = (kSourceRoot / "bench/peers/checkpoint_peer.py").string();
  bool peer = true;
};

struct Stats {
  double best = 0, median = 0;
};
template <typename F>
Stats time_it(int repeats, F&& fn) {
  std::vector<double> s;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    fn(i);
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  return {s.front(), s[s.size() / 2]};
}

// Runs argv, returning its stdout; throws when it fails.
std::string run_capture(std::vector<std::string> args) {
  int fds[2];
  MEGACPP_CHECK(::pipe(fds) == 0, mc::ErrorKind::kSystem, "pipe");
  std::fflush(stdout);
  const pid_t pid = ::fork();
  MEGACPP_CHECK(pid >= 0, mc::ErrorKind::kSystem, "fork");
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::close(fds[0]);
    ::setenv("OMP_NUM_THREADS", "1", 1);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string out;
  char buf[65536];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  MEGACPP_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, mc::ErrorKind::kSystem,
                fmt::format("{} failed (status {:#x})", args[0], status));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const fs::path venv_python = kSourceRoot / ".venv/bin/python";
  o.peer_python = fs::exists(venv_python) ? venv_python.string() : "python3";
  CLI::App app{
      "checkpoint stall and write throughput vs memcpy, dd conv=fsync, torch.save and DCP"};
  app.add_option("--d-model", o.d_model, "model width")->capture_default_str();
  app.add_option("--layers", o.layers, "blocks")->capture_default_str();
  app.add_option("--vocab", o.vocab, "vocabulary")->capture_default_str();
  app.add_option("--repeats", o.repeats, "timed repetitions (best and median)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--dir", o.dir, "where checkpoints are written (its filesystem is measured)")
      ->capture_default_str();
  app.add_option("--peer-python", o.peer_python, "python with torch")->capture_default_str();
  app.add_flag("!--no-peer", o.peer, "skip torch.save / DCP");
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    const mc::trainer::ModelConfig model{.vocab_size = o.vocab,
                                         .seq_len = o.seq,
                                         .d_model = o.d_model,
                                         .n_layers = o.layers,
                                         .n_heads = std::max(1u, o.d_model / 64),
                                         .mlp_mult = 4};
    mc::trainer::TrainConfig train;
    train.batch_size = 1;
    mc::trainer::TrainStep ts(model, train, 1000);
    const at::Tensor batch = torch::randint(o.vocab, {1, o.seq + 1}, torch::kInt64);
    ts.step(batch, 1);
    const auto layout = ts.snapshot_layout();
    const uint64_t bytes = layout.total_bytes;
    fmt::print(
        "state: d_model {} x {} layers, vocab {}: {} tensors, {:.1f} MB (params + optimizer)\n",
        o.d_model, o.layers, o.vocab, layout.entries.size(), bytes / 1e6);

    const std::string shm = fmt::format("/megacpp-bench-ckpt-{}", ::getpid());
    mc::ipc::ShmRegion staging(mc::ipc::ShmRegion::Create{}, shm,
                               bytes + mc::ipc::kStagingStampBytes);
    std::memset(staging.data(), 0, staging.size());  // mapped once, as a rank's region stays
    std::vector<std::byte> src(bytes, std::byte{0x5a});
    const Stats copy =
        time_it(o.repeats, [&](int) { std::memcpy(staging.data(), src.data(), bytes); });
    src.clear();
    src.shrink_to_fit();
    std::byte* stamp = staging.data() + bytes;
    const Stats inline_copy = time_it(o.repeats, [&](int i) {
      mc::ipc::clear_staging_stamp(stamp);
      ts.copy_snapshot({staging.data(), bytes});
      mc::ipc::set_staging_stamp(stamp, static_cast<uint32_t>(i + 1));
    });
    auto since = [](Clock::time_point t0) {
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    std::vector<double> plain_s, with_s, blocked_s;
    uint32_t step_index = 2;
    for (int i = 0; i <= o.repeats; ++i) {  // round 0 is the warm-up
      auto t0 = Clock::now();
      ts.step(batch, step_index++);
      const double plain = since(t0);
      double blocked = 0;
      t0 = Clock::now();
      mc::ipc::clear_staging_stamp(stamp);
      mc::trainer::SnapshotLayout started;
      mc::trainer::SnapshotCopy copy = ts.start_snapshot_copy({staging.data(), bytes}, &started);
      blocked += since(t0);
      mc::trainer::StepHooks hooks;
      hooks.before_update = [&] {
        const auto w0 = Clock::now();
        copy.wait();
        mc::ipc::set_staging_stamp(stamp, step_index);
        blocked += since(w0);
      };
      ts.step(batch, step_index++, hooks);
      const double with = since(t0);
      if (i == 0) continue;
      plain_s.push_back(plain);
      with_s.push_back(with);
      blocked_s.push_back(blocked);
    }

    // The same stall with the share staged in an exported buffer (the memfd stand-in of device
    // staging: the copy is issued, its SnapshotReady would go out at once, and the update waits
    // for the copy's end): the protocol's cost on a CPU beside the shm region's.
    std::vector<double> staged_s;
    {
      auto target = mc::trainer::make_memfd_staging(0, bytes);
      for (int i = 0; i <= o.repeats; ++i) {
        ts.step(batch, step_index++);
        double blocked = 0;
        auto t0 = Clock::now();
        mc::trainer::SnapshotLayout started;
        mc::trainer::SnapshotCopy copy = ts.start_staged_copy(*target, step_index, &started);
        blocked += since(t0);
        mc::trainer::StepHooks hooks;
        hooks.before_update = [&] {
          const auto w0 = Clock::now();
          copy.wait();
          blocked += since(w0);
        };
        ts.step(batch, step_index++, hooks);
        if (i > 0) staged_s.push_back(blocked);
      }
    }

    const fs::path work = fs::path(o.dir) / fmt::format("megacpp-bench-ckpt-{}", ::getpid());
    fs::create_directories(work);
    std::vector<mc::checkpoint::TensorView> views;
    for (const auto& e : layout.entries)
      views.push_back({e.name, e.dtype, e.shape, staging.data() + e.offset, e.bytes});
    // Checkpoint and dd alternate, each output removed before the next and after one untimed
    // round, so both write into space the filesystem has just freed: on a thin-provisioned
    // virtual disk a first write to a block can cost ~3x a rewrite, and keeping every
    // checkpoint while dd rewrote its own freed file once measured that, not the write path
    // (DESIGN.md "Checkpoint write path").
    uint64_t written = 0;
    const uint64_t block = 1ull << 20;
    const fs::path dd_file = work / "dd.bin";
    std::vector<double> write_s, dd_s;
    {
      mc::checkpoint::CheckpointStore store(work, "bench", "hash");
      for (int i = 0; i <= o.repeats; ++i) {  // round 0 is the warm-up
        const auto step = static_cast<uint32_t>(i + 1);
        auto t0 = Clock::now();
        store.write_rank(step, 1, 0, views, ts.snapshot_metadata());
        const auto done = store.commit(step);
        if (i > 0) write_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        written = done.bytes;
        fs::remove_all(done.dir);
        t0 = Clock::now();
        run_capture({"dd", "if=/dev/zero", fmt::format("of={}", dd_file.string()), "bs=1M",
                     fmt::format("count={}", (written + block - 1) / block), "conv=fsync",
                     "status=none"});
        if (i > 0) dd_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        fs::remove(dd_file);
      }
    }
    auto stats_of = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return Stats{v.front(), v[v.size() / 2]};
    };
    const Stats write = stats_of(write_s), dd = stats_of(dd_s);
    const Stats stall = stats_of(blocked_s), plain = stats_of(plain_s), with = stats_of(with_s);
    const Stats staged = stats_of(staged_s);
    const uint64_t count = (written + block - 1) / block;
    fs::remove_all(work);

    json peer;
    if (o.peer) {
      json spec = {{"tensors", json::array()}, {"dir", o.dir}, {"repeats", o.repeats}};
      for (const auto& e : layout.entries) spec["tensors"].push_back({e.name, e.dtype, e.shape});
      const std::string text = run_capture({o.peer_python, o.peer_script, "--spec", spec.dump()});
      peer = json::parse(text.substr(text.rfind('{', text.rfind("\"bytes\""))));
    }

    const double memcpy_bw = bytes / copy.best;
    fmt::print("\n{:<44} {:>10} {:>10}   {}\n", "", "best s", "median s", "ratio");
    fmt::print("{:<44} {:>10.4f} {:>10.4f}   {:.2f} GB/s\n",
               "memcpy of the share (bytes / bandwidth)", copy.best, copy.median, memcpy_bw / 1e9);
    fmt::print("{:<44} {:>10.4f} {:>10.4f}   {:.2f} x memcpy (goal <= 1.2)\n",
               "megacpp copy into staging + stamp, inline", inline_copy.best, inline_copy.median,
               inline_copy.best / copy.best);
    fmt::print("{:<44} {:>10.4f} {:>10.4f}   {:.2f} x memcpy\n",
               "megacpp stall: start + wait before update", stall.best, stall.median,
               stall.best / copy.best);
    fmt::print("{:<44} {:>10.4f} {:>10.4f}   {:.2f} x the shm region's stall\n",
               "megacpp stall, staged in an exported memfd", staged.best, staged.median,
               staged.best / stall.best);
    fmt::print("{:<44} {:>10.4f} {:>10.4f}\n", "a training step without a snapshot", plain.best,
               plain.median);
    fmt::print(
        "{:<44} {:>10.4f} {:>10.4f}   +{:.4f} s (medians): the copy's cost beside the "
        "step\n",
        "a training step with one (copy overlapped)", with.best, with.median,
        with.median - plain.median);
    if (o.peer) {
      const double dcp_block = peer["dcp_async_blocking_s"]["best"];
      const double save = peer["torch_save_s"]["best"];
      fmt::print("{:<44} {:>10.4f} {:>10.4f}   megacpp stall {:.1f}x lower (goal >= 5)\n",
                 "PyTorch DCP async_save: blocking", dcp_block,
                 peer["dcp_async_blocking_s"]["median"].get<double>(), dcp_block / stall.best);
      fmt::print("{:<44} {:>10.4f} {:>10.4f}\n", "PyTorch DCP async_save: until durable",
                 peer["dcp_async_total_s"]["best"].get<double>(),
                 peer["dcp_async_total_s"]["median"].get<double>());
      fmt::print("{:<44} {:>10.4f} {:>10.4f}   megacpp stall {:.1f}x lower\n",
                 "PyTorch torch.save (blocks for the write)", save,
                 peer["torch_save_s"]["median"].get<double>(), save / stall.best);
    }
    const double write_bw = written / write.median, dd_bw = (count * block) / dd.median;
    fmt::print("\nwrite to {} ({}): {:.1f} MB per checkpoint\n", o.dir, mc::filesystem_type(o.dir),
               written / 1e6);
    fmt::print("{:<44} {:>10.4f} {:>10.4f}   {:.2f} GB/s\n", "megacpp write_rank + commit (fsyncs)",
               write.best, write.median, write_bw / 1e9);
    fmt::print("{:<44} {:>10.4f} {:>10.4f}   {:.2f} GB/s\n", "dd bs=1M conv=fsync, same bytes",
               dd.best, dd.median, dd_bw / 1e9);
    fmt::print("{:<44} {:>10} {:>10}   {:.0f}% of dd, medians (goal >= 80%)\n", "", "", "",
               100.0 * write_bw / dd_bw);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_checkpoint: {}\n", e.what());
    return 1;
  }
  return 0;
}
