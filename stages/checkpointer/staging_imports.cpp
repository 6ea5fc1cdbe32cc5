// The ranks' exported staging buffers on the checkpointer's side (staging_imports.h).
#include "stages/checkpointer/staging_imports.h"

#include <thread>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "gpu/staging.h"

namespace megacpp::checkpointer {

struct StagingImports::Import {
  ipc::StagedBufferInfo info;
  std::unique_ptr<ipc::HandleConnection> conn;
  std::unique_ptr<ipc::MemfdBuffer> memfd;
  std::unique_ptr<gpu::ImportedBuffer> cuda;
  std::string refused;  // why the buffer could not be imported (empty: imported)
};

StagingImports::StagingImports(std::filesystem::path socket, Options options)
    : options_(options), listener_(std::move(socket)) {}

StagingImports::~StagingImports() = default;

void StagingImports::poll() {
  while (auto conn = listener_.accept(ipc::Millis(0))) pending_.push_back(std::move(conn));
  receive_all();
}

void StagingImports::receive_all() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    auto msg = (*it)->receive(ipc::Millis(0));
    if (!msg) {
      it = (*it)->peer_gone() ? pending_.erase(it) : it + 1;
      continue;
    }
    auto conn = std::move(*it);
    it = pending_.erase(it);
    try {
      MEGACPP_CHECK(msg->count() == 1, ErrorKind::kProtocol,
                    fmt::format("a StagedBuffer with {} descriptors", msg->count()));
      auto im = std::make_unique<Import>();
      im->info = ipc::decode_staged_buffer(msg->payload());
      im->conn = std::move(conn);
      // The rank's earlier import goes first: a rank that reconnects to this process sends the
      // same allocation and IPC event again, which the driver may refuse to open twice.
      imports_.erase(im->info.rank);
      try {
        if (im->info.kind == ipc::kStagedMemfd) {
          im->memfd = std::make_unique<ipc::MemfdBuffer>(msg->fd(0), im->info.mapping_bytes);
        } else {
          im->cuda = std::make_unique<gpu::ImportedBuffer>(
              msg->fd(0), im->info.bytes, im->info.mapping_bytes, im->info.device, im->info.event);
        }
        log_info("imported rank {}'s staging buffer ({}, {} bytes, generation {:#x})",
                 im->info.rank, im->info.kind, im->info.bytes, im->info.generation);
      } catch (const Error& e) {
        // What this process cannot map is the rank's to route around (host staging), not a
        // reason to go down: a relaunched checkpointer would refuse it the same way.
        if (e.kind() == ErrorKind::kProtocol) throw;
        im->refused = e.what();
        log_error(
            "cannot import rank {}'s {} staging buffer (generation {:#x}): {}; its snapshots "
            "are refused until it stages them in host memory",
            im->info.rank, im->info.kind, im->info.generation, im->refused);
      }
      imports_[im->info.rank] = std::move(im);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kProtocol) throw;
      log_error("refused a staging buffer on {}: {}", listener_.path().string(), e.what());
    }
  }
}

bool StagingImports::gone(const Import& im) {
  // The rank never writes after its StagedBuffer: a readable connection is a closed one, and
  // peer_gone() stays true once seen.
  while (im.conn->receive(ipc::Millis(0))) {
  }
  return im.conn->peer_gone();
}

StagingImports::Read StagingImports::read(uint32_t rank, uint64_t generation, uint64_t bytes,
                                          uint64_t step) {
  using Clock = std::chrono::steady_clock;
  const auto buffer_wait = options_.buffer_wait;
  const auto copy_wait = options_.copy_wait;
  const auto buffer_deadline = Clock::now() + buffer_wait;
  Import* im = nullptr;
  for (;;) {
    poll();
    if (auto it = imports_.find(rank); it != imports_.end()) {
      if (it->second->info.generation == generation) {
        im = it->second.get();
        break;
      }
    }
    if (Clock::now() >= buffer_deadline) return {Status::kNoBuffer, {}};
    if (options_.progress) options_.progress();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  MEGACPP_CHECK(bytes <= im->info.bytes, ErrorKind::kProtocol,
                fmt::format("rank {}'s snapshot needs {} bytes of its {}-byte staging buffer", rank,
                            bytes, im->info.bytes));
  // Refused first: a refused rank closes this connection when it moves to host staging, and
  // its snapshots still queued are refused, not reported as a dead rank's.
  if (!im->refused.empty()) return {Status::kRefused, {}, im->refused};
  if (gone(*im)) return {Status::kRankGone, {}};
  auto abandon = [this, im] {
    if (options_.progress) options_.progress();
    return gone(*im);
  };
  if (im->memfd) {
    const auto deadline = Clock::now() + copy_wait;
    for (auto nap = std::chrono::microseconds(20); !im->memfd->copies_done();
         nap = std::min(nap * 2, std::chrono::microseconds(2000))) {
      if (abandon()) return {Status::kRankGone, {}};
      if (Clock::now() >= deadline) return {Status::kNotCopied, {}};
      std::this_thread::sleep_for(nap);
    }
    return {Status::kOk, {im->memfd->data(), bytes}};
  }
  gpu::ImportedBuffer::HostCopy host;
  try {
    host = im->cuda->copy_to_host(bytes, step, copy_wait, abandon);
  } catch (const Error& e) {
    // A driver error after the import (page-locked memory refused, a copy that failed) would
    // fail a relaunched checkpointer the same way: the buffer is refused from now on, as one
    // that cannot be imported, and the rank stages in host memory. A dead rank's error is its
    // death's.
    if (e.kind() == ErrorKind::kProtocol) throw;
    if (gone(*im)) return {Status::kRankGone, {}};
    im->refused = e.what();
    log_error(
        "cannot copy rank {}'s {} staging buffer (generation {:#x}): {}; its snapshots are "
        "refused until it stages them in host memory",
        rank, im->info.kind, im->info.generation, im->refused);
    return {Status::kRefused, {}, im->refused};
  }
  using Copy = gpu::ImportedBuffer::HostCopy::Status;
  if (host.status == Copy::kOk) return {Status::kOk, host.bytes};
  if (gone(*im)) return {Status::kRankGone, {}};
  if (host.status == Copy::kUnsealed)
    return {Status::kNotCopied,
            {},
            host.found == gpu::kNoSeal
                ? fmt::format("rank {}'s staging buffer holds no completed copy, not step {}'s",
                              rank, step)
                : fmt::format("rank {}'s staging buffer holds the copy of step {}, not step {}'s",
                              rank, host.found, step)};
  return {Status::kNotCopied, {}};
}

}  // namespace megacpp::checkpointer
