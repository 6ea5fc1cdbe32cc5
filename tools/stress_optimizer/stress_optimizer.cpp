// megacpp-stress-optimizer: the long-run stress harness of DistAdamW / DistMuon. It forks W ranks
// joined by Gloo over a TCPStore this process hosts, steps both optimizers over a small parameter
// set with a deterministic schedule of per-rank gradients (present or absent), and checks at every
// sample that all ranks hold bit-identical parameters and optimizer state (max_adam_abs_diff,
// max_mu_a_abs_diff, max_mu_b_abs_diff, max_abs_param_diff, each exactly 0). Sharded state is
// held by one rank only, so every rank also steps a replicated mirror of both optimizers
// (DistAdamW without sharding, DistMuon with DistMuonOptions::replicated) on the same
// gradients: its state is compared across ranks, and the sharded pair must equal it exactly.
// With --reference it replays the same schedule through tools/optim_reference.py (float64)
// and checks the distance to it.
//
// Gradient presence (phase = step % 4), generalising {0:g,1:-}, {0:-,1:g}, {0:g,1:g}, {-,-}
// to W ranks: phase 0 only rank 0 has gradients, phase 1 only rank W-1, phase 2 every rank,
// phase 3 none. --scenario conditional additionally flips presence for a per-step subset of
// parameters on a per-rank basis (so one parameter can have a gradient on some ranks only,
// or on none while its neighbours have one). --scenario hybrid steps the parameters of a hybrid
// model (attention, mixture of experts, Mamba-2, recurrence: hybrid_set) as the trainer assigns
// them to the two optimizers, and withholds a routed expert's gradient on a rank whose batch
// routed it no token (`starved`): an expert then has a gradient on some ranks only, or on none
// while the router and every other block have one. It fails unless the schedule produced both.
// --bf16-mixed runs bfloat16 parameters and gradients with float32 masters in the optimizers
// (train.precision = "bf16-mixed"): the masters are compared across ranks and with the
// reference (fed the same bfloat16-rounded gradients), and every parameter must be exactly its
// master's bfloat16 cast.
// --tensor-parallel T arranges the W ranks as W / T replicas of T consecutive ranks (a
// tensor-parallel group each, as the trainer's nemo_native layout): every rank of a replica
// holds only its part of each DistMuon matrix (tensor_parallel.h shard_model's cuts: blocks of
// rows or columns, a block every rank holds, routed experts on one rank each; optim.h
// MatrixPart) and gives the blocks of its replica's gradient; DistMuon steps the whole matrices
// over the W ranks, averaging over the replicas. The schedule's ranks are the replicas. At every
// sample each rank publishes its replica's whole matrices reassembled from the group's parts
// (an all-gather): the replicas must agree bit for bit, equal the mirror (whole matrices,
// stepped on each replica's whole gradient) bit for bit, and match the reference.
//
// Samples travel from the ranks to this process through the TCPStore (keys under
// "stress/"); the cross-rank comparison and the reference comparison run here after the
// ranks exit. Every comparison treats a non-finite value as a failure and names the tensor,
// the element and the rank that holds it.
//
// Each rank appends every optimizer call (DistAdamW or DistMuon step() of schedule step s,
// each a fixed sequence of collectives) to its call log in the store when it enters the call,
// and marks it when it returns, so the log survives the rank. After the ranks end, a failure
// is reported by its cause: "collective sequences diverged" only when two ranks' logs issue
// different calls at the same index (or a rank finished with fewer calls than another), with
// the index, the calls and the ranks left inside a call; otherwise the rank that crashed
// (signal), could not rendezvous, or threw, and the ranks left blocked behind it.
// --break-mask makes a rank with no local gradient skip step() (emulating a missing has-grad
// mask): the logs then diverge, whether the ranks pair their collectives with other ranks'
// different steps (at W=2 the pairing stays symmetric, so parameters stay equal across ranks
// yet are wrong) or leave a peer in a collective that never completes (Gloo error or timeout;
// the parent SIGKILLs ranks still running collective_timeout + 5 s after the first failure,
// or at --deadline). Every wait is bounded. --inject-crash, --inject-rendezvous-failure and
// --inject-nan are the faults that must be reported as what they are.
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "stages/trainer/optim.h"
#include "stages/trainer/rendezvous.h"
#include "stages/trainer/tensor_parallel.h"
#include "stages/trainer/train_step.h"
#include "tools/forked_world/forked_world.h"

namespace megacpp::trainer {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

struct Config {
  uint32_t world = 2;
  uint32_t steps = 1000;
  uint32_t sample_every = 100;
  std::string scenario = "pure";
  bool break_mask = false;
  std::string reference;
  std::string python = "python3";
  int collective_timeout_s = 10;
  int deadline_s = 540;
  bool keep = false;
  // 0 by default: the cautious mask (u * p) >= 0 is discontinuous where u crosses 0, so one
  // element whose u has a different sign in float32 than in float64 moves by lr_eff * wd * p
  // (~5e-4 here), beyond the Muon tolerance, without anything being wrong.
  double muon_wd = 0.0;
  // Orthogonalize in bfloat16 (the training default) instead of float32.
  bool bf16 = false;
  // bf16-mixed (train.precision): bfloat16 parameters and gradients, float32 masters in the
  // optimizers (master_weights, gradients summed in float32). The masters are compared with the
  // reference (fed the same bfloat16-rounded gradients), and every parameter must be exactly its
  // master's bfloat16 cast.
  bool mixed = false;
  int rendezvous_timeout_s = 30;
  // Fail unless DistAdamW shards exactly this many parameters.
  std::optional<int> expect_adam_sharded;
  // Fault injection (rank, step). NaN: after its DistAdamW step, the rank sets element 5 of
  // the exp_avg of the parameter set's nan_param (a norm weight, replicated, so every rank
  // holds a copy to compare) to NaN. Crash:
  // the rank aborts at the start of that step.
  std::optional<std::pair<uint32_t, uint32_t>> inject_nan, inject_crash;
  // This rank joins the process group under another store prefix: no peer ever meets it.
  std::optional<uint32_t> inject_rendezvous_failure;
  // Ranks per tensor-parallel group (dividing world): DistMuon matrices held in parts.
  uint32_t tp = 1;
};

// The schedule's world: one rank per replica (world / tp). Presence, gradients and the
// reference are the replicas'.
Config replicas_of(const Config& c) {
  Config r = c;
  r.world = c.world / c.tp;
  return r;
}

// A rank's exit status: what it was doing when it failed.
constexpr int kRankStepFailed = 3, kRankRendezvousFailed = 4, kRankOtherFailure = 5;

// One parameter of the stressed set. `expert` >= 0: a routed expert's matrix, whose gradient is
// absent on a rank whose batch sent that expert no token (the hybrid scenario).
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool muon = false;
  int expert = -1;
};
struct MuonGroupSpec {
  std::vector<size_t> members = {};  // parameter indices, in the group's order
  std::vector<int64_t> split = {};   // qkv_split_sizes; empty: whole matrices
};
// The parameters the ranks step, and how they are handed to the optimizers: DistAdamW takes
// `adam` as one group (in that order: its flattened index k is adam[k]), DistMuon one group per
// `muon` entry. `nan_param` is the DistAdamW index --inject-nan poisons (replicated at every
// world, so every rank holds a copy to compare).
struct ParamSet {
  std::string description;
  std::vector<ParamSpec> params;
  std::vector<size_t> adam;
  std::vector<MuonGroupSpec> muon;
  size_t nan_param = 0;
  // The hybrid set's model (its tensor-parallel parts are shard_model's).
  std::optional<ModelConfig> model = std::nullopt;
};

// pure / conditional: with the harness's crossover of 1024 elements, wte (96 rows) is sharded
// at worlds 2 and 3, lm_head (64 rows) at world 2 only, norm never. Muon: group 0 =
// {attn_proj, mlp_proj}, group 1 = {qkv} (fused, split into q, k, v).
ParamSet default_set() {
  ParamSet s;
  s.description = "6 parameters (3 DistAdamW, 3 DistMuon in 2 groups)";
  s.params = {
      {"wte", {96, 32}, false},         {"lm_head", {64, 32}, false},    {"norm", {32}, false},
      {"h0.attn_proj", {32, 32}, true}, {"h0.mlp_proj", {32, 32}, true}, {"h0.qkv", {96, 32}, true},
  };
  s.adam = {0, 1, 2};
  s.muon = {{.members = {3, 4}}, {.members = {5}, .split = {32, 32, 32}}};
  s.nan_param = 2;
  return s;
}

