// libFuzzer target: `dataset.json` (data/dataset_manifest.h) read from untrusted bytes.
//
// Input: the file's bytes. An Error is an expected refusal; any other exception, a crash, a
// leak or UB is a finding, and so is an accepted manifest that does not survive a round trip
// (written back as JSON, read again: the same fields and the same text).
#include <cstdint>
#include <tuple>

#include "core/error.h"
#include "data/dataset_manifest.h"
#include "tests/fuzz/fuzz_support.h"

namespace md = megacpp::data;

namespace {

bool same(const md::DatasetManifest& a, const md::DatasetManifest& b) {
  auto tok = [](const md::DatasetTokenizer& t) {
    return std::tie(t.kind, t.file, t.xxh3, t.vocab_size);
  };
  auto in = [](const md::DatasetInput& i) {
    return std::tie(i.path, i.bytes, i.xxh3, i.documents, i.skipped);
  };
  auto sh = [](const md::DatasetShard& s) {
    return std::tie(s.file, s.split, s.tokens, s.documents, s.bytes, s.xxh3);
  };
  if (std::tie(a.schema_version, a.format, a.token_width, a.vocab_size, a.eos_id, a.documents,
               a.skipped_files) != std::tie(b.schema_version, b.format, b.token_width, b.vocab_size,
                                            b.eos_id, b.documents, b.skipped_files))
    return false;
  if (tok(a.tokenizer) != tok(b.tokenizer)) return false;
  if (a.inputs.size() != b.inputs.size() || a.shards.size() != b.shards.size()) return false;
  for (size_t i = 0; i < a.inputs.size(); ++i)
    if (in(a.inputs[i]) != in(b.inputs[i])) return false;
  for (size_t i = 0; i < a.shards.size(); ++i)
    if (sh(a.shards[i]) != sh(b.shards[i])) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto dir = megacpp::fuzz::scratch_dir();
  static const auto file = dir / std::string(md::kDatasetManifestName);
  megacpp::fuzz::write_bytes(file, data, size);
  md::DatasetManifest m;
  try {
    m = md::read_dataset_manifest(dir);
  } catch (const megacpp::Error&) {
    return 0;  // a refused manifest: the expected outcome for most inputs
  }
  // Accepted: it validates, so writing it must not throw, and reading that back gives it again.
  const std::string json = md::dataset_manifest_json(m);
  megacpp::fuzz::write_bytes(file, reinterpret_cast<const uint8_t*>(json.data()), json.size());
  const md::DatasetManifest again = md::read_dataset_manifest(dir);
  MEGACPP_FUZZ_ASSERT(same(m, again));
  MEGACPP_FUZZ_ASSERT(md::dataset_manifest_json(again) == json);
  return 0;
}
