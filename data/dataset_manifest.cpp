#include "data/dataset_manifest.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <memory>
#include <set>
#include <vector>

#include <capnp/message.h>
#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "schemas/dataset.capnp.h"
#include "schemas/json.h"

namespace fs = std::filesystem;

namespace megacpp::data {

namespace {

constexpr size_t kChunkBytes = size_t{8} << 20;

bool is_hex16(std::string_view s) {
  if (s.size() != 16) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

struct XxhState {
  XxhState() : state(XXH3_createState()) {
    MEGACPP_CHECK(state != nullptr, ErrorKind::kSystem, "XXH3_createState");
    XXH3_64bits_reset(state);
  }
  ~XxhState() { XXH3_freeState(state); }
  XxhState(const XxhState&) = delete;
  XxhState& operator=(const XxhState&) = delete;
  void update(const void* p, size_t n) { XXH3_64bits_update(state, p, n); }
  std::string hex() const { return fmt::format("{:016x}", XXH3_64bits_digest(state)); }
  XXH3_state_t* state;
};

// Reads up to `n` bytes (fewer only at end of file). Returns the count.
size_t read_full(int fd, char* buf, size_t n, const fs::path& path) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) MEGACPP_FAIL_SYS(errno, "cannot read {}: {}", path.string(), std::strerror(errno));
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

void write_full(int fd, const char* buf, size_t n, const fs::path& path) {
  size_t off = 0;
  while (off < n) {
    ssize_t w = ::write(fd, buf + off, n - off);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) MEGACPP_FAIL_SYS(errno, "cannot write {}: {}", path.string(), std::strerror(errno));
    off += static_cast<size_t>(w);
  }
}

Fd open_read(const fs::path& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid())
    MEGACPP_FAIL_SYS(errno, "cannot open {}: {}", path.string(), std::strerror(errno));
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  return fd;
}

}  // namespace

