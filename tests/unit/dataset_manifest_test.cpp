// data/dataset_manifest.h: the manifest's round trip, every validation rule refused with its
// one-line message, and staging a dataset onto a hot directory.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/util.h"
#include "data/dataset_manifest.h"
#include "data/shards.h"
#include "tests/unit/temp_dir.h"

namespace fs = std::filesystem;
using namespace megacpp;
using namespace megacpp::data;

namespace {

using test_support::TempDir;

// A two-shard byte-level dataset in `dir` (train 5 tokens, val 3 tokens) with its manifest.
DatasetManifest make_dataset(const fs::path& dir) {
  fs::create_directories(dir);
  DatasetManifest m;
  m.token_width = 2;
  m.vocab_size = 257;
  m.eos_id = 256;
  m.tokenizer = {"byte", "", "", 257};
  m.inputs = {{"t/a.txt", 4, std::string(16, 'a'), 1, ""},
              {"t/b.txt", 2, std::string(16, 'b'), 1, ""},
              {"t/c.bin", 1, std::string(16, 'c'), 0, "not UTF-8: invalid byte 0xff at offset 0"}};
  m.documents = 2;
  m.skipped_files = 1;
  const std::vector<std::vector<uint32_t>> shards = {{256, 'a', 'b', 'c', 'd'}, {256, 'x', 'y'}};
  const char* names[] = {"train_000000.bin", "val_000000.bin"};
  const char* splits[] = {"train", "val"};
  for (size_t i = 0; i < 2; ++i) {
    write_llmc_shard(dir / names[i], shards[i], TokenWidth::kU16);
    m.shards.push_back({names[i], splits[i], static_cast<uint32_t>(shards[i].size()), 1,
                        llmc_file_bytes(shards[i].size(), TokenWidth::kU16),
                        xxh3_file_hex(dir / names[i])});
  }
  write_dataset_manifest(dir, m);
  return m;
}

std::string error_of(const std::function<void()>& f, ErrorKind* kind = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (kind) *kind = e.kind();
    return e.what();
  }
  return "(no error)";
}

std::vector<std::string> tmp_files(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().find(".tmp.") != std::string::npos) {
      out.push_back(e.path().filename().string());
    }
  }
  return out;
}

void flip_byte(const fs::path& p, size_t offset) {
  std::string bytes = read_file(p);
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x5a);
  write_file_atomic(p, bytes);
}

}  // namespace

TEST(DatasetManifest, RoundTripIsExactAndStable) {
  TempDir tmp;
  const DatasetManifest m = make_dataset(tmp.path());
  const std::string text = read_file(tmp.path() / "dataset.json");
  const DatasetManifest r = read_dataset_manifest(tmp.path());
  EXPECT_EQ(r.token_width, 2u);
  EXPECT_EQ(r.vocab_size, 257u);
  EXPECT_EQ(r.eos_id, 256u);
  EXPECT_EQ(r.documents, 2u);
  EXPECT_EQ(r.skipped_files, 1u);
  EXPECT_EQ(r.tokenizer.kind, "byte");
  ASSERT_EQ(r.inputs.size(), 3u);
  EXPECT_EQ(r.inputs[2].skipped, m.inputs[2].skipped);
  ASSERT_EQ(r.shards.size(), 2u);
  EXPECT_EQ(r.shards[1].file, "val_000000.bin");
  EXPECT_EQ(r.shards[1].split, "val");
  EXPECT_EQ(r.shards[1].tokens, 3u);
  EXPECT_EQ(r.shards[1].bytes, llmc_file_bytes(3, TokenWidth::kU16));
  EXPECT_EQ(r.shards[0].xxh3, xxh3_hex(read_file(tmp.path() / "train_000000.bin")));
  // Same manifest, same bytes; nothing time- or host-dependent in it.
  EXPECT_EQ(dataset_manifest_json(r), text);
  EXPECT_EQ(text.find("At"), std::string::npos);
  EXPECT_NE(text.find("\"tokenWidth\": 2"), std::string::npos);
}

TEST(DatasetManifest, StreamingHashEqualsWholeFileHash) {
  TempDir tmp;
  std::string big(size_t{9} << 20, '\0');  // more than one 8 MiB chunk
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7 + (i >> 13));
  write_file_atomic(tmp.path() / "big", big);
  EXPECT_EQ(xxh3_file_hex(tmp.path() / "big"), xxh3_hex(big));
  write_file_atomic(tmp.path() / "empty", "");
  EXPECT_EQ(xxh3_file_hex(tmp.path() / "empty"), xxh3_hex(""));
}

