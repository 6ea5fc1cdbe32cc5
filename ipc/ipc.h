// megacpp::ipc — the batch, snapshot and control planes, and journals.
//
// Every type here owns an OS handle (shm fd + mapping, ZeroMQ context/socket, journal fd)
// and is neither copyable nor movable; hold them by value or in std::unique_ptr.
// Expected conditions (timeout, full/empty ring, unreachable peer) are return values;
// broken invariants and failed calls throw megacpp::Error (core/error.h).
#pragma once

#include <zmq.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include "schemas/control.capnp.h"
#include "schemas/journal.capnp.h"

namespace megacpp::ipc {

using Millis = std::chrono::milliseconds;

// ---------------------------------------------------------------------------------------
// Shared memory

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

// ---------------------------------------------------------------------------------------
// Slot ring: single producer, single consumer, fixed-size slots, in a ShmRegion.
//
// Layout: a 256-byte header (magic, version, geometry, producer and consumer counters on
// separate cache lines) followed by `slots` slots of `slot_bytes` payload each, every
// payload 64-byte aligned. Producer and consumer may live in different processes; the
// counters are lock-free 64-bit atomics (acquire/release). Waiting is a bounded spin then
// short sleeps; every wait takes a timeout and returns nullopt when it expires.
class SlotRing {
 public:
  // The header stores a slot's size in 32 bits.
  static constexpr uint64_t kMaxSlotBytes = UINT32_MAX;
  // Throws Error{kInvalidArgument} for an empty geometry or slot_bytes > kMaxSlotBytes.
  static size_t region_bytes(uint32_t slots, uint64_t slot_bytes);
  // Writes a fresh header into `region` (creator side). Throws if the region is too small.
  static void format(ShmRegion& region, uint32_t slots, uint64_t slot_bytes);
  // Validates magic/version/geometry; throws Error{kCorruption} on mismatch.
  explicit SlotRing(ShmRegion& region);
  SlotRing(const SlotRing&) = delete;
  SlotRing& operator=(const SlotRing&) = delete;

  uint32_t slots() const noexcept;
  uint32_t slot_bytes() const noexcept;
  uint64_t produced() const noexcept;  // slots published so far
  uint64_t consumed() const noexcept;  // slots released so far
  uint32_t depth() const noexcept { return static_cast<uint32_t>(produced() - consumed()); }

  // Producer. acquire returns the next free slot's payload, or nullopt (ring full until
  // timeout). publish makes it visible with `bytes` used and a caller-defined `tag`.
  std::optional<std::span<std::byte>> try_acquire();
  std::optional<std::span<std::byte>> acquire(Millis timeout);
  void publish(uint32_t bytes, uint64_t tag);

  // Consumer. peek returns the oldest published slot without freeing it (its memory stays
  // valid and unchanged until release()); nullopt when empty until timeout.
  struct Slot {
    std::span<std::byte> data;  // `bytes` long as published
    uint64_t tag;
    uint64_t seq;  // 0-based publication index
  };
  std::optional<Slot> try_peek();
  std::optional<Slot> peek(Millis timeout);
  void release();

 private:
  struct Header;
  Header* header_;
  std::byte* slots_base_;
};

// ---------------------------------------------------------------------------------------
// Control plane: ZeroMQ sockets carrying one schema::ControlMessage per frame.

class ZmqContext {
 public:
  ZmqContext();
  ~ZmqContext();
  ZmqContext(const ZmqContext&) = delete;
  ZmqContext& operator=(const ZmqContext&) = delete;
  void* get() const noexcept { return ctx_; }

 private:
  void* ctx_;
};

// A received control message. The frame is copied into a word-aligned buffer before it is
// read (ZeroMQ frames are not aligned). root() is valid for this object's lifetime.
class Received {
 public:
  Received(std::string peer, kj::Array<capnp::word> words);
  Received(const Received&) = delete;
  Received& operator=(const Received&) = delete;
  const std::string& peer() const noexcept { return peer_; }  // ROUTER side: sender identity
  schema::ControlMessage::Reader root() { return reader_.getRoot<schema::ControlMessage>(); }