// hybrid: the parameters of a hybrid model with every block family (tiny-hybrid's pattern AEMR,
// grouped-query attention, 4 routed experts of which each token takes 2, a shared expert, the
// Mamba-2 mixer and the gated recurrence) at a size the float64 reference replays in seconds,
// handed to the optimizers exactly as the trainer assigns them (TrainStep::assignment()): every
// 2-D block matrix (each expert's own) to DistMuon, fused qkv split in its own group; embedding,
// head, router, norms, SSM scalars, conv weights and biases to DistAdamW.
ParamSet hybrid_set(uint32_t tp) {
  ModelConfig m;
  m.vocab_size = 96;  // embedding and head: 96 x 32, sharded by DistAdamW at worlds 2 and 3
  m.seq_len = 16;
  m.d_model = 32;
  m.n_layers = 4;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.ffn_hidden = 64;
  m.moe = {.enabled = true,
           .n_experts = 4,
           .top_k = 2,
           .expert_hidden = 16,
           .shared_hidden = 16,
           .aux_loss_coef = 0.01};
  m.ssm = {.d_state = 8, .head_dim = 16, .expand = 2, .conv_kernel = 4, .chunk = 8};
  m.rnn = {.width = 32, .conv_kernel = 4};
  m.blocks = recipe::expand_blocks("AEMR", m.n_layers, recipe::kModeAuthorDp, true);
  if (tp > 1) {
    // The tensor-parallel layout's: R runs on the Mamba block; key/value heads divide tp.
    m.mode = std::string(recipe::kModeNemoNative);
    m.blocks = recipe::expand_blocks("AEMR", m.n_layers, recipe::kModeNemoNative, true);
    m.n_kv_heads = tp;
    m.n_heads = 2 * tp;
  }
  TrainConfig t;
  t.optim.qkv_split = true;
  const TrainStep model(m, t, 1, nullptr, at::Device(at::kCPU));
  const std::vector<NamedTensor> named = model.parameters();
  const std::vector<ParamAssignment> assigned = model.assignment();
  ParamSet s;
  MuonGroupSpec qkv{.split = {int64_t{m.n_heads} * m.head_dim(),
                              int64_t{m.kv_heads()} * m.head_dim(),
                              int64_t{m.kv_heads()} * m.head_dim()}};
  MuonGroupSpec matrices;
  size_t experts = 0;
  for (size_t i = 0; i < named.size(); ++i) {
    ParamSpec p{.name = named[i].first,
                .shape = named[i].second.sizes().vec(),
                .muon = assigned[i].optimizer == "muon"};
    if (const size_t at = p.name.find(".experts."); at != std::string::npos)
      p.expert = std::stoi(p.name.substr(at + 9));
    if (!p.muon)
      s.adam.push_back(i);
    else
      (assigned[i].group == "qkv" ? qkv : matrices).members.push_back(i);
    experts += p.expert >= 0;
    s.params.push_back(std::move(p));
  }
  for (auto* g : {&qkv, &matrices})
    if (!g->members.empty()) s.muon.push_back(std::move(*g));
  for (size_t k = 0; k < s.adam.size(); ++k) {
    const auto& shape = s.params[s.adam[k]].shape;
    if (shape.size() == 1 && shape[0] > 5) {  // a norm weight: never above the crossover
      s.nan_param = k;
      break;
    }
  }
  s.description = fmt::format(
      "{} parameters of blocks {} ({} DistAdamW; {} DistMuon in {} groups, {} of them expert "
      "matrices)",
      s.params.size(), m.blocks, s.adam.size(), s.params.size() - s.adam.size(), s.muon.size(),
      experts);
  s.model = m;
  return s;
}

// Tensor-parallel rank `tp_rank`'s part of every DistMuon matrix of `set` (by parameter index):
// the hybrid set's as shard_model cuts its model; the default set's qkv by q, k and v rows, its
// projections by columns. A matrix shard_model leaves whole is whole on every rank, its
// gradient given by rank 0.
std::map<size_t, MatrixPart> tp_parts(const ParamSet& set, uint32_t tp_rank, uint32_t tp) {
  std::map<std::string, MatrixPart> by_name;
  if (set.model) {
    Transformer model(*set.model, 1);
    by_name = shard_model(*model, TensorParallel{.rank = tp_rank, .size = tp});
  }
  std::map<size_t, MatrixPart> out;
  for (size_t i = 0; i < set.params.size(); ++i) {
    const ParamSpec& p = set.params[i];
    if (!p.muon) continue;
    if (auto it = by_name.find(p.name); it != by_name.end()) {
      out[i] = it->second;
      continue;
    }
    MatrixPart part{.full_shape = p.shape, .dim = 0, .blocks = {}};
    const auto split = [&](int64_t dim, std::vector<int64_t> runs) {
      part.dim = dim;
      int64_t full = 0, local = 0;
      for (int64_t run : runs) {
        const int64_t size = run / tp;
        part.blocks.push_back(
            {.full_offset = full + tp_rank * size, .local_offset = local, .size = size});
        full += run, local += size;
      }
    };
    if (!set.model && p.name.ends_with("qkv")) {
      split(0, {p.shape[0] / 3, p.shape[0] / 3, p.shape[0] / 3});
    } else if (!set.model) {
      split(1, {p.shape[1]});
    } else {
      part.blocks.push_back({.full_offset = 0,
                             .local_offset = 0,
                             .size = p.shape[0],
                             .contributes = tp_rank == 0,
                             .replicated = true});
    }
    out[i] = std::move(part);
  }
  return out;
}

// The blocks of `whole` a part holds, as the rank's tensor ([0, cols] when none).
at::Tensor local_of(const at::Tensor& whole, const MatrixPart& part) {
  if (part.blocks.empty()) return at::empty({0, whole.size(1)}, whole.options());
  std::vector<at::Tensor> pieces;
  for (const auto& b : part.blocks) pieces.push_back(whole.narrow(part.dim, b.full_offset, b.size));
  return at::cat(pieces, part.dim).contiguous();
}

constexpr int64_t kAdamCrossover = 1024;
constexpr double kAdamLr = 0.004, kAdamB1 = 0.8, kAdamB2 = 0.95, kAdamEps = 1e-10, kAdamWd = 0.01;
constexpr double kMuonLr = 0.02, kMuonMom = 0.95, kMuonB2 = 0.95;
// Distance to the float64 reference. Adam and float32 Muon: fixed (DESIGN.md "Decisions": stress
// harness tolerances). bfloat16 Muon: the orthogonalization rounds every update to 8 significant
// bits, an error of a fixed relative size per step that does not cancel; consecutive updates are
// correlated through the momentum, so the accumulated distance grows like sqrt(k) after k steps —
// measured worst 6.3e-4·sqrt(k) over k = 50..1000 (DESIGN.md "Decisions": stress harness
// tolerances). The bound is 1.5e-3·sqrt(k), 2.4x that; a formula error is far beyond it (the
// fused-qkv lr scale this repository used to apply: 0.19 at k = 50, where the bound is 0.011).
constexpr double kAdamTol = 2e-5, kMuonTol = 3e-4, kMuonBf16TolPerSqrtStep = 1.5e-3;

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
uint64_t mix3(uint64_t a, uint64_t b, uint64_t c) {
  return mix(mix(mix(a) ^ b) ^ c);
}

at::Tensor randn(at::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
}
at::Tensor init_value(const ParamSet& set, size_t i) {
  return randn(set.params[i].shape, 1000 + i) * 0.5;
}
// The gradient a rank's parameter receives: float32, or its bfloat16 rounding under bf16-mixed
// (as float32 for the reference, which replays the same values).
at::Tensor grad_value(const Config& c, const ParamSet& set, uint32_t step, uint32_t rank,
                      size_t i) {
  const at::Tensor g = randn(set.params[i].shape, mix3(step, rank, i));
  return c.mixed ? g.to(at::kBFloat16).to(at::kFloat) : g;
}

