#include "recipes/recipe.h"

#include <gtest/gtest.h>

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
  EXPECT_NE(expect_invalid(moe).find("block family A only"), std::string::npos);
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

TEST(Recipe, ResolveByNameAndPath) {
  auto p = mc::recipe::resolve("tiny", MEGACPP_RECIPE_DIR);
  EXPECT_TRUE(std::filesystem::exists(p));
  auto r = mc::recipe::load(p);
  EXPECT_EQ(r.name, "tiny");
  EXPECT_THROW(mc::recipe::resolve("no-such-recipe", MEGACPP_RECIPE_DIR), mc::Error);
  EXPECT_THROW(mc::recipe::resolve("/no/such/file.toml", MEGACPP_RECIPE_DIR), mc::Error);
}
