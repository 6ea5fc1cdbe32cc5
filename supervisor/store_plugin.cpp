// libmegacpp_store.so: the c10d TCPStore the trainer ranks rendezvous through, for the
// supervisor to host, and a client of such a store (a node joining its job through node 0's
// store, membership.cpp). The `megacpp` command loads it with dlopen when a run starts
// (rendezvous.cpp), so the command itself links no torch: collect, status, list, compare, plan,
// verify and export run where torch is out of reach. C ABI; failures are a return code and a
// one-line message, never an exception across the boundary.
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/fd.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

struct Store {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

// The client functions' results (rendezvous.cpp mirrors them).
constexpr int kOk = 0;
constexpr int kAbsent = 1;  // get: the key was not set within the timeout
constexpr int kFailed = 2;  // `error` says why

// Runs `op`, turning any exception into kFailed and a one-line message: nothing is thrown
// across the C ABI. The message names no key: keys may carry the job's secret prefix.
template <typename Op>
int guarded(const char* what, char* error, size_t error_len, Op&& op) noexcept {
  try {
    return op();
  } catch (const std::exception& e) {
    // c10's messages carry a backtrace after the first line; the user's line is the first.
    std::string first = e.what();
    first = first.substr(0, first.find('\n'));
    std::snprintf(error, error_len, "store %s failed: %s", what, first.c_str());
  } catch (...) {
    std::snprintf(error, error_len, "store %s failed", what);
  }
  return kFailed;
}

// A listening TCP socket bound to `host` itself. c10d's TCPStore server, given only a port,
// binds the wildcard address (all interfaces, IPv4 and IPv6) whatever host it is handed; an
// unauthenticated rendezvous must be reachable only where it was asked to be. None held when
// `host` does not resolve (`unresolved` set) or no socket could be bound; `why` says why.
megacpp::Fd listen_on(const char* host, uint16_t port, bool& unresolved, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host, service.c_str(), &hints, &found); rc != 0) {
    unresolved = true;
    why = ::gai_strerror(rc);
    return {};
  }
  why = "no address";
  megacpp::Fd fd;
  for (addrinfo* a = found; a != nullptr && !fd.valid(); a = a->ai_next) {
    megacpp::Fd candidate(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (!candidate.valid()) {
      why = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(candidate.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(candidate.get(), a->ai_addr, a->ai_addrlen) != 0 ||
        ::listen(candidate.get(), SOMAXCONN) != 0) {
      why = std::strerror(errno);
      continue;
    }
    fd = std::move(candidate);
  }
  ::freeaddrinfo(found);
  return fd;
}

uint16_t bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  return addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

}  // namespace

