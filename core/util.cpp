#include "core/util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include <xxhash.h>

#include "core/error.h"

namespace megacpp {

namespace {
std::string& log_prefix() {
  static std::string prefix = "megacpp";
  return prefix;
}
}  // namespace

void fsync_path(const std::filesystem::path& path) {
  Fd fd(SYSCALL_CHECK_PATH(::open(path.c_str(), O_RDONLY | O_CLOEXEC), "open", path.string()));
  SYSCALL_CHECK_PATH(::fsync(fd.get()), "fsync", path.string());
}

void write_file_atomic(const std::filesystem::path& path, std::string_view bytes) {
  auto tmp = path;
  tmp += fmt::format(".tmp.{}", ::getpid());
  // O_NOFOLLOW: a link planted at the temporary name is not written through (the rename then
  // replaces a link at `path` itself rather than writing where it points).
  Fd fd(SYSCALL_CHECK_PATH(
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644), "create",
      tmp.string()));
  size_t off = 0;
  try {
    while (off < bytes.size()) {
      ssize_t n = SYSCALL_CHECK_PATH(::write(fd.get(), bytes.data() + off, bytes.size() - off),
                                     "write", tmp.string());
      off += static_cast<size_t>(n);
    }
    SYSCALL_CHECK_PATH(::fsync(fd.get()), "fsync", tmp.string());
  } catch (...) {
    fd.reset();
    ::unlink(tmp.c_str());
    throw;
  }
  fd.reset();
  SYSCALL_CHECK_PATH(::rename(tmp.c_str(), path.c_str()), "replace", path.string());
  fsync_path(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
}

std::string read_file(const std::filesystem::path& path) {
  Fd fd(SYSCALL_CHECK_PATH(::open(path.c_str(), O_RDONLY | O_CLOEXEC), "open", path.string()));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = SYSCALL_CHECK_PATH(::read(fd.get(), buf, sizeof buf), "read", path.string());
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::string xxh3_hex(std::string_view bytes) {
  return fmt::format("{:016x}", XXH3_64bits(bytes.data(), bytes.size()));
}

namespace {

// The value of /proc/cpuinfo's first line named `key` (its first CPU's), "" when there is none.
std::string cpuinfo_field(std::string_view key) {
  std::string text;
  try {
    text = read_file("/proc/cpuinfo");
  } catch (const Error&) {
    return "";
  }
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const std::string_view line(text.data() + at, end - at);
    const size_t colon = line.find(':');
    if (line.starts_with(key) && colon != std::string_view::npos &&
        line.substr(key.size(), colon - key.size()).find_first_not_of(" \t") ==
            std::string_view::npos) {
      std::string_view v = line.substr(colon + 1);
      while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
      return std::string(v);
    }
    at = end + 1;
  }
  return "";
}

}  // namespace

std::string cpu_bf16_units() {
  const std::string flags = " " + cpuinfo_field("flags") + " ";
  std::string units;
  for (const char* unit : {"amx_bf16", "avx512_bf16"}) {
    if (flags.find(fmt::format(" {} ", unit)) != std::string::npos)
      units += (units.empty() ? "" : " ") + std::string(unit);
  }
  return units;
}

std::string cpu_model() {
  return cpuinfo_field("model name");
}

std::string filesystem_type_name(long type) {
  switch (static_cast<unsigned long>(type)) {
    case 0xEF53:
      return "ext4";
    case 0x58465342:
      return "xfs";
    case 0x01021994:
      return "tmpfs";
    case 0x794c7630:
      return "overlay";
    case 0x9123683E:
      return "btrfs";
    case 0x6969:
      return "nfs";
    case 0x2fc12fc1:
      return "zfs";
    case 0x65735546:
      return "fuse";
    default:
      return fmt::format("0x{:x}", static_cast<unsigned long>(type));
  }
}

std::string filesystem_type(const std::filesystem::path& path) {
  struct statfs s {};
  if (::statfs(path.c_str(), &s) != 0) return "?";
  return filesystem_type_name(s.f_type);
}

std::string kernel_description() {
  utsname u{};
  if (::uname(&u) != 0) return "";
  return fmt::format("{} {} {} {}", u.sysname, u.release, u.version, u.machine);
}

void set_log_prefix(std::string prefix) {
  log_prefix() = std::move(prefix);
}

void log_line(std::string_view level, std::string_view text) {
  static std::mutex mu;
  std::lock_guard lock(mu);
  // Never throws: a log line that cannot be written (a closed pipe, a full disk) is lost,
  // and the process goes on.
  const std::string line =
      fmt::format("{} [{}] {}: {}\n", rfc3339(wall_ns()), log_prefix(), level, text);
  if (std::fwrite(line.data(), 1, line.size(), stderr) == line.size())
    std::fflush(stderr);
  else
    std::clearerr(stderr);
}

ProcessMemory process_memory() {
  ProcessMemory m;
  std::string status;
  try {
    status = read_file("/proc/self/status");
  } catch (const std::exception&) {
    return m;
  }
  const auto field = [&](std::string_view name) -> uint64_t {
    const size_t at = status.find(name);
    if (at == std::string::npos) return 0;
    return std::strtoull(status.c_str() + at + name.size(), nullptr, 10) * 1024;  // kB
  };
  m.resident = field("VmRSS:");
  m.peak = field("VmHWM:");
  m.file = field("RssFile:");
  return m;
}

}  // namespace megacpp
