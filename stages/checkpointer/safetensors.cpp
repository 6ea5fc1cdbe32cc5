// safetensors (https://github.com/huggingface/safetensors): u64 little-endian header length N,
// N bytes of JSON (space-padded here to a multiple of 8), then the data section.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <atomic>
#include <cerrno>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <set>
#include <tuple>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/util.h"
#include "stages/checkpointer/checkpointer.h"

namespace megacpp::checkpointer {

namespace {

// The format's own bound on the header (safetensors refuses larger ones).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Each write(2) carries at most this much, hashed just before it is written: the write's copy
// into the page cache then reads the chunk from the CPU cache instead of memory a second time,
// and the progress callback fires at least once per chunk.
constexpr size_t kWriteChunk = 1ull << 20;
// Every this many bytes written, the range is handed to writeback (sync_file_range WRITE, which
// starts the device write and does not wait for it): the disk works while the next chunks are
// hashed and copied, and the final fsync waits only for the tail, the metadata and the cache
// flush. One fsync at the end still makes the file durable (DESIGN.md "Checkpoint write path").
constexpr uint64_t kWritebackWindow = 8ull << 20;

struct Xxh3StateDeleter {
  void operator()(XXH3_state_t* s) const noexcept { XXH3_freeState(s); }
};
using Xxh3State = std::unique_ptr<XXH3_state_t, Xxh3StateDeleter>;

Xxh3State new_xxh3() {
  Xxh3State state(XXH3_createState());
  MEGACPP_CHECK(state != nullptr, ErrorKind::kSystem, "XXH3_createState failed");
  XXH3_64bits_reset(state.get());
  return state;
}

std::string xxh3_digest_hex(XXH3_state_t* state) {
  return fmt::format("{:016x}", XXH3_64bits_digest(state));
}

// The open file of write_safetensors: every byte that reaches it is hashed and counted.
struct Output {
  Output(const fs::path& path_in, int fd_in, uint64_t total_in, const ProgressFn& on_chunk_in)
      : path(path_in), fd(fd_in), total(total_in), on_chunk(on_chunk_in) {}
  const fs::path& path;
  int fd;
  uint64_t total;
  const ProgressFn& on_chunk;
  Xxh3State hash = new_xxh3();
  uint64_t written = 0;

  uint64_t handed = 0;    // bytes [0, handed) were handed to writeback
  bool writeback = true;  // false once the filesystem refuses sync_file_range

  void write_all(const std::byte* data, uint64_t bytes) {
    while (bytes > 0) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(bytes, kWriteChunk));
      XXH3_64bits_update(hash.get(), data, chunk);
      for (size_t done = 0; done < chunk;) {
        const ssize_t n =
            SYSCALL_CHECK_PATH(::write(fd, data + done, chunk - done), "write", path.string());
        done += static_cast<size_t>(n);
        written += static_cast<uint64_t>(n);
        if (on_chunk) on_chunk(written, total);
      }
      data += chunk;
      bytes -= chunk;
      if (written - handed >= kWritebackWindow) start_writeback();
    }
  }

  // Starts the device write of [handed, written) without waiting for it. A filesystem or file
  // type without sync_file_range only loses the overlap (the final fsync writes everything);
  // an I/O error or a full disk is thrown with its errno, as from write(2).
  void start_writeback() {
    if (!writeback) return;
    if (::sync_file_range(fd, static_cast<off_t>(handed), static_cast<off_t>(written - handed),
                          SYNC_FILE_RANGE_WRITE) != 0) {
      const int err = errno;
      if (err != EINVAL && err != ESPIPE && err != ENOSYS && err != EOPNOTSUPP)
        MEGACPP_FAIL_SYS(err, "cannot write {}: {}", path.string(), std::strerror(err));
      writeback = false;
    }
    handed = written;
  }
};

[[noreturn]] void corrupt(const std::string& what) {
  MEGACPP_FAIL(ErrorKind::kCorruption, "{}", what);
}

