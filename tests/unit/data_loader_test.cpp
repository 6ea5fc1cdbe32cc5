#include "stages/data_loader/data_loader.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"

namespace mc = megacpp;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir() {
  auto d = fs::temp_directory_path() / ("megacpp-dl-test-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

}  // namespace

TEST(Corpus, DeterministicTextWithStructure) {
  auto a = mc::data_loader::builtin_corpus_tokens(0, 4096);
  auto b = mc::data_loader::builtin_corpus_tokens(0, 4096);
  auto c = mc::data_loader::builtin_corpus_tokens(1, 4096);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::set<uint16_t> distinct(a.begin(), a.end());
  EXPECT_LT(distinct.size(), 64u);  // a small alphabet: there is something to learn
  for (auto t : a) EXPECT_LT(t, 128);
}

TEST(Shard, RoundTripInLlmcFormat) {
  auto dir = temp_dir();
  std::vector<uint16_t> tokens = {1, 2, 3, 65535, 7};
  mc::data_loader::write_shard(dir / "s.bin", tokens);
  EXPECT_EQ(fs::file_size(dir / "s.bin"), 1024u + tokens.size() * 2);
  std::ifstream in(dir / "s.bin", std::ios::binary);
  int32_t header[3];
  in.read(reinterpret_cast<char*>(header), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 5);
  mc::data_loader::Shard s(dir / "s.bin");
  EXPECT_EQ(std::vector<uint16_t>(s.tokens().begin(), s.tokens().end()), tokens);
  fs::remove_all(dir);
}

TEST(Shard, CorruptHeadersAreNamed) {
  auto dir = temp_dir();
  mc::data_loader::write_shard(dir / "s.bin", std::vector<uint16_t>(100, 3));
  {
    std::fstream f(dir / "s.bin", std::ios::binary | std::ios::in | std::ios::out);
    int32_t bad = 1234;
    f.write(reinterpret_cast<char*>(&bad), 4);
  }
  try {
    mc::data_loader::Shard s(dir / "s.bin");
    FAIL() << "accepted a bad magic";
  } catch (const mc::Error& e) {
    EXPECT_EQ(e.kind(), mc::ErrorKind::kCorruption);
    EXPECT_NE(std::string(e.what()).find("magic"), std::string::npos);
  }
  mc::data_loader::write_shard(dir / "t.bin", std::vector<uint16_t>(100, 3));
  fs::resize_file(dir / "t.bin", 1024 + 50);
  EXPECT_THROW(mc::data_loader::Shard(dir / "t.bin"), mc::Error);
  std::ofstream(dir / "u.bin") << "short";
  EXPECT_THROW(mc::data_loader::Shard(dir / "u.bin"), mc::Error);
  fs::remove_all(dir);
}

TEST(Corpus, EnsureWritesOnceAndReuses) {
  auto dir = temp_dir();
  auto paths = mc::data_loader::ensure_builtin_corpus(dir, 2, 10000);
  ASSERT_EQ(paths.size(), 2u);
  auto mtime = fs::last_write_time(paths[0]);
  auto again = mc::data_loader::ensure_builtin_corpus(dir, 2, 10000);
  EXPECT_EQ(paths, again);
  EXPECT_EQ(mtime, fs::last_write_time(paths[0]));
  fs::resize_file(paths[1], 1024 + 10);  // a torn shard is rewritten
  mc::data_loader::ensure_builtin_corpus(dir, 2, 10000);
  EXPECT_EQ(mc::data_loader::Shard(paths[1]).tokens().size(), 10000u);
  fs::remove_all(dir);
}

TEST(Sampler, RanksGetDifferentEqualBatchesDeterministically) {
  auto t0 = mc::data_loader::builtin_corpus_tokens(0, 20000);
  auto t1 = mc::data_loader::builtin_corpus_tokens(1, 20000);
  std::vector<std::span<const uint16_t>> shards = {t0, t1};
  const uint32_t seq = 16, batch = 4, world = 2;
  mc::data_loader::Sampler s(shards, seq, batch, world, 7);
  EXPECT_EQ(s.batch_bytes(), size_t{batch} * (seq + 1) * 8);
  std::vector<int64_t> a(batch * (seq + 1)), b(a.size()), a2(a.size());
  s.fill(1, 0, a.data());
  s.fill(1, 1, b.data());
  s.fill(1, 0, a2.data());
  EXPECT_NE(a, b);
  EXPECT_EQ(a, a2);
  // Within one epoch every window is used exactly once.
  std::set<std::vector<int64_t>> seen;
  const uint64_t steps = s.windows() / (batch * world);
  for (uint32_t step = 1; step <= steps; ++step) {
    for (uint32_t r = 0; r < world; ++r) {
      s.fill(step, r, a.data());
      for (uint32_t row = 0; row < batch; ++row) {
        seen.insert(
            std::vector<int64_t>(a.begin() + row * (seq + 1), a.begin() + (row + 1) * (seq + 1)));
      }
    }
  }
  EXPECT_GT(seen.size(),
            steps * batch * world * 9 / 10);  // distinct windows (text may repeat exactly)
  EXPECT_THROW(s.fill(0, 0, a.data()), mc::Error);
  EXPECT_THROW(s.fill(1, 2, a.data()), mc::Error);
}