// The hybrid scenario's routing: expert e received no token on `rank` at `step` (so its matrices
// have no gradient there while the router, the shared expert and every other block do). One
// (step, rank, expert) in three: an expert is starved on one rank only, or on every rank.
bool starved(uint32_t step, uint32_t rank, int expert) {
  return mix3(step, rank, static_cast<uint64_t>(expert) + 0x5eed) % 3 == 0;
}

// The phase's presence: whether the rank had a batch at that step (phase = step % 4).
bool has_batch(const Config& c, uint32_t step, uint32_t rank) {
  switch (step % 4) {
    case 0:
      return rank == 0;
    case 1:
      return rank == c.world - 1;
    case 2:
      return true;
    default:
      return false;
  }
}

bool present(const Config& c, const ParamSet& set, uint32_t step, uint32_t rank, size_t i) {
  bool base = has_batch(c, step, rank);
  if (c.scenario == "conditional") {
    const bool in_subset = mix3(step, i, 0xc0ffee) % 2 == 0;
    const bool flip = mix3(step, rank, i + 77) % 3 == 0;
    if (in_subset && flip) base = !base;
  }
  if (c.scenario == "hybrid" && set.params[i].expert >= 0 &&
      starved(step, rank, set.params[i].expert))
    base = false;
  return base;
}

std::string key(uint32_t sample, uint32_t rank, const char* what) {
  return fmt::format("stress/sample{}/rank{}/{}", sample, rank, what);
}

// What a published value is, for the cross-rank maxima: a parameter (either pair), AdamW state,
// Muon momentum buffers and group scalars (mu_a), Muon second-moment buffers (mu_b).
enum class Kind { kParam, kAdam, kMuA, kMuB };
NLOHMANN_JSON_SERIALIZE_ENUM(Kind, {{Kind::kParam, "param"},
                                    {Kind::kAdam, "adam"},
                                    {Kind::kMuA, "mu_a"},
                                    {Kind::kMuB, "mu_b"}})

Kind kind_of(bool adam, const StateKey& key) {
  if (key.field == StateField::kMaster) return Kind::kParam;
  if (adam) return Kind::kAdam;
  return key.field == StateField::kSecondMomentum ? Kind::kMuB : Kind::kMuA;
}

