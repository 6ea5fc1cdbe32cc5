#include "ipc/handle_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"
#include "ipc/detail/internal.h"

namespace megacpp::ipc {

namespace {

sockaddr_un address_of(const std::filesystem::path& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string p = path.string();
  MEGACPP_CHECK(p.size() < sizeof a.sun_path, ErrorKind::kInvalidArgument,
                fmt::format("socket path {} is longer than {} bytes", p, sizeof a.sun_path - 1));
  std::memcpy(a.sun_path, p.c_str(), p.size() + 1);
  return a;
}

// Waits until `fd` has any of `events` or `timeout` passes; false on the timeout. A hang-up
// or error counts as ready (the call that follows reports it).
bool wait_ready(int fd, short events, Millis timeout) {
  const auto deadline = detail::Clock::now() + timeout;
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(detail::remaining_ms(deadline)));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) SYSCALL_FAIL("poll", errno);
  }
}

}  // namespace

ReceivedHandles::ReceivedHandles(std::string payload, const std::vector<int>& fds)
    : payload_(std::move(payload)) {
  fds_.reserve(fds.size());
  for (int fd : fds) fds_.emplace_back(fd);
}

std::unique_ptr<HandleConnection> HandleConnection::connect(const std::filesystem::path& path,
                                                            Millis timeout) {
  const sockaddr_un a = address_of(path);
  const auto deadline = detail::Clock::now() + timeout;
  for (;;) {
    detail::Fd fd(SYSCALL_CHECK(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)));
    const int r = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a);
    if (r == 0) return std::make_unique<HandleConnection>(fd.release());
    // Absent or not yet listening: a listener being (re)started.
    if (errno != ENOENT && errno != ECONNREFUSED && errno != EINTR && errno != EAGAIN)
      SYSCALL_FAIL(("connect " + path.string()).c_str(), errno);
    if (detail::Clock::now() >= deadline) return nullptr;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool HandleConnection::send(std::string_view payload, std::span<const int> fds, Millis timeout) {
  MEGACPP_CHECK(payload.size() <= kMaxHandlePayload && fds.size() <= kMaxHandleFds,
                ErrorKind::kInvalidArgument,
                fmt::format("a handle message carries at most {} bytes and {} descriptors",
                            kMaxHandlePayload, kMaxHandleFds));
  if (gone_) return false;
  // A zero-length seqpacket message is indistinguishable from the peer's end: always at
  // least one byte (the receiver drops it).
  std::string framed = "H";
  framed += payload;
  iovec iov{framed.data(), framed.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxHandleFds)] = {};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (!fds.empty()) {
    m.msg_control = control;
    m.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  const auto deadline = detail::Clock::now() + timeout;
  for (;;) {
    const ssize_t n = ::sendmsg(fd_.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return true;
    if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) {
      gone_ = true;
      return false;
    }
    if (errno != EAGAIN && errno != EINTR) SYSCALL_FAIL("sendmsg", errno);
    if (errno == EAGAIN && !wait_ready(fd_.get(), POLLOUT, Millis(detail::remaining_ms(deadline))))
      return false;
  }
}

std::optional<ReceivedHandles> HandleConnection::receive(Millis timeout) {
  if (gone_ || !wait_ready(fd_.get(), POLLIN, timeout)) return std::nullopt;
  std::string buffer(kMaxHandlePayload + 2, '\0');
  iovec iov{buffer.data(), buffer.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxHandleFds)] = {};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control;
  m.msg_controllen = sizeof control;
  const ssize_t n = ::recvmsg(fd_.get(), &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) {
    // A peer that closed with our message unread in its queue is reported by the kernel as a
    // reset, not an end: the same death.
    if (errno == ECONNRESET || errno == ENOTCONN || errno == EPIPE) {
      gone_ = true;
      return std::nullopt;
    }
    if (errno == EAGAIN || errno == EINTR) return std::nullopt;
    SYSCALL_FAIL("recvmsg", errno);
  }
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      fds.push_back(fd);
    }
  }
  // Owned from here, whatever follows.
  ReceivedHandles received(std::string(), fds);
  if (n == 0) {
    gone_ = true;
    return std::nullopt;
  }
  MEGACPP_CHECK((m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) == 0 && buffer[0] == 'H',
                ErrorKind::kProtocol,
                "handle socket: a truncated or foreign message (more than the payload or "
                "descriptor limit, or not framed by this protocol)");
  received.payload_ = buffer.substr(1, static_cast<size_t>(n) - 1);
  return received;
}

HandleListener::HandleListener(std::filesystem::path path) : path_(std::move(path)) {
  const sockaddr_un a = address_of(path_);
  // Non-blocking: a connection withdrawn between poll and accept must not block accept.
  detail::Fd fd(SYSCALL_CHECK(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0)));
  struct stat st {};
  // Only a socket file is replaced: anything else at the path is the caller's mistake.
  if (::lstat(path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(path_.c_str());
  SYSCALL_CHECK(::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a));
  SYSCALL_CHECK(::chmod(path_.c_str(), 0600));
  SYSCALL_CHECK(::listen(fd.get(), 64));
  fd_ = std::move(fd);
}

HandleListener::~HandleListener() {
  fd_.reset();
  ::unlink(path_.c_str());
}

std::unique_ptr<HandleConnection> HandleListener::accept(Millis timeout) {
  if (!wait_ready(fd_.get(), POLLIN, timeout)) return nullptr;
  Fd fd(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
  if (!fd.valid()) {
    if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) return nullptr;
    SYSCALL_FAIL("accept4", errno);
  }
  auto connection = std::make_unique<HandleConnection>(fd.get());
  fd.release();  // owned by the connection
  return connection;
}

}  // namespace megacpp::ipc
