#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cstring>
#include <optional>
#include <system_error>

#include <fmt/format.h>
#include <kj/exception.h>
#include <xxhash.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/detail/internal.h"
#include "ipc/journal.h"
#include "schemas/common.capnp.h"

namespace megacpp::ipc {

namespace {

// Frame header: magic "MJR1" as bytes, u32 payload length, u64 XXH3-64 of the payload, all
// little-endian (the host order on every supported platform).
constexpr char kMagicBytes[4] = {'M', 'J', 'R', '1'};
constexpr size_t kFrameHeader = 16;
constexpr uint32_t kMaxPayload = 64u << 20;
constexpr size_t kAlign = 8;

static_assert(std::endian::native == std::endian::little, "journal frames are little-endian");

uint32_t load_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
uint64_t load_u64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
bool is_magic(const char* p) {
  return std::memcmp(p, kMagicBytes, sizeof kMagicBytes) == 0;
}

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = SYSCALL_CHECK(::write(fd, data, size));
    data += n;
    size -= static_cast<size_t>(n);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------

JournalWriter::JournalWriter(const std::filesystem::path& path) : path_(path) {
  if (path_.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(path_.parent_path(), ec);
    if (ec) {
      MEGACPP_FAIL_SYS(ec.value(), "create_directories({}): {}", path_.parent_path().string(),
                       ec.message());
    }
  }
  // O_NOFOLLOW: a journal that is a symlink is never written through (ELOOP).
  detail::Fd fd(SYSCALL_CHECK(
      ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0644)));
  // A predecessor killed mid-write may have left a torn tail of any length. Padding to the
  // next 8-byte boundary keeps every frame aligned, which is where readers resynchronise.
  struct stat st {};
  SYSCALL_CHECK(::fstat(fd.get(), &st));
  if (size_t rem = static_cast<size_t>(st.st_size) % kAlign; rem != 0) {
    char zeros[kAlign] = {};
    write_all(fd.get(), zeros, kAlign - rem);
  }
  fd_ = std::move(fd);
}

JournalWriter::~JournalWriter() = default;

void JournalWriter::set_identity(schema::StageKind stage, uint32_t rank) {
  stage_ = stage;
  rank_ = rank;
}

void JournalWriter::append(const std::function<void(schema::JournalRecord::Builder)>& fill) {
  capnp::MallocMessageBuilder message;
  auto root = message.initRoot<schema::JournalRecord>();
  root.setSchemaVersion(schema::SCHEMA_VERSION);
  root.setMonoNs(mono_ns());
  root.setWallNs(wall_ns());
  root.setStage(stage_);
  root.setRank(rank_);
  root.setPid(::getpid());
  root.setAttempt(attempt_);
  fill(root);
  append_raw(message);
}

void JournalWriter::append_raw(capnp::MessageBuilder& message) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(message);
  auto payload = words.asChars();
  MEGACPP_CHECK(payload.size() <= kMaxPayload, ErrorKind::kInvalidArgument,
                fmt::format("journal record of {} bytes exceeds the {}-byte frame limit",
                            payload.size(), kMaxPayload));
  std::string frame(kFrameHeader + payload.size(), '\0');
  uint32_t length = static_cast<uint32_t>(payload.size());
  uint64_t checksum = XXH3_64bits(payload.begin(), payload.size());
  std::memcpy(frame.data(), kMagicBytes, 4);
  std::memcpy(frame.data() + 4, &length, 4);
  std::memcpy(frame.data() + 8, &checksum, 8);
  std::memcpy(frame.data() + kFrameHeader, payload.begin(), payload.size());
  // One write: a concurrent reader sees a record whole or as a (retried) partial tail.
  write_all(fd_.get(), frame.data(), frame.size());
}

void JournalWriter::sync() {
  SYSCALL_CHECK(::fdatasync(fd_.get()));
}

// ---------------------------------------------------------------------------------------

JournalReader::JournalReader(const std::filesystem::path& path) : path_(path) {}

