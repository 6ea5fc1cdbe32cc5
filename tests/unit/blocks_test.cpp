// The chunked SSD scan (stages/trainer/ssd.h), the Mamba-2 block around it (mamba.h) and the
// gated linear recurrence (recurrent.h) against step-by-step recurrences, forward and backward;
// the mixture of experts (moe.h) against its dense reference; grouped-query attention against
// attention over repeated key/value heads; the hybrid model against the plan (recipes/plan.h)
// and the optimizer assignment. In
// float64 the two agree to rounding (1e-10 relative: they sum the same terms in another order); in
// float32 to 2e-4 relative, the rounding of the chunk products over 24-step chunks.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/torch.h>

#include "core/error.h"
#include "recipes/plan.h"
#include "recipes/recipe.h"
#include "stages/trainer/mamba.h"
#include "stages/trainer/model.h"
#include "stages/trainer/moe.h"
#include "stages/trainer/recurrent.h"
#include "stages/trainer/rendezvous.h"
#include "stages/trainer/ssd.h"
#include "stages/trainer/tensor_parallel.h"
#include "stages/trainer/train_step.h"
#include "tests/unit/test_support.h"

namespace megacpp::trainer {
namespace {

struct Inputs {
  at::Tensor x, a, b, c, state;
};

Inputs make_inputs(int64_t B, int64_t L, int64_t H, int64_t P, int64_t N, at::ScalarType dtype,
                   uint64_t seed, bool with_state) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto opts = at::TensorOptions().dtype(dtype);
  Inputs in;
  in.x = at::randn({B, L, H, P}, gen, opts);
  // Log-decays as a Mamba-2 block makes them: -softplus(dt) * exp(A_log), dt and A moderate.
  in.a = -at::softplus(at::randn({B, L, H}, gen, opts)) * 0.5;
  in.b = at::randn({B, L, H, N}, gen, opts);
  in.c = at::randn({B, L, H, N}, gen, opts);
  if (with_state) in.state = at::randn({B, H, P, N}, gen, opts);
  for (auto* t : {&in.x, &in.a, &in.b, &in.c, &in.state})
    if (t->defined()) t->requires_grad_(true);
  return in;
}

double rel_err(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).abs().max().item<double>() / (want.abs().max().item<double>() + 1e-30);
}

// Each tensor of `got` against its twin in `want`, relative to the twin's largest magnitude.
void expect_all_close(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                      double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(rel_err(got[i], want[i]), tol) << "#" << i;
}

// Forward outputs and the gradients of a fixed random projection of both outputs.
struct ScanRun {
  at::Tensor y, final_state;
  std::vector<at::Tensor> grads;
};

ScanRun scan_run(const Inputs& in, bool chunked, int64_t chunk) {
  for (const at::Tensor* t : {&in.x, &in.a, &in.b, &in.c, &in.state})
    if (t->defined() && t->grad().defined()) t->mutable_grad().reset();
  const SsdResult r = chunked ? ssd_chunked(in.x, in.a, in.b, in.c, chunk, in.state)
                              : ssd_sequential(in.x, in.a, in.b, in.c, in.state);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
  const at::Tensor wy = at::randn(r.y.sizes(), gen, r.y.options().requires_grad(false));
  const at::Tensor ws =
      at::randn(r.final_state.sizes(), gen, r.final_state.options().requires_grad(false));
  ((r.y * wy).sum() + (r.final_state * ws).sum()).backward();
  ScanRun out{r.y.detach(), r.final_state.detach(), {}};
  for (const auto* t : {&in.x, &in.a, &in.b, &in.c, &in.state})
    if (t->defined()) out.grads.push_back(t->grad().clone());
  return out;
}

void expect_same(const ScanRun& got, const ScanRun& want, double tol) {
  EXPECT_LT(rel_err(got.y, want.y), tol);
  EXPECT_LT(rel_err(got.final_state, want.final_state), tol);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  const char* names[] = {"x", "a", "b", "c", "initial state"};
  for (size_t i = 0; i < got.grads.size(); ++i)
    EXPECT_LT(rel_err(got.grads[i], want.grads[i]), tol) << "gradient of " << names[i];
}

TEST(SsdScan, ChunkedMatchesSequentialInFloat64) {
  // 48 steps in chunks of 16 (exact), and of 20 (a padded tail), with and without a state.
  for (const int64_t chunk : {16, 20, 48, 64}) {
    for (const bool with_state : {false, true}) {
      const Inputs in = make_inputs(2, 48, 3, 4, 5, at::kDouble, 7, with_state);
      const ScanRun want = scan_run(in, false, 0);
      const ScanRun got = scan_run(in, true, chunk);
      SCOPED_TRACE(::testing::Message() << "chunk " << chunk << " state " << with_state);
      expect_same(got, want, 1e-10);
    }
  }
}

TEST(SsdScan, ChunkedMatchesSequentialInFloat32) {
  const Inputs in = make_inputs(2, 96, 4, 8, 16, at::kFloat, 11, true);
  expect_same(scan_run(in, true, 24), scan_run(in, false, 0), 2e-4);
}

TEST(SsdScan, FinalStateCarriesASplitSequence) {
  // Two halves, the second starting from the first's final state, equal the whole.
  const Inputs in = make_inputs(1, 40, 2, 3, 4, at::kDouble, 5, false);
  at::NoGradGuard no_grad;
  const SsdResult whole = ssd_chunked(in.x, in.a, in.b, in.c, 8);
  auto half = [&](const at::Tensor& t, int64_t i) { return t.narrow(1, i * 20, 20); };
  const SsdResult first =
      ssd_chunked(half(in.x, 0), half(in.a, 0), half(in.b, 0), half(in.c, 0), 8);
  const SsdResult second =
      ssd_chunked(half(in.x, 1), half(in.a, 1), half(in.b, 1), half(in.c, 1), 8, first.final_state);
  EXPECT_LT(rel_err(at::cat({first.y, second.y}, 1), whole.y), 1e-12);
  EXPECT_LT(rel_err(second.final_state, whole.final_state), 1e-12);
}

