#include "data/shards.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string_view>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"

namespace megacpp::data {

const char* format_name(ShardFormat f) noexcept {
  switch (f) {
    case ShardFormat::kLlmc:
      return "llmc";
    case ShardFormat::kMegatron:
      return "megatron";
  }
  return "?";
}

void write_llmc_shard(const std::filesystem::path& path, std::span<const uint32_t> tokens,
                      TokenWidth width) {
  MEGACPP_CHECK(tokens.size() <= INT32_MAX, ErrorKind::kInvalidArgument,
                fmt::format("{}: {} tokens exceed the llm.c header's int32 count", path.string(),
                            tokens.size()));
  std::array<int32_t, kLlmcHeaderInts> header{};
  const bool narrow = width == TokenWidth::kU16;
  header[0] = narrow ? kLlmcMagic16 : kLlmcMagic32;
  header[1] = narrow ? kLlmcVersion16 : kLlmcVersion32;
  header[2] = static_cast<int32_t>(tokens.size());
  std::string bytes(llmc_file_bytes(tokens.size(), width), '\0');
  std::memcpy(bytes.data(), header.data(), sizeof header);
  char* out = bytes.data() + sizeof header;
  if (narrow) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      MEGACPP_CHECK(tokens[i] <= UINT16_MAX, ErrorKind::kInvalidArgument,
                    fmt::format("{}: token {} at index {} does not fit a uint16 shard",
                                path.string(), tokens[i], i));
      const auto t = static_cast<uint16_t>(tokens[i]);
      std::memcpy(out + i * 2, &t, 2);
    }
  } else {
    std::memcpy(out, tokens.data(), tokens.size_bytes());
  }
  write_file_atomic(path, bytes);
}

namespace {

// A violated format rule: one line naming the file, the byte offset and the rule.
[[noreturn]] void bad(const std::filesystem::path& file, uint64_t offset, std::string_view rule) {
  MEGACPP_FAIL(ErrorKind::kCorruption, "bad shard {} at byte {}: {}", file.string(), offset, rule);
}

template <typename T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

const char* megatron_dtype_name(uint8_t code) {
  switch (code) {
    case 1:
      return "uint8";
    case 2:
      return "int8";
    case 3:
      return "int16";
    case 4:
      return "int32";
    case 5:
      return "int64";
    case 6:
      return "float64";
    case 7:
      return "float32";
    case 8:
      return "uint16";
    default:
      return "unknown";
  }
}

}  // namespace

Shard::Shard(const std::filesystem::path& path, ShardFormat format, const ShardCheck& check)
    : format_(format) {
  try {
    if (format == ShardFormat::kLlmc) {
      path_ = path;
      open_llmc(check);
    } else {
      auto prefix = path;
      if (prefix.extension() == ".idx" || prefix.extension() == ".bin") prefix.replace_extension();
      open_megatron(prefix, check);
    }
    scan(check);
  } catch (...) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    throw;
  }
}

Shard::~Shard() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

void Shard::map(const std::filesystem::path& file) {
  const int raw = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw < 0) {
    int err = errno;
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "cannot open shard {}: {}", file.string(),
                 std::strerror(err));
  }
  const Fd fd(raw);  // the mapping outlives it
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) SYSCALL_FAIL("fstat", errno);
  if (!S_ISREG(st.st_mode)) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "shard {} is not a regular file", file.string());
  }
  map_bytes_ = static_cast<size_t>(st.st_size);
  if (map_bytes_ == 0) return;
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    SYSCALL_FAIL("mmap", errno);
  }
}

