// megacpp::checkpointer staging imports — the ranks' exported staging buffers, received over the
// checkpointer's handle socket (ipc/handle_socket.h) and imported once per connection: device
// memory through the CUDA driver (gpu/staging.h), or the memfd stand-in (ipc/staged_buffer.h).
//
// Contract: a rank connects, sends one StagedBuffer with the buffer's descriptor, and keeps the
// connection open for its life; the connection closing is how a rank's death is seen (the kernel
// closes it), so a SnapshotReady still queued from a dead rank is refused by name instead of
// waiting on a copy that will never finish. A rank that connects again (a restarted
// checkpointer, a new buffer) replaces its import.
// Blocking: poll() never blocks; read() waits at most its timeouts. Not thread-safe.
// Failure: a malformed StagedBuffer drops that connection (logged); a buffer that cannot be
// imported here (no driver, another device, a driver that refuses the descriptor) is refused:
// logged by rank, its connection kept (the rank's death is still seen), and read() answers
// kRefused with the reason until the rank sends another buffer; so is one whose copy fails in
// the driver after its import. Expected conditions are read()'s statuses; nothing a rank sends
// makes this process fail.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ipc/handle_socket.h"
#include "ipc/staged_buffer.h"

namespace megacpp::checkpointer {

class StagingImports {
 public:
  // How long read() waits for a rank's descriptor (it may arrive just after the SnapshotReady,
  // on another socket) and for the rank's copy into the buffer and this process's copy out of
  // it (a device-to-device copy of the share: milliseconds; device to host: about a second for
  // 20 GiB). Past either the snapshot is acked ok=false and re-sent, not failed: both waits
  // together stay well below the checkpointer's stall budget (60 s) and the ranks' lease wait,
  // since one rank's wait delays every snapshot queued behind it. `progress` (may be empty) is
  // called on every turn of the waits: the checkpointer's loop is moving while it polls a rank.
  struct Options {
    std::chrono::milliseconds buffer_wait{5000};
    std::chrono::milliseconds copy_wait{20000};
    std::function<void()> progress;
  };
  // Binds the handle socket at `socket` (a stale one of a killed checkpointer is replaced).
  StagingImports(std::filesystem::path socket, Options options);
  explicit StagingImports(std::filesystem::path socket) : StagingImports(std::move(socket), {}) {}
  ~StagingImports();
  StagingImports(const StagingImports&) = delete;
  StagingImports& operator=(const StagingImports&) = delete;

  // Accepts the connections waiting and reads what they sent. Never blocks.
  void poll();

  enum class Status {
    kOk,         // `bytes` hold the snapshot
    kNoBuffer,   // no buffer of that generation from the rank within the wait
    kRankGone,   // the rank's connection closed: it died, its copy may never finish
    kNotCopied,  // the rank's copy did not finish within the wait, or never ran (`why`)
    kRefused,    // the rank's buffer cannot be imported here (`why`); a re-send will not help
  };
  struct Read {
    Status status = Status::kNoBuffer;
    std::span<const std::byte> bytes;  // valid until the next read() of that rank
    std::string why = {};              // kRefused: the import's error; kNotCopied: what was found
  };
  // The first `bytes` of `rank`'s buffer of `generation`, once the copy announced before the
  // SnapshotReady is done: waits up to buffer_wait for the descriptor, then up to copy_wait for
  // the copy. A device buffer's copy must carry the seal `step` (gpu/staging.h: a copy that never
  // ran is kNotCopied, whatever its event says); the memfd's counters stand for it. Throws
  // Error{kProtocol} when `bytes` exceeds the buffer.
  Read read(uint32_t rank, uint64_t generation, uint64_t bytes, uint64_t step);

  const std::filesystem::path& path() const noexcept { return listener_.path(); }
  const Options& options() const noexcept { return options_; }

 private:
  struct Import;
  // Receives from every connection not yet attached; attaches the StagedBuffers it sent.
  void receive_all();
  bool gone(const Import& im);

  Options options_;
  ipc::HandleListener listener_;
  std::vector<std::unique_ptr<ipc::HandleConnection>> pending_;  // connected, nothing sent yet
  std::map<uint32_t, std::unique_ptr<Import>> imports_;          // by rank
};

}  // namespace megacpp::checkpointer
