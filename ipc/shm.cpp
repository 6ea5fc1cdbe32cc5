#include <fcntl.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <system_error>

#include <fmt/format.h>

#include "core/error.h"
#include "ipc/detail/internal.h"
#include "ipc/shm.h"

namespace megacpp::ipc {

namespace {

constexpr const char* kShmDir = "/dev/shm";

void check_name(const std::string& name) {
  MEGACPP_CHECK(name.size() >= 2 && name.size() <= NAME_MAX && name[0] == '/' &&
                    name.find('/', 1) == std::string::npos,
                ErrorKind::kInvalidArgument,
                fmt::format("shm name '{}' must be '/' followed by 1..{} characters without '/'",
                            name, NAME_MAX - 1));
}

std::byte* map_fd(int fd, size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) SYSCALL_FAIL("mmap", errno);
  return static_cast<std::byte*>(p);
}

}  // namespace

ShmRegion::ShmRegion(Create, std::string name, size_t bytes) : name_(std::move(name)) {
  check_name(name_);
  MEGACPP_CHECK(bytes > 0, ErrorKind::kInvalidArgument,
                fmt::format("shm segment {} must not be empty", name_));
  // A segment left by a crashed run of the same name is replaced, never reused: its
  // contents (ring counters, staged tensors) belong to a dead generation.
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    SYSCALL_FAIL("shm_unlink(stale)", errno);
  }
  detail::Fd fd(SYSCALL_CHECK(::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)));
  try {
    SYSCALL_CHECK(::ftruncate(fd.get(), static_cast<off_t>(bytes)));
    // Reserve the pages now: a full /dev/shm then fails here with ENOSPC instead of
    // delivering SIGBUS on first touch in some other process.
    int rc = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes));
    if (rc != 0 && rc != EOPNOTSUPP && rc != ENOSYS && rc != EINVAL) {
      SYSCALL_FAIL("posix_fallocate", rc);
    }
    data_ = map_fd(fd.get(), bytes);
  } catch (...) {
    ::shm_unlink(name_.c_str());
    throw;
  }
  size_ = bytes;
  owner_ = true;
}

ShmRegion::ShmRegion(Attach, std::string name) : name_(std::move(name)) {
  check_name(name_);
  detail::Fd fd(SYSCALL_CHECK(::shm_open(name_.c_str(), O_RDWR, 0)));
  struct stat st {};
  SYSCALL_CHECK(::fstat(fd.get(), &st));
  MEGACPP_CHECK(st.st_size > 0, ErrorKind::kCorruption,
                fmt::format("shm segment {} is empty (creator not finished?)", name_));
  size_ = static_cast<size_t>(st.st_size);
  data_ = map_fd(fd.get(), size_);
  owner_ = false;
}

ShmRegion::~ShmRegion() {
  if (data_ != nullptr) ::munmap(data_, size_);
  // ENOENT here means someone (unlink_shm, a supervisor cleanup) removed it already.
  if (owner_) ::shm_unlink(name_.c_str());
}

void ShmRegion::unlink() {
  if (!owner_) return;
  owner_ = false;
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) SYSCALL_FAIL("shm_unlink", errno);
}

std::vector<std::string> list_shm(std::string_view prefix) {
  MEGACPP_CHECK(!prefix.empty() && prefix[0] == '/', ErrorKind::kInvalidArgument,
                fmt::format("shm prefix '{}' must start with '/'", prefix));
  std::vector<std::string> out;
  std::error_code ec;
  std::filesystem::directory_iterator it(kShmDir, ec), end;
  if (ec) return out;  // no /dev/shm: nothing can be live
  for (; it != end; it.increment(ec)) {
    if (ec) break;
    std::string name = "/" + it->path().filename().string();
    if (name.starts_with(prefix)) out.push_back(std::move(name));
  }
  std::sort(out.begin(), out.end());
  return out;
}

size_t unlink_shm(std::string_view prefix) {
  size_t removed = 0;
  for (const auto& name : list_shm(prefix)) {
    if (::shm_unlink(name.c_str()) == 0) {
      ++removed;
    } else if (errno != ENOENT) {  // ENOENT: its owner unlinked it concurrently
      SYSCALL_FAIL("shm_unlink", errno);
    }
  }
  return removed;
}

std::map<std::string, pid_t> shm_users(std::string_view prefix) {
  MEGACPP_CHECK(!prefix.empty() && prefix[0] == '/', ErrorKind::kInvalidArgument,
                fmt::format("shm prefix '{}' must start with '/'", prefix));
  // A segment appears as kShmDir/<name>; an unlinked one has " (deleted)" after it and is no
  // longer a name anyone can unlink.
  const std::string dir = std::filesystem::path(kShmDir).string();
  const std::string wanted = dir + std::string(prefix);
  std::map<std::string, pid_t> out;
  auto note = [&](std::string_view path, pid_t pid) {
    if (!path.starts_with(wanted) || path.ends_with(" (deleted)")) return;
    out.emplace(std::string(path.substr(dir.size())), pid);
  };
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc", ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    std::ifstream maps(it->path() / "maps");
    for (std::string line; std::getline(maps, line);) {
      if (const auto at = line.find(dir); at != std::string::npos)
        note(std::string_view(line).substr(at), pid);
    }
    std::error_code fd_ec;
    for (std::filesystem::directory_iterator fd(it->path() / "fd", fd_ec), fd_end;
         !fd_ec && fd != fd_end; fd.increment(fd_ec)) {
      std::error_code link_ec;
      const auto target = std::filesystem::read_symlink(fd->path(), link_ec);
      if (!link_ec) note(target.native(), pid);
    }
  }
  return out;
}

}  // namespace megacpp::ipc