TEST(SsdScan, DiagonalScanMatchesTheSequentialRecurrence) {
  // h_t = exp(a_t) h_{t-1} + x_t per channel: the SSD recurrence with P = N = 1 and b = c = 1.
  for (const int64_t chunk : {4, 7, 16, 40}) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
    const at::Tensor x = at::randn({2, 37, 5}, gen, at::kDouble).requires_grad_();
    const at::Tensor a = (-at::softplus(at::randn({2, 37, 5}, gen, at::kDouble))).requires_grad_();
    const at::Tensor w = at::randn({2, 37, 5}, gen, at::kDouble);
    auto run = [&](bool diagonal) {
      x.mutable_grad().reset();
      a.mutable_grad().reset();
      const at::Tensor ones = at::ones({2, 37, 5, 1}, at::kDouble);
      const at::Tensor h = diagonal ? ssd_diagonal(x, a, chunk)
                                    : ssd_sequential(x.unsqueeze(-1), a, ones, ones).y.squeeze(-1);
      (h * w).sum().backward();
      return std::vector<at::Tensor>{h.detach(), x.grad().clone(), a.grad().clone()};
    };
    SCOPED_TRACE(::testing::Message() << "chunk " << chunk);
    expect_all_close(run(true), run(false), 1e-10);
  }
  EXPECT_THROW(ssd_diagonal(at::zeros({1, 4, 2}), at::zeros({1, 4, 3}), 2), Error);
}

TEST(SsdScan, ShapeMismatchesAreRefused) {
  const Inputs in = make_inputs(1, 8, 2, 3, 4, at::kFloat, 1, false);
  EXPECT_THROW(ssd_chunked(in.x, in.a.narrow(1, 0, 7), in.b, in.c, 4), Error);
  EXPECT_THROW(ssd_chunked(in.x, in.a, in.b, in.c.narrow(3, 0, 3), 4), Error);
  EXPECT_THROW(ssd_chunked(in.x, in.a, in.b, in.c, 0), Error);
  EXPECT_THROW(ssd_sequential(in.x, in.a, in.b, in.c, at::zeros({1, 2, 3, 5})), Error);
}

// ---- the Mamba-2 block ----------------------------------------------------------------

MambaConfig small_mamba() {
  MambaConfig c;
  c.d_model = 16;
  c.d_state = 8;
  c.head_dim = 8;
  c.expand = 2;
  c.conv_kernel = 4;
  c.chunk = 8;
  return c;
}

Mamba double_mamba(uint64_t seed) {
  Mamba m(small_mamba());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  m->initialise(gen, /*zero_out=*/false);
  m->to(at::kDouble);
  return m;
}

// A block's output and the gradients of its input and every parameter.

template <typename M>
std::vector<at::Tensor> module_run(M& m, const at::Tensor& x, bool sequential) {
  m->zero_grad();
  if (x.grad().defined()) x.mutable_grad().reset();
  const at::Tensor y = m->forward(x, sequential);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  (y * at::randn(y.sizes(), gen, y.options().requires_grad(false))).sum().backward();
  std::vector<at::Tensor> out{y.detach(), x.grad().clone()};
  for (const auto& p : m->parameters()) out.push_back(p.grad().clone());
  return out;
}

TEST(MambaBlock, ChunkedMatchesSequentialForwardAndBackward) {
  Mamba m = double_mamba(17);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
  // 21 steps: two chunks of 8 and a padded tail.
  const at::Tensor x = at::randn({2, 21, 16}, gen, at::kDouble).requires_grad_();
  const auto want = module_run(m, x, true);
  const auto got = module_run(m, x, false);
  expect_all_close(got, want, 1e-10);
  EXPECT_GT(want[0].abs().max().item<double>(), 0.0);
}

TEST(MambaBlock, IsCausal) {
  Mamba m = double_mamba(5);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  at::NoGradGuard no_grad;
  const at::Tensor x = at::randn({1, 20, 16}, gen, at::kDouble);
  at::Tensor changed = x.clone();
  changed.narrow(1, 12, 8).add_(at::randn({1, 8, 16}, gen, at::kDouble));
  const at::Tensor y = m->forward(x), y2 = m->forward(changed);
  EXPECT_LT((y.narrow(1, 0, 12) - y2.narrow(1, 0, 12)).abs().max().item<double>(), 1e-12);
  EXPECT_GT((y.narrow(1, 12, 8) - y2.narrow(1, 12, 8)).abs().max().item<double>(), 1e-6);
}

TEST(MambaBlock, ParametersAndTheirShapes) {
  const MambaConfig c = small_mamba();
  Mamba m(c);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& item : m->named_parameters()) shapes[item.key()] = item.value().sizes().vec();
  const int64_t H = c.n_heads(), I = c.d_inner(), N = c.d_state;
  EXPECT_EQ(H, 4);
  const std::map<std::string, std::vector<int64_t>> want = {
      {"in_proj.weight", {2 * I + 2 * N + H, c.d_model}},
      {"conv.weight", {I + 2 * N, 1, c.conv_kernel}},
      {"conv.bias", {I + 2 * N}},
      {"out_proj.weight", {c.d_model, I}},
      {"dt_bias", {H}},
      {"A_log", {H}},
      {"D", {H}},
      {"norm_weight", {I}}};
  EXPECT_EQ(shapes, want);
  MambaConfig bad = c;
  bad.head_dim = 5;
  EXPECT_THROW(bad.validate(), Error);
}

// ---- the recurrent (R) block ------------------------------------------------------------

