// megacpp::ipc handle socket — file descriptors (SCM_RIGHTS) with a small payload between two
// processes over a Unix SOCK_SEQPACKET socket (one message per send, boundaries kept, a closed
// peer seen at once). How a device staging buffer exported as a POSIX file descriptor (the CUDA
// virtual-memory API's CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; on the fake device of the tests,
// a memfd) reaches the checkpointer, which imports it once and copies out of it itself.
//
// Lifetime: a HandleListener owns a listening socket bound to a path it unlinks when destroyed; a
// HandleConnection owns one connected end; ReceivedHandles owns the descriptors it carries until
// they are taken. None is copyable or movable.
// Blocking: accept, connect, send and receive wait at most their timeout (EINTR retried).
// Failure: a timeout or a peer that is gone are return values (nullptr / nullopt / false; the
// caller reconnects); a message that is not one of ours (truncated payload or descriptors) is
// Error{kProtocol}; a failed system call is Error{kSystem}.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/fd.h"
#include "ipc/millis.h"

namespace megacpp::ipc {

// At most this many bytes of payload and descriptors per message.
inline constexpr size_t kMaxHandlePayload = 64 * 1024;
inline constexpr size_t kMaxHandleFds = 16;

// One received message: its payload and the descriptors that came with it (each a new
// descriptor of this process, close-on-exec, closed with this object unless taken).
class ReceivedHandles {
 public:
  // Takes ownership of every descriptor in `fds`.
  ReceivedHandles(std::string payload, const std::vector<int>& fds);
  ReceivedHandles(ReceivedHandles&&) noexcept = default;
  ReceivedHandles& operator=(ReceivedHandles&&) noexcept = default;

  const std::string& payload() const noexcept { return payload_; }
  size_t count() const noexcept { return fds_.size(); }
  // The i-th descriptor, still owned here (-1 once taken).
  int fd(size_t i) const { return fds_.at(i).get(); }
  // Hands the i-th descriptor to the caller, who closes it.
  int take(size_t i) { return fds_.at(i).release(); }

 private:
  friend class HandleConnection;  // receive() sets the payload once the descriptors are owned
  std::string payload_;
  std::vector<Fd> fds_;
};

class HandleConnection {
 public:
  // Connects to the listener at `path`, retrying while it does not exist or refuses (a
  // listener being restarted) until `timeout`; nullptr then.
  static std::unique_ptr<HandleConnection> connect(const std::filesystem::path& path,
                                                   Millis timeout);
  // Takes ownership of the connected socket `fd`.
  explicit HandleConnection(int fd) noexcept : fd_(fd) {}
  HandleConnection(const HandleConnection&) = delete;
  HandleConnection& operator=(const HandleConnection&) = delete;

  // Sends `payload` (at most kMaxHandlePayload bytes) with `fds` (at most kMaxHandleFds; the
  // receiver gets duplicates, these stay open). False when the peer is gone or no room came
  // within `timeout`.
  bool send(std::string_view payload, std::span<const int> fds, Millis timeout);
  // The next message; nullopt on a timeout or when the peer is gone (then peer_gone()).
  std::optional<ReceivedHandles> receive(Millis timeout);
  bool peer_gone() const noexcept { return gone_; }
  int fd() const noexcept { return fd_.get(); }

 private:
  Fd fd_;
  bool gone_ = false;
};

class HandleListener {
 public:
  // Binds a SOCK_SEQPACKET socket at `path` (mode 0600; a stale socket file left by a killed
  // listener is replaced) and listens.
  explicit HandleListener(std::filesystem::path path);
  ~HandleListener();
  HandleListener(const HandleListener&) = delete;
  HandleListener& operator=(const HandleListener&) = delete;

  // The next connection, or nullptr after `timeout`.
  std::unique_ptr<HandleConnection> accept(Millis timeout);
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
  Fd fd_;
};

}  // namespace megacpp::ipc
