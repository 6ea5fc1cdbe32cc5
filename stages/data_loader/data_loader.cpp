#include "stages/data_loader/data_loader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <numeric>
#include <string_view>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"

namespace megacpp::data_loader {

namespace {

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

template <size_t N>
std::string_view pick(uint64_t& s, const std::array<std::string_view, N>& words) {
  return words[splitmix64(s) % N];
}

// One line of built-in text. The structure is there to be learned: agreement between
// subject and verb form, fixed sentence shapes, and arithmetic that is always correct.
std::string corpus_line(uint64_t& s) {
  static constexpr std::array<std::string_view, 8> kAdj = {"small", "quiet", "bright", "old",
                                                           "green", "heavy", "quick",  "calm"};
  static constexpr std::array<std::string_view, 8> kNoun = {"cat",     "river",  "engine", "garden",
                                                            "teacher", "signal", "tower",  "model"};
  static constexpr std::array<std::string_view, 8> kVerb = {"sees",   "follows", "builds", "moves",
                                                            "trains", "finds",   "holds",  "reads"};
  static constexpr std::array<std::string_view, 4> kPlace = {"near the hill", "in the city",
                                                             "by the sea", "under the bridge"};
  switch (splitmix64(s) % 3) {
    case 0:
      return fmt::format("the {} {} {} the {} {}.\n", pick(s, kAdj), pick(s, kNoun), pick(s, kVerb),
                         pick(s, kAdj), pick(s, kNoun));
    case 1:
      return fmt::format("a {} {} {}.\n", pick(s, kNoun), pick(s, kVerb), pick(s, kPlace));
    default: {
      uint64_t a = splitmix64(s) % 50, b = splitmix64(s) % 50;
      return fmt::format("{} + {} = {}.\n", a, b, a + b);
    }
  }
}

}  // namespace

std::vector<uint16_t> builtin_corpus_tokens(uint32_t index, uint32_t tokens) {
  std::vector<uint16_t> out;
  out.reserve(tokens);
  uint64_t s = 0x6d656761637070ULL ^ (uint64_t{index} * 0x9e3779b97f4a7c15ULL);
  while (out.size() < tokens) {
    for (unsigned char c : corpus_line(s)) {
      if (out.size() == tokens) break;
      out.push_back(c);
    }
  }
  return out;
}

void write_shard(const std::filesystem::path& path, std::span<const uint16_t> tokens) {
  std::array<int32_t, kShardHeaderInts> header{};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  std::string bytes(sizeof header + tokens.size_bytes(), '\0');
  std::memcpy(bytes.data(), header.data(), sizeof header);
  std::memcpy(bytes.data() + sizeof header, tokens.data(), tokens.size_bytes());
  write_file_atomic(path, bytes);
}

std::vector<std::filesystem::path> ensure_builtin_corpus(const std::filesystem::path& data_dir,
                                                         uint32_t shards, uint32_t shard_tokens) {
  auto dir = data_dir / fmt::format("builtin-v1-{}", shard_tokens);
  std::filesystem::create_directories(dir);
  std::vector<std::filesystem::path> paths;
  for (uint32_t i = 0; i < shards; ++i) {
    auto p = dir / fmt::format("shard_{:06d}.bin", i);
    bool valid = false;
    if (std::filesystem::exists(p)) {
      try {
        Shard s(p);
        valid = s.tokens().size() == shard_tokens;
      } catch (const Error& e) {
        log_warn("rewriting invalid shard {}: {}", p.string(), e.what());
      }
    }
    if (!valid) {
      auto tokens = builtin_corpus_tokens(i, shard_tokens);
      write_shard(p, tokens);
    }
    paths.push_back(p);
  }
  return paths;
}

Shard::Shard(const std::filesystem::path& path) : path_(path) {
  int fd = SYSCALL_CHECK(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    SYSCALL_FAIL("fstat", err);
  }
  map_bytes_ = static_cast<size_t>(st.st_size);
  auto corrupt = [&](std::string_view what) {
    MEGACPP_FAIL(ErrorKind::kCorruption, "shard {}: {}", path.string(), what);
  };
  if (map_bytes_ < kShardHeaderInts * sizeof(int32_t)) {
    ::close(fd);
    corrupt("shorter than the 1024-byte header");
  }
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    SYSCALL_FAIL("mmap", err);
  }
  const auto* header = static_cast<const int32_t*>(map_);
  try {
    if (header[0] != kShardMagic)
      corrupt(fmt::format("magic {} (expected {})", header[0], kShardMagic));
    if (header[1] != kShardVersion)
      corrupt(fmt::format("version {} (expected {})", header[1], kShardVersion));
    if (header[2] < 0) corrupt("negative token count");
    count_ = static_cast<size_t>(header[2]);
    if (kShardHeaderInts * sizeof(int32_t) + count_ * sizeof(uint16_t) > map_bytes_) {
      corrupt(fmt::format("header says {} tokens but the file holds fewer", count_));
    }
  } catch (...) {
    ::munmap(map_, map_bytes_);
    throw;
  }
  tokens_ = reinterpret_cast<const uint16_t*>(static_cast<const std::byte*>(map_) +
                                              kShardHeaderInts * sizeof(int32_t));
}

Shard::~Shard() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

Sampler::Sampler(std::vector<std::span<const uint16_t>> shards, uint32_t seq_len, uint32_t batch,
                 uint32_t world, uint64_t seed)
    : shards_(std::move(shards)),
      spec_{.batch = batch, .seq_len = seq_len},
      world_(world),
      seed_(seed) {
  MEGACPP_CHECK(seq_len >= 1 && batch >= 1 && world_ >= 1, ErrorKind::kInvalidArgument,
                "sampler needs seq_len, batch and world >= 1");
  for (const auto& s : shards_) {
    windows_before_.push_back(windows_);
    windows_ += s.size() > seq_len ? (s.size() - 1) / seq_len : 0;
  }
  MEGACPP_CHECK(windows_ > 0, ErrorKind::kInvalidArgument,
                "the shards hold no full (seq_len + 1)-token window");
}

void Sampler::fill(uint32_t step, uint32_t rank, int64_t* out) const {
  MEGACPP_CHECK(step >= 1 && rank < world_, ErrorKind::kInvalidArgument,
                "step is 1-based and rank < world");
  const uint64_t n = windows_;
  for (uint32_t row = 0; row < spec_.batch; ++row) {
    uint64_t g = ((uint64_t{step} - 1) * world_ + rank) * spec_.batch + row;
    uint64_t epoch = g / n;
    uint64_t s = seed_ ^ (epoch * 0xd1b54a32d192ed03ULL);
    uint64_t a = (splitmix64(s) % n) | 1;
    while (std::gcd(a, n) != 1) a += 2;
    uint64_t c = splitmix64(s) % n;
    uint64_t w = (static_cast<unsigned __int128>(a) * (g % n) + c) % n;
    size_t shard =
        static_cast<size_t>(std::upper_bound(windows_before_.begin(), windows_before_.end(), w) -
                            windows_before_.begin() - 1);
    // Windows start every seq_len tokens; a row is the seq_len + 1 tokens from its start.
    uint64_t start = (w - windows_before_[shard]) * spec_.seq_len;
    const uint16_t* src = shards_[shard].data() + start;
    int64_t* dst = out + size_t{row} * spec_.row_tokens();
    for (uint64_t i = 0; i < spec_.row_tokens(); ++i) dst[i] = src[i];
  }
}

}  // namespace megacpp::data_loader
