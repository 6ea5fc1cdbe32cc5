// data/: the shard formats (llm.c uint16/uint32, Megatron indexed), their validation, the
// built-in corpus, the sampler's one global window sequence, and the dataset pre-flight.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <capnp/message.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>

#include "core/error.h"
#include "core/util.h"
#include "data/dataset.h"
#include "data/dataset_manifest.h"
#include "data/sampler.h"
#include "data/shards.h"
#include "tests/unit/temp_dir.h"

namespace mc = megacpp;
namespace md = megacpp::data;
namespace fs = std::filesystem;

namespace {

using megacpp::test_support::TempDir;

std::string bytes_of(const fs::path& p) {
  return mc::read_file(p);
}

void patch(const fs::path& p, uint64_t offset, const void* bytes, size_t n) {
  std::fstream f(p, std::ios::binary | std::ios::in | std::ios::out);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
}

// A Megatron indexed dataset (text, one sequence per document), as Megatron's writer lays it
// out: "MMIDIDX\0\0", version, dtype code, counts, lengths, byte pointers, document indices.
void write_megatron(const fs::path& prefix, const std::vector<std::vector<uint32_t>>& docs,
                    uint8_t code) {
  const size_t w = code == md::kMegatronDtypeUint16 ? 2 : 4;
  std::string bin;
  std::vector<int32_t> lens;
  std::vector<int64_t> ptrs;
  for (const auto& d : docs) {
    ptrs.push_back(static_cast<int64_t>(bin.size()));
    lens.push_back(static_cast<int32_t>(d.size()));
    for (uint32_t t : d) bin.append(reinterpret_cast<const char*>(&t), w);
  }
  std::string idx(md::kMegatronMagic, 9);
  auto put = [&](const auto& v) { idx.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(uint64_t{1});
  put(code);
  put(uint64_t{docs.size()});
  put(uint64_t{docs.size() + 1});
  for (auto l : lens) put(l);
  for (auto p : ptrs) put(p);
  for (uint64_t i = 0; i <= docs.size(); ++i) put(static_cast<int64_t>(i));
  mc::write_file_atomic(fs::path(prefix.string() + ".bin"), bin);
  mc::write_file_atomic(fs::path(prefix.string() + ".idx"), idx);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const mc::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Corpus, DeterministicTextWithStructure) {
  auto a = md::builtin_corpus_tokens(0, 4096);
  auto b = md::builtin_corpus_tokens(0, 4096);
  auto c = md::builtin_corpus_tokens(1, 4096);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::set<uint16_t> distinct(a.begin(), a.end());
  EXPECT_LT(distinct.size(), 64u);
  for (auto t : a) EXPECT_LT(t, 128);
}

TEST(Corpus, EnsureWritesOnceAndReuses) {
  TempDir dir;
  auto paths = md::ensure_builtin_corpus(dir.path(), 2, 10000);
  ASSERT_EQ(paths.size(), 2u);
  auto mtime = fs::last_write_time(paths[0]);
  EXPECT_EQ(paths, md::ensure_builtin_corpus(dir.path(), 2, 10000));
  EXPECT_EQ(mtime, fs::last_write_time(paths[0]));
  fs::resize_file(paths[1], 1024 + 10);  // a torn shard is rewritten
  md::ensure_builtin_corpus(dir.path(), 2, 10000);
  EXPECT_EQ(md::Shard(paths[1], md::ShardFormat::kLlmc).tokens(), 10000u);
}

TEST(Llmc, BothVersionsRoundTripWithTheLlmcHeader) {
  TempDir dir;
  std::vector<uint32_t> small = {1, 2, 3, 65535, 7}, wide = {1, 70000, 3, 1u << 20};
  md::write_llmc_shard(dir.path() / "a.bin", small, md::TokenWidth::kU16);
  md::write_llmc_shard(dir.path() / "b.bin", wide, md::TokenWidth::kU32);
  auto a = bytes_of(dir.path() / "a.bin"), b = bytes_of(dir.path() / "b.bin");
  ASSERT_EQ(a.size(), 1024u + 10);
  ASSERT_EQ(b.size(), 1024u + 16);
  int32_t h[3];
  std::memcpy(h, a.data(), sizeof h);
  EXPECT_EQ(h[0], 20240520);
  EXPECT_EQ(h[1], 1);
  EXPECT_EQ(h[2], 5);
  std::memcpy(h, b.data(), sizeof h);
  EXPECT_EQ(h[0], 20240801);
  EXPECT_EQ(h[1], 7);
  EXPECT_EQ(h[2], 4);
  md::Shard sa(dir.path() / "a.bin", md::ShardFormat::kLlmc, {.vocab_size = 65536});
  md::Shard sb(dir.path() / "b.bin", md::ShardFormat::kLlmc, {.vocab_size = 1u << 21});
  EXPECT_EQ(sa.width(), md::TokenWidth::kU16);
  EXPECT_EQ(sb.width(), md::TokenWidth::kU32);
  for (size_t i = 0; i < small.size(); ++i) EXPECT_EQ(sa.token(i), small[i]);
  for (size_t i = 0; i < wide.size(); ++i) EXPECT_EQ(sb.token(i), wide[i]);
  EXPECT_EQ(sa.max_token(), 65535u);
  EXPECT_EQ(sb.max_token(), 1u << 20);
  EXPECT_THROW(md::write_llmc_shard(dir.path() / "c.bin", wide, md::TokenWidth::kU16), mc::Error);
  EXPECT_FALSE(fs::exists(dir.path() / "c.bin"));
}

TEST(Llmc, EveryBrokenRuleIsOneLineNamingFileOffsetAndRule) {
  TempDir dir;
  auto make = [&](const char* name) {
    auto p = dir.path() / name;
    md::write_llmc_shard(p, std::vector<uint32_t>(100, 3), md::TokenWidth::kU16);
    return p;
  };
  auto open = [&](const fs::path& p, uint64_t vocab = 0) {
    return error_of([&] { md::Shard s(p, md::ShardFormat::kLlmc, {.vocab_size = vocab}); });
  };
  auto expect = [&](const std::string& msg, const fs::path& p, const char* offset,
                    const char* rule) {
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find(offset), std::string::npos) << msg;
    EXPECT_NE(msg.find(rule), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  auto magic = make("magic.bin");
  int32_t v = 1234;
  patch(magic, 0, &v, 4);
  expect(open(magic), magic, "at byte 0", "magic 1234");
  auto version = make("version.bin");
  v = 2;
  patch(version, 4, &v, 4);
  expect(open(version), version, "at byte 4", "version 2");
  auto negative = make("negative.bin");
  v = -5;
  patch(negative, 8, &v, 4);
  expect(open(negative), negative, "at byte 8", "negative token count");
  auto torn = make("torn.bin");
  fs::resize_file(torn, 1024 + 50);
  expect(open(torn), torn, "at byte 1074", "says 100 tokens");
  auto longer = make("long.bin");
  fs::resize_file(longer, 1024 + 202);
  expect(open(longer), longer, "at byte 1224", "file has 1226 bytes");
  std::ofstream(dir.path() / "short.bin") << "short";
  expect(open(dir.path() / "short.bin"), dir.path() / "short.bin", "at byte 5", "header");
  auto vocab = dir.path() / "vocab.bin";
  md::write_llmc_shard(vocab, std::vector<uint32_t>{1, 2, 300, 4}, md::TokenWidth::kU16);
  expect(open(vocab, 256), vocab, "at byte 1028", "token 300 at index 2");
  EXPECT_EQ(open(vocab, 301), "");
}

TEST(Megatron, ReadsTheIndexedDatasetWithItsDocuments) {
  TempDir dir;
  write_megatron(dir.path() / "corpus_text_document", {{5, 6, 7}, {8, 9}, {10, 11, 12, 13}},
                 md::kMegatronDtypeUint16);
  md::Shard s(dir.path() / "corpus_text_document.idx", md::ShardFormat::kMegatron,
              {.vocab_size = 100, .checksum = true});
  EXPECT_EQ(s.path(), dir.path() / "corpus_text_document.bin");
  EXPECT_EQ(s.width(), md::TokenWidth::kU16);
  ASSERT_EQ(s.tokens(), 9u);
  EXPECT_EQ(s.token(0), 5u);
  EXPECT_EQ(s.token(8), 13u);
  EXPECT_EQ(std::vector<uint64_t>(s.document_starts().begin(), s.document_starts().end()),
            (std::vector<uint64_t>{0, 3, 5}));
  EXPECT_EQ(s.xxh3().size(), 16u);
  write_megatron(dir.path() / "wide", {{70000, 1}}, md::kMegatronDtypeInt32);
  md::Shard w(dir.path() / "wide", md::ShardFormat::kMegatron, {.vocab_size = 70001});
  EXPECT_EQ(w.width(), md::TokenWidth::kU32);
  EXPECT_EQ(w.token(0), 70000u);
}

TEST(Megatron, EveryBrokenRuleIsOneLineNamingFileOffsetAndRule) {
  TempDir dir;
  auto make = [&](const std::string& name) {
    auto p = dir.path() / name;
    write_megatron(p, {{1, 2, 3}, {4, 5}}, md::kMegatronDtypeUint16);
    return fs::path(p.string() + ".idx");
  };
  auto open = [&](const fs::path& p, uint64_t vocab = 0) {
    return error_of([&] { md::Shard s(p, md::ShardFormat::kMegatron, {.vocab_size = vocab}); });
  };
  auto has = [](const std::string& msg, std::initializer_list<const char*> parts) {
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const char* part : parts) EXPECT_NE(msg.find(part), std::string::npos) << msg;
  };
  auto magic = make("magic");
  patch(magic, 0, "XX", 2);
  has(open(magic), {"magic.idx", "at byte 0", "MMIDIDX"});
  auto version = make("version");
  uint64_t v = 2;
  patch(version, 9, &v, 8);
  has(open(version), {"version.idx", "at byte 9", "version 2"});
  auto dtype = make("dtype");
  uint8_t code = 6;
  patch(dtype, 17, &code, 1);
  has(open(dtype), {"dtype.idx", "at byte 17", "dtype code 6 (float64)"});
  auto count = make("count");
  v = uint64_t{1} << 62;  // a count that would wrap a multiplication
  patch(count, 18, &v, 8);
  has(open(count), {"count.idx", "at byte 18", "sequences"});
  auto length = make("length");
  int32_t len = -1;
  patch(length, 34, &len, 4);
  has(open(length), {"length.idx", "at byte 34", "length -1"});
  auto pointer = make("pointer");
  int64_t ptr = 2;
  patch(pointer, 34 + 8 + 8, &ptr, 8);
  has(open(pointer), {"pointer.idx", "at byte 50", "back-to-back"});
  auto docs = make("docs");
  int64_t d = 5;
  patch(docs, 34 + 8 + 16 + 8, &d, 8);
  has(open(docs), {"docs.idx", "at byte 66", "document index 1 is 5"});
  auto bin = make("bin");
  fs::resize_file(dir.path() / "bin.bin", 6);
  has(open(bin), {"bin.bin", "at byte 6", "describes 10"});
  auto vocab = make("vocab");
  has(open(vocab, 5), {"vocab.bin", "at byte 8", "token 5 at index 4"});
  has(open(dir.path() / "missing.idx"), {"missing.idx"});
}

TEST(FindShards, DirectoriesGlobsSplitsAndEmptyFolders) {
  TempDir dir;
  for (const char* n : {"fw_train_000001.bin", "fw_train_000000.bin", "fw_val_000000.bin"})
    md::write_llmc_shard(dir.path() / n, std::vector<uint32_t>{1, 2, 3}, md::TokenWidth::kU16);
  auto train = md::find_shards(dir.path(), md::ShardFormat::kLlmc, "", "train");
  ASSERT_EQ(train.size(), 2u);
  EXPECT_EQ(train[0].filename(), "fw_train_000000.bin");
  auto val = md::find_shards(dir.path(), md::ShardFormat::kLlmc, "fw_{split}_*.bin", "val");
  ASSERT_EQ(val.size(), 1u);
  fs::create_directories(dir.path() / "empty");
  auto msg =
      error_of([&] { md::find_shards(dir.path(), md::ShardFormat::kLlmc, "empty", "train"); });
  EXPECT_NE(msg.find("no llmc shards"), std::string::npos) << msg;
  EXPECT_NE(msg.find((dir.path() / "empty").string()), std::string::npos) << msg;
  msg = error_of([&] { md::find_shards(dir.path(), md::ShardFormat::kMegatron, "", "train"); });
  EXPECT_NE(msg.find(".idx"), std::string::npos) << msg;
}

// Megatron-LM names a dataset by its prefix (--data-path corpus_text_document): the prefix, or
// either file's name, is that dataset whatever the split (no validation split then).
TEST(FindShards, AMegatronPrefixIsItsIdxAndBinPair) {
  TempDir dir;
  write_megatron(dir.path() / "corpus_text_document", {{5, 6, 7}, {8, 9}},
                 md::kMegatronDtypeUint16);
  write_megatron(dir.path() / "other_text_document", {{1, 2}}, md::kMegatronDtypeUint16);
  const fs::path idx = dir.path() / "corpus_text_document.idx";
  for (const std::string& pattern :
       {std::string("corpus_text_document"), std::string("corpus_text_document.idx"),
        std::string("corpus_text_document.bin"), (dir.path() / "corpus_text_document").string()}) {
    for (const char* split : {"train", "val", ""}) {
      SCOPED_TRACE(pattern + " split " + split);
      const auto found = md::find_shards(dir.path(), md::ShardFormat::kMegatron, pattern, split);
      ASSERT_EQ(found.size(), 1u);
      EXPECT_EQ(found[0], idx);
    }
  }
  // A prefix whose .bin is missing is no dataset: refused naming where it looked.
  fs::remove(dir.path() / "other_text_document.bin");
  const auto msg = error_of(
      [&] { md::find_shards(dir.path(), md::ShardFormat::kMegatron, "other_text_document", ""); });
  EXPECT_NE(msg.find("no megatron shards"), std::string::npos) << msg;
}

// Megatron's weighted blend "W1 P1 W2 P2" is refused in one line naming what is supported, in
// a recipe's path and on the command line; a path that exists with spaces is a path.
TEST(FindShards, AWeightedBlendIsRefusedInOneLine) {
  TempDir dir;
  write_megatron(dir.path() / "a_text_document", {{5, 6, 7}}, md::kMegatronDtypeUint16);
  write_megatron(dir.path() / "b_text_document", {{8, 9}}, md::kMegatronDtypeUint16);
  const std::string blend = "0.3 a_text_document 0.7 b_text_document";
  for (const auto& msg :
       {error_of([&] { md::find_shards(dir.path(), md::ShardFormat::kMegatron, blend, ""); }),
        error_of([&] { md::command_line_data_path(blend); })}) {
    EXPECT_NE(msg.find("weighted blend"), std::string::npos) << msg;
    EXPECT_NE(msg.find("pass one Megatron prefix, a directory or a glob"), std::string::npos)
        << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  fs::create_directories(dir.path() / "2024 web");
  md::write_llmc_shard(dir.path() / "2024 web" / "x_train_0.bin", std::vector<uint32_t>{1, 2},
                       md::TokenWidth::kU16);
  EXPECT_EQ(md::find_shards(dir.path(), md::ShardFormat::kLlmc, "2024 web", "train").size(), 1u);
}

// A command-line --data-path is relative to the working directory, not to --data-dir.
TEST(FindShards, ACommandLineDataPathIsRelativeToTheWorkingDirectory) {
  TempDir dir;
  const fs::path cwd = fs::current_path();
  fs::current_path(dir.path());
  write_megatron(dir.path() / "corpus_text_document", {{5, 6, 7}}, md::kMegatronDtypeUint16);
  const std::string path = md::command_line_data_path("corpus_text_document");
  EXPECT_EQ(path, (dir.path() / "corpus_text_document").string());
  EXPECT_EQ(md::command_line_data_path("/abs/x_{split}_*.bin"), "/abs/x_{split}_*.bin");
  EXPECT_EQ(md::command_line_data_path(""), "");
  fs::current_path(cwd);
  // Resolved, it names the dataset whatever --data-dir is.
  const auto found = md::find_shards("/nonexistent-data-dir", md::ShardFormat::kMegatron, path, "");
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0], dir.path() / "corpus_text_document.idx");
}

TEST(Sampler, OneGlobalSequenceWhateverTheWorldSize) {
  TempDir dir;
  auto paths = md::ensure_builtin_corpus(dir.path(), 2, 20000);
  md::Shard a(paths[0], md::ShardFormat::kLlmc), b(paths[1], md::ShardFormat::kLlmc);
  const md::Shard* views[] = {&a, &b};
  const uint32_t seq = 16, batch = 4;
  md::Sampler w1(views, {.seq_len = seq, .batch = batch, .world = 1, .seed = 7});
  md::Sampler w2(views, {.seq_len = seq, .batch = batch, .world = 2, .seed = 7});
  md::Sampler w4(views, {.seq_len = seq, .batch = batch, .world = 4, .seed = 7});
  const size_t bytes = w1.spec().slot_bytes();
  EXPECT_EQ(bytes, 64 + size_t{batch} * (seq + 1) * 2);
  auto slot = [&](const md::Sampler& s, uint32_t step, uint32_t rank) {
    std::vector<std::byte> out(bytes);
    s.fill(step, rank, out);
    return std::vector<std::byte>(out.begin() + 64, out.end());
  };
  // Global batch g: world 1 step g+1; world 2 step g/2+1 rank g%2; world 4 likewise.
  for (uint32_t g = 0; g < 12; ++g) {
    auto ref = slot(w1, g + 1, 0);
    EXPECT_EQ(ref, slot(w2, g / 2 + 1, g % 2)) << g;
    EXPECT_EQ(ref, slot(w4, g / 4 + 1, g % 4)) << g;
  }
  EXPECT_NE(slot(w2, 1, 0), slot(w2, 1, 1));
  // Within one epoch every window is used exactly once; the next epoch reshuffles.
  std::set<uint64_t> seen;
  const uint64_t n = w1.windows();
  for (uint64_t p = 0; p < n; ++p) {
    auto w = w1.window_at(p);
    seen.insert(uint64_t{w.shard} << 40 | w.start);
  }
  EXPECT_EQ(seen.size(), n);
  EXPECT_NE(w1.window_at(0).start + w1.window_at(1).start,
            w1.window_at(n).start + w1.window_at(n + 1).start);
  auto st = w2.state_after(10);
  EXPECT_EQ(st.epoch * n + st.cursor, 10u * 2 * batch);
  // A resumed sampler at another world size continues the same sequence.
  md::Sampler resumed(views,
                      {.seq_len = seq, .batch = batch, .world = 4, .seed = 7, .start = 8 * batch});
  EXPECT_EQ(slot(resumed, 1, 3), slot(w1, 12, 0));
  std::vector<std::byte> out(bytes);
  EXPECT_THROW(w2.fill(0, 0, out), mc::Error);
  EXPECT_THROW(w2.fill(1, 2, out), mc::Error);
}

TEST(Sampler, HeaderCarriesTheStateAndTokensTheWindows) {
  TempDir dir;
  std::vector<uint32_t> tokens(1000);
  for (uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = 70000 + i;
  md::write_llmc_shard(dir.path() / "w.bin", tokens, md::TokenWidth::kU32);
  md::Shard s(dir.path() / "w.bin", md::ShardFormat::kLlmc);
  const md::Shard* views[] = {&s};
  md::Sampler sm(views, {.seq_len = 9, .batch = 3, .world = 2, .token_bytes = 4, .seed = 1});
  std::vector<std::byte> out(sm.spec().slot_bytes());
  sm.fill(5, 1, out);
  mc::recipe::BatchHeader h;
  std::memcpy(&h, out.data(), sizeof h);
  EXPECT_EQ(h.magic, mc::recipe::kBatchMagic);
  EXPECT_EQ(h.token_bytes, 4u);
  EXPECT_EQ(h.step, 5u);
  EXPECT_EQ(h.windows, sm.windows());
  EXPECT_EQ(h.position, (4u * 2 + 1) * 3);
  EXPECT_EQ(h.next_position, 5u * 2 * 3);
  for (uint32_t row = 0; row < 3; ++row) {
    const auto w = sm.window_at(h.position + row);
    for (uint32_t i = 0; i < 10; ++i) {
      uint32_t t;
      std::memcpy(&t, out.data() + 64 + (row * 10 + i) * 4, 4);
      EXPECT_EQ(t, tokens[w.start + i]);
    }
  }
}

TEST(Sampler, UnpackedWindowsStayInsideDocuments) {
  TempDir dir;
  // Documents led by EOS 0: lengths 25, 5 (too short for a window of 11), 31.
  std::vector<uint32_t> tokens;
  uint32_t next = 1;
  for (uint32_t len : {25u, 5u, 31u}) {
    tokens.push_back(0);
    for (uint32_t i = 1; i < len; ++i) tokens.push_back(next++ % 200 + 1);
  }
  md::write_llmc_shard(dir.path() / "d.bin", tokens, md::TokenWidth::kU16);
  md::Shard s(dir.path() / "d.bin", md::ShardFormat::kLlmc);
  s.find_documents(0);
  ASSERT_EQ(s.document_starts().size(), 3u);
  const md::Shard* views[] = {&s};
  md::Sampler sm(views, {.seq_len = 10, .batch = 1, .world = 1, .seed = 3, .pack = false});
  EXPECT_EQ(sm.windows(), 2u + 3u);  // (25-1)/10 + (31-1)/10
  EXPECT_EQ(sm.documents_without_window(), 1u);
  for (uint64_t p = 0; p < sm.windows(); ++p) {
    const auto w = sm.window_at(p);
    for (uint64_t i = 1; i <= 10; ++i) EXPECT_NE(s.token(w.start + i), 0u) << p;
  }
  auto msg = error_of(
      [&] { md::Sampler too_big(views, {.seq_len = 10, .batch = 3, .world = 2, .pack = false}); });
  EXPECT_NE(msg.find("rule data.windows"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fewer than one global batch (2 ranks x 3 rows)"), std::string::npos) << msg;
}

// fill() is the window order's contract (the golden losses were recorded with it): every row of
// every slot is the window window_at() names, across epoch boundaries, both slot widths, mixed
// shard widths, packed and unpacked; and the bytes are pinned by digests of what fill wrote when
// this test was added, so a faster fill must write the very same slots.
TEST(Sampler, FillIsTheWindowSequenceBitForBit) {
  TempDir dir;
  std::vector<uint32_t> a(1500), b(1100);
  uint32_t x = 12345;
  for (auto* v : {&a, &b})
    for (size_t i = 0; i < v->size(); ++i) {
      x = x * 1103515245u + 12345u;
      (*v)[i] = i % 37 == 0 ? 0 : (x >> 8) % 60000 + 1;  // EOS 0 every 37 tokens
    }
  md::write_llmc_shard(dir.path() / "a.bin", a, md::TokenWidth::kU16);
  md::write_llmc_shard(dir.path() / "b.bin", b, md::TokenWidth::kU32);
  md::Shard sa(dir.path() / "a.bin", md::ShardFormat::kLlmc);
  md::Shard sb(dir.path() / "b.bin", md::ShardFormat::kLlmc);
  const md::Shard* views[] = {&sa, &sb};
  struct Case {
    md::SamplerConfig config;
    uint32_t steps;
    const char* digest;
  };
  const Case cases[] = {
      {{.seq_len = 7, .batch = 5, .world = 3, .token_bytes = 2, .seed = 11},
       80,
       "4c785df3b0e4fa08"},
      {{.seq_len = 13, .batch = 4, .world = 2, .token_bytes = 4, .seed = 5, .start = 37},
       60,
       "5c78bd4aba41a02c"},
      {{.seq_len = 5, .batch = 3, .world = 2, .token_bytes = 2, .seed = 9, .pack = false},
       90,
       "29f1b07b7ec055ea"},
      {{.seq_len = 64, .batch = 16, .world = 2, .token_bytes = 2, .seed = 1234},
       30,
       "23da8177dccb3db1"},
  };
  for (size_t k = 0; k < std::size(cases); ++k) {
    const Case& c = cases[k];
    if (!c.config.pack) {
      sa.find_documents(0);
      sb.find_documents(0);
    }
    md::Sampler sm(views, c.config);
    const uint64_t row = sm.spec().row_tokens();
    std::string all;
    std::vector<std::byte> slot(sm.spec().slot_bytes());
    uint64_t epochs = 0;
    for (uint32_t step = 1; step <= c.steps; ++step)
      for (uint32_t rank = 0; rank < c.config.world; ++rank) {
        sm.fill(step, rank, slot);
        const uint64_t pos = sm.position(step, rank);
        epochs = std::max(epochs, (pos + c.config.batch) / sm.windows());
        for (uint32_t r = 0; r < c.config.batch; ++r) {
          const auto w = sm.window_at(pos + r);
          const md::Shard& s = *views[w.shard];
          for (uint64_t i = 0; i < row; ++i) {
            uint32_t t = 0;
            std::memcpy(&t, slot.data() + 64 + (r * row + i) * c.config.token_bytes,
                        c.config.token_bytes);
            ASSERT_EQ(t, s.token(w.start + i)) << k << " step " << step << " rank " << rank;
          }
        }
        all.append(reinterpret_cast<const char*>(slot.data()), slot.size());
      }
    EXPECT_GE(epochs, 1u) << k << ": the case must cross an epoch boundary";
    EXPECT_EQ(mc::xxh3_hex(all), c.digest) << k;
  }
}

TEST(Dataset, PreflightValidatesEveryFileAndRoundTripsTheContract) {
  TempDir dir;
  fs::create_directories(dir.path() / "shards");
  for (int i = 0; i < 3; ++i) {
    std::vector<uint32_t> t(500);
    for (uint32_t j = 0; j < t.size(); ++j) t[j] = (j * 7 + i) % 300;
    md::write_llmc_shard(dir.path() / "shards" / fmt::format("x_train_{}.bin", i), t,
                         md::TokenWidth::kU16);
  }
  mc::recipe::Recipe r;
  r.name = "t";
  r.model.vocab_size = 300;
  r.model.seq_len = 16;
  r.train.batch_size = 2;
  r.data.source = "llmc";
  r.data.path = "shards";
  auto d = md::resolve_dataset(r, mc::recipe::resolve_batch(r, 2, 0), dir.path(), 2);
  ASSERT_EQ(d.files.size(), 3u);
  EXPECT_EQ(d.windows, 3u * (499 / 16));
  EXPECT_EQ(d.files[1].max_token, 299u);
  EXPECT_EQ(d.files[1].xxh3.size(), 16u);
  capnp::MallocMessageBuilder msg;
  auto spec = msg.initRoot<mc::schema::Dataset>();
  md::to_spec(d, spec);
  auto back = md::from_spec(spec.asReader());
  EXPECT_EQ(back.files.size(), 3u);
  EXPECT_EQ(back.files[2].path, d.files[2].path);
  EXPECT_EQ(back.windows, d.windows);
  EXPECT_EQ(md::open_dataset(back, r.data.pack).size(), 3u);
  // A vocabulary smaller than the data's, an empty folder, too little data: one line each.
  r.model.vocab_size = 299;
  auto e =
      error_of([&] { md::resolve_dataset(r, mc::recipe::resolve_batch(r, 2, 0), dir.path(), 2); });
  EXPECT_NE(e.find("token 299"), std::string::npos) << e;
  EXPECT_NE(e.find("vocab_size 299"), std::string::npos) << e;
  r.model.vocab_size = 300;
  r.data.path = "nothing";
  fs::create_directories(dir.path() / "nothing");
  e = error_of([&] { md::resolve_dataset(r, mc::recipe::resolve_batch(r, 2, 0), dir.path(), 2); });
  EXPECT_NE(e.find("no llmc shards"), std::string::npos) << e;
  r.data.path = "shards";
  r.train.batch_size = 50;
  e = error_of([&] { md::resolve_dataset(r, mc::recipe::resolve_batch(r, 2, 0), dir.path(), 2); });
  EXPECT_NE(e.find("rule data.windows"), std::string::npos) << e;
}

// The validation order (README.md "Validation loss"): an evaluation's windows are the split's
// windows i x split / windows in file order, the same whatever the number of data ranks and
// batch, every one read once; each slot's header names its rows, its tag and where it starts.
TEST(ValidationSampler, TheSameWindowsInOneOrderAtEveryWorld) {
  TempDir dir;
  std::vector<std::unique_ptr<md::Shard>> files;
  for (int i = 0; i < 2; ++i) {
    std::vector<uint32_t> t(1000 + 300 * i);
    uint64_t x = 11 + i;  // no two windows alike
    for (auto& v : t) v = static_cast<uint32_t>((x = x * 6364136223846793005ULL + 1) >> 56);
    md::write_llmc_shard(dir.path() / fmt::format("val_{}.bin", i), t, md::TokenWidth::kU16);
    files.push_back(std::make_unique<md::Shard>(dir.path() / fmt::format("val_{}.bin", i),
                                                md::ShardFormat::kLlmc));
  }
  const md::Shard* views[] = {files[0].get(), files[1].get()};
  constexpr uint32_t T = 16;
  const uint64_t split = 999 / T + 1299 / T;  // windows of 17 tokens, every 16
  // The rows of every data rank's slots in rank and slot order: the evaluation's sequence.
  auto sequence = [&](uint32_t ranks, uint32_t batch, uint64_t windows) {
    const md::ValidationSampler v(
        views,
        {.seq_len = T, .batch = batch, .data_ranks = ranks, .token_bytes = 2, .windows = windows});
    EXPECT_EQ(v.split_windows(), split);
    std::vector<std::vector<uint16_t>> rows;
    std::vector<std::byte> slot(v.spec().slot_bytes());
    for (uint32_t d = 0; d < ranks; ++d)
      for (uint32_t k = 0; k < v.share().slots(d); ++k) {
        const uint64_t tag = mc::recipe::validation_tag(2, k);
        const size_t bytes = v.fill(d, k, tag, slot);
        mc::recipe::BatchHeader h;
        std::memcpy(&h, slot.data(), sizeof h);
        EXPECT_EQ(h.batch, v.share().rows(d, k));
        EXPECT_EQ(h.step, tag);
        EXPECT_EQ(h.position, v.share().first(d) + uint64_t{k} * batch);
        EXPECT_EQ(h.windows, v.share().windows);
        EXPECT_EQ(bytes, sizeof h + uint64_t{h.batch} * (T + 1) * 2);
        for (uint32_t r = 0; r < h.batch; ++r) {
          std::vector<uint16_t> row(T + 1);
          std::memcpy(row.data(), slot.data() + sizeof h + uint64_t{r} * (T + 1) * 2,
                      row.size() * 2);
          rows.push_back(std::move(row));
        }
      }
    return rows;
  };
  const auto one = sequence(1, 8, 50);
  ASSERT_EQ(one.size(), 50u);
  for (const auto& [ranks, batch] : {std::pair{2u, 8u}, {3u, 4u}, {4u, 3u}, {8u, 16u}, {64u, 1u}})
    EXPECT_EQ(sequence(ranks, batch, 50), one) << ranks << " ranks, batch " << batch;
  // Window i is the split's window i x split / 50: the first, and one from the second file.
  const std::vector<uint16_t> first(one[0]);
  for (uint32_t i = 0; i <= T; ++i) EXPECT_EQ(first[i], files[0]->token(i));
  const uint64_t w = 49 * split / 50, in_second = w - 999 / T;
  ASSERT_GE(w, 999u / T);
  for (uint32_t i = 0; i <= T; ++i) EXPECT_EQ(one[49][i], files[1]->token(in_second * T + i));
  // Asking for more windows than the split holds reads every one, once.
  const auto all = sequence(3, 8, 100000);
  EXPECT_EQ(all.size(), split);
  EXPECT_EQ(std::set(all.begin(), all.end()).size(), all.size());
}

// The val split of a run, or one line saying why it has none (README.md "Validation loss").
TEST(Dataset, ValidationSplitOrWhyItIsOff) {
  TempDir dir;
  fs::create_directories(dir.path() / "shards");
  for (const char* split : {"train", "val"}) {
    std::vector<uint32_t> t(700);
    for (uint32_t j = 0; j < t.size(); ++j) t[j] = (j * 7) % 300;
    md::write_llmc_shard(dir.path() / "shards" / fmt::format("x_{}_0.bin", split), t,
                         md::TokenWidth::kU16);
  }
  mc::recipe::Recipe r;
  r.name = "t";
  r.model.vocab_size = 300;
  r.model.seq_len = 16;
  r.train.batch_size = 2;
  r.train.eval_every = 5;
  r.train.eval_tokens = 160;
  r.data.source = "llmc";
  r.data.path = "shards";
  const auto batch = mc::recipe::resolve_batch(r, 2, 0);
  auto resolve = [&] {
    const auto train = md::resolve_dataset(r, batch, dir.path(), 2);
    return md::resolve_validation(r, batch, train, dir.path(), 2);
  };
  auto v = resolve();
  ASSERT_TRUE(v.dataset) << v.off;
  EXPECT_EQ(v.dataset->files.size(), 1u);
  EXPECT_EQ(v.dataset->files[0].path.filename(), "x_val_0.bin");
  EXPECT_EQ(v.split_windows, 699u / 16);
  EXPECT_EQ(v.windows, 10u);
  EXPECT_EQ(v.digest.size(), 16u);
  EXPECT_TRUE(v.off.empty());
  EXPECT_TRUE(v.notice.empty());
  // More tokens than the split holds: every window, said once.
  r.train.eval_tokens = 16000;
  v = resolve();
  EXPECT_EQ(v.windows, v.split_windows);
  EXPECT_NE(v.notice.find("fewer than train.eval_tokens asks"), std::string::npos) << v.notice;
  r.train.eval_tokens = 160;
  // No evaluation asked: nothing resolved, nothing said.
  r.train.eval_every = 0;
  v = resolve();
  EXPECT_FALSE(v.dataset);
  EXPECT_TRUE(v.off.empty());
  r.train.eval_every = 5;
  // Training on the val split, a glob that names the same files for both, no val files: off,
  // one line each naming why and what to do.
  r.data.split = "val";
  v = resolve();
  EXPECT_FALSE(v.dataset);
  EXPECT_NE(v.off.find("trains on the val split"), std::string::npos) << v.off;
  r.data.split = "train";
  r.data.path = "shards/*.bin";
  v = resolve();
  EXPECT_FALSE(v.dataset);
  EXPECT_NE(v.off.find("put \"{split}\""), std::string::npos) << v.off;
  fs::remove(dir.path() / "shards" / "x_val_0.bin");
  r.data.path = "shards";
  v = resolve();
  EXPECT_FALSE(v.dataset);
  EXPECT_NE(v.off.find("the data has no val split"), std::string::npos) << v.off;
  EXPECT_NE(v.off.find("megacpp prepare --val-every"), std::string::npos) << v.off;
  for (const auto& line : {v.off}) EXPECT_EQ(line.find('\n'), std::string::npos);
  // A directory of Megatron datasets splits by name like llm.c files.
  fs::create_directories(dir.path() / "mega");
  write_megatron(dir.path() / "mega" / "web_train_text_document", {{5, 6, 7, 8}, {9, 10}},
                 md::kMegatronDtypeUint16);
  {
    std::vector<std::vector<uint32_t>> docs(40, std::vector<uint32_t>(20, 3));
    write_megatron(dir.path() / "mega" / "web_train2_text_document", docs,
                   md::kMegatronDtypeUint16);
    write_megatron(dir.path() / "mega" / "web_val_text_document", docs, md::kMegatronDtypeUint16);
  }
  r.data.source = "megatron";
  r.data.path = "mega";
  v = resolve();
  ASSERT_TRUE(v.dataset) << v.off;
  ASSERT_EQ(v.dataset->files.size(), 1u);
  EXPECT_EQ(v.dataset->files[0].path.filename(), "web_val_text_document.bin");  // its tokens
  // A Megatron prefix is one dataset for every split: no val split, said so.
  r.data.path = "mega/web_train2_text_document";
  v = resolve();
  EXPECT_FALSE(v.dataset);
  EXPECT_NE(v.off.find("names the same files"), std::string::npos) << v.off;
  // The built-in corpus has one: a generated shard no training shard equals.
  mc::recipe::Recipe b;
  b.name = "b";
  b.model.seq_len = 16;
  b.train.eval_every = 5;
  b.train.eval_tokens = 160;
  b.data.shard_tokens = 5000;
  const auto bb = mc::recipe::resolve_batch(b, 2, 0);
  const auto train = md::resolve_dataset(b, bb, dir.path(), 2);
  v = md::resolve_validation(b, bb, train, dir.path(), 2);
  ASSERT_TRUE(v.dataset) << v.off;
  EXPECT_EQ(v.dataset->files[0].path.filename(), "val_000000.bin");
  EXPECT_EQ(v.dataset->files[0].tokens, 5000u);
  for (const auto& f : train.files) EXPECT_NE(f.xxh3, v.dataset->files[0].xxh3);
}

TEST(Dataset, ChecksAreCachedUntilAFileChanges) {
  TempDir dir;
  fs::create_directories(dir.path() / "s");
  for (int i = 0; i < 2; ++i)
    md::write_llmc_shard(dir.path() / "s" / fmt::format("a_train_{}.bin", i),
                         std::vector<uint32_t>(400, 7 + i), md::TokenWidth::kU16);
  mc::recipe::Recipe r;
  r.name = "t";
  r.model.vocab_size = 300;
  r.model.seq_len = 16;
  r.train.batch_size = 2;
  r.data.source = "llmc";
  r.data.path = "s";
  auto first = md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1);
  EXPECT_EQ(first.files_scanned, 2u);
  ASSERT_TRUE(fs::exists(dir.path() / "s" / md::kCheckCacheName));
  auto second = md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1);
  EXPECT_EQ(second.files_scanned, 0u);
  EXPECT_EQ(second.files[1].xxh3, first.files[1].xxh3);
  EXPECT_EQ(second.files[1].max_token, 8u);
  // A rewritten file (new inode, new mtime) is scanned again, and a bad one is still refused.
  std::vector<uint32_t> bad(400, 7);
  bad[10] = 400;
  md::write_llmc_shard(dir.path() / "s" / "a_train_1.bin", bad, md::TokenWidth::kU16);
  auto e =
      error_of([&] { md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1); });
  EXPECT_NE(e.find("token 400 at index 10"), std::string::npos) << e;
  // A smaller vocabulary than a cached largest token rescans (and names the offset).
  md::write_llmc_shard(dir.path() / "s" / "a_train_1.bin", std::vector<uint32_t>(400, 8),
                       md::TokenWidth::kU16);
  EXPECT_EQ(md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1).files_scanned,
            1u);
  r.model.vocab_size = 8;
  e = error_of([&] { md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1); });
  EXPECT_NE(e.find("token 8 at index 0"), std::string::npos) << e;
}

