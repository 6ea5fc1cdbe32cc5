#include "core/fd.h"

#include <unistd.h>

#include "core/error.h"

namespace megacpp {

void Fd::reset(int fd) noexcept {
  const int old = std::exchange(fd_, fd);
  if (old >= 0) ::close(old);
}

void Fd::close_checked() {
  const int fd = release();
  if (fd < 0) return;
  // No retry on EINTR: the descriptor is released whatever close returns (Linux).
  if (::close(fd) == -1 && errno != EINTR)
    detail::throw_syscall("::close(fd)", errno, __FILE__, __LINE__);
}

}  // namespace megacpp
