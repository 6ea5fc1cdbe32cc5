// megacpp::trainer: the model learns, snapshot shares are laid out and partitioned as the
// checkpointer expects, and two real processes over a real TCPStore + Gloo stay identical.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <capnp/message.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/store.h"
#include "core/error.h"
#include "core/util.h"
#include "data/sampler.h"
#include "data/shards.h"
#include "ipc/channel.h"
#include "ipc/shm.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"
#include "stages/trainer/collective.h"
#include "stages/trainer/optim.h"
#include "stages/trainer/rendezvous.h"
#include "stages/trainer/snapshot_plane.h"
#include "stages/trainer/step_profile.h"
#include "stages/trainer/train_step.h"
#include "tests/unit/test_support.h"

namespace megacpp::trainer {

using test_support::read_floats;
namespace {

namespace fs = std::filesystem;

ModelConfig tiny_model() {
  return ModelConfig{
      .vocab_size = 32, .seq_len = 16, .d_model = 32, .n_layers = 2, .n_heads = 2, .mlp_mult = 4};
}

// Optimizer hyperparameters: the recipe defaults (recipes/recipe.h OptimConfig), but for a
// small Muon weight decay so the cautious decay path runs.
TrainConfig tiny_train() {
  TrainConfig t{.batch_size = 8,
                .min_lr_ratio = 0.1,
                .warmup_steps = 5,
                .grad_clip = 1.0,
                .seed = 1234,
                .checkpoint_every = 0,
                .optim = {}};
  t.optim.muon_weight_decay = 0.01;
  return t;
}

// A learnable language: each row counts modulo V from a random start with a stride of 1
// or 3, so after two tokens the rest of the row is determined. int64 [B, T + 1].
at::Tensor make_batch(const ModelConfig& m, int64_t batch, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto start = torch::randint(m.vocab_size, {batch, 1}, gen, torch::kInt64);
  const auto stride = torch::randint(2, {batch, 1}, gen, torch::kInt64) * 2 + 1;
  const auto pos = torch::arange(int64_t{m.seq_len} + 1, torch::kInt64).unsqueeze(0);
  return (start + stride * pos).remainder(m.vocab_size).contiguous();
}

// Every parameter's bytes, concatenated in order.
std::vector<float> flat_parameters(const TrainStep& ts) {
  std::vector<float> out;
  for (const auto& [name, p] : ts.parameters()) {
    const auto c = p.detach().contiguous();
    out.insert(out.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return out;
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_F(TrainerTest, ParameterNamesAndShapes) {
  const ModelConfig m = tiny_model();
  TrainStep ts(m, tiny_train(), 10);
  std::vector<std::string> names;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, p] : ts.parameters()) {
    names.push_back(name);
    shapes[name] = p.sizes().vec();
    EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
  }
  const std::vector<std::string> expected = {"embed.weight",
                                             "blocks.0.attn.qkv.weight",
                                             "blocks.0.attn.proj.weight",
                                             "blocks.0.mlp.fc.weight",
                                             "blocks.0.mlp.proj.weight",
                                             "blocks.1.attn.qkv.weight",
                                             "blocks.1.attn.proj.weight",
                                             "blocks.1.mlp.fc.weight",
                                             "blocks.1.mlp.proj.weight",
                                             "head.weight"};
  EXPECT_EQ(names, expected);
  EXPECT_EQ(shapes["embed.weight"], (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(shapes["blocks.0.attn.qkv.weight"], (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(shapes["blocks.0.mlp.fc.weight"], (std::vector<int64_t>{128, 32}));
  EXPECT_EQ(shapes["blocks.0.mlp.proj.weight"], (std::vector<int64_t>{32, 128}));
  EXPECT_EQ(shapes["head.weight"], (std::vector<int64_t>{32, 32}));
}

TEST_F(TrainerTest, InitIsDeterministicPerSeed) {
  TrainStep a(tiny_model(), tiny_train(), 10);
  TrainStep b(tiny_model(), tiny_train(), 10);
  TrainConfig other = tiny_train();
  other.seed = 99;
  TrainStep c(tiny_model(), other, 10);
  EXPECT_EQ(flat_parameters(a), flat_parameters(b));
  EXPECT_NE(flat_parameters(a), flat_parameters(c));
}

TEST_F(TrainerTest, RejectsInvalidConfigAndBatches) {
  ModelConfig m = tiny_model();
  m.n_heads = 3;  // 32 % 3 != 0
  try {
    validate(m);
    FAIL() << "accepted dModel % nHeads != 0";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  }
  m = tiny_model();
  m.d_model = 6;
  m.n_heads = 2;  // head dim 3: RoPE needs pairs
  EXPECT_THROW(validate(m), Error);

  TrainStep ts(tiny_model(), tiny_train(), 10);
  EXPECT_THROW(ts.step(torch::zeros({8, 17}, torch::kInt32), 1), Error);
  EXPECT_THROW(ts.step(torch::zeros({8, 18}, torch::kInt64), 1), Error);  // T > seqLen
}

// MEGACPP_PROFILE_STEPS: FIRST:LAST with 1 <= FIRST <= LAST, else one line naming the knob.
TEST(StepProfileSteps, ParsesFirstColonLastAndRefusesTheRest) {
  EXPECT_FALSE(megacpp::trainer::parse_profile_steps(""));
  const auto r = megacpp::trainer::parse_profile_steps("6:10");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->first, 6u);
  EXPECT_EQ(r->last, 10u);
  EXPECT_EQ(megacpp::trainer::parse_profile_steps("3:3")->last, 3u);
  for (const char* bad : {"6", "0:3", "4:2", "a:b", " 6:10", "6:10:", "6:-1", ":4"}) {
    try {
      (void)megacpp::trainer::parse_profile_steps(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(std::string("MEGACPP_PROFILE_STEPS=") + bad),
                std::string::npos)
          << e.what();
    }
  }
}

// widen_batch into a caller's buffer (a device rank's page-locked one, reused every step) gives
// the same tensor as a fresh one and returns that buffer; a buffer of another shape or dtype
// is refused.
TEST_F(TrainerTest, WidenBatchIntoAGivenBuffer) {
  for (const uint32_t bytes : {2u, 4u}) {
    const recipe::BatchSpec spec{.batch = 3, .seq_len = 5, .token_bytes = bytes};
    std::vector<std::byte> slot(spec.slot_bytes());
    recipe::BatchHeader h;
    h.token_bytes = bytes;
    h.batch = spec.batch;
    h.row_tokens = static_cast<uint32_t>(spec.row_tokens());
    h.step = 7;
    std::memcpy(slot.data(), &h, sizeof h);
    for (uint64_t i = 0; i < spec.slot_tokens(); ++i) {
      const uint32_t t = static_cast<uint32_t>(bytes == 2 ? 65535 - i * 11 : 70000 + i * 13);
      std::memcpy(slot.data() + sizeof h + i * bytes, &t, bytes);  // little-endian low bytes
    }
    const at::Tensor fresh = widen_batch(slot, spec, 7);
    at::Tensor buffer = torch::full({3, 6}, -1, torch::kInt64);
    const at::Tensor into = widen_batch(slot, spec, 7, nullptr, buffer);
    EXPECT_EQ(into.data_ptr(), buffer.data_ptr());
    EXPECT_TRUE(torch::equal(fresh, buffer)) << bytes;
    EXPECT_EQ(fresh[2][5].item<int64_t>(), bytes == 2 ? 65535 - 17 * 11 : 70000 + 17 * 13);
    EXPECT_THROW(widen_batch(slot, spec, 7, nullptr, torch::zeros({3, 5}, torch::kInt64)), Error);
    EXPECT_THROW(widen_batch(slot, spec, 7, nullptr, torch::zeros({3, 6}, torch::kInt32)), Error);
  }
}

TEST_F(TrainerTest, LearningRateSchedule) {
  TrainConfig t = tiny_train();  // warmup 5, min ratio 0.1
  EXPECT_DOUBLE_EQ(lr_scale(t, 1, 40), 0.2);
  EXPECT_DOUBLE_EQ(lr_scale(t, 5, 40), 1.0);
  EXPECT_NEAR(lr_scale(t, 40, 40), 0.1, 1e-12);
  for (uint32_t s = 6; s <= 40; ++s) EXPECT_LT(lr_scale(t, s, 40), lr_scale(t, s - 1, 40)) << s;
  t.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(lr_scale(t, 0, 40), 1.0);
}

TEST_F(TrainerTest, OptimizerAssignment) {
  TrainStep ts(tiny_model(), tiny_train(), 10);
  std::map<std::string, ParamAssignment> by_name;
  for (const auto& a : ts.assignment()) by_name[a.name] = a;
  ASSERT_EQ(by_name.size(), ts.parameters().size());
  EXPECT_EQ(by_name["embed.weight"].optimizer, "adamw");
  EXPECT_EQ(by_name["embed.weight"].group, "embed");
  EXPECT_EQ(by_name["head.weight"].group, "head");
  EXPECT_FALSE(by_name["head.weight"].sharded);  // world 1: nothing to shard over
  for (int l = 0; l < 2; ++l) {
    const std::string b = fmt::format("blocks.{}.", l);
    EXPECT_EQ(by_name[b + "attn.qkv.weight"].optimizer, "muon");
    EXPECT_EQ(by_name[b + "attn.qkv.weight"].group, "qkv");
    for (const char* n : {"attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"}) {
      EXPECT_EQ(by_name[b + n].optimizer, "muon") << n;
      EXPECT_EQ(by_name[b + n].group, "matrices") << n;
    }
  }
  TrainConfig unsplit = tiny_train();
  unsplit.optim.qkv_split = false;
  TrainStep u(tiny_model(), unsplit, 10);
  for (const auto& a : u.assignment()) {
    if (a.optimizer != "muon") continue;
    EXPECT_EQ(a.group, "matrices") << a.name;
  }
}

TEST_F(TrainerTest, LossFallsOnALearnableSequence) {
  const ModelConfig m = tiny_model();
  const TrainConfig t = tiny_train();
  constexpr uint32_t kSteps = 40;
  TrainStep ts(m, t, kSteps);
  std::vector<float> losses;
  std::vector<schema::Phase> phases;
  int released = 0;
  StepHooks hooks{.on_phase = [&](schema::Phase p) { phases.push_back(p); },
                  .after_backward = [&] { ++released; },
                  .stop_requested = {},
                  .poison_gradients = {},
                  .before_update = {}};
  for (uint32_t step = 1; step <= kSteps; ++step) {
    const StepTiming r = ts.step(make_batch(m, t.batch_size, step), step, hooks);
    ASSERT_TRUE(std::isfinite(r.loss)) << step;
    EXPECT_GT(r.lr_scale, 0);
    EXPECT_GE(r.forward_seconds, 0);
    EXPECT_GE(r.optimizer_seconds, 0);
    losses.push_back(r.loss);
  }
  EXPECT_EQ(released, static_cast<int>(kSteps));
  ASSERT_EQ(phases.size(), 3 * kSteps);
  EXPECT_EQ(phases[0], schema::Phase::FORWARD);
  EXPECT_EQ(phases[1], schema::Phase::BACKWARD);
  EXPECT_EQ(phases[2], schema::Phase::OPTIMIZER);
  EXPECT_NEAR(losses.front(), std::log(32.0), 0.2);  // near-uniform start
  const float tail = (losses[35] + losses[36] + losses[37] + losses[38] + losses[39]) / 5;
  RecordProperty("first_loss", std::to_string(losses.front()));
  RecordProperty("tail_loss", std::to_string(tail));
  EXPECT_LT(tail, 0.5f * losses.front()) << "first " << losses.front() << " tail " << tail;
}

TEST_F(TrainerTest, SnapshotShareLayoutAndContents) {
  const ModelConfig m = tiny_model();
  const TrainConfig t = tiny_train();
  TrainStep ts(m, t, 10);
  const auto params = ts.parameters();
  const size_t P = params.size();

  // Before any update the layout already has its final shape (the region is sized once).
  const SnapshotLayout before = ts.snapshot_layout();
  for (uint32_t step = 1; step <= 3; ++step) ts.step(make_batch(m, t.batch_size, step), step);
  const SnapshotLayout layout = ts.snapshot_layout();
  ASSERT_EQ(before.entries.size(), layout.entries.size());
  EXPECT_EQ(before.total_bytes, layout.total_bytes);

  uint64_t end = 0;
  std::map<std::string, const SnapshotEntry*> by_name;
  for (size_t i = 0; i < layout.entries.size(); ++i) {
    const SnapshotEntry& e = layout.entries[i];
    EXPECT_EQ(e.offset % kSnapshotAlignment, 0u) << e.name;
    EXPECT_GE(e.offset, end) << e.name;  // in order, no overlap
    end = e.offset + e.bytes;
    EXPECT_EQ(before.entries[i].name, e.name);
    EXPECT_EQ(before.entries[i].offset, e.offset);
    EXPECT_TRUE(by_name.emplace(e.name, &e).second) << "duplicate " << e.name;
  }
  EXPECT_EQ(layout.total_bytes % kSnapshotAlignment, 0u);
  EXPECT_GE(layout.total_bytes, end);

  auto shape_of = [](const at::Tensor& p) {
    return std::vector<uint64_t>(p.sizes().begin(), p.sizes().end());
  };
  for (size_t i = 0; i < P; ++i) {
    const auto& [name, p] = params[i];
    const SnapshotEntry& model = layout.entries[i];
    EXPECT_EQ(model.name, "model." + name);
    EXPECT_EQ(model.dtype, "F32");
    EXPECT_EQ(model.bytes, static_cast<uint64_t>(p.numel()) * 4);
    EXPECT_EQ(model.shape, shape_of(p));
  }
  // World 1: AdamW state is replicated (whole parameter shape), Muon state is one shard per
  // stack holding every member.
  for (const char* name : {"embed.weight", "head.weight"}) {
    const std::string pre = fmt::format("optim.adamw.{}.", name);
    ASSERT_TRUE(by_name.count(pre + "exp_avg")) << pre;
    EXPECT_EQ(by_name[pre + "exp_avg"]->shape, by_name[fmt::format("model.{}", name)]->shape);
    EXPECT_EQ(by_name[pre + "exp_avg_sq"]->dtype, "F32");
    EXPECT_TRUE(by_name[pre + "step"]->shape.empty());
  }
  for (const char* g : {"optim.adamw.embed.lr", "optim.adamw.head.weight_decay",
                        "optim.muon.qkv.momentum", "optim.muon.matrices.lr"})
    EXPECT_TRUE(by_name.count(g)) << g;
  ASSERT_TRUE(by_name.count("optim.muon.qkv.96x32.momentum.shard0"));
  EXPECT_EQ(by_name["optim.muon.qkv.96x32.momentum.shard0"]->shape,
            (std::vector<uint64_t>{2, 96, 32}));
  EXPECT_EQ(by_name["optim.muon.matrices.32x128.second_momentum.shard0"]->shape,
            (std::vector<uint64_t>{2, 1, 128}));  // wide: per-column second moment
  EXPECT_EQ(by_name["optim.muon.matrices.128x32.second_momentum.shard0"]->shape,
            (std::vector<uint64_t>{2, 128, 1}));

  const auto meta = nlohmann::json::parse(ts.snapshot_metadata());
  EXPECT_EQ(meta["format"], "megacpp.snapshot.v1");
  EXPECT_EQ(meta["world"], 1);
  EXPECT_EQ(meta["muon_stacks"]["optim.muon.qkv.96x32"],
            (std::vector<std::string>{"blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"}));
  EXPECT_EQ(meta["muon_stacks"].size(), 4u);  // qkv + attn.proj, mlp.fc, mlp.proj shapes
  for (const auto& [name, e] : by_name) {
    if (!name.ends_with(".shard0")) continue;
    ASSERT_TRUE(meta["shards"].contains(name)) << name;
    EXPECT_EQ(meta["shards"][name]["offset"], 0);
    EXPECT_EQ(meta["shards"][name]["logical"], name.substr(0, name.size() - 7));
  }

  // Contents: the bytes at each offset are the live tensors.
  std::vector<std::byte> region(layout.total_bytes + 64);
  const auto base = reinterpret_cast<uintptr_t>(region.data());
  std::span<std::byte> aligned(region.data() + (64 - base % 64) % 64, layout.total_bytes);
  const SnapshotLayout copied = ts.copy_snapshot(aligned);
  ASSERT_EQ(copied.entries.size(), layout.entries.size());
  const auto share = ts.snapshot_share();
  ASSERT_EQ(share.size(), layout.entries.size());
  for (size_t i = 0; i < share.size(); ++i) {
    const auto src = share[i].second.contiguous();
    ASSERT_EQ(std::memcmp(aligned.data() + copied.entries[i].offset, src.data_ptr(),
                          copied.entries[i].bytes),
              0)
        << share[i].first;
  }
  float step_value = 0;
  std::memcpy(&step_value, aligned.data() + by_name["optim.adamw.embed.weight.step"]->offset, 4);
  EXPECT_EQ(step_value, 3.0f);
  for (const auto& [name, tensor] : share) {
    if (name == "optim.adamw.head.weight.exp_avg_sq" ||
        name == "optim.muon.matrices.32x32.momentum.shard0") {
      EXPECT_GT(tensor.abs().sum().item<double>(), 0.0) << name;  // real updates happened
    }
  }

  std::vector<std::byte> small(layout.total_bytes / 2);
  EXPECT_THROW(ts.copy_snapshot(small), Error);
}

// The trainer's snapshot: the copy started after step N runs while step N+1's forward and
// backward do, and step N+1 waits for it before its update; the region then holds step N's
// state exactly, though the state has moved on.
TEST_F(TrainerTest, AnOverlappedSnapshotCopyHoldsTheStateOfItsStep) {
  const ModelConfig m = tiny_model();
  const TrainConfig t = tiny_train();
  TrainStep ts(m, t, 10);
  ts.step(make_batch(m, t.batch_size, 1), 1);
  const SnapshotLayout layout = ts.snapshot_layout();
  std::vector<uint64_t> a(layout.total_bytes / 8 + 1), b(layout.total_bytes / 8 + 1);
  std::span<std::byte> inline_region(reinterpret_cast<std::byte*>(a.data()), layout.total_bytes);
  std::span<std::byte> overlapped(reinterpret_cast<std::byte*>(b.data()), layout.total_bytes);
  ts.copy_snapshot(inline_region);  // step 1's state

  SnapshotLayout started;
  SnapshotCopy copy = ts.start_snapshot_copy(overlapped, &started);
  int waits = 0;
  StepHooks hooks;
  std::vector<schema::Phase> phases;
  hooks.on_phase = [&](schema::Phase p) { phases.push_back(p); };
  hooks.before_update = [&] {
    // After backward, before the optimizer touches anything.
    EXPECT_EQ(phases.back(), schema::Phase::OPTIMIZER);
    copy.wait();
    EXPECT_TRUE(copy.ready());
    ++waits;
  };
  ts.step(make_batch(m, t.batch_size, 2), 2, hooks);
  EXPECT_EQ(waits, 1);
  ASSERT_EQ(started.entries.size(), layout.entries.size());
  EXPECT_EQ(started.total_bytes, layout.total_bytes);
  EXPECT_EQ(std::memcmp(inline_region.data(), overlapped.data(), layout.total_bytes), 0);
  ts.copy_snapshot(inline_region);  // step 2's state differs
  EXPECT_NE(std::memcmp(inline_region.data(), overlapped.data(), layout.total_bytes), 0);

  // A copy nobody waits for is joined by its destructor; a default one is ready.
  {
    SnapshotLayout l;
    SnapshotCopy dropped = ts.start_snapshot_copy(overlapped, &l);
  }
  EXPECT_EQ(std::memcmp(inline_region.data(), overlapped.data(), layout.total_bytes), 0);
  SnapshotCopy none;
  EXPECT_TRUE(none.ready());
  none.wait();
  std::vector<std::byte> small(layout.total_bytes / 2);
  SnapshotLayout l;
  EXPECT_THROW(ts.start_snapshot_copy(small, &l), Error);
}

// Writes `ts`'s share of `step` into `store` the way the checkpointer does: the staging bytes
// as laid out by copy_snapshot, with the rank's layout metadata.
void write_share(checkpoint::CheckpointStore& store, const TrainStep& ts, uint32_t step) {
  const SnapshotLayout layout = ts.snapshot_layout();
  std::vector<uint64_t> storage(layout.total_bytes / sizeof(uint64_t) + 1);
  std::span<std::byte> region(reinterpret_cast<std::byte*>(storage.data()), layout.total_bytes);
  ts.copy_snapshot(region);
  std::vector<checkpoint::TensorView> views;
  for (const auto& e : layout.entries)
    views.push_back({e.name, e.dtype, e.shape, region.data() + e.offset, e.bytes});
  store.write_rank(step, ts.world(), ts.rank(), views, ts.snapshot_metadata());
}

TEST_F(TrainerTest, RestoreFromACheckpointContinuesBitIdentically) {
  const ModelConfig m = tiny_model();
  const TrainConfig t = tiny_train();
  constexpr uint32_t kSteps = 7, kAt = 3;
  test_support::TempDir run;
  checkpoint::CheckpointStore store(run.path(), "run-1", "hash");

  TrainStep straight(m, t, kSteps);
  std::vector<float> losses;
  for (uint32_t step = 1; step <= kSteps; ++step) {
    const float loss = straight.step(make_batch(m, t.batch_size, step), step).loss;
    if (step > kAt) losses.push_back(loss);
    if (step == kAt) {
      write_share(store, straight, step);
      store.commit(step);
    }
  }

  const checkpoint::CheckpointReader ckpt(run.path() / "checkpoints" / "step_00000003");
  EXPECT_EQ(ckpt.step(), kAt);
  TrainStep resumed(m, TrainConfig{t}, kSteps);
  TrainStep fresh(m, t, kSteps);  // the same model without the checkpoint: the test can fail
  resumed.restore(ckpt);
  for (uint32_t step = kAt + 1; step <= kSteps; ++step) {
    const auto batch = make_batch(m, t.batch_size, step);
    const float loss = resumed.step(batch, step).loss;
    EXPECT_EQ(std::memcmp(&loss, &losses[step - kAt - 1], sizeof loss), 0)
        << "step " << step << ": " << loss << " vs " << losses[step - kAt - 1];
    if (step == kAt + 1) {
      EXPECT_NE(fresh.step(batch, step).loss, loss);
    }
  }
  const auto a = flat_parameters(straight), b = flat_parameters(resumed);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  // The optimizer state too: the next snapshot of both is byte for byte the same.
  const SnapshotLayout la = straight.snapshot_layout();
  std::vector<std::byte> sa(la.total_bytes), sb(la.total_bytes);
  straight.copy_snapshot(sa);
  resumed.copy_snapshot(sb);
  EXPECT_TRUE(sa == sb);
}

// Every block family at toy size (attention with grouped-query heads, experts, Mamba-2, the
// recurrence).
ModelConfig hybrid_model() {
  ModelConfig c{
      .vocab_size = 64, .seq_len = 16, .d_model = 32, .n_layers = 4, .n_heads = 4, .mlp_mult = 2};
  c.n_kv_heads = 2;
  c.moe = recipe::MoeConfig{.enabled = true,
                            .n_experts = 4,
                            .top_k = 2,
                            .expert_hidden = 16,
                            .shared_hidden = 16,
                            .aux_loss_coef = 0.01};
  c.ssm =
      recipe::SsmConfig{.d_state = 8, .head_dim = 16, .expand = 2, .conv_kernel = 4, .chunk = 8};
  c.rnn = recipe::RnnConfig{.width = 32, .conv_kernel = 4};
  c.blocks = "AEMR";
  return c;
}

// bf16-mixed: bfloat16 parameters, float32 masters in the optimizers' state (and so in every
// snapshot); a resume from a checkpoint continues bit for bit; the losses track the float32
// run's (tolerance: 2% relative per step over 12 steps of a model of every block family; what
// this measured is in the failure message).
TEST_F(TrainerTest, Bf16MixedResumesExactlyAndTracksFloat32) {
  const ModelConfig m = hybrid_model();
  const TrainConfig t32 = tiny_train();
  TrainConfig tb = t32;
  tb.precision = "bf16-mixed";
  constexpr uint32_t kSteps = 12, kAt = 5;
  test_support::TempDir run;
  checkpoint::CheckpointStore store(run.path(), "run-1", "hash");
  TrainStep f32(m, t32, kSteps), mixed(m, tb, kSteps);
  for (const auto& [name, p] : mixed.parameters())
    EXPECT_EQ(p.scalar_type(), at::kBFloat16) << name;
  int masters = 0;
  for (const auto& [name, t] : mixed.snapshot_share()) {
    if (name.ends_with(".master")) {
      ++masters;
      EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
    }
  }
  EXPECT_GT(masters, 0);
  std::vector<float> losses;
  double worst = 0;
  for (uint32_t step = 1; step <= kSteps; ++step) {
    const auto batch = make_batch(m, tb.batch_size, step);
    const float l32 = f32.step(batch, step).loss, lb = mixed.step(batch, step).loss;
    worst = std::max(worst, std::abs(static_cast<double>(lb) - l32) / l32);
    if (step > kAt) losses.push_back(lb);
    if (step == kAt) {
      write_share(store, mixed, step);
      store.commit(step);
    }
  }
  EXPECT_LE(worst, 0.02) << "largest relative loss difference to float32";
  EXPECT_GT(worst, 0.0) << "bf16-mixed computed in float32";

  TrainStep resumed(m, tb, kSteps);
  resumed.restore(checkpoint::CheckpointReader(run.path() / "checkpoints" / "step_00000005"));
  for (uint32_t step = kAt + 1; step <= kSteps; ++step) {
    const float loss = resumed.step(make_batch(m, tb.batch_size, step), step).loss;
    EXPECT_EQ(std::memcmp(&loss, &losses[step - kAt - 1], sizeof loss), 0)
        << "step " << step << ": " << loss << " vs " << losses[step - kAt - 1];
  }
  const SnapshotLayout la = mixed.snapshot_layout();
  std::vector<std::byte> sa(la.total_bytes), sb(la.total_bytes);
  mixed.copy_snapshot(sa);
  resumed.copy_snapshot(sb);
  EXPECT_TRUE(sa == sb);
}

TEST_F(TrainerTest, RestoreRefusesACheckpointOfAnotherModel) {
  const ModelConfig m = tiny_model();
  const TrainConfig t = tiny_train();
  test_support::TempDir run;
  checkpoint::CheckpointStore store(run.path(), "run-1", "hash");
  TrainStep ts(m, t, 4);
  write_share(store, ts, 1);
  store.commit(1);
  ModelConfig wider = m;
  wider.d_model = 64;
  TrainStep other(wider, t, 4);
  const checkpoint::CheckpointReader ckpt(run.path() / "checkpoints" / "step_00000001");
  try {
    other.restore(ckpt);
    FAIL() << "a checkpoint of another width was loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("this model needs"), std::string::npos) << e.what();
  }
}

TEST_F(TrainerTest, TensorEntriesFillTheMessage) {
  TrainStep ts(tiny_model(), tiny_train(), 10);
  const SnapshotLayout layout = ts.snapshot_layout();
  capnp::MallocMessageBuilder message;
  auto ready = message.initRoot<schema::SnapshotReady>();
  auto list = ready.initTensors(static_cast<uint32_t>(layout.entries.size()));
  fill_tensor_entries(layout, list);
  auto reader = ready.asReader().getTensors();
  ASSERT_EQ(reader.size(), layout.entries.size());
  for (uint32_t i = 0; i < reader.size(); ++i) {
    const auto& e = layout.entries[i];
    EXPECT_EQ(std::string(reader[i].getName().cStr()), e.name);
    EXPECT_EQ(std::string(reader[i].getDtype().cStr()), e.dtype);
    EXPECT_EQ(reader[i].getOffset(), e.offset);
    EXPECT_EQ(reader[i].getBytes(), e.bytes);
    ASSERT_EQ(reader[i].getShape().size(), e.shape.size());
    for (uint32_t d = 0; d < e.shape.size(); ++d) EXPECT_EQ(reader[i].getShape()[d], e.shape[d]);
  }
  EXPECT_THROW(fill_tensor_entries(layout, ready.initTensors(1)), Error);
}

// ---------------------------------------------------------------------------------------
// SnapshotPlane: the rank's side of the snapshot plane, against a ROUTER played by the test
// and against a real megacpp-checkpointer that is killed and relaunched.

using namespace std::chrono_literals;

using megacpp::test_support::TempDir;

std::string staging_prefix() {
  return fmt::format("/megacpp-trtest-{}-", ::getpid());
}

SnapshotPlaneOptions plane_options(const std::string& endpoint) {
  SnapshotPlaneOptions o;
  o.endpoint = endpoint;
  o.identity = "trainer-0";
  o.peer_name = "checkpointer-0";
  o.region_name = layout::staging_shm_name(staging_prefix(), 0);
  o.lease_timeout = 10s;
  o.commit_timeout = 10s;
  o.resend_interval = 100ms;
  return o;
}

struct Ready {
  uint32_t step = 0;
  bool final = false;
};
std::optional<Ready> receive_ready(ipc::Channel& router, std::chrono::milliseconds timeout) {
  auto msg = router.receive(timeout);
  if (!msg || !msg->root().isSnapshotReady()) return std::nullopt;
  EXPECT_EQ(msg->peer(), "trainer-0");
  auto r = msg->root().getSnapshotReady();
  return Ready{r.getStep(), r.getFinal()};
}

void send_ack(ipc::Channel& router, uint32_t step, bool ok, bool committed,
              const std::string& error = {}) {
  ipc::ControlMessageBuilder b;
  auto a = b.root().initSnapshotAck();
  a.setRank(0);
  a.setStep(step);
  a.setOk(ok);
  a.setCommitted(committed);
  if (!error.empty()) a.setError(error);
  ASSERT_TRUE(router.send_to("trainer-0", b.message()));
}

// Polls `plane` until `done()` (bounded).
template <typename Pred>
bool poll_until(SnapshotPlane& plane, Pred done) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  bool ok = false;  // `done` may consume what it looks at: evaluated once per round
  while (!(ok = done()) && std::chrono::steady_clock::now() < deadline) {
    plane.poll();
    std::this_thread::sleep_for(5ms);
  }
  return ok;
}

TEST_F(TrainerTest, SnapshotPlaneMatchesAcksByStepAndResendsWhatItNeeds) {
  TempDir sock;
  const std::string endpoint = "ipc://" + (sock.path() / "ck").string();
  ipc::ZmqContext zmq;
  ipc::Channel router(zmq, ipc::Channel::Kind::kRouter, endpoint);
  TrainStep ts(tiny_model(), tiny_train(), 10);
  {
    SnapshotPlane plane(zmq, ts, plane_options(endpoint));
    ASSERT_TRUE(plane.take(1, false));
    plane.settle();  // the copy is done and its SnapshotReady sent
    EXPECT_EQ(plane.leased(), 1u);
    auto r1 = receive_ready(router, 5s);
    ASSERT_TRUE(r1);
    EXPECT_EQ(r1->step, 1u);
    send_ack(router, 1, true, false);
    ASSERT_TRUE(poll_until(plane, [&] { return !plane.leased(); }));

    ASSERT_TRUE(plane.take(2, false));
    plane.settle();  // the copy is done and its SnapshotReady sent
    auto r2 = receive_ready(router, 5s);
    ASSERT_TRUE(r2);
    EXPECT_EQ(r2->step, 2u);
    // Stale acks of step 1 (a duplicate's answer, a failure report) leave the lease of step
    // 2 alone and do not fail the rank; the committed one is still news.
    send_ack(router, 1, false, false, "stale failure");
    send_ack(router, 1, true, true);
    ASSERT_TRUE(poll_until(plane, [&] { return plane.committed().has_value(); }));
    EXPECT_EQ(plane.committed(), 1u);
    EXPECT_EQ(plane.leased(), 2u);
    // Unacknowledged: poll() re-sends step 2.
    std::optional<Ready> again;
    ASSERT_TRUE(
        poll_until(plane, [&] { return (again = receive_ready(router, 0ms)).has_value(); }));
    EXPECT_EQ(again->step, 2u);
    EXPECT_GE(plane.resends(), 1u);
    EXPECT_EQ(plane.leased(), 2u);

    // take(3) waits for the lease of step 2, re-sending it; a failure report for step 2 (the
    // checkpointer goes down) is waited out; the ack that finally comes releases it.
    std::thread checkpointer([&] {
      std::optional<Ready> r;
      int seen = 0;
      while ((r = receive_ready(router, 5s)) && r->step == 2) {
        if (++seen == 1) send_ack(router, 2, false, false, "disk on fire");
        if (seen == 3) send_ack(router, 2, true, false);
      }
      ASSERT_TRUE(r);
      EXPECT_EQ(r->step, 3u);
      EXPECT_TRUE(r->final);
      send_ack(router, 3, true, false);
      // The final commit is needed: the rank re-sends until it comes.
      auto dup = receive_ready(router, 5s);
      ASSERT_TRUE(dup);
      EXPECT_EQ(dup->step, 3u);
      send_ack(router, 3, true, true);
    });
    const uint64_t before = plane.resends();
    bool took = false, committed = false;
    try {
      took = plane.take(3, true);
      committed = took && plane.wait_committed(3);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
    checkpointer.join();
    EXPECT_TRUE(took);
    EXPECT_TRUE(committed);
    EXPECT_EQ(plane.committed(), 3u);
    EXPECT_FALSE(plane.leased());
    EXPECT_GE(plane.resends(), before + 2);
  }
  EXPECT_TRUE(ipc::list_shm(staging_prefix()).empty());
}

TEST_F(TrainerTest, SnapshotPlaneWaitsAreBounded) {
  TempDir sock;
  const std::string endpoint = "ipc://" + (sock.path() / "ck").string();
  ipc::ZmqContext zmq;
  TrainStep ts(tiny_model(), tiny_train(), 10);
  SnapshotPlaneOptions o = plane_options(endpoint);  // nobody listens
  o.lease_timeout = 300ms;
  o.commit_timeout = 300ms;
  {
    SnapshotPlane plane(zmq, ts, o);
    ASSERT_TRUE(plane.take(1, false));
    plane.settle();  // the copy is done and its SnapshotReady sent
    try {
      plane.take(2, false);
      ADD_FAILURE() << "took a snapshot over a leased region";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
      EXPECT_NE(std::string(e.what()).find("step 1"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("re-sent"), std::string::npos) << e.what();
    }
    try {
      plane.wait_committed(1);
      ADD_FAILURE() << "no commit, yet wait_committed returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
    }
  }
  {
    bool stop = false;
    o.stop_requested = [&] { return stop; };
    SnapshotPlane plane(zmq, ts, o);
    ASSERT_TRUE(plane.take(1, true));
    plane.settle();  // the copy is done and its SnapshotReady sent
    stop = true;
    EXPECT_FALSE(plane.take(2, false));
    EXPECT_FALSE(plane.wait_committed(1));
  }
  EXPECT_TRUE(ipc::list_shm(staging_prefix()).empty());
}

// The stage executable next to this test binary (both land in the build's bin/).
fs::path sibling_executable(const std::string& name) {
  return fs::read_symlink("/proc/self/exe").parent_path() / name;
}

int wait_exit(pid_t pid, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ADD_FAILURE() << "child " << pid << " did not exit in time";
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  return status;
}

// DESIGN.md "Failure model as implemented" (restartable stages: the checkpointer): the checkpointer
// is SIGKILLed with this rank's final snapshot unhandled; a relaunch on the same endpoint gets it
// re-sent and commits it.
// A driver that cannot export a staging buffer (Error{kSystem} from make_staging): with
// staging_fallback the rank stages in the host region and says so; without, the error stands.
TEST_F(TrainerTest, AStagingBufferThatCannotBeMadeFallsBackToTheHostRegionWhenAllowed) {
  TempDir sock;
  const std::string endpoint = "ipc://" + (sock.path() / "ck").string();
  ipc::ZmqContext zmq;
  ipc::Channel router(zmq, ipc::Channel::Kind::kRouter, endpoint);
  TrainStep ts(tiny_model(), tiny_train(), 10);
  SnapshotPlaneOptions o = plane_options(endpoint);
  o.handle_socket = layout::staged_handle_socket(endpoint);
  o.make_staging = [](uint64_t) -> std::unique_ptr<StagingTarget> {
    MEGACPP_FAIL(ErrorKind::kSystem, "CUDA driver: cuMemCreate failed: out of memory");
  };
  {
    SnapshotPlane plane(zmq, ts, o);
    try {
      plane.take(1, false);
      ADD_FAILURE() << "a staging buffer that cannot be made was ignored";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kSystem);
    }
  }
  o.staging_fallback = true;
  SnapshotPlane plane(zmq, ts, o);
  ASSERT_TRUE(plane.take(1, false));
  plane.settle();  // the host copy is done and its SnapshotReady sent
  auto msg = router.receive(5000ms);
  ASSERT_TRUE(msg && msg->root().isSnapshotReady());
  auto ready = msg->root().getSnapshotReady();
  EXPECT_EQ(ready.getStep(), 1u);
  EXPECT_EQ(ready.getStagedGeneration(), 0u);  // the tensors lie in the host region
  EXPECT_GT(ready.getRegionBytes(), ts.snapshot_layout().total_bytes);
  EXPECT_EQ(plane.staged_device_bytes(), 0u);
}

// A run of one rank for a real checkpointer process: the launch contract names the checkpoint
// endpoint, the supervisor's control socket is bound, and spawn() starts the megacpp-checkpointer
// binary on it (rank 0, `generation`), its stderr appended to `log`.
struct CheckpointerRun {
  TempDir run, sock;
  const std::string control = "ipc://" + (sock.path() / "control").string();
  const std::string endpoint = "ipc://" + (sock.path() / "ck").string();
  const fs::path log = layout::log_path(run.path(), schema::StageKind::CHECKPOINTER, 0);
  ipc::ZmqContext zmq;
  ipc::Channel supervisor{zmq, ipc::Channel::Kind::kRouter, control};

  CheckpointerRun() {
    test_support::write_test_launch(run.path(), "run-trainer-test", control, endpoint, 1, "hash");
    fs::create_directories(layout::logs_dir(run.path()));
  }
  pid_t spawn(const fs::path& exe, uint32_t generation) const {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    std::vector<std::string> args = {
        exe.string(), "--run-dir",    run.path().string(),       "--rank",
        "0",          "--generation", std::to_string(generation)};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    EXPECT_EQ(::posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&actions);
    return pid;
  }
};

// Whether `file` (a rank's checkpoint file) holds `ts`'s share, byte for byte.
void expect_share_written(const fs::path& file, const TrainStep& ts) {
  const auto header = checkpoint::read_safetensors_header(file);
  const std::string bytes = read_file(file);
  const auto share = ts.snapshot_share();
  ASSERT_EQ(header.tensors.size(), share.size());
  for (size_t i = 0; i < share.size(); ++i) {
    const at::Tensor t = share[i].second.contiguous();
    ASSERT_EQ(header.tensors[i].name, share[i].first);
    EXPECT_EQ(std::memcmp(bytes.data() + 8 + header.header_bytes + header.tensors[i].begin,
                          t.data_ptr(), t.nbytes()),
              0)
        << share[i].first;
  }
}

// With `staged`, the rank stages in an exported buffer (the memfd stand-in of device memory):
// the relaunched checkpointer imports it again from the descriptor the rank re-sends.
void checkpointer_restart(bool staged) {
  const fs::path exe = sibling_executable("megacpp-checkpointer");
  ASSERT_TRUE(fs::exists(exe)) << exe << " is not built";
  CheckpointerRun ck;
  const fs::path& log = ck.log;
  auto spawn = [&](uint32_t generation) { return ck.spawn(exe, generation); };

  TrainStep ts(tiny_model(), tiny_train(), 2);
  SnapshotPlaneOptions o = plane_options(ck.endpoint);
  o.resend_interval = 200ms;
  if (staged) {
    o.handle_socket = layout::staged_handle_socket(ck.endpoint);
    o.make_staging = [](uint64_t bytes) { return make_memfd_staging(0, bytes); };
  }
  {
    SnapshotPlane plane(ck.zmq, ts, o);
    const pid_t first = spawn(0);
    ASSERT_GT(first, 0);
    ASSERT_TRUE(plane.take(1, false));
    EXPECT_TRUE(plane.wait_committed(1)) << read_file(log);  // world 1: one rank commits

    // The final snapshot reaches a checkpointer that never handles it.
    ::kill(first, SIGSTOP);
    ASSERT_TRUE(plane.take(2, true));
    plane.settle();  // the copy is done and its SnapshotReady sent
    std::this_thread::sleep_for(200ms);
    ::kill(first, SIGKILL);
    const int status = wait_exit(first, 10s);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;

    const uint64_t before = plane.resends();
    const pid_t second = spawn(1);
    ASSERT_GT(second, 0);
    EXPECT_TRUE(plane.wait_committed(2)) << read_file(log);
    EXPECT_GE(plane.resends(), before + 1);  // the first SnapshotReady died with `first`
    ::kill(second, SIGTERM);
    const int status2 = wait_exit(second, 20s);
    EXPECT_TRUE(WIFEXITED(status2) && WEXITSTATUS(status2) == 0) << status2 << "\n"
                                                                 << read_file(log);
  }
  const fs::path ckpts = layout::checkpoints_dir(ck.run.path());
  EXPECT_TRUE(fs::exists(ckpts / "step_00000001" / "rank_0.safetensors"));
  EXPECT_TRUE(fs::exists(ckpts / "step_00000002" / "checkpoint.json"));
  EXPECT_TRUE(fs::exists(ckpts / "step_00000002" / "rank_0.safetensors"));
  EXPECT_FALSE(fs::exists(ckpts / "step_00000002.tmp"));
  EXPECT_EQ(read_file(ckpts / "LATEST"), "step_00000002\n");
  EXPECT_TRUE(ipc::list_shm(staging_prefix()).empty());
  // What was written is the rank's share, byte for byte.
  expect_share_written(ckpts / "step_00000002" / "rank_0.safetensors", ts);
}

TEST_F(TrainerTest, SnapshotPlaneSurvivesACheckpointerRestart) {
  checkpointer_restart(false);
}

TEST_F(TrainerTest, AStagedSnapshotPlaneSurvivesACheckpointerRestart) {
  checkpointer_restart(true);
}

// A memfd staging buffer announced as device memory: a checkpointer cannot import it (no CUDA
// driver here; on a GPU, the driver refuses a memfd) — what a checkpointer whose device cannot
// map a rank's buffer sees.
class UnimportableStaging final : public StagingTarget {
 public:
  explicit UnimportableStaging(uint64_t bytes) : inner_(make_memfd_staging(0, bytes)) {
    info_ = inner_->info();
    info_.kind = std::string(ipc::kStagedCuda);
    info_.device = "0000:00:00.0";
  }
  uint64_t bytes() const override { return inner_->bytes(); }
  bool device() const override { return false; }
  void copy_async(std::span<const StagingPiece> pieces, uint64_t step) override {
    inner_->copy_async(pieces, step);
  }
  void order_after_copy() override { inner_->order_after_copy(); }
  void read_back(std::span<std::byte> dst) override { inner_->read_back(dst); }
  const ipc::StagedBufferInfo& info() const override { return info_; }
  int fd() const override { return inner_->fd(); }

 private:
  std::unique_ptr<StagingTarget> inner_;
  ipc::StagedBufferInfo info_;
};

// DESIGN.md "GPU lane (second part)": a checkpointer that cannot import a rank's buffer
// refuses it (SnapshotAck.stagingRefused) and stays up. A rank that may fall back reads the
// refused snapshot back into a host region and re-sends it — the step commits, byte for byte —
// and stages there from then on; a rank whose staging was forced fails, naming the knob.
TEST_F(TrainerTest, ARefusedStagingBufferMovesTheSnapshotToTheHostRegion) {
  const fs::path exe = sibling_executable("megacpp-checkpointer");
  ASSERT_TRUE(fs::exists(exe)) << exe << " is not built";
  CheckpointerRun ck;
  const fs::path& log = ck.log;
  const pid_t pid = ck.spawn(exe, 0);
  ASSERT_GT(pid, 0);

  TrainStep ts(tiny_model(), tiny_train(), 3);
  SnapshotPlaneOptions o = plane_options(ck.endpoint);
  o.resend_interval = 200ms;
  o.commit_timeout = 20s;
  o.handle_socket = layout::staged_handle_socket(ck.endpoint);
  o.make_staging = [](uint64_t bytes) { return std::make_unique<UnimportableStaging>(bytes); };
  {
    SnapshotPlane forced(ck.zmq, ts, o);
    ASSERT_TRUE(forced.take(1, true));
    try {
      forced.wait_committed(1);
      ADD_FAILURE() << "a refused buffer was ignored by a rank that may not fall back";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("MEGACPP_SNAPSHOT_STAGING"), std::string::npos)
          << e.what();
    }
  }
  o.staging_fallback = true;
  {
    SnapshotPlane plane(ck.zmq, ts, o);
    ASSERT_TRUE(plane.take(2, false));
    EXPECT_TRUE(plane.wait_committed(2)) << read_file(log);
    EXPECT_EQ(plane.staged_device_bytes(), 0u);
    // Read back from the buffer it was staged in: the share, byte for byte.
    expect_share_written(
        layout::checkpoints_dir(ck.run.path()) / "step_00000002" / "rank_0.safetensors", ts);
    // The next snapshot goes through the host region at once (no refusal, no re-send).
    ts.step(make_batch(tiny_model(), tiny_train().batch_size, 7), 3);
    const uint64_t resends = plane.resends();
    ASSERT_TRUE(plane.take(3, true));
    EXPECT_TRUE(plane.wait_committed(3)) << read_file(log);
    EXPECT_EQ(plane.resends(), resends);
  }
  ::kill(pid, SIGTERM);
  const int status = wait_exit(pid, 20s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << read_file(log);
  const std::string text = read_file(log);
  EXPECT_NE(text.find("cannot import rank 0's cuda staging buffer"), std::string::npos) << text;
  const fs::path ckpts = layout::checkpoints_dir(ck.run.path());
  EXPECT_FALSE(fs::exists(ckpts / "step_00000001"));
  EXPECT_TRUE(fs::exists(ckpts / "step_00000002" / "checkpoint.json"));
  EXPECT_EQ(read_file(ckpts / "LATEST"), "step_00000003\n");
  expect_share_written(ckpts / "step_00000003" / "rank_0.safetensors", ts);
  EXPECT_TRUE(ipc::list_shm(staging_prefix()).empty());
}

// ---------------------------------------------------------------------------------------
// World 2: two forked ranks, a TCPStore server in this process, ProcessGroupGloo.

constexpr uint32_t kWorldSteps = 6;

// Clipping is per rank (by the rank's own gradient norm) and bf16 orthogonalization rounds
// the averaged gradient's last bits differently from a joint batch's: both are off here so
// world 2 can be compared with one process on the joint batch.
TrainConfig world_train() {
  TrainConfig t = tiny_train();
  t.grad_clip = 0;
  t.optim.muon_bf16 = false;
  t.optim.adamw_crossover = 1024;  // embed and head (32 x 32) sharded
  return t;
}

uint64_t rank_batch_seed(uint32_t rank, uint32_t step) {
  return 1000 * (rank + 1) + step;
}

// Child body: returns the exit status. `shared_prefix` non-empty: the optimizers exchange
// through shared memory (outboxes under that shm prefix, slots of 4 KiB so a step's
// exchange streams through several), and the group must have set it up (else exit 6).
int run_rank_child(uint16_t port, uint32_t rank, const fs::path& out,
                   const std::string& shared_prefix = "") {
  try {
    torch::set_num_threads(1);
    GlooOptions go;
    go.store_port = port;
    go.rank = rank;
    go.world = 2;
    go.store_timeout = std::chrono::seconds(20);
    go.collective_timeout = std::chrono::seconds(20);
    go.store_prefix = shared_prefix.empty() ? "trainer_test/" : "trainer_test_shared/";
    go.peer_exchange_prefix = shared_prefix;
    go.peer_exchange_slot_bytes = 4096;
    auto pg = connect_gloo(go);
    if ((peer_exchange_of(pg) != nullptr) != !shared_prefix.empty()) return 6;
    const ModelConfig m = tiny_model();
    TrainStep ts(m, world_train(), kWorldSteps, pg);
    if (ts.rank() != rank || ts.world() != 2) return 3;
    // Rank 1 alone asks to stop at step 3: the agreement rides in the step's exchange and
    // both ranks read it there, at step 3 only.
    for (uint32_t step = 1; step <= kWorldSteps; ++step) {
      StepHooks hooks;
      hooks.stop_requested = [&] { return rank == 1 && step == 3; };
      const StepTiming t = ts.step(
          make_batch(m, world_train().batch_size, rank_batch_seed(rank, step)), step, hooks);
      if (!t.stop_agreed || *t.stop_agreed != (step == 3)) return 5;
    }
    nlohmann::json layout = {{"meta", nlohmann::json::parse(ts.snapshot_metadata())},
                             {"entries", nlohmann::json::array()},
                             {"sharded", nlohmann::json::object()}};
    for (const auto& e : ts.snapshot_layout().entries)
      layout["entries"].push_back({{"name", e.name}, {"shape", e.shape}});
    for (const auto& a : ts.assignment()) layout["sharded"][a.name] = a.sharded;
    std::ofstream(out.string() + ".json") << layout.dump();
    const auto flat = flat_parameters(ts);
    std::ofstream f(out, std::ios::binary);
    f.write(reinterpret_cast<const char*>(flat.data()),
            static_cast<std::streamsize>(flat.size() * sizeof(float)));
    return f.good() ? 0 : 4;
  } catch (const std::exception& e) {
    fprintf(stderr, "rank %u: %s\n", rank, e.what());
    return 2;
  }
}

// Child body of AbortEndsAWaitInAGlooCollective: rank 1 joins the group but never the
// collective; rank 0's all_reduce (or, with `p2p`, a receive from rank 1: the optimizers'
// exchanges wait on Gloo's send and receive works, which have no future) is ended by abort()
// from another thread (what the supervisor's AbortCollectives does), as a peer failure naming
// the abort, and a collective issued after it fails at once. Rank 1 leaves after 4 s: had the
// abort not ended the wait, its exit would, with Gloo's connection error, which names no abort.
//
// `wait` kShared: rank 0 waits in DistMuon's exchange through shared memory instead.
enum class AbortedWait { kCollective, kReceive, kShared };
int abort_child(uint16_t port, uint32_t rank, AbortedWait wait, const std::string& shm_prefix) {
  try {
    GlooOptions go;
    go.store_port = port;
    go.rank = rank;
    go.world = 2;
    go.store_timeout = std::chrono::seconds(20);
    go.collective_timeout = std::chrono::seconds(60);
    go.store_prefix = "abort_test/";
    if (wait == AbortedWait::kShared) go.peer_exchange_prefix = shm_prefix;
    auto pg = connect_gloo(go);
    if (wait == AbortedWait::kShared && peer_exchange_of(pg) == nullptr) return 14;
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(4));
      return 0;
    }
    at::Tensor w = torch::randn({8, 8});
    w.mutable_grad() = torch::randn({8, 8});
    DistMuon muon({MuonParamGroup{.params = {w}}}, pg);
    auto all_reduce = [&] {
      std::vector<at::Tensor> v{torch::ones({4})};
      if (wait == AbortedWait::kShared) {
        muon.step();
      } else if (wait == AbortedWait::kReceive) {
        run_collectives("recv", pg, [&] {
          return std::vector<c10::intrusive_ptr<c10d::Work>>{pg->recv(v, 1, 0)};
        });
      } else {
        run_collective("all_reduce", pg, [&] { return pg->allreduce(v); });
      }
    };
    std::thread aborter([pg] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      pg->abort();
    });
    int code = 0;
    try {
      all_reduce();
      code = 10;  // completed, though rank 1 never joined
    } catch (const Error& e) {
      const bool named = std::string(e.what()).find("aborted") != std::string::npos;
      if (e.kind() != ErrorKind::kPeerFailure || !named) {
        fprintf(stderr, "rank 0: %s\n", e.what());
        code = 11;
      }
    }
    aborter.join();
    try {
      all_reduce();
      if (code == 0) code = 12;
    } catch (const Error& e) {
      if (code == 0 && e.kind() != ErrorKind::kPeerFailure) code = 13;
    }
    return code;
  } catch (const std::exception& e) {
    fprintf(stderr, "rank %u: %s\n", rank, e.what());
    return 2;
  }
}

TEST_F(TrainerTest, AbortEndsAWaitInAGlooCollective) {
  const std::string shm_prefix = fmt::format("/megacpp-trainer-test-{}-xch-", ::getpid());
  for (const AbortedWait wait :
       {AbortedWait::kCollective, AbortedWait::kReceive, AbortedWait::kShared}) {
    const char* name = wait == AbortedWait::kCollective ? "all_reduce"
                       : wait == AbortedWait::kReceive  ? "receive"
                                                        : "shared-memory exchange";
    const forked_world::ForkedWorld world(2, std::chrono::seconds(20));
    const std::vector<int> status = test_support::run_ranks_within(
        world,
        [&](uint32_t rank) { return abort_child(world.store_port(), rank, wait, shm_prefix); },
        std::chrono::seconds(60));
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)
          << name << ": rank " << r << " status " << status[r];
    }
  }
  EXPECT_TRUE(ipc::list_shm(shm_prefix).empty()) << "outboxes are unlinked once attached";
}

// A backend that reports NCCL's error state as the watchdog leaves it: the check after a host
// read types it; a group without error state passes.
class ErrorStateBackend final : public c10d::Backend {
 public:
  ErrorStateBackend(std::string name, c10d::ErrorType error)
      : c10d::Backend(0, 2), name_(std::move(name)), error_(error) {}
  const std::string getBackendName() const override { return name_; }
  c10d::ErrorType getError() override { return error_; }

