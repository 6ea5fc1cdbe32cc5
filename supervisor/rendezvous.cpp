#include "supervisor/rendezvous.h"

#include <dlfcn.h>

#include <fmt/format.h>

#include "core/error.h"
#include "supervisor/process.h"

namespace megacpp::supervisor {

// The plugin (store_plugin.cpp) and the store it made; both released in reverse order.
struct StoreServer::Impl {
  using Create = void* (*)(const char*, uint16_t, uint32_t, int*, char*, size_t);
  using Port = uint16_t (*)(const void*);
  using Destroy = void (*)(void*);
  void* library = nullptr;
  void* store = nullptr;
  Port port = nullptr;
  Destroy destroy = nullptr;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (store != nullptr) destroy(store);
    if (library != nullptr) ::dlclose(library);
  }
};

namespace {
void* open_store_plugin() {
  const auto path = detail::self_exe_dir() / "libmegacpp_store.so";
  void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = ::dlerror();
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "this megacpp cannot host the ranks' rendezvous: {} does not load ({}); "
                 "rebuild or reinstall megacpp with its libraries",
                 path.string(), why != nullptr ? why : "unknown dlopen error");
  }
  return library;
}
}  // namespace

void check_store_plugin() {
  ::dlclose(open_store_plugin());
}

StoreServer::StoreServer(const std::string& host, uint16_t port, uint32_t world)
    : impl_(std::make_unique<Impl>()) {
  const auto path = detail::self_exe_dir() / "libmegacpp_store.so";
  impl_->library = open_store_plugin();
  auto symbol = [&](const char* name) {
    void* s = ::dlsym(impl_->library, name);
    MEGACPP_CHECK(
        s != nullptr, ErrorKind::kInternal,
        fmt::format("{} lacks {}: a library of another megacpp build", path.string(), name));
    return s;
  };
  const auto create = reinterpret_cast<Impl::Create>(symbol("megacpp_store_create"));
  impl_->port = reinterpret_cast<Impl::Port>(symbol("megacpp_store_port"));
  impl_->destroy = reinterpret_cast<Impl::Destroy>(symbol("megacpp_store_destroy"));
  char error[512] = {};
  int code = 0;
  impl_->store = create(host.c_str(), port, world, &code, error, sizeof error);
  if (impl_->store == nullptr) {
    MEGACPP_FAIL(code == 2 ? ErrorKind::kInvalidArgument : ErrorKind::kSystem, "{}", error);
  }
}

StoreServer::~StoreServer() = default;

uint16_t StoreServer::port() const {
  return impl_->port(impl_->store);
}

std::string torch_version() {
  return MEGACPP_TORCH_VERSION;
}

}  // namespace megacpp::supervisor