namespace {

// Rewrites `p` in place (same inode, same size) with `tokens`, then puts its mtime back: the
// change a name/size/mtime/inode identity cannot see.
void rewrite_in_place_keeping_mtime(const fs::path& p, const std::vector<uint32_t>& tokens) {
  struct stat before {};
  ASSERT_EQ(::stat(p.c_str(), &before), 0);
  const fs::path tmp = p.string() + ".new";
  md::write_llmc_shard(tmp, tokens, md::TokenWidth::kU16);
  const std::string bytes = bytes_of(tmp);
  fs::remove(tmp);
  ASSERT_EQ(bytes.size(), static_cast<size_t>(before.st_size));
  patch(p, 0, bytes.data(), bytes.size());
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, p.c_str(), times, 0), 0);
  struct stat after {};
  ASSERT_EQ(::stat(p.c_str(), &after), 0);
  ASSERT_EQ(after.st_ino, before.st_ino);
  ASSERT_EQ(after.st_size, before.st_size);
  ASSERT_EQ(after.st_mtim.tv_sec, before.st_mtim.tv_sec);
  ASSERT_EQ(after.st_mtim.tv_nsec, before.st_mtim.tv_nsec);
}

mc::recipe::Recipe cache_recipe() {
  mc::recipe::Recipe r;
  r.name = "t";
  r.model.vocab_size = 300;
  r.model.seq_len = 16;
  r.train.batch_size = 2;
  r.data.source = "llmc";
  r.data.path = "s";
  return r;
}

}  // namespace