uint64_t le64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// Number of data bytes a tensor of `dtype` and `shape` occupies; nullopt on overflow.
std::optional<uint64_t> tensor_bytes(size_t element, std::span<const uint64_t> shape) {
  uint64_t n = element;
  for (uint64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

}  // namespace

std::optional<size_t> dtype_size(std::string_view dtype) {
  static constexpr std::array<std::pair<std::string_view, size_t>, 16> kSizes{{
      {"BOOL", 1},
      {"U8", 1},
      {"I8", 1},
      {"F8_E5M2", 1},
      {"F8_E4M3", 1},
      {"F8_E8M0", 1},
      {"I16", 2},
      {"U16", 2},
      {"F16", 2},
      {"BF16", 2},
      {"I32", 4},
      {"U32", 4},
      {"F32", 4},
      {"F64", 8},
      {"I64", 8},
      {"U64", 8},
  }};
  for (const auto& [name, size] : kSizes) {
    if (name == dtype) return size;
  }
  return std::nullopt;
}

WrittenFile write_safetensors(const fs::path& path, std::span<const TensorView> tensors,
                              const std::map<std::string, std::string>& metadata,
                              const ProgressFn& on_chunk) {
  // Header: "__metadata__" first, then tensors in data order (readers sort by offset anyway).
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  meta["format"] = "pt";
  for (const auto& [k, v] : metadata) {
    if (k != "format") meta[k] = v;
  }
  header["__metadata__"] = std::move(meta);

  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const TensorView& t : tensors) {
    auto element = dtype_size(t.dtype);
    MEGACPP_CHECK(element.has_value(), ErrorKind::kInvalidArgument,
                  fmt::format("tensor '{}': unknown safetensors dtype '{}'", t.name, t.dtype));
    auto expect = tensor_bytes(*element, t.shape);
    MEGACPP_CHECK(expect.has_value() && *expect == t.bytes, ErrorKind::kInvalidArgument,
                  fmt::format("tensor '{}': {} bytes do not match dtype {} and its shape", t.name,
                              t.bytes, t.dtype));
    MEGACPP_CHECK(t.name != "__metadata__" && names.insert(t.name).second,
                  ErrorKind::kInvalidArgument,
                  fmt::format("tensor name '{}' is reserved or duplicated", t.name));
    MEGACPP_CHECK(t.bytes == 0 || t.data != nullptr, ErrorKind::kInvalidArgument,
                  fmt::format("tensor '{}' has no data", t.name));
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }

  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{}: cannot encode the safetensors header: {}",
                 path.string(), e.what());
  }
  text.resize((text.size() + 7) / 8 * 8, ' ');
  std::array<std::byte, 8> length{};
  for (size_t i = 0; i < 8; ++i)
    length[i] = static_cast<std::byte>((text.size() >> (8 * i)) & 0xff);

  const uint64_t total = 8 + text.size() + offset;
  if (on_chunk) on_chunk(0, total);
  Fd fd(SYSCALL_CHECK_PATH(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                           "create", path.string()));
  Output out(path, fd.get(), total, on_chunk);
  try {
    out.write_all(length.data(), length.size());
    out.write_all(reinterpret_cast<const std::byte*>(text.data()), text.size());
    for (const TensorView& t : tensors) out.write_all(t.data, t.bytes);
    SYSCALL_CHECK_PATH(::fsync(fd.get()), "fsync", path.string());
    if (on_chunk) on_chunk(out.written, total);
    fd.close_checked();
  } catch (...) {
    ::unlink(path.c_str());
    throw;
  }
  return WrittenFile{total, xxh3_digest_hex(out.hash.get()), static_cast<uint32_t>(tensors.size())};
}

SafetensorsHeader parse_safetensors_header(std::string_view prefix, uint64_t file_size) {
  if (prefix.size() < 8 || file_size < 8)
    corrupt("safetensors: shorter than the 8-byte header length");
  SafetensorsHeader out;
  out.header_bytes = le64(prefix.data());
  if (out.header_bytes > kMaxHeaderBytes || out.header_bytes > file_size - 8) {
    corrupt(fmt::format("safetensors: header length {} exceeds the file ({} bytes)",
                        out.header_bytes, file_size));
  }
  if (prefix.size() < 8 + out.header_bytes) corrupt("safetensors: header truncated");
  out.data_bytes = file_size - 8 - out.header_bytes;

  auto json = nlohmann::json::parse(prefix.substr(8, out.header_bytes), nullptr, false);
  if (json.is_discarded() || !json.is_object()) corrupt("safetensors: header is not a JSON object");
  for (const auto& [name, value] : json.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) corrupt("safetensors: __metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) corrupt(fmt::format("safetensors: metadata '{}' is not a string", k));
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    if (!value.is_object()) corrupt(fmt::format("safetensors: entry '{}' is not an object", name));
    SafetensorsTensor t;
    t.name = name;
    auto dtype = value.find("dtype");
    auto shape = value.find("shape");
    auto offsets = value.find("data_offsets");
    if (dtype == value.end() || !dtype->is_string() || shape == value.end() || !shape->is_array() ||
        offsets == value.end() || !offsets->is_array() || offsets->size() != 2) {
      corrupt(fmt::format("safetensors: tensor '{}' lacks dtype, shape or data_offsets", name));
    }
    t.dtype = dtype->get<std::string>();
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned())
        corrupt(fmt::format("safetensors: tensor '{}': bad shape", name));
      t.shape.push_back(d.get<uint64_t>());
    }
    if (!(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
      corrupt(fmt::format("safetensors: tensor '{}': bad data_offsets", name));
    }
    t.begin = (*offsets)[0].get<uint64_t>();
    t.end = (*offsets)[1].get<uint64_t>();
    auto element = dtype_size(t.dtype);
    if (!element)
      corrupt(fmt::format("safetensors: tensor '{}': unknown dtype '{}'", name, t.dtype));
    auto bytes = tensor_bytes(*element, t.shape);
    if (t.end < t.begin || !bytes || *bytes != t.end - t.begin) {
      corrupt(fmt::format("safetensors: tensor '{}': data_offsets [{}, {}] do not match {} {}",
                          name, t.begin, t.end, t.dtype, nlohmann::json(t.shape).dump()));
    }
    out.tensors.push_back(std::move(t));
  }
  std::sort(out.tensors.begin(), out.tensors.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t expected = 0;
  for (const auto& t : out.tensors) {
    if (t.begin != expected) {
      corrupt(fmt::format("safetensors: tensor '{}' starts at {}, expected {} (gap or overlap)",
                          t.name, t.begin, expected));
    }
    expected = t.end;
  }
  if (expected != out.data_bytes) {
    corrupt(fmt::format("safetensors: tensors cover {} bytes but the data section holds {}",
                        expected, out.data_bytes));
  }
  return out;
}

