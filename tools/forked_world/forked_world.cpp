// ForkedWorld's store: a c10d TCPStore server in a process of its own, forked once when the
// world is made, and a client of it for this process. The ranks are forked later from this
// process, which then holds no store thread: a rank forked while the server's thread held a
// lock the child needs (c10's, libuv's) would wait on it forever — ranks that never reached
// their rendezvous under load were that.
#include "tools/forked_world/forked_world.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace megacpp::forked_world {

struct ForkedWorld::Impl {
  pid_t server = -1;
  int alive_write = -1;  // the server exits when this closes (or this process dies)
  uint16_t port = 0;
  c10::intrusive_ptr<c10d::TCPStore> client;
};

namespace {
[[noreturn]] void fail(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}
}  // namespace

ForkedWorld::ForkedWorld(uint32_t size, std::chrono::milliseconds store_timeout)
    : size_(size), impl_(std::make_unique<Impl>()) {
  const int listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd < 0) fail("forked world store: socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(listen_fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::listen(listen_fd, SOMAXCONN) != 0 ||
      ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int err = errno;
    ::close(listen_fd);
    errno = err;
    fail("forked world store: listen");
  }
  impl_->port = ntohs(a.sin_port);
  int alive[2];
  if (::pipe2(alive, O_CLOEXEC) != 0) {
    ::close(listen_fd);
    fail("forked world store: pipe");
  }
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(listen_fd);
    ::close(alive[0]);
    ::close(alive[1]);
    fail("forked world store: fork");
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::close(alive[1]);
    int rc = 0;
    try {
      c10d::TCPStoreOptions so;
      so.port = impl_->port;
      so.isServer = true;
      so.waitWorkers = false;
      so.timeout = store_timeout;
      so.masterListenFd = listen_fd;  // the store takes it over
      const auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
      char c = 0;
      while (::read(alive[0], &c, 1) < 0 && errno == EINTR) {
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "forked world store: %s\n", e.what());
      rc = 1;
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  ::close(listen_fd);
  ::close(alive[0]);
  impl_->server = pid;
  impl_->alive_write = alive[1];
  c10d::TCPStoreOptions co;
  co.port = impl_->port;
  co.isServer = false;
  co.waitWorkers = false;
  co.timeout = store_timeout;
  impl_->client = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", co);
}

ForkedWorld::~ForkedWorld() {
  impl_->client.reset();
  ::close(impl_->alive_write);
  int status = 0;
  while (::waitpid(impl_->server, &status, 0) < 0 && errno == EINTR) {
  }
}

uint16_t ForkedWorld::store_port() const {
  return impl_->port;
}

c10d::Store& ForkedWorld::store() const {
  return *impl_->client;
}

}  // namespace megacpp::forked_world
