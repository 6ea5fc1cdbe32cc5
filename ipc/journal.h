// megacpp::ipc journals: append-only files of framed, checksummed schema::JournalRecord
// messages.
//
// Lifetime: a JournalWriter owns its O_APPEND fd (closed by the destructor); a JournalReader
// holds only a path and an offset and reopens the file on each poll. Neither is copyable
// or movable.
// Blocking: one write(2) per appended record and one read pass per poll; sync() waits for
// fdatasync. Nothing waits on another process.
// Failure: a torn or corrupt frame is skipped by the reader and counted in stats(), never
// fatal; failed system calls throw megacpp::Error{kSystem}.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include "core/fd.h"
#include "schemas/common.capnp.h"
#include "schemas/journal.capnp.h"

namespace megacpp::ipc {

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

  // Stamps schemaVersion, monoNs, wallNs, stage, rank, pid and attempt; `fill` sets the union.
  void append(const std::function<void(schema::JournalRecord::Builder)>& fill);
  void append_raw(capnp::MessageBuilder& message);
  void sync();  // fdatasync: records so far survive a machine crash
  void set_identity(schema::StageKind stage, uint32_t rank);
  // The run attempt stamped on every record from now on (launch.json's attempt).
  void set_attempt(uint32_t attempt) noexcept { attempt_ = attempt; }
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
  Fd fd_;
  schema::StageKind stage_ = schema::StageKind::SUPERVISOR;
  uint32_t rank_ = 0;
  uint32_t attempt_ = 0;
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