bool is_plain_file_name(std::string_view name) noexcept {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

void validate_dataset_manifest(const DatasetManifest& m, std::string_view what, ErrorKind kind) {
  auto fail = [&](std::string_view field, std::string_view rule) {
    detail::throw_fail(
        kind,
        fmt::format("{}: {} {}; re-run megacpp prepare to rewrite the dataset", what, field, rule),
        __FILE__, __LINE__);
  };
  if (m.schema_version != kDatasetSchemaVersion) {
    fail("schemaVersion",
         fmt::format("is {}, this build reads {}", m.schema_version, kDatasetSchemaVersion));
  }
  if (m.format != "llmc") fail("format", fmt::format("is \"{}\", must be \"llmc\"", m.format));
  if (m.token_width != 2 && m.token_width != 4) {
    fail("tokenWidth", fmt::format("is {}, must be 2 or 4", m.token_width));
  }
  if (m.vocab_size < 2) fail("vocabSize", fmt::format("is {}, must be at least 2", m.vocab_size));
  if (m.token_width == 2 && m.vocab_size > 65536) {
    fail("tokenWidth", fmt::format("is 2 but vocabSize {} needs 4-byte tokens", m.vocab_size));
  }
  if (m.eos_id >= m.vocab_size) {
    fail("eosId", fmt::format("{} is not below vocabSize {}", m.eos_id, m.vocab_size));
  }
  const auto& t = m.tokenizer;
  if (t.kind == "byte") {
    if (!t.file.empty() || !t.xxh3.empty()) {
      fail("tokenizer.file", "must be empty for a byte-level tokenizer");
    }
  } else if (t.kind == "sentencepiece-bpe" || t.kind == "sentencepiece-unigram") {
    if (!is_plain_file_name(t.file)) {
      fail("tokenizer.file", fmt::format("\"{}\" is not a plain file name", t.file));
    }
    if (!is_hex16(t.xxh3)) {
      fail("tokenizer.xxh3", fmt::format("\"{}\" is not 16 lowercase hex digits", t.xxh3));
    }
  } else {
    fail(
        "tokenizer.kind",
        fmt::format("is \"{}\", must be byte, sentencepiece-bpe or sentencepiece-unigram", t.kind));
  }
  if (t.vocab_size != m.vocab_size) {
    fail("tokenizer.vocabSize",
         fmt::format("{} differs from vocabSize {}", t.vocab_size, m.vocab_size));
  }
  uint64_t input_docs = 0;
  uint32_t skipped = 0;
  for (size_t i = 0; i < m.inputs.size(); ++i) {
    const auto& in = m.inputs[i];
    const auto field = [&](std::string_view f) { return fmt::format("inputs[{}].{}", i, f); };
    if (in.path.empty()) fail(field("path"), "is empty");
    if (!is_hex16(in.xxh3)) {
      fail(field("xxh3"), fmt::format("\"{}\" is not 16 lowercase hex digits", in.xxh3));
    }
    if (in.documents != (in.skipped.empty() ? 1u : 0u)) {
      fail(field("documents"),
           fmt::format("is {}, must be 1 for an accepted file and 0 for a skipped one",
                       in.documents));
    }
    input_docs += in.documents;
    skipped += in.skipped.empty() ? 0 : 1;
  }
  if (input_docs != m.documents) {
    fail("documents", fmt::format("is {} but the inputs hold {}", m.documents, input_docs));
  }
  if (skipped != m.skipped_files) {
    fail("skippedFiles", fmt::format("is {} but {} inputs are skipped", m.skipped_files, skipped));
  }
  std::set<std::string_view> names;
  if (!t.file.empty()) names.insert(t.file);
  uint64_t shard_docs = 0;
  for (size_t i = 0; i < m.shards.size(); ++i) {
    const auto& s = m.shards[i];
    const auto field = [&](std::string_view f) { return fmt::format("shards[{}].{}", i, f); };
    if (!is_plain_file_name(s.file) || s.file == kDatasetManifestName) {
      fail(field("file"), fmt::format("\"{}\" is not a plain shard file name", s.file));
    }
    if (!names.insert(s.file).second) {
      fail(field("file"), fmt::format("\"{}\" is named twice", s.file));
    }
    if (s.split != "train" && s.split != "val") {
      fail(field("split"), fmt::format("is \"{}\", must be train or val", s.split));
    }
    if (s.tokens > INT32_MAX) {
      fail(field("tokens"), fmt::format("{} exceeds the llm.c limit of 2^31-1", s.tokens));
    }
    if (s.documents > s.tokens) {
      fail(field("documents"), fmt::format("{} exceeds its {} tokens", s.documents, s.tokens));
    }
    const uint64_t expect = llmc_file_bytes(s.tokens, m.width());
    if (s.bytes != expect) {
      fail(field("bytes"), fmt::format("is {}, an llm.c file of {} {}-byte tokens is {}", s.bytes,
                                       s.tokens, m.token_width, expect));
    }
    if (!is_hex16(s.xxh3)) {
      fail(field("xxh3"), fmt::format("\"{}\" is not 16 lowercase hex digits", s.xxh3));
    }
    shard_docs += s.documents;
  }
  if (shard_docs != m.documents) {
    fail("documents", fmt::format("is {} but the shards start {}", m.documents, shard_docs));
  }
}

std::string dataset_manifest_json(const DatasetManifest& m) {
  validate_dataset_manifest(m, kDatasetManifestName, ErrorKind::kInternal);
  capnp::MallocMessageBuilder message;
  auto root = message.initRoot<schema::DatasetManifest>();
  root.setSchemaVersion(m.schema_version);
  root.setFormat(m.format);
  root.setTokenWidth(m.token_width);
  root.setVocabSize(m.vocab_size);
  root.setEosId(m.eos_id);
  root.setDocuments(m.documents);
  root.setSkippedFiles(m.skipped_files);
  auto t = root.initTokenizer();
  t.setKind(m.tokenizer.kind);
  t.setFile(m.tokenizer.file);
  t.setXxh3(m.tokenizer.xxh3);
  t.setVocabSize(m.tokenizer.vocab_size);
  auto inputs = root.initInputs(static_cast<unsigned>(m.inputs.size()));
  for (unsigned i = 0; i < inputs.size(); ++i) {
    const auto& in = m.inputs[i];
    auto b = inputs[i];
    b.setPath(in.path);
    b.setBytes(in.bytes);
    b.setXxh3(in.xxh3);
    b.setDocuments(in.documents);
    b.setSkipped(in.skipped);
  }
  auto shards = root.initShards(static_cast<unsigned>(m.shards.size()));
  for (unsigned i = 0; i < shards.size(); ++i) {
    const auto& s = m.shards[i];
    auto b = shards[i];
    b.setFile(s.file);
    b.setSplit(s.split);
    b.setTokens(s.tokens);
    b.setDocuments(s.documents);
    b.setBytes(s.bytes);
    b.setXxh3(s.xxh3);
  }
  return schemas::to_json(root.asReader());
}

DatasetManifest read_dataset_manifest(const fs::path& dir) {
  const fs::path path = dir / kDatasetManifestName;
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error& e) {
    MEGACPP_FAIL_LIKE(e,
                      "{}: cannot read the dataset manifest ({}); is {} a directory "
                      "written by megacpp prepare?",
                      path.string(), std::strerror(e.sys_errno()), dir.string());
  }
  schemas::JsonDocument<schema::DatasetManifest> doc(text, path.string());
  auto r = doc.get();
  DatasetManifest m;
  m.schema_version = r.getSchemaVersion();
  m.format = r.getFormat();
  m.token_width = r.getTokenWidth();
  m.vocab_size = r.getVocabSize();
  m.eos_id = r.getEosId();
  m.documents = r.getDocuments();
  m.skipped_files = r.getSkippedFiles();
  auto t = r.getTokenizer();
  m.tokenizer = {t.getKind(), t.getFile(), t.getXxh3(), t.getVocabSize()};
  for (auto in : r.getInputs()) {
    m.inputs.push_back(
        {in.getPath(), in.getBytes(), in.getXxh3(), in.getDocuments(), in.getSkipped()});
  }
  for (auto s : r.getShards()) {
    m.shards.push_back(
        {s.getFile(), s.getSplit(), s.getTokens(), s.getDocuments(), s.getBytes(), s.getXxh3()});
  }
  validate_dataset_manifest(m, path.string());
  return m;
}

