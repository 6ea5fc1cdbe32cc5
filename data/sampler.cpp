#include "data/sampler.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include <fmt/format.h>

#include "core/error.h"
#include "data/detail/splitmix64.h"

namespace megacpp::data {

namespace {

using detail::splitmix64;

// Epoch e's bijection of [0, n): x -> (a x + c) mod n with a odd and coprime to n, both drawn
// from (seed, e). Cheap, stateless and exact; it is the order the built-in corpus's golden
// losses were recorded with.
struct Affine {
  uint64_t a;
  uint64_t c;
};
Affine epoch_affine(uint64_t seed, uint64_t epoch, uint64_t n) {
  uint64_t s = seed ^ (epoch * 0xd1b54a32d192ed03ULL);
  uint64_t a = (splitmix64(s) % n) | 1;
  while (std::gcd(a, n) != 1) a += 2;
  uint64_t c = splitmix64(s) % n;
  return {a, c};
}
uint64_t permute(uint64_t seed, uint64_t epoch, uint64_t x, uint64_t n) {
  const auto [a, c] = epoch_affine(seed, epoch, n);
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * x + c) % n);
}

// Consecutive positions through the global sequence: within an epoch perm(x + 1) = perm(x) +
// a (mod n), so stepping costs an add and a compare; the epoch's (a, c) is drawn once per
// epoch instead of once per row. Gives exactly permute()'s windows.
class Walk {
 public:
  Walk(uint64_t seed, uint64_t n, uint64_t position)
      : seed_(seed), n_(n), epoch_(position / n), x_(position % n) {
    start_epoch();
  }
  uint64_t window() const noexcept { return w_; }
  void next() {
    if (++x_ == n_) {
      ++epoch_;
      x_ = 0;
      start_epoch();
      return;
    }
    w_ += step_;
    if (w_ >= n_) w_ -= n_;
  }

 private:
  void start_epoch() {
    const auto [a, c] = epoch_affine(seed_, epoch_, n_);
    step_ = a % n_;
    w_ = static_cast<uint64_t>((static_cast<unsigned __int128>(a) * x_ + c) % n_);
  }
  uint64_t seed_, n_, epoch_, x_;
  uint64_t step_ = 0, w_ = 0;
};

// Rows are read from random places of the shards: each row's first touch misses the caches
// and often the TLB. Touching rows kAhead rows before they are copied lets those misses
// overlap instead of following one another. At most kPrefetchLines of a row's head are
// touched, and its last line (so a row that crosses a page gets its second page walked early);
// the hardware prefetcher streams the rest of a long row.
constexpr uint32_t kAhead = 8;
constexpr uint64_t kPrefetchLines = 4;
inline void prefetch_row(const std::byte* p, uint64_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const auto last = (reinterpret_cast<uintptr_t>(p) + bytes - 1) & ~uintptr_t{63};
  for (uint64_t i = 0; i < kPrefetchLines && first + i * 64 <= last; ++i)
    __builtin_prefetch(reinterpret_cast<const void*>(first + i * 64));
  __builtin_prefetch(reinterpret_cast<const void*>(last));
}

template <typename Dst, typename Src>
void copy_row(Dst* dst, const Src* src, uint64_t n) {
  if constexpr (sizeof(Dst) == sizeof(Src)) {
    std::memcpy(dst, src, n * sizeof(Dst));
  } else {
    for (uint64_t i = 0; i < n; ++i) dst[i] = static_cast<Dst>(src[i]);
  }
}

}  // namespace

