// megacpp::trainer rendezvous — the rank's side of joining the c10d store and its Gloo process
// group. The store itself is hosted elsewhere: by the supervisor for a run
// (supervisor/rendezvous.h), by forked_world::ForkedWorld for a process that forks its own
// ranks (tests, the stress harness, benchmarks).
//
// Contract: connect_gloo blocks until every rank joined or store_timeout passed (then
// c10::Error / c10d exceptions propagate; trainer::with_peers types them). The returned group
// is shared (intrusive_ptr) and lives as long as its last holder; collectives on it time out
// after collective_timeout.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace megacpp::trainer {

// Rendezvous: a TCPStore client at host:port and a ProcessGroupGloo over it whose abort() ends
// every wait of run_collective on it (collective.h AbortableWaits). Throws
// Error{kInvalidArgument} for a rank outside the world.
struct GlooOptions {
  std::string store_host = "127.0.0.1";
  uint16_t store_port = 0;
  uint32_t rank = 0;
  uint32_t world = 1;
  std::chrono::milliseconds store_timeout{60'000};
  std::chrono::milliseconds collective_timeout{300'000};
  std::string device_hostname = "127.0.0.1";  // the interface Gloo's TCP transport binds
  // Non-empty: Gloo's TCP transport binds this interface (a job across nodes, `--iface`) and
  // device_hostname is not used.
  std::string device_iface;
  // Keys of this group live under this prefix in the store (e.g. one per run generation),
  // so a store shared by several groups or generations never mixes their rendezvous.
  std::string store_prefix;
  // Non-empty: the optimizers' point-to-point exchanges go through shared memory
  // (ipc/peer_exchange.h; rank r's outbox is the shm segment "<prefix><r>") on every link
  // between two ranks that name the same peer_exchange_host and could map each other's
  // outbox; every other link through Gloo's send and receive (exchange.h), with a warning
  // naming why when a link of one host could not be shared. Empty: always Gloo.
  std::string peer_exchange_prefix;
  // The host this rank runs on, as the job names it (its node): ranks of different hosts
  // never share memory, even where their /dev/shm happens to be one (namespaces as hosts).
  // Empty on every rank: one host.
  std::string peer_exchange_host;
  size_t peer_exchange_slot_bytes = 0;  // 0: PeerExchange's default (tests stream small slots)
};
c10::intrusive_ptr<c10d::Backend> connect_gloo(const GlooOptions& options);

class CudaPlugin;
// The same rendezvous with a ProcessGroupNCCL made by the CUDA plugin, bound to CUDA device
// `device_index` (device_hostname is not used). The plugin must outlive the group.
c10::intrusive_ptr<c10d::Backend> connect_nccl(const GlooOptions& options, const CudaPlugin& cuda,
                                               int device_index);

}  // namespace megacpp::trainer
