// megacpp::data — token shards on a volume: the formats megacpp reads and writes, their
// validation, and the dataset a recipe's [data] section names.
//
// Formats (all little-endian):
//  - llm.c / modded-nanogpt `.bin`: a 256 x int32 header, then the tokens. header[0] is the
//    magic, header[1] the version, header[2] the token count; 20240520/1 carries uint16 tokens
//    (GPT-2 vocabulary), 20240801/7 carries uint32 tokens (Llama-3 vocabulary).
//  - Megatron-LM's indexed dataset: `<prefix>.idx` = "MMIDIDX\0\0", uint64 version 1, uint8
//    dtype code, uint64 sequence count, uint64 document-index count, then int32 sequence
//    lengths, int64 byte pointers into `<prefix>.bin`, int64 document indices (sequence
//    numbers where documents start, first 0, last the sequence count). Token dtypes read:
//    uint16 (code 8) and int32 (code 4), the two Megatron's writer picks.
//
// Contract: a shard is validated completely when it is opened (header fields, file size
// against the token count, every token below the vocabulary when one is given); a violated
// rule throws Error{kCorruption} whose message is one line: the file, the byte offset and the
// rule. Nothing here wraps around, clamps or skips a file. A Shard is a read-only mapping:
// neither copyable nor movable, valid while it lives.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace megacpp::data {

inline constexpr int32_t kLlmcMagic16 = 20240520;
inline constexpr int32_t kLlmcVersion16 = 1;
inline constexpr int32_t kLlmcMagic32 = 20240801;
inline constexpr int32_t kLlmcVersion32 = 7;
inline constexpr size_t kLlmcHeaderInts = 256;
inline constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);
inline constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint8_t kMegatronDtypeUint16 = 8;
inline constexpr uint8_t kMegatronDtypeInt32 = 4;

// Bytes of one token in a shard or a batch slot: 2 (uint16) or 4 (uint32).
enum class TokenWidth : uint8_t { kU16 = 2, kU32 = 4 };
constexpr size_t bytes_of(TokenWidth w) noexcept {
  return static_cast<size_t>(w);
}
// The narrowest width that holds every token id below `vocab_size`.
constexpr TokenWidth width_for_vocab(uint64_t vocab_size) noexcept {
  return vocab_size <= 65536 ? TokenWidth::kU16 : TokenWidth::kU32;
}

enum class ShardFormat : uint8_t { kLlmc, kMegatron };
const char* format_name(ShardFormat f) noexcept;

// Writes an llm.c shard atomically (tmp + fsync + rename): the uint16 version when `width` is
// kU16 (every token must be < 65536), else the uint32 version. Throws Error{kInvalidArgument}
// for a token that does not fit or more than INT32_MAX tokens.
void write_llmc_shard(const std::filesystem::path& path, std::span<const uint32_t> tokens,
                      TokenWidth width);

// Bytes of the llm.c file `write_llmc_shard` writes for `tokens` tokens of `width`.
constexpr uint64_t llmc_file_bytes(uint64_t tokens, TokenWidth width) noexcept {
  return kLlmcHeaderBytes + tokens * bytes_of(width);
}

// What opening a shard checks beyond its own structure.
struct ShardCheck {
  uint64_t vocab_size = 0;  // every token must be below it; 0 = do not scan the tokens
  bool checksum = false;    // compute the XXH3 of the token file while scanning
};

// One validated, read-only mapped shard: an llm.c file, or a Megatron prefix (its .bin
// mapped, its .idx read into document starts). The tokens are one contiguous array (a
// Megatron index whose sequences are not back to back in the .bin is refused).
class Shard {
 public:
  // `path` is the llm.c .bin, or for kMegatron the .idx, the .bin or the prefix.
  Shard(const std::filesystem::path& path, ShardFormat format, const ShardCheck& check = {});
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  ShardFormat format() const noexcept { return format_; }
  TokenWidth width() const noexcept { return width_; }
  // The file that holds the tokens (the llm.c file, or the Megatron .bin).
  const std::filesystem::path& path() const noexcept { return path_; }
  uint64_t tokens() const noexcept { return count_; }
  // Token i, widened; i < tokens().
  uint32_t token(uint64_t i) const noexcept {
    return width_ == TokenWidth::kU16 ? reinterpret_cast<const uint16_t*>(base_)[i]
                                      : reinterpret_cast<const uint32_t*>(base_)[i];
  }
  const std::byte* token_bytes() const noexcept { return base_; }
  // Token offsets where documents start, ascending, first 0: from the Megatron document
  // index; for llm.c shards empty until find_documents() splits them at an EOS id.
  std::span<const uint64_t> document_starts() const noexcept { return doc_starts_; }
  // llm.c shards: documents start at every `eos_id` (the llm.c writers put the end-of-text id
  // first in every document), and at 0. A no-op for Megatron shards.
  void find_documents(uint32_t eos_id);
  // Set when opened with a vocabulary bound / a checksum; 0 / empty otherwise.
  uint32_t max_token() const noexcept { return max_token_; }
  const std::string& xxh3() const noexcept { return xxh3_; }
  uint64_t file_bytes() const noexcept { return map_bytes_; }