Recurrent double_recurrent(uint64_t seed) {
  RecurrentConfig c;
  c.d_model = 12;
  c.width = 10;
  c.conv_kernel = 4;
  c.chunk = 8;
  Recurrent m(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  m->initialise(gen, /*zero_out=*/false);
  m->to(at::kDouble);
  return m;
}

TEST(RecurrentBlock, ChunkedMatchesTheStepLoopForwardAndBackward) {
  Recurrent m = double_recurrent(4);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const at::Tensor x = at::randn({3, 29, 12}, gen, at::kDouble).requires_grad_();
  const auto want = module_run(m, x, true);
  const auto got = module_run(m, x, false);
  expect_all_close(got, want, 1e-10);
}

TEST(RecurrentBlock, IsCausalAndCarriesStateAcrossTheSequence) {
  Recurrent m = double_recurrent(6);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(10);
  at::NoGradGuard no_grad;
  const at::Tensor x = at::randn({1, 24, 12}, gen, at::kDouble);
  at::Tensor later = x.clone();
  later.narrow(1, 16, 8).add_(1.0);
  at::Tensor earlier = x.clone();
  earlier.narrow(1, 0, 1).add_(1.0);  // the first step only
  const at::Tensor y = m->forward(x);
  EXPECT_LT((y.narrow(1, 0, 16) - m->forward(later).narrow(1, 0, 16)).abs().max().item<double>(),
            1e-12);
  // Step 0's input still moves the last step's output through the state (and not only through
  // the convolution's 4-step window).
  EXPECT_GT((y.narrow(1, 23, 1) - m->forward(earlier).narrow(1, 23, 1)).abs().max().item<double>(),
            1e-9);
}

// ---- the mixture of experts (E) ---------------------------------------------------------

recipe::MoeConfig small_moe(uint32_t shared) {
  return recipe::MoeConfig{.enabled = true,
                           .n_experts = 5,
                           .top_k = 2,
                           .expert_hidden = 6,
                           .shared_hidden = shared,
                           .aux_loss_coef = 0.01};
}

Moe double_moe(uint32_t shared, uint64_t seed) {
  Moe m(8, small_moe(shared));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.uniform_(-0.5, 0.5, gen);
  m->to(at::kDouble);
  return m;
}

TEST(MoeBlock, DroplessRoutingMatchesTheDenseReferenceForwardAndBackward) {
  for (const uint32_t shared : {0u, 4u}) {
    Moe m = double_moe(shared, 31);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(32);
    const at::Tensor x = at::randn({3, 7, 8}, gen, at::kDouble).requires_grad_();
    const at::Tensor w = at::randn({3, 7, 8}, gen, at::kDouble);
    auto run = [&](bool dense) {
      m->zero_grad();
      if (x.grad().defined()) x.mutable_grad().reset();
      const at::Tensor y = dense ? moe_reference(*m, x) : m->forward(x);
      (y * w).sum().backward();
      std::vector<at::Tensor> out{y.detach(), x.grad().clone()};
      for (const auto& item : m->named_parameters())
        out.push_back(item.value().grad().defined() ? item.value().grad().clone()
                                                    : at::zeros_like(item.value()));
      return out;
    };
    const auto want = run(true), got = run(false);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), 1e-12)
          << "shared " << shared << " #" << i;
    // 21 tokens x top-2 assignments, all counted.
    EXPECT_EQ(m->tokens_per_expert().sum().item<int64_t>(), 42);
  }
}

TEST(MoeBlock, AnExpertWithoutTokensGetsNoGradientAndTheAuxLossIsSwitchs) {
  Moe m = double_moe(0, 3);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  // Feature 0 of every token is 1 and expert 4's router row is -100 there (0 elsewhere): its
  // logit is -100 for every token, so it never makes the top 2.
  at::Tensor xc = at::randn({2, 5, 8}, gen, at::kDouble);
  xc.select(2, 0).fill_(1.0);
  {
    torch::NoGradGuard no_grad;
    m->router->weight.select(0, 4).fill_(0.0);
    m->router->weight.select(0, 4).select(0, 0).fill_(-100.0);
  }
  m->zero_grad();
  const at::Tensor y = m->forward(xc);
  (y.sum() + m->aux_loss()).backward();
  EXPECT_EQ(m->tokens_per_expert()[4].item<int64_t>(), 0);
  for (const auto& item : m->experts[4]->named_parameters())
    EXPECT_FALSE(item.value().grad().defined()) << item.key();
  for (const auto& item : m->experts[0]->named_parameters())
    EXPECT_TRUE(item.value().grad().defined()) << item.key();
  // aux = E * sum_e f_e * P_e, recomputed from the routing.
  torch::NoGradGuard no_grad;
  const at::Tensor flat = xc.reshape({-1, 8});
  const at::Tensor probs = at::softmax(m->router(flat), -1);
  const at::Tensor top = std::get<1>(probs.topk(2, -1)).reshape({-1});
  const at::Tensor f = at::bincount(top, {}, 5).to(at::kDouble) / 20.0;
  const double want = 5.0 * (f * probs.mean(0)).sum().item<double>();
  EXPECT_NEAR(m->aux_loss().item<double>(), want, 1e-12);
  EXPECT_THROW(
      Moe(8, recipe::MoeConfig{.enabled = true, .n_experts = 2, .top_k = 3, .expert_hidden = 4}),
      Error);
}

// ---- grouped-query attention (A) ---------------------------------------------------------

TEST(AttentionBlock, GroupedQueryHeadsEqualRepeatedKeyValueHeads) {
  ModelConfig c{
      .vocab_size = 32, .seq_len = 12, .d_model = 32, .n_layers = 1, .n_heads = 4, .mlp_mult = 2};
  c.n_kv_heads = 2;
  Attention attn(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : attn->parameters()) p.uniform_(-0.3, 0.3, gen);
  }
  attn->to(at::kDouble);
  EXPECT_EQ(attn->qkv->weight.size(0), (4 + 2 * 2) * 8);
  const at::Tensor x = at::randn({2, 12, 32}, gen, at::kDouble);
  const at::Tensor angles =
      at::outer(at::arange(12, at::kDouble), at::pow(500000.0, -at::arange(4, at::kDouble) / 4.0));
  const at::Tensor cos = angles.cos(), sin = angles.sin();
  at::NoGradGuard no_grad;
  const at::Tensor got = attn->forward(x, cos, sin);
  // Reference: split q/k/v, repeat each key/value head for its group, softmax attention by hand.
  const auto parts = attn->qkv(x).split_with_sizes({32, 16, 16}, -1);
  auto heads = [](const at::Tensor& t, int64_t h) { return t.view({2, 12, h, 8}).transpose(1, 2); };
  auto rope = [&](const at::Tensor& t) {
    const auto a = t.narrow(-1, 0, 4), b = t.narrow(-1, 4, 4);
    return at::cat({a * cos + b * sin, b * cos - a * sin}, -1);
  };
  auto norm = [](const at::Tensor& t) { return at::rms_norm(t, {8}, {}, 1e-6); };
  const at::Tensor q = rope(norm(heads(parts[0], 4)));
  const at::Tensor k = rope(norm(heads(parts[1], 2))).repeat_interleave(2, 1);
  const at::Tensor v = heads(parts[2], 2).repeat_interleave(2, 1);
  at::Tensor scores = at::matmul(q, k.transpose(-1, -2)) / std::sqrt(8.0);
  scores = scores.masked_fill(at::ones({12, 12}, at::kBool).triu(1), -INFINITY);
  const at::Tensor y = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({2, 12, 32});
  EXPECT_LT((got - attn->proj(y)).abs().max().item<double>(), 1e-12);
}

