// megacpp::gpu staging — a rank's snapshot staging buffer in device memory, shared with the
// checkpointer through a POSIX file descriptor (DESIGN.md "GPU lane (second part)": the
// snapshot plane on a device).
//
// The rank allocates the buffer with the CUDA virtual-memory API as an exportable allocation
// (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) and an interprocess event, and sends the
// descriptor and the event's handle once per connection (ipc/handle_socket.h). At a snapshot it
// copies its share device-to-device on a side stream, after what its compute stream has queued,
// and records the event; the compute stream waits for the copy (on the device) only before the
// next update. The checkpointer imports the buffer, waits for the event (polled on the host),
// copies device-to-host into page-locked memory and writes from there: the rank's stall is the
// issue of one device-to-device copy.
//
// Torch-free and runtime-free: the driver API is loaded at run time (libcuda.so.1), so these
// classes build wherever cuda.h is found and report, at run time, a machine without a driver.
// Without cuda.h at build time (built() false) every constructor throws Error{kInvalidArgument}.
// Lifetime: each object owns its driver handles (allocation, mapping, stream, events, pinned
// memory) and releases them when destroyed; neither is copyable or movable. Not thread-safe.
// Failure: a failed driver call is Error{kSystem} naming it; expected conditions (a copy not yet
// done, a peer gone) are return values.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace megacpp::gpu {

// True when this build found cuda.h (the driver API can be used if a driver is present).
bool built() noexcept;
// Whether a CUDA driver can be loaded and initialised here; `why` says why not.
bool driver_available(std::string* why = nullptr);

// Every copy into a staging buffer ends by writing its seal (the snapshot's step) past the
// buffer's usable bytes, on the same stream, and the importer checks it after copying out: a copy
// that never ran (its rank died or its context failed with the copy queued) is never taken for
// one that did, whatever the driver then reports of the rank's event (undocumented for a dead
// exporter). The seal lies at seal_offset(bytes), kSealBytes long, inside the mapping.
inline constexpr uint64_t kSealBytes = 8;
constexpr uint64_t seal_offset(uint64_t bytes) noexcept {
  return (bytes + 7) / 8 * 8;
}
// The seal of a buffer no copy has completed into (no step is this).
inline constexpr uint64_t kNoSeal = ~uint64_t{0};

// One piece of a share: `bytes` from device pointer `src` to `offset` in the buffer.
struct CopyPiece {
  uint64_t offset = 0;
  const void* src = nullptr;
  uint64_t bytes = 0;
};

// The rank's side: an exportable device buffer of at least `bytes` on device `ordinal` (the
// driver's ordinal in this process, which the CUDA runtime and torch share), and the event.
class ExportedBuffer {
 public:
  ExportedBuffer(int ordinal, uint64_t bytes);
  ~ExportedBuffer();  // waits for a copy in flight, then releases everything
  ExportedBuffer(const ExportedBuffer&) = delete;
  ExportedBuffer& operator=(const ExportedBuffer&) = delete;

  int fd() const noexcept;                         // the exported allocation (owned here)
  uint64_t bytes() const noexcept;                 // usable bytes (as asked)
  uint64_t mapping_bytes() const noexcept;         // the allocation's size (a granularity multiple)
  const std::string& pci_bus_id() const noexcept;  // names the device to the importer
  const std::string& event_handle() const noexcept;  // the IPC event handle's bytes
  void* device_pointer() const noexcept;             // where the buffer is mapped here

  // Issues the copies on the side stream after everything queued so far on `stream` (a
  // CUstream / cudaStream_t of the buffer's device; nullptr: the legacy default stream), then
  // the seal `seal` (kNoSeal is refused), then records the event. Returns once issued. The
  // sources must stay valid and unchanged until order_after_copy's stream passes the copy.
  void copy_async(void* stream, std::span<const CopyPiece> pieces, uint64_t seal);
  // Makes `stream` wait, on the device, for the last copy. Never blocks the host.
  void order_after_copy(void* stream);
  // Blocks the host until the last copy is done.
  void synchronize();
  // Blocks until the last copy is done, then copies [0, dst.size()) of the buffer into `dst`
  // (host memory): how a rank moves a staged snapshot to host staging when the checkpointer
  // cannot import the buffer. Throws Error{kInternal} past bytes().
  void read(std::span<std::byte> dst);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The checkpointer's side: a rank's buffer imported from its descriptor and mapped on the same
// device (found by PCI bus id), its event opened.
class ImportedBuffer {
 public:
  // Imports `fd` (not taken: the caller closes it; the import holds its own reference) of a
  // buffer of `bytes` usable bytes (its seal after them) in an allocation of `mapping_bytes`.
  ImportedBuffer(int fd, uint64_t bytes, uint64_t mapping_bytes, std::string_view pci_bus_id,
                 std::string_view event_handle);
  ~ImportedBuffer();
  ImportedBuffer(const ImportedBuffer&) = delete;
  ImportedBuffer& operator=(const ImportedBuffer&) = delete;

  struct HostCopy {
    enum class Status {
      kOk,        // `bytes` hold the copy sealed `seal`
      kWaiting,   // `abandon()` turned true or the timeout passed first
      kUnsealed,  // the buffer is sealed `found`, not `seal`: that copy never ran
    };
    Status status = Status::kWaiting;
    std::span<const std::byte> bytes;  // valid until the next call
    uint64_t found = kNoSeal;          // kUnsealed: the seal the buffer holds
  };
  // Waits (polling the event on the host, never on a stream: a dead rank's event may never
  // complete) for the rank's last recorded copy, copies [0, bytes) and the seal into page-locked
  // host memory kept for the next call on this object's stream, waits for that, polling, and
  // checks the seal against `seal`.
  HostCopy copy_to_host(uint64_t bytes, uint64_t seal, std::chrono::milliseconds timeout,
                        const std::function<bool()>& abandon);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Plain device memory that the host fills: a source share for tests and benchmarks that run
// without torch.
class DeviceBlock {
 public:
  DeviceBlock(int ordinal, uint64_t bytes);
  ~DeviceBlock();
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;

  void* pointer() const noexcept;
  // Copies `bytes` to the start of the block; returns once they are on the device.
  void upload(std::span<const std::byte> bytes);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace megacpp::gpu
