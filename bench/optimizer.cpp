// Distributed optimizer benchmark (issue 4), four sections in one invocation:
//   1. step time: DistAdamW::step() + DistMuon::step() in W forked ranks joined by Gloo vs the
//      PyTorch peer (bench/peers/optim_peer.py: DDP-style bucketed all-reduce, then
//      torch.optim.AdamW and torch.optim.Muon) on the same parameter shapes, threads and world;
//   2. bytes moved per step per rank (ring cost model) for the optimizers' actual placement, as
//      issued on Gloo and with a native reduce-scatter, vs all-reducing every gradient; plus a
//      probe of what ProcessGroupGloo does with a reduce-scatter;
//   3. the DistAdamW crossover: one parameter forced sharded vs forced replicated, per size;
//   4. the optimizer's share of a TrainStep on the recipe, as TrainStep reports its timings.
//
// Ranks are forked from this process and joined by Gloo over a TCPStore it hosts; rank 0's
// results come back through the store, the peer's on its stdout. Every wait is bounded: a rank
// that fails gets its group killed, and so does one still running at the deadline. Timings
// are printed, never judged.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <capnp/message.h>
#include <fmt/format.h>
#include <torch/version.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "recipes/recipe.h"
#include "schemas/launch.capnp.h"
#include "stages/trainer/optim.h"
#include "stages/trainer/rendezvous.h"
#include "stages/trainer/train_step.h"
#include "tools/forked_world/forked_world.h"

