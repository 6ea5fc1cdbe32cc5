// libFuzzer target: an llm.c `.bin` shard (data/shards.h) opened from untrusted bytes.
//
// Input: byte 0 picks the checks (bits 0-2: the vocabulary bound, bit 3: no checksum,
// bits 4-5: the EOS id find_documents splits at); the rest is the file. An Error is an
// expected refusal; any other exception, a crash, a leak, UB or a broken invariant of an
// accepted shard is a finding.
#include <algorithm>
#include <cstdint>
#include <span>

#include "core/error.h"
#include "data/shards.h"
#include "tests/fuzz/fuzz_support.h"

namespace md = megacpp::data;

namespace {

constexpr uint64_t kVocabs[8] = {0, 2, 257, 50257, 65535, 65536, 65537, 128256};
constexpr uint32_t kEos[4] = {0, 256, 50256, 128001};

void check(const md::Shard& s, const md::ShardCheck& c, uint64_t file_size) {
  const uint64_t w = md::bytes_of(s.width());
  MEGACPP_FUZZ_ASSERT(s.file_bytes() == file_size);
  MEGACPP_FUZZ_ASSERT(file_size == md::llmc_file_bytes(s.tokens(), s.width()));
  uint32_t max = 0;
  for (uint64_t i = 0; i < s.tokens(); ++i) max = std::max(max, s.token(i));
  if (c.vocab_size != 0) {
    MEGACPP_FUZZ_ASSERT(max == s.max_token());
    MEGACPP_FUZZ_ASSERT(max < c.vocab_size);
  }
  MEGACPP_FUZZ_ASSERT(c.checksum == (s.xxh3().size() == 16));
  MEGACPP_FUZZ_ASSERT(w == 2 || w == 4);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t opt = data[0];
  const md::ShardCheck c{.vocab_size = kVocabs[opt & 7], .checksum = (opt & 8) == 0};
  const uint32_t eos = kEos[(opt >> 4) & 3];
  static const auto path = megacpp::fuzz::scratch_dir() / "shard.bin";
  megacpp::fuzz::write_bytes(path, data + 1, size - 1);
  try {
    md::Shard s(path, md::ShardFormat::kLlmc, c);
    check(s, c, size - 1);
    s.find_documents(eos);
    const auto starts = s.document_starts();
    MEGACPP_FUZZ_ASSERT(!starts.empty() && starts[0] == 0);
    for (size_t i = 1; i < starts.size(); ++i) {
      MEGACPP_FUZZ_ASSERT(starts[i] > starts[i - 1] && starts[i] < s.tokens());
      MEGACPP_FUZZ_ASSERT(s.token(starts[i]) == eos);
    }
  } catch (const megacpp::Error&) {
    // A refused shard: the expected outcome for most inputs.
  }
  return 0;
}