// ---- the hybrid model, the plan and the optimizer assignment -------------------------------

recipe::Recipe hybrid_recipe(const std::string& mode) {
  recipe::Recipe r = recipe::load(recipe::resolve("tiny-hybrid", MEGACPP_RECIPE_DIR));
  r.model.mode = mode;
  return recipe::rehash(std::move(r));
}

TEST(HybridModel, ParametersAreThePlansNamesAndShapes) {
  for (const std::string mode : {"author_dp", "nemo_native"}) {
    const recipe::Recipe r = hybrid_recipe(mode);
    Transformer model(r.model, 1);
    std::map<std::string, std::vector<int64_t>> got, want;
    for (const auto& item : model->named_parameters()) got[item.key()] = item.value().sizes().vec();
    const recipe::Plan plan = recipe::make_plan(r, {.ranks = 2});
    for (const auto& g : plan.globals) want[g.name] = g.shape;
    uint64_t total = 0;
    for (const auto& l : plan.layers) {
      for (const auto& p : l.params) want[fmt::format("blocks.{}.{}", l.index, p.name)] = p.shape;
      EXPECT_EQ(std::string(1, model->blocks[l.index]->as<Block>()->kind()),
                std::string(1, l.block));
    }
    for (const auto& p : model->parameters()) total += static_cast<uint64_t>(p.numel());
    EXPECT_EQ(got, want) << mode;
    EXPECT_EQ(total, plan.params_total) << mode;
  }
  // nemo_native runs R on the Mamba-family block.
  EXPECT_EQ(hybrid_recipe("author_dp").model.blocks, "AEMRAEMR");
  EXPECT_EQ(hybrid_recipe("nemo_native").model.blocks, "AEMMAEMM");
}

TEST(HybridModel, OptimizerAssignmentFollowsTheRules) {
  const recipe::Recipe r = hybrid_recipe("author_dp");
  TrainStep ts(r.model, r.train, 10);
  const auto params = ts.parameters();
  const auto assignment = ts.assignment();
  ASSERT_EQ(params.size(), assignment.size());
  const recipe::Plan plan = recipe::make_plan(r, {.ranks = 1});
  std::map<std::string, std::string> planned;
  for (const auto& g : plan.globals) planned[g.name] = g.optimizer + "." + g.group;
  for (const auto& l : plan.layers)
    for (const auto& p : l.params)
      planned[fmt::format("blocks.{}.{}", l.index, p.name)] = p.optimizer + "." + p.group;
  int experts = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, t] = params[i];
    const auto& a = assignment[i];
    EXPECT_EQ(a.optimizer + "." + a.group, planned.at(name)) << name;
    if (a.optimizer == "muon") {
      EXPECT_EQ(t.dim(), 2) << name << ": Muon takes 2-D matrices only";
    }
    if (name.find(".router.") != std::string::npos) {
      EXPECT_EQ(a.optimizer, "adamw") << name;
    }
    if (name.find(".experts.") != std::string::npos) {
      EXPECT_EQ(a.optimizer, "muon") << name;
      ++experts;
    }
    for (const char* scalar :
         {".A_log", ".D", ".dt_bias", ".conv.weight", ".lambda", "norm_weight"})
      if (name.ends_with(scalar)) {
        EXPECT_EQ(a.optimizer, "adamw") << name;
      }
  }
  EXPECT_EQ(experts, 2 * 4 * 2);  // 2 E layers x 4 experts x (fc, proj)
}

TEST(HybridModel, TrainsAndTheLossFalls) {
  recipe::Recipe r = hybrid_recipe("author_dp");
  r.model.seq_len = 32;
  r.train.batch_size = 8;
  r = recipe::rehash(std::move(r));
  TrainStep ts(r.model, r.train, 30);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  // A learnable language: each row counts modulo V from a random start.
  auto batch = [&] {
    const auto start = torch::randint(r.model.vocab_size, {8, 1}, gen, torch::kInt64);
    return (start + torch::arange(33, torch::kInt64).unsqueeze(0)).remainder(r.model.vocab_size);
  };
  std::vector<float> losses;
  for (uint32_t step = 1; step <= 30; ++step) {
    const StepTiming t = ts.step(batch(), step);
    losses.push_back(t.loss);
    EXPECT_GT(t.aux_loss, 0.0f);
    ASSERT_EQ(t.tokens_per_expert.size(), 2u);
    int64_t assigned = 0;
    for (int64_t n : t.tokens_per_expert[0]) assigned += n;
    EXPECT_EQ(assigned, 8 * 32 * 2);
  }
  EXPECT_LT(losses.back(), 0.5f * losses.front()) << losses.front() << " -> " << losses.back();
}

// Rank `rank` of a 2-rank Gloo group over the forked world's store, its keys under `prefix`.
c10::intrusive_ptr<c10d::Backend> connect_pair(uint16_t port, uint32_t rank,
                                               const std::string& prefix) {
  GlooOptions go;
  go.store_port = port;
  go.rank = rank;
  go.world = 2;
  go.store_timeout = std::chrono::seconds(20);
  go.collective_timeout = std::chrono::seconds(20);
  go.store_prefix = prefix;
  return connect_gloo(go);
}

