// prepare/prepare.h: documents are [EOS] + tokens in sorted input order, bad files are skipped
// and recorded, the output is the same for any thread count, SentencePiece training is
// repeatable and a loaded model cuts the same tokens, and shards cut where they should.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <glob.h>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/util.h"
#include "data/dataset_manifest.h"
#include "data/shards.h"
#include "prepare/prepare.h"
#include "tests/unit/temp_dir.h"

namespace fs = std::filesystem;
using namespace megacpp;
using namespace megacpp::prepare;

namespace {

using test_support::TempDir;

void put(const fs::path& p, std::string_view bytes) {
  fs::create_directories(p.parent_path());
  write_file_atomic(p, bytes);
}

// The tokens of an llm.c shard, read back from its bytes.
std::vector<uint32_t> read_shard(const fs::path& p) {
  const std::string bytes = read_file(p);
  EXPECT_GE(bytes.size(), data::kLlmcHeaderBytes);
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  const bool narrow = header[0] == data::kLlmcMagic16;
  EXPECT_TRUE(narrow || header[0] == data::kLlmcMagic32) << p;
  const size_t width = narrow ? 2 : 4;
  EXPECT_EQ(bytes.size(), data::kLlmcHeaderBytes + size_t(header[2]) * width) << p;
  std::vector<uint32_t> out(static_cast<size_t>(header[2]));
  for (size_t i = 0; i < out.size(); ++i) {
    const char* at = bytes.data() + data::kLlmcHeaderBytes + i * width;
    if (narrow) {
      uint16_t t;
      std::memcpy(&t, at, 2);
      out[i] = t;
    } else {
      std::memcpy(&out[i], at, 4);
    }
  }
  return out;
}

std::vector<uint32_t> concat_split(const fs::path& dir, const data::DatasetManifest& m,
                                   std::string_view split) {
  std::vector<uint32_t> all;
  for (const auto& s : m.shards) {
    if (s.split != split) continue;
    auto t = read_shard(dir / s.file);
    EXPECT_EQ(t.size(), s.tokens);
    EXPECT_EQ(data::xxh3_file_hex(dir / s.file), s.xxh3);
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

std::vector<uint32_t> byte_doc(std::string_view text) {
  std::vector<uint32_t> d = {256};
  for (char c : text) d.push_back(static_cast<unsigned char>(c));
  return d;
}

PrepareConfig config(std::vector<fs::path> inputs, fs::path out) {
  PrepareConfig c;
  c.inputs = std::move(inputs);
  c.out_dir = std::move(out);
  c.progress = ProgressMode::kNone;
  c.threads = 2;
  return c;
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

// Every file's bytes in a dataset directory, by name.
std::vector<std::pair<std::string, std::string>> dir_bytes(const fs::path& dir) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    out.emplace_back(e.path().filename().string(), read_file(e.path()));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The first header files of /usr/include/c++/<version>/bits (sorted) adding up to `bytes`.
std::vector<fs::path> cxx_headers(uint64_t bytes) {
  glob_t g{};
  std::vector<fs::path> out;
  if (::glob("/usr/include/c++/*/bits", 0, nullptr, &g) != 0 || g.gl_pathc == 0) return out;
  const fs::path bits = g.gl_pathv[0];
  ::globfree(&g);
  std::vector<fs::path> all;
  for (const auto& e : fs::directory_iterator(bits)) {
    if (e.is_regular_file()) all.push_back(e.path());
  }
  std::sort(all.begin(), all.end());
  uint64_t total = 0;
  for (const auto& p : all) {
    if (total >= bytes) break;
    out.push_back(p);
    total += fs::file_size(p);
  }
  return out;
}

}  // namespace

TEST(Prepare, ByteLevelDocumentsAreEosLedInSortedOrder) {
  TempDir tmp;
  const fs::path in = tmp.path() / "corpus";
  put(in / "x.txt", "hello");
  put(in / "sub" / "y.txt", "w\xc3\xb6rld\n");  // wörld
  put(in / "bad.bin", "ok\xff\xfe");
  put(in / "nul.txt", std::string("ab\0c", 4));
  put(in / "surrogate.txt", "\xed\xa0\x80");  // U+D800 encoded: not UTF-8
  put(in / "overlong.txt", "\xc0\xaf");
  put(in / "empty.txt", "");
  auto r = prepare::prepare(config({in}, tmp.path() / "out"));
  const auto m = data::read_dataset_manifest(tmp.path() / "out");
  EXPECT_EQ(m.documents, 2u);
  EXPECT_EQ(m.skipped_files, 5u);
  EXPECT_EQ(m.vocab_size, 257u);
  EXPECT_EQ(m.eos_id, 256u);
  EXPECT_EQ(m.token_width, 2u);
  EXPECT_EQ(m.tokenizer.kind, "byte");
  EXPECT_TRUE(m.tokenizer.file.empty());
  ASSERT_EQ(m.inputs.size(), 7u);
  const std::vector<std::string> order = {
      "corpus/bad.bin",   "corpus/empty.txt",     "corpus/nul.txt", "corpus/overlong.txt",
      "corpus/sub/y.txt", "corpus/surrogate.txt", "corpus/x.txt"};
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(m.inputs[i].path, order[i]);
  EXPECT_EQ(m.inputs[0].skipped, "not UTF-8: invalid byte 0xff at offset 2");
  EXPECT_EQ(m.inputs[1].skipped, "empty file");
  EXPECT_EQ(m.inputs[2].skipped, "holds a NUL byte at offset 2");
  EXPECT_NE(m.inputs[3].skipped.find("not UTF-8"), std::string::npos);
  EXPECT_NE(m.inputs[5].skipped.find("not UTF-8"), std::string::npos);
  EXPECT_TRUE(m.inputs[4].skipped.empty());
  EXPECT_EQ(m.inputs[4].xxh3, xxh3_hex("w\xc3\xb6rld\n"));
  EXPECT_EQ(m.inputs[4].bytes, 7u);
  ASSERT_EQ(m.shards.size(), 1u);
  EXPECT_EQ(m.shards[0].file, "train_000000.bin");
  EXPECT_EQ(m.shards[0].documents, 2u);
  std::vector<uint32_t> expect = byte_doc("w\xc3\xb6rld\n");
  for (auto t : byte_doc("hello")) expect.push_back(t);
  EXPECT_EQ(read_shard(tmp.path() / "out" / "train_000000.bin"), expect);
  EXPECT_EQ(r.tokens, expect.size());
  EXPECT_EQ(r.input_bytes, 12u);
  EXPECT_NE(summary_line(r).find("prepared 2 documents (5 skipped files), 14 tokens in 1 shards"),
            std::string::npos)
      << summary_line(r);
}

TEST(Prepare, EveryKthDocumentGoesToVal) {
  TempDir tmp;
  const fs::path in = tmp.path() / "c";
  for (int i = 0; i < 7; ++i) put(in / fmt::format("{}.txt", i), std::string(1, char('a' + i)));
  auto c = config({in}, tmp.path() / "out");
  c.val_every = 3;
  prepare::prepare(c);
  const auto m = data::read_dataset_manifest(tmp.path() / "out");
  std::vector<uint32_t> train, val;
  for (int i = 0; i < 7; ++i) {
    auto d = byte_doc(std::string(1, char('a' + i)));
    auto& to = (i + 1) % 3 == 0 ? val : train;
    to.insert(to.end(), d.begin(), d.end());
  }
  EXPECT_EQ(concat_split(tmp.path() / "out", m, "train"), train);
  EXPECT_EQ(concat_split(tmp.path() / "out", m, "val"), val);
  ASSERT_EQ(m.shards.size(), 2u);
  EXPECT_EQ(m.shards[1].file, "val_000000.bin");
  EXPECT_EQ(m.shards[1].documents, 2u);
}

TEST(Prepare, ShardCutsConcatenateToTheDocuments) {
  TempDir tmp;
  const fs::path in = tmp.path() / "c";
  std::vector<uint32_t> expect;
  for (int i = 0; i < 9; ++i) {
    const std::string text(static_cast<size_t>(3 + i), char('a' + i));
    put(in / fmt::format("{:02d}.txt", i), text);
    auto d = byte_doc(text);
    expect.insert(expect.end(), d.begin(), d.end());
  }
  auto c = config({in}, tmp.path() / "out");
  c.val_every = 0;
  c.shard_tokens = 10;
  prepare::prepare(c);
  const auto m = data::read_dataset_manifest(tmp.path() / "out");
  ASSERT_EQ(m.shards.size(), (expect.size() + 9) / 10);
  uint32_t docs = 0;
  for (size_t i = 0; i < m.shards.size(); ++i) {
    EXPECT_EQ(m.shards[i].file, fmt::format("train_{:06d}.bin", i));
    if (i + 1 < m.shards.size()) {
      EXPECT_EQ(m.shards[i].tokens, 10u);
    }
    // Documents counted where they start: the EOS tokens in the shard.
    auto t = read_shard(tmp.path() / "out" / m.shards[i].file);
    EXPECT_EQ(m.shards[i].documents, std::count(t.begin(), t.end(), 256u));
    docs += m.shards[i].documents;
  }
  EXPECT_EQ(docs, 9u);
  EXPECT_EQ(concat_split(tmp.path() / "out", m, "train"), expect);
}

TEST(Prepare, OutputIsIdenticalForAnyThreadCount) {
  TempDir tmp;
  const fs::path in = tmp.path() / "c";
  for (int i = 0; i < 300; ++i) {
    std::string text;
    for (int k = 0; k < (i * 37) % 500 + 1; ++k) text += char('a' + (i * k) % 26);
    put(in / fmt::format("d{}", i % 7) / fmt::format("f{}.txt", i), text);
  }
  put(in / "zz.bin", "\xff");
  std::vector<std::vector<std::pair<std::string, std::string>>> outs;
  for (unsigned threads : {1u, 2u, 5u}) {
    auto c = config({in}, tmp.path() / fmt::format("out{}", threads));
    c.threads = threads;
    c.shard_tokens = 5000;
    c.val_every = 10;
    prepare::prepare(c);
    outs.push_back(dir_bytes(c.out_dir));
  }
  ASSERT_GT(outs[0].size(), 5u);
  EXPECT_EQ(outs[0], outs[1]);
  EXPECT_EQ(outs[0], outs[2]);
}

TEST(Prepare, InputsAreExpandedOnceAndFollowFileSymlinks) {
  TempDir tmp;
  const fs::path in = tmp.path() / "c";
  put(in / "a.txt", "A");
  put(tmp.path() / "outside.txt", "O");
  fs::create_symlink(tmp.path() / "outside.txt", in / "link.txt");
  fs::create_directory_symlink(tmp.path(), in / "loop");  // a folder link is not followed
  // The same file twice (as a folder entry and as a file input) is one document.
  prepare::prepare(config({in, in / "a.txt"}, tmp.path() / "out"));
  const auto m = data::read_dataset_manifest(tmp.path() / "out");
  ASSERT_EQ(m.inputs.size(), 2u);
  EXPECT_EQ(m.inputs[0].path, "a.txt");  // sorted by path; "c/a.txt" is the same file
  EXPECT_EQ(m.inputs[1].path, "c/link.txt");
  auto expect = byte_doc("A");
  for (auto t : byte_doc("O")) expect.push_back(t);
  EXPECT_EQ(read_shard(tmp.path() / "out" / "train_000000.bin"), expect);
}

TEST(Prepare, BadInputsAreRefusedAndNothingIsWritten) {
  TempDir tmp;
  const fs::path out = tmp.path() / "out";
  ErrorKind kind{};
  std::string msg = error_of([&] { prepare::prepare(config({tmp.path() / "nope"}, out)); }, &kind);
  EXPECT_EQ(kind, ErrorKind::kInvalidArgument);
  EXPECT_NE(msg.find("nope cannot be read"), std::string::npos) << msg;
  fs::create_directories(tmp.path() / "empty");
  msg = error_of([&] { prepare::prepare(config({tmp.path() / "empty"}, out)); }, &kind);
  EXPECT_NE(msg.find("holds no files"), std::string::npos) << msg;
  // Only skipped files: refused after tokenizing, and what was written is removed.
  put(tmp.path() / "bin" / "a", "\xff\xfe");
  msg = error_of([&] { prepare::prepare(config({tmp.path() / "bin"}, out)); }, &kind);
  EXPECT_EQ(kind, ErrorKind::kInvalidArgument);
  EXPECT_NE(msg.find("no input file is a document"), std::string::npos) << msg;
  // A file that is not a SentencePiece model.
  put(tmp.path() / "text" / "a.txt", "some text");
  auto c = config({tmp.path() / "text"}, out);
  c.tokenizer = TokenizerMode::kLoad;
  c.tokenizer_model = tmp.path() / "text" / "a.txt";
  msg = error_of([&] { prepare::prepare(c); }, &kind);
  EXPECT_EQ(kind, ErrorKind::kInvalidArgument);
  EXPECT_NE(msg.find("is not a SentencePiece model"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos);
  EXPECT_FALSE(fs::exists(out));
  // Options.
  c = config({tmp.path() / "text"}, out);
  c.val_every = 1;
  EXPECT_NE(error_of([&] { prepare::prepare(c); }).find("--val-every 1"), std::string::npos);
  c = config({tmp.path() / "text"}, out);
  c.tokenizer = TokenizerMode::kTrain;
  c.vocab_size = 100;
  EXPECT_NE(error_of([&] { prepare::prepare(c); }).find("--vocab-size 100 is out of range"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(out));
  // An out directory that is not empty is refused and left alone.
  put(out / "keep.txt", "mine");
  msg = error_of([&] { prepare::prepare(config({tmp.path() / "text"}, out)); }, &kind);
  EXPECT_EQ(kind, ErrorKind::kInvalidArgument);
  EXPECT_NE(msg.find("is not empty"), std::string::npos) << msg;
  EXPECT_EQ(dir_bytes(out).size(), 1u);
}

TEST(Prepare, StageToCopiesTheDataset) {
  TempDir tmp;
  put(tmp.path() / "c" / "a.txt", "abc");
  auto c = config({tmp.path() / "c"}, tmp.path() / "out");
  c.stage_to = tmp.path() / "hot";
  auto r = prepare::prepare(c);
  ASSERT_TRUE(r.staged);
  EXPECT_EQ(r.staged->copied, 1u);
  EXPECT_EQ(dir_bytes(tmp.path() / "hot"), dir_bytes(tmp.path() / "out"));
}

TEST(Prepare, SentencePieceTrainingIsRepeatableAndLoadingCutsTheSameTokens) {
  const auto headers = cxx_headers(300'000);
  ASSERT_FALSE(headers.empty()) << "no /usr/include/c++/*/bits";
  TempDir tmp;
  std::vector<std::vector<std::pair<std::string, std::string>>> outs;
  for (int run = 0; run < 2; ++run) {
    auto c = config(headers, tmp.path() / fmt::format("out{}", run));
    c.tokenizer = TokenizerMode::kTrain;
    c.vocab_size = 1024;
    c.shard_tokens = 20'000;
    prepare::prepare(c);
    outs.push_back(dir_bytes(c.out_dir));
  }
  EXPECT_EQ(outs[0], outs[1]);  // model, shards and manifest
  const fs::path out0 = tmp.path() / "out0";
  const auto m = data::read_dataset_manifest(out0);
  EXPECT_EQ(m.tokenizer.kind, "sentencepiece-bpe");
  EXPECT_EQ(m.tokenizer.file, "tokenizer.model");
  EXPECT_EQ(m.tokenizer.xxh3, data::xxh3_file_hex(out0 / "tokenizer.model"));
  EXPECT_EQ(m.vocab_size, 1024u);
  EXPECT_EQ(m.eos_id, 2u);
  EXPECT_EQ(m.documents, headers.size());
  EXPECT_GT(m.shards.size(), 2u);
  // Text compresses: fewer tokens than bytes, and no token is <unk> (byte fallback).
  auto train = concat_split(out0, m, "train");
  uint64_t bytes = 0;
  for (const auto& in : m.inputs) bytes += in.bytes;
  EXPECT_LT(train.size(), bytes / 2);
  EXPECT_EQ(std::count(train.begin(), train.end(), 0u), 0);
  EXPECT_EQ(train.front(), 2u);

  // --tokenizer with the trained model: the same tokens.
  auto c = config(headers, tmp.path() / "loaded");
  c.tokenizer = TokenizerMode::kLoad;
  c.tokenizer_model = out0 / "tokenizer.model";
  c.shard_tokens = 20'000;
  c.threads = 1;
  prepare::prepare(c);
  EXPECT_EQ(dir_bytes(tmp.path() / "loaded"), outs[0]);
}

TEST(Prepare, UnigramTrainingIsRepeatable) {
  const auto headers = cxx_headers(120'000);
  ASSERT_FALSE(headers.empty());
  TempDir tmp;
  std::string model[2];
  for (int run = 0; run < 2; ++run) {
    auto c = config(headers, tmp.path() / fmt::format("out{}", run));
    c.tokenizer = TokenizerMode::kTrain;
    c.vocab_size = 512;
    c.model_type = ModelType::kUnigram;
    prepare::prepare(c);
    model[run] = read_file(c.out_dir / "tokenizer.model");
    EXPECT_EQ(data::read_dataset_manifest(c.out_dir).tokenizer.kind, "sentencepiece-unigram");
  }
  EXPECT_EQ(model[0], model[1]);
  EXPECT_EQ(read_file(tmp.path() / "out0" / "dataset.json"),
            read_file(tmp.path() / "out1" / "dataset.json"));
}
