// megacpp::ipc staged buffer — a rank's snapshot staging buffer exported as a file descriptor:
// the StagedBuffer message that describes it (schemas/control.capnp), and the memfd stand-in of
// a device buffer (DESIGN.md "GPU lane (second part)": the snapshot plane on a device).
//
// A device buffer (gpu/staging.h) is filled by a copy the rank only issues: the checkpointer
// must wait for it (the IPC event) before reading. The memfd stand-in keeps that contract on a
// CPU, so the whole protocol — descriptors over the handle socket, the wait, a re-import after
// a checkpointer restart, a rank gone — runs and is tested without a GPU: its last
// kMemfdTrailerBytes hold two counters, copies begun and copies done; the checkpointer reads once
// they are equal. Both are accessed through std::atomic_ref (lock-free, valid across processes).
//
// Lifetime: a MemfdBuffer owns its descriptor and mapping. Not copyable. Failure: a failed
// system call is Error{kSystem}; a malformed StagedBuffer is Error{kProtocol}.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/fd.h"

namespace megacpp::ipc {

struct StagedBufferInfo {
  uint32_t rank = 0;
  uint64_t generation = 0;
  std::string kind;  // "cuda" or "memfd"
  uint64_t bytes = 0;
  uint64_t mapping_bytes = 0;
  std::string device;  // cuda: PCI bus id
  std::string event;   // cuda: the IPC event handle's bytes
};
inline constexpr std::string_view kStagedCuda = "cuda";
inline constexpr std::string_view kStagedMemfd = "memfd";

// A StagedBuffer message as the handle socket's payload, and back.
std::string encode_staged_buffer(const StagedBufferInfo& info);
StagedBufferInfo decode_staged_buffer(std::string_view payload);

// A generation no earlier buffer of this process had (nonzero; the pid in the high bits).
uint64_t new_staged_generation();

inline constexpr uint64_t kMemfdTrailerBytes = 64;

class MemfdBuffer {
 public:
  // A new anonymous buffer of `bytes` (plus the trailer), zero-filled.
  explicit MemfdBuffer(uint64_t bytes);
  // Maps a received descriptor (duplicated: the caller keeps `fd`) of `mapping_bytes`, which
  // must equal its size.
  MemfdBuffer(int fd, uint64_t mapping_bytes);
  ~MemfdBuffer();
  MemfdBuffer(const MemfdBuffer&) = delete;
  MemfdBuffer& operator=(const MemfdBuffer&) = delete;

  int fd() const noexcept { return fd_.get(); }
  std::byte* data() const noexcept { return data_; }
  uint64_t bytes() const noexcept { return mapping_bytes_ - kMemfdTrailerBytes; }
  uint64_t mapping_bytes() const noexcept { return mapping_bytes_; }

  // The rank: a copy is begun (announce it after this), and done (its bytes visible first).
  void begin_copy() noexcept;
  void end_copy() noexcept;
  // The checkpointer: every begun copy is done (the bytes it wrote are visible after this).
  bool copies_done() const noexcept;

 private:
  Fd fd_;
  std::byte* data_ = nullptr;
  uint64_t mapping_bytes_ = 0;
};

}  // namespace megacpp::ipc
