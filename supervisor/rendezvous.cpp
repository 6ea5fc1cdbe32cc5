#include "supervisor/rendezvous.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>

#include "core/error.h"

namespace megacpp::supervisor {

struct StoreServer::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

StoreServer::StoreServer(const std::string& host, uint16_t port, uint32_t world)
    : impl_(std::make_unique<Impl>()) {
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = true;
  o.numWorkers = static_cast<int>(world);
  o.waitWorkers = false;
  o.timeout = std::chrono::seconds(60);
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(host, o);
  } catch (const std::exception& e) {
    throw Error(ErrorKind::kSystem, std::string("could not host the c10d TCPStore: ") + e.what());
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