void Shard::open_llmc(const ShardCheck&) {
  map(path_);
  if (map_bytes_ < kLlmcHeaderBytes)
    bad(path_, map_bytes_,
        fmt::format("the file has {} bytes, shorter than the {}-byte llm.c header", map_bytes_,
                    kLlmcHeaderBytes));
  const auto* h = static_cast<const std::byte*>(map_);
  const auto magic = load<int32_t>(h), version = load<int32_t>(h + 4), count = load<int32_t>(h + 8);
  if (magic == kLlmcMagic16) {
    width_ = TokenWidth::kU16;
    if (version != kLlmcVersion16)
      bad(path_, 4,
          fmt::format("version {} with the uint16 magic {} (llm.c writes version {})", version,
                      magic, kLlmcVersion16));
  } else if (magic == kLlmcMagic32) {
    width_ = TokenWidth::kU32;
    if (version != kLlmcVersion32)
      bad(path_, 4,
          fmt::format("version {} with the uint32 magic {} (llm.c writes version {})", version,
                      magic, kLlmcVersion32));
  } else {
    bad(path_, 0,
        fmt::format("magic {} is not an llm.c shard's ({} for uint16 tokens, {} for uint32)", magic,
                    kLlmcMagic16, kLlmcMagic32));
  }
  if (count < 0) bad(path_, 8, fmt::format("negative token count {}", count));
  count_ = static_cast<uint64_t>(count);
  const uint64_t want = llmc_file_bytes(count_, width_);
  if (want != map_bytes_)
    bad(path_, std::min<uint64_t>(want, map_bytes_),
        fmt::format("the header says {} tokens of {} bytes ({} bytes with the header) but the "
                    "file has {} bytes",
                    count_, bytes_of(width_), want, map_bytes_));
  header_bytes_ = kLlmcHeaderBytes;
  base_ = h + kLlmcHeaderBytes;
}

void Shard::open_megatron(const std::filesystem::path& prefix, const ShardCheck&) {
  auto idx_path = prefix;
  idx_path += ".idx";
  path_ = prefix;
  path_ += ".bin";
  std::string idx;
  try {
    idx = read_file(idx_path);
  } catch (const Error&) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "cannot read Megatron index {} (the .idx of {})",
                 idx_path.string(), path_.string());
  }
  const auto* p = reinterpret_cast<const std::byte*>(idx.data());
  constexpr uint64_t kHeader = 9 + 8 + 1 + 8 + 8;
  if (idx.size() < kHeader)
    bad(idx_path, idx.size(),
        fmt::format("the index has {} bytes, shorter than the {}-byte MMIDIDX header", idx.size(),
                    kHeader));
  if (std::memcmp(p, kMegatronMagic, sizeof kMegatronMagic) != 0)
    bad(idx_path, 0, "magic is not Megatron's \"MMIDIDX\\0\\0\"");
  const auto version = load<uint64_t>(p + 9);
  if (version != 1) bad(idx_path, 9, fmt::format("index version {} (Megatron writes 1)", version));
  const auto code = load<uint8_t>(p + 17);
  if (code == kMegatronDtypeUint16)
    width_ = TokenWidth::kU16;
  else if (code == kMegatronDtypeInt32)
    width_ = TokenWidth::kU32;
  else
    bad(idx_path, 17,
        fmt::format("dtype code {} ({}) is not a token type megacpp reads (8 = uint16, 4 = int32)",
                    code, megatron_dtype_name(code)));
  const auto n = load<uint64_t>(p + 18), d = load<uint64_t>(p + 26);
  // Sizes are checked before they are multiplied: a hostile count must not wrap the sum.
  const uint64_t room = idx.size() - kHeader;
  if (n > room / 12 || d > room / 8 || n * 12 + d * 8 > room)
    bad(idx_path, 18,
        fmt::format("{} sequences and {} document indices need more than the index's {} bytes", n,
                    d, idx.size()));
  const uint64_t want = kHeader + n * 12 + d * 8;
  // Multimodal indices append one int8 mode per sequence; text indices end here.
  if (idx.size() != want && idx.size() != want + n)
    bad(idx_path, want,
        fmt::format("the index has {} bytes; {} sequences and {} document indices take {}",
                    idx.size(), n, d, want));
  const uint64_t len_off = kHeader, ptr_off = len_off + n * 4, doc_off = ptr_off + n * 8;
  const uint64_t w = bytes_of(width_);
  std::vector<uint64_t> seq_start(n + 1, 0);
  uint64_t bytes = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const auto len = load<int32_t>(p + len_off + i * 4);
    if (len < 0) bad(idx_path, len_off + i * 4, fmt::format("sequence {} has length {}", i, len));
    const auto ptr = load<int64_t>(p + ptr_off + i * 8);
    if (ptr < 0 || static_cast<uint64_t>(ptr) != bytes)
      bad(idx_path, ptr_off + i * 8,
          fmt::format("sequence {} starts at byte {} of the .bin, not where the sequences before "
                      "it end ({}): megacpp reads back-to-back sequences",
                      i, ptr, bytes));
    seq_start[i] = bytes / w;
    bytes += static_cast<uint64_t>(len) * w;
  }
  seq_start[n] = bytes / w;
  if (d < 1) bad(idx_path, 26, "no document index (it holds at least the leading 0)");
  uint64_t prev = 0;
  doc_starts_.reserve(d);
  for (uint64_t i = 0; i < d; ++i) {
    const auto v = load<int64_t>(p + doc_off + i * 8);
    if (v < 0 || static_cast<uint64_t>(v) > n || static_cast<uint64_t>(v) < prev ||
        (i == 0 && v != 0))
      bad(idx_path, doc_off + i * 8,
          fmt::format("document index {} is {}: document indices ascend from 0 to the sequence "
                      "count {}",
                      i, v, n));
    prev = static_cast<uint64_t>(v);
    if (i + 1 < d && (doc_starts_.empty() || doc_starts_.back() != seq_start[prev]))
      doc_starts_.push_back(seq_start[prev]);
  }
  if (prev != n)
    bad(idx_path, doc_off + (d - 1) * 8,
        fmt::format("the last document index is {}, not the sequence count {}", prev, n));
  map(path_);
  if (map_bytes_ != bytes)
    bad(path_, std::min<uint64_t>(bytes, map_bytes_),
        fmt::format("the .bin has {} bytes but its index {} describes {}", map_bytes_,
                    idx_path.filename().string(), bytes));
  count_ = bytes / w;
  if (!doc_starts_.empty() && doc_starts_.back() >= count_) doc_starts_.pop_back();
  header_bytes_ = 0;
  base_ = static_cast<const std::byte*>(map_);
}

