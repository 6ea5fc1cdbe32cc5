// ipc/journal.h: journals on disk, written and read by separate processes, torn and corrupt frames.
// Against the real thing; timings are never asserted, every wait is bounded.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include "core/error.h"
#include "ipc/journal.h"
#include "tests/unit/ipc_test_support.h"
#include "tests/unit/test_support.h"

namespace megacpp::ipc {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using megacpp::test_support::TempDir;
using test::Child;
using test::ShmTest;

// ---------------------------------------------------------------------------------------
// Journals

struct Seen {
  std::vector<uint32_t> steps;  // step number of step records; 0 for other records
  std::vector<schema::JournalRecord::Which> kinds;
};

JournalReader::Visitor collect(Seen& seen) {
  return [&seen](schema::JournalRecord::Reader r) {
    seen.kinds.push_back(r.which());
    seen.steps.push_back(r.isStep() ? r.getStep().getStep() : 0);
  };
}

void append_step(JournalWriter& w, uint32_t step) {
  w.append([step](schema::JournalRecord::Builder r) {
    auto s = r.initStep();
    s.setStep(step);
    s.setLoss(1.0f / static_cast<float>(step));
    s.setTokens(4096);
  });
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void spit(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
// Byte offsets where each frame of an intact journal starts.
std::vector<size_t> frame_starts(const std::string& bytes) {
  std::vector<size_t> starts;
  for (size_t pos = 0; pos + 16 <= bytes.size();) {
    starts.push_back(pos);
    uint32_t len;
    std::memcpy(&len, bytes.data() + pos + 4, 4);
    pos += 16 + len;
  }
  return starts;
}

TEST(JournalTest, AppendAndReadBack) {
  TempDir dir;
  const fs::path path = dir.path() / "journal" / "trainer-2.journal";  // parent is created
  {
    JournalWriter w(path);
    EXPECT_EQ(w.path(), path);
    w.set_identity(schema::StageKind::TRAINER, 2);
    w.append([](schema::JournalRecord::Builder r) { r.setProcessStarted(); });
    for (uint32_t s = 1; s <= 10; ++s) append_step(w, s);
    w.append([](schema::JournalRecord::Builder r) { r.setProcessFinished(); });
    w.sync();
  }
  std::vector<uint32_t> steps;
  int64_t last_mono = 0;
  auto stats = JournalReader::read_all(path, [&](schema::JournalRecord::Reader r) {
    EXPECT_EQ(r.getSchemaVersion(), schema::SCHEMA_VERSION);
    EXPECT_EQ(r.getStage(), schema::StageKind::TRAINER);
    EXPECT_EQ(r.getRank(), 2u);
    EXPECT_EQ(r.getPid(), ::getpid());
    EXPECT_GE(r.getMonoNs(), last_mono);
    EXPECT_GT(r.getWallNs(), 0);
    last_mono = r.getMonoNs();
    if (r.isStep()) {
      steps.push_back(r.getStep().getStep());
      EXPECT_EQ(r.getStep().getTokens(), 4096u);
    }
  });
  EXPECT_EQ(stats.records, 12u);
  EXPECT_EQ(stats.torn_bytes, 0u);
  EXPECT_EQ(stats.corrupt_frames, 0u);
  EXPECT_EQ(steps, (std::vector<uint32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));

  // A restarted writer appends after what is there.
  {
    JournalWriter w(path);
    append_step(w, 11);
  }
  Seen seen;
  EXPECT_EQ(JournalReader::read_all(path, collect(seen)).records, 13u);
  EXPECT_EQ(seen.steps.back(), 11u);
}

TEST(JournalTest, MissingFileIsAnEmptyJournal) {
  TempDir dir;
  Seen seen;
  auto stats = JournalReader::read_all(dir.path() / "never-written.journal", collect(seen));
  EXPECT_EQ(stats.records, 0u);
  EXPECT_EQ(stats.torn_bytes, 0u);
  JournalReader reader(dir.path() / "also-missing.journal");
  EXPECT_EQ(reader.poll(collect(seen)), 0u);
  EXPECT_TRUE(seen.steps.empty());
}

TEST(JournalTest, IncrementalPoll) {
  TempDir dir;
  const fs::path path = dir.path() / "loader-0.journal";
  JournalWriter w(path);
  JournalReader reader(path);
  Seen seen;
  auto fn = collect(seen);
  EXPECT_EQ(reader.poll(fn), 0u);
  for (uint32_t s = 1; s <= 3; ++s) append_step(w, s);
  EXPECT_EQ(reader.poll(fn), 3u);
  EXPECT_EQ(reader.poll(fn), 0u);
  append_step(w, 4);
  append_step(w, 5);
  EXPECT_EQ(reader.poll(fn), 2u);
  EXPECT_EQ(seen.steps, (std::vector<uint32_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(reader.stats().records, 5u);
}

TEST(JournalTest, PollWhileAnotherProcessWrites) {
  TempDir dir;
  const fs::path path = dir.path() / "trainer-0.journal";
  constexpr uint32_t kRecords = 300;
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 0;
    try {
      JournalWriter w(path);
      for (uint32_t s = 1; s <= kRecords; ++s) {
        append_step(w, s);
        if (s % 10 == 0) ::usleep(500);
      }
    } catch (...) {
      code = 3;
    }
    ::_exit(code);
  }
  Child child(pid);
  JournalReader reader(path);
  Seen seen;
  auto fn = collect(seen);
  auto deadline = Clock::now() + std::chrono::seconds(15);
  while (!child.exited() && Clock::now() < deadline) {
    reader.poll(fn);
    EXPECT_EQ(reader.stats().torn_bytes, 0u) << "a partial record was treated as torn";
    ::usleep(200);
  }
  ASSERT_TRUE(child.exited());
  EXPECT_EQ(child.exit_code(), 0);
  reader.poll(fn);
  reader.finish();
  std::vector<uint32_t> expected(kRecords);
  for (uint32_t s = 0; s < kRecords; ++s) expected[s] = s + 1;
  EXPECT_EQ(seen.steps, expected);
  EXPECT_EQ(reader.stats().records, kRecords);
  EXPECT_EQ(reader.stats().torn_bytes, 0u);
  EXPECT_EQ(reader.stats().corrupt_frames, 0u);
}

TEST(JournalTest, TornTailIsSkippedAndARestartedWriterResumes) {
  TempDir dir;
  const fs::path path = dir.path() / "checkpointer-0.journal";
  {
    JournalWriter w(path);
    for (uint32_t s = 1; s <= 5; ++s) append_step(w, s);
  }
  fs::resize_file(path, fs::file_size(path) - 10);  // killed mid-write of record 5

  JournalReader reader(path);
  Seen seen;
  EXPECT_EQ(reader.poll(collect(seen)), 4u);
  EXPECT_EQ(reader.stats().torn_bytes, 0u) << "the tail may still be being written";
  reader.finish();
  EXPECT_GT(reader.stats().torn_bytes, 0u);
  EXPECT_EQ(reader.stats().corrupt_frames, 1u);
  EXPECT_EQ(seen.steps, (std::vector<uint32_t>{1, 2, 3, 4}));

  {
    JournalWriter w(path);  // a restarted process appends after the torn tail
    append_step(w, 6);
    append_step(w, 7);
  }
  Seen again;
  auto stats = JournalReader::read_all(path, collect(again));
  EXPECT_EQ(again.steps, (std::vector<uint32_t>{1, 2, 3, 4, 6, 7}));
  EXPECT_EQ(stats.records, 6u);
  EXPECT_GT(stats.torn_bytes, 0u);
  EXPECT_EQ(stats.corrupt_frames, 1u);

  // Cut in the middle of a frame header too: still no crash, still counted.
  fs::resize_file(path, fs::file_size(path) - (fs::file_size(path) % 8) - 3);
  Seen third;
  auto cut = JournalReader::read_all(path, collect(third));
  EXPECT_EQ(third.steps, (std::vector<uint32_t>{1, 2, 3, 4, 6}));
  EXPECT_GT(cut.torn_bytes, 0u);
}

TEST(JournalTest, CorruptMiddleRecordIsSkipped) {
  TempDir dir;
  const fs::path path = dir.path() / "trainer-0.journal";
  {
    JournalWriter w(path);
    for (uint32_t s = 1; s <= 3; ++s) append_step(w, s);
  }
  std::string bytes = slurp(path);
  auto starts = frame_starts(bytes);
  ASSERT_EQ(starts.size(), 3u);
  bytes[starts[1] + 16 + 12] ^= 0x40;  // one bit inside record 2's payload
  spit(path, bytes);

  Seen seen;
  auto stats = JournalReader::read_all(path, collect(seen));
  EXPECT_EQ(seen.steps, (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(stats.records, 2u);
  EXPECT_EQ(stats.corrupt_frames, 1u);
  EXPECT_EQ(stats.torn_bytes, starts[2] - starts[1]);

  // A flipped magic is resynchronised the same way.
  bytes = slurp(path);
  bytes[starts[1] + 16 + 12] ^= 0x40;
  bytes[starts[1]] = 'X';
  spit(path, bytes);
  Seen again;
  EXPECT_EQ(JournalReader::read_all(path, collect(again)).records, 2u);
  EXPECT_EQ(again.steps, (std::vector<uint32_t>{1, 3}));
}

TEST(JournalTest, IntactFrameWithUndecodablePayloadIsSkipped) {
  TempDir dir;
  const fs::path path = dir.path() / "trainer-0.journal";
  {
    JournalWriter w(path);
    append_step(w, 1);
  }
  {
    // Correct magic, length and checksum around a payload that is not a Cap'n Proto message.
    std::string payload(16, '\xff');
    uint32_t len = static_cast<uint32_t>(payload.size());
    uint64_t sum = XXH3_64bits(payload.data(), payload.size());
    std::string frame = "MJR1";
    frame.append(reinterpret_cast<const char*>(&len), 4);
    frame.append(reinterpret_cast<const char*>(&sum), 8);
    frame += payload;
    std::ofstream out(path, std::ios::binary | std::ios::app);
    out.write(frame.data(), static_cast<std::streamsize>(frame.size()));
  }
  {
    JournalWriter w(path);
    append_step(w, 2);
  }
  Seen seen;
  auto stats = JournalReader::read_all(path, collect(seen));
  EXPECT_EQ(seen.steps, (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(stats.corrupt_frames, 1u);
  EXPECT_EQ(stats.torn_bytes, 32u);
}

}  // namespace
}  // namespace megacpp::ipc