// World 2 over Gloo: rank 1 trains on batches of one repeated token, so every token of its MoE
// layers takes the same route and at most top_k of the 4 experts receive tokens there, while
// rank 0's varied text reaches them all. The starved experts have no gradient on rank 1 (the
// rank-asymmetric case); both ranks must still end every step with bit-identical parameters.
int hybrid_rank(uint16_t port, uint32_t rank, const std::filesystem::path& out) {
  torch::set_num_threads(1);
  auto pg = connect_pair(port, rank, "blocks_test/");
  recipe::Recipe r = hybrid_recipe("author_dp");
  r.model.seq_len = 16;
  r.train.batch_size = 4;
  r = recipe::rehash(std::move(r));
  TrainStep ts(r.model, r.train, 6, pg);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
  int starved_steps = 0;
  for (uint32_t step = 1; step <= 6; ++step) {
    const at::Tensor batch = rank == 0
                                 ? torch::randint(r.model.vocab_size, {4, 17}, gen, torch::kInt64)
                                 : torch::full({4, 17}, 65, torch::kInt64);
    const StepTiming t = ts.step(batch, step);
    bool starved = false;
    for (const auto& layer : t.tokens_per_expert)
      for (int64_t n : layer) starved = starved || n == 0;
    starved_steps += starved ? 1 : 0;
  }
  std::ofstream f(out, std::ios::binary);
  for (const auto& [name, p] : ts.parameters()) {
    const at::Tensor c = p.detach().contiguous();
    f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  }
  f << "starved " << starved_steps;
  return f.good() ? 0 : 4;
}

TEST(HybridModel, RanksStayBitIdenticalWhenExpertsGetNoTokensOnOneRank) {
  const forked_world::ForkedWorld world(2, std::chrono::seconds(20));
  char tmpl[] = "/tmp/megacpp-blocks-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::filesystem::path dir(tmpl);
  const std::vector<int> status = test_support::run_ranks_within(
      world,
      [&](uint32_t rank) {
        return hybrid_rank(world.store_port(), rank, dir / fmt::format("rank{}", rank));
      },
      std::chrono::seconds(120));
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0) << "rank " << r;
  std::string files[2];
  for (int r = 0; r < 2; ++r) {
    std::ifstream f(dir / fmt::format("rank{}", r), std::ios::binary);
    files[r].assign(std::istreambuf_iterator<char>(f), {});
  }
  std::filesystem::remove_all(dir);
  ASSERT_FALSE(files[0].empty());
  // Rank 1 was starved at every step; rank 0's text reached every expert at some step.
  EXPECT_TRUE(files[1].ends_with("starved 6")) << files[1].substr(files[1].size() - 12);
  EXPECT_EQ(files[0].substr(0, files[0].rfind("starved")),
            files[1].substr(0, files[1].rfind("starved")))
      << "the ranks' parameters differ";
}

// nemo_native as code: the same tiny hybrid recipe (R on the Mamba block) trained by 2 ranks as
// one tensor-parallel group with sequence parallelism, and by 1 rank. Both ranks of the group
// report the batch's loss; it must equal the single rank's at every step within 2e-6 relative.
// The layouts compute the same sums in other orders (matrix products split over heads and hidden
// units, partial outputs added by an all-reduce): float32 rounding, measured at 2.0e-7 relative
// over 6 steps; a wrong slice, a missing gradient reduction or a double-counted loss moves the
// loss by 1e-3 or more.
// tiny-hybrid in nemo_native, short, with float32 orthogonalization: bfloat16 rounds every
// update to 8 significant bits, which would swamp the float32 differences the test bounds.
recipe::Recipe tp_recipe() {
  recipe::Recipe r = hybrid_recipe("nemo_native");
  r.model.seq_len = 32;
  r.train.batch_size = 4;
  r.train.optim.muon_bf16 = false;
  return recipe::rehash(std::move(r));
}

// Rows counting modulo V from a random start: learnable, so the loss falls within 6 steps.
at::Tensor counting_batch(at::Generator& gen, int64_t V) {
  const auto start = torch::randint(V, {4, 1}, gen, torch::kInt64);
  return (start + torch::arange(33, torch::kInt64).unsqueeze(0)).remainder(V);
}

int tp_rank(uint16_t port, uint32_t rank, const std::filesystem::path& out) {
  torch::set_num_threads(1);
  TensorParallel tp{.group = connect_pair(port, rank, "blocks_test_tp/"), .rank = rank, .size = 2};
  const recipe::Recipe r = tp_recipe();
  TrainStep ts(r.model, r.train, 6, /*pg=*/{}, at::kCPU, tp);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(55);  // the same batches on both ranks
  std::ofstream f(out);
  for (uint32_t step = 1; step <= 6; ++step) {
    const at::Tensor batch = counting_batch(gen, r.model.vocab_size);
    f << fmt::format("{:.9e}\n", ts.step(batch, step).loss);
  }
  return f.good() ? 0 : 4;
}