 private:
  std::string peer_;
  kj::Array<capnp::word> words_;
  capnp::FlatArrayMessageReader reader_;
};

// ROUTER (bind) or DEALER (connect) socket. Linger is 0: closing never blocks. A ROUTER bound
// to ipc://PATH removes its socket file when destroyed.
// A DEALER's routing identity is `identity` (e.g. "trainer-1"); the ROUTER sees it as peer().
class Channel {
 public:
  enum class Kind { kRouter, kDealer };
  Channel(ZmqContext& ctx, Kind kind, const std::string& endpoint,
          const std::string& identity = {});
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // DEALER: send to the bound peer. ROUTER: send_to a connected identity. Return false if
  // the message could not be queued within `timeout` or the peer is unknown (ROUTER).
  bool send(capnp::MessageBuilder& message, Millis timeout = Millis(1000));
  bool send_to(std::string_view peer, capnp::MessageBuilder& message,
               Millis timeout = Millis(1000));

  // Waits at most `timeout`; nullptr on timeout. A malformed frame or an unknown schema
  // version is counted in malformed() and skipped, never thrown.
  std::unique_ptr<Received> receive(Millis timeout);
  uint64_t malformed() const noexcept { return malformed_; }

  // The endpoint actually bound or connected (ZMQ_LAST_ENDPOINT): resolves a wildcard port
  // such as "tcp://127.0.0.1:*" to the port the kernel chose.
  std::string endpoint() const;
  // How long closing may wait to deliver queued messages (default 0). Used to flush a last
  // message (a Failure) before a process exits; it bounds the context's termination.
  void set_linger(Millis linger);

  // For zmq_poll together with other fds (the supervisor's signalfd).
  zmq_pollitem_t pollitem() const noexcept { return zmq_pollitem_t{socket_, 0, ZMQ_POLLIN, 0}; }

 private:
  void* socket_;
  Kind kind_;
  uint64_t malformed_ = 0;
  // A bound ipc:// socket file, removed by the destructor (libzmq leaves it behind) unless
  // another socket has been bound at the same path since (different inode).
  std::string ipc_path_;
  uint64_t ipc_dev_ = 0;
  uint64_t ipc_ino_ = 0;
};

// Builds a ControlMessage with schemaVersion set; fill the union via root().
class ControlMessageBuilder {
 public:
  ControlMessageBuilder();
  schema::ControlMessage::Builder root() { return root_; }
  capnp::MessageBuilder& message() { return message_; }

 private:
  capnp::MallocMessageBuilder message_;
  schema::ControlMessage::Builder root_;
};

// The per-process control client: a DEALER to the supervisor, Hello on construction, then a
// background thread that sends a Heartbeat every `interval` carrying the progress fields the
// owning thread publishes through set_*(), and that records a Stop from the supervisor.
// Lifetime: the thread is joined in the destructor (bounded by one interval). The socket is
// used only by that thread (ZeroMQ sockets are not thread-safe).
class ControlClient {
 public:
  ControlClient(const std::string& endpoint, schema::StageKind stage, uint32_t rank,
                uint32_t generation, Millis interval);
  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  void set_phase(schema::Phase phase);  // also stamps phaseStartedMonoNs
  void set_step(uint32_t step);
  void set_progress(uint32_t step, double tokens, float loss, double step_seconds);
  // Collector: how far behind the journals the last fold was (append -> fold, seconds).
  void set_lag(double seconds);
  // Called by the thread that does the stage's work, never by a helper thread: each call
  // stamps "progress now" (the supervisor judges a stage by the age of this stamp, since
  // heartbeats come from this client's own thread and go on while the work is wedged).
  // `work_done` counts finished units of work (folds, commits, batches); `pending_since_ns`
  // is when the oldest piece of work still owed arrived (CLOCK_MONOTONIC; 0: none owed).
  void report_progress(uint64_t work_done, int64_t pending_since_ns = 0);
  bool stop_requested() const noexcept { return stop_.load(std::memory_order_acquire); }
  std::string stop_reason() const;
  // Sends a Failure message now (best effort, from the calling thread's point of view it
  // is queued to the heartbeat thread and flushed before the destructor returns).
  // `error_kind`: what was thrown (schemas::to_schema of a megacpp::Error's kind, or the
  // foreign kinds), NONE when the failure is no exception;
  // `mono_ns` is when the process met the failure (0: now).
  void report_failure(const std::string& kind, const std::string& message,
                      schema::ErrorKind error_kind = schema::ErrorKind::NONE, int64_t mono_ns = 0);

