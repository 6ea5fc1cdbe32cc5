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
class AbortableGloo final : public c10d::ProcessGroupGloo, public AbortableWaits {
 public:
  using ProcessGroupGloo::ProcessGroupGloo;

  void abort() override {
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
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> connect_gloo(const GlooOptions& o) {
  auto store = connect_store(o);
  auto opts = c10d::ProcessGroupGloo::Options::create(o.collective_timeout);
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(o.device_hostname));
  return c10::make_intrusive<AbortableGloo>(store, static_cast<int>(o.rank),
                                            static_cast<int>(o.world), opts);
}

c10::intrusive_ptr<c10d::Backend> connect_nccl(const GlooOptions& o, const CudaPlugin& cuda,
                                               int device_index) {
  auto store = connect_store(o);
  return cuda.api().nccl(store, static_cast<int>(o.rank), static_cast<int>(o.world), device_index,
                         o.collective_timeout);
}

}  // namespace megacpp::trainer
