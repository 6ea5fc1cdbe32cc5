// megacpp::checkpoint safetensors — the file format of every rank file and of `megacpp export`:
// a writer that streams tensors from a staging region straight to a file (no copy of the
// region), and a validating header reader. https://github.com/huggingface/safetensors
//
// Torch-free: tensors are bytes plus dtype/shape metadata.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace megacpp::checkpoint {

namespace fs = std::filesystem;

class Storage;

// Element size of a safetensors dtype name ("F32" -> 4, "BF16" -> 2, "BOOL" -> 1, ...);
// nullopt for a name the format does not define.
std::optional<size_t> dtype_size(std::string_view dtype);

// One tensor to write. `data` points at `bytes` bytes that stay valid and unchanged for
// the duration of the write (a leased staging region).
struct TensorView {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  const std::byte* data = nullptr;
  uint64_t bytes = 0;
};

struct WrittenFile {
  uint64_t bytes = 0;  // file size
  std::string xxh3;    // XXH3-64 hex of the whole file (same format as core xxh3_hex)
  uint32_t tensors = 0;
};

// Called with the bytes of the file written so far and the file's full size: once (0, total)
// before the file is created, then after every write(2) that reached the file (at most
// 1 MiB) and after the fsync. A slow write keeps calling it, a write blocked in the kernel
// does not (the checkpointer's progress stamp, judged by the supervisor). When a write fails,
// the last `written` reported is what reached the file.
using ProgressFn = std::function<void(uint64_t written, uint64_t total)>;

// Writes a safetensors file at `path` of `storage` (created or truncated, mode 0644) and makes
// it durable (fsync). Data is laid out in the order given. `metadata` lands in "__metadata__"
// after "format": "pt". Throws Error{kInvalidArgument} for an unknown dtype, a byte count that
// does not match the shape, or a duplicate/reserved name (before the file is created);
// Error{kSystem} with the errno kept on an I/O failure (the partial file is removed).
WrittenFile write_safetensors(Storage& storage, const fs::path& path,
                              std::span<const TensorView> tensors,
                              const std::map<std::string, std::string>& metadata = {},
                              const ProgressFn& on_chunk = {});
// The same on the local filesystem (PosixStorage).
WrittenFile write_safetensors(const fs::path& path, std::span<const TensorView> tensors,
                              const std::map<std::string, std::string>& metadata = {},
                              const ProgressFn& on_chunk = {});

struct SafetensorsTensor {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;               // length of the JSON header (padding included)
  uint64_t data_bytes = 0;                 // size of the data section
  std::vector<SafetensorsTensor> tensors;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
};

// Parses and validates a header: `prefix` holds at least the first 8 + header_bytes bytes of
// a file of `file_size` bytes. Checks: JSON object, known dtypes, byte counts match shapes,
// offsets contiguous from 0 and covering exactly the data section. Throws
// Error{kCorruption} naming the problem.
SafetensorsHeader parse_safetensors_header(std::string_view prefix, uint64_t file_size);
// Reads only the header of the file at `path` and parses it as above.
SafetensorsHeader read_safetensors_header(const fs::path& path);

// XXH3-64 hex of a file, streamed (never the whole file in memory).
std::string xxh3_file(const fs::path& path);

}  // namespace megacpp::checkpoint
