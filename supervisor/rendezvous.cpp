#include "supervisor/rendezvous.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"

namespace megacpp::supervisor {

namespace {

// A listening TCP socket bound to `host` itself. c10d's TCPStore server, given only a port,
// binds the wildcard address (all interfaces, IPv4 and IPv6) whatever host it is handed;
// an unauthenticated rendezvous must be reachable only where it was asked to be.
int listen_on(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "rendezvous host {}: {}", host, ::gai_strerror(rc));
  }
  std::string why = "no address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) {
    MEGACPP_FAIL(ErrorKind::kSystem, "could not listen for the rendezvous on {}:{}: {}", host, port,
                 why);
  }
  return fd;
}

uint16_t bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  SYSCALL_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len));
  return addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

}  // namespace

struct StoreServer::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

StoreServer::StoreServer(const std::string& host, uint16_t port, uint32_t world)
    : impl_(std::make_unique<Impl>()) {
  const int fd = listen_on(host, port);
  c10d::TCPStoreOptions o;
  o.port = bound_port(fd);
  o.isServer = true;
  o.numWorkers = static_cast<int>(world);
  o.waitWorkers = false;
  o.timeout = std::chrono::seconds(60);
  // The store takes the socket over (both backends) and closes it when destroyed.
  o.masterListenFd = fd;
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(host, o);
  } catch (const std::exception& e) {
    MEGACPP_FAIL(ErrorKind::kSystem, "could not host the c10d TCPStore: {}", e.what());
  }
}

StoreServer::~StoreServer() = default;

uint16_t StoreServer::port() const {
  return impl_->store->getPort();
}

std::string torch_version() {
  return MEGACPP_TORCH_VERSION;
}

}  // namespace megacpp::supervisor
