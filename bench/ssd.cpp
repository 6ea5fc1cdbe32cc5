// bench_ssd: the chunked SSD scan (stages/trainer/ssd.h, the M block's recurrence) against the
// sequential recurrence and against its Python twin (bench/peers/ssd_peer.py: the same algorithm
// in PyTorch), forward + backward, same shapes, same thread count, in one invocation. Prints
// medians and the ratios. Nothing is asserted: timings are reported, never tested.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/peer_json.h"
#include "stages/trainer/ssd.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

const fs::path kSourceRoot = fs::path(MEGACPP_RECIPE_DIR).parent_path();

struct Config {
  int64_t batch = 4, length = 512, heads = 8, head_dim = 64, state_dim = 64, chunk = 64;
  int repeats = 5;
  int threads = 1;
  int deadline_s = 600;
  std::string peer_python;
};

using megacpp::bench::median;

template <typename F>
std::vector<double> timed(int repeats, F&& fn) {
  std::vector<double> out;
  for (int i = 0; i <= repeats; ++i) {  // the first is a warm-up
    const auto t0 = Clock::now();
    const megacpp::trainer::SsdResult r = fn();
    (r.y.sum() + r.final_state.sum()).backward();
    if (i > 0) out.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return out;
}

// Runs the peer with the same shapes; its JSON line. Bounded by the deadline.
json run_peer(const Config& c) {
  return megacpp::bench::run_peer_json(
      c.peer_python, (kSourceRoot / "bench/peers/ssd_peer.py").string(),
      {"--batch", std::to_string(c.batch), "--length", std::to_string(c.length), "--heads",
       std::to_string(c.heads), "--head-dim", std::to_string(c.head_dim), "--state-dim",
       std::to_string(c.state_dim), "--chunk", std::to_string(c.chunk), "--repeats",
       std::to_string(c.repeats), "--threads", std::to_string(c.threads)},
      c.threads, c.deadline_s);
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  c.peer_python = megacpp::bench::default_peer_python(kSourceRoot);
  CLI::App app("bench_ssd: the chunked SSD scan vs the sequential recurrence vs its Python twin");
  app.add_option("--batch", c.batch)->capture_default_str();
  app.add_option("--length", c.length, "sequence length (a multiple of --chunk)")
      ->capture_default_str();
  app.add_option("--heads", c.heads)->capture_default_str();
  app.add_option("--head-dim", c.head_dim)->capture_default_str();
  app.add_option("--state-dim", c.state_dim)->capture_default_str();
  app.add_option("--chunk", c.chunk)->capture_default_str();
  app.add_option("--repeats", c.repeats)->capture_default_str();
  app.add_option("--threads", c.threads)->capture_default_str();
  app.add_option("--peer-python", c.peer_python)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (c.length % c.chunk != 0) {
    fmt::print(stderr, "bench_ssd: --length must be a multiple of --chunk\n");
    return 2;
  }
  torch::set_num_threads(c.threads);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor x = at::randn({c.batch, c.length, c.heads, c.head_dim}, gen).requires_grad_();
  const at::Tensor a =
      (-at::softplus(at::randn({c.batch, c.length, c.heads}, gen)) * 0.5).requires_grad_();
  const at::Tensor b = at::randn({c.batch, c.length, c.heads, c.state_dim}, gen).requires_grad_();
  const at::Tensor cc = at::randn({c.batch, c.length, c.heads, c.state_dim}, gen).requires_grad_();

  const double chunked =
      median(timed(c.repeats, [&] { return megacpp::trainer::ssd_chunked(x, a, b, cc, c.chunk); }));
  const double sequential =
      median(timed(c.repeats, [&] { return megacpp::trainer::ssd_sequential(x, a, b, cc); }));
  json peer;
  std::string peer_error;
  try {
    peer = run_peer(c);
  } catch (const std::exception& e) {
    peer_error = e.what();
  }
  fmt::print(
      "SSD scan, forward + backward: batch {} x length {} x heads {} (head dim {}, state {}), "
      "chunk {}; {} thread(s); median of {}\n",
      c.batch, c.length, c.heads, c.head_dim, c.state_dim, c.chunk, c.threads, c.repeats);
  fmt::print("  {:<28} {:>10} {:>14}\n", "", "seconds", "tokens/s");
  const double tokens = static_cast<double>(c.batch * c.length);
  auto row = [&](const std::string& name, double s) {
    fmt::print("  {:<28} {:>10.4f} {:>14.0f}\n", name, s, s > 0 ? tokens / s : 0.0);
  };
  row("megacpp chunked", chunked);
  row("megacpp sequential", sequential);
  if (peer_error.empty()) {
    const double py_chunked = median(peer["chunked"].get<std::vector<double>>());
    const double py_sequential = median(peer["sequential"].get<std::vector<double>>());
    row("python chunked (torch " + peer["torch"].get<std::string>() + ")", py_chunked);
    row("python sequential", py_sequential);
    fmt::print("  chunked vs sequential (megacpp): {:.1f}x faster\n", sequential / chunked);
    fmt::print("  megacpp chunked vs its Python twin: {:.2f}x (goal >= 1.0)\n",
               py_chunked / chunked);
  } else {
    fmt::print("  chunked vs sequential (megacpp): {:.1f}x faster\n", sequential / chunked);
    fmt::print("  peer failed: {}\n", peer_error);
  }
  return 0;
}
