// safetensors (https://github.com/huggingface/safetensors): u64 little-endian header length N,
// N bytes of JSON (space-padded here to a multiple of 8), then the data section.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <set>
#include <tuple>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "checkpoint/storage.h"
#include "core/error.h"
#include "core/util.h"

namespace megacpp::checkpoint {

namespace {

// The format's own bound on the header (safetensors refuses larger ones).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Each write(2) carries at most this much, hashed just before it is written: the write's copy
// into the page cache then reads the chunk from the CPU cache instead of memory a second time,
// and the progress callback fires at least once per chunk.
constexpr size_t kWriteChunk = 1ull << 20;

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
  Output(WritableFile& file_in, uint64_t total_in, const ProgressFn& on_chunk_in)
      : file(file_in), total(total_in), on_chunk(on_chunk_in) {}
  WritableFile& file;
  uint64_t total;
  const ProgressFn& on_chunk;
  Xxh3State hash = new_xxh3();
  uint64_t written = 0;
  const std::function<void(uint64_t)> on_write = [this](uint64_t n) {
    written += n;
    if (on_chunk) on_chunk(written, total);
  };

  void write_all(const std::byte* data, uint64_t bytes) {
    while (bytes > 0) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(bytes, kWriteChunk));
      XXH3_64bits_update(hash.get(), data, chunk);
      file.append({data, chunk}, on_write);
      data += chunk;
      bytes -= chunk;
    }
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

WrittenFile write_safetensors(Storage& storage, const fs::path& path,
                              std::span<const TensorView> tensors,
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
  const std::unique_ptr<WritableFile> file = storage.create(path);
  Output out(*file, total, on_chunk);
  try {
    out.write_all(length.data(), length.size());
    out.write_all(reinterpret_cast<const std::byte*>(text.data()), text.size());
    for (const TensorView& t : tensors) out.write_all(t.data, t.bytes);
    file->sync();
    if (on_chunk) on_chunk(out.written, total);
    file->close();
  } catch (...) {
    storage.remove(path);
    throw;
  }
  return WrittenFile{total, xxh3_digest_hex(out.hash.get()), static_cast<uint32_t>(tensors.size())};
}

WrittenFile write_safetensors(const fs::path& path, std::span<const TensorView> tensors,
                              const std::map<std::string, std::string>& metadata,
                              const ProgressFn& on_chunk) {
  PosixStorage storage;
  return write_safetensors(storage, path, tensors, metadata, on_chunk);
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

}  // namespace megacpp::checkpoint