TEST(DatasetManifest, EveryRuleIsRefusedWithOneLine) {
  TempDir tmp;
  const DatasetManifest good = make_dataset(tmp.path());
  struct Case {
    const char* field;
    std::function<void(DatasetManifest&)> mutate;
  };
  const std::vector<Case> cases = {
      {"schemaVersion", [](auto& m) { m.schema_version = 2; }},
      {"format", [](auto& m) { m.format = "megatron"; }},
      {"tokenWidth", [](auto& m) { m.token_width = 3; }},
      {"tokenWidth", [](auto& m) { m.vocab_size = m.tokenizer.vocab_size = 70000; }},
      {"vocabSize", [](auto& m) { m.vocab_size = m.tokenizer.vocab_size = 1, m.eos_id = 0; }},
      {"eosId", [](auto& m) { m.eos_id = 257; }},
      {"tokenizer.kind", [](auto& m) { m.tokenizer.kind = "wordpiece"; }},
      {"tokenizer.file", [](auto& m) { m.tokenizer.file = "tokenizer.model"; }},
      {"tokenizer.file",
       [](auto& m) {
         m.tokenizer = {"sentencepiece-bpe", "../tokenizer.model", std::string(16, '0'), 257};
       }},
      {"tokenizer.xxh3",
       [](auto& m) {
         m.tokenizer = {"sentencepiece-bpe", "tokenizer.model", "XYZ", 257};
       }},
      {"tokenizer.vocabSize", [](auto& m) { m.tokenizer.vocab_size = 300; }},
      {"inputs[0].xxh3", [](auto& m) { m.inputs[0].xxh3 = "0123"; }},
      {"inputs[2].documents", [](auto& m) { m.inputs[2].documents = 1; }},
      {"skippedFiles", [](auto& m) { m.skipped_files = 0; }},
      {"shards[0].file", [](auto& m) { m.shards[0].file = "../train_000000.bin"; }},
      {"shards[0].file", [](auto& m) { m.shards[0].file = "sub/train_000000.bin"; }},
      {"shards[1].file", [](auto& m) { m.shards[1].file = ".."; }},
      {"shards[1].file", [](auto& m) { m.shards[1].file = m.shards[0].file; }},
      {"shards[0].split", [](auto& m) { m.shards[0].split = "test"; }},
      {"shards[0].bytes", [](auto& m) { m.shards[0].bytes += 2; }},
      {"shards[1].bytes", [](auto& m) { m.shards[1].tokens += 1; }},
      {"shards[0].xxh3", [](auto& m) { m.shards[0].xxh3 = std::string(16, 'G'); }},
      {"documents", [](auto& m) { m.shards[1].documents = 0; }},
  };
  for (const auto& c : cases) {
    DatasetManifest m = good;
    c.mutate(m);
    ErrorKind kind{};
    const std::string msg =
        error_of([&] { validate_dataset_manifest(m, "/d/dataset.json"); }, &kind);
    EXPECT_EQ(kind, ErrorKind::kCorruption) << c.field << ": " << msg;
    EXPECT_TRUE(msg.starts_with(std::string("/d/dataset.json: ") + c.field + " "))
        << c.field << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find("re-run megacpp prepare"), std::string::npos) << msg;
    // Writing refuses it too, before anything reaches the disk.
    EXPECT_EQ(error_of([&] { dataset_manifest_json(m); }, &kind),
              msg.substr(std::string("/d/").size()));
    EXPECT_EQ(kind, ErrorKind::kInternal);
  }
}

TEST(DatasetManifest, ReadRefusesAnEditedFileNamingIt) {
  TempDir tmp;
  make_dataset(tmp.path());
  const fs::path path = tmp.path() / "dataset.json";
  std::string text = read_file(path);
  const auto at = text.find("\"eosId\": 256");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 12, "\"eosId\": 999");
  write_file_atomic(path, text);
  ErrorKind kind{};
  const std::string msg = error_of([&] { read_dataset_manifest(tmp.path()); }, &kind);
  EXPECT_EQ(kind, ErrorKind::kCorruption);
  EXPECT_EQ(msg, path.string() +
                     ": eosId 999 is not below vocabSize 257; re-run megacpp prepare to rewrite "
                     "the dataset");
  write_file_atomic(path, "{ not json");
  EXPECT_NE(error_of([&] { read_dataset_manifest(tmp.path()); }, &kind).find(path.string()),
            std::string::npos);
  EXPECT_EQ(kind, ErrorKind::kCorruption);
  fs::remove(path);
  const std::string missing = error_of([&] { read_dataset_manifest(tmp.path()); }, &kind);
  EXPECT_EQ(kind, ErrorKind::kSystem);
  EXPECT_NE(missing.find("dataset.json: cannot read the dataset manifest"), std::string::npos);
}

