// PosixStorage: the checkpoint store's files on a POSIX filesystem.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "checkpoint/storage.h"
#include "core/error.h"
#include "core/util.h"

namespace megacpp::checkpoint {

namespace {

// Every this many bytes written, the range is handed to writeback (sync_file_range WRITE, which
// starts the device write and does not wait for it): the disk works while the next chunks are
// hashed and copied, and the final fsync waits only for the tail, the metadata and the cache
// flush. One fsync at the end still makes the file durable (DESIGN.md "Checkpoint write path").
constexpr uint64_t kWritebackWindow = 8ull << 20;

class PosixFile final : public WritableFile {
 public:
  explicit PosixFile(const fs::path& path)
      : path_(path),
        fd_(SYSCALL_CHECK_PATH(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                               "create", path.string())) {}

  void append(std::span<const std::byte> data,
              const std::function<void(uint64_t)>& on_write) override {
    const int fd = fd_.get();
    const std::byte* p = data.data();
    const size_t chunk = data.size();
    for (size_t done = 0; done < chunk;) {
      const ssize_t n =
          SYSCALL_CHECK_PATH(::write(fd, p + done, chunk - done), "write", path_.string());
      done += static_cast<size_t>(n);
      written_ += static_cast<uint64_t>(n);
      if (on_write) on_write(static_cast<uint64_t>(n));
    }
    if (written_ - handed_ >= kWritebackWindow) start_writeback();
  }

  void sync() override { SYSCALL_CHECK_PATH(::fsync(fd_.get()), "fsync", path_.string()); }

  void close() override { fd_.close_checked(); }

 private:
  // Starts the device write of [handed_, written_) without waiting for it. A filesystem or file
  // type without sync_file_range only loses the overlap (the final fsync writes everything);
  // an I/O error or a full disk is thrown with its errno, as from write(2).
  void start_writeback() {
    if (!writeback_) return;
    if (::sync_file_range(fd_.get(), static_cast<off_t>(handed_),
                          static_cast<off_t>(written_ - handed_), SYNC_FILE_RANGE_WRITE) != 0) {
      const int err = errno;
      if (err != EINVAL && err != ESPIPE && err != ENOSYS && err != EOPNOTSUPP)
        MEGACPP_FAIL_SYS(err, "cannot write {}: {}", path_.string(), std::strerror(err));
      writeback_ = false;
    }
    handed_ = written_;
  }

  fs::path path_;
  Fd fd_;
  uint64_t written_ = 0;
  uint64_t handed_ = 0;    // bytes [0, handed_) were handed to writeback
  bool writeback_ = true;  // false once the filesystem refuses sync_file_range
};

}  // namespace

std::unique_ptr<WritableFile> PosixStorage::create(const fs::path& path) {
  return std::make_unique<PosixFile>(path);
}

void PosixStorage::write_atomic(const fs::path& path, std::string_view bytes) {
  write_file_atomic(path, bytes);  // fsyncs the file and the directory that holds it
}

std::string PosixStorage::read(const fs::path& path) {
  return read_file(path);
}

uint64_t PosixStorage::file_size(const fs::path& path) {
  return fs::file_size(path);
}

void PosixStorage::remove(const fs::path& path) noexcept {
  ::unlink(path.c_str());
}

bool PosixStorage::exists(const fs::path& path) {
  return fs::exists(path);
}

bool PosixStorage::is_directory(const fs::path& path) {
  return fs::is_directory(path);
}

std::vector<Storage::Entry> PosixStorage::list(const fs::path& dir) {
  std::vector<Entry> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    out.push_back(
        {entry.path().filename().string(), entry.is_directory(), entry.is_regular_file()});
  }
  return out;
}

std::error_code PosixStorage::make_dirs(const fs::path& dir) noexcept {
  std::error_code ec;
  fs::create_directories(dir, ec);
  return ec;
}

std::error_code PosixStorage::rename(const fs::path& from, const fs::path& to) noexcept {
  int r;
  while ((r = ::rename(from.c_str(), to.c_str())) == -1 && errno == EINTR) {
  }
  return r == 0 ? std::error_code() : std::error_code(errno, std::system_category());
}

std::error_code PosixStorage::remove_all(const fs::path& path) noexcept {
  std::error_code ec;
  fs::remove_all(path, ec);
  return ec;
}

void PosixStorage::sync_dir(const fs::path& dir) {
  fsync_path(dir);
}

}  // namespace megacpp::checkpoint