 private:
  std::string name_;
  c10d::ErrorType error_;
};

TEST(CollectiveTest, AnNcclGroupsErrorStateIsTypedAfterTheHostRead) {
  const auto kind_of = [](const std::string& backend, c10d::ErrorType error) {
    try {
      check_async_error("step 7", c10::make_intrusive<ErrorStateBackend>(backend, error));
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("step 7"), std::string::npos) << e.what();
      return std::optional<ErrorKind>(e.kind());
    }
    return std::optional<ErrorKind>();
  };
  EXPECT_EQ(kind_of("nccl", c10d::ErrorType::SUCCESS), std::nullopt);
  EXPECT_EQ(kind_of("nccl", c10d::ErrorType::TIMEOUT), ErrorKind::kTimeout);
  EXPECT_EQ(kind_of("nccl", c10d::ErrorType::COMM_ERROR), ErrorKind::kPeerFailure);
  EXPECT_EQ(kind_of("nccl", c10d::ErrorType::REMOTE_ERROR), ErrorKind::kPeerFailure);
  // Gloo keeps no error state (its getError throws): its waits throw themselves.
  EXPECT_EQ(kind_of("gloo", c10d::ErrorType::TIMEOUT), std::nullopt);
  EXPECT_NO_THROW(check_async_error("step 7", {}));
}

