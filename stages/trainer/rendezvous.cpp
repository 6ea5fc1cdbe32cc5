// The rendezvous: a TCPStore client and a ProcessGroupGloo whose abort() ends the rank's waits
// (or, through the CUDA plugin, a ProcessGroupNCCL) over it.
#include "stages/trainer/rendezvous.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/peer_exchange.h"
#include "stages/trainer/collective.h"
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

// ProcessGroupGloo whose abort() ends run_collective's waits (Gloo's own abort() is a no-op:
// a rank stuck in a collective would wait out the transport's timeout). The collective itself
// is left to Gloo's threads; the rank's thread, released, fails and the process exits.
class AbortableGloo final : public c10d::ProcessGroupGloo,
                            public AbortableWaits,
                            public WithPeerExchange {
 public:
  using ProcessGroupGloo::ProcessGroupGloo;

  // Set once, right after construction, before the group is shared.
  void set_peer_exchange(std::unique_ptr<ipc::PeerExchange> exchange) {
    exchange_ = std::move(exchange);
  }
  ipc::PeerExchange* peer_exchange() noexcept override { return exchange_.get(); }

  void abort() override {
    if (exchange_) exchange_->abort();
    {
      std::lock_guard lock(waits_->mu);
      waits_->aborted = true;
    }
    waits_->cv.notify_all();
  }

  bool wait_unless_aborted(c10d::Work& work) override {
    if (dynamic_cast<c10d::ProcessGroupGloo::AsyncWork*>(&work) == nullptr)
      return wait_without_future(work);
    const auto future = work.getFuture();
    // Shared with the callback, which may run after this wait returned (an aborted
    // collective completes, or fails, whenever Gloo gets to it).
    std::shared_ptr<Waits> waits = waits_;
    future->addCallback([waits](c10::ivalue::Future&) {
      { std::lock_guard lock(waits->mu); }
      waits->cv.notify_all();
    });
    {
      std::unique_lock lock(waits->mu);
      waits->cv.wait(lock, [&] { return waits->aborted || future->completed(); });
      if (!future->completed()) return false;
    }
    work.wait();  // completed: returns at once, or rethrows the collective's error
    return true;
  }

 private:
  struct Waits {
    std::mutex mu;
    std::condition_variable cv;
    bool aborted = false;
  };
  struct Outcome {
    bool done = false;
    std::exception_ptr error;
  };

  // Gloo's send and receive works have no future, and their timed wait completes them with an
  // error, so they are waited for on a thread of their own. That thread and the work outlive
  // an aborted wait (the process exits after it).
  bool wait_without_future(c10d::Work& work) {
    std::shared_ptr<Waits> waits = waits_;
    auto outcome = std::make_shared<Outcome>();
    std::thread([keep = c10::intrusive_ptr<c10d::Work>::reclaim_copy(&work), waits, outcome] {
      std::exception_ptr error;
      try {
        keep->wait();
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard lock(waits->mu);
        outcome->done = true;
        outcome->error = error;
      }
      waits->cv.notify_all();
    }).detach();
    std::unique_lock lock(waits->mu);
    waits->cv.wait(lock, [&] { return waits->aborted || outcome->done; });
    if (!outcome->done) return false;
    if (outcome->error) std::rethrow_exception(outcome->error);
    return true;
  }

  std::shared_ptr<Waits> waits_ = std::make_shared<Waits>();
  std::unique_ptr<ipc::PeerExchange> exchange_;
};

// Collective over `store`: every rank creates its outbox and publishes its token and host;
// each attaches the outboxes of the peers that name the same host and publishes which it
// could. A link goes through shared memory only when both of its ranks attached each other,
// so both sides agree on every link; the others go through Gloo (exchange.h chooses per link).
// A rank that cannot create or attach says so instead of failing. Null when no link is shared.
// Store errors propagate.
std::unique_ptr<ipc::PeerExchange> connect_peer_exchange(c10d::Store& store, const GlooOptions& o) {
  std::unique_ptr<ipc::PeerExchange> x;
  std::string why;
  try {
    x = std::make_unique<ipc::PeerExchange>(
        ipc::PeerExchange::Config{.name_prefix = o.peer_exchange_prefix,
                                  .rank = o.rank,
                                  .world = o.world,
                                  .slot_bytes = o.peer_exchange_slot_bytes});
  } catch (const Error& e) {
    why = e.what();
  }
  auto to_bytes = [](const std::string& v) { return std::vector<uint8_t>(v.begin(), v.end()); };
  auto get = [&](const std::string& key) {
    const std::vector<uint8_t> v = store.get(key);
    return std::string(v.begin(), v.end());
  };
  store.set(fmt::format("peer_exchange/host/{}", o.rank), to_bytes(o.peer_exchange_host));
  store.set(fmt::format("peer_exchange/token/{}", o.rank), to_bytes(x ? x->token() : "-"));
  std::string attached(o.world, '0');
  std::vector<bool> same_host(o.world, false);
  for (uint32_t q = 0; q < o.world; ++q) {
    if (q == o.rank) continue;
    same_host[q] = get(fmt::format("peer_exchange/host/{}", q)) == o.peer_exchange_host;
    const std::string token = get(fmt::format("peer_exchange/token/{}", q));
    if (!x || !same_host[q]) continue;
    if (token == "-") {
      why = fmt::format("rank {} could not create its outbox", q);
      continue;
    }
    try {
      x->attach(q, token);
      attached[q] = '1';
    } catch (const Error& e) {
      why = fmt::format("rank {}'s outbox: {}", q, e.what());
    }
  }
  store.set(fmt::format("peer_exchange/attached/{}", o.rank), to_bytes(attached));
  uint32_t shared = 0, fell_back = 0;
  for (uint32_t q = 0; q < o.world; ++q) {
    if (q == o.rank || !same_host[q]) continue;
    const std::string theirs = get(fmt::format("peer_exchange/attached/{}", q));
    const bool both = attached[q] == '1' && theirs.size() == o.world && theirs[o.rank] == '1';
    if (both) {
      ++shared;
    } else {
      if (x && attached[q] == '1') x->forget(q);
      ++fell_back;
    }
  }
  if (fell_back > 0) {
    if (why.empty())
      why = fmt::format("{} peer(s) of this host could not attach this outbox", fell_back);
    log_warn(
        "rank {}: {} optimizer exchange link(s) to ranks of this host go through Gloo, not "
        "shared memory ({})",
        o.rank, fell_back, why);
  }
  if (shared == 0) return nullptr;
  x->unlink();
  return x;
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> connect_gloo(const GlooOptions& o) {
  auto store = connect_store(o);
  auto opts = c10d::ProcessGroupGloo::Options::create(o.collective_timeout);
  opts->devices.push_back(o.device_iface.empty()
                              ? c10d::ProcessGroupGloo::createDeviceForHostname(o.device_hostname)
                              : c10d::ProcessGroupGloo::createDeviceForInterface(o.device_iface));
  auto pg = c10::make_intrusive<AbortableGloo>(store, static_cast<int>(o.rank),
                                               static_cast<int>(o.world), opts);
  if (!o.peer_exchange_prefix.empty() && o.world > 1)
    pg->set_peer_exchange(connect_peer_exchange(*store, o));
  return pg;
}

c10::intrusive_ptr<c10d::Backend> connect_nccl(const GlooOptions& o, const CudaPlugin& cuda,
                                               int device_index) {
  auto store = connect_store(o);
  return cuda.api().nccl(store, static_cast<int>(o.rank), static_cast<int>(o.world), device_index,
                         o.collective_timeout);
}

}  // namespace megacpp::trainer
