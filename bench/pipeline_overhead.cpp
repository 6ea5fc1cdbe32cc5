// Pipeline per-step overhead: the same model and batches trained by one trainer rank inside
// the full pipeline (`megacpp run --ranks 1`: loader ring, heartbeats, journal, snapshots,
// collector and checkpointer alongside) vs a plain in-process loop with every batch already
// in memory. Both sides run the same TrainStep code, thread count and data; the figure is
// the ratio of steady-state time per step (goal <= 1.03).
//
// --device cuda: both sides on CUDA device 0 — the in-process loop in a child process of its own
// (it loads the trainer's CUDA plugin there, so each side's device memory is freed when its
// process ends: two gpu-small-sized models need not fit at once), its batches on the device
// before the first step; the pipeline as `megacpp run --device cuda`.
//
// In-process time per step: wall clock over steps warmup+1..warmup+steps.
// Pipeline time per step: (wallNs of step warmup+steps - wallNs of step warmup) / steps, read
// from the rank's own journal, so it counts everything the rank does between steps.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>

#include <capnp/message.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/util.h"
#include "data/sampler.h"
#include "ipc/journal.h"
#include "recipes/recipe.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"
#include "stages/trainer/cuda_plugin.h"
#include "stages/trainer/train_step.h"

namespace mc = megacpp;
namespace fs = std::filesystem;

namespace {

double in_process_ms(const mc::recipe::Recipe& r, uint32_t warmup, uint32_t steps,
                     const fs::path& work, at::Device device,
                     mc::trainer::OptimKernels kernels = {}) {
  capnp::MallocMessageBuilder msg;
  auto spec = msg.initRoot<mc::schema::RecipeSpec>();
  mc::recipe::to_spec(r, spec);
  mc::trainer::TrainStep ts(mc::trainer::model_config(spec.asReader()),
                            mc::trainer::train_config(spec.getTrain()), warmup + steps, nullptr,
                            device, {}, std::move(kernels));
  std::vector<std::unique_ptr<mc::data::Shard>> shards;
  std::vector<const mc::data::Shard*> views;
  for (const auto& p :
       mc::data::ensure_builtin_corpus(work / "data", r.data.shards, r.data.shard_tokens)) {
    shards.push_back(std::make_unique<mc::data::Shard>(p, mc::data::ShardFormat::kLlmc));
    views.push_back(shards.back().get());
  }
  const auto batch = mc::recipe::batch_spec(r);
  mc::data::Sampler sampler(views, {.seq_len = r.model.seq_len,
                                    .batch = r.train.batch_size,
                                    .world = 1,
                                    .token_bytes = batch.token_bytes,
                                    .seed = r.train.seed});
  std::vector<at::Tensor> batches;
  std::vector<std::byte> slot(batch.slot_bytes());
  for (uint32_t s = 1; s <= warmup + steps; ++s) {
    sampler.fill(s, 0, slot);
    batches.push_back(mc::trainer::widen_batch(slot, batch, s).to(device));
  }
  for (uint32_t s = 1; s <= warmup; ++s) ts.step(batches[s - 1], s);
  auto t0 = std::chrono::steady_clock::now();
  for (uint32_t s = warmup + 1; s <= warmup + steps; ++s) ts.step(batches[s - 1], s);
  auto dt =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return dt / steps;
}

// in_process_ms on CUDA device 0 in a child process (see the top); its result through a pipe.
double in_process_cuda_ms(const mc::recipe::Recipe& r, uint32_t warmup, uint32_t steps,
                          const fs::path& work) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    double ms = -1;
    try {
      const mc::trainer::CudaPlugin plugin(mc::trainer::CudaPlugin::beside_executable());
      plugin.api().set_device(0);
      // The kernels a CUDA rank of the pipeline runs: the same step on both sides.
      ms = in_process_ms(r, warmup, steps, work, at::Device(at::kCUDA, 0), plugin.optim_kernels(0));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "in-process loop on cuda: %s\n", e.what());
    }
    const bool ok = ::write(fds[1], &ms, sizeof ms) == sizeof ms;
    ::_exit(ok && ms > 0 ? 0 : 1);
  }
  ::close(fds[1]);
  double ms = -1;
  const bool got = ::read(fds[0], &ms, sizeof ms) == sizeof ms;
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!got || !WIFEXITED(status) || WEXITSTATUS(status) != 0 || ms <= 0)
    throw std::runtime_error("the in-process loop on cuda failed (its error is above)");
  return ms;
}