TEST(CollectiveTest, ForeignErrorsAreOneLine) {
  const c10::Error cuda(
      "CUDA error: an illegal memory access was encountered\nCUDA kernel "
      "errors might be asynchronously reported\n\nFor debugging consider "
      "passing CUDA_LAUNCH_BLOCKING=1 \n");
  EXPECT_EQ(exception_text(cuda),
            "CUDA error: an illegal memory access was encountered; CUDA kernel errors might be "
            "asynchronously reported; For debugging consider passing CUDA_LAUNCH_BLOCKING=1");
  EXPECT_EQ(exception_text(std::runtime_error("one line")), "one line");
}

// The same two-rank training with the optimizers' exchanges through shared memory (streamed
// through slots smaller than a step's messages) lands on the same bits as through Gloo.
TEST_F(TrainerTest, SharedMemoryExchangeMatchesGlooBitForBit) {
  const forked_world::ForkedWorld world(2, std::chrono::seconds(20));
  char tmpl[] = "/tmp/megacpp-trainer-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const fs::path dir(tmpl);
  const std::string shm_prefix = fmt::format("/megacpp-trainer-test-{}-xch-", ::getpid());
  for (const bool shared : {false, true}) {
    const std::vector<int> status = test_support::run_ranks_within(
        world,
        [&](uint32_t rank) {
          return run_rank_child(world.store_port(), rank,
                                dir / fmt::format("{}{}.bin", shared ? "shm" : "gloo", rank),
                                shared ? shm_prefix : std::string());
        },
        std::chrono::seconds(60));
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)
          << (shared ? "shared memory" : "Gloo") << ": rank " << r << " status " << status[r];
    }
  }
  for (int r = 0; r < 2; ++r) {
    const auto gloo = read_floats(dir / fmt::format("gloo{}.bin", r));
    const auto shm = read_floats(dir / fmt::format("shm{}.bin", r));
    ASSERT_FALSE(gloo.empty());
    ASSERT_EQ(gloo.size(), shm.size());
    EXPECT_EQ(std::memcmp(gloo.data(), shm.data(), gloo.size() * sizeof(float)), 0)
        << "rank " << r << ": the transports disagree";
  }
  fs::remove_all(dir);
  EXPECT_TRUE(ipc::list_shm(shm_prefix).empty());
}