// Found by tests/fuzz/fuzz_dataset_manifest: Cap'n Proto 0.9's decoder read the hex letters of
// \u escapes as 0-5, so an input path holding a control character (written "\u000e") came
// back as another character. Paths with control characters and non-ASCII text survive a
// round trip, and escapes a person or another tool wrote read as JSON says.
TEST(DatasetManifest, UnicodeEscapesRoundTrip) {
  TempDir tmp;
  DatasetManifest m = make_dataset(tmp.path());
  m.inputs[0].path = "t/a\x0e\x1f\x0b.txt";
  m.inputs[1].path = "t/\xc3\xa9t\xc3\xa9 \\ \"q\".txt";
  write_dataset_manifest(tmp.path(), m);
  const std::string text = read_file(tmp.path() / "dataset.json");
  ASSERT_NE(text.find("\\u000e"), std::string::npos) << text;
  DatasetManifest r = read_dataset_manifest(tmp.path());
  EXPECT_EQ(r.inputs[0].path, m.inputs[0].path);
  EXPECT_EQ(r.inputs[1].path, m.inputs[1].path);
  EXPECT_EQ(dataset_manifest_json(r), text);

  std::string edited = text;
  const auto at = read_file(tmp.path() / "dataset.json").find("\"t/\xc3\xa9t");
  ASSERT_NE(at, std::string::npos);
  edited.replace(at, edited.find("\",", at) - at + 1,
                 R"("t/\u00E9\u00e9\u005C\u0041\ud83d\ude00.txt")");
  write_file_atomic(tmp.path() / "dataset.json", edited);
  EXPECT_EQ(read_dataset_manifest(tmp.path()).inputs[1].path,
            "t/\xc3\xa9\xc3\xa9\\A\xf0\x9f\x98\x80.txt");

  edited.replace(edited.find("\\ud83d"), 6, "\\u0041");  // a lone low surrogate is refused
  write_file_atomic(tmp.path() / "dataset.json", edited);
  ErrorKind kind{};
  const std::string msg = error_of([&] { read_dataset_manifest(tmp.path()); }, &kind);
  EXPECT_EQ(kind, ErrorKind::kCorruption);
  EXPECT_NE(msg.find("lone UTF-16 surrogate \\ude00"), std::string::npos) << msg;
}

TEST(DatasetStaging, CopiesReusesAndRecopies) {
  TempDir tmp;
  const fs::path src = tmp.path() / "slow", hot = tmp.path() / "hot";
  const DatasetManifest m = make_dataset(src);
  const uint64_t all_bytes = m.shards[0].bytes + m.shards[1].bytes;

  StageReport first = stage_dataset(src, hot);
  EXPECT_EQ(first.copied, 2u);
  EXPECT_EQ(first.reused, 0u);
  EXPECT_EQ(first.bytes_copied, all_bytes);
  for (const auto& s : m.shards) {
    EXPECT_EQ(read_file(hot / s.file), read_file(src / s.file)) << s.file;
  }
  EXPECT_EQ(read_file(hot / "dataset.json"), read_file(src / "dataset.json"));
  EXPECT_EQ(read_dataset_manifest(hot).shards.size(), 2u);

  StageReport again = stage_dataset(src, hot);
  EXPECT_EQ(again.copied, 0u);
  EXPECT_EQ(again.reused, 2u);
  EXPECT_EQ(again.bytes_copied, 0u);

  // A hot copy whose bytes changed (same size) is replaced by a verified copy.
  flip_byte(hot / "val_000000.bin", kLlmcHeaderBytes + 1);
  StageReport fixed = stage_dataset(src, hot);
  EXPECT_EQ(fixed.copied, 1u);
  EXPECT_EQ(fixed.reused, 1u);
  EXPECT_EQ(fixed.bytes_copied, m.shards[1].bytes);
  EXPECT_EQ(read_file(hot / "val_000000.bin"), read_file(src / "val_000000.bin"));
  // A truncated hot copy too.
  std::string cut = read_file(hot / "train_000000.bin");
  cut.resize(cut.size() - 2);
  write_file_atomic(hot / "train_000000.bin", cut);
  EXPECT_EQ(stage_dataset(src, hot).copied, 1u);
  EXPECT_EQ(read_file(hot / "train_000000.bin"), read_file(src / "train_000000.bin"));
  EXPECT_TRUE(tmp_files(hot).empty());
}

TEST(DatasetStaging, RefusesASourceThatDoesNotMatchItsManifest) {
  TempDir tmp;
  const fs::path src = tmp.path() / "slow", hot = tmp.path() / "hot";
  make_dataset(src);
  stage_dataset(src, hot);
  // The slow volume's shard changes under the manifest, and the hot copy is gone.
  flip_byte(src / "train_000000.bin", kLlmcHeaderBytes + 2);
  fs::remove(hot / "train_000000.bin");
  ErrorKind kind{};
  const std::string msg = error_of([&] { stage_dataset(src, hot); }, &kind);
  EXPECT_EQ(kind, ErrorKind::kCorruption);
  EXPECT_TRUE(msg.starts_with((src / "train_000000.bin").string() + ": XXH3 ")) << msg;
  EXPECT_NE(msg.find("changed or is corrupt"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos);
  EXPECT_TRUE(tmp_files(hot).empty());
  EXPECT_FALSE(fs::exists(hot / "train_000000.bin"));
  // The hot directory is no longer committed: its dataset.json is gone.
  EXPECT_FALSE(fs::exists(hot / "dataset.json"));

  // A source of the wrong size is refused before copying.
  std::string bytes = read_file(src / "train_000000.bin");
  bytes.push_back('x');
  write_file_atomic(src / "train_000000.bin", bytes);
  const std::string size_msg = error_of([&] { stage_dataset(src, hot); }, &kind);
  EXPECT_EQ(kind, ErrorKind::kCorruption);
  EXPECT_NE(size_msg.find("bytes, dataset.json records"), std::string::npos) << size_msg;
  EXPECT_TRUE(tmp_files(hot).empty());
}