void write_dataset_manifest(const fs::path& dir, const DatasetManifest& m) {
  write_file_atomic(dir / kDatasetManifestName, dataset_manifest_json(m));
}

std::string xxh3_file_hex(const fs::path& path) {
  Fd fd = open_read(path);
  XxhState h;
  std::vector<char> buf(kChunkBytes);
  for (;;) {
    size_t n = read_full(fd.get(), buf.data(), buf.size(), path);
    h.update(buf.data(), n);
    if (n < buf.size()) break;
  }
  return h.hex();
}

namespace {

// Whether `hot` already holds the file the manifest describes. `bytes` < 0: size not recorded.
bool hot_matches(const fs::path& hot, int64_t bytes, const std::string& xxh3) {
  std::error_code ec;
  auto st = fs::status(hot, ec);
  if (ec || !fs::is_regular_file(st)) return false;
  if (bytes >= 0 && fs::file_size(hot, ec) != static_cast<uint64_t>(bytes)) return false;
  if (ec) return false;
  return xxh3_file_hex(hot) == xxh3;
}

// Copies src to dst through dst.tmp.<pid>, hashing while it copies; the tmp file is removed
// unless the copy matched `xxh3` and was renamed into place. Returns the bytes copied.
uint64_t copy_verified(const fs::path& src, const fs::path& dst, const std::string& xxh3) {
  fs::path tmp = dst;
  tmp += fmt::format(".tmp.{}", ::getpid());
  struct RemoveTmp {
    const fs::path& p;
    bool armed = true;
    ~RemoveTmp() {
      std::error_code ec;
      if (armed) fs::remove(p, ec);
    }
  } guard{tmp};
  Fd in = open_read(src);
  Fd out(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!out.valid()) {
    MEGACPP_FAIL_SYS(errno, "cannot create {}: {}", tmp.string(), std::strerror(errno));
  }
  XxhState h;
  std::vector<char> buf(kChunkBytes);
  uint64_t total = 0;
  for (;;) {
    size_t n = read_full(in.get(), buf.data(), buf.size(), src);
    h.update(buf.data(), n);
    write_full(out.get(), buf.data(), n, tmp);
    total += n;
    if (n < buf.size()) break;
  }
  if (h.hex() != xxh3) {
    MEGACPP_FAIL(ErrorKind::kCorruption,
                 "{}: XXH3 {} does not match {} recorded in dataset.json: the file on the "
                 "source volume changed or is corrupt; re-run megacpp prepare",
                 src.string(), h.hex(), xxh3);
  }
  SYSCALL_CHECK(::fsync(out.get()));
  out.close_checked();
  std::error_code ec;
  fs::rename(tmp, dst, ec);
  if (ec) MEGACPP_FAIL_SYS(ec.value(), "cannot rename {}: {}", tmp.string(), ec.message());
  guard.armed = false;
  return total;
}

}  // namespace