TEST_F(TrainerTest, TwoRanksOverGlooStayBitIdentical) {
  const forked_world::ForkedWorld world(2, std::chrono::seconds(20));
  const uint16_t port = world.store_port();
  ASSERT_NE(port, 0);

  char tmpl[] = "/tmp/megacpp-trainer-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const fs::path dir(tmpl);

  const std::vector<int> status = test_support::run_ranks_within(
      world,
      [&](uint32_t rank) {
        return run_rank_child(port, rank, dir / fmt::format("rank{}.bin", rank));
      },
      std::chrono::seconds(60));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)
        << "rank " << r << " status " << status[r];
  }
  const auto p0 = read_floats(dir / "rank0.bin");
  const auto p1 = read_floats(dir / "rank1.bin");
  std::vector<nlohmann::json> layouts;
  for (int r = 0; r < 2; ++r) {
    std::ifstream f(dir / fmt::format("rank{}.bin.json", r));
    layouts.push_back(nlohmann::json::parse(f));
  }
  fs::remove_all(dir);

  // Snapshot shares: names unique across the ranks, model and replicated state on rank 0
  // only, and the shards of every sharded logical tensor tile it exactly.
  std::set<std::string> names;
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> rows;  // logical -> [lo, hi)
  std::map<std::string, int64_t> full_rows;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(layouts[r]["meta"]["rank"], r);
    EXPECT_EQ(layouts[r]["meta"]["world"], 2);
    for (const auto& e : layouts[r]["entries"]) {
      const std::string name = e["name"];
      EXPECT_TRUE(names.insert(name).second) << "duplicate across ranks: " << name;
      const bool shard = name.find(".shard") != std::string::npos;
      if (!shard) {
        EXPECT_EQ(r, 0) << name << " is replicated and must come from rank 0 only";
        continue;
      }
      EXPECT_TRUE(name.ends_with(fmt::format(".shard{}", r))) << name;
      const auto& m = layouts[r]["meta"]["shards"].at(name);
      const int64_t lo = m["offset"], n = e["shape"][0];
      rows[m["logical"]].push_back({lo, lo + n});
      full_rows[m["logical"]] = m["full_shape"][0];
    }
  }
  EXPECT_TRUE(layouts[0]["sharded"]["embed.weight"]) << "1024 elements, 32 rows: sharded";
  EXPECT_TRUE(layouts[0]["sharded"]["head.weight"]);
  EXPECT_TRUE(rows.count("optim.adamw.embed.weight.exp_avg"));
  EXPECT_TRUE(rows.count("optim.muon.qkv.96x32.momentum"));
  for (auto& [logical, spans] : rows) {
    std::sort(spans.begin(), spans.end());
    int64_t at = 0;
    for (const auto& [lo, hi] : spans) {
      EXPECT_EQ(lo, at) << logical;
      at = hi;
    }
    EXPECT_EQ(at, full_rows[logical]) << logical;
  }
  ASSERT_FALSE(p0.empty());
  ASSERT_EQ(p0.size(), p1.size());
  EXPECT_EQ(std::memcmp(p0.data(), p1.data(), p0.size() * sizeof(float)), 0) << "ranks diverged";
  EXPECT_TRUE(test_support::all_finite(p0)) << "bit-identical ranks, but not finite";

  // The averaged gradient is the gradient of both ranks' batches together: a single process
  // on the concatenated batch lands on (numerically almost) the same parameters, and far
  // from a single process that saw only rank 0's data.
  const ModelConfig m = tiny_model();
  TrainConfig big = world_train();
  big.batch_size *= 2;
  TrainStep joint(m, big, kWorldSteps);
  TrainStep alone(m, world_train(), kWorldSteps);
  for (uint32_t step = 1; step <= kWorldSteps; ++step) {
    const auto b0 = make_batch(m, world_train().batch_size, rank_batch_seed(0, step));
    const auto b1 = make_batch(m, world_train().batch_size, rank_batch_seed(1, step));
    joint.step(torch::cat({b0, b1}, 0), step);
    alone.step(b0, step);
  }
  // NaN when anything is non-finite: both bounds below then fail.
  const double joint_diff = test_support::mean_abs_diff(p0, flat_parameters(joint));
  const double alone_diff = test_support::mean_abs_diff(p0, flat_parameters(alone));
  RecordProperty("joint_mean_abs_diff", std::to_string(joint_diff));
  RecordProperty("alone_mean_abs_diff", std::to_string(alone_diff));
  EXPECT_LT(joint_diff, 1e-4);
  EXPECT_GT(alone_diff, 10 * joint_diff);
}

