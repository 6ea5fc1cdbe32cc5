// megacpp::checkpoint storage — where a CheckpointStore keeps its files (torchtitan's
// checkpointer has the same seam: the commit protocol above, the medium below).
//
// The store needs only these operations; PosixStorage implements them on a local or shared
// POSIX filesystem. Another medium (an object store, a filesystem without atomic rename) adds
// an implementation and keeps the store's guarantee: rename() of a directory is what commits a
// checkpoint, so it must be atomic (all of the directory under the new name, or none of it),
// and sync_dir() makes a rename or removal in that directory durable.
//
// Paths are the store's names (RUN/checkpoints/step_NNNNNNNN.tmp/rank_0.safetensors); a
// medium that has no directories maps them to keys. Errors are Error{kSystem} with the errno
// kept (callers tell a full disk apart: is_out_of_space), or a std::error_code where the
// caller words the message itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace megacpp::checkpoint {

namespace fs = std::filesystem;

// A file being created by Storage::create. Nothing is durable before sync(); destroying it
// without close() closes it unchecked (it is then abandoned: the caller removes it).
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Appends every byte of `data`, in as many writes as the medium takes; `on_write` (may be
  // empty) is called with the byte count of each write that reached the file, so a caller's
  // progress moves while a large append is under way. Throws Error{kSystem} ("cannot write
  // PATH: ...") on failure; what was reported through `on_write` reached the file.
  virtual void append(std::span<const std::byte> data,
                      const std::function<void(uint64_t bytes)>& on_write) = 0;
  // Makes every appended byte durable (fsync). Throws Error{kSystem} ("cannot fsync PATH").
  virtual void sync() = 0;
  // Closes the file, reporting a failed close (Error{kSystem}).
  virtual void close() = 0;
};

class Storage {
 public:
  virtual ~Storage() = default;

  struct Entry {
    std::string name;           // within the listed directory
    bool directory = false;     // symbolic links followed
    bool regular_file = false;  // symbolic links followed
  };

  // Files.
  // Creates (or truncates) the file at `path`, mode 0644. Throws Error{kSystem}
  // ("cannot create PATH: ...").
  virtual std::unique_ptr<WritableFile> create(const fs::path& path) = 0;
  // Replaces `path` with `bytes` durably: a crash leaves the old content or the new one.
  virtual void write_atomic(const fs::path& path, std::string_view bytes) = 0;
  virtual std::string read(const fs::path& path) = 0;
  virtual uint64_t file_size(const fs::path& path) = 0;
  // Removes one file; best effort (a file that stays is the caller's leftover to discard).
  virtual void remove(const fs::path& path) noexcept = 0;

  // Directories.
  virtual bool exists(const fs::path& path) = 0;
  virtual bool is_directory(const fs::path& path) = 0;
  // The entries of `dir` in the medium's order (not sorted).
  virtual std::vector<Entry> list(const fs::path& dir) = 0;
  // Creates `dir` and its missing parents; an error code when it cannot.
  virtual std::error_code make_dirs(const fs::path& dir) noexcept = 0;
  // Renames a file or directory atomically (the commit of a checkpoint); an error code (errno
  // for PosixStorage) when it cannot. Not durable before sync_dir of the parent.
  virtual std::error_code rename(const fs::path& from, const fs::path& to) noexcept = 0;
  // Removes a file or a whole tree; absent is no error; an error code when it cannot.
  virtual std::error_code remove_all(const fs::path& path) noexcept = 0;
  // Makes the entries of `dir` (creations, renames, removals) durable.
  virtual void sync_dir(const fs::path& dir) = 0;
};

// The local (or shared, e.g. NFS, Lustre) POSIX filesystem: write(2) with early writeback
// (sync_file_range) and fsync for files, rename(2) and an fsync of the directory for commits
// (DESIGN.md "Checkpoint write path"). Stateless: any number may exist.
class PosixStorage final : public Storage {
 public:
  std::unique_ptr<WritableFile> create(const fs::path& path) override;
  void write_atomic(const fs::path& path, std::string_view bytes) override;
  std::string read(const fs::path& path) override;
  uint64_t file_size(const fs::path& path) override;
  void remove(const fs::path& path) noexcept override;
  bool exists(const fs::path& path) override;
  bool is_directory(const fs::path& path) override;
  std::vector<Entry> list(const fs::path& dir) override;
  std::error_code make_dirs(const fs::path& dir) noexcept override;
  std::error_code rename(const fs::path& from, const fs::path& to) noexcept override;
  std::error_code remove_all(const fs::path& path) noexcept override;
  void sync_dir(const fs::path& dir) override;
};

}  // namespace megacpp::checkpoint