StageReport stage_dataset(const fs::path& src_dir, const fs::path& hot_dir) {
  const DatasetManifest m = read_dataset_manifest(src_dir);
  const std::string manifest_text = read_file(src_dir / kDatasetManifestName);
  std::error_code ec;
  fs::create_directories(hot_dir, ec);
  if (ec) {
    MEGACPP_FAIL_SYS(ec.value(), "cannot create the staging directory {}: {}", hot_dir.string(),
                     ec.message());
  }
  // Uncommit the hot copy before the first file changes: while files change, no dataset.json
  // claims them.
  const fs::path hot_manifest = hot_dir / kDatasetManifestName;
  bool committed = fs::exists(hot_manifest) && read_file(hot_manifest) == manifest_text;
  auto uncommit = [&] {
    if (fs::exists(hot_manifest)) {
      fs::remove(hot_manifest);
      fsync_path(hot_dir);
    }
    committed = false;
  };
  if (!committed) uncommit();
  StageReport report;
  auto stage_one = [&](const std::string& name, int64_t bytes, const std::string& xxh3) {
    const fs::path hot = hot_dir / name;
    if (hot_matches(hot, bytes, xxh3)) {
      ++report.reused;
      return;
    }
    uncommit();
    const fs::path src = src_dir / name;
    if (bytes >= 0) {
      auto size = fs::file_size(src, ec);
      if (ec) MEGACPP_FAIL_SYS(ec.value(), "cannot stat {}: {}", src.string(), ec.message());
      if (size != static_cast<uint64_t>(bytes)) {
        MEGACPP_FAIL(ErrorKind::kCorruption,
                     "{}: {} bytes, dataset.json records {}: the file on the source volume "
                     "changed or is corrupt; re-run megacpp prepare",
                     src.string(), size, bytes);
      }
    }
    report.bytes_copied += copy_verified(src, hot, xxh3);
    ++report.copied;
  };
  for (const auto& s : m.shards) stage_one(s.file, static_cast<int64_t>(s.bytes), s.xxh3);
  if (!m.tokenizer.file.empty()) stage_one(m.tokenizer.file, -1, m.tokenizer.xxh3);
  fsync_path(hot_dir);
  if (!committed) write_file_atomic(hot_manifest, manifest_text);
  return report;
}

}  // namespace megacpp::data