TEST(HybridModel, NemoNativeTensorParallelEqualsOneRank) {
  const recipe::Recipe r = tp_recipe();
  std::vector<double> want;
  {
    torch::set_num_threads(1);
    TrainStep ts(r.model, r.train, 6);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(55);
    for (uint32_t step = 1; step <= 6; ++step)
      want.push_back(ts.step(counting_batch(gen, r.model.vocab_size), step).loss);
  }
  const forked_world::ForkedWorld world(2, std::chrono::seconds(20));
  char tmpl[] = "/tmp/megacpp-tp-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::filesystem::path dir(tmpl);
  const std::vector<int> status = test_support::run_ranks_within(
      world,
      [&](uint32_t rank) {
        return tp_rank(world.store_port(), rank, dir / fmt::format("rank{}", rank));
      },
      std::chrono::seconds(120));
  for (int k = 0; k < 2; ++k)
    EXPECT_TRUE(WIFEXITED(status[k]) && WEXITSTATUS(status[k]) == 0) << "rank " << k;
  for (int k = 0; k < 2; ++k) {
    std::ifstream f(dir / fmt::format("rank{}", k));
    std::vector<double> got;
    for (double v; f >> v;) got.push_back(v);
    ASSERT_EQ(got.size(), want.size()) << "rank " << k;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, std::abs(got[i] - want[i]) / want[i]);
    EXPECT_LT(worst, 2e-6) << "rank " << k << ": step 1 " << got[0] << " vs " << want[0]
                           << ", step 6 " << got.back() << " vs " << want.back();
    std::printf("rank %d: worst relative loss difference to one rank over 6 steps: %.2e\n", k,
                worst);
  }
  EXPECT_LT(want.back(), want.front());
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------
// Activation recomputation (train.recompute; model.h, recompute.h).

using recipe::Recompute;

constexpr Recompute kModes[] = {Recompute::kNone, Recompute::kSelective, Recompute::kFull};
const char* mode_name(Recompute m) {
  return m == Recompute::kNone ? "none" : m == Recompute::kSelective ? "selective" : "full";
}

// A toy model of the given blocks: two chunks of the scans per sequence, grouped-query heads,
// experts with a shared one.
ModelConfig recompute_config(const std::string& blocks) {
  ModelConfig c;
  c.vocab_size = 64;
  c.seq_len = 16;
  c.d_model = 32;
  c.n_layers = static_cast<uint32_t>(blocks.size());
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.mlp_mult = 2;
  c.moe = {.enabled = true, .n_experts = 4, .top_k = 2, .expert_hidden = 24, .shared_hidden = 16};
  c.ssm = {.d_state = 8, .head_dim = 8, .expand = 2, .conv_kernel = 4, .chunk = 8};
  c.rnn = {.width = 24, .conv_kernel = 4};
  c.blocks = blocks;
  return c;
}

// The model from `seed` with every parameter moved off its initial value (residual outputs
// start at zero, which would leave the mixers' gradients zero and the comparison empty).
Transformer perturbed_model(const ModelConfig& c, at::ScalarType dtype) {
  Transformer model(c, 7);
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  for (auto& p : model->parameters()) p.add_(at::randn(p.sizes(), gen) * 0.1);
  model->to(dtype);
  return model;
}

at::Tensor recompute_tokens(const ModelConfig& c, int64_t batch, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randint(c.vocab_size, {batch, int64_t{c.seq_len} + 1}, gen, torch::kInt64);
}

// The loss (cross-entropy + the MoE aux loss) and every parameter's gradient, in registration
// order (an undefined gradient as an empty tensor).
struct LossAndGrads {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
};

LossAndGrads loss_and_grads(Transformer& model, const at::Tensor& tokens, Recompute mode) {
  model->set_recompute(mode);
  model->zero_grad(/*set_to_none=*/true);
  const int64_t T = tokens.size(1) - 1, V = model->config().vocab_size;
  const at::Tensor logits = model->forward(tokens.narrow(1, 0, T));
  at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, V}).to(at::kFloat),
                                                         tokens.narrow(1, 1, T).reshape({-1}));
  if (const at::Tensor aux = model->aux_loss(); aux.defined()) loss = loss + aux;
  loss.backward();
  LossAndGrads out{loss.detach(), {}};
  for (const auto& p : model->parameters())
    out.grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return out;
}

void expect_bit_identical(const LossAndGrads& got, const LossAndGrads& want,
                          const std::string& what) {
  EXPECT_TRUE(torch::equal(got.loss, want.loss))
      << what << ": loss " << got.loss.item<double>() << " vs " << want.loss.item<double>();
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i) {
    ASSERT_EQ(got.grads[i].defined(), want.grads[i].defined()) << what << ": gradient #" << i;
    if (!want.grads[i].defined()) continue;
    EXPECT_TRUE(torch::equal(got.grads[i], want.grads[i]))
        << what << ": gradient #" << i << " differs by "
        << (got.grads[i].to(at::kDouble) - want.grads[i].to(at::kDouble))
               .abs()
               .max()
               .item<double>();
  }
}

// Selective and full run the same ops on the same values: losses and every parameter's gradient
// equal none's bit for bit, per block family and for a hybrid, in float32 and in bfloat16.
TEST(Recompute, EveryBlockFamilyEqualsNoneBitForBit) {
  for (const std::string blocks : {"A", "E", "F", "M", "R", "AEMR"}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const ModelConfig c = recompute_config(blocks + blocks);
      Transformer model = perturbed_model(c, dtype);
      const at::Tensor tokens = recompute_tokens(c, 3, 11);
      const LossAndGrads none = loss_and_grads(model, tokens, Recompute::kNone);
      int nonzero = 0;
      for (const at::Tensor& g : none.grads)
        nonzero += g.defined() && g.abs().max().item<double>() > 0;
      EXPECT_EQ(nonzero, static_cast<int>(none.grads.size())) << blocks;
      for (const Recompute mode : {Recompute::kSelective, Recompute::kFull}) {
        expect_bit_identical(
            loss_and_grads(model, tokens, mode), none,
            fmt::format("{} {} {}", blocks, c10::toString(dtype), mode_name(mode)));
      }
    }
  }
}

// Counts the CPU allocator's bytes allocated and freed on this thread while it is installed
// (c10's memory reporting: the profiler's hook, called by the default CPU allocator).
struct AllocationCounter : c10::MemoryReportingInfoBase {
  int64_t current = 0;
  int64_t peak = 0;
  void reportMemoryUsage(void*, int64_t bytes, size_t, size_t, c10::Device device) override {
    if (!device.is_cpu()) return;
    current += bytes;
    peak = std::max(peak, current);
  }
  bool memoryProfilingEnabled() const override { return true; }
};

struct MemoryKept {
  int64_t after_forward = 0;  // bytes allocated in forward and still held when backward starts
  int64_t peak = 0;           // the highest held over forward and backward
};

