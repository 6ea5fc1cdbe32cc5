// libFuzzer target: a Megatron indexed dataset (`.idx` + `.bin`, data/shards.h) opened from
// untrusted bytes.
//
// Input: byte 0 picks the checks (bits 0-2: the vocabulary bound, bit 3: no checksum), bytes
// 1-4 are the .idx length (little-endian uint32, cut to what is left), then the .idx, then the
// .bin. An Error is an expected refusal; any other exception, a crash, a leak, UB or a broken
// invariant of an accepted shard is a finding.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "data/shards.h"
#include "tests/fuzz/fuzz_support.h"

namespace md = megacpp::data;

namespace {

constexpr uint64_t kVocabs[8] = {0, 2, 257, 50257, 65535, 65536, 65537, 128256};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  const uint8_t opt = data[0];
  const md::ShardCheck c{.vocab_size = kVocabs[opt & 7], .checksum = (opt & 8) == 0};
  uint32_t idx_len;
  std::memcpy(&idx_len, data + 1, 4);
  const size_t rest = size - 5;
  const size_t idx_n = std::min<size_t>(idx_len, rest);
  const size_t bin_n = rest - idx_n;
  static const auto dir = megacpp::fuzz::scratch_dir();
  static const auto idx = dir / "data.idx", bin = dir / "data.bin";
  megacpp::fuzz::write_bytes(idx, data + 5, idx_n);
  megacpp::fuzz::write_bytes(bin, data + 5 + idx_n, bin_n);
  try {
    md::Shard s(idx, md::ShardFormat::kMegatron, c);
    const uint64_t w = md::bytes_of(s.width());
    MEGACPP_FUZZ_ASSERT(w == 2 || w == 4);
    MEGACPP_FUZZ_ASSERT(s.file_bytes() == bin_n && bin_n == s.tokens() * w);
    uint32_t max = 0;
    for (uint64_t i = 0; i < s.tokens(); ++i) max = std::max(max, s.token(i));
    if (c.vocab_size != 0) {
      MEGACPP_FUZZ_ASSERT(max == s.max_token());
      MEGACPP_FUZZ_ASSERT(max < c.vocab_size);
    }
    MEGACPP_FUZZ_ASSERT(c.checksum == (s.xxh3().size() == 16));
    const auto starts = s.document_starts();
    for (size_t i = 0; i < starts.size(); ++i) {
      MEGACPP_FUZZ_ASSERT(i > 0 || starts[0] == 0);
      MEGACPP_FUZZ_ASSERT(i == 0 || starts[i] > starts[i - 1]);
      MEGACPP_FUZZ_ASSERT(starts[i] < s.tokens());
    }
    s.find_documents(0);  // a no-op for Megatron shards
    MEGACPP_FUZZ_ASSERT(s.document_starts().size() == starts.size());
  } catch (const megacpp::Error&) {
    // A refused index or .bin: the expected outcome for most inputs.
  }
  return 0;
}