// A rank's share as the checkpointer receives it (the staging bytes and their layout), saved
// by a child process for the parent to commit: one CheckpointStore per run directory.
void save_share(const TrainStep& ts, const fs::path& out) {
  const SnapshotLayout layout = ts.snapshot_layout();
  std::vector<uint64_t> storage(layout.total_bytes / sizeof(uint64_t) + 1);
  std::span<std::byte> region(reinterpret_cast<std::byte*>(storage.data()), layout.total_bytes);
  ts.copy_snapshot(region);
  nlohmann::json j = {{"meta", ts.snapshot_metadata()}, {"entries", nlohmann::json::array()}};
  for (const auto& e : layout.entries)
    j["entries"].push_back({{"name", e.name},
                            {"dtype", e.dtype},
                            {"shape", e.shape},
                            {"offset", e.offset},
                            {"bytes", e.bytes}});
  std::ofstream(out.string() + ".json") << j.dump();
  std::ofstream(out, std::ios::binary)
      .write(reinterpret_cast<const char*>(region.data()),
             static_cast<std::streamsize>(region.size()));
}

void commit_shares(const fs::path& run_dir, uint32_t step, uint32_t world,
                   const std::function<fs::path(uint32_t)>& share_of) {
  checkpoint::CheckpointStore store(run_dir, "run-1", "hash");
  for (uint32_t r = 0; r < world; ++r) {
    const fs::path in = share_of(r);
    const auto j = nlohmann::json::parse(std::ifstream(in.string() + ".json"));
    std::ifstream f(in, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(f)),
                                  std::istreambuf_iterator<char>());
    std::vector<checkpoint::TensorView> views;
    for (const auto& e : j["entries"]) {
      views.push_back(
          {e["name"].get<std::string>(), e["dtype"].get<std::string>(),
           e["shape"].get<std::vector<uint64_t>>(),
           reinterpret_cast<const std::byte*>(bytes.data()) + e["offset"].get<uint64_t>(),
           e["bytes"].get<uint64_t>()});
    }
    store.write_rank(step, world, r, views, j["meta"].get<std::string>());
  }
  store.commit(step);
}