double pipeline_ms(const fs::path& megacpp, const std::string& recipe, uint32_t warmup,
                   uint32_t steps, const fs::path& work, int threads, const std::string& device) {
  auto run_dir = work / fmt::format("run-{}", mc::wall_ns());
  std::vector<std::string> args = {megacpp.string(),
                                   "run",
                                   recipe,
                                   "--ranks",
                                   "1",
                                   "--steps",
                                   std::to_string(warmup + steps),
                                   "--run-dir",
                                   run_dir.string(),
                                   "--data-dir",
                                   (work / "data").string(),
                                   "--progress",
                                   "none",
                                   "--device",
                                   device};
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("MEGACPP_TRAINER_THREADS", std::to_string(threads).c_str(), 1);
    int out = ::open((work / "megacpp-run.out").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (out >= 0) {
      ::dup2(out, STDOUT_FILENO);
      ::dup2(out, STDERR_FILENO);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw std::runtime_error(
        fmt::format("pipeline run failed (status {}); see {}", status, run_dir.string()));
  }
  std::map<uint32_t, int64_t> wall;
  mc::ipc::JournalReader::read_all(
      mc::layout::journal_path(run_dir, mc::schema::StageKind::TRAINER, 0),
      [&](mc::schema::JournalRecord::Reader rec) {
        if (rec.isStep()) wall[rec.getStep().getStep()] = rec.getWallNs();
      });
  if (!wall.count(warmup) || !wall.count(warmup + steps))
    throw std::runtime_error("trainer journal lacks steps");
  return static_cast<double>(wall[warmup + steps] - wall[warmup]) / 1e6 / steps;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Pipeline per-step overhead: one rank in `megacpp run` vs a plain in-process loop"};
  std::string recipe = "tiny";
  uint32_t steps = 80, warmup = 5, repeats = 3;
  int threads = 1;
  fs::path megacpp = fs::read_symlink("/proc/self/exe").parent_path() / "megacpp";
  fs::path work = fs::temp_directory_path() / fmt::format("megacpp-bench-{}", ::getpid());
  app.add_option("--recipe", recipe, "Recipe name or path")->capture_default_str();
  app.add_option("--steps", steps, "Measured steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Unmeasured first steps")->capture_default_str();
  app.add_option("--repeats", repeats,
                 "Alternating repeats of both sides (best of each is reported)")
      ->capture_default_str();
  app.add_option("--threads", threads, "torch intra-op threads on both sides")
      ->capture_default_str();
  app.add_option("--megacpp", megacpp, "The megacpp binary")->capture_default_str();
  std::string device = "cpu";
  app.add_option("--device", device, "cpu, or cuda (device 0, both sides)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (warmup < 1) warmup = 1;

  try {
    torch::set_num_threads(threads);
    auto r = mc::recipe::load(mc::recipe::resolve(recipe, MEGACPP_RECIPE_DIR));
    fs::create_directories(work);
    double best_in = 1e300, best_pipe = 1e300;
    for (uint32_t i = 0; i < repeats; ++i) {
      double a = device == "cuda" ? in_process_cuda_ms(r, warmup, steps, work)
                                  : in_process_ms(r, warmup, steps, work, at::kCPU);
      double b = pipeline_ms(megacpp, recipe, warmup, steps, work, threads, device);
      fmt::print("repeat {}: in-process {:.3f} ms/step, pipeline {:.3f} ms/step\n", i + 1, a, b);
      best_in = std::min(best_in, a);
      best_pipe = std::min(best_pipe, b);
    }
    fs::remove_all(work);
    double tokens = double(r.train.batch_size) * r.model.seq_len;
    fmt::print(
        "\npipeline overhead, recipe {} on {} ({} steps after {} warm-up, {} thread(s), best of "
        "{}):\n",
        r.name, device, steps, warmup, threads, repeats);
    fmt::print("  {:<28} {:>10.3f} ms/step {:>10.0f} tokens/s\n", "in-process loop (peer)", best_in,
               tokens / best_in * 1e3);
    fmt::print("  {:<28} {:>10.3f} ms/step {:>10.0f} tokens/s\n", "megacpp pipeline (1 rank)",
               best_pipe, tokens / best_pipe * 1e3);
    fmt::print("  ratio pipeline/in-process: {:.3f} (goal <= 1.03)\n", best_pipe / best_in);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pipeline_overhead: %s\n", e.what());
    fs::remove_all(work);
    return 1;
  }
  return 0;
}
