// megacpp::ipc shared memory: named POSIX shm segments.
//
// Lifetime: a ShmRegion owns its fd and mapping; a creating instance also unlinks the name
// in its destructor, an attaching one only unmaps. Neither copyable nor movable.
// Blocking: never (creation, attach and unlink are single system calls).
// Failure: failed system calls throw megacpp::Error{kSystem} (core/error.h).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace megacpp::ipc {

// A mapped POSIX shm segment (/dev/shm/<name without the leading '/'>), mode 0600.
// Lifetime: a creating instance unlinks the name in its destructor; an attaching one only
// unmaps. Names must start with '/' and contain no other '/'.
class ShmRegion {
 public:
  struct Create {};
  struct Attach {};
  // Creates a zero-filled segment of `bytes`; a stale segment of the same name is replaced.
  ShmRegion(Create, std::string name, size_t bytes);
  // Attaches an existing segment; size from fstat. Throws Error{kSystem} if absent.
  ShmRegion(Attach, std::string name);
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  // Removes the name now (a creating instance whose users have all attached); the mapping
  // stays valid and the destructor no longer unlinks. A no-op on an attaching instance.
  void unlink();

  std::byte* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }
  bool owner() const noexcept { return owner_; }

 private:
  std::string name_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
};

// Names (with leading '/') of live segments whose name starts with `prefix` (leading '/').
std::vector<std::string> list_shm(std::string_view prefix);
// Unlinks every segment whose name starts with `prefix`; returns how many were removed.
size_t unlink_shm(std::string_view prefix);

// The named segments starting with `prefix` that a live process maps or holds open, each with
// one such pid: what must not be unlinked by anyone but its owner. Reads /proc/<pid>/maps and
// /proc/<pid>/fd of every process this user may read (a segment is mode 0600, so only its
// user's processes, and root's, can use it). Blocking: one pass over /proc (milliseconds).
std::map<std::string, pid_t> shm_users(std::string_view prefix);

}  // namespace megacpp::ipc
