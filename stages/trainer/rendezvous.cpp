// The rendezvous: a TCPStore client and a ProcessGroupGloo (or, through the CUDA plugin, a
// ProcessGroupNCCL) over it.
#include "stages/trainer/rendezvous.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fmt/format.h>

#include "core/error.h"
#include "stages/trainer/cuda_plugin.h"

namespace megacpp::trainer {

namespace {

c10::intrusive_ptr<c10d::Store> connect_store(const GlooOptions& o) {
  MEGACPP_CHECK(o.world > 0 && o.rank < o.world, ErrorKind::kInvalidArgument,
                fmt::format("rank {} outside world {}", o.rank, o.world));
  c10d::TCPStoreOptions so;
  so.port = o.store_port;
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = o.store_timeout;
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(o.store_host, so);
  if (!o.store_prefix.empty())
    store = c10::make_intrusive<c10d::PrefixStore>(o.store_prefix, store);
  return store;
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> connect_gloo(const GlooOptions& o) {
  auto store = connect_store(o);
  auto opts = c10d::ProcessGroupGloo::Options::create(o.collective_timeout);
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(o.device_hostname));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(o.rank),
                                                     static_cast<int>(o.world), opts);
}

c10::intrusive_ptr<c10d::Backend> connect_nccl(const GlooOptions& o, const CudaPlugin& cuda,
                                               int device_index) {
  auto store = connect_store(o);
  return cuda.api().nccl(store, static_cast<int>(o.rank), static_cast<int>(o.world), device_index,
                         o.collective_timeout);
}

}  // namespace megacpp::trainer