void Shard::scan(const ShardCheck& check) {
  if (check.checksum) {
    xxh3_ = fmt::format("{:016x}", XXH3_64bits(map_, map_bytes_));
  }
  if (check.vocab_size == 0) return;
  if (width_ == TokenWidth::kU16 && check.vocab_size > UINT16_MAX) {
    const auto* t = reinterpret_cast<const uint16_t*>(base_);
    uint16_t m = 0;
    for (uint64_t i = 0; i < count_; ++i) m = std::max(m, t[i]);
    max_token_ = m;
    return;
  }
  uint32_t m = 0;
  if (width_ == TokenWidth::kU16) {
    const auto* t = reinterpret_cast<const uint16_t*>(base_);
    for (uint64_t i = 0; i < count_; ++i) m = std::max<uint32_t>(m, t[i]);
  } else {
    const auto* t = reinterpret_cast<const uint32_t*>(base_);
    for (uint64_t i = 0; i < count_; ++i) m = std::max(m, t[i]);
  }
  max_token_ = m;
  if (m < check.vocab_size) return;
  for (uint64_t i = 0; i < count_; ++i) {
    if (token(i) >= check.vocab_size)
      bad(path_, header_bytes_ + i * bytes_of(width_),
          fmt::format("token {} at index {} is not below the recipe's vocab_size {}", token(i), i,
                      check.vocab_size));
  }
}

void Shard::find_documents(uint32_t eos_id) {
  if (format_ != ShardFormat::kLlmc) return;
  doc_starts_.clear();
  doc_starts_.push_back(0);
  for (uint64_t i = 1; i < count_; ++i)
    if (token(i) == eos_id) doc_starts_.push_back(i);
}

FoundShards find_known_shards(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> llmc, megatron;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    const bool bin = p.extension() == ".bin", idx = p.extension() == ".idx";
    if ((!bin && !idx) || !it->is_regular_file(ec)) continue;
    std::array<char, 9> head{};
    std::ifstream in(p, std::ios::binary);
    if (!in.read(head.data(), head.size())) continue;
    if (idx && std::memcmp(head.data(), kMegatronMagic, sizeof kMegatronMagic) == 0) {
      megatron.push_back(p);
    } else if (bin) {
      const auto magic = load<int32_t>(reinterpret_cast<const std::byte*>(head.data()));
      if (magic == kLlmcMagic16 || magic == kLlmcMagic32) llmc.push_back(p);
    }
  }
  // A Megatron dataset's .bin has no magic: its .idx names the format.
  FoundShards out;
  if (!megatron.empty()) {
    out = {ShardFormat::kMegatron, std::move(megatron)};
  } else {
    out = {ShardFormat::kLlmc, std::move(llmc)};
  }
  std::sort(out.files.begin(), out.files.end());
  return out;
}