Sampler::Sampler(std::span<const Shard* const> shards, const SamplerConfig& config)
    : shards_(shards.begin(), shards.end()),
      config_(config),
      spec_{.batch = config.batch, .seq_len = config.seq_len, .token_bytes = config.token_bytes} {
  MEGACPP_CHECK(config.batch >= 1 && config.world >= 1, ErrorKind::kInvalidArgument,
                "sampler needs batch and world >= 1");
  MEGACPP_CHECK(config.token_bytes == 2 || config.token_bytes == 4, ErrorKind::kInvalidArgument,
                "slot tokens are 2 or 4 bytes");
  const uint64_t T = config.seq_len;
  auto add = [&](uint32_t shard, uint64_t begin, uint64_t end) {
    const uint64_t w = end - begin > T ? (end - begin - 1) / T : 0;
    if (w == 0) {
      ++short_docs_;
      return;
    }
    runs_.push_back({shard, begin, w});
    before_.push_back(windows_);
    windows_ += w;
  };
  for (uint32_t i = 0; i < shards_.size(); ++i) {
    const Shard& s = *shards_[i];
    if (config.pack || s.document_starts().empty()) {
      MEGACPP_CHECK(config.pack || s.tokens() == 0, ErrorKind::kInvalidArgument,
                    fmt::format("data.pack: {} has no document boundaries (set data.eos_id for "
                                "llm.c shards, or pack = true)",
                                s.path().string()));
      const uint64_t w = s.tokens() > T ? (s.tokens() - 1) / T : 0;
      if (w > 0) {
        runs_.push_back({i, 0, w});
        before_.push_back(windows_);
        windows_ += w;
      }
      continue;
    }
    const auto starts = s.document_starts();
    for (size_t d = 0; d < starts.size(); ++d)
      add(i, starts[d], d + 1 < starts.size() ? starts[d + 1] : s.tokens());
  }
  const uint64_t global = uint64_t{config.world} * config.batch;
  if (config.windows_rule && windows_ < global)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "rule data.windows: the data holds {} windows of {} tokens{}, fewer than one "
                 "global batch ({} ranks x {} rows): add data, or lower seq_len, batch_size or "
                 "--ranks",
                 windows_, spec_.row_tokens(),
                 config.pack ? "" : " inside documents (pack = false)", config.world, config.batch);
}

uint64_t Sampler::position(uint32_t step, uint32_t rank) const noexcept {
  return config_.start + ((uint64_t{step} - 1 - config_.start_step) * config_.world + rank) *
                             uint64_t{config_.batch};
}

SamplerState Sampler::state_at(uint64_t p) const noexcept {
  return {config_.seed, p / windows_, p % windows_};
}

SamplerState Sampler::state_after(uint32_t step) const noexcept {
  return state_at(config_.start +
                  (uint64_t{step} - config_.start_step) * config_.world * config_.batch);
}

Sampler::Window Sampler::window_at(uint64_t p) const noexcept {
  const uint64_t w = permute(config_.seed, p / windows_, p % windows_, windows_);
  const size_t run = static_cast<size_t>(std::upper_bound(before_.begin(), before_.end(), w) -
                                         before_.begin() - 1);
  return {runs_[run].shard, runs_[run].start + (w - before_[run]) * config_.seq_len};
}

template <typename WindowOf>
void Sampler::copy_rows(uint32_t rows, std::byte* out, WindowOf window_of) const {
  const uint64_t n = spec_.row_tokens();
  // Sources of the next kAhead rows, located (and prefetched) ahead of their copy.
  struct Source {
    const std::byte* p;
    bool src16;
  };
  Source ahead[kAhead];
  uint32_t located = 0;
  auto locate = [&]() -> Source {
    const uint64_t w = window_of(located++);
    const size_t run = static_cast<size_t>(std::upper_bound(before_.begin(), before_.end(), w) -
                                           before_.begin() - 1);
    const Shard& s = *shards_[runs_[run].shard];
    const uint64_t start = runs_[run].start + (w - before_[run]) * config_.seq_len;
    const Source src{s.token_bytes() + start * bytes_of(s.width()), s.width() == TokenWidth::kU16};
    prefetch_row(src.p, n * bytes_of(s.width()));
    return src;
  };
  for (uint32_t row = 0; row < std::min(rows, kAhead); ++row) ahead[row] = locate();
  for (uint32_t row = 0; row < rows; ++row) {
    const Source src = ahead[row % kAhead];
    if (row + kAhead < rows) ahead[row % kAhead] = locate();
    std::byte* dst = out + uint64_t{row} * n * spec_.token_bytes;
    if (spec_.token_bytes == 2) {
      if (src.src16)
        copy_row(reinterpret_cast<uint16_t*>(dst), reinterpret_cast<const uint16_t*>(src.p), n);
      else
        copy_row(reinterpret_cast<uint16_t*>(dst), reinterpret_cast<const uint32_t*>(src.p), n);
    } else {
      if (src.src16)
        copy_row(reinterpret_cast<uint32_t*>(dst), reinterpret_cast<const uint16_t*>(src.p), n);
      else
        copy_row(reinterpret_cast<uint32_t*>(dst), reinterpret_cast<const uint32_t*>(src.p), n);
    }
  }
}

