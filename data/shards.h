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

}  // namespace megacpp::data