namespace {

namespace mc = megacpp;
namespace tr = megacpp::trainer;
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using Pg = c10::intrusive_ptr<c10d::Backend>;
using Shape = std::vector<int64_t>;

const fs::path kSourceRoot = fs::path(MEGACPP_RECIPE_DIR).parent_path();

struct Config {
  uint32_t world = 2;
  uint32_t steps = 30;
  uint32_t warmup = 3;
  uint32_t large_steps = 8;
  std::vector<std::string> sections = {"all"};
  std::string recipe = "recipes/tiny.toml";
  std::string peer_python;
  std::string peer_script = (kSourceRoot / "bench/peers/optim_peer.py").string();
  int deadline_s = 300;  // per group of forked processes
};

bool wants(const Config& c, const std::string& section) {
  for (const auto& s : c.sections)
    if (s == "all" || s == section) return true;
  return false;
}

// ---- statistics ------------------------------------------------------------------------

struct Stats {
  double median = 0;
  double p90 = 0;
};

Stats stats(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  const double median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  const size_t i90 = static_cast<size_t>(std::ceil(0.9 * static_cast<double>(n))) - 1;
  return {median, v[std::min(i90, n - 1)]};
}

double median(const json& a) {
  return stats(a.get<std::vector<double>>()).median;
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::string mib(double bytes) {
  if (bytes < 1024.0) return fmt::format("{:.0f} B", bytes);
  if (bytes < 1024.0 * 1024.0) return fmt::format("{:.1f} KiB", bytes / 1024.0);
  return fmt::format("{:.2f} MiB", bytes / (1024.0 * 1024.0));
}

// ---- parameter shapes and optimizers ---------------------------------------------------

// A model's parameters as the optimizers split them: the embedding and the head go to
// DistAdamW (one group each), the fused qkv of every layer to a DistMuon group with
// qkv_split_sizes {D, D, D}, every other block matrix to a second DistMuon group.
struct ShapeSet {
  std::string name;
  std::string label;
  std::vector<Shape> adamw;
  std::vector<Shape> qkv;
  Shape qkv_split;
  std::vector<Shape> matrices;
  uint32_t steps = 0;

  std::vector<Shape> muon() const {
    std::vector<Shape> all = qkv;
    all.insert(all.end(), matrices.begin(), matrices.end());
    return all;
  }
  int64_t numel() const {
    int64_t n = 0;
    for (const auto& group : {adamw, qkv, matrices})
      for (const auto& s : group) n += s[0] * s[1];
    return n;
  }
};

ShapeSet model_shapes(std::string name, int64_t vocab, int64_t d, int64_t layers, int64_t mlp_mult,
                      uint32_t steps) {
  ShapeSet s;
  s.label = fmt::format("{} (V{} D{} L{})", name, vocab, d, layers);
  s.name = std::move(name);
  s.steps = steps;
  s.adamw = {{vocab, d}, {vocab, d}};
  s.qkv_split = {d, d, d};
  for (int64_t l = 0; l < layers; ++l) {
    s.qkv.push_back({3 * d, d});
    s.matrices.push_back({d, d});
    s.matrices.push_back({mlp_mult * d, d});
    s.matrices.push_back({d, mlp_mult * d});
  }
  return s;
}

at::Tensor randn(at::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
}

// Hyperparameters are the recipe defaults of the [optim] table; they do not change the cost.
struct Optimizers {
  std::vector<at::Tensor> adamw, qkv, matrices;
  std::unique_ptr<tr::DistAdamW> adam;
  std::unique_ptr<tr::DistMuon> muon;

  std::vector<at::Tensor> all() const {
    std::vector<at::Tensor> a = adamw;
    a.insert(a.end(), qkv.begin(), qkv.end());
    a.insert(a.end(), matrices.begin(), matrices.end());
    return a;
  }
};

std::unique_ptr<Optimizers> build_optimizers(const ShapeSet& s, const Pg& pg) {
  auto o = std::make_unique<Optimizers>();
  uint64_t seed = 7;
  auto make = [&](const std::vector<Shape>& shapes, std::vector<at::Tensor>& out) {
    for (const auto& shape : shapes) out.push_back((randn(shape, seed++) * 0.02).requires_grad_());
  };
  make(s.adamw, o->adamw);
  make(s.qkv, o->qkv);
  make(s.matrices, o->matrices);
  o->adam = std::make_unique<tr::DistAdamW>(
      std::vector<tr::AdamWParamGroup>{
          {.params = {o->adamw[0]}, .lr = 0.2, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-10},
          {.params = {o->adamw[1]}, .lr = 0.004, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-10}},
      pg);
  o->muon = std::make_unique<tr::DistMuon>(
      std::vector<tr::MuonParamGroup>{{.params = o->qkv, .qkv_split_sizes = s.qkv_split},
                                      {.params = o->matrices}},
      pg);
  return o;
}

// ---- forked ranks and the peer ----------------------------------------------------------

using RankBody = std::function<json(const Pg&, uint32_t rank)>;

// Bounds for a group of processes that stands or falls together: once one failed, the others
// are SIGKILLed, and so is everyone left at the deadline. `poll_once`, when set, runs between
// checks (it must not block for long). The first failure is described, naming `what`, in
// `failure`.
mc::forked_world::ReapOptions all_or_nothing(Clock::time_point deadline, const std::string& what,
                                             std::string& failure,
                                             const std::function<void()>& poll_once = {}) {
  return {.deadline = deadline,
          .grace_after_failure = Clock::duration::zero(),
          .poll_once = poll_once,
          .on_first_failure = [&failure, what](size_t r, int st) {
            failure = fmt::format("{} rank {} {} {}", what, r,
                                  WIFEXITED(st) ? "exited" : "was killed by signal",
                                  WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
          }};
}

// Throws std::runtime_error naming `what` unless all exited 0.
void check_all_exited_0(const mc::forked_world::ReapResult& reaped, const std::string& what,
                        std::string failure) {
  if (failure.empty() && reaped.any_killed())
    failure = fmt::format("{} still running at the deadline", what);
  if (!failure.empty()) throw std::runtime_error(failure);
}

// Waits for `pids` until all exited, or one failed, or the deadline passed (all_or_nothing).
// Throws std::runtime_error naming `what` unless all exited 0.
void supervise(std::vector<pid_t> pids, Clock::time_point deadline, const std::string& what,
               const std::function<void()>& poll_once = {}) {
  std::string failure;
  const auto reaped =
      mc::forked_world::reap(pids, all_or_nothing(deadline, what, failure, poll_once));
  check_all_exited_0(reaped, what, failure);
}

// Runs the world's ranks joined by Gloo (keys under "bench/<tag>/" of the store it hosts); each
// runs body(pg, rank) with one intra-op thread. Returns rank 0's value.
json run_ranks(const Config& c, const mc::forked_world::ForkedWorld& world, const std::string& tag,
               const RankBody& body) {
  const std::string result_key = fmt::format("bench/{}/result", tag);
  const uint16_t port = world.store_port();
  const auto rank_body = [&](uint32_t r) {
    int rc = 0;
    try {
      torch::set_num_threads(1);
      tr::GlooOptions go;
      go.store_port = port;
      go.rank = r;
      go.world = c.world;
      go.store_timeout = std::chrono::seconds(60);
      go.collective_timeout = std::chrono::seconds(120);
      go.store_prefix = fmt::format("bench/{}/gloo/", tag);
      const Pg pg = tr::connect_gloo(go);
      const json result = body(pg, r);
      pg->barrier()->wait();
      if (r == 0) {
        c10d::TCPStoreOptions so;
        so.port = port;
        so.isServer = false;
        so.timeout = std::chrono::seconds(60);
        auto client = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
        const std::string text = result.dump();
        client->set(result_key, std::vector<uint8_t>(text.begin(), text.end()));
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_optimizer: %s, rank %u: %s\n", tag.c_str(), r, e.what());
      rc = 3;
    }
    return rc;
  };
  std::string failure;
  const auto reaped = world.run(
      rank_body, all_or_nothing(Clock::now() + std::chrono::seconds(c.deadline_s), tag, failure));
  check_all_exited_0(reaped, tag, failure);
  const auto bytes = world.store().get(result_key);
  return json::parse(std::string(bytes.begin(), bytes.end()));
}

// Runs the peer: c.world processes of `python optim_peer.py` joined by Gloo over the store
// this process hosts on `port`. Returns the JSON line rank 0 prints.
json run_peer(const Config& c, uint16_t port, const json& spec) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  std::vector<pid_t> pids;
  for (uint32_t r = 0; r < c.world; ++r) {
    std::fflush(stdout);
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(fmt::format("fork: {}", std::strerror(errno)));
    if (pid == 0) {
      const int out = r == 0 ? fds[1] : ::open("/dev/null", O_WRONLY);
      if (out < 0 || ::dup2(out, STDOUT_FILENO) < 0) ::_exit(126);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      std::vector<std::string> args = {c.peer_python,  c.peer_script,
                                       "--rank",       std::to_string(r),
                                       "--world",      std::to_string(c.world),
                                       "--store-port", std::to_string(port),
                                       "--prefix",     "bench/peer/",
                                       "--threads",    "1",
                                       "--spec",       spec.dump()};
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "bench_optimizer: exec %s: %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  ::close(fds[1]);
  std::string text;
  bool open = true;
  auto drain = [&] {
    if (!open) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    }
    pollfd p{.fd = fds[0], .events = POLLIN, .revents = 0};
    if (::poll(&p, 1, 20) <= 0) return;
    char buf[65536];
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n > 0) text.append(buf, static_cast<size_t>(n));
    if (n == 0) open = false;
  };
  try {
    supervise(pids, Clock::now() + std::chrono::seconds(c.deadline_s), "peer", drain);
    while (open) drain();
  } catch (...) {
    ::close(fds[0]);
    throw;
  }
  ::close(fds[0]);
  // The result is the last line the peer's rank 0 printed.
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  const auto nl = text.rfind('\n');
  const std::string last = nl == std::string::npos ? text : text.substr(nl + 1);
  if (last.empty() || last.front() != '{') throw std::runtime_error("the peer printed no JSON");
  return json::parse(last);
}

// ---- 1. step time ---------------------------------------------------------------------

json step_rank(const Config& c, const std::vector<ShapeSet>& sets, const Pg& pg, uint32_t rank) {
  json out = json::object();
  for (const ShapeSet& s : sets) {
    auto o = build_optimizers(s, pg);
    const std::vector<at::Tensor> params = o->all();
    std::vector<std::vector<at::Tensor>> pool(2);
    for (size_t k = 0; k < 2; ++k)
      for (size_t i = 0; i < params.size(); ++i)
        pool[k].push_back(randn(params[i].sizes(), 1'000'000 * (rank + 1) + 1000 * k + i));
    std::vector<double> total, adam, muon;
    for (uint32_t i = 0; i < c.warmup + s.steps; ++i) {
      for (size_t j = 0; j < params.size(); ++j) params[j].mutable_grad() = pool[i % 2][j];
      pg->barrier()->wait();
      const auto t0 = Clock::now();
      o->adam->step();
      const double a = ms_since(t0);
      const auto t1 = Clock::now();
      o->muon->step();
      const double m = ms_since(t1);
      if (i < c.warmup) continue;
      total.push_back(a + m);
      adam.push_back(a);
      muon.push_back(m);
    }
    out[s.name] = {{"total", total}, {"adamw", adam}, {"muon", muon}};
  }
  return out;
}

void section_step(const Config& c, const mc::forked_world::ForkedWorld& world,
                  const std::vector<ShapeSet>& sets) {
  fmt::print("\n== 1. Optimizer step time, world {} over Gloo, 1 torch thread per rank ==\n",
             c.world);
  const json ours = run_ranks(
      c, world, "step", [&](const Pg& pg, uint32_t rank) { return step_rank(c, sets, pg, rank); });
  json spec = {{"sets", json::array()}};
  for (const ShapeSet& s : sets) {
    spec["sets"].push_back({{"name", s.name},
                            {"adamw", s.adamw},
                            {"muon", s.muon()},
                            {"steps", s.steps},
                            {"warmup", c.warmup}});
  }
  json peer;
  std::string peer_error;
  try {
    peer = run_peer(c, world.store_port(), spec);
  } catch (const std::exception& e) {
    peer_error = e.what();
  }
  fmt::print("{:<26} {:>7} {:>6}  {:>21}  {:>21}  {:>13}\n", "shape set", "params", "steps",
             "megacpp ms p50 / p90", "torch ms p50 / p90", "torch/megacpp");
  for (const ShapeSet& s : sets) {
    const Stats m = stats(ours[s.name]["total"].get<std::vector<double>>());
    std::string p = "-", ratio = "-";
    if (peer_error.empty()) {
      const Stats t = stats(peer["sets"][s.name]["total"].get<std::vector<double>>());
      p = fmt::format("{:.2f} / {:.2f}", t.median, t.p90);
      ratio = fmt::format("{:.2f}", t.median / m.median);
    }
    fmt::print("{:<26} {:>6.2f}M {:>6}  {:>21}  {:>21}  {:>13}\n", s.label, s.numel() / 1e6,
               s.steps, fmt::format("{:.2f} / {:.2f}", m.median, m.p90), p, ratio);
  }
  fmt::print("breakdown (median ms per step):\n");
  for (const ShapeSet& s : sets) {
    fmt::print("  {:<24} megacpp: DistAdamW {:.2f} + DistMuon {:.2f}", s.name,
               median(ours[s.name]["adamw"]), median(ours[s.name]["muon"]));
    if (peer_error.empty()) {
      const json& t = peer["sets"][s.name];
      fmt::print(" | torch: all-reduce {:.2f} ({} bucket{}) + AdamW {:.2f} + Muon {:.2f}",
                 median(t["allreduce"]), t["buckets"].get<int>(),
                 t["buckets"].get<int>() == 1 ? "" : "s", median(t["adamw"]), median(t["muon"]));
    }
    fmt::print("\n");
  }
  if (!peer_error.empty()) fmt::print("peer failed: {}\n", peer_error);
  fmt::print(
      "ratio > 1: megacpp faster. megacpp times DistAdamW::step() + DistMuon::step(): has-grad\n"
      "  masks, per-parameter all-reduce or reduce-scatter + all-gather for AdamW, one\n"
      "  reduce-scatter + one all-gather for all Muon stacks, stacked Muon (Polar Express x5 in\n"
      "  bf16, variance reduction, cautious update, q/k/v split).\n");
  fmt::print(
      "torch{} peer{}:\n", peer_error.empty() ? " " + peer["torch"].get<std::string>() : "",
      peer_error.empty() ? fmt::format(", {} thread(s) per rank", peer["threads"].get<int>()) : "");
  fmt::print(
      "  DDP-style flat all-reduce in 25 MiB buckets (SUM / world; gradients are bucket views),\n"
      "  torch.optim.AdamW defaults (single-tensor loop on CPU),\n"
      "  torch.optim.Muon (Newton-Schulz x5 in bf16, every matrix on every rank). It has no qkv\n"
      "  split, no variance reduction and no cautious update: the torch side does less math.\n");
}

// ---- 2. bytes moved --------------------------------------------------------------------

// A Backend that only carries a rank and a world size: optimizers constructed over it get
// the placement of that rank (construction issues no collective). They must never step.
class PlacementBackend final : public c10d::Backend {
 public:
  PlacementBackend(int rank, int size) : Backend(rank, size) {}
  const std::string getBackendName() const override { return "placement"; }
};

struct Traffic {
  std::string what;
  double elements = 0;
  double gloo = 0;    // bytes sent per rank, as issued on Gloo
  double native = 0;  // bytes sent per rank with a native reduce-scatter
};

double state_bytes(const tr::OptimizerState& s) {
  double b = 0;
  for (const auto& e : s.entries) b += static_cast<double>(e.value.nbytes());
  return b;
}

void print_bytes(const Config& c, const ShapeSet& s) {
  const double w = c.world;
  const double ar = 2 * (w - 1) / w;  // ring all-reduce: bytes sent per byte reduced
  const double half = (w - 1) / w;    // ring reduce-scatter or all-gather
  const Pg pg = c10::make_intrusive<PlacementBackend>(0, static_cast<int>(c.world));
  auto o = build_optimizers(s, pg);

  Traffic mask{"has-grad masks: all-reduce MAX int32", 0, 0, 0};
  Traffic rep{"DistAdamW replicated: all-reduce", 0, 0, 0};
  Traffic rs{"DistAdamW sharded: reduce-scatter", 0, 0, 0};
  Traffic ag{"DistAdamW sharded: all-gather", 0, 0, 0};
  Traffic mrs{"DistMuon stacks: reduce-scatter", 0, 0, 0};
  Traffic mag{"DistMuon stacks: all-gather", 0, 0, 0};
  std::string placement;
  for (size_t i = 0; i < s.adamw.size(); ++i) {
    const double n = static_cast<double>(s.adamw[i][0] * s.adamw[i][1]);
    const bool sharded = o->adam->is_sharded(i);
    placement += fmt::format("{}[{}x{}] {}", i ? ", " : "", s.adamw[i][0], s.adamw[i][1],
                             sharded ? "sharded" : "replicated");
    (sharded ? rs : rep).elements += n;
    if (sharded) ag.elements += n;
  }
  const std::vector<std::vector<Shape>> groups = {s.qkv, s.matrices};
  for (size_t g = 0; g < groups.size(); ++g) {
    std::map<std::pair<int64_t, int64_t>, int64_t> by_shape;  // the optimizer's stack order
    for (const auto& shape : groups[g]) ++by_shape[{shape[0], shape[1]}];
    if (by_shape.size() != o->muon->num_stacks(g))
      throw std::runtime_error("DistMuon stacks differ from the bench's shape grouping");
    size_t k = 0;
    for (const auto& [shape, count] : by_shape) {
      if (o->muon->stack_len(g, k) != count)
        throw std::runtime_error("DistMuon stack lengths differ from the bench's grouping");
      const double padded = static_cast<double>(o->muon->chunk_size(g, k) * c.world);
      placement += fmt::format(", stack {}x[{}x{}] chunk {}", count, shape.first, shape.second,
                               o->muon->chunk_size(g, k));
      mrs.elements += padded * static_cast<double>(shape.first * shape.second);
      ++k;
    }
  }
  mag.elements = mrs.elements;
  mask.elements = static_cast<double>(s.adamw.size() + s.muon().size());
  // Rank-ordered (Gloo, shared memory; stages/trainer/exchange.h): the has-grad flags ride in
  // the gradient buffers (a few bytes, not counted), a reduce-scatter sends each other rank
  // its segment once.
  mask.gloo = 0;
  mask.native = ar * 4 * mask.elements;
  rep.gloo = rep.native = ar * 4 * rep.elements;
  for (Traffic* t : {&rs, &mrs}) t->gloo = t->native = half * 4 * t->elements;
  for (Traffic* t : {&ag, &mag}) t->gloo = t->native = half * 4 * t->elements;

  fmt::print("{}: {}\n", s.label, placement);
  fmt::print("  {:<40} {:>11} {:>17} {:>17}\n", "collective", "elements", "rank-ordered",
             "native (NCCL)");
  Traffic total{"megacpp total", 0, 0, 0};
  for (const Traffic* t : {&mask, &rep, &rs, &ag, &mrs, &mag}) {
    fmt::print("  {:<40} {:>11.0f} {:>17} {:>17}\n", t->what, t->elements, mib(t->gloo),
               mib(t->native));
    total.elements += t->elements;
    total.gloo += t->gloo;
    total.native += t->native;
  }
  const double ddp = ar * 4 * static_cast<double>(s.numel());
  fmt::print("  {:<40} {:>11} {:>17} {:>17}\n", total.what, "", mib(total.gloo), mib(total.native));
  fmt::print("  {:<40} {:>11} {:>17} {:>17}\n", "DDP: all-reduce of every gradient", s.numel(),
             mib(ddp), mib(ddp));
  fmt::print("  {:<40} {:>11} {:>17.3f} {:>17.3f}\n", "megacpp / DDP", "", total.gloo / ddp,
             total.native / ddp);
  const auto one = build_optimizers(s, Pg());
  const double ours = state_bytes(o->adam->state_dict()) + state_bytes(o->muon->state_dict());
  const double rep_state =
      state_bytes(one->adam->state_dict()) + state_bytes(one->muon->state_dict());
  fmt::print("  optimizer state on rank 0: {} (world {}) vs {} replicated (world 1)\n", mib(ours),
             c.world, mib(rep_state));
}

// What ProcessGroupGloo does with a reduce-scatter: whether it is accepted, whether the result
// is right, and its time against an all-reduce and an all-gather of the same buffer.
json probe_rank(const Pg& pg, uint32_t rank, uint32_t world) {
  json out = json::array();
  for (int64_t n : {int64_t{65536}, int64_t{1} << 20}) {
    const int64_t len = n / world * world;
    const at::Tensor input = at::full({len}, static_cast<double>(rank + 1), at::kFloat);
    at::Tensor slice = at::empty({len / world}, at::kFloat);
    json row = {{"numel", len}};
    std::string error;
    try {
      at::Tensor in = input.clone();
      pg->_reduce_scatter_base(slice, in)->wait();
      const double want = world * (world + 1) / 2.0;
      row["rs_correct"] = slice.eq(want).all().item<bool>();
    } catch (const std::exception& e) {
      error = e.what();
      error = error.substr(0, error.find('\n'));
    }
    row["rs_error"] = error;
    std::vector<double> t_ar, t_rs, t_ag;
    for (int i = 0; i < 12; ++i) {
      at::Tensor a = input.clone();
      std::vector<at::Tensor> v{a};
      pg->barrier()->wait();
      auto t0 = Clock::now();
      pg->allreduce(v)->wait();
      if (i >= 2) t_ar.push_back(ms_since(t0));
      if (error.empty()) {
        at::Tensor b = input.clone();
        pg->barrier()->wait();
        t0 = Clock::now();
        pg->_reduce_scatter_base(slice, b)->wait();
        if (i >= 2) t_rs.push_back(ms_since(t0));
      }
      at::Tensor full = at::empty({len}, at::kFloat);
      pg->barrier()->wait();
      t0 = Clock::now();
      pg->_allgather_base(full, slice)->wait();
      if (i >= 2) t_ag.push_back(ms_since(t0));
    }
    row["allreduce_ms"] = stats(t_ar).median;
    row["reduce_scatter_ms"] = stats(t_rs).median;
    row["allgather_ms"] = stats(t_ag).median;
    out.push_back(row);
  }
  return out;
}

void section_bytes(const Config& c, const mc::forked_world::ForkedWorld& world,
                   const std::vector<ShapeSet>& sets) {
  fmt::print(
      "\n== 2. Bytes sent per rank per step (ring model: all-reduce 2(W-1)/W*n, "
      "reduce-scatter and all-gather (W-1)/W*n each), world {} ==\n",
      c.world);
  for (const ShapeSet& s : sets) print_bytes(c, s);
  fmt::print(
      "Rank-ordered: the exchanges of stages/trainer/exchange.h on Gloo and shared memory (the\n"
      "has-grad flags ride in the gradient buffers); native: the backend's own collectives.\n");
  const json probe = run_ranks(c, world, "probe", [&](const Pg& pg, uint32_t rank) {
    return probe_rank(pg, rank, c.world);
  });
  fmt::print("Probe of ProcessGroupGloo::_reduce_scatter_base (torch {}):\n", TORCH_VERSION);
  for (const json& row : probe) {
    const std::string err = row["rs_error"];
    const double n = row["numel"].get<double>();
    if (!err.empty()) {
      fmt::print(
          "  {:>8.0f} floats: reduce-scatter rejected ({}); all-reduce {:.3f} ms, "
          "all-gather {:.3f} ms\n",
          n, err, row["allreduce_ms"].get<double>(), row["allgather_ms"].get<double>());
      continue;
    }
    fmt::print(
        "  {:>8.0f} floats: accepted, result {}; median all-reduce {:.3f} ms, "
        "reduce-scatter {:.3f} ms (x{:.2f} of the all-reduce), all-gather {:.3f} ms\n",
        n, row["rs_correct"].get<bool>() ? "correct" : "WRONG", row["allreduce_ms"].get<double>(),
        row["reduce_scatter_ms"].get<double>(),
        row["reduce_scatter_ms"].get<double>() / row["allreduce_ms"].get<double>(),
        row["allgather_ms"].get<double>());
  }
  fmt::print(
      "  libtorch's ProcessGroupGloo accepts reduce_scatter and _reduce_scatter_base, but runs\n"
      "  them as an all-reduce of the whole input plus a copy of the rank's chunk (no Gloo\n"
      "  reduce-scatter algorithm is linked): a native call would move all-reduce bytes too.\n");
}

// ---- 3. crossover ---------------------------------------------------------------------

const std::vector<int64_t> kCrossoverSizes = {256,   512,   1024,   2048,   4096,
                                              16384, 65536, 262144, 1048576};

// [rows, cols] with rows a multiple of world (as close to square as powers of two allow);
// the element count is rounded up to a multiple of world when needed.
Shape crossover_shape(int64_t n, int64_t world) {
  n = (n + world - 1) / world * world;
  int64_t rows = world;
  while (n % (rows * 2) == 0 && rows * 2 * rows * 2 <= n) rows *= 2;
  return {rows, n / rows};
}

// Small sizes are cheap and their latency-bound steps the most exposed to scheduling noise:
// they get four times the steps.
uint32_t crossover_steps(const Config& c, int64_t size) {
  return size <= 65536 ? 4 * c.steps : c.steps;
}

json crossover_rank(const Config& c, const Pg& pg, uint32_t rank) {
  json out = json::array();
  for (int64_t size : kCrossoverSizes) {
    const Shape shape = crossover_shape(size, c.world);
    std::vector<at::Tensor> p = {randn(shape, 11).requires_grad_(),
                                 randn(shape, 11).requires_grad_()};
    tr::DistAdamW sharded({{.params = {p[0]}}}, pg, {.crossover_numel = 1});
    tr::DistAdamW replicated({{.params = {p[1]}}}, pg,
                             {.crossover_numel = std::numeric_limits<int64_t>::max()});
    const std::vector<at::Tensor> grads = {randn(shape, 100 + rank), randn(shape, 200 + rank)};
    std::vector<double> ts, tr_;
    for (uint32_t i = 0; i < c.warmup + crossover_steps(c, size); ++i) {
      // Alternate which placement goes first, so drift in machine load hits both alike.
      for (int k = 0; k < 2; ++k) {
        const bool shard = (i + k) % 2 == 0;
        tr::DistAdamW& opt = shard ? sharded : replicated;
        p[shard ? 0 : 1].mutable_grad() = grads[i % 2];
        pg->barrier()->wait();
        const auto t0 = Clock::now();
        opt.step();
        const double ms = ms_since(t0);
        if (i >= c.warmup) (shard ? ts : tr_).push_back(ms);
      }
    }
    out.push_back({{"numel", shape[0] * shape[1]},
                   {"shape", shape},
                   {"is_sharded", sharded.is_sharded(0)},
                   {"sharded", stats(ts).median},
                   {"replicated", stats(tr_).median}});
  }
  return out;
}

void section_crossover(const Config& c, const mc::forked_world::ForkedWorld& world) {
  fmt::print(
      "\n== 3. DistAdamW crossover: one parameter, forced sharded (crossover_numel 1) vs "
      "forced replicated, world {} over Gloo, median of {} steps ({} up to 65536) ==\n",
      c.world, c.steps, crossover_steps(c, 1));
  const json rows = run_ranks(c, world, "crossover", [&](const Pg& pg, uint32_t rank) {
    return crossover_rank(c, pg, rank);
  });
  fmt::print("{:>9} {:>12} {:>15} {:>12} {:>17} {:>21}\n", "numel", "shape", "replicated ms",
             "sharded ms", "sharded/replicated", "Adam state per rank");
  std::optional<int64_t> from;  // smallest size from which sharded is never slower
  for (const json& r : rows) {
    const int64_t n = r["numel"];
    const double rep = r["replicated"], sh = r["sharded"];
    const double state = 8.0 * static_cast<double>(n);  // exp_avg + exp_avg_sq, float32
    fmt::print("{:>9} {:>12} {:>15.3f} {:>12.3f} {:>17.2f} {:>21}\n", n,
               fmt::format("{}x{}", r["shape"][0].get<int64_t>(), r["shape"][1].get<int64_t>()),
               rep, sh, sh / rep, fmt::format("{} -> {}", mib(state), mib(state / c.world)));
    if (!r["is_sharded"].get<bool>())
      throw std::runtime_error("crossover_numel 1 left a parameter replicated");
    if (sh <= rep) {
      if (!from) from = n;
    } else {
      from.reset();
    }
  }
  const int64_t dflt = tr::DistAdamWOptions{}.crossover_numel;
  if (from) {
    fmt::print(
        "measured crossover (Gloo, world {}): sharded is not slower from {} elements up "
        "(DistAdamWOptions default crossover_numel: {})\n",
        c.world, *from, dflt);
  } else {
    fmt::print(
        "measured crossover (Gloo, world {}): none up to {} elements: sharded stays "
        "slower on Gloo at every size (DistAdamWOptions default crossover_numel: {});\n"
        "  what sharding buys here is memory: Adam state per rank / {} (column above)\n",
        c.world, kCrossoverSizes.back(), dflt, c.world);
  }
  fmt::print(
      "On Gloo a sharded step issues all-reduce + all-gather against the replicated all-reduce\n"
      "alone (1.5x the bytes at any world size), and saves (W-1)/W of the Adam arithmetic.\n");
}

// ---- 4. share of the train step ---------------------------------------------------------

json share_rank(const Config& c, const mc::recipe::Recipe& r, uint32_t steps, const Pg& pg,
                uint32_t rank) {
  capnp::MallocMessageBuilder msg;
  auto spec = msg.initRoot<mc::schema::RecipeSpec>();
  mc::recipe::to_spec(r, spec);
  const uint32_t total = c.warmup + steps;
  tr::TrainStep ts(tr::model_config(spec.asReader()), tr::train_config(spec.getTrain()), total, pg);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4242 + rank);
  std::vector<double> fwd, bwd, opt, agree;
  for (uint32_t s = 1; s <= total; ++s) {
    const at::Tensor tokens = at::randint(r.model.vocab_size, mc::recipe::batch_spec(r).shape(),
                                          gen, at::TensorOptions().dtype(at::kLong));
    const tr::StepTiming t = ts.step(tokens, s);
    // The graceful-stop agreement the trainer runs after every step (one int32 MAX
    // all-reduce, TrainStep::any_rank).
    const auto a0 = std::chrono::steady_clock::now();
    ts.any_rank(false);
    const double agree_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a0).count();
    if (s <= c.warmup) continue;
    fwd.push_back(t.forward_seconds * 1e3);
    bwd.push_back(t.backward_seconds * 1e3);
    opt.push_back(t.optimizer_seconds * 1e3);
    agree.push_back(agree_ms);
  }
  if (!pg || pg->getSize() < 2)
    return {{"forward", fwd}, {"backward", bwd}, {"optimizer", opt}, {"agree", agree}};
  // A rank that finishes backward first waits for its peers inside the optimizer's first
  // collective, so its optimizer_seconds includes the skew between ranks. Per step, the
  // rank that finished forward + backward last waited for nobody: its figures are the
  // step's critical path, and those are what is reported.
  const auto n = static_cast<int64_t>(fwd.size());
  at::Tensor mine = at::empty({n, 4}, at::kDouble);
  for (int64_t i = 0; i < n; ++i) {
    mine[i][0] = fwd[i];
    mine[i][1] = bwd[i];
    mine[i][2] = opt[i];
    mine[i][3] = agree[i];
  }
  at::Tensor all = at::empty({pg->getSize() * n, 4}, at::kDouble);
  pg->_allgather_base(all, mine)->wait();
  all = all.view({pg->getSize(), n, 4});
  std::vector<double> f, b, o, g;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor per_rank = all.select(1, i);  // [world, 4]
    const int64_t last = (per_rank.select(1, 0) + per_rank.select(1, 1)).argmax().item<int64_t>();
    f.push_back(per_rank[last][0].item<double>());
    b.push_back(per_rank[last][1].item<double>());
    o.push_back(per_rank[last][2].item<double>());
    // The rank that entered the agreement last waited for no peer: its time is the
    // collective's own.
    g.push_back(per_rank.select(1, 3).min().item<double>());
  }
  return {{"forward", f}, {"backward", b}, {"optimizer", o}, {"agree", g}};
}