MemoryKept measure(Transformer& model, const at::Tensor& tokens, Recompute mode) {
  model->set_recompute(mode);
  model->zero_grad(true);
  const int64_t T = tokens.size(1) - 1, V = model->config().vocab_size;
  const auto counter = std::make_shared<AllocationCounter>();
  MemoryKept out;
  {
    c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, counter);
    at::Tensor loss = torch::nn::functional::cross_entropy(
        model->forward(tokens.narrow(1, 0, T)).reshape({-1, V}),
        tokens.narrow(1, 1, T).reshape({-1}));
    if (const at::Tensor aux = model->aux_loss(); aux.defined()) loss = loss + aux;
    out.after_forward = counter->current;
    loss.backward();
  }
  out.peak = counter->peak;
  return out;
}

// What recomputation is for: the activations held between forward and backward. A hybrid of
// every family at d_model 64 and 64 positions: full keeps each block's input, selective every
// product's output, none everything autograd saves.
TEST(Recompute, KeepsLessBetweenForwardAndBackward) {
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);  // the counter sees this thread's allocations
  ModelConfig c = recompute_config("AEMRAEMR");
  c.d_model = 64;
  c.seq_len = 64;
  c.rnn.width = 64;
  Transformer model = perturbed_model(c, at::kFloat);
  const at::Tensor tokens = recompute_tokens(c, 4, 12);
  std::map<Recompute, MemoryKept> kept;
  for (const Recompute mode : kModes) kept[mode] = measure(model, tokens, mode);
  torch::set_num_threads(threads);
  for (const Recompute mode : kModes)
    std::printf("recompute %-9s kept after forward %8.3f MiB, peak %8.3f MiB\n", mode_name(mode),
                static_cast<double>(kept[mode].after_forward) / (1 << 20),
                static_cast<double>(kept[mode].peak) / (1 << 20));
  EXPECT_LT(kept[Recompute::kFull].after_forward, kept[Recompute::kSelective].after_forward);
  EXPECT_LT(kept[Recompute::kSelective].after_forward, kept[Recompute::kNone].after_forward);
}

// nemo_native's tensor-parallel forward (2 ranks over Gloo, sequence parallel) with selective
// and full: every rank's loss and gradients equal its none run's bit for bit. The regions keep
// the collectives outside (recompute.h), so backward issues the same collectives.
int recompute_tp_rank(uint16_t port, uint32_t rank) {
  torch::set_num_threads(1);
  TensorParallel tp{
      .group = connect_pair(port, rank, "blocks_test_recompute/"), .rank = rank, .size = 2};
  ModelConfig c = recompute_config("AEMFAEMF");
  c.mode = std::string(recipe::kModeNemoNative);
  Transformer model = perturbed_model(c, at::kFloat);
  shard_model(*model, tp);
  const at::Tensor tokens = recompute_tokens(c, 2, 13);
  const int64_t T = c.seq_len, t = T / 2, V = c.vocab_size;
  std::vector<LossAndGrads> runs;
  for (const Recompute mode : kModes) {
    model->set_recompute(mode);
    model->zero_grad(true);
    const at::Tensor logits = forward_tensor_parallel(*model, tokens.narrow(1, 0, T), tp);
    at::Tensor loss = torch::nn::functional::cross_entropy(
                          logits.reshape({-1, V}), tokens.narrow(1, 1 + rank * t, t).reshape({-1}),
                          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                      static_cast<double>(tokens.size(0) * T);
    loss = loss + model->aux_loss() / 2.0;
    loss.backward();
    LossAndGrads r{loss.detach(), {}};
    for (const auto& p : model->parameters())
      r.grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    runs.push_back(std::move(r));
  }
  int failures = 0;
  for (size_t m = 1; m < runs.size(); ++m) {
    failures += !torch::equal(runs[m].loss, runs[0].loss);
    for (size_t i = 0; i < runs[0].grads.size(); ++i) {
      const at::Tensor& a = runs[m].grads[i];
      const at::Tensor& b = runs[0].grads[i];
      const bool same = a.defined() == b.defined() && (!a.defined() || torch::equal(a, b));
      if (!same)
        std::fprintf(stderr, "rank %u %s: gradient #%zu differs\n", rank, mode_name(kModes[m]), i);
      failures += !same;
    }
  }
  return failures == 0 ? 0 : 5;
}

TEST(Recompute, TensorParallelEqualsNoneBitForBit) {
  const forked_world::ForkedWorld world(2, std::chrono::seconds(20));
  const std::vector<int> status = test_support::run_ranks_within(
      world, [&](uint32_t rank) { return recompute_tp_rank(world.store_port(), rank); },
      std::chrono::seconds(120));
  for (int k = 0; k < 2; ++k)
    EXPECT_TRUE(WIFEXITED(status[k]) && WEXITSTATUS(status[k]) == 0)
        << "rank " << k << " status " << status[k];
}

// TrainStep applies train.recompute: a few steps of the hybrid with full and with selective
// recomputation give none's losses and parameters bit for bit.
TEST(Recompute, TrainStepEqualsNoneBitForBit) {
  recipe::Recipe r = hybrid_recipe("author_dp");
  r.model.seq_len = 16;
  r.train.batch_size = 2;
  r = recipe::rehash(std::move(r));
  const auto run = [&](const std::string& mode) {
    recipe::TrainConfig t = r.train;
    t.recompute = mode;
    TrainStep ts(r.model, t, 3);
    EXPECT_EQ(ts.model()->recompute(), recipe::recompute_mode(mode));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
    std::vector<float> losses;
    for (uint32_t step = 1; step <= 3; ++step)
      losses.push_back(
          ts.step(counting_batch(gen, r.model.vocab_size).narrow(0, 0, 2).narrow(1, 0, 17), step)
              .loss);
    std::vector<at::Tensor> params;
    for (const auto& [name, p] : ts.parameters()) params.push_back(p.detach().clone());
    return std::pair{losses, params};
  };
  const auto none = run("none");
  for (const std::string mode : {"selective", "full"}) {
    const auto got = run(mode);
    EXPECT_EQ(got.first, none.first) << mode;
    ASSERT_EQ(got.second.size(), none.second.size());
    for (size_t i = 0; i < got.second.size(); ++i)
      EXPECT_TRUE(torch::equal(got.second[i], none.second[i])) << mode << ": parameter #" << i;
  }
}

}  // namespace
}  // namespace megacpp::trainer