uint64_t JournalReader::poll(const Visitor& fn) {
  int raw = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw == -1 && errno == ENOENT) return 0;  // not written yet: an empty journal
  if (raw == -1) raw = SYSCALL_CHECK(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  detail::Fd fd(raw);
  struct stat st {};
  SYSCALL_CHECK(::fstat(fd.get(), &st));
  uint64_t start = offset_ + pending_.size();
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > start) {
    size_t have = pending_.size();
    pending_.resize(have + static_cast<size_t>(size - start));
    while (have < pending_.size()) {
      ssize_t n = SYSCALL_CHECK(::pread(fd.get(), pending_.data() + have, pending_.size() - have,
                                        static_cast<off_t>(offset_ + have)));
      if (n == 0) break;  // shrank underneath us: keep what was read
      have += static_cast<size_t>(n);
    }
    pending_.resize(have);
  }
  return parse(fn, false);
}

void JournalReader::finish() {
  if (pending_.empty()) return;
  if (!resyncing_) ++stats_.corrupt_frames;
  stats_.torn_bytes += pending_.size();
  offset_ += pending_.size();
  pending_.clear();
  resyncing_ = false;
}

uint64_t JournalReader::finish(const Visitor& fn) {
  return parse(fn, true);
}

uint64_t JournalReader::parse(const Visitor& fn, bool final) {
  uint64_t delivered = 0;
  size_t pos = 0;
  // Consumes [pos, pos + n) as bad bytes; a new run of bad bytes counts one corrupt frame.
  auto skip = [&](size_t n) {
    if (!resyncing_) ++stats_.corrupt_frames;
    resyncing_ = true;
    stats_.torn_bytes += n;
    pos += n;
  };
  // Bytes before `pos` are dropped once per call (not per record: that would be quadratic),
  // and also when a visitor throws, so the reader stays consistent (that record counts as
  // delivered).
  auto consume = [&] {
    pending_.erase(0, pos);
    offset_ += pos;
    pos = 0;
  };

  for (;;) {
    size_t avail = pending_.size() - pos;
    const char* p = pending_.data() + pos;
    if (!final && avail < kFrameHeader) {
      // Not enough for a header yet; while resynchronising, whole 8-byte words that are not
      // a magic can still be skipped.
      if (resyncing_ && avail >= kAlign && !is_magic(p)) {
        skip(kAlign);
        continue;
      }
      break;
    }
    if (final && avail < kFrameHeader) {
      if (avail > 0) skip(avail);
      break;
    }
    if (!is_magic(p)) {
      skip(kAlign);
      continue;
    }
    uint32_t length = load_u32(p + 4);
    if (length == 0 || length > kMaxPayload || length % kAlign != 0) {
      skip(kAlign);
      continue;
    }
    if (avail < kFrameHeader + length) {
      if (!final) break;  // the writer may be mid-record: wait for the rest
      skip(kAlign);       // torn: look for a later frame inside the tail
      continue;
    }
    const char* payload = p + kFrameHeader;
    if (XXH3_64bits(payload, length) != load_u64(p + 8)) {
      skip(kAlign);
      continue;
    }
    resyncing_ = false;
    size_t frame_bytes = kFrameHeader + length;

    auto words = kj::heapArray<capnp::word>(length / sizeof(capnp::word));
    std::memcpy(words.begin(), payload, length);
    pos += frame_bytes;
    std::optional<capnp::FlatArrayMessageReader> reader;
    try {
      reader.emplace(words.asPtr(), detail::reader_options(words.size()));
      reader->getRoot<schema::JournalRecord>().totalSize();  // bounds-checks the whole record
    } catch (const kj::Exception& e) {
      // Intact framing around an undecodable record (a writer bug, not a torn write).
      ++stats_.corrupt_frames;
      stats_.torn_bytes += frame_bytes;
      log_warn("journal {}: skipped undecodable record at offset {}: {}", path_.string(),
               offset_ + pos - frame_bytes, e.getDescription().cStr());
      continue;
    }
    ++stats_.records;
    ++delivered;
    try {
      fn(reader->getRoot<schema::JournalRecord>());
    } catch (...) {
      consume();
      throw;
    }
  }
  consume();
  if (final) resyncing_ = false;
  return delivered;
}

JournalStats JournalReader::read_all(const std::filesystem::path& path, const Visitor& fn) {
  JournalReader reader(path);
  reader.poll(fn);
  reader.finish(fn);
  return reader.stats();
}

}  // namespace megacpp::ipc