// Child body: joins a Gloo world of `world`, either trains kWorldSteps steps (from empty) or
// restores `from`, and saves its share to `out`. Returns the exit status.
int reshard_child(uint16_t port, uint32_t world, uint32_t rank, const fs::path& from,
                  const fs::path& out) {
  try {
    torch::set_num_threads(1);
    GlooOptions go;
    go.store_port = port;
    go.rank = rank;
    go.world = world;
    go.store_timeout = std::chrono::seconds(20);
    go.collective_timeout = std::chrono::seconds(20);
    go.store_prefix = fmt::format("reshard/w{}/", world);
    auto pg = connect_gloo(go);
    const ModelConfig m = tiny_model();
    TrainStep ts(m, world_train(), kWorldSteps, pg);
    if (from.empty()) {
      for (uint32_t step = 1; step <= kWorldSteps; ++step)
        ts.step(make_batch(m, world_train().batch_size, rank_batch_seed(rank, step)), step);
    } else {
      const checkpoint::CheckpointReader ckpt(from);
      ts.restore(ckpt);
    }
    save_share(ts, out);
    return 0;
  } catch (const std::exception& e) {
    fprintf(stderr, "rank %u of %u: %s\n", rank, world, e.what());
    return 2;
  }
}

// Two checkpoints hold the same training state: the same logical tensors (names, dtypes,
// shapes, Muon stack members) with the same bytes in every real row (a Muon stack's padding
// rows, which depend on the world size, excluded).
// `skip`: logical names left out of the comparison.
void expect_same_state(const checkpoint::CheckpointReader& x, const checkpoint::CheckpointReader& y,
                       const std::function<bool(const std::string&)>& skip = {}) {
  std::set<std::string> nx, ny;
  for (const auto& [name, t] : x.tensors())
    if (!skip || !skip(name)) nx.insert(name);
  for (const auto& [name, t] : y.tensors())
    if (!skip || !skip(name)) ny.insert(name);
  EXPECT_EQ(nx, ny);
  EXPECT_EQ(x.muon_stacks(), y.muon_stacks());
  size_t compared = 0;
  for (const auto& [name, t] : x.tensors()) {
    const checkpoint::StoredTensor* u = y.find(name);
    if (u == nullptr || !nx.contains(name)) continue;
    EXPECT_EQ(t.dtype, u->dtype) << name;
    // A Muon stack has a row per member, padded to a multiple of the world size.
    uint64_t rows = t.full_shape.empty() ? 1 : t.full_shape[0];
    const auto stack = x.muon_stacks().find(name.substr(0, name.rfind('.')));
    const bool padded = stack != x.muon_stacks().end();
    if (padded) rows = stack->second.size();
    const auto trailing = [&](const std::vector<uint64_t>& shape) {
      return padded ? std::vector<uint64_t>(shape.begin() + 1, shape.end()) : shape;
    };
    EXPECT_EQ(trailing(t.full_shape), trailing(u->full_shape)) << name;
    if (trailing(t.full_shape) != trailing(u->full_shape) || t.row_bytes != u->row_bytes) continue;
    std::vector<std::byte> bx(rows * t.row_bytes), by(rows * u->row_bytes);
    x.read_rows(t, 0, rows, bx);
    y.read_rows(*u, 0, rows, by);
    EXPECT_TRUE(bx == by) << name << " differs";
    ++compared;
  }
  EXPECT_EQ(compared, nx.size());
}

