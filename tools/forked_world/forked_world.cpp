// ForkedWorld's store: a c10d TCPStore server hosted by the process that forks the ranks.
#include "tools/forked_world/forked_world.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace megacpp::forked_world {

struct ForkedWorld::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

ForkedWorld::ForkedWorld(uint32_t size, std::chrono::milliseconds store_timeout)
    : size_(size), impl_(std::make_unique<Impl>()) {
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = store_timeout;
  impl_->store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
}

ForkedWorld::~ForkedWorld() = default;

uint16_t ForkedWorld::store_port() const {
  return impl_->store->getPort();
}

c10d::Store& ForkedWorld::store() const {
  return *impl_->store;
}

}  // namespace megacpp::forked_world
