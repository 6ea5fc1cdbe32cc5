#include "ipc/job_keys.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <string_view>

#include <fmt/format.h>
#include <sodium.h>
#include <zmq.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/detail/zmq.h"

namespace megacpp::ipc {

namespace {

constexpr std::string_view kHeader =
    "# megacpp job keys (ZeroMQ CURVE, Z85); readable by this user only";
constexpr size_t kZ85KeyChars = 40;

CurveKeyPair make_pair() {
  char pub[kZ85KeyChars + 1] = {};
  char sec[kZ85KeyChars + 1] = {};
  ZMQ_CHECK(zmq_curve_keypair(pub, sec));
  return {std::string(pub, kZ85KeyChars), std::string(sec, kZ85KeyChars)};
}

bool valid_key(const std::string& z85) {
  uint8_t raw[32];
  return z85.size() == kZ85KeyChars && zmq_z85_decode(raw, z85.c_str()) != nullptr;
}

[[noreturn]] void refuse(const std::filesystem::path& path, std::string_view what) {
  throw Error(ErrorKind::kInvalidArgument, fmt::format("job key file {}: {}", path.string(), what));
}

}  // namespace

JobKeys generate_job_keys() {
  return {make_pair(), make_pair()};
}

std::filesystem::path job_keys_path(const std::filesystem::path& run_dir) {
  return run_dir / "job.keys";
}

void write_job_keys(const std::filesystem::path& path, const JobKeys& keys) {
  const std::string text =
      fmt::format("{}\nserver-public {}\nserver-secret {}\nclient-public {}\nclient-secret {}\n",
                  kHeader, keys.server.public_key, keys.server.secret_key, keys.client.public_key,
                  keys.client.secret_key);
  const std::filesystem::path tmp = path.string() + fmt::format(".tmp.{}", ::getpid());
  {
    // 0600 from the first instant: open(2) creates it so, the umask can only narrow it.
    Fd fd(SYSCALL_CHECK_PATH(
        ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600), "create",
        tmp.string()));
    try {
      size_t done = 0;
      while (done < text.size()) {
        done += static_cast<size_t>(SYSCALL_CHECK_PATH(
            ::write(fd.get(), text.data() + done, text.size() - done), "write", tmp.string()));
      }
      SYSCALL_CHECK_PATH(::fsync(fd.get()), "fsync", tmp.string());
      fd.close_checked();
    } catch (...) {
      ::unlink(tmp.c_str());
      throw;
    }
  }
  if (::link(tmp.c_str(), path.c_str()) == -1) {
    const int err = errno;
    ::unlink(tmp.c_str());
    if (err == EEXIST) {
      refuse(path, "already exists; a job's keys are made once (remove it to make new ones)");
    }
    ::megacpp::detail::throw_syscall_path("create", path.string(), "link(tmp, path)", err, __FILE__,
                                          __LINE__);
  }
  ::unlink(tmp.c_str());
  fsync_path(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
}

JobKeys read_job_keys(const std::filesystem::path& path) {
  const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (raw == -1 && errno == ELOOP) refuse(path, "is a symbolic link; name the file itself");
  if (raw == -1 && errno == ENOENT)
    refuse(path, "does not exist; create the job's keys once with `megacpp keys FILE`");
  Fd fd(SYSCALL_CHECK_PATH(raw, "open", path.string()));
  struct stat st {};
  SYSCALL_CHECK_PATH(::fstat(fd.get(), &st), "stat", path.string());
  if (!S_ISREG(st.st_mode)) refuse(path, "is not a regular file");
  if (st.st_uid != ::geteuid()) {
    refuse(path, fmt::format("is owned by uid {}, not by this user (uid {}); the job's keys "
                             "must be this user's",
                             st.st_uid, ::geteuid()));
  }
  if ((st.st_mode & 077) != 0) {
    refuse(path, fmt::format("permissions {:04o} are too open: others may read the job's keys; "
                             "run `chmod 600 {}`",
                             st.st_mode & 07777, path.string()));
  }
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = SYSCALL_CHECK_PATH(::read(fd.get(), buf, sizeof buf), "read", path.string());
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > 64 * 1024) refuse(path, "is too large to be a key file");
  }
  JobKeys keys;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.find(' ');
    const std::string name = line.substr(0, space);
    const std::string value = space == std::string::npos ? "" : line.substr(space + 1);
    std::string* slot = name == "server-public"   ? &keys.server.public_key
                        : name == "server-secret" ? &keys.server.secret_key
                        : name == "client-public" ? &keys.client.public_key
                        : name == "client-secret" ? &keys.client.secret_key
                                                  : nullptr;
    if (slot == nullptr) refuse(path, fmt::format("unknown entry '{}'; is this a key file?", name));
    if (!valid_key(value)) refuse(path, fmt::format("{} is not a 40-character Z85 key", name));
    *slot = value;
  }
  for (const auto* k : {&keys.server.public_key, &keys.server.secret_key, &keys.client.public_key,
                        &keys.client.secret_key}) {
    if (k->empty()) refuse(path, "lacks a key; write it again with a new job's keys");
  }
  return keys;
}

std::string job_store_prefix(const JobKeys& keys) {
  MEGACPP_CHECK(sodium_init() >= 0, ErrorKind::kInternal, "libsodium did not initialise");
  constexpr std::string_view kContext = "megacpp job store prefix v1";
  unsigned char digest[16];
  crypto_generichash(digest, sizeof digest,
                     reinterpret_cast<const unsigned char*>(keys.client.secret_key.data()),
                     keys.client.secret_key.size(),
                     reinterpret_cast<const unsigned char*>(kContext.data()), kContext.size());
  std::string out = "megacpp-job-";
  for (unsigned char b : digest) out += fmt::format("{:02x}", b);
  return out;
}

RecordSealer::RecordSealer(const JobKeys& keys) {
  MEGACPP_CHECK(sodium_init() >= 0, ErrorKind::kInternal, "libsodium did not initialise");
  constexpr std::string_view kContext = "megacpp job record seal v1";
  crypto_generichash(key_.data(), key_.size(),
                     reinterpret_cast<const unsigned char*>(keys.client.secret_key.data()),
                     keys.client.secret_key.size(),
                     reinterpret_cast<const unsigned char*>(kContext.data()), kContext.size());
}

std::string RecordSealer::operator()(std::string_view text) const {
  unsigned char mac[32];
  crypto_generichash(mac, sizeof mac, reinterpret_cast<const unsigned char*>(text.data()),
                     text.size(), key_.data(), key_.size());
  std::string out;
  out.reserve(2 * sizeof mac);
  for (unsigned char b : mac) out += fmt::format("{:02x}", b);
  return out;
}

}  // namespace megacpp::ipc