// Resharding is exact: world 2 trains and checkpoints; world 3 restores it (the Muon stacks
// and AdamW shards cut at other rows) and checkpoints again at once; world 1 restores that.
// All three checkpoints hold the same logical tensors byte for byte. (The e2e reshard test
// covers what follows: training on at another world changes reduction order, so its losses
// match within a tolerance.)
TEST_F(TrainerTest, RestoreReshardsOptimizerStateExactly) {
  test_support::TempDir tmp;
  const fs::path w2 = tmp.path() / "w2", w3 = tmp.path() / "w3", w1 = tmp.path() / "w1";
  const fs::path step_dir = fs::path("checkpoints") / layout::checkpoint_dir_name(kWorldSteps);
  auto share = [&](uint32_t world) {
    return [&, world](uint32_t r) { return tmp.path() / fmt::format("share-w{}-r{}", world, r); };
  };
  auto run_world = [&](uint32_t world, const fs::path& from) {
    const forked_world::ForkedWorld fw(world, std::chrono::seconds(20));
    ASSERT_NE(fw.store_port(), 0);
    const std::vector<int> status = test_support::run_ranks_within(
        fw,
        [&](uint32_t rank) {
          return reshard_child(fw.store_port(), world, rank, from, share(world)(rank));
        },
        std::chrono::seconds(60));
    for (uint32_t r = 0; r < world; ++r)
      ASSERT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)
          << "world " << world << " rank " << r << " status " << status[r];
  };

  run_world(2, {});
  commit_shares(w2, kWorldSteps, 2, share(2));
  run_world(3, w2 / step_dir);
  commit_shares(w3, kWorldSteps, 3, share(3));
  {
    TrainStep alone(tiny_model(), world_train(), kWorldSteps);
    alone.restore(checkpoint::CheckpointReader(w3 / step_dir));
    checkpoint::CheckpointStore store(w1, "run-1", "hash");
    write_share(store, alone, kWorldSteps);
    store.commit(kWorldSteps);
  }

  const checkpoint::CheckpointReader a(w2 / step_dir), b(w3 / step_dir), c(w1 / step_dir);
  ASSERT_EQ(a.world(), 2u);
  ASSERT_EQ(b.world(), 3u);
  ASSERT_EQ(c.world(), 1u);
  // The state is not trivial (a restore that loaded nothing would differ from it).
  const auto* m = a.find("optim.muon.qkv.96x32.momentum");
  ASSERT_NE(m, nullptr);
  std::vector<float> mom(m->full_shape[0] * m->row_bytes / sizeof(float));
  a.read_rows(*m, 0, m->full_shape[0], std::as_writable_bytes(std::span(mom)));
  EXPECT_GT(std::count_if(mom.begin(), mom.end(), [](float v) { return v != 0.0f; }), 0);
  {
    SCOPED_TRACE("world 2 -> 3");
    expect_same_state(a, b);
  }
  {
    SCOPED_TRACE("world 3 -> 1");
    expect_same_state(a, c);
  }
}

// Tensor-parallel weight shards (nemo_native, every block family it runs): each rank of a
// tensor-parallel group holds its slices of the block matrices, so a checkpoint holds them as
// blocks of rows and of columns from several ranks, and DistMuon's state as stacks of whole
// matrices over the job. A layout's `tp` x `dp` ranks train (or restore `from`) and save their
// shares.
ModelConfig nemo_model() {
  ModelConfig c = hybrid_model();
  c.blocks = "AEMF";
  c.mode = std::string(recipe::kModeNemoNative);
  return c;
}

// Rank `rank` of a layout of `tp` x `dp` forked ranks joins its groups over the store at `port`
// (keys under `prefix`): its tensor-parallel group, and with more than one group the
// data-parallel group across them and the job's; without tensor parallelism one data-parallel
// group of the world. Returns the data-parallel group (null for one) and the tensor-parallel
// layout as TrainStep takes them.
std::pair<c10::intrusive_ptr<c10d::Backend>, TensorParallel> join_layout(
    uint16_t port, uint32_t tp, uint32_t dp, uint32_t rank, const std::string& prefix) {
  const uint32_t world = tp * dp, tp_rank = rank % tp, dp_rank = rank / tp;
  const auto join = [&](uint32_t r, uint32_t w, const std::string& group) {
    GlooOptions go;
    go.store_port = port;
    go.rank = r;
    go.world = w;
    go.store_timeout = std::chrono::seconds(20);
    go.collective_timeout = std::chrono::seconds(20);
    go.store_prefix = fmt::format("{}/tp{}dp{}/{}/", prefix, tp, dp, group);
    return connect_gloo(go);
  };
  TensorParallel t{.rank = tp_rank, .size = tp};
  c10::intrusive_ptr<c10d::Backend> pg;
  if (tp > 1) {
    t.group = join(tp_rank, tp, fmt::format("tp{}", dp_rank));
    if (dp > 1) {
      pg = join(dp_rank, dp, fmt::format("dp{}", tp_rank));
      t.job = join(rank, world, "job");
    }
  } else if (world > 1) {
    pg = join(rank, world, "dp");
  }
  return {pg, t};
}

int tp_reshard_child(uint16_t port, uint32_t tp, uint32_t dp, uint32_t rank, const fs::path& from,
                     const fs::path& out) {
  try {
    torch::set_num_threads(1);
    const uint32_t dp_rank = rank / tp;
    auto [pg, t] = join_layout(port, tp, dp, rank, "tp_reshard");
    const ModelConfig m = nemo_model();
    TrainStep ts(m, world_train(), kWorldSteps, pg, at::kCPU, t);
    if (from.empty()) {
      for (uint32_t step = 1; step <= kWorldSteps; ++step)
        ts.step(make_batch(m, world_train().batch_size, rank_batch_seed(dp_rank, step)), step);
    } else {
      ts.restore(checkpoint::CheckpointReader(from));
    }
    save_share(ts, out);
    return 0;
  } catch (const std::exception& e) {
    fprintf(stderr, "rank %u of tp %u x dp %u: %s\n", rank, tp, dp, e.what());
    return 2;
  }
}

