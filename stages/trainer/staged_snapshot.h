// megacpp::trainer staged snapshot — a rank's share copied into a staging buffer exported to the
// checkpointer as a file descriptor: device memory on a GPU (gpu/staging.h), or its memfd
// stand-in (ipc/staged_buffer.h) that runs the same protocol on a CPU (DESIGN.md "GPU lane
// (second part)").
//
// Contract: copy_async only issues the copy and returns; the checkpointer waits for it itself
// (the IPC event, or the memfd's counters), so the SnapshotReady may go out at once.
// order_after_copy() must run before anything changes the share (StepHooks::before_update):
// on a device it makes the compute stream wait for the copy (the host does not block); on the
// memfd it joins the copying thread. No torch types here.
// Lifetime: a target owns its buffer and descriptor; its destructor waits for a copy in flight.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "gpu/staging.h"
#include "ipc/staged_buffer.h"

namespace megacpp::trainer {

class CudaPlugin;

// `bytes` from `src` to `offset` in the buffer; `src` is a device pointer when device(), else
// host memory.
using StagingPiece = gpu::CopyPiece;

class StagingTarget {
 public:
  virtual ~StagingTarget() = default;
  virtual uint64_t bytes() const = 0;
  // True when the pieces must be device pointers of the rank's device.
  virtual bool device() const = 0;
  // Issues the copy of `pieces`, then seals it `step` (gpu/staging.h: the device buffer's proof
  // that the copy ran; the memfd's counters stand for it there).
  virtual void copy_async(std::span<const StagingPiece> pieces, uint64_t step) = 0;
  virtual void order_after_copy() = 0;
  // Blocks until the last copy is done and copies [0, dst.size()) of the buffer into host
  // memory: a snapshot the checkpointer could not import moves to host staging this way.
  virtual void read_back(std::span<std::byte> dst) = 0;
  // What the checkpointer is told with the descriptor (its generation names the buffer).
  virtual const ipc::StagedBufferInfo& info() const = 0;
  virtual int fd() const = 0;
};

// A memfd of `bytes` copied into by a thread of its own.
std::unique_ptr<StagingTarget> make_memfd_staging(uint32_t rank, uint64_t bytes);
// Device memory of `bytes` on device `index` through the CUDA driver, copied into on a side
// stream after the plugin's current stream of that device. Throws Error{kSystem} naming the
// driver call that failed (no driver, out of device memory).
std::unique_ptr<StagingTarget> make_cuda_staging(const CudaPlugin& plugin, int index, uint32_t rank,
                                                 uint64_t bytes);

}  // namespace megacpp::trainer
