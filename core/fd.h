// An owned file descriptor: the one RAII type for every descriptor megacpp opens (files,
// sockets, shared memory, pidfds). Above core/error.h (close_checked throws), below util.h.
#pragma once

#include <utility>

namespace megacpp {

// Owns one descriptor (or none: -1) and closes it on destruction; movable, not copyable.
// The destructor ignores a failed close (the descriptor is released either way and a
// destructor must not throw); a caller that must see a deferred write error calls
// close_checked().
class Fd {
 public:
  Fd() noexcept = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }

  int get() const noexcept { return fd_; }
  bool valid() const noexcept { return fd_ >= 0; }
  // Gives up ownership (the caller closes the descriptor).
  int release() noexcept { return std::exchange(fd_, -1); }
  // Closes the descriptor held (errors ignored) and takes `fd`.
  void reset(int fd = -1) noexcept;
  // Closes now and throws Error{kSystem} for a failed close (a deferred write error on some
  // filesystems: the last chance to see it).
  void close_checked();

 private:
  int fd_ = -1;
};

}  // namespace megacpp