extern "C" {

// Hosts a server on `host` (port 0: any free port) for `world` workers. Returns the store, or
// nullptr with `error` filled and *code = 2 (the host does not resolve) or 1 (anything else).
__attribute__((visibility("default"))) void* megacpp_store_create(const char* host, uint16_t port,
                                                                  uint32_t world, int* code,
                                                                  char* error, size_t error_len) {
  std::string why;
  bool unresolved = false;
  megacpp::Fd fd = listen_on(host, port, unresolved, why);
  if (!fd.valid()) {
    *code = unresolved ? 2 : 1;
    std::snprintf(error, error_len, "%s%s:%u: %s",
                  unresolved ? "rendezvous host " : "could not listen for the rendezvous on ", host,
                  static_cast<unsigned>(port), why.c_str());
    return nullptr;
  }
  c10d::TCPStoreOptions o;
  o.port = bound_port(fd.get());
  o.isServer = true;
  o.numWorkers = static_cast<int>(world);
  o.waitWorkers = false;
  o.timeout = std::chrono::seconds(60);
  // The store takes the socket over (both backends) and closes it when destroyed.
  o.masterListenFd = fd.release();
  try {
    auto s = std::make_unique<Store>();
    s->store = c10::make_intrusive<c10d::TCPStore>(host, o);
    return s.release();  // the caller owns it until megacpp_store_destroy
  } catch (const std::exception& e) {
    *code = 1;
    std::snprintf(error, error_len, "could not host the c10d TCPStore: %s", e.what());
    return nullptr;
  }
}

__attribute__((visibility("default"))) uint16_t megacpp_store_port(const void* store) {
  return static_cast<const Store*>(store)->store->getPort();
}

__attribute__((visibility("default"))) void megacpp_store_destroy(void* store) {
  std::unique_ptr<Store>(static_cast<Store*>(store)).reset();
}

// A client of the store at host:port, connecting (and retrying, as c10d does) for at most
// `timeout_ms`, which is also the bound of every later call but get's own wait. Returns the
// client, or nullptr with `error` filled and *code = 2 (nothing answered in time: no server
// yet, or none at that address) or 1 (anything else).
__attribute__((visibility("default"))) void* megacpp_store_connect(const char* host, uint16_t port,
                                                                   uint32_t timeout_ms, int* code,
                                                                   char* error, size_t error_len) {
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  try {
    auto s = std::make_unique<Store>();
    s->store = c10::make_intrusive<c10d::TCPStore>(host, o);
    return s.release();  // the caller owns it until megacpp_store_client_destroy
  } catch (const c10::DistNetworkError& e) {
    *code = 2;
    std::string first = e.what();
    std::snprintf(error, error_len, "no store answered at %s:%u within %u ms: %s", host,
                  static_cast<unsigned>(port), timeout_ms,
                  first.substr(0, first.find('\n')).c_str());
  } catch (const std::exception& e) {
    *code = 1;
    std::string first = e.what();
    std::snprintf(error, error_len, "could not connect to the store at %s:%u: %s", host,
                  static_cast<unsigned>(port), first.substr(0, first.find('\n')).c_str());
  } catch (...) {
    *code = 1;
    std::snprintf(error, error_len, "could not connect to the store at %s:%u", host,
                  static_cast<unsigned>(port));
  }
  return nullptr;
}

// Sets `key` to `len` bytes. 0, or 2 with `error` filled.
__attribute__((visibility("default"))) int megacpp_store_set(void* client, const char* key,
                                                             const char* value, size_t len,
                                                             char* error, size_t error_len) {
  return guarded("set", error, error_len, [&] {
    static_cast<Store*>(client)->store->set(key, std::vector<uint8_t>(value, value + len));
    return kOk;
  });
}

// Waits at most `timeout_ms` (0: does not wait) for `key` to be set, then hands its value to
// `sink(context, bytes, len)` before returning 0. 1: not set within the timeout (an expected
// answer, the connection stays usable). 2: `error` filled (the store went away, ...).
// `sink` must not throw.
__attribute__((visibility("default"))) int megacpp_store_get(
    void* client, const char* key, uint32_t timeout_ms, void (*sink)(void*, const char*, size_t),
    void* context, char* error, size_t error_len) {
  return guarded("get", error, error_len, [&] {
    c10d::TCPStore& store = *static_cast<Store*>(client)->store;
    if (timeout_ms == 0) {
      if (!store.check({key})) return kAbsent;
    } else {
      try {
        store.wait({key}, std::chrono::milliseconds(timeout_ms));
      } catch (const c10::DistNetworkError&) {
        throw;  // the connection, not the key: a failure
      } catch (const c10::DistStoreError&) {
        return kAbsent;  // c10d's "wait timeout": it cancels the wait, the client stays usable
      }
    }
    const std::vector<uint8_t> value = store.get(key);
    sink(context, reinterpret_cast<const char*>(value.data()), value.size());
    return kOk;
  });
}

// Adds `delta` to the counter `key` (0 before its first add) and stores its new value in
// *result. 0, or 2 with `error` filled.
__attribute__((visibility("default"))) int megacpp_store_add(void* client, const char* key,
                                                             int64_t delta, int64_t* result,
                                                             char* error, size_t error_len) {
  return guarded("add", error, error_len, [&] {
    *result = static_cast<Store*>(client)->store->add(key, delta);
    return kOk;
  });
}

__attribute__((visibility("default"))) void megacpp_store_client_destroy(void* client) {
  std::unique_ptr<Store>(static_cast<Store*>(client)).reset();
}

}  // extern "C"