namespace megacpp::trainer {
namespace {

// The plan's activation estimate (recipes/plan.h) against what the model keeps: per block family
// and recomputation mode, tiny-hybrid's dimensions over 2 layers of one family, the bytes held
// when backward starts (the logits, the cross-entropy's and the blocks' saved tensors) against
// make_plan's activations for the same batch, within 15% for none and selective (measured
// 1.01-1.07). full is not compared: the plan counts the block inputs kept plus one block's
// working set in backward, the measurement only what forward kept.
TEST(Plan, ActivationsAreWhatTheModelKeeps) {
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  for (const std::string family : {"A", "F", "E", "M", "R"}) {
    // F: an E layer with MoE off.
    const std::string pattern = family == "F" ? "E" : family;
    recipe::Recipe r = hybrid_recipe("author_dp");
    r.pattern = pattern;
    r.layers.clear();
    r.model.n_layers = 2;
    r.model.seq_len = 64;
    r.train.batch_size = 4;
    r.model.moe.enabled = family == "E";
    r.model.blocks = recipe::expand_blocks(pattern, 2, "author_dp", r.model.moe.enabled);
    r = recipe::rehash(std::move(r));
    Transformer model = perturbed_model(r.model, at::kFloat);
    const at::Tensor tokens = recompute_tokens(r.model, 4, 12);
    for (const Recompute mode : kModes) {
      r.train.recompute = mode_name(mode);
      const recipe::Plan plan = recipe::make_plan(recipe::rehash(recipe::Recipe(r)), {.ranks = 1});
      const MemoryKept kept = measure(model, tokens, mode);
      std::printf(
          "%s %-9s kept %8.3f MiB peak %8.3f MiB plan %8.3f MiB ratio %.2f\n", family.c_str(),
          mode_name(mode), static_cast<double>(kept.after_forward) / (1 << 20),
          static_cast<double>(kept.peak) / (1 << 20),
          static_cast<double>(plan.memory.activations) / (1 << 20),
          static_cast<double>(kept.after_forward) / static_cast<double>(plan.memory.activations));
      if (mode != Recompute::kFull) {
        const double ratio =
            static_cast<double>(kept.after_forward) / static_cast<double>(plan.memory.activations);
        EXPECT_GT(ratio, 0.85) << family << " " << mode_name(mode);
        EXPECT_LT(ratio, 1.15) << family << " " << mode_name(mode);
      }
    }
  }
  torch::set_num_threads(threads);
}

// Each family's count per layer and token against the model's, one dimension changed at a time
// from tiny-hybrid's (d_model, Mamba's state, chunk, head size and conv kernel, the recurrence's
// width, the sequence, which also changes the recurrence's scan chunk): the bytes held when
// backward starts at 4 layers less those at 2, halved. Under full, a layer keeps its input.
TEST(Plan, ActivationsPerLayerFollowEachDimension) {
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  struct Dims {
    uint32_t d_model = 128, seq_len = 64, d_state = 16, chunk = 32, head_dim = 32, kernel = 4,
             width = 128;
  };
  const std::vector<Dims> all = {{},
                                 {.d_model = 64},
                                 {.seq_len = 256},
                                 {.d_state = 64},
                                 {.chunk = 8},
                                 {.head_dim = 16, .kernel = 8},
                                 {.width = 256},
                                 {.d_model = 64, .seq_len = 512, .chunk = 16, .width = 256}};
  for (const std::string family : {"A", "F", "E", "M", "R"}) {
    for (const Dims& d : all) {
      for (const Recompute mode : kModes) {
        std::array<double, 2> kept{};
        uint64_t planned = 0;
        for (const uint32_t layers : {2u, 4u}) {
          recipe::Recipe r = hybrid_recipe("author_dp");
          r.pattern = family == "F" ? "E" : family;
          r.layers.clear();
          r.model.n_layers = layers;
          r.model.d_model = d.d_model;
          r.model.seq_len = d.seq_len;
          r.model.ssm.d_state = d.d_state;
          r.model.ssm.chunk = d.chunk;
          r.model.ssm.head_dim = d.head_dim;
          r.model.ssm.conv_kernel = d.kernel;
          r.model.rnn.conv_kernel = d.kernel;
          r.model.rnn.width = d.width;
          r.model.moe.enabled = family == "E";
          r.model.blocks = recipe::expand_blocks(r.pattern, layers, "author_dp", family == "E");
          r.train.batch_size = 2;
          r.train.recompute = mode_name(mode);
          r = recipe::rehash(std::move(r));
          Transformer model = perturbed_model(r.model, at::kFloat);
          const at::Tensor tokens = recompute_tokens(r.model, 2, 12);
          kept[layers / 4] = static_cast<double>(measure(model, tokens, mode).after_forward);
          planned = recipe::make_plan(r, {.ranks = 1}).layers[0].activation_floats;
        }
        const double per_layer = (kept[1] - kept[0]) / 2 / (2.0 * d.seq_len) / sizeof(float);
        const double ratio = per_layer / static_cast<double>(planned);
        const std::string where = fmt::format(
            "{} {} d_model {} seq {} state {} chunk {} head {} kernel {} width {}: {:.1f} floats "
            "per token against {}",
            family, mode_name(mode), d.d_model, d.seq_len, d.d_state, d.chunk, d.head_dim, d.kernel,
            d.width, per_layer, planned);
        std::printf("%s ratio %.3f\n", where.c_str(), ratio);
        EXPECT_GT(ratio, 0.95) << where;
        EXPECT_LT(ratio, 1.05) << where;
      }
    }
  }
  torch::set_num_threads(threads);
}

}  // namespace
}  // namespace megacpp::trainer