size_t Sampler::fill(uint32_t step, uint32_t rank, std::span<std::byte> slot) const {
  MEGACPP_CHECK(step > config_.start_step && rank < config_.world, ErrorKind::kInvalidArgument,
                "step is after the sampler's start step and rank < world");
  MEGACPP_CHECK(
      slot.size() >= spec_.slot_bytes(), ErrorKind::kInvalidArgument,
      fmt::format("a slot of {} bytes cannot hold a batch of {}", slot.size(), spec_.slot_bytes()));
  recipe::BatchHeader h;
  h.token_bytes = spec_.token_bytes;
  h.batch = spec_.batch;
  h.row_tokens = static_cast<uint32_t>(spec_.row_tokens());
  h.step = step;
  h.seed = config_.seed;
  h.windows = windows_;
  h.position = position(step, rank);
  h.next_position =
      config_.start + (uint64_t{step} - config_.start_step) * config_.world * config_.batch;
  std::memcpy(slot.data(), &h, sizeof h);
  Walk walk(config_.seed, windows_, h.position);
  copy_rows(spec_.batch, slot.data() + sizeof h, [&](uint32_t) {
    const uint64_t w = walk.window();
    walk.next();
    return w;
  });
  return spec_.slot_bytes();
}

ValidationSampler::ValidationSampler(std::span<const Shard* const> shards,
                                     const ValidationConfig& config)
    : index_(shards, SamplerConfig{.seq_len = config.seq_len,
                                   .batch = config.batch,
                                   .world = 1,
                                   .token_bytes = config.token_bytes,
                                   .seed = 0,
                                   .pack = config.pack,
                                   .windows_rule = false}),
      share_{.windows = std::min(config.windows, index_.windows()),
             .data_ranks = config.data_ranks,
             .batch = config.batch} {
  MEGACPP_CHECK(index_.windows() > 0, ErrorKind::kInvalidArgument,
                fmt::format("the val split holds no window of {} tokens{}", config.seq_len + 1,
                            config.pack ? "" : " inside a document (pack = false)"));
  MEGACPP_CHECK(config.data_ranks >= 1 && config.batch >= 1 && config.windows >= 1,
                ErrorKind::kInvalidArgument, "validation needs data_ranks, batch and windows >= 1");
}

size_t ValidationSampler::fill(uint32_t data_rank, uint32_t slot, uint64_t tag,
                               std::span<std::byte> out) const {
  const recipe::BatchSpec& spec = index_.spec();
  MEGACPP_CHECK(
      data_rank < share_.data_ranks && slot < share_.slots(data_rank), ErrorKind::kInvalidArgument,
      fmt::format("validation slot {} of data rank {}: the part has {} slots", slot, data_rank,
                  data_rank < share_.data_ranks ? share_.slots(data_rank) : 0));
  MEGACPP_CHECK(
      out.size() >= spec.slot_bytes(), ErrorKind::kInvalidArgument,
      fmt::format("a slot of {} bytes cannot hold a batch of {}", out.size(), spec.slot_bytes()));
  const uint32_t rows = share_.rows(data_rank, slot);
  recipe::BatchHeader h;
  h.token_bytes = spec.token_bytes;
  h.batch = rows;
  h.row_tokens = static_cast<uint32_t>(spec.row_tokens());
  h.step = tag;
  h.windows = share_.windows;
  h.position = share_.first(data_rank) + uint64_t{slot} * share_.batch;
  h.next_position = h.position + rows;
  std::memcpy(out.data(), &h, sizeof h);
  const uint64_t split = index_.windows(), n = share_.windows;
  index_.copy_rows(rows, out.data() + sizeof h, [&](uint32_t row) {
    const uint64_t i = h.position + row;
    return static_cast<uint64_t>(static_cast<unsigned __int128>(i) * split / n);
  });
  return sizeof h + uint64_t{rows} * spec.row_tokens() * spec.token_bytes;
}

}  // namespace megacpp::data
