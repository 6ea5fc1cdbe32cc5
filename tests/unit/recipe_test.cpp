#include "recipes/recipe.h"

#include <gtest/gtest.h>

#include <capnp/message.h>

#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "recipes/plan.h"

#include "core/error.h"

namespace mc = megacpp;

namespace {

const char* kBase = R"(
name = "t"
pattern = "A"
[model]
vocab_size = 256
seq_len = 32
d_model = 64
n_layers = 3
n_heads = 4
[train]
batch_size = 2
)";

std::string expect_invalid(const std::string& text) {
  try {
    mc::recipe::parse(text, "x.toml");
  } catch (const mc::Error& e) {
    EXPECT_EQ(e.kind(), mc::ErrorKind::kInvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << text;
  return {};
}

}  // namespace

TEST(Recipe, ParsesAndExpandsPattern) {
  auto r = mc::recipe::parse(kBase, "x.toml");
  EXPECT_EQ(r.name, "t");
  EXPECT_EQ(r.model.seq_len, 32u);
  EXPECT_EQ(r.layers, (std::vector<std::string>{"A", "A", "A"}));
  EXPECT_EQ(r.hash.size(), 16u);
  EXPECT_NE(mc::recipe::describe(r).find("3 layers"), std::string::npos);
}

TEST(Recipe, HashIgnoresPathButNotValues) {
  auto a = mc::recipe::parse(kBase, "a.toml");
  auto b = mc::recipe::parse(kBase, "elsewhere/b.toml");
  EXPECT_EQ(a.hash, b.hash);
  auto c = mc::recipe::parse(std::string(kBase) + "warmup_steps = 7\n", "a.toml");
  EXPECT_NE(a.hash, c.hash);
  auto d = mc::recipe::parse(std::string(kBase) + "[optim]\nmuon_lr = 0.05\n", "a.toml");
  EXPECT_NE(a.hash, d.hash);
  EXPECT_DOUBLE_EQ(d.train.optim.muon_lr, 0.05);
}

TEST(Recipe, RulesAreNamed) {
  EXPECT_NE(expect_invalid(std::string(kBase) + "bogus = 1\n").find("train.bogus: unknown key"),
            std::string::npos);
  std::string bad_heads = kBase;
  bad_heads.replace(bad_heads.find("n_heads = 4"), 11, "n_heads = 5");
  EXPECT_NE(expect_invalid(bad_heads).find("model.n_heads: must divide model.d_model"),
            std::string::npos);
  std::string zero_batch = kBase;
  zero_batch.replace(zero_batch.find("batch_size = 2"), 14, "batch_size = 0");
  EXPECT_NE(expect_invalid(zero_batch).find("zero-length work"), std::string::npos);
  std::string moe = kBase;
  moe.replace(moe.find("pattern = \"A\""), 13, "pattern = \"AE\"");
  EXPECT_EQ(mc::recipe::parse(moe, "x.toml").model.blocks, "AFA");  // E without MoE: dense MLP
  EXPECT_NE(expect_invalid("name = [").find("x.toml:1"), std::string::npos);
  EXPECT_NE(expect_invalid(std::string(kBase) + "lr = 0.1\n").find("train.lr: unknown key"),
            std::string::npos);
  EXPECT_NE(expect_invalid(std::string(kBase) + "[optim]\nmuon_orthogonalizer = \"svd\"\n")
                .find("optim.muon_orthogonalizer: must be"),
            std::string::npos);
  EXPECT_NE(expect_invalid(std::string(kBase) + "[optim]\nmuon_ns_steps = 6\n")
                .find("optim.muon_ns_steps"),
            std::string::npos);
  EXPECT_NE(expect_invalid(std::string(kBase) + "[optim]\nqkv_split = 1\n")
                .find("optim.qkv_split: must be a boolean"),
            std::string::npos);
  EXPECT_NE(expect_invalid(std::string(kBase) + "precision = \"bf16\"\n")
                .find("train.precision: must be \"fp32\" or \"bf16-mixed\""),
            std::string::npos);
  EXPECT_NE(expect_invalid(std::string(kBase) + "grad_reduce = \"bf16\"\n")
                .find("train.grad_reduce: must be \"fp32\", or \"bf16\" with"),
            std::string::npos);
  EXPECT_NE(expect_invalid(std::string(kBase) + "recompute = \"some\"\n")
                .find("train.recompute: must be"),
            std::string::npos);
  std::string wrong_type = kBase;
  wrong_type.replace(wrong_type.find("seq_len = 32"), 12, "seq_len = \"32\"");
  EXPECT_NE(expect_invalid(wrong_type).find("model.seq_len"), std::string::npos);
}

namespace {
std::string with(std::string text, const std::string& from, const std::string& to) {
  text.replace(text.find(from), from.size(), to);
  return text;
}
}  // namespace

TEST(Recipe, ZeroAndOverflowingDimensionsAreRefused) {
  EXPECT_NE(expect_invalid(with(kBase, "d_model = 64", "d_model = 0")).find("model.d_model"),
            std::string::npos);
  EXPECT_NE(expect_invalid(with(kBase, "n_heads = 4", "n_heads = 0")).find("model.n_heads"),
            std::string::npos);
  EXPECT_NE(expect_invalid(with(kBase, "n_layers = 3", "n_layers = 0")).find("model.n_layers"),
            std::string::npos);
  EXPECT_NE(
      expect_invalid(with(kBase, "n_layers = 3", "n_layers = 4294967295")).find("model.n_layers"),
      std::string::npos);
  EXPECT_NE(expect_invalid(with(kBase, "seq_len = 32", "seq_len = 1")).find("model.seq_len"),
            std::string::npos);
  EXPECT_NE(
      expect_invalid(with(kBase, "vocab_size = 256", "vocab_size = 0")).find("model.vocab_size"),
      std::string::npos);
  // seq_len + 1 wraps to 0 in 32 bits: the shard rule must not be fooled by it.
  EXPECT_NE(expect_invalid(with(kBase, "seq_len = 32", "seq_len = 4294967295")).find("seq_len"),
            std::string::npos);
}

// A batch slot is a 64-byte header, then batch_size * (seq_len + 1) tokens of 2 bytes (this
// vocabulary fits uint16). 65536 x 65537 wraps in 32 bits to 65536 tokens (a 128 KiB slot for
// an 8 GiB batch); the ring's slot size is 32-bit.
TEST(Recipe, BatchSlotLargerThanTheRingCanHoldIsRefused) {
  std::string big =
      with(with(kBase, "seq_len = 32", "seq_len = 65536"), "batch_size = 2", "batch_size = 65536");
  big += "[data]\nshard_tokens = 1000000\n";
  std::string msg = expect_invalid(big);
  EXPECT_NE(msg.find("train.batch_size"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.seq_len"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  auto ok = mc::recipe::parse(kBase, "x.toml");
  EXPECT_EQ(mc::recipe::batch_spec(ok).slot_bytes(), 64 + uint64_t{2} * 33 * 2);
  mc::recipe::Recipe r = ok;
  r.train.batch_size = 65536;
  r.model.seq_len = 65536;
  EXPECT_EQ(mc::recipe::batch_spec(r).slot_bytes(), 64 + uint64_t{65536} * 65537 * 2);
}

// The batch geometry is resolved once (resolve_batch) and recorded in the launch contract; the
// stages read it back (batch_geometry) as it was recorded.
TEST(BatchGeometry, ResolvedOnceAndReadBackFromTheLaunchContract) {
  const auto r = mc::recipe::parse(kBase, "x.toml");
  const auto g = mc::recipe::resolve_batch(r, 4, 0);
  EXPECT_EQ(g.slot, mc::recipe::batch_spec(r));
  EXPECT_EQ(g.data_ranks(), 4u);
  EXPECT_EQ(g.windows_per_step(), 8u);
  EXPECT_EQ(g.rank_rows(), 8u);
  // A resume at another world size: its own rows per rank, the same slot otherwise.
  const auto resumed = mc::recipe::resolve_batch(r, 1, 8);
  EXPECT_EQ(resumed.slot.batch, 8u);
  EXPECT_EQ(resumed.slot.slot_bytes(), 64 + uint64_t{8} * 33 * 2);
  EXPECT_EQ(resumed.windows_per_step(), 8u);
  // nemo_native: tensor-parallel pairs share a batch.
  auto tp = r;
  tp.model.mode = std::string(mc::recipe::kModeNemoNative);
  tp = mc::recipe::rehash(tp);
  const auto pairs = mc::recipe::resolve_batch(tp, 4, 0);
  EXPECT_EQ(pairs.tensor_parallel, 2u);
  EXPECT_EQ(pairs.data_ranks(), 2u);
  EXPECT_EQ(pairs.windows_per_step(), 4u);
  EXPECT_EQ(pairs.rank_rows(), 8u);

  capnp::MallocMessageBuilder msg;
  auto l = msg.initRoot<mc::schema::LaunchContract>();
  l.setWorld(4);
  mc::recipe::to_spec(tp, l.initRecipe());
  // A contract written before the field: the recipe, the world and resume.rankBatch say it.
  EXPECT_EQ(mc::recipe::batch_geometry(l.asReader()), pairs);
  l.initResume().setRankBatch(3);
  EXPECT_EQ(mc::recipe::batch_geometry(l.asReader()), mc::recipe::resolve_batch(tp, 4, 3));
  // Recorded: read as recorded, not from the recipe.
  const auto recorded = mc::recipe::resolve_batch(tp, 4, 5);
  mc::recipe::to_spec(recorded, l.initBatch());
  EXPECT_EQ(mc::recipe::batch_geometry(l.asReader()), recorded);
  EXPECT_EQ(l.getBatch().getSlotBytes(), recorded.slot.slot_bytes());
  EXPECT_EQ(l.getBatch().getWindowsPerStep(), 10u);

  auto refused = [&](std::string_view says) {
    try {
      mc::recipe::batch_geometry(l.asReader());
      ADD_FAILURE() << "accepted a geometry that should say " << says;
    } catch (const mc::Error& e) {
      EXPECT_EQ(e.kind(), mc::ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  l.getBatch().setSlotBytes(l.getBatch().getSlotBytes() - 2);
  refused("does not hold together");
  // seq_len is bounded once, by the recipe's rule (model.seq_len >= 2; the sampler and the
  // model do not check it again): a recorded geometry carries the recorded recipe's seq_len,
  // however well its own sizes agree.
  auto other_seq = recorded;
  other_seq.slot.seq_len = 0;
  mc::recipe::to_spec(other_seq, l.initBatch());
  refused("does not hold together");
  mc::recipe::to_spec(recorded, l.initBatch());
  l.setWorld(3);
  refused("a world of 3 does not divide into tensor-parallel groups of 2");
}

// Every key of every table is read from TOML, written to the launch contract and read back
// (recipe.cpp's one table of fields): each is given a value other than its default here.
TEST(Recipe, EveryFieldIsParsedWrittenAndReadBack) {
  const char* text = R"(
name = "every"
pattern = "AEMR"
mode = "author_dp"
[model]
vocab_size = 300
seq_len = 48
d_model = 96
n_layers = 5
n_heads = 6
mlp_mult = 3
n_kv_heads = 3
rope_theta = 5000.0
ffn_hidden = 200
[moe]
enabled = true
n_experts = 4
top_k = 2
expert_hidden = 40
shared_hidden = 24
aux_loss_coef = 0.02
[ssm]
d_state = 8
head_dim = 16
expand = 3
conv_kernel = 3
chunk = 32
[rnn]
width = 72
conv_kernel = 2
[train]
batch_size = 3
min_lr_ratio = 0.2
warmup_steps = 7
grad_clip = 0.5
seed = 99
checkpoint_every = 11
precision = "bf16-mixed"
grad_reduce = "bf16"
recompute = "selective"
eval_every = 13
eval_tokens = 4800
[optim]
embed_lr = 0.3
head_lr = 0.005
adam_lr = 0.006
adam_beta1 = 0.7
adam_beta2 = 0.9
adam_eps = 1e-9
adam_weight_decay = 0.01
adamw_crossover = 1000
muon_lr = 0.03
muon_momentum = 0.9
muon_beta2 = 0.9
muon_weight_decay = 0.02
muon_orthogonalizer = "newton_schulz"
muon_ns_steps = 7
muon_bf16 = false
qkv_split = false
[data]
source = "llmc"
path = "shards/*.bin"
split = "val"
pack = false
eos_id = 7
shard_tokens = 5000
shards = 3
)";
  const auto r = mc::recipe::parse(text, "every.toml");
  const auto check = [](const mc::recipe::Recipe& x) {
    const auto& m = x.model;
    EXPECT_EQ(x.name, "every");
    EXPECT_EQ(x.pattern, "AEMR");
    EXPECT_EQ(m.mode, "author_dp");
    EXPECT_EQ(std::tie(m.vocab_size, m.seq_len, m.d_model, m.n_layers, m.n_heads, m.mlp_mult,
                       m.n_kv_heads, m.ffn_hidden),
              std::make_tuple(300u, 48u, 96u, 5u, 6u, 3u, 3u, 200u));
    EXPECT_EQ(m.rope_theta, 5000.0);
    EXPECT_EQ(m.moe, (mc::recipe::MoeConfig{true, 4, 2, 40, 24, 0.02}));
    EXPECT_EQ(m.ssm, (mc::recipe::SsmConfig{8, 16, 3, 3, 32}));
    EXPECT_EQ(m.rnn, (mc::recipe::RnnConfig{72, 2}));
    const auto& t = x.train;
    EXPECT_EQ(std::tie(t.batch_size, t.warmup_steps, t.seed, t.checkpoint_every),
              std::make_tuple(3u, 7u, 99u, 11u));
    EXPECT_EQ(std::tie(t.min_lr_ratio, t.grad_clip), std::make_tuple(0.2, 0.5));
    EXPECT_EQ(std::tie(t.precision, t.grad_reduce, t.recompute),
              std::make_tuple("bf16-mixed", "bf16", "selective"));
    EXPECT_EQ(std::tie(t.eval_every, t.eval_tokens), std::make_tuple(13u, 4800u));
    const auto& o = t.optim;
    EXPECT_EQ(std::tie(o.embed_lr, o.head_lr, o.adam_lr, o.adam_beta1, o.adam_beta2, o.adam_eps,
                       o.adam_weight_decay, o.muon_lr, o.muon_momentum, o.muon_beta2,
                       o.muon_weight_decay),
              std::make_tuple(0.3, 0.005, 0.006, 0.7, 0.9, 1e-9, 0.01, 0.03, 0.9, 0.9, 0.02));
    EXPECT_EQ(std::tie(o.adamw_crossover, o.muon_ns_steps), std::make_tuple(1000u, 7u));
    EXPECT_EQ(o.muon_orthogonalizer, "newton_schulz");
    EXPECT_FALSE(o.muon_bf16);
    EXPECT_FALSE(o.muon_bf16_auto);
    EXPECT_FALSE(o.qkv_split);
    const auto& d = x.data;
    EXPECT_EQ(std::tie(d.source, d.path, d.split), std::make_tuple("llmc", "shards/*.bin", "val"));
    EXPECT_FALSE(d.pack);
    EXPECT_EQ(d.eos_id, 7);
    EXPECT_EQ(std::tie(d.shard_tokens, d.shards), std::make_tuple(5000u, 3u));
  };
  check(r);
  capnp::MallocMessageBuilder msg;
  auto spec = msg.initRoot<mc::schema::RecipeSpec>();
  mc::recipe::to_spec(r, spec);
  const auto back = mc::recipe::from_spec(spec.asReader());
  check(back);
  EXPECT_EQ(back.hash, r.hash);
  EXPECT_EQ(mc::recipe::describe(back), mc::recipe::describe(r));
  // Absent keys keep their defaults, muon_bf16 its "auto".
  const auto plain = mc::recipe::parse(kBase, "x.toml");
  EXPECT_TRUE(plain.train.optim.muon_bf16_auto);
  EXPECT_EQ(plain.model.rope_theta, mc::recipe::ModelConfig{}.rope_theta);
  EXPECT_EQ(plain.data.eos_id, -1);
}

// Evaluation (README.md "Validation loss"): off by default; its keys are read, checked and
// carried by the launch contract, and left out of the hash (evaluation changes nothing that
// trains), so a recipe hashes the same with or without them.
TEST(Recipe, EvaluationKeysAreReadButNotHashed) {
  const auto plain = mc::recipe::parse(kBase, "x.toml");
  EXPECT_EQ(plain.train.eval_every, 0u);
  const std::string with = std::string(kBase) + "eval_every = 5\neval_tokens = 640\n";
  const auto evaluating = mc::recipe::parse(with, "x.toml");
  EXPECT_EQ(evaluating.train.eval_every, 5u);
  EXPECT_EQ(evaluating.train.eval_tokens, 640u);
  EXPECT_EQ(evaluating.hash, plain.hash);
  EXPECT_NE(mc::recipe::describe(evaluating).find("eval      every 5 steps"), std::string::npos);
  // The launch contract carries them (and a contract without them reads as no evaluation).
  capnp::MallocMessageBuilder msg;
  auto spec = msg.initRoot<mc::schema::RecipeSpec>();
  mc::recipe::to_spec(evaluating, spec);
  EXPECT_TRUE(spec.getTrain().hasEval());
  EXPECT_EQ(mc::recipe::from_spec(spec.asReader()).train.eval_every, 5u);
  mc::recipe::to_spec(plain, spec);
  EXPECT_FALSE(spec.getTrain().hasEval());
  // One window at least per evaluation.
  EXPECT_NE(expect_invalid(std::string(kBase) + "eval_every = 5\neval_tokens = 31\n")
                .find("train.eval_tokens"),
            std::string::npos);
  // Which steps evaluate: every 5th and the last.
  using mc::recipe::evaluates_at;
  using mc::recipe::evaluations_after;
  EXPECT_TRUE(evaluates_at(5, 5, 12));
  EXPECT_FALSE(evaluates_at(5, 6, 12));
  EXPECT_TRUE(evaluates_at(5, 12, 12));
  EXPECT_FALSE(evaluates_at(0, 12, 12));
  for (uint32_t every : {1u, 3u, 5u, 12u, 20u})
    for (uint32_t after = 0; after <= 12; ++after) {
      uint32_t n = 0;
      for (uint32_t s = after + 1; s <= 12; ++s) n += evaluates_at(every, s, 12);
      EXPECT_EQ(evaluations_after(every, after, 12), n) << every << " " << after;
    }
  EXPECT_EQ(evaluations_after(0, 0, 12), 0u);
}

// An evaluation's windows shared out over data ranks: contiguous parts that cover every window
// once, in slots of at most `batch` rows, whatever the number of ranks.
TEST(ValidationShare, PartsCoverEveryWindowOnceInSlotsOfTheBatch) {
  for (uint64_t windows : {1ull, 7ull, 50ull, 128ull})
    for (uint32_t ranks : {1u, 2u, 3u, 4u, 8u})
      for (uint32_t batch : {1u, 4u, 16u}) {
        const mc::recipe::ValidationShare share{windows, ranks, batch};
        uint64_t next = 0;
        for (uint32_t d = 0; d < ranks; ++d) {
          EXPECT_EQ(share.first(d), next);
          uint64_t rows = 0;
          for (uint32_t k = 0; k < share.slots(d); ++k) {
            EXPECT_GE(share.rows(d, k), 1u);
            EXPECT_LE(share.rows(d, k), batch);
            rows += share.rows(d, k);
          }
          EXPECT_EQ(rows, share.count(d));
          EXPECT_LE(share.count(d), windows / ranks + 1);
          next += share.count(d);
        }
        EXPECT_EQ(next, windows) << windows << " " << ranks << " " << batch;
      }
  EXPECT_EQ(mc::recipe::validation_tag(3, 7), (uint64_t{3} << 32) | 7);
}

TEST(Recipe, ResolveByNameAndPath) {
  auto p = mc::recipe::resolve("tiny", MEGACPP_RECIPE_DIR);
  EXPECT_TRUE(std::filesystem::exists(p));
  auto r = mc::recipe::load(p);
  EXPECT_EQ(r.name, "tiny");
  EXPECT_THROW(mc::recipe::resolve("no-such-recipe", MEGACPP_RECIPE_DIR), mc::Error);
  EXPECT_THROW(mc::recipe::resolve("/no/such/file.toml", MEGACPP_RECIPE_DIR), mc::Error);
}

// ---- hybrid recipes: expansion, modes, hashes, the plan and its gates ----------------------

namespace {
mc::recipe::Recipe named(const std::string& name, const std::string& mode = "") {
  auto r = mc::recipe::load(mc::recipe::resolve(name, MEGACPP_RECIPE_DIR));
  if (!mode.empty()) {
    r.model.mode = mode;
    r = mc::recipe::rehash(std::move(r));
  }
  return r;
}
const mc::recipe::Gate& gate(const mc::recipe::Plan& p, const std::string& rule) {
  for (const auto& g : p.gates)
    if (g.rule == rule) return g;
  throw std::runtime_error("no gate " + rule);
}
}  // namespace

TEST(HybridRecipe, PlainRecipesKeepTheirLaunchContractAndHash) {
  // At its defaults the hybrid architecture is not written: the canonical form (and so the hash)
  // of a plain recipe is what it was before the hybrid fields existed.
  auto r = named("tiny");
  EXPECT_TRUE(r.model.plain_architecture());
  capnp::MallocMessageBuilder msg;
  auto spec = msg.initRoot<mc::schema::RecipeSpec>();
  mc::recipe::to_spec(r, spec);
  EXPECT_FALSE(spec.asReader().getModel().hasArch());
  EXPECT_EQ(r.model.blocks, "AA");
  EXPECT_EQ(mc::recipe::from_spec(spec.asReader()).hash, r.hash);
  // So are precision, gradient reduction and recomputation at theirs; any other value is in
  // the contract and the hash.
  EXPECT_FALSE(spec.asReader().getTrain().hasMemory());
  for (const auto& [key, value] :
       {std::pair{"precision", "bf16-mixed"}, std::pair{"recompute", "full"}}) {
    auto changed = r;
    if (std::string_view(key) == "precision")
      changed.train.precision = value;
    else
      changed.train.recompute = value;
    changed = mc::recipe::rehash(changed);
    EXPECT_NE(changed.hash, r.hash) << key;
    capnp::MallocMessageBuilder m2;
    auto s2 = m2.initRoot<mc::schema::RecipeSpec>();
    mc::recipe::to_spec(changed, s2);
    EXPECT_TRUE(s2.asReader().getTrain().hasMemory()) << key;
    EXPECT_EQ(mc::recipe::from_spec(s2.asReader()).hash, changed.hash) << key;
  }
}

TEST(HybridRecipe, GoldenExpansionsOfTheHybridRecipes) {
  auto th = named("tiny-hybrid");
  EXPECT_EQ(th.model.mode, "author_dp");
  EXPECT_EQ(th.model.blocks, "AEMRAEMR");
  EXPECT_EQ(named("tiny-hybrid", "nemo_native").model.blocks, "AEMMAEMM");

  // nam56r: AEMEAEMEAEMR tiled to 52 layers; E is MoE (enabled); R -> Mamba in nemo_native.
  auto nam = named("nam56r");
  ASSERT_EQ(nam.layers.size(), 52u);
  std::string symbols;
  for (const auto& l : nam.layers) symbols += l;
  EXPECT_EQ(symbols,
            "AEMEAEMEAEMR"
            "AEMEAEMEAEMR"
            "AEMEAEMEAEMR"
            "AEMEAEMEAEMR"
            "AEME");
  EXPECT_EQ(nam.model.mode, "nemo_native");
  EXPECT_EQ(nam.model.blocks,
            "AEMEAEMEAEMM"
            "AEMEAEMEAEMM"
            "AEMEAEMEAEMM"
            "AEMEAEMEAEMM"
            "AEME");
  EXPECT_EQ(named("nam56r", "author_dp").model.blocks,
            "AEMEAEMEAEMR"
            "AEMEAEMEAEMR"
            "AEMEAEMEAEMR"
            "AEMEAEMEAEMR"
            "AEME");
  // With MoE off an E layer is a dense MLP.
  nam.model.moe.enabled = false;
  nam = mc::recipe::rehash(std::move(nam));
  EXPECT_EQ(nam.model.blocks.substr(0, 12), "AFMFAFMFAFMM");
}

// The device recipe (issue 32): 100-300 M parameters, bf16-mixed (bfloat16 orthogonalization on
// cuda), and one rank's plan on cuda well inside an H100's 80 GB with room for torch's cache.
TEST(DeviceRecipe, GpuSmallIsSizedForOneH100) {
  auto r = named("gpu-small");
  EXPECT_EQ(r.train.precision, "bf16-mixed");
  EXPECT_GT(r.train.eval_every, 0u);
  const std::string how = mc::recipe::resolve_muon_precision(r, "cuda", "");
  EXPECT_TRUE(r.train.optim.muon_bf16) << how;
  const auto plan =
      mc::recipe::make_plan(r, {.ranks = 1, .device = "cuda", .cuda_trainer_built = true});
  EXPECT_GE(plan.params_total, 100'000'000u);
  EXPECT_LE(plan.params_total, 300'000'000u);
  EXPECT_EQ(plan.params_total, 254'017'536u);  // README and the recipe's comment say 254.0 M
  // Staged on the device (auto, no budget known), so in the device's total.
  EXPECT_TRUE(plan.memory.staging_on_device);
  EXPECT_TRUE(plan.memory.staging_counted);
  const double gib = static_cast<double>(plan.memory.total()) / (1ull << 30);
  EXPECT_GT(gib, 20.0) << "too small to keep the device busy";
  EXPECT_LT(gib, 60.0) << "leaves too little of 80 GB";
  EXPECT_EQ(plan.refusal(), nullptr) << mc::recipe::format_plan(plan);
}

TEST(HybridRecipe, ThePatternTheModeAndTheDimsAreInTheHash) {
  const auto base = named("tiny-hybrid");
  EXPECT_NE(named("tiny-hybrid", "nemo_native").hash, base.hash);
  auto other = base;
  other.pattern = "AEMM";
  EXPECT_NE(mc::recipe::rehash(other).hash, base.hash);
  other = base;
  other.model.moe.top_k = 1;
  EXPECT_NE(mc::recipe::rehash(other).hash, base.hash);
  other = base;
  other.model.ssm.d_state = 8;
  EXPECT_NE(mc::recipe::rehash(other).hash, base.hash);
  other = base;
  other.model.n_kv_heads = 1;
  EXPECT_NE(mc::recipe::rehash(other).hash, base.hash);
  // The launch contract round trip keeps every hybrid field.
  capnp::MallocMessageBuilder msg;
  auto spec = msg.initRoot<mc::schema::RecipeSpec>();
  mc::recipe::to_spec(base, spec);
  const auto back = mc::recipe::from_spec(spec.asReader());
  EXPECT_EQ(back.hash, base.hash);
  EXPECT_EQ(back.model.blocks, base.model.blocks);
  EXPECT_EQ(back.model.moe, base.model.moe);
  EXPECT_EQ(back.model.ssm, base.model.ssm);
}

TEST(HybridRecipe, HybridRulesAreNamed) {
  const std::string hybrid = std::string(kBase) + "[moe]\nenabled = true\nn_experts = 4\n";
  auto with_pattern = [](std::string text, const char* p) {
    text.replace(text.find("pattern = \"A\""), 13, std::string("pattern = \"") + p + "\"");
    return text;
  };
  EXPECT_NE(expect_invalid(hybrid).find("moe.enabled: the pattern has no E layer"),
            std::string::npos);
  EXPECT_NE(expect_invalid(with_pattern(hybrid, "AE")).find("moe.top_k"), std::string::npos);
  EXPECT_NE(expect_invalid(with_pattern(std::string(kBase), "AX")).find("pattern: symbols are"),
            std::string::npos);
  EXPECT_NE(expect_invalid("mode = \"tp8\"\n" + std::string(kBase)).find("mode: must be"),
            std::string::npos);
  EXPECT_NE(expect_invalid(with(kBase, "n_heads = 4", "n_heads = 4\nn_kv_heads = 3"))
                .find("model.n_kv_heads"),
            std::string::npos);
  EXPECT_NE(expect_invalid(std::string(kBase) + "[ssm]\nhead_dim = 7\n").find("ssm.head_dim"),
            std::string::npos);
  EXPECT_NE(
      expect_invalid(std::string(kBase) + "[rnn]\ndepth = 2\n").find("rnn.depth: unknown key"),
      std::string::npos);
}

// nam56r's first two layers recomputed by hand from the note's dims: D 3584, 56 heads and 8 KV
// heads of 64, FFN 18944; 16 experts of hidden 896, top 4, a shared expert of 1024.
TEST(Plan, Nam56rTwoLayersByHand) {
  auto unrecomputed = named("nam56r");  // the recipe recomputes selectively: count everything
  unrecomputed.train.recompute = "none";
  const auto p = mc::recipe::make_plan(mc::recipe::rehash(unrecomputed), {.ranks = 8});
  ASSERT_EQ(p.layers.size(), 52u);
  const uint64_t D = 3584, H = 56, KV = 8, hd = 64, F = 18944, E = 16, k = 4, h = 896, s = 1024;
  const auto& a = p.layers[0];
  EXPECT_EQ(a.block, 'A');
  const uint64_t attn = (H + 2 * KV) * hd * D + D * H * hd, mlp = 2 * F * D;
  EXPECT_EQ(a.params_total, attn + mlp);
  EXPECT_EQ(a.params_total, 165150720u);
  EXPECT_EQ(a.params_active, a.params_total);
  EXPECT_EQ(a.activation_floats,
            4 * D + 2 + (H + 2 * KV) * hd + (H + KV) * hd + 2 * H * hd + H + (H + KV) + 2 * F);
  const auto& e = p.layers[1];
  EXPECT_EQ(e.block, 'E');
  EXPECT_EQ(e.params_total, E * D + E * 2 * h * D + 2 * s * D);
  EXPECT_EQ(e.params_total, 110157824u);
  EXPECT_EQ(e.params_active, E * D + k * 2 * h * D + 2 * s * D);
  EXPECT_EQ(e.activation_floats, 2 * D + 2 * E + k * (3 * D + 2 * h + 1) + 2 * s);
  // Families: 13 A, 22 E, 17 Mamba (13 M + 4 R in nemo_native).
  std::map<std::string, uint32_t> layers;
  for (const auto& f : p.families) layers[f.name] = f.layers;
  EXPECT_EQ(layers,
            (std::map<std::string, uint32_t>{{"attention", 13}, {"moe", 22}, {"mamba2", 17}}));
  const auto author = mc::recipe::make_plan(named("nam56r", "author_dp"), {.ranks = 8});
  layers.clear();
  for (const auto& f : author.families) layers[f.name] = f.layers;
  EXPECT_EQ(layers["recurrent"], 4u);
  EXPECT_EQ(layers["mamba2"], 13u);
  // The text names all 52 layers and the hash.
  const std::string text = mc::recipe::format_plan(p);
  EXPECT_NE(text.find(p.hash), std::string::npos);
  EXPECT_NE(text.find("\n     51  E   moe"), std::string::npos) << text;
}

// A one-layer recipe's whole per-rank memory, by hand (see recipes/plan.h "Memory model").
TEST(Plan, PerRankMemoryByHand) {
  std::string text = with(kBase, "n_layers = 3", "n_layers = 1");
  const auto r = mc::recipe::parse(text, "x.toml");
  const auto p = mc::recipe::make_plan(r, {.ranks = 2});
  // embed 256x64, head 256x64, qkv 192x64, attn.proj 64x64, mlp.fc 256x64, mlp.proj 64x256
  const uint64_t held = 16384 + 16384 + 12288 + 4096 + 16384 + 16384;
  EXPECT_EQ(p.params_total, held);
  EXPECT_EQ(p.memory.parameters, 4 * held);
  EXPECT_EQ(p.memory.gradients, 4 * held);
  // DistMuon: one entry per stack, ceil(1 / 2) = 1 owned: momentum + second moment (qkv: rows;
  // rows >= cols: rows; else cols). DistAdamW: embed and head below the crossover, replicated.
  const uint64_t muon = (12288 + 192) * 4 + (4096 + 64) * 4 + (16384 + 256) * 4 + (16384 + 256) * 4;
  const uint64_t adam = 8 * 16384 * 2;
  EXPECT_EQ(p.memory.optimizer, muon + adam);
  // 2 sequences x 32 tokens x (2 x 256 logits + the A block's 4D + 2 + (H+2KV)hd + (H+KV)hd +
  // 2 H hd + H + (H+KV) + 2F with D 64, H = KV = 4, hd 16, F 256) x 4 bytes
  const uint64_t a = 4 * 64 + 2 + 12 * 16 + 8 * 16 + 2 * 4 * 16 + 4 + 8 + 2 * 256;
  EXPECT_EQ(p.memory.activations, 2 * 32 * (512 + a) * 4);
  EXPECT_EQ(p.memory.master, 0u);
  // Exchange buffers at dp 2 on Gloo: DistMuon's stacks padded to 2 entries each (P), its
  // gradients, gathered parameters and half of P of receive space; DistAdamW's bucket (A), its
  // receive space and its ride in both segments of DistMuon's exchange.
  const uint64_t P = 2 * (12288 + 4096 + 16384 + 16384), A = 16384 * 2;
  EXPECT_EQ(p.memory.buffers, 4 * P + 4 * P + 4 * P / 2 + 4 * A * (1 + 1 + 2));
  // The snapshot staging region: the share of the rank writing the replicated state, host
  // memory — in the total on the CPU, apart from the device's on cuda.
  EXPECT_EQ(p.memory.staging, 4 * held + muon + adam);
  EXPECT_EQ(p.memory.total(), 4 * held * 3 + muon + adam + p.memory.buffers + p.memory.activations +
                                  p.memory.working + muon + adam);
  const auto on_cuda =
      mc::recipe::make_plan(r, {.ranks = 2, .device = "cuda", .snapshot_staging = "host"});
  EXPECT_EQ(on_cuda.memory.staging, p.memory.staging);
  const auto& c = on_cuda.memory;  // NCCL's receive space differs from Gloo's
  EXPECT_EQ(c.total(), c.parameters + c.gradients + c.master + c.optimizer + c.buffers +
                           c.activations + c.working);
  EXPECT_NE(mc::recipe::format_plan(on_cuda).find("; and in host memory, snapshot staging"),
            std::string::npos);
  // Staged on the device (auto where it fits the budget): in the device's total, and the
  // checkpointer's page-locked copy in host memory.
  const double without = static_cast<double>(c.total()) / (1ull << 30);
  const double staging = static_cast<double>(c.staging) / (1ull << 30);
  const auto fits = mc::recipe::make_plan(
      r, {.ranks = 2, .memory_budget_gib = without + staging * 1.01, .device = "cuda"});
  EXPECT_TRUE(fits.memory.staging_on_device);
  EXPECT_EQ(fits.memory.total(), c.total() + c.staging);
  EXPECT_NE(mc::recipe::format_plan(fits).find("snapshot staging on the device"),
            std::string::npos);
  EXPECT_NE(mc::recipe::format_plan(fits).find("the checkpointer's page-locked copy"),
            std::string::npos);
  const auto tight = mc::recipe::make_plan(r, {.ranks = 2,
                                               .memory_budget_gib = without + staging * 0.99,
                                               .device = "cuda",
                                               .cuda_trainer_built = true});
  EXPECT_FALSE(tight.memory.staging_on_device);  // auto falls back to host memory
  EXPECT_EQ(tight.refusal(), nullptr);
  const auto forced = mc::recipe::make_plan(r, {.ranks = 2,
                                                .memory_budget_gib = without + staging * 0.99,
                                                .device = "cuda",
                                                .cuda_trainer_built = true,
                                                .snapshot_staging = "device"});
  ASSERT_NE(forced.refusal(), nullptr);  // device staging that does not fit is refused
  EXPECT_EQ(forced.refusal()->rule, "memory-budget");
  const auto no_driver =
      mc::recipe::make_plan(r, {.ranks = 2, .device = "cuda", .cuda_staging_available = false});
  EXPECT_FALSE(no_driver.memory.staging_on_device);
  // bf16-mixed: parameters, gradients and activations at 2 bytes; float32 masters of what the
  // rank owns (one entry of each stack, both replicated DistAdamW tensors); the moments as
  // before; the gathered parameters at 2 bytes.
  auto rb = r;
  rb.train.precision = "bf16-mixed";
  rb = mc::recipe::rehash(std::move(rb));
  const auto mixed = mc::recipe::make_plan(rb, {.ranks = 2});
  EXPECT_EQ(mixed.memory.parameters, 2 * held);
  EXPECT_EQ(mixed.memory.gradients, 2 * held);
  EXPECT_EQ(mixed.memory.master, 4 * (A + P / 2));
  EXPECT_EQ(mixed.memory.optimizer, muon + adam);
  EXPECT_EQ(mixed.memory.buffers, 4 * P + 2 * P + 4 * P / 2 + 4 * A * (1 + 1 + 2));
  // The blocks' floats at 2 bytes; the logits in bfloat16 and float32 and the log-probabilities.
  EXPECT_EQ(mixed.memory.activations, 2 * 32 * (a * 2 + 256 * 10));
  // The optimizer's working set: the largest stack's one owned entry (mlp.fc 256x64 or
  // mlp.proj 64x256) orthogonalized — input, iterate, product, and three 64x64 Gram matrices —
  // plus two float32 temporaries of its size.
  const uint64_t ob = r.train.optim.muon_bf16 ? 2 : 4;
  EXPECT_EQ(p.memory.working, (3 * 16384 + 3 * 64 * 64) * ob + 2 * 16384 * 4);
  // Gradients summed in bfloat16: DistMuon's buffers at 2 bytes, DistAdamW a tensor at a time.
  rb.train.grad_reduce = "bf16";
  rb = mc::recipe::rehash(std::move(rb));
  EXPECT_EQ(mc::recipe::make_plan(rb, {.ranks = 2}).memory.buffers, 2 * P + 2 * P + 2 * P / 2);
  // Tensor parallel 2 on the same 2 ranks (one data-parallel group), weight shards: each rank
  // holds half of every block matrix and embed and head whole; DistMuon steps one whole entry
  // of each stack per rank (over the job's 2 ranks) on a whole float32 copy of it; DistAdamW
  // keeps embed and head replicated (dp 1, no exchange of its own); the gradients of embed and
  // head are summed over the group in one flat buffer; the activations of a sequence shard are
  // half.
  auto rn = r;
  rn.model.mode = "nemo_native";
  rn = mc::recipe::rehash(std::move(rn));
  const auto tp = mc::recipe::make_plan(rn, {.ranks = 2});
  const uint64_t held_tp = 16384 + 16384 + (12288 + 4096 + 16384 + 16384) / 2;
  EXPECT_EQ(tp.memory.parameters, 4 * held_tp);
  EXPECT_EQ(tp.memory.gradients, 4 * held_tp);
  EXPECT_EQ(tp.memory.optimizer, muon + adam);
  EXPECT_EQ(tp.memory.master, 4 * P / 2);
  EXPECT_EQ(tp.memory.buffers, 4 * P + 4 * P + 4 * P / 2 + 4 * A);
  EXPECT_EQ(tp.memory.activations, 32 * (512 + a) * 4);
}

// The recurrence's scan chunk (trainer and plan alike): a power of two near (2T)^(1/3) x 1.5,
// at least 4, at most the recipe's ssm.chunk.
TEST(Plan, RecurrenceScanChunk) {
  EXPECT_EQ(mc::recipe::recurrence_scan_chunk(64, 32), 4);
  EXPECT_EQ(mc::recipe::recurrence_scan_chunk(256, 32), 8);
  EXPECT_EQ(mc::recipe::recurrence_scan_chunk(4096, 128), 16);
  EXPECT_EQ(mc::recipe::recurrence_scan_chunk(4096, 8), 8);
  EXPECT_EQ(mc::recipe::recurrence_scan_chunk(64, 2), 2);
  EXPECT_EQ(mc::recipe::recurrence_scan_chunk(1, 64), 4);
}

// train.recompute on the same one-layer attention recipe, by hand: none keeps the norms' inputs,
// outputs and 1 / rms (two per token; the QK-norms' one per head), qkv, q and k after RoPE, the
// attention's output, its copy and log-sum-exp per head, the MLP's relu and square; selective
// the two norms' inputs for their outputs and the MLP's fc output only; full keeps the block's
// input per layer and, once, the block's none figure (its working set while its forward runs
// again in backward). Three layers: the working set is counted once.
TEST(Plan, ActivationsFollowRecompute) {
  const uint64_t D = 64, H = 4, qkv = 12 * 16, qk = 2 * 4 * 16, y = 4 * 16, F = 256;
  const uint64_t none = 4 * D + 2 + qkv + qk + 2 * y + H + 2 * H + 2 * F;
  const uint64_t selective = 2 * D + qkv + qk + 2 * y + H + F;
  for (const uint32_t layers : {1u, 3u}) {
    std::string text = with(kBase, "n_layers = 3", fmt::format("n_layers = {}", layers));
    for (const auto& [mode, per_layer, once] :
         {std::tuple{"none", none, uint64_t{0}}, std::tuple{"selective", selective, uint64_t{0}},
          std::tuple{"full", D, none}}) {
      auto r = mc::recipe::parse(text, "x.toml");
      r.train.recompute = mode;
      r = mc::recipe::rehash(std::move(r));
      const auto p = mc::recipe::make_plan(r, {.ranks = 2});
      ASSERT_EQ(p.layers.size(), layers);
      EXPECT_EQ(p.layers[0].activation_floats, per_layer) << mode;
      EXPECT_EQ(p.memory.activations, 2 * 32 * (512 + layers * per_layer + once) * 4) << mode;
    }
  }
  const mc::recipe::ModelConfig m;
  EXPECT_EQ(mc::recipe::activation_floats(m, 'F', mc::recipe::Recompute::kSelective),
            m.d_model + m.ffn());
  EXPECT_LT(mc::recipe::activation_floats(m, 'M', mc::recipe::Recompute::kSelective),
            mc::recipe::activation_floats(m, 'M', mc::recipe::Recompute::kNone));
  EXPECT_LT(mc::recipe::activation_floats(m, 'R', mc::recipe::Recompute::kSelective),
            mc::recipe::activation_floats(m, 'R', mc::recipe::Recompute::kNone));
}

TEST(Plan, GatesNameTheirRuleReasonAndRetirement) {
  // nam56r in its default mode (tensor parallel 2) passes every gate on CPUs at 8 ranks; on
  // CUDA, a build without the CUDA trainer refuses it by feature-built.
  EXPECT_EQ(mc::recipe::make_plan(named("nam56r"), {.ranks = 8}).refusal(), nullptr);
  EXPECT_EQ(mc::recipe::make_plan(named("nam56r"),
                                  {.ranks = 8, .device = "cuda", .cuda_trainer_built = true})
                .refusal(),
            nullptr);
  auto nemo = mc::recipe::make_plan(named("nam56r"), {.ranks = 8, .device = "cuda"});
  ASSERT_NE(nemo.refusal(), nullptr);
  EXPECT_EQ(nemo.refusal()->rule, "feature-built");
  EXPECT_NE(nemo.refusal()->detail.find("no CUDA trainer"), std::string::npos);
  for (const auto& g : nemo.gates) {
    EXPECT_FALSE(g.reason.empty()) << g.rule;
    EXPECT_FALSE(g.retires.empty()) << g.rule;
  }
  EXPECT_TRUE(gate(nemo, "tp-divides-heads").passed);
  EXPECT_TRUE(gate(nemo, "sp-divides-seq").passed);
  EXPECT_TRUE(gate(nemo, "experts-divide-tp").passed);
  EXPECT_FALSE(gate(nemo, "memory-budget").checked);
  const std::string line = mc::recipe::refusal_line(*nemo.refusal());
  EXPECT_NE(line.find("feature-built:"), std::string::npos);
  EXPECT_NE(line.find("retires when"), std::string::npos);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  // A budget's source is named in the detail.
  const auto host = mc::recipe::make_plan(
      named("nam56r"),
      {.ranks = 8, .memory_budget_gib = 1, .memory_budget_source = "this host's 8.0 GiB over 8"});
  ASSERT_NE(host.refusal(), nullptr);
  EXPECT_EQ(host.refusal()->rule, "memory-budget");
  EXPECT_NE(host.refusal()->detail.find("(this host's 8.0 GiB over 8)"), std::string::npos);
  // author_dp passes every gate at 8 ranks; a small memory budget refuses it by name.
  EXPECT_EQ(mc::recipe::make_plan(named("nam56r", "author_dp"), {.ranks = 8}).refusal(), nullptr);
  auto tight =
      mc::recipe::make_plan(named("nam56r", "author_dp"), {.ranks = 8, .memory_budget_gib = 40});
  ASSERT_NE(tight.refusal(), nullptr);
  EXPECT_EQ(tight.refusal()->rule, "memory-budget");
  // Odd worlds, heads, sequences and experts under tensor parallel 2.
  EXPECT_FALSE(
      gate(mc::recipe::make_plan(named("nam56r"), {.ranks = 3}), "tp-divides-world").passed);
  // A job of 2 nodes of 1 rank each: its tensor-parallel groups would span nodes.
  const auto spans = mc::recipe::make_plan(named("nam56r"), {.ranks = 2, .ranks_per_node = 1});
  EXPECT_TRUE(gate(spans, "tp-divides-world").passed);
  EXPECT_FALSE(gate(spans, "tp-within-node").passed);
  EXPECT_TRUE(gate(mc::recipe::make_plan(named("nam56r"), {.ranks = 8, .ranks_per_node = 4}),
                   "tp-within-node")
                  .passed);
  auto r = named("tiny-hybrid", "nemo_native");
  r.model.n_heads = 1;
  r.model.n_kv_heads = 1;
  r.model.d_model = 32;
  r.model.ssm.head_dim = 16;
  r.model.rnn.width = 32;
  r.model.seq_len = 63;
  r.model.moe.n_experts = 3;
  r = mc::recipe::rehash(std::move(r));
  const auto odd = mc::recipe::make_plan(r, {.ranks = 2});
  EXPECT_FALSE(gate(odd, "tp-divides-heads").passed);
  EXPECT_FALSE(gate(odd, "sp-divides-seq").passed);
  EXPECT_FALSE(gate(odd, "experts-divide-tp").passed);
  EXPECT_TRUE(gate(odd, "tp-divides-world").passed);
}

// muon_bf16 = "auto" (the shipped recipes' setting and the default) settles per device before a
// launch: bfloat16 on CUDA and on a CPU with bfloat16 matrix units, float32 elsewhere; the hash
// then equals that of a recipe that says so explicitly, and an explicit value is kept as is.
TEST(Recipe, MuonBf16AutoFollowsTheDevice) {
  const std::string base(kBase);
  auto with = [&](const std::string& value) {
    std::string text = base;
    const size_t at = text.find("[optim]");
    if (at == std::string::npos) return text + "\n[optim]\nmuon_bf16 = " + value + "\n";
    return text.insert(at + 7, "\nmuon_bf16 = " + value);
  };
  const auto explicit_bf16 = mc::recipe::parse(with("true"), "x.toml");
  const auto explicit_f32 = mc::recipe::parse(with("false"), "x.toml");
  EXPECT_FALSE(explicit_bf16.train.optim.muon_bf16_auto);
  const auto shipped = mc::recipe::load(mc::recipe::resolve("tiny", MEGACPP_RECIPE_DIR));
  EXPECT_TRUE(shipped.train.optim.muon_bf16_auto);
  EXPECT_TRUE(mc::recipe::parse(base, "x.toml").train.optim.muon_bf16_auto);  // the default

  auto a = mc::recipe::parse(with("\"auto\""), "x.toml");
  EXPECT_EQ(mc::recipe::resolve_muon_precision(a, "cpu", ""),
            "float32 (auto: cpu without bfloat16 matrix units)");
  EXPECT_FALSE(a.train.optim.muon_bf16);
  EXPECT_EQ(a.hash, explicit_f32.hash);

  auto b = mc::recipe::parse(with("\"auto\""), "x.toml");
  EXPECT_EQ(mc::recipe::resolve_muon_precision(b, "cpu", "amx_bf16 avx512_bf16"),
            "bfloat16 (auto: cpu with amx_bf16 avx512_bf16)");
  EXPECT_TRUE(b.train.optim.muon_bf16);
  EXPECT_EQ(b.hash, explicit_bf16.hash);

  auto c = mc::recipe::parse(with("\"auto\""), "x.toml");
  EXPECT_EQ(mc::recipe::resolve_muon_precision(c, "cuda", ""), "bfloat16 (auto: cuda)");
  EXPECT_EQ(c.hash, explicit_bf16.hash);

  auto d = explicit_bf16;
  EXPECT_EQ(mc::recipe::resolve_muon_precision(d, "cpu", ""), "bfloat16 (the recipe)");
  EXPECT_EQ(d.hash, explicit_bf16.hash);

  // An engine's restart of the same command: its "auto" recipe names the run whatever the run
  // settled (float32 on a CPU without bfloat16 units, whose hash differs from the unsettled
  // recipe's), and a recipe that differs otherwise still does not.
  const auto command = mc::recipe::parse(with("\"auto\""), "x.toml");
  EXPECT_NE(command.hash, a.hash);
  EXPECT_EQ(mc::recipe::settled_like(command, a).hash, a.hash);
  EXPECT_EQ(mc::recipe::settled_like(command, b).hash, b.hash);
  EXPECT_EQ(mc::recipe::settled_like(explicit_f32, a).hash, explicit_f32.hash);
  EXPECT_NE(mc::recipe::settled_like(explicit_bf16, a).hash, a.hash);

  try {
    mc::recipe::parse(with("\"fast\""), "x.toml");
    ADD_FAILURE() << "muon_bf16 = \"fast\" was accepted";
  } catch (const mc::Error& e) {
    EXPECT_NE(std::string(e.what()).find("optim.muon_bf16"), std::string::npos) << e.what();
  }
}