SafetensorsHeader read_safetensors_header(const fs::path& path) {
  Fd fd(SYSCALL_CHECK_PATH(::open(path.c_str(), O_RDONLY | O_CLOEXEC), "open", path.string()));
  struct stat st {};
  SYSCALL_CHECK(::fstat(fd.get(), &st));
  const auto size = static_cast<uint64_t>(st.st_size);
  std::string prefix(static_cast<size_t>(std::min<uint64_t>(size, 8)), '\0');
  auto read_exact = [&](char* dst, size_t n, uint64_t at) {
    size_t done = 0;
    while (done < n) {
      ssize_t r =
          SYSCALL_CHECK(::pread(fd.get(), dst + done, n - done, static_cast<off_t>(at + done)));
      if (r == 0) corrupt(fmt::format("{}: unexpected end of file", path.string()));
      done += static_cast<size_t>(r);
    }
  };
  try {
    read_exact(prefix.data(), prefix.size(), 0);
    if (prefix.size() == 8) {
      uint64_t n = le64(prefix.data());
      if (n <= kMaxHeaderBytes && n <= size - 8) {
        prefix.resize(8 + n);
        read_exact(prefix.data() + 8, n, 8);
      }
    }
    return parse_safetensors_header(prefix, size);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kCorruption) throw;
    MEGACPP_FAIL(ErrorKind::kCorruption, "{}: {}", path.string(), e.message());
  }
}

std::optional<uint32_t> read_staging_stamp(const std::byte* p) {
  auto* stamp = reinterpret_cast<StagingStamp*>(const_cast<std::byte*>(p));
  if (std::atomic_ref<uint64_t>(stamp->magic).load(std::memory_order_acquire) != kStagingStampMagic)
    return std::nullopt;
  return std::atomic_ref<uint32_t>(stamp->step).load(std::memory_order_acquire);
}

// The share is copied with non-temporal (streaming) stores (ops::stream_copy), which x86 does
// not order with ordinary stores, and a release fence is only a compiler barrier there. Both
// ends of the copy therefore take a full fence (MFENCE, which drains the write-combining buffers
// too): the cleared stamp is visible before any byte of the new share, and every byte of the
// share before the new stamp. Without them a reader could pair the old stamp with new bytes,
// or the new stamp with bytes still in flight: a torn snapshot that passes the stamp check.
namespace {
void full_fence() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_mfence();
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}
}  // namespace

void clear_staging_stamp(std::byte* p) {
  auto* stamp = reinterpret_cast<StagingStamp*>(p);
  std::atomic_ref<uint32_t>(stamp->step).store(0, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(stamp->magic).store(kStagingStampMagic, std::memory_order_relaxed);
  full_fence();
}

void set_staging_stamp(std::byte* p, uint32_t step) {
  auto* stamp = reinterpret_cast<StagingStamp*>(p);
  full_fence();
  std::atomic_ref<uint32_t>(stamp->step).store(step, std::memory_order_release);
}

std::string xxh3_file(const fs::path& path) {
  Fd fd(SYSCALL_CHECK_PATH(::open(path.c_str(), O_RDONLY | O_CLOEXEC), "open", path.string()));
  auto hash = new_xxh3();
  std::vector<char> buf(1 << 20);
  for (;;) {
    ssize_t n = SYSCALL_CHECK(::read(fd.get(), buf.data(), buf.size()));
    if (n == 0) break;
    XXH3_64bits_update(hash.get(), buf.data(), static_cast<size_t>(n));
  }
  return xxh3_digest_hex(hash.get());
}

}  // namespace megacpp::checkpointer