// The cache's identity includes the ctime, which no user-space call sets back: bytes rewritten
// in place with the same size and the mtime restored are scanned again, and a bad token in
// them is refused.
TEST(Dataset, CacheSeesAnInPlaceRewriteWithItsMtimeRestored) {
  TempDir dir;
  fs::create_directories(dir.path() / "s");
  const fs::path shard = dir.path() / "s" / "a_train_0.bin";
  md::write_llmc_shard(shard, std::vector<uint32_t>(400, 7), md::TokenWidth::kU16);
  const auto r = cache_recipe();
  const auto first = md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1);
  ASSERT_EQ(first.files_scanned, 1u);
  ASSERT_EQ(md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1).files_scanned,
            0u);
  std::vector<uint32_t> bad(400, 7);
  bad[10] = 400;
  rewrite_in_place_keeping_mtime(shard, bad);
  auto e =
      error_of([&] { md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1); });
  EXPECT_NE(e.find("token 400 at index 10"), std::string::npos) << e;
  // A good rewrite is rescanned and its new checksum recorded.
  rewrite_in_place_keeping_mtime(shard, std::vector<uint32_t>(400, 9));
  const auto again = md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1);
  EXPECT_EQ(again.files_scanned, 1u);
  EXPECT_NE(again.files[0].xxh3, first.files[0].xxh3);
  EXPECT_EQ(again.files[0].xxh3, md::xxh3_file_hex(shard));
}