// The optimizer's cost per step is fixed by the model (Muon's orthogonalization is O(d^3) per
// matrix, whatever the batch) while forward + backward grow with the tokens of the step: the
// share is measured at the recipe's batch and at larger ones, to show where the <= 3% of the
// published distributed-Muon range is reached on this machine.
void section_share(const Config& c, const mc::forked_world::ForkedWorld& world,
                   const mc::recipe::Recipe& r) {
  fmt::print(
      "\n== 4. Optimizer share of a TrainStep, recipe {} ({}), world {} over Gloo, "
      "batch x1 (the recipe's), x4, x16, x32; {} steps at x1 (fewer for larger batches) after "
      "{} warm-up ==\n",
      r.name, r.path.string(), c.world, c.steps, c.warmup);
  fmt::print("{:>8} {:>14} {:>12} {:>12} {:>13} {:>18} {:>10}\n", "batch", "tokens/rank",
             "forward ms", "backward ms", "optimizer ms", "share (median)", "goal 3%");
  std::vector<double> agree, step_ms;
  for (uint32_t mult : {1u, 4u, 16u, 32u}) {
    mc::recipe::Recipe rb = r;
    rb.train.batch_size *= mult;
    const uint32_t steps = std::max(3u, c.steps / mult);
    const json t =
        run_ranks(c, world, fmt::format("share{}", mult),
                  [&](const Pg& pg, uint32_t rank) { return share_rank(c, rb, steps, pg, rank); });
    const auto f = t["forward"].get<std::vector<double>>();
    const auto b = t["backward"].get<std::vector<double>>();
    const auto o = t["optimizer"].get<std::vector<double>>();
    if (mult == 1) {
      agree = t["agree"].get<std::vector<double>>();
      for (size_t i = 0; i < o.size(); ++i) step_ms.push_back(f[i] + b[i] + o[i]);
    }
    std::vector<double> share;
    for (size_t i = 0; i < o.size(); ++i) share.push_back(100.0 * o[i] / (f[i] + b[i]));
    const Stats s = stats(share);
    fmt::print("{:>8} {:>14} {:>12.2f} {:>12.2f} {:>13.2f} {:>17.1f}% {:>10}\n",
               rb.train.batch_size, rb.train.batch_size * rb.model.seq_len, stats(f).median,
               stats(b).median, stats(o).median, s.median, s.median <= 3.0 ? "met" : "not met");
  }
  fmt::print(
      "medians over steps of the critical path (per step, the rank that finished forward +\n"
      "backward last, which waits for no peer); optimizer = TrainStep's optimizer_seconds\n"
      "(clipping, DistAdamW and DistMuon steps with their collectives); share = optimizer /\n"
      "(forward + backward).\n");
  if (!agree.empty()) {
    const double a = stats(agree).median, st = stats(step_ms).median;
    fmt::print(
        "graceful-stop agreement (TrainStep::any_rank after every step: one int32 MAX "
        "all-reduce): median {:.3f} ms per step = {:.2f}% of a step at the recipe's batch "
        "({:.1f} ms; per step the rank that entered last, which waits for no peer)\n",
        a, 100.0 * a / st, st);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  const fs::path venv_python = kSourceRoot / ".venv/bin/python";
  c.peer_python = fs::exists(venv_python) ? venv_python.string() : "python3";
  CLI::App app{
      "DistAdamW + DistMuon vs torch.optim.AdamW + Muon: step time, bytes, crossover, "
      "share of a train step"};
  app.add_option("--world", c.world, "ranks (forked, joined by Gloo)")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  app.add_option("--steps", c.steps,
                 "measured steps (step time of the recipe's shapes, "
                 "crossover, share)")
      ->check(CLI::Range(1u, 100000u))
      ->capture_default_str();
  app.add_option("--large-steps", c.large_steps, "measured steps of the large shape set")
      ->check(CLI::Range(1u, 100000u))
      ->capture_default_str();
  app.add_option("--warmup", c.warmup, "unmeasured first steps")->capture_default_str();
  app.add_option("--sections", c.sections, "comma-separated: all, step, bytes, crossover, share")
      ->delimiter(',')
      ->check(CLI::IsMember({"all", "step", "bytes", "crossover", "share"}))
      ->capture_default_str();
  app.add_option("--recipe", c.recipe, "recipe path or name")->capture_default_str();
  app.add_option("--peer-python", c.peer_python, "python with torch for the peer")
      ->capture_default_str();
  app.add_option("--peer-script", c.peer_script, "the peer")->capture_default_str();
  app.add_option("--deadline", c.deadline_s, "seconds each group of processes may run")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    torch::set_num_threads(1);  // forked ranks must not inherit a live OpenMP pool
    std::string recipe = c.recipe;
    if (fs::path(recipe).is_relative() && !fs::exists(recipe) && fs::exists(kSourceRoot / recipe))
      recipe = (kSourceRoot / recipe).string();
    const mc::recipe::Recipe r = mc::recipe::load(mc::recipe::resolve(recipe, MEGACPP_RECIPE_DIR));
    const std::vector<ShapeSet> sets = {model_shapes(r.name, r.model.vocab_size, r.model.d_model,
                                                     r.model.n_layers, r.model.mlp_mult, c.steps),
                                        model_shapes("large", 4096, 512, 4, 4, c.large_steps)};

    const mc::forked_world::ForkedWorld world(c.world, std::chrono::seconds(60));

    fmt::print(
        "bench_optimizer: world {}, {} measured steps ({} for the large set) after {} "
        "warm-up, recipe {}\n",
        c.world, c.steps, c.large_steps, c.warmup, r.path.string());
    const auto t0 = Clock::now();
    if (wants(c, "step")) section_step(c, world, sets);
    if (wants(c, "bytes")) section_bytes(c, world, sets);
    if (wants(c, "crossover")) section_crossover(c, world);
    if (wants(c, "share")) section_share(c, world, r);
    fmt::print("\ntotal {:.1f} s\n", ms_since(t0) / 1e3);
    return 0;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "bench_optimizer: %s\n", e.what());
    return 1;
  }
}
