// megacpp::data — the dataset manifest (`DIR/dataset.json`) that `megacpp prepare` writes next
// to its llm.c shards, and the staging of a dataset from a slow volume onto a hot one.
//
// Contract: a dataset directory is committed when its dataset.json exists; every file it names
// (shards, tokenizer) is a plain name inside that directory whose size and XXH3-64 are
// recorded. The manifest holds no timestamp, host or thread count, so the same inputs and
// options give byte-identical JSON. Reading validates every field and throws
// Error{kCorruption} with one line naming dataset.json, the field and what to do; writing
// validates the same rules first (a violation there is a bug: Error{kInternal}).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "data/shards.h"

namespace megacpp::data {

inline constexpr std::string_view kDatasetManifestName = "dataset.json";
inline constexpr uint32_t kDatasetSchemaVersion = 1;

struct DatasetTokenizer {
  std::string kind;  // "byte" | "sentencepiece-bpe" | "sentencepiece-unigram"
  std::string file;  // plain name in the dataset directory; empty for "byte"
  std::string xxh3;  // XXH3-64 hex of `file`; empty for "byte"
  uint32_t vocab_size = 0;
};

struct DatasetInput {
  std::string path;  // relative to the input root it was found under
  uint64_t bytes = 0;
  std::string xxh3;
  uint32_t documents = 0;  // 1, or 0 when skipped
  std::string skipped;     // the reason; empty when the file is a document
};

struct DatasetShard {
  std::string file;   // plain name in the dataset directory
  std::string split;  // "train" | "val"
  uint32_t tokens = 0;
  uint32_t documents = 0;  // documents starting in this shard (its EOS tokens)
  uint64_t bytes = 0;      // llmc_file_bytes(tokens, width)
  std::string xxh3;        // XXH3-64 hex of the whole file
};

struct DatasetManifest {
  uint32_t schema_version = kDatasetSchemaVersion;
  std::string format = "llmc";
  uint32_t token_width = 2;  // 2 | 4
  uint32_t vocab_size = 0;
  uint32_t eos_id = 0;
  uint32_t documents = 0;
  uint32_t skipped_files = 0;
  DatasetTokenizer tokenizer;
  std::vector<DatasetInput> inputs;
  std::vector<DatasetShard> shards;

  TokenWidth width() const noexcept { return static_cast<TokenWidth>(token_width); }
};

// Throws Error{kind} naming `what` (the manifest's path) and the first field that breaks a
// rule: schema version, format "llmc", width 2|4 (2 only for vocab ≤ 65536), vocab ≥ 2,
// eos < vocab, tokenizer kind/file/hash/vocab, every shard a plain unique file name with
// split train|val, bytes == llmc_file_bytes(tokens, width), 16-hex-digit hashes, and the
// document and skipped-file counts agreeing with the inputs and shards.
void validate_dataset_manifest(const DatasetManifest& m, std::string_view what,
                               ErrorKind kind = ErrorKind::kCorruption);

// The manifest's JSON text (schemas/dataset.capnp); validates first (kInternal).
std::string dataset_manifest_json(const DatasetManifest& m);
// Reads and validates DIR/dataset.json. Throws Error{kSystem} when it cannot be read,
// Error{kCorruption} when it is malformed or breaks a rule.
DatasetManifest read_dataset_manifest(const std::filesystem::path& dir);
// Validates, then writes DIR/dataset.json atomically (tmp, fsync, rename, fsync DIR).
void write_dataset_manifest(const std::filesystem::path& dir, const DatasetManifest& m);

// XXH3-64 hex of a file's bytes, read in bounded chunks (any size; blocking I/O).
std::string xxh3_file_hex(const std::filesystem::path& path);

// Whether `name` is a plain file name: not empty, no '/', not "." or "..", no NUL.
bool is_plain_file_name(std::string_view name) noexcept;

struct StageReport {
  uint32_t copied = 0;  // files copied (shards and the tokenizer)
  uint32_t reused = 0;  // hot copies kept: same size and XXH3 as the manifest says
  uint64_t bytes_copied = 0;
};

// Copies the dataset at `src_dir` onto `hot_dir` (created if missing) and returns what it did.
// Blocking; streams every file. A hot file with the manifest's size and XXH3 is reused; any
// other is replaced by a copy (tmp + fsync + rename) whose XXH3 is checked against the
// manifest, and a mismatch throws Error{kCorruption} naming the source file, leaving no tmp
// file behind. hot_dir/dataset.json is removed first when it differs and written last, so it
// exists only when every file it names has been verified.
StageReport stage_dataset(const std::filesystem::path& src_dir,
                          const std::filesystem::path& hot_dir);

}  // namespace megacpp::data