// A dataset.json that records a file's XXH3 is checked against the file's bytes on every
// pre-flight: a check-cache line whose identity matches (a stale or forged one here: its hash
// edited) never stands in for it.
TEST(Dataset, CacheNeverStandsInForTheDatasetManifestHash) {
  TempDir dir;
  const fs::path s = dir.path() / "s";
  fs::create_directories(s);
  const fs::path shard = s / "a_train_0.bin";
  md::write_llmc_shard(shard, std::vector<uint32_t>(400, 7), md::TokenWidth::kU16);
  md::DatasetManifest m;
  m.token_width = 2;
  m.vocab_size = 257;
  m.eos_id = 256;
  m.tokenizer = {"byte", "", "", 257};
  m.shards.push_back({"a_train_0.bin", "train", 400, 0,
                      md::llmc_file_bytes(400, md::TokenWidth::kU16), md::xxh3_file_hex(shard)});
  md::write_dataset_manifest(s, m);
  const auto r = cache_recipe();
  EXPECT_EQ(md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1).files_scanned,
            1u);
  std::string cache = bytes_of(s / md::kCheckCacheName);
  const auto hash_at = cache.find(m.shards[0].xxh3);
  ASSERT_NE(hash_at, std::string::npos) << cache;
  cache.replace(hash_at, 16, "0123456789abcdef");
  mc::write_file_atomic(s / md::kCheckCacheName, cache);
  const auto second = md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1);
  EXPECT_EQ(second.files_scanned, 1u)
      << "a file the dataset.json records a hash for is hashed on every pre-flight";
  EXPECT_EQ(second.files[0].xxh3, m.shards[0].xxh3);
  // The bytes rewritten in place, size and mtime kept: refused against dataset.json.
  rewrite_in_place_keeping_mtime(shard, std::vector<uint32_t>(400, 9));
  auto e =
      error_of([&] { md::resolve_dataset(r, mc::recipe::resolve_batch(r, 1, 0), dir.path(), 1); });
  EXPECT_NE(e.find("does not match"), std::string::npos) << e;
  EXPECT_NE(e.find(m.shards[0].xxh3), std::string::npos) << e;
}
