// StagedBuffer messages and the memfd stand-in of a device staging buffer (staged_buffer.h).
#include "ipc/staged_buffer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <fmt/format.h>

#include "core/error.h"
#include "schemas/control.capnp.h"

namespace megacpp::ipc {

std::string encode_staged_buffer(const StagedBufferInfo& info) {
  capnp::MallocMessageBuilder message;
  auto b = message.initRoot<schema::StagedBuffer>();
  b.setRank(info.rank);
  b.setGeneration(info.generation);
  b.setKind(info.kind);
  b.setBytes(info.bytes);
  b.setMappingBytes(info.mapping_bytes);
  b.setDevice(info.device);
  b.setEvent(
      kj::arrayPtr(reinterpret_cast<const capnp::byte*>(info.event.data()), info.event.size()));
  auto words = capnp::messageToFlatArray(message);
  auto bytes = words.asBytes();
  return std::string(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
}

StagedBufferInfo decode_staged_buffer(std::string_view payload) {
  MEGACPP_CHECK(!payload.empty() && payload.size() % sizeof(capnp::word) == 0, ErrorKind::kProtocol,
                fmt::format("a StagedBuffer of {} bytes is not a message", payload.size()));
  // Copied into words: the payload's alignment is a std::string's.
  kj::Array<capnp::word> words = kj::heapArray<capnp::word>(payload.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), payload.data(), payload.size());
  StagedBufferInfo info;
  try {
    capnp::FlatArrayMessageReader reader(words);
    auto r = reader.getRoot<schema::StagedBuffer>();
    info.rank = r.getRank();
    info.generation = r.getGeneration();
    info.kind = r.getKind();
    info.bytes = r.getBytes();
    info.mapping_bytes = r.getMappingBytes();
    info.device = r.getDevice();
    auto event = r.getEvent();
    info.event.assign(reinterpret_cast<const char*>(event.begin()), event.size());
  } catch (const kj::Exception& e) {
    MEGACPP_FAIL(ErrorKind::kProtocol, "a malformed StagedBuffer: {}", e.getDescription().cStr());
  }
  MEGACPP_CHECK(info.generation != 0 && info.bytes <= info.mapping_bytes &&
                    (info.kind == kStagedCuda || info.kind == kStagedMemfd),
                ErrorKind::kProtocol,
                fmt::format("StagedBuffer of rank {}: kind '{}', generation {}, {} of {} bytes",
                            info.rank, info.kind, info.generation, info.bytes, info.mapping_bytes));
  return info;
}

uint64_t new_staged_generation() {
  // The pid tells the buffers of a restarted rank apart; the clock those of one process.
  const auto now =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return ((static_cast<uint64_t>(::getpid()) << 40) ^ (now & ((uint64_t{1} << 40) - 1))) | 1;
}

namespace {
std::byte* map_shared(int fd, uint64_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) SYSCALL_FAIL("mmap", errno);
  return static_cast<std::byte*>(p);
}
}  // namespace

MemfdBuffer::MemfdBuffer(uint64_t bytes)
    : fd_(SYSCALL_CHECK(::memfd_create("megacpp-staging", MFD_CLOEXEC))),
      mapping_bytes_((bytes + 63) / 64 * 64 + kMemfdTrailerBytes) {
  SYSCALL_CHECK(::ftruncate(fd_.get(), static_cast<off_t>(mapping_bytes_)));
  data_ = map_shared(fd_.get(), mapping_bytes_);
}

MemfdBuffer::MemfdBuffer(int fd, uint64_t mapping_bytes)
    : fd_(SYSCALL_CHECK(::fcntl(fd, F_DUPFD_CLOEXEC, 0))), mapping_bytes_(mapping_bytes) {
  struct stat st {};
  SYSCALL_CHECK(::fstat(fd_.get(), &st));
  MEGACPP_CHECK(
      static_cast<uint64_t>(st.st_size) == mapping_bytes && mapping_bytes >= kMemfdTrailerBytes &&
          mapping_bytes % 64 == 0,
      ErrorKind::kProtocol,
      fmt::format("a staged memfd of {} bytes announced as {}", st.st_size, mapping_bytes));
  data_ = map_shared(fd_.get(), mapping_bytes_);
}

MemfdBuffer::~MemfdBuffer() {
  if (data_ != nullptr) ::munmap(data_, mapping_bytes_);
}

namespace {
std::atomic_ref<uint64_t> counter(std::byte* base, uint64_t mapping_bytes, int which) {
  static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);
  return std::atomic_ref<uint64_t>(
      *reinterpret_cast<uint64_t*>(base + mapping_bytes - kMemfdTrailerBytes + 8 * which));
}
}  // namespace

void MemfdBuffer::begin_copy() noexcept {
  counter(data_, mapping_bytes_, 0).fetch_add(1, std::memory_order_seq_cst);
}

void MemfdBuffer::end_copy() noexcept {
  auto begun = counter(data_, mapping_bytes_, 0).load(std::memory_order_acquire);
  counter(data_, mapping_bytes_, 1).store(begun, std::memory_order_release);
}

bool MemfdBuffer::copies_done() const noexcept {
  const uint64_t done = counter(data_, mapping_bytes_, 1).load(std::memory_order_acquire);
  return done == counter(data_, mapping_bytes_, 0).load(std::memory_order_acquire);
}

}  // namespace megacpp::ipc
