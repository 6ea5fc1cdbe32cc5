// bench_blocks: forward + backward of each hybrid block family — A (attention + MLP), E (mixture
// of experts), M (Mamba-2), R (the gated linear recurrence) — as the trainer builds it
// (stages/trainer/model.h BlockImpl), against the same block written in Python PyTorch
// (bench/peers/blocks_peer.py), same shapes, same initialisation, same thread count, in one
// invocation. The peer's parameter count must equal ours (a check that the twin is the same
// block). Prints medians, tokens/s, the ratio per family (goal >= 1.0) and where our time goes
// (forward vs backward). Nothing is asserted: timings are reported, never tested.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/peer_json.h"
#include "stages/trainer/model.h"

namespace {

namespace fs = std::filesystem;
namespace mt = megacpp::trainer;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

const fs::path kSourceRoot = fs::path(MEGACPP_RECIPE_DIR).parent_path();

struct Config {
  int64_t batch = 4, seq = 256, d_model = 256, heads = 8, kv_heads = 2, ffn = 1024;
  int64_t experts = 8, top_k = 2, expert_hidden = 256, shared_hidden = 256;
  int64_t ssm_state = 32, ssm_head_dim = 64, ssm_expand = 2, conv_kernel = 4, chunk = 64;
  int64_t rnn_width = 256;
  int repeats = 5;
  int threads = 1;
  int deadline_s = 600;
  std::string blocks = "AEMR";
  std::string peer_python;
};

using megacpp::bench::median;

mt::ModelConfig model_config(const Config& c) {
  mt::ModelConfig m;
  m.vocab_size = 256;
  m.seq_len = static_cast<uint32_t>(c.seq);
  m.d_model = static_cast<uint32_t>(c.d_model);
  m.n_layers = 1;
  m.n_heads = static_cast<uint32_t>(c.heads);
  m.n_kv_heads = static_cast<uint32_t>(c.kv_heads);
  m.ffn_hidden = static_cast<uint32_t>(c.ffn);
  m.moe = {.enabled = true,
           .n_experts = static_cast<uint32_t>(c.experts),
           .top_k = static_cast<uint32_t>(c.top_k),
           .expert_hidden = static_cast<uint32_t>(c.expert_hidden),
           .shared_hidden = static_cast<uint32_t>(c.shared_hidden),
           .aux_loss_coef = 0.01};
  m.ssm = {.d_state = static_cast<uint32_t>(c.ssm_state),
           .head_dim = static_cast<uint32_t>(c.ssm_head_dim),
           .expand = static_cast<uint32_t>(c.ssm_expand),
           .conv_kernel = static_cast<uint32_t>(c.conv_kernel),
           .chunk = static_cast<uint32_t>(c.chunk)};
  m.rnn = {.width = static_cast<uint32_t>(c.rnn_width),
           .conv_kernel = static_cast<uint32_t>(c.conv_kernel)};
  return m;
}

struct Timing {
  int64_t params = 0;
  std::vector<double> forward, backward, total;
};

// Forward + backward of y.sum() (plus the MoE's unweighted auxiliary loss, as the peer does),
// repeats + 1 times, the first a warm-up. Gradients accumulate across repeats, as in the peer.
Timing time_block(const Config& c, char kind) {
  const mt::ModelConfig m = model_config(c);
  mt::Block block(m, kind);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  block->initialise(gen);
  const at::Tensor x = at::randn({c.batch, c.seq, c.d_model}, gen).requires_grad_();
  const int64_t half = m.head_dim() / 2;
  const at::Tensor angles =
      at::outer(at::arange(c.seq, at::kDouble),
                at::pow(m.rope_theta, -at::arange(half, at::kDouble) / static_cast<double>(half)));
  const at::Tensor cos = angles.cos().to(at::kFloat), sin = angles.sin().to(at::kFloat);
  Timing t;
  for (const auto& p : block->parameters()) t.params += p.numel();
  for (int i = 0; i <= c.repeats; ++i) {
    const auto t0 = Clock::now();
    at::Tensor loss = block->forward(x, cos, sin).sum();
    if (block->moe) loss = loss + block->moe->aux_loss();
    const auto t1 = Clock::now();
    loss.backward();
    const auto t2 = Clock::now();
    if (i == 0) continue;
    t.forward.push_back(std::chrono::duration<double>(t1 - t0).count());
    t.backward.push_back(std::chrono::duration<double>(t2 - t1).count());
    t.total.push_back(std::chrono::duration<double>(t2 - t0).count());
  }
  return t;
}

json run_peer(const Config& c, char kind) {
  auto s = [](int64_t v) { return std::to_string(v); };
  return megacpp::bench::run_peer_json(c.peer_python,
                                       (kSourceRoot / "bench/peers/blocks_peer.py").string(),
                                       {"--block",         std::string(1, kind),
                                        "--batch",         s(c.batch),
                                        "--seq",           s(c.seq),
                                        "--d-model",       s(c.d_model),
                                        "--heads",         s(c.heads),
                                        "--kv-heads",      s(c.kv_heads),
                                        "--ffn",           s(c.ffn),
                                        "--experts",       s(c.experts),
                                        "--top-k",         s(c.top_k),
                                        "--expert-hidden", s(c.expert_hidden),
                                        "--shared-hidden", s(c.shared_hidden),
                                        "--ssm-state",     s(c.ssm_state),
                                        "--ssm-head-dim",  s(c.ssm_head_dim),
                                        "--ssm-expand",    s(c.ssm_expand),
                                        "--conv-kernel",   s(c.conv_kernel),
                                        "--chunk",         s(c.chunk),
                                        "--rnn-width",     s(c.rnn_width),
                                        "--repeats",       s(c.repeats),
                                        "--threads",       s(c.threads)},
                                       c.threads, c.deadline_s);
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  c.peer_python = megacpp::bench::default_peer_python(kSourceRoot);
  CLI::App app("bench_blocks: each hybrid block family, megacpp vs its Python PyTorch twin");
  app.add_option("--blocks", c.blocks, "families to time, from AEMR")->capture_default_str();
  app.add_option("--batch", c.batch)->capture_default_str();
  app.add_option("--seq", c.seq)->capture_default_str();
  app.add_option("--d-model", c.d_model)->capture_default_str();
  app.add_option("--heads", c.heads)->capture_default_str();
  app.add_option("--kv-heads", c.kv_heads)->capture_default_str();
  app.add_option("--ffn", c.ffn)->capture_default_str();
  app.add_option("--experts", c.experts)->capture_default_str();
  app.add_option("--top-k", c.top_k)->capture_default_str();
  app.add_option("--expert-hidden", c.expert_hidden)->capture_default_str();
  app.add_option("--shared-hidden", c.shared_hidden)->capture_default_str();
  app.add_option("--ssm-state", c.ssm_state)->capture_default_str();
  app.add_option("--ssm-head-dim", c.ssm_head_dim)->capture_default_str();
  app.add_option("--ssm-expand", c.ssm_expand)->capture_default_str();
  app.add_option("--conv-kernel", c.conv_kernel)->capture_default_str();
  app.add_option("--chunk", c.chunk)->capture_default_str();
  app.add_option("--rnn-width", c.rnn_width)->capture_default_str();
  app.add_option("--repeats", c.repeats)->capture_default_str();
  app.add_option("--threads", c.threads)->capture_default_str();
  app.add_option("--peer-python", c.peer_python)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  for (char k : c.blocks) {
    if (std::string_view("AEMR").find(k) == std::string_view::npos) {
      fmt::print(stderr, "bench_blocks: --blocks takes letters from AEMR, got '{}'\n", k);
      return 2;
    }
  }
  torch::set_num_threads(c.threads);
  fmt::print(
      "Hybrid blocks, forward + backward, float32: batch {} x seq {}, d_model {}; {} thread(s); "
      "median of {}\n  A: {} heads / {} kv, ffn {}   E: {} experts top {} (hidden {}, shared {})"
      "   M: state {}, head dim {}, expand {}, chunk {}   R: width {}\n",
      c.batch, c.seq, c.d_model, c.threads, c.repeats, c.heads, c.kv_heads, c.ffn, c.experts,
      c.top_k, c.expert_hidden, c.shared_hidden, c.ssm_state, c.ssm_head_dim, c.ssm_expand, c.chunk,
      c.rnn_width);
  fmt::print("  {:<6} {:>10} {:>10} {:>10} {:>12} {:>12} {:>8}   {}\n", "block", "params",
             "megacpp s", "python s", "megacpp tok/s", "python tok/s", "ratio", "megacpp fwd/bwd");
  const double tokens = static_cast<double>(c.batch * c.seq);
  for (char k : c.blocks) {
    const Timing t = time_block(c, k);
    const double ours = median(t.total);
    std::string peer_cell, ratio_cell = "-", note;
    double theirs = 0;
    try {
      const json peer = run_peer(c, k);
      theirs = median(peer["seconds"].get<std::vector<double>>());
      peer_cell = fmt::format("{:.4f}", theirs);
      ratio_cell = fmt::format("{:.2f}x", theirs / ours);
      if (peer["params"].get<int64_t>() != t.params)
        note = fmt::format("  (peer has {} parameters: NOT the same block)",
                           peer["params"].get<int64_t>());
    } catch (const std::exception& e) {
      peer_cell = "failed";
      note = fmt::format("  (peer: {})", e.what());
    }
    fmt::print("  {:<6} {:>10} {:>10.4f} {:>10} {:>12.0f} {:>12.0f} {:>8}   {:.0f}% / {:.0f}%{}\n",
               std::string(1, k) + " " + std::string(megacpp::recipe::block_name(k)).substr(0, 3),
               t.params, ours, peer_cell, tokens / ours, theirs > 0 ? tokens / theirs : 0.0,
               ratio_cell, 100 * median(t.forward) / ours, 100 * median(t.backward) / ours, note);
  }
  fmt::print("  ratio = python seconds / megacpp seconds (goal >= 1.0 for every family)\n");
  return 0;
}