namespace {

// Megatron-LM's weighted blend, "W1 P1 W2 P2 ...": words alternating a number and a path, at
// least one pair (a path that exists with spaces in its name is a path, not a blend).
void refuse_blend(const std::string& pattern, const std::filesystem::path& as_path) {
  std::vector<std::string> words;
  for (size_t at = 0; at < pattern.size();) {
    const size_t start = pattern.find_first_not_of(" \t", at);
    if (start == std::string::npos) break;
    const size_t end = std::min(pattern.find_first_of(" \t", start), pattern.size());
    words.push_back(pattern.substr(start, end - start));
    at = end;
  }
  if (words.size() < 2 || words.size() % 2 != 0) return;
  for (size_t i = 0; i < words.size(); i += 2) {
    char* rest = nullptr;
    std::strtod(words[i].c_str(), &rest);
    if (rest == words[i].c_str() || *rest != '\0') return;
  }
  std::error_code ec;
  if (std::filesystem::exists(as_path, ec)) return;
  MEGACPP_FAIL(ErrorKind::kInvalidArgument,
               "data path '{}' is a weighted blend (W1 PREFIX1 W2 PREFIX2 ...), which megacpp does "
               "not sample: pass one Megatron prefix, a directory or a glob (the datasets it "
               "names train as one, each window equally likely)",
               pattern);
}

}  // namespace

std::string command_line_data_path(const std::string& arg) {
  refuse_blend(arg, arg);
  if (arg.empty()) return arg;
  return std::filesystem::absolute(arg).lexically_normal().string();
}

std::vector<std::filesystem::path> find_shards(const std::filesystem::path& data_dir,
                                               ShardFormat format, const std::string& pattern,
                                               const std::string& split) {
  namespace fs = std::filesystem;
  refuse_blend(pattern, pattern.empty() ? data_dir : data_dir / pattern);
  const std::string ext = format == ShardFormat::kLlmc ? ".bin" : ".idx";
  std::string pat = pattern;
  for (size_t at; (at = pat.find("{split}")) != std::string::npos;) pat.replace(at, 7, split);
  fs::path where = pat.empty() ? data_dir : fs::path(pat);
  if (where.is_relative()) where = data_dir / where;
  std::vector<fs::path> out;
  std::error_code ec;
  if (format == ShardFormat::kMegatron && !pat.empty()) {
    // Megatron's own naming: the prefix (or its .idx or .bin) is the dataset.
    fs::path prefix = where;
    if (prefix.extension() == ".idx" || prefix.extension() == ".bin") prefix.replace_extension();
    fs::path idx = prefix, bin = prefix;
    idx += ".idx";
    bin += ".bin";
    if (fs::is_regular_file(idx, ec) && fs::is_regular_file(bin, ec)) return {idx};
  }
  if (fs::is_directory(where, ec)) {
    for (const auto& e : fs::directory_iterator(where, ec)) {
      const auto name = e.path().filename().string();
      if (e.path().extension() != ext || !e.is_regular_file(ec)) continue;
      if (!split.empty() && name.find(split) == std::string::npos) continue;
      out.push_back(e.path());
    }
  } else {
    glob_t g{};
    if (::glob(where.c_str(), GLOB_NOSORT, nullptr, &g) == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) {
        fs::path p = g.gl_pathv[i];
        if (format == ShardFormat::kMegatron && p.extension() == ".bin") continue;
        if (fs::is_regular_file(p, ec)) out.push_back(p);
      }
    }
    ::globfree(&g);
  }
  std::sort(out.begin(), out.end());
  if (out.empty())
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "no {} shards ({} files{}) at {}: check [data] path and split, or --data-dir",
                 format_name(format), ext, split.empty() ? "" : fmt::format(" named *{}*", split),
                 where.string());
  return out;
}

}  // namespace megacpp::data