 private:
  struct State;
  std::unique_ptr<State> state_;
  std::atomic<bool> stop_{false};
};

// ---------------------------------------------------------------------------------------
// Journals: append-only files of framed, checksummed schema::JournalRecord messages.
//
// Frame: u32 magic "MJR1" | u32 payload bytes | u64 XXH3-64(payload) | payload (flat
// Cap'n Proto words, a multiple of 8). One write(2) per record; the file is opened
// O_APPEND, so a restarted writer appends after whatever is there. A torn or corrupt frame
// is skipped by the reader (it resynchronises on the next magic at an 8-byte boundary) and
// counted; it is never fatal.
class JournalWriter {
 public:
  explicit JournalWriter(const std::filesystem::path& path);
  ~JournalWriter();
  JournalWriter(const JournalWriter&) = delete;
  JournalWriter& operator=(const JournalWriter&) = delete;

  // Stamps schemaVersion, monoNs, wallNs, stage, rank and pid; `fill` sets the union.
  void append(const std::function<void(schema::JournalRecord::Builder)>& fill);
  void append_raw(capnp::MessageBuilder& message);
  void sync();  // fdatasync: records so far survive a machine crash
  void set_identity(schema::StageKind stage, uint32_t rank);
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
  int fd_;
  schema::StageKind stage_ = schema::StageKind::SUPERVISOR;
  uint32_t rank_ = 0;
};

struct JournalStats {
  uint64_t records = 0;
  uint64_t torn_bytes = 0;      // bytes skipped (torn tail or corrupt frames)
  uint64_t corrupt_frames = 0;  // frames whose checksum or framing failed
};

// Incremental reader. poll() reads whatever was appended since the last call and calls `fn`
// for each intact record in order; a trailing partial frame is left for the next poll
// (the writer may still be mid-write). finish() treats any remaining partial tail as torn.
class JournalReader {
 public:
  explicit JournalReader(const std::filesystem::path& path);
  JournalReader(const JournalReader&) = delete;
  JournalReader& operator=(const JournalReader&) = delete;

  using Visitor = std::function<void(schema::JournalRecord::Reader)>;
  uint64_t poll(const Visitor& fn);  // returns records delivered by this call
  void finish();
  // As finish(), but first resynchronises inside the remaining tail and delivers any intact
  // records found after a torn frame (a restarted writer appends after a torn tail).
  uint64_t finish(const Visitor& fn);
  const JournalStats& stats() const noexcept { return stats_; }

  // Reads a whole file (poll + finish).
  static JournalStats read_all(const std::filesystem::path& path, const Visitor& fn);

 private:
  std::filesystem::path path_;
  uint64_t offset_ = 0;  // file offset of the first unconsumed byte
  std::string pending_;  // bytes read but not yet consumed
  JournalStats stats_;
  bool resyncing_ = false;  // inside a run of bad bytes (counted as one corrupt frame)

  uint64_t parse(const Visitor& fn, bool final);
};

}  // namespace megacpp::ipc
