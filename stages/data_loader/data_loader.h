// megacpp::data_loader — token shards and the deterministic sampler behind the batch plane.
//
// Shards are llm.c's format: a 256 x int32 header (magic 20240520, version 1, token count),
// then uint16 tokens. The built-in corpus is generated text with learnable structure
// (templated sentences and arithmetic), byte-level, deterministic for a given shard size.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "recipes/batch_spec.h"

namespace megacpp::data_loader {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderInts = 256;

// Generates `tokens` tokens of built-in corpus text for shard `index` (deterministic).
std::vector<uint16_t> builtin_corpus_tokens(uint32_t index, uint32_t tokens);

// Writes a shard atomically (tmp + fsync + rename).
void write_shard(const std::filesystem::path& path, std::span<const uint16_t> tokens);

// Ensures `shards` built-in shards of `shard_tokens` exist under `data_dir`
// (data_dir/builtin-v1-<shard_tokens>/shard_NNNNNN.bin); existing valid shards are reused,
// so concurrent or repeated runs write them once. Returns their paths in order.
std::vector<std::filesystem::path> ensure_builtin_corpus(const std::filesystem::path& data_dir,
                                                         uint32_t shards, uint32_t shard_tokens);

// A read-only mapping of one shard. Throws Error{kCorruption} naming the file and the field
// when the header is wrong or the file is shorter than the header says.
class Shard {
 public:
  explicit Shard(const std::filesystem::path& path);
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;
  std::span<const uint16_t> tokens() const noexcept { return {tokens_, count_}; }
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
  size_t count_ = 0;
};

// Deterministic sampling of (seq_len + 1)-token windows: every (step, rank, row) maps to one
// window of one shard through a seeded permutation per epoch, so ranks receive different,
// equal-sized batches and a restarted loader reproduces a step exactly from its number.
class Sampler {
 public:
  Sampler(std::vector<std::span<const uint16_t>> shards, uint32_t seq_len, uint32_t batch,
          uint32_t world, uint64_t seed);
  // Writes one batch slot (spec(): batch x (seq_len + 1) int64 tokens) for `step` (1-based)
  // and `rank` into `out`.
  void fill(uint32_t step, uint32_t rank, int64_t* out) const;
  uint64_t windows() const noexcept { return windows_; }
  const recipe::BatchSpec& spec() const noexcept { return spec_; }
  size_t batch_bytes() const noexcept { return spec_.slot_bytes(); }

 private:
  std::vector<std::span<const uint16_t>> shards_;
  std::vector<uint64_t> windows_before_;  // prefix sums of windows per shard
  recipe::BatchSpec spec_;
  uint32_t world_;
  uint64_t seed_;
  uint64_t windows_ = 0;
};

}  // namespace megacpp::data_loader