// Appends a tensor's values (as float64) to data and its description to meta.
void publish_entry(json& meta, std::vector<double>& data, const std::string& name, Kind kind,
                   const at::Tensor& t, const std::vector<int64_t>& full_shape, int64_t offset,
                   bool replicated) {
  const at::Tensor d = t.detach().to(at::kDouble).contiguous().reshape({-1});
  meta.push_back({{"name", name},
                  {"kind", kind},
                  {"shape", t.sizes().vec()},
                  {"full_shape", full_shape},
                  {"offset", offset},
                  {"replicated", replicated},
                  {"start", data.size()},
                  {"numel", d.numel()}});
  data.insert(data.end(), d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

std::string calls_key(uint32_t rank) {
  return fmt::format("stress/calls/rank{}", rank);
}

void append(c10d::Store& store, const std::string& k, const std::string& v) {
  store.append(k, std::vector<uint8_t>(v.begin(), v.end()));
}

[[noreturn]] void crash() {
  const rlimit no_core{0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  signal(SIGABRT, SIG_DFL);
  abort();
}

int run_rank(const Config& c, const ParamSet& set, uint16_t port, uint32_t rank) {
  uint32_t step = 0;
  const char* where = "rendezvous";
  try {
    GlooOptions go;
    go.store_port = port;
    go.rank = rank;
    go.world = c.world;
    go.store_timeout = std::chrono::seconds(c.rendezvous_timeout_s);
    go.collective_timeout = std::chrono::seconds(c.collective_timeout_s);
    go.store_prefix =
        c.inject_rendezvous_failure == rank ? "stress/gloo-elsewhere/" : "stress/gloo/";
    auto pg = connect_gloo(go);
    c10d::TCPStoreOptions so;
    so.port = port;
    so.isServer = false;
    so.timeout = std::chrono::seconds(30);
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    where = "set-up";

    // The sharded pair, and the mirror: the same optimizers with every state tensor replicated
    // (DistAdamW with no parameter above the crossover, DistMuon owning whole stacks) over a
    // second copy of the parameters, stepped on the same gradients right after the sharded
    // pair. Its state is held by every rank, so it can be compared across ranks; the sharded
    // pair must equal it.
    // --tensor-parallel: the sharded pair's DistMuon holds this rank's parts of the matrices
    // (p), the mirror the whole matrices (q); the schedule is the replica's.
    const uint32_t replica = rank / c.tp, tp_rank = rank % c.tp;
    const Config cr = replicas_of(c);
    const bool parted = c.tp > 1;
    const std::map<size_t, MatrixPart> parts =
        parted ? tp_parts(set, tp_rank, c.tp) : std::map<size_t, MatrixPart>{};
    std::vector<at::Tensor> p, q;
    const at::ScalarType dtype = c.mixed ? at::kBFloat16 : at::kFloat;
    for (size_t i = 0; i < set.params.size(); ++i) {
      const at::Tensor whole = init_value(set, i).to(dtype);
      p.push_back(
          (parts.contains(i) ? local_of(whole, parts.at(i)) : whole.clone()).requires_grad_(true));
      q.push_back(whole.requires_grad_(true));
    }
    auto adam_groups = [&](const std::vector<at::Tensor>& x) {
      AdamWParamGroup g{.lr = kAdamLr,
                        .beta1 = kAdamB1,
                        .beta2 = kAdamB2,
                        .eps = kAdamEps,
                        .weight_decay = kAdamWd};
      for (size_t i : set.adam) {
        g.params.push_back(x[i]);
        if (c.mixed) g.masters.push_back(init_value(set, i));
      }
      return std::vector<AdamWParamGroup>{std::move(g)};
    };
    auto muon_groups = [&](const std::vector<at::Tensor>& x, bool with_parts) {
      std::vector<MuonParamGroup> out;
      for (const MuonGroupSpec& spec : set.muon) {
        MuonParamGroup g{.lr = kMuonLr,
                         .momentum = kMuonMom,
                         .beta2 = kMuonB2,
                         .weight_decay = c.muon_wd,
                         .qkv_split_sizes = spec.split};
        for (size_t i : spec.members) {
          g.params.push_back(x[i]);
          if (c.mixed || with_parts) g.masters.push_back(init_value(set, i));
          if (with_parts) g.parts.push_back(parts.at(i));
        }
        out.push_back(std::move(g));
      }
      return out;
    };
    const uint32_t muon_replicas = parted ? cr.world : 0;
    const std::optional<at::ScalarType> reduce =
        c.mixed ? std::optional(at::kFloat) : std::optional<at::ScalarType>();
    DistAdamW adam(
        adam_groups(p), pg,
        DistAdamWOptions{
            .crossover_numel = kAdamCrossover, .master_weights = c.mixed, .reduce_dtype = reduce});
    DistMuon muon(muon_groups(p, parted), pg,
                  DistMuonOptions{.bf16_orthogonalization = c.bf16,
                                  .master_weights = c.mixed,
                                  .reduce_dtype = reduce,
                                  .replicas = muon_replicas});
    DistAdamW adam_r(adam_groups(q), pg,
                     DistAdamWOptions{.crossover_numel = std::numeric_limits<int64_t>::max(),
                                      .master_weights = c.mixed,
                                      .reduce_dtype = reduce});
    DistMuon muon_r(muon_groups(q, false), pg,
                    DistMuonOptions{.bf16_orthogonalization = c.bf16,
                                    .replicated = true,
                                    .master_weights = c.mixed,
                                    .reduce_dtype = reduce,
                                    .replicas = muon_replicas});
    // A matrix's whole value as this rank's replica holds it: the contributing blocks of the
    // group's parts (disjoint; zeros elsewhere), summed out of an all-gather over every rank.
    const auto whole_of = [&](size_t i) {
      const MatrixPart& part = parts.at(i);
      at::Tensor mine = at::zeros(set.params[i].shape, p[i].options().requires_grad(false));
      for (const auto& b : part.blocks)
        if (b.contributes)
          mine.narrow(part.dim, b.full_offset, b.size)
              .copy_(p[i].detach().narrow(part.dim, b.local_offset, b.size));
      std::vector<std::vector<at::Tensor>> all(1);
      for (uint32_t r = 0; r < c.world; ++r) all[0].push_back(at::empty_like(mine));
      std::vector<at::Tensor> in{mine};
      pg->allgather(all, in)->wait();
      at::Tensor whole = at::zeros_like(mine);
      for (uint32_t t = 0; t < c.tp; ++t) whole.add_(all[0][replica * c.tp + t]);
      return whole;
    };
    if (rank == 0) {
      std::string sharded;
      for (size_t k = 0; k < set.adam.size(); ++k)
        if (adam.is_sharded(k))
          sharded += fmt::format("{}{}", sharded.empty() ? "" : ", ", set.params[set.adam[k]].name);
      store->set("stress/adam_sharded", std::vector<uint8_t>(sharded.begin(), sharded.end()));
    }
    const std::string log = calls_key(rank);
    for (step = 0; step < c.steps; ++step) {
      if (c.inject_crash == std::pair{rank, step}) crash();
      bool any_adam = false, any_muon = false;
      for (size_t i = 0; i < p.size(); ++i) {
        const bool has = present(cr, set, step, replica, i);
        const at::Tensor g = has ? grad_value(cr, set, step, replica, i).to(dtype) : at::Tensor();
        if (parts.contains(i)) {
          // This rank's blocks of its replica's gradient; the mirror's whole gradient is given
          // by the replica's first rank.
          const at::Tensor mine = has ? local_of(g, parts.at(i)) : at::Tensor();
          p[i].mutable_grad() = mine.defined() && mine.numel() > 0 ? mine : at::Tensor();
          q[i].mutable_grad() = has && tp_rank == 0 ? g : at::Tensor();
        } else {
          p[i].mutable_grad() = g;
          q[i].mutable_grad() = has ? g.clone() : at::Tensor();
        }
        (set.params[i].muon ? any_muon : any_adam) |= has;
      }
      where = "DistAdamW::step";
      if (!c.break_mask || any_adam) {
        append(*store, log, fmt::format("A{} ", step));
        adam.step();
        adam_r.step();
        append(*store, log, "+ ");
      }
      if (c.inject_nan && c.inject_nan->first == rank && c.inject_nan->second == step) {
        for (auto& e : adam.state_view().entries)
          if (e.key == StateKey::of_param(set.nan_param, StateField::kExpAvg))
            e.value.view({-1})[5].fill_(NAN);
      }
      where = "DistMuon::step";
      if (!c.break_mask || any_muon) {
        append(*store, log, fmt::format("M{} ", step));
        muon.step();
        muon_r.step();
        append(*store, log, "+ ");
      }
      where = "sample publication";
      if ((step + 1) % c.sample_every == 0) {
        json meta = json::array();
        std::vector<double> data;
        for (size_t i = 0; i < p.size(); ++i) {
          const at::Tensor value = parts.contains(i) ? whole_of(i) : p[i];
          publish_entry(meta, data, fmt::format("param.{}", set.params[i].name), Kind::kParam,
                        value, value.sizes().vec(), 0, true);
          publish_entry(meta, data, fmt::format("mirror.{}", set.params[i].name), Kind::kParam,
                        q[i], q[i].sizes().vec(), 0, true);
        }
        for (const auto& [prefix, is_adam, st] :
             {std::tuple{"adam.", true, adam.state_view()},
              std::tuple{"muon.", false, muon.state_view()},
              std::tuple{"adam_r.", true, adam_r.state_view()},
              std::tuple{"muon_r.", false, muon_r.state_view()}})
          for (const auto& e : st.entries)
            publish_entry(meta, data, prefix + entry_name(e.key), kind_of(is_adam, e.key), e.value,
                          e.full_shape, e.offset, e.replicated);
        const std::string m = meta.dump();
        std::vector<uint8_t> mb(m.begin(), m.end());
        std::vector<uint8_t> db(data.size() * sizeof(double));
        std::memcpy(db.data(), data.data(), db.size());
        store->set(key(step + 1, rank, "data"), db);
        store->set(key(step + 1, rank, "meta"), mb);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    fprintf(stderr, "rank %u: failed at step %u in %s: %s\n", rank, step, where, e.what());
    const std::string_view w(where);
    return w == "rendezvous"       ? kRankRendezvousFailed
           : w.ends_with("::step") ? kRankStepFailed
                                   : kRankOtherFailure;
  }
}

// ---- safetensors (little-endian; header padded with spaces to a multiple of 8) ----------
void write_safetensors(const fs::path& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  json header = json::object();
  size_t off = 0;
  std::vector<at::Tensor> data;
  for (const auto& [name, t] : tensors) {
    at::Tensor c = t.detach().to(at::kFloat).contiguous();
    const size_t bytes = static_cast<size_t>(c.numel()) * sizeof(float);
    header[name] = {
        {"dtype", "F32"}, {"shape", c.sizes().vec()}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
    data.push_back(c);
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  std::ofstream f(path, std::ios::binary);
  const uint64_t n = h.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& c : data)
    f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  if (!f.good()) throw std::runtime_error("writing " + path.string() + " failed");
}

std::map<std::string, std::vector<double>> read_safetensors(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string h(n, '\0');
  f.read(h.data(), static_cast<std::streamsize>(n));
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (!f.eof() && !f.good()) throw std::runtime_error("reading " + path.string() + " failed");
  std::map<std::string, std::vector<double>> out;
  const json header = json::parse(h);  // items() refers into it: keep it alive
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    const size_t b = v["data_offsets"][0], e = v["data_offsets"][1];
    const std::string dt = v["dtype"];
    std::vector<double>& o = out[name];
    if (dt == "F64") {
      o.resize((e - b) / 8);
      std::memcpy(o.data(), bytes.data() + b, e - b);
    } else if (dt == "I64") {
      std::vector<int64_t> t((e - b) / 8);
      std::memcpy(t.data(), bytes.data() + b, e - b);
      o.assign(t.begin(), t.end());
    } else {
      throw std::runtime_error(
          fmt::format("{}: unexpected dtype {} for {}", path.string(), dt, name));
    }
  }
  return out;
}

// A difference that must be exactly zero: "0.0" when it is, every digit when it is not
// ("nan" when a non-finite value was involved).
std::string exact(double d) {
  return d == 0.0 ? "0.0" : fmt::format("{:.17g}", d);
}

// Distances are NaN as soon as a non-finite value takes part (two equal infinities, or NaN
// against anything, are no match), and NaN is worse than any number: every check below is
// "d == 0" or "d <= tolerance", which NaN fails. std::max(m, NaN) would keep m.
double distance(double a, double b) {
  return std::isfinite(a) && std::isfinite(b) ? std::abs(a - b) : NAN;
}
double worse(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b);
}

// Row-major multi-index of flat element i of a tensor of `shape`, e.g. "[2, 5]".
std::string index_str(const std::vector<int64_t>& shape, size_t i) {
  if (shape.empty()) return "[]";
  std::vector<int64_t> idx(shape.size());
  auto rest = static_cast<int64_t>(i);
  for (size_t d = shape.size(); d-- > 0;) {
    const int64_t n = std::max<int64_t>(shape[d], 1);
    idx[d] = rest % n;
    rest /= n;
  }
  return fmt::format("[{}]", fmt::join(idx, ", "));
}

// The largest distance between two tensors and the element where it is (the first non-finite
// one when there is one, then the distance is NaN).
struct Diff {
  double max = 0;
  std::string where = "-";
};
Diff max_diff(const std::string& name, const std::vector<int64_t>& shape,
              const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size())
    return {NAN, fmt::format("{} (sizes {} and {})", name, a.size(), b.size())};
  Diff d;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = distance(a[i], b[i]);
    if (std::isnan(x)) {
      return {NAN, fmt::format("{}{} ({} against {})", name, index_str(shape, i), a[i], b[i])};
    }
    if (x > d.max || d.where == "-") d = {x, fmt::format("{}{}", name, index_str(shape, i))};
  }
  return d;
}
void accumulate(Diff& acc, const Diff& d) {
  if (std::isnan(acc.max)) return;
  if (std::isnan(d.max) || d.max > acc.max || acc.where == "-") acc = d;
}

// One sample as the ranks published it, assembled into logical tensors named like the
// reference's OUT keys ("{p}", "{p}.exp_avg", ...).
// Across ranks, over every value more than one rank holds: parameters (both pairs), AdamW
// state (exp_avg, exp_avg_sq, step, group scalars), Muon momentum buffers and group scalars
// (mu_a), Muon second-moment buffers (mu_b) — the sharded pair's replicated entries and the
// whole mirror. Plus the sharded pair against the mirror (parameters and reassembled state).
struct Sample {
  double max_param_diff = 0;
  double max_adam_diff = 0;
  double max_mu_a_diff = 0;
  double max_mu_b_diff = 0;
  double max_sharded_vs_replicated = 0;
  // bf16-mixed: the largest distance between a parameter and its master's bfloat16 cast.
  double max_cast_diff = 0;
  size_t compared_values = 0;  // held by more than one rank and compared
  // The first non-finite element of every (rank, entry) that has one: "rank r name[i] = v".
  std::vector<std::string> nonfinite;
  std::map<std::string, std::vector<double>> logical;
  std::map<std::string, std::vector<int64_t>> shapes;  // of the logical tensors
};

// A DistMuon stack: its group, its index in the group, and the parameters it holds in stack
// order. The layout depends on the groups' shapes alone, not on the world (optim.h).
struct MuonStack {
  uint32_t group = 0, stack = 0;
  std::vector<size_t> members = {};  // parameter indices
};
std::vector<MuonStack> muon_stacks(const ParamSet& set) {
  std::vector<MuonParamGroup> groups;
  for (const MuonGroupSpec& spec : set.muon) {
    MuonParamGroup g{.qkv_split_sizes = spec.split};
    for (size_t i : spec.members) g.params.push_back(at::zeros(set.params[i].shape));
    groups.push_back(std::move(g));
  }
  const DistMuon layout(std::move(groups), nullptr);
  std::vector<MuonStack> out;
  for (uint32_t g = 0; g < layout.num_groups(); ++g)
    for (uint32_t st = 0; st < layout.num_stacks(g); ++st) {
      MuonStack m{.group = g, .stack = st};
      for (size_t j : layout.stack_members(g, st)) m.members.push_back(set.muon[g].members[j]);
      out.push_back(std::move(m));
    }
  return out;
}

Sample assemble(const Config& c, const ParamSet& set, const std::vector<MuonStack>& stacks,
                c10d::Store& store, uint32_t k) {
  Sample s;
  std::vector<json> metas(c.world);
  std::vector<std::vector<double>> datas(c.world);
  for (uint32_t r = 0; r < c.world; ++r) {
    if (!store.check({key(k, r, "meta")}))
      throw std::runtime_error(fmt::format("sample {}: rank {} never published it", k, r));
    const auto m = store.get(key(k, r, "meta"));
    metas[r] = json::parse(std::string(m.begin(), m.end()));
    const auto d = store.get(key(k, r, "data"));
    datas[r].resize(d.size() / sizeof(double));
    std::memcpy(datas[r].data(), d.data(), d.size());
  }
  std::map<std::string, std::vector<double>> raw;  // entry name -> assembled logical values
  for (size_t e = 0; e < metas[0].size(); ++e) {
    const json& m0 = metas[0][e];
    const std::string name = m0["name"];
    const std::vector<int64_t> full = m0["full_shape"];
    int64_t full_numel = 1;
    for (int64_t d : full) full_numel *= d;
    const int64_t row = full.empty() ? 1 : full_numel / std::max<int64_t>(full[0], 1);
    std::vector<double> out(static_cast<size_t>(full_numel), 0.0);
    for (uint32_t r = 0; r < c.world; ++r) {
      const json& m = metas[r].at(e);
      if (m["name"] != name) throw std::runtime_error("ranks published different state layouts");
      const size_t start = m["start"], numel = m["numel"];
      const double* v = datas[r].data() + start;
      for (size_t i = 0; i < numel; ++i) {
        if (std::isfinite(v[i])) continue;
        // Named by its element of the logical tensor (a shard starts at row `offset`).
        const size_t at =
            m["replicated"] ? i : static_cast<size_t>(m["offset"].get<int64_t>() * row) + i;
        s.nonfinite.push_back(fmt::format(
            "rank {} {}{} = {}", r, name,
            index_str(m["replicated"] ? m["shape"].get<std::vector<int64_t>>() : full, at), v[i]));
        break;
      }
      if (m["replicated"]) {
        double d = 0;
        for (size_t i = 0; r > 0 && i < numel; ++i) d = worse(d, distance(v[i], out[i]));
        if (r == 0) std::copy(v, v + numel, out.begin());
        if (r > 0) s.compared_values += numel;
        const Kind kind = m0["kind"];
        double& acc = kind == Kind::kParam  ? s.max_param_diff
                      : kind == Kind::kAdam ? s.max_adam_diff
                      : kind == Kind::kMuB  ? s.max_mu_b_diff
                                            : s.max_mu_a_diff;
        acc = worse(acc, d);
      } else {
        const size_t at = static_cast<size_t>(m["offset"].get<int64_t>() * row);
        std::copy(v, v + std::min(numel, out.size() - std::min(at, out.size())), out.begin() + at);
      }
    }
    raw[name] = std::move(out);
  }
  // The sharded pair against the mirror: Muon stacks compare their first (unpadded) rows.
  for (const auto& [name, values] : raw) {
    std::string other;
    if (name.starts_with("param.")) other = "mirror." + name.substr(6);
    if (name.starts_with("adam.")) other = "adam_r." + name.substr(5);
    if (name.starts_with("muon.")) other = "muon_r." + name.substr(5);
    // Under --tensor-parallel in float32 the sharded DistMuon's "master" entries (its whole
    // copies of the matrices) have no counterpart in the mirror; its parameters are compared.
    if (other.empty() || !raw.contains(other)) continue;
    const auto& mirror = raw.at(other);
    for (size_t i = 0; i < mirror.size(); ++i)
      s.max_sharded_vs_replicated =
          worse(s.max_sharded_vs_replicated, distance(values.at(i), mirror[i]));
  }
  // Map entry names to the reference's logical names. Under bf16-mixed a parameter's logical
  // value is its master (the optimizers' float32 copy, reassembled below).
  for (const ParamSpec& p : set.params) {
    s.logical[p.name] = raw.at(fmt::format("param.{}", p.name));
    s.shapes[p.name] = p.shape;
  }
  std::map<std::string, std::vector<double>> masters;
  if (c.mixed) {
    for (uint32_t k = 0; k < set.adam.size(); ++k)
      masters[set.params[set.adam[k]].name] =
          raw.at("adam." + entry_name(StateKey::of_param(k, StateField::kMaster)));
    for (const MuonStack& st : stacks) {
      const auto& m =
          raw.at("muon." + entry_name(StateKey::of_stack(st.group, st.stack, StateField::kMaster)));
      for (size_t j = 0; j < st.members.size(); ++j) {
        const ParamSpec& p = set.params[st.members[j]];
        const size_t mn = static_cast<size_t>(p.shape[0] * p.shape[1]);
        masters[p.name].assign(m.begin() + j * mn, m.begin() + (j + 1) * mn);
      }
    }
    for (auto& [name, master] : masters) {
      const at::Tensor cast = at::tensor(master, at::kDouble)
                                  .to(at::kFloat)
                                  .to(at::kBFloat16)
                                  .to(at::kDouble)
                                  .contiguous();
      const auto& param = s.logical.at(name);
      for (size_t i = 0; i < master.size(); ++i)
        s.max_cast_diff = worse(s.max_cast_diff, distance(param.at(i), cast.data_ptr<double>()[i]));
      s.logical[name] = master;
    }
  }
  // The reference's names of the AdamW state of a parameter, and the entries that hold it.
  const std::array<std::pair<const char*, StateField>, 3> adam_state = {
      {{"exp_avg", StateField::kExpAvg},
       {"exp_avg_sq", StateField::kExpAvgSq},
       {"step", StateField::kStep}}};
  for (uint32_t k = 0; k < set.adam.size(); ++k) {
    const ParamSpec& p = set.params[set.adam[k]];
    for (const auto& [suffix, field] : adam_state)
      s.logical[p.name + "." + suffix] = raw.at("adam." + entry_name(StateKey::of_param(k, field)));
    s.shapes[p.name + ".exp_avg"] = s.shapes[p.name + ".exp_avg_sq"] = p.shape;
  }
  for (const MuonStack& st : stacks) {
    const auto& mom =
        raw.at("muon." + entry_name(StateKey::of_stack(st.group, st.stack, StateField::kMomentum)));
    const auto& sec = raw.at(
        "muon." + entry_name(StateKey::of_stack(st.group, st.stack, StateField::kSecondMomentum)));
    const bool split = !set.muon[st.group].split.empty();
    for (size_t j = 0; j < st.members.size(); ++j) {
      const ParamSpec& p = set.params[st.members[j]];
      const auto& shp = p.shape;
      const size_t mn = static_cast<size_t>(shp[0] * shp[1]);
      // Per row when rows >= cols or the parameter is split (the qkv), else per column.
      const bool per_row = shp[0] >= shp[1] || split;
      const size_t sn = static_cast<size_t>(per_row ? shp[0] : shp[1]);
      s.shapes[p.name + ".momentum_buffer"] = shp;
      s.shapes[p.name + ".second_momentum_buffer"] =
          per_row ? std::vector<int64_t>{shp[0], 1} : std::vector<int64_t>{1, shp[1]};
      s.logical[p.name + ".momentum_buffer"].assign(mom.begin() + j * mn,
                                                    mom.begin() + (j + 1) * mn);
      s.logical[p.name + ".second_momentum_buffer"].assign(sec.begin() + j * sn,
                                                           sec.begin() + (j + 1) * sn);
    }
  }
  return s;
}

// Runs argv with a deadline; returns the exit status or -1 when it was killed at the deadline.
int run_child(const std::vector<std::string>& args, int deadline_s) {
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    fprintf(stderr, "execvp %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  const auto deadline = Clock::now() + std::chrono::seconds(deadline_s);
  for (;;) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    if (Clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// One optimizer call as a rank's log records it.
struct Call {
  std::string what;  // "A12": DistAdamW::step of schedule step 12; "M12": DistMuon::step
  bool returned = false;
};
std::string describe(const Call& call) {
  return fmt::format("{}::step of step {}", call.what[0] == 'A' ? "DistAdamW" : "DistMuon",
                     call.what.substr(1));
}
std::vector<Call> read_calls(c10d::Store& store, uint32_t rank) {
  std::vector<Call> out;
  if (!store.check({calls_key(rank)})) return out;
  const auto b = store.get(calls_key(rank));
  std::istringstream in(std::string(b.begin(), b.end()));
  for (std::string tok; in >> tok;) {
    if (tok == "+") {
      if (!out.empty()) out.back().returned = true;
    } else {
      out.push_back({tok, false});
    }
  }
  return out;
}

// How each rank ended.
struct Outcome {
  int status = -1;      // wait status
  bool killed = false;  // by this process, still running after the grace period or deadline
  bool ok() const { return !killed && WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

// "" when the ranks' call logs agree; otherwise where they first disagree: an index at which
// two ranks issued different calls, or at which a rank that finished cleanly had issued none
// while another rank issued one. A rank that died with a shorter log is not a divergence.
std::string divergence(const std::vector<std::vector<Call>>& logs,
                       const std::vector<Outcome>& outcome) {
  size_t longest = 0;
  for (const auto& l : logs) longest = std::max(longest, l.size());
  for (size_t k = 0; k < longest; ++k) {
    std::optional<std::string> first;
    bool differ = false;
    for (size_t r = 0; r < logs.size(); ++r) {
      if (k < logs[r].size()) {
        if (!first) first = logs[r][k].what;
        differ |= logs[r][k].what != *first;
      } else if (outcome[r].ok()) {
        differ = true;
      }
    }
    if (!differ) continue;
    std::string text = fmt::format("at optimizer call #{}:", k);
    for (size_t r = 0; r < logs.size(); ++r) {
      text += k < logs[r].size()
                  ? fmt::format(" rank {} {};", r, describe(logs[r][k]))
                  : fmt::format(" rank {} none (its {} calls ended {});", r, logs[r].size(),
                                outcome[r].ok() ? "with a clean exit" : "when it failed");
    }
    return text;
  }
  return "";
}

std::string signal_name(int sig) {
  const char* n = sigabbrev_np(sig);
  return n ? fmt::format("SIG{}", n) : fmt::format("signal {}", sig);
}

// How the schedule leaves the experts' gradients, over all steps: a (step, expert) pair counts
// as `some_ranks` when the expert has a gradient on some ranks that have a batch and not on
// others, and as `no_rank` when no rank has one while other parameters do.
struct Starvation {
  size_t some_ranks = 0, no_rank = 0;
};
Starvation count_starvation(const Config& c, const ParamSet& set) {
  Starvation out;
  for (uint32_t step = 0; step < c.steps; ++step) {
    std::map<int, std::pair<uint32_t, uint32_t>> per_expert;  // expert -> (ranks with, batches)
    for (size_t i = 0; i < set.params.size(); ++i) {
      if (set.params[i].expert < 0) continue;
      auto& [with, batches] = per_expert[set.params[i].expert];
      with = batches = 0;
      for (uint32_t r = 0; r < c.world; ++r) {
        with += present(c, set, step, r, i);
        batches += has_batch(c, step, r);
      }
    }
    for (const auto& [expert, counts] : per_expert) {
      const auto [with, batches] = counts;
      if (batches > 0 && with == 0) ++out.no_rank;
      if (with > 0 && with < batches) ++out.some_ranks;
    }
  }
  return out;
}

int run(const Config& c) {
  torch::set_num_threads(1);  // forked ranks must not inherit a live OpenMP pool
  const ParamSet set = c.scenario == "hybrid" ? hybrid_set(c.tp) : default_set();
  const std::vector<MuonStack> stacks = muon_stacks(set);
  printf("parameter set: %s\n", set.description.c_str());
  if (c.scenario == "hybrid") {
    const Starvation st = count_starvation(replicas_of(c), set);
    printf(
        "expert gradients: on some ranks with a batch but not others at %zu (step, expert) "
        "pairs, on no rank while the rest of the model has gradients at %zu\n",
        st.some_ranks, st.no_rank);
    if (st.some_ranks == 0 || st.no_rank == 0) {
      fprintf(stderr, "FAIL: the hybrid schedule never starved an expert on %s: run more steps\n",
              st.some_ranks == 0 ? "some ranks only" : "every rank");
      return 1;
    }
  }
  const forked_world::ForkedWorld world(c.world, std::chrono::seconds(30));
  c10d::Store& server = world.store();
  const uint16_t port = world.store_port();
  const auto t0 = Clock::now();

  const auto grace = std::chrono::seconds(c.collective_timeout_s + 5);
  const forked_world::ReapOptions bounds{
      .deadline = t0 + std::chrono::seconds(c.deadline_s),
      .grace_after_failure = grace,
      .on_first_failure =
          [&](size_t r, int st) {
            fprintf(stderr, "rank %zu failed first (status %d); others get %llds to finish\n", r,
                    WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st),
                    static_cast<long long>(grace.count()));
          },
      .on_kill =
          [&](size_t r, bool at_deadline) {
            fprintf(stderr, "rank %zu: still running %s; killed\n", r,
                    at_deadline ? fmt::format("at the {}s deadline", c.deadline_s).c_str()
                                : "after another rank failed");
          }};
  forked_world::ReapResult reaped;
  try {
    reaped = world.run([&](uint32_t r) { return run_rank(c, set, port, r); }, bounds);
  } catch (const std::system_error& e) {
    fprintf(stderr, "fork failed: %s\n", e.what());
    return 2;
  }
  const std::vector<int>& status = reaped.status;
  const std::vector<bool>& killed = reaped.killed;
  const double train_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<Outcome> outcome(c.world);
  std::vector<std::vector<Call>> logs(c.world);
  bool ok = true;
  for (uint32_t r = 0; r < c.world; ++r) {
    outcome[r] = {status[r], killed[r]};
    logs[r] = read_calls(server, r);
    ok &= outcome[r].ok();
  }
  // A call a rank entered and never returned from: where a killed rank was blocked.
  auto inside = [&](uint32_t r) {
    return !logs[r].empty() && !logs[r].back().returned
               ? fmt::format("inside optimizer call #{} ({})", logs[r].size() - 1,
                             describe(logs[r].back()))
               : std::string("outside any optimizer call");
  };
  const std::string diverged = divergence(logs, outcome);
  if (!diverged.empty()) {
    fprintf(stderr, "FAIL: collective sequences diverged %s\n", diverged.c_str());
    for (uint32_t r = 0; r < c.world; ++r) {
      if (outcome[r].killed)
        fprintf(stderr, "  rank %u: stuck in a collective %s, killed\n", r, inside(r).c_str());
      else if (!outcome[r].ok())
        fprintf(stderr, "  rank %u: failed %s (its error is above)\n", r, inside(r).c_str());
    }
    return 1;
  }
  if (!ok) {
    // Not a divergence: name what each failed rank did, the cause first.
    for (uint32_t r = 0; r < c.world; ++r) {
      const int st = status[r];
      if (outcome[r].ok()) continue;
      if (outcome[r].killed) {
        fprintf(stderr,
                "FAIL: rank %u was still running %s and was killed (blocked behind a "
                "failed peer or past the deadline)\n",
                r, inside(r).c_str());
      } else if (WIFSIGNALED(st)) {
        fprintf(stderr, "FAIL: rank %u crashed (%s) %s\n", r, signal_name(WTERMSIG(st)).c_str(),
                inside(r).c_str());
      } else if (WEXITSTATUS(st) == kRankRendezvousFailed) {
        fprintf(stderr,
                "FAIL: rank %u could not join the process group (rendezvous error "
                "above)\n",
                r);
      } else {
        fprintf(stderr, "FAIL: rank %u threw an exception %s (exit %d, error above)\n", r,
                inside(r).c_str(), WEXITSTATUS(st));
      }
    }
    fprintf(stderr,
            "FAIL: after %.1fs the ranks' optimizer call logs agree: the ranks failed, "
            "their collective sequences did not diverge\n",
            train_s);
    return 1;
  }
  printf(
      "world %u%s, %u steps, scenario %s%s, Muon orthogonalization in %s%s: ranks finished in "
      "%.1fs\n",
      c.world,
      c.tp > 1
          ? fmt::format(" (tensor-parallel groups of {}: DistMuon matrices in parts)", c.tp).c_str()
          : "",
      c.steps, c.scenario.c_str(), c.break_mask ? " (break-mask)" : "",
      c.bf16 ? "bfloat16" : "float32", c.mixed ? ", bf16-mixed (float32 masters)" : "", train_s);
  const auto sb = server.get("stress/adam_sharded");
  const std::string sharded(sb.begin(), sb.end());
  const int n_sharded =
      sharded.empty() ? 0 : 1 + static_cast<int>(std::count(sharded.begin(), sharded.end(), ','));
  printf("DistAdamW shards %d of %zu parameters at world %u%s%s%s\n", n_sharded, set.adam.size(),
         c.world, sharded.empty() ? "" : " (", sharded.c_str(), sharded.empty() ? "" : ")");
  if (c.expect_adam_sharded && *c.expect_adam_sharded != n_sharded) {
    fprintf(stderr, "FAIL: expected DistAdamW to shard %d parameters, it shards %d\n",
            *c.expect_adam_sharded, n_sharded);
    return 1;
  }

  std::vector<uint32_t> ks;
  for (uint32_t k = c.sample_every; k <= c.steps; k += c.sample_every) ks.push_back(k);
  std::vector<Sample> samples;
  for (uint32_t k : ks) {
    samples.push_back(assemble(c, set, stacks, server, k));
    const Sample& s = samples.back();
    printf(
        "sample %u across ranks: max_adam_abs_diff=%s max_mu_a_abs_diff=%s max_mu_b_abs_diff=%s "
        "max_abs_param_diff=%s (%zu values); sharded vs replicated max_abs_diff=%s\n",
        k, exact(s.max_adam_diff).c_str(), exact(s.max_mu_a_diff).c_str(),
        exact(s.max_mu_b_diff).c_str(), exact(s.max_param_diff).c_str(), s.compared_values,
        exact(s.max_sharded_vs_replicated).c_str());
    for (const auto& where : s.nonfinite) {
      fprintf(stderr, "FAIL: non-finite value at sample %u: %s\n", k, where.c_str());
      ok = false;
    }
    if (s.max_param_diff != 0.0 || s.max_adam_diff != 0.0 || s.max_mu_a_diff != 0.0 ||
        s.max_mu_b_diff != 0.0) {
      fprintf(stderr,
              "FAIL: ranks diverged by sample %u (max_adam_abs_diff=%.17g max_mu_a_abs_diff=%.17g "
              "max_mu_b_abs_diff=%.17g max_abs_param_diff=%.17g)\n",
              k, s.max_adam_diff, s.max_mu_a_diff, s.max_mu_b_diff, s.max_param_diff);
      ok = false;
    }
    if (c.mixed) {
      printf(
          "sample %u bf16-mixed: parameters against their masters' bfloat16 cast "
          "max_abs_diff=%s\n",
          k, exact(s.max_cast_diff).c_str());
      if (s.max_cast_diff != 0.0) {
        fprintf(stderr, "FAIL: a parameter is not its master's bfloat16 cast at sample %u\n", k);
        ok = false;
      }
    }
    if (s.max_sharded_vs_replicated != 0.0) {
      fprintf(stderr,
              "FAIL: sharded optimizers differ from their replicated mirror by sample %u "
              "(max_abs_diff=%.17g)\n",
              k, s.max_sharded_vs_replicated);
      ok = false;
    }
  }
  if (!ok) return 1;
  if (c.reference.empty()) {
    printf("PASS (no reference)\n");
    return 0;
  }

  char tmpl[] = "/tmp/megacpp-stress-optimizer-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
  const fs::path dir(tmpl);
  std::vector<std::pair<std::string, at::Tensor>> init, grads;
  json params = json::array();
  std::vector<const std::vector<int64_t>*> split(set.params.size(), nullptr);
  for (const MuonGroupSpec& g : set.muon)
    for (size_t i : g.members)
      if (!g.split.empty()) split[i] = &g.split;
  for (size_t i = 0; i < set.params.size(); ++i) {
    const ParamSpec& sp = set.params[i];
    init.emplace_back(sp.name, init_value(set, i));
    json p = {{"name", sp.name},
              {"shape", sp.shape},
              {"optimizer", sp.muon ? "muon" : "adamw"},
              {"init", {{"file", "init.safetensors"}, {"key", sp.name}}}};
    if (split[i]) p["qkv_split_sizes"] = *split[i];
    params.push_back(p);
  }
  // The schedule's ranks: the replicas (one per rank without tensor parallelism).
  const Config cr = replicas_of(c);
  for (uint32_t s = 0; s < c.steps; ++s)
    for (uint32_t r = 0; r < cr.world; ++r)
      for (size_t i = 0; i < set.params.size(); ++i)
        if (present(cr, set, s, r, i))
          grads.emplace_back(fmt::format("step{}.rank{}.{}", s, r, set.params[i].name),
                             grad_value(cr, set, s, r, i));
  const json spec = {{"world_size", cr.world},
                     {"steps", c.steps},
                     {"hyperparameters",
                      {{"adamw",
                        {{"lr", kAdamLr},
                         {"betas", {kAdamB1, kAdamB2}},
                         {"eps", kAdamEps},
                         {"weight_decay", kAdamWd}}},
                       {"muon",
                        {{"lr", kMuonLr},
                         {"momentum", kMuonMom},
                         {"beta2", kMuonB2},
                         {"weight_decay", c.muon_wd},
                         {"ns_method", "polar_express"},
                         {"ns_steps", 5}}}}},
                     {"params", params}};
  write_safetensors(dir / "init.safetensors", init);
  write_safetensors(dir / "grads.safetensors", grads);
  std::ofstream(dir / "spec.json") << spec.dump(2);
  const auto tr = Clock::now();
  const int rc =
      run_child({c.python, c.reference, "--spec", (dir / "spec.json").string(), "--grads",
                 (dir / "grads.safetensors").string(), "--out", (dir / "out.safetensors").string(),
                 "--sample-every", std::to_string(c.sample_every)},
                c.deadline_s);
  if (rc != 0) {
    fprintf(stderr, "FAIL: the reference %s (inputs kept in %s)\n",
            rc == -1 ? "hit the deadline" : fmt::format("exited {}", rc).c_str(), dir.c_str());
    return 1;
  }
  const auto ref = read_safetensors(dir / "out.safetensors");
  printf("reference: %zu gradient tensors replayed in %.1fs\n", grads.size(),
         std::chrono::duration<double>(Clock::now() - tr).count());
  auto ref_get = [&](const std::string& k) -> const std::vector<double>& {
    auto it = ref.find(k);
    if (it == ref.end()) throw std::runtime_error("reference output lacks " + k);
    return it->second;
  };
  double muon_tol = kMuonTol;
  for (size_t si = 0; si < ks.size(); ++si) {
    const Sample& s = samples[si];
    if (c.bf16) muon_tol = kMuonBf16TolPerSqrtStep * std::sqrt(static_cast<double>(ks[si]));
    const std::string pre = fmt::format("sample{}.", ks[si]);
    Diff adam, mu_p, mu_a, mu_b;
    bool steps_equal = true;
    auto diff = [&](const std::string& n) {
      return max_diff(n, s.shapes.at(n), s.logical.at(n), ref_get(pre + n));
    };
    for (const ParamSpec& sp : set.params) {
      const std::string& n = sp.name;
      if (!sp.muon) {
        for (const char* suf : {"", ".exp_avg", ".exp_avg_sq"}) accumulate(adam, diff(n + suf));
        steps_equal &= s.logical.at(n + ".step") == ref_get(pre + n + ".step");
      } else {
        accumulate(mu_p, diff(n));
        accumulate(mu_a, diff(n + ".momentum_buffer"));
        accumulate(mu_b, diff(n + ".second_momentum_buffer"));
      }
    }
    const bool good = steps_equal && adam.max <= kAdamTol && mu_p.max <= muon_tol &&
                      mu_a.max <= muon_tol && mu_b.max <= muon_tol;
    printf(
        "sample %u vs reference: adam_abs_diff=%.3g (%s) mu_param_abs_diff=%.3g (%s) "
        "mu_a_abs_diff=%.3g mu_b_abs_diff=%.3g adam_steps_equal=%s (tolerance Adam %g, Muon "
        "%.3g) %s\n",
        ks[si], adam.max, adam.where.c_str(), mu_p.max, mu_p.where.c_str(), mu_a.max, mu_b.max,
        steps_equal ? "yes" : "NO", kAdamTol, muon_tol, good ? "ok" : "OUT OF TOLERANCE");
    for (const Diff* d : {&adam, &mu_p, &mu_a, &mu_b})
      if (std::isnan(d->max))
        fprintf(stderr, "FAIL: non-finite value against the reference at sample %u: %s\n", ks[si],
                d->where.c_str());
    ok &= good;
  }
  if (!ok) {
    fprintf(stderr,
            "FAIL: distance to the reference out of tolerance (Adam %g, Muon %g); "
            "inputs kept in %s\n",
            kAdamTol, muon_tol, dir.c_str());
    return 1;
  }
  if (!c.keep) fs::remove_all(dir);
  printf("PASS\n");
  return 0;
}

}  // namespace
}  // namespace megacpp::trainer

int main(int argc, char** argv) {
  megacpp::trainer::Config c;
  CLI::App app{"Stress DistAdamW/DistMuon over W forked Gloo ranks"};
  app.add_option("--world", c.world, "ranks")->check(CLI::Range(1u, 64u));
  app.add_option("--steps", c.steps, "optimizer steps")->check(CLI::Range(1u, 1000000u));
  app.add_option("--sample-every", c.sample_every, "compare every N steps")
      ->check(CLI::Range(1u, 1000000u));
  app.add_option("--scenario", c.scenario, "gradient presence schedule")
      ->check(CLI::IsMember({"pure", "conditional", "hybrid"}));
  app.add_flag("--break-mask", c.break_mask,
               "ranks without a local gradient skip step() (must fail, never hang)");
  const std::filesystem::path src(MEGACPP_SOURCE_DIR);
  if (std::filesystem::exists(src / "tools/optim_reference.py") &&
      std::filesystem::exists(src / ".venv/bin/python")) {
    c.reference = (src / "tools/optim_reference.py").string();
    c.python = (src / ".venv/bin/python").string();
  }
  bool no_reference = false;
  app.add_option("--reference", c.reference, "the float64 reference script")->capture_default_str();
  app.add_option("--python", c.python, "python interpreter (with torch) for --reference")
      ->capture_default_str();
  app.add_flag("--no-reference", no_reference, "skip the comparison with the reference");
  app.add_option("--collective-timeout", c.collective_timeout_s, "Gloo timeout, seconds");
  app.add_option("--deadline", c.deadline_s, "parent-side deadline, seconds");
  app.add_option("--muon-weight-decay", c.muon_wd, "Muon (cautious) weight decay");
  app.add_flag("--keep", c.keep, "keep the reference inputs/outputs");
  app.add_flag("--bf16", c.bf16,
               "orthogonalize in bfloat16 (Muon reference tolerance 1.5e-3*sqrt(step))");
  app.add_flag("--bf16-mixed", c.mixed,
               "bf16-mixed: bfloat16 parameters and gradients, float32 masters in the optimizers "
               "(compared with the reference; every parameter must be its master's cast)");
  app.add_option("--rendezvous-timeout", c.rendezvous_timeout_s, "store/rendezvous timeout, s");
  app.add_option("--tensor-parallel", c.tp,
                 "ranks per tensor-parallel group: DistMuon matrices held in parts (divides "
                 "--world)")
      ->check(CLI::Range(1u, 64u));
  int expect_sharded = -1;
  app.add_option("--expect-adam-sharded", expect_sharded,
                 "fail unless DistAdamW shards this many parameters");
  std::string inject_nan, inject_crash;
  int bad_rendezvous = -1;
  app.add_option("--inject-nan", inject_nan,
                 "RANK:STEP: that rank sets exp_avg[5] of a norm weight to NaN after that step");
  app.add_option("--inject-crash", inject_crash, "RANK:STEP: that rank aborts at that step");
  app.add_option("--inject-rendezvous-failure", bad_rendezvous,
                 "RANK: that rank joins under another store prefix");
  CLI11_PARSE(app, argc, argv);
  if (no_reference) c.reference.clear();
  for (auto [text, out, name] : {std::tuple{&inject_nan, &c.inject_nan, "--inject-nan"},
                                 std::tuple{&inject_crash, &c.inject_crash, "--inject-crash"}}) {
    if (text->empty()) continue;
    unsigned r = 0, s = 0;
    if (sscanf(text->c_str(), "%u:%u", &r, &s) != 2 || r >= c.world || s >= c.steps) {
      fprintf(stderr, "%s wants RANK:STEP within the world and the steps\n", name);
      return 2;
    }
    *out = std::pair<uint32_t, uint32_t>{r, s};
  }
  if (c.world % c.tp != 0 || (c.tp > 1 && c.break_mask)) {
    fprintf(stderr,
            "--tensor-parallel %u must divide --world %u (and is not run with "
            "--break-mask)\n",
            c.tp, c.world);
    return 2;
  }
  if (bad_rendezvous >= 0) c.inject_rendezvous_failure = static_cast<uint32_t>(bad_rendezvous);
  if (expect_sharded >= 0) c.expect_adam_sharded = expect_sharded;
  try {
    return megacpp::trainer::run(c);
  } catch (const std::exception& e) {
    fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
}
