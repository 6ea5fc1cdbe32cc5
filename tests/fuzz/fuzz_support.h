// Shared by the libFuzzer targets: one scratch directory per process (created on first use
// under /dev/shm, else $TMPDIR or /tmp; removed at exit) whose fixed file names every input
// reuses, and a plain write of the input's bytes to one of them.
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

inline const std::filesystem::path& scratch_dir() {
  // Never destroyed: the exit handler below runs after the destructors of statics made later.
  static const std::filesystem::path* dir = [] {
    std::string base = "/dev/shm";
    if (::access(base.c_str(), W_OK) != 0) {
      const char* tmp = std::getenv("TMPDIR");
      base = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    }
    std::string templ = base + "/megacpp-fuzz-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) {
      std::perror("megacpp fuzz: mkdtemp");
      std::abort();
    }
    auto* path = new std::filesystem::path(templ);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(*dir, ec);
    });
    return path;
  }();
  return *dir;
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