 private:
  void open_llmc(const ShardCheck& check);
  void open_megatron(const std::filesystem::path& prefix, const ShardCheck& check);
  void map(const std::filesystem::path& file);
  void scan(const ShardCheck& check);

  ShardFormat format_;
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const std::byte* base_ = nullptr;
  uint64_t header_bytes_ = 0;  // bytes before the first token
  uint64_t count_ = 0;
  TokenWidth width_ = TokenWidth::kU16;
  std::vector<uint64_t> doc_starts_;
  uint32_t max_token_ = 0;
  std::string xxh3_;
};

// The shard files a recipe's [data] names. `pattern` is a directory (every *.bin in it, for
// Megatron every *.idx, whose name contains `split` when split is not empty), for Megatron a
// dataset prefix as Megatron-LM names it (`corpus_text_document` for
// `corpus_text_document.idx` + `.bin`, or either file's name: that one dataset, whatever
// `split` says — Megatron splits a prefix by document ranges, megacpp trains on all of it and
// has no validation split), or a glob (POSIX glob(3); "{split}" in it is replaced by `split`);
// a relative pattern is taken relative to `data_dir`. Sorted by path. Throws
// Error{kInvalidArgument} with a one-line message when nothing matches (an empty data folder
// is an error, never a silent fallback) and for Megatron's weighted blend ("W1 P1 W2 P2"),
// which megacpp does not sample.
std::vector<std::filesystem::path> find_shards(const std::filesystem::path& data_dir,
                                               ShardFormat format, const std::string& pattern,
                                               const std::string& split);

// A `--data-path` as the user typed it: a relative path is made absolute against the working
// directory (a recipe's [data] path is relative to --data-dir; a command-line path, like every
// other path on the command line, to where the command runs). Throws Error{kInvalidArgument}
// for Megatron's weighted blend, one line naming what is supported.
std::string command_line_data_path(const std::string& arg);

// Shard files of a known format lying directly in `dir` (not in its subfolders, where the
// built-in corpus lives), recognised by their header magic: llm.c `.bin` files, Megatron `.idx`
// files. What `megacpp run` looks for before it trains on the built-in corpus by default in a
// folder that holds the user's data. Reads the first bytes of each candidate; a file that
// cannot be read is not counted. Sorted; empty when there are none.
struct FoundShards {
  ShardFormat format = ShardFormat::kLlmc;
  std::vector<std::filesystem::path> files;  // of `format`
};
FoundShards find_known_shards(const std::filesystem::path& dir);

// The built-in corpus: generated text with learnable structure (templated sentences and
// arithmetic), byte-level, deterministic for a given shard size.
std::vector<uint16_t> builtin_corpus_tokens(uint32_t index, uint32_t tokens);
// Ensures `shards` built-in uint16 llm.c shards of `shard_tokens` exist under `data_dir`
// (data_dir/builtin-v1-<shard_tokens>/shard_NNNNNN.bin); existing valid shards are reused, so
// concurrent or repeated runs write them once. Returns their paths in order.
std::vector<std::filesystem::path> ensure_builtin_corpus(const std::filesystem::path& data_dir,
                                                         uint32_t shards, uint32_t shard_tokens);
// The built-in corpus's val split: one more shard of `shard_tokens`, generated from a seed no
// training shard uses (data_dir/builtin-v1-<shard_tokens>/val_000000.bin), written once like
// the others. Returns its path.
std::filesystem::path ensure_builtin_validation(const std::filesystem::path& data_dir,
                                                uint32_t shard_tokens);

}  // namespace megacpp::data