// Resharding across tensor-parallel degrees is exact: TP2 x DP2 trains and checkpoints, one
// rank (no tensor parallelism) restores it and checkpoints at once, TP2 restores that and
// checkpoints. The three hold the same logical tensors byte for byte (DistMuon's "master"
// entries — under tensor parallelism in float32 its whole copies of the matrices, equal to the
// parameters — exist in the tensor-parallel ones only), and the split matrices were stored in
// parts (blocks of rows and of columns) by several ranks.
TEST_F(TrainerTest, RestoreReshardsTensorParallelShardsExactly) {
  test_support::TempDir tmp;
  const fs::path a_dir = tmp.path() / "tp2dp2", b_dir = tmp.path() / "tp1",
                 c_dir = tmp.path() / "tp2";
  const fs::path step_dir = fs::path("checkpoints") / layout::checkpoint_dir_name(kWorldSteps);
  auto share = [&](const std::string& tag) {
    return [&, tag](uint32_t r) { return tmp.path() / fmt::format("share-{}-r{}", tag, r); };
  };
  auto run_layout = [&](uint32_t tp, uint32_t dp, const fs::path& from, const std::string& tag) {
    const uint32_t world = tp * dp;
    const forked_world::ForkedWorld fw(world, std::chrono::seconds(20));
    ASSERT_NE(fw.store_port(), 0);
    const std::vector<int> status = test_support::run_ranks_within(
        fw,
        [&](uint32_t rank) {
          return tp_reshard_child(fw.store_port(), tp, dp, rank, from, share(tag)(rank));
        },
        std::chrono::seconds(90));
    for (uint32_t r = 0; r < world; ++r)
      ASSERT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)
          << "tp " << tp << " dp " << dp << " rank " << r << " status " << status[r];
  };
  run_layout(2, 2, {}, "a");
  commit_shares(a_dir, kWorldSteps, 4, share("a"));
  {
    torch::set_num_threads(1);
    TrainStep alone(nemo_model(), world_train(), kWorldSteps);
    alone.restore(checkpoint::CheckpointReader(a_dir / step_dir));
    checkpoint::CheckpointStore store(b_dir, "run-1", "hash");
    write_share(store, alone, kWorldSteps);
    store.commit(kWorldSteps);
  }
  run_layout(2, 1, b_dir / step_dir, "c");
  commit_shares(c_dir, kWorldSteps, 2, share("c"));

  const checkpoint::CheckpointReader a(a_dir / step_dir), b(b_dir / step_dir), c(c_dir / step_dir);
  // Parts: the attention projection's columns and the MLP's rows from both ranks of a group.
  for (const char* name : {"model.blocks.0.attn.proj.weight", "model.blocks.0.mlp.fc.weight",
                           "model.blocks.2.mamba.in_proj.weight"}) {
    const checkpoint::StoredTensor* t = a.find(name);
    ASSERT_NE(t, nullptr) << name;
    std::set<uint32_t> ranks;
    for (const auto& p : t->pieces) ranks.insert(p.rank);
    EXPECT_EQ(ranks, (std::set<uint32_t>{0, 1})) << name;
  }
  EXPECT_TRUE(a.find("model.blocks.0.attn.proj.weight")->column_blocks);
  const auto masters = [](const std::string& name) { return name.ends_with(".master"); };
  {
    SCOPED_TRACE("tp2 x dp2 -> one rank");
    expect_same_state(a, b, masters);
  }
  {
    SCOPED_TRACE("one rank -> tp2");
    expect_same_state(a, c);
  }
}

// ---------------------------------------------------------------------------------------
// Held-out evaluation (README.md "Validation loss").

// Every byte a step reads or writes that lasts past it: the snapshot share (parameters, masters,
// optimizer moments and step counts).
std::vector<std::vector<std::byte>> state_bytes(const TrainStep& ts) {
  std::vector<std::vector<std::byte>> out;
  for (const auto& [name, t] : ts.snapshot_share()) {
    const auto c = t.contiguous();
    const auto* p = static_cast<const std::byte*>(c.data_ptr());
    out.emplace_back(p, p + c.nbytes());
  }
  return out;
}

// An evaluation changes nothing that trains: a TrainStep that evaluates after every step trains
// bit-identically to one that never does (losses, parameters, optimizer state), in float32 and
// bf16-mixed, with and without recomputation; evaluating twice gives the same sum; and the sum
// is the cross-entropy of the model's forward in the training precision.
TEST_F(TrainerTest, EvaluationChangesNothingThatTrains) {
  const ModelConfig m = hybrid_model();
  for (const auto& [precision, recompute] :
       {std::pair{"fp32", "none"}, {"bf16-mixed", "selective"}, {"fp32", "full"}}) {
    SCOPED_TRACE(fmt::format("{} recompute {}", precision, recompute));
    TrainConfig t = tiny_train();
    t.precision = precision;
    t.recompute = recompute;
    constexpr uint32_t kSteps = 4;
    TrainStep evaluating(m, t, kSteps), plain(m, t, kSteps);
    const at::Tensor held = make_batch(m, 5, 4242);  // a short last slot's 5 rows
    for (uint32_t step = 1; step <= kSteps; ++step) {
      const auto batch = make_batch(m, t.batch_size, step);
      const float a = evaluating.step(batch, step).loss, b = plain.step(batch, step).loss;
      EXPECT_EQ(a, b) << "step " << step;
      const auto first = evaluating.evaluate(held), again = evaluating.evaluate(held);
      EXPECT_EQ(first.loss_sum, again.loss_sum);
      EXPECT_EQ(first.tokens, 5.0 * m.seq_len);
      // The mean is the model's cross-entropy on the held-out rows.
      torch::NoGradGuard no_grad;
      const auto logits = evaluating.model()->forward(held.narrow(1, 0, m.seq_len));
      const double mean = torch::nn::functional::cross_entropy(
                              logits.reshape({-1, int64_t{m.vocab_size}}).to(at::kFloat),
                              held.narrow(1, 1, m.seq_len).reshape({-1}))
                              .item<double>();
      EXPECT_NEAR(first.loss_sum / first.tokens, mean, 1e-5 * mean);
      EXPECT_GT(mean, 0.5);
    }
    EXPECT_TRUE(state_bytes(evaluating) == state_bytes(plain));
  }
}

// One evaluation at one layout: `tp` x `dp` forked ranks join their groups, each scores its
// data rank's part of the val split (data::ValidationSampler slots, as the loader cuts them)
// and the job's sum is written to `out` (loss_sum, tokens).
int evaluation_child(uint16_t port, uint32_t tp, uint32_t dp, uint32_t rank, const fs::path& shard,
                     const fs::path& out) {
  try {
    torch::set_num_threads(1);
    const uint32_t dp_rank = rank / tp;
    auto [pg, t] = join_layout(port, tp, dp, rank, "eval");
    ModelConfig m = hybrid_model();
    if (tp > 1) {
      m.blocks = "AEMF";
      m.mode = std::string(recipe::kModeNemoNative);
    }
    TrainStep ts(m, world_train(), kWorldSteps, pg, at::kCPU, t);
    const data::Shard file(shard, data::ShardFormat::kLlmc);
    const data::Shard* files[] = {&file};
    const data::ValidationSampler sampler(
        files, {.seq_len = m.seq_len, .batch = 4, .data_ranks = dp, .windows = 50});
    std::vector<std::byte> slot(sampler.spec().slot_bytes());
    TrainStep::EvalSum mine;
    for (uint32_t k = 0; k < sampler.share().slots(dp_rank); ++k) {
      const size_t bytes = sampler.fill(dp_rank, k, k, slot);
      recipe::BatchSpec rows = sampler.spec();
      rows.batch = sampler.share().rows(dp_rank, k);
      const auto part = ts.evaluate(widen_batch(std::span(slot).first(bytes), rows, k));
      mine.loss_sum += part.loss_sum;
      mine.tokens += part.tokens;
    }
    const auto job = ts.sum_over_data_ranks(mine);
    const double sums[] = {job.loss_sum, job.tokens};
    write_file_atomic(out, std::string(reinterpret_cast<const char*>(sums), sizeof sums));
    return 0;
  } catch (const std::exception& e) {
    fprintf(stderr, "rank %u of tp %u x dp %u: %s\n", rank, tp, dp, e.what());
    return 2;
  }
}

// A validation loss is one number whatever the layout: the same 50 windows (not a multiple of
// 3 or 4, in slots of 4 rows, so parts and last slots are uneven) scored by 1, 2, 3 and 4 data
// ranks, and by tensor-parallel groups of 2 with 1 and 2 data ranks, give the same mean to float
// reduction order (every rank holds the same parameters; only which rank sums which tokens, and
// the order of the sums, change): relative difference at most 1e-6 (measured on AMD EPYC: at
// most 7e-9; float32 sums of other lengths), and every rank of a layout gets the same bits.
TEST_F(TrainerTest, ValidationLossIsTheSameAtEveryLayout) {
  test_support::TempDir tmp;
  const fs::path shard = tmp.path() / "val_000000.bin";
  {
    std::vector<uint32_t> tokens(4000);
    uint64_t s = 7;
    for (auto& x : tokens) x = static_cast<uint32_t>((s = s * 6364136223846793005ULL + 1) >> 58);
    data::write_llmc_shard(shard, tokens, data::TokenWidth::kU16);
  }
  std::map<std::pair<uint32_t, uint32_t>, double> mean;
  for (const auto& [tp, dp] :
       {std::pair{1u, 1u}, {1u, 2u}, {1u, 3u}, {1u, 4u}, {2u, 1u}, {2u, 2u}}) {
    SCOPED_TRACE(fmt::format("tp {} x dp {}", tp, dp));
    const uint32_t world = tp * dp;
    const forked_world::ForkedWorld fw(world, std::chrono::seconds(20));
    ASSERT_NE(fw.store_port(), 0);
    auto out = [&](uint32_t r) { return tmp.path() / fmt::format("tp{}dp{}-r{}", tp, dp, r); };
    const std::vector<int> status = test_support::run_ranks_within(
        fw,
        [&](uint32_t rank) {
          return evaluation_child(fw.store_port(), tp, dp, rank, shard, out(rank));
        },
        std::chrono::seconds(90));
    for (uint32_t r = 0; r < world; ++r)
      ASSERT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0) << "rank " << r;
    const std::string first = read_file(out(0));
    for (uint32_t r = 1; r < world; ++r) EXPECT_EQ(read_file(out(r)), first) << "rank " << r;
    double sums[2];
    std::memcpy(sums, first.data(), sizeof sums);
    EXPECT_EQ(sums[1], 50.0 * hybrid_model().seq_len);
    mean[{tp, dp}] = sums[0] / sums[1];
  }
  for (const auto& [layout, m] : mean) {
    const double base = mean[{layout.first, 1}];
    EXPECT_NEAR(m, base, 1e-6 * base) << "tp " << layout.first << " x dp " << layout.second;
    EXPECT_GT(m, 1.0);
  }
}

}  // namespace
}  // namespace megacpp::trainer
