// Shared by the libFuzzer targets: one scratch directory per process (created on first use
// under /dev/shm, else the system temporary directory; removed at exit) whose fixed file names
// every input reuses, and a plain write of the input's bytes to one of them.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

namespace megacpp::fuzz {

// The process's scratch directory: made on first use, removed when the process exits
// normally (libFuzzer's runs end with exit(); a crash leaves it behind with the crash input).
class ScratchDir {
 public:
  ScratchDir() {
    std::error_code ec;
    std::filesystem::path base = "/dev/shm";
    if (::access(base.c_str(), W_OK) != 0) base = std::filesystem::temp_directory_path(ec);
    std::string templ = (base / "megacpp-fuzz-XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) {
      std::perror("megacpp fuzz: mkdtemp");
      std::abort();
    }
    path_ = templ;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
};

inline const std::filesystem::path& scratch_dir() {
  static const ScratchDir dir;
  return dir.path();
}

// Replaces `path` with exactly `n` bytes of `data`; aborts on an I/O error (not a finding in
// the code under test, so it must not pass silently either).
inline void write_bytes(const std::filesystem::path& path, const uint8_t* data, size_t n) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    std::perror("megacpp fuzz: open");
    std::abort();
  }
  size_t off = 0;
  while (off < n) {
    ssize_t w = ::write(fd, data + off, n - off);
    if (w < 0) {
      std::perror("megacpp fuzz: write");
      std::abort();
    }
    off += static_cast<size_t>(w);
  }
  ::close(fd);
}

// A broken invariant of a parser that accepted its input: abort, so libFuzzer saves it.
#define MEGACPP_FUZZ_ASSERT(cond)                                                           \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "megacpp fuzz: invariant broken: %s (%s:%d)\n", #cond, __FILE__, \
                   __LINE__);                                                               \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

}  // namespace megacpp::fuzz
