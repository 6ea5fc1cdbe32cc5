// megacpp::checkpointer: safetensors writer/reader, the commit protocol, verify, and the
// snapshot service over real ZeroMQ sockets and real shm staging regions.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <numeric>
#include <set>
#include <system_error>
#include <thread>

#include <fmt/ranges.h>

#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/store.h"
#include "checkpoint/verify.h"
#include "core/error.h"
#include "core/util.h"
#include "ipc/channel.h"
#include "ipc/handle_socket.h"
#include "ipc/journal.h"
#include "ipc/shm.h"
#include "ipc/staged_buffer.h"
#include "ipc/staging_stamp.h"
#include "schemas/checkpoint.capnp.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"
#include "stages/checkpointer/service.h"
#include "stages/checkpointer/staging_imports.h"
#include "tests/unit/test_support.h"

namespace megacpp::checkpoint {
namespace {

using namespace std::chrono_literals;

using megacpp::test_support::TempDir;

// A byte buffer standing in for a staging region, with F32/I64 tensors at known offsets.
struct FakeRegion {
  std::vector<std::byte> bytes;
  std::vector<TensorView> views;

  template <typename T>
  void add(const std::string& name, const std::string& dtype, std::vector<uint64_t> shape,
           const std::vector<T>& values) {
    const size_t offset = bytes.size();
    bytes.resize(offset + values.size() * sizeof(T));
    if (!values.empty())
      std::memcpy(bytes.data() + offset, values.data(), values.size() * sizeof(T));
    views.push_back(TensorView{name, dtype, std::move(shape), nullptr, values.size() * sizeof(T)});
    offsets.push_back(offset);
  }
  std::span<const TensorView> finish() {
    for (size_t i = 0; i < views.size(); ++i) views[i].data = bytes.data() + offsets[i];
    return views;
  }
  std::vector<size_t> offsets;
};

FakeRegion sample_region(float scale) {
  FakeRegion r;
  std::vector<float> w(6);
  std::iota(w.begin(), w.end(), 1.0f);
  for (auto& x : w) x *= scale;
  r.add<float>("model.w", "F32", {2, 3}, w);
  r.add<int64_t>("optim.step", "I64", {}, {42});
  r.add<float>("optim.exp_avg.model.w", "F32", {3, 2}, std::vector<float>(6, 0.5f * scale));
  r.add<float>("empty", "F32", {0, 4}, {});
  return r;
}

TEST(Safetensors, WritesAndReadsBackHeader) {
  TempDir dir;
  FakeRegion region = sample_region(1.0f);
  auto views = region.finish();
  const fs::path path = dir.path() / "t.safetensors";
  WrittenFile w = write_safetensors(path, views, {{"step", "7"}});
  EXPECT_EQ(w.tensors, 4u);
  EXPECT_EQ(w.bytes, fs::file_size(path));
  EXPECT_EQ(w.xxh3, xxh3_hex(read_file(path)));
  EXPECT_EQ(w.xxh3, xxh3_file(path));

  SafetensorsHeader h = read_safetensors_header(path);
  EXPECT_EQ(h.header_bytes % 8, 0u);
  EXPECT_EQ(h.data_bytes, region.bytes.size());
  EXPECT_EQ(h.metadata.at("format"), "pt");
  EXPECT_EQ(h.metadata.at("step"), "7");
  ASSERT_EQ(h.tensors.size(), 4u);
  // Sorted by offset = the order written.
  EXPECT_EQ(h.tensors[0].name, "model.w");
  EXPECT_EQ(h.tensors[0].dtype, "F32");
  EXPECT_EQ(h.tensors[0].shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(h.tensors[0].begin, 0u);
  EXPECT_EQ(h.tensors[0].end, 24u);
  EXPECT_EQ(h.tensors[1].name, "optim.step");
  EXPECT_EQ(h.tensors[1].dtype, "I64");
  EXPECT_TRUE(h.tensors[1].shape.empty());
  EXPECT_EQ(h.tensors[1].begin, 24u);
  EXPECT_EQ(h.tensors[1].end, 32u);
  EXPECT_EQ(h.tensors[2].name, "optim.exp_avg.model.w");
  EXPECT_EQ(h.tensors[2].begin, 32u);
  EXPECT_EQ(h.tensors[2].end, 56u);
  EXPECT_EQ(h.tensors[3].name, "empty");
  EXPECT_EQ(h.tensors[3].begin, 56u);
  EXPECT_EQ(h.tensors[3].end, 56u);

  // The data section is the region's bytes, verbatim.
  std::string file = read_file(path);
  ASSERT_EQ(file.size(), 8 + h.header_bytes + region.bytes.size());
  EXPECT_EQ(std::memcmp(file.data() + 8 + h.header_bytes, region.bytes.data(), region.bytes.size()),
            0);
}

TEST(Safetensors, ZeroTensorsIsAValidFile) {
  TempDir dir;
  const fs::path path = dir.path() / "none.safetensors";
  WrittenFile w = write_safetensors(path, {}, {});
  EXPECT_EQ(w.tensors, 0u);
  SafetensorsHeader h = read_safetensors_header(path);
  EXPECT_TRUE(h.tensors.empty());
  EXPECT_EQ(h.data_bytes, 0u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

// A rank file of tens of MiB is written in bounded write(2)s (the checkpointer's progress stamp
// moves at least every 1 MiB, as checkpoint/safetensors.h's ProgressFn promises) and handed to
// writeback in windows along the way; the bytes and the hash are those of an unchunked write,
// whatever the tensor sizes against the chunk and window boundaries.
TEST(Safetensors, ALargeFileIsWrittenInBoundedChunksAndReadsBackVerbatim) {
  TempDir dir;
  const std::vector<uint64_t> sizes = {(5u << 20) + 3, 1, (12u << 20) + 5, 0, 3u << 20};
  std::vector<std::byte> data(std::accumulate(sizes.begin(), sizes.end(), uint64_t{0}));
  uint64_t x = 0x2545f4914f6cdd1dull;
  for (auto& b : data) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<std::byte>(x >> 56);
  }
  std::vector<TensorView> views;
  uint64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    views.push_back(
        TensorView{fmt::format("t{}", i), "U8", {sizes[i]}, data.data() + offset, sizes[i]});
    offset += sizes[i];
  }
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  const fs::path path = dir.path() / "large.safetensors";
  const WrittenFile w = write_safetensors(path, views, {}, [&](uint64_t written, uint64_t total) {
    calls.emplace_back(written, total);
  });

  const std::string file = read_file(path);
  ASSERT_EQ(w.bytes, file.size());
  EXPECT_EQ(w.xxh3, xxh3_hex(file));
  EXPECT_EQ(w.xxh3, xxh3_file(path));
  const SafetensorsHeader h = read_safetensors_header(path);
  ASSERT_EQ(h.data_bytes, data.size());
  EXPECT_EQ(std::memcmp(file.data() + 8 + h.header_bytes, data.data(), data.size()), 0);

  ASSERT_GE(calls.size(), 2u);
  EXPECT_EQ(calls.front(), std::make_pair(uint64_t{0}, w.bytes));
  EXPECT_EQ(calls.back(), std::make_pair(w.bytes, w.bytes));
  for (size_t i = 1; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].second, w.bytes);
    ASSERT_GE(calls[i].first, calls[i - 1].first);
    ASSERT_LE(calls[i].first - calls[i - 1].first, uint64_t{1} << 20)
        << "a write of " << calls[i].first - calls[i - 1].first << " bytes ending at "
        << calls[i].first << " without a progress call";
  }
}

TEST(Safetensors, RejectsBadTensorsAndLeavesNoFile) {
  TempDir dir;
  const fs::path path = dir.path() / "bad.safetensors";
  float data[4] = {};
  auto expect_invalid = [&](std::vector<TensorView> views) {
    try {
      write_safetensors(path, views);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    }
    EXPECT_FALSE(fs::exists(path));
  };
  auto* p = reinterpret_cast<const std::byte*>(data);
  expect_invalid({TensorView{"a", "F31", {4}, p, 16}});  // unknown dtype
  expect_invalid({TensorView{"a", "F32", {3}, p, 16}});  // size mismatch
  expect_invalid({TensorView{"a", "F32", {2}, p, 8}, TensorView{"a", "F32", {2}, p, 8}});  // dup
  expect_invalid({TensorView{"__metadata__", "F32", {4}, p, 16}});  // reserved
}

// A file that cannot be created (`megacpp export --out` into a folder that does not exist): the
// user's line names the file and the reason; the failed call and its source location are kept
// for logs only (what()).
TEST(Safetensors, AFileThatCannotBeCreatedIsNamedInTheUsersTerms) {
  TempDir dir;
  const fs::path path = dir.path() / "no-such-folder" / "model.safetensors";
  auto region = sample_region(1.0f);
  try {
    write_safetensors(path, region.finish());
    ADD_FAILURE() << "wrote " << path;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kSystem);
    EXPECT_EQ(e.sys_errno(), ENOENT);
    EXPECT_EQ(e.message(), "cannot create " + path.string() + ": No such file or directory");
    EXPECT_NE(std::string(e.what()).find("storage.cpp:"), std::string::npos) << e.what();
    EXPECT_EQ(user_message(e), e.message());
  }
}

// read_file, the reader behind every JSON document a command opens: the same split.
TEST(Safetensors, AMissingFileReadIsNamedInTheUsersTerms) {
  TempDir dir;
  const fs::path path = dir.path() / "checkpoint.json";
  try {
    read_file(path);
    ADD_FAILURE() << "read " << path;
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "cannot open " + path.string() + ": No such file or directory");
    EXPECT_EQ(e.message().find("failed:"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("util.cpp:"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, HeaderParserRejectsCorruption) {
  auto frame = [](const std::string& json, size_t data) {
    std::string out(8, '\0');
    uint64_t n = json.size();
    std::memcpy(out.data(), &n, 8);
    return out + json + std::string(data, '\0');
  };
  auto expect_corrupt = [](const std::string& bytes) {
    try {
      parse_safetensors_header(bytes, bytes.size());
      ADD_FAILURE() << "accepted: " << bytes.substr(8);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kCorruption) << e.what();
    }
  };
  const std::string good = frame(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8);
  EXPECT_NO_THROW(parse_safetensors_header(good, good.size()));
  EXPECT_EQ(parse_safetensors_header(good, good.size()).tensors.at(0).end, 8u);
  expect_corrupt("abc");
  expect_corrupt(frame("{not json", 0));
  expect_corrupt(frame("[]", 0));
  expect_corrupt(frame(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4));   // short
  expect_corrupt(frame(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12));  // extra
  expect_corrupt(frame(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8));   // shape
  expect_corrupt(frame(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8));   // gap
  expect_corrupt(frame(R"({"a":{"dtype":"X","shape":[2],"data_offsets":[0,8]}})", 8));     // dtype
  expect_corrupt(frame(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8));
  expect_corrupt(frame(R"({"__metadata__":{"k":1}})", 0));
  // Header length beyond the file.
  std::string big(8, '\0');
  big[0] = 100;
  expect_corrupt(big + "{}");
}

fs::path step_dir(const fs::path& run, uint32_t step) {
  return layout::checkpoints_dir(run) / layout::checkpoint_dir_name(step);
}

// Writes and commits step `step` for world 2 directly through the store.
CommittedCheckpoint commit_world2(CheckpointStore& store, uint32_t step) {
  FakeRegion r0 = sample_region(1.0f);
  store.write_rank(step, 2, 0, r0.finish());
  EXPECT_FALSE(store.complete(step));
  store.write_rank(step, 2, 1, {});  // a rank that owns no tensors
  EXPECT_TRUE(store.complete(step));
  return store.commit(step);
}

TEST(CheckpointStore, CommitProtocolWorld2) {
  TempDir run;
  CheckpointStore store(run.path(), "run-x", "hash-y");
  EXPECT_FALSE(store.latest().has_value());
  FakeRegion r0 = sample_region(1.0f);
  store.write_rank(40, 2, 0, r0.finish());
  const fs::path tmp = layout::checkpoints_dir(run.path()) / "step_00000040.tmp";
  EXPECT_TRUE(fs::exists(tmp / "rank_0.safetensors"));
  EXPECT_FALSE(store.complete(40));
  EXPECT_EQ(store.pending(), std::vector<uint32_t>{40});
  EXPECT_THROW(store.write_rank(40, 3, 1, {}), Error);  // world disagrees
  store.write_rank(40, 2, 1, {});
  ASSERT_TRUE(store.complete(40));
  CommittedCheckpoint c = store.commit(40);

  EXPECT_EQ(c.step, 40u);
  EXPECT_EQ(c.relative_path, "checkpoints/step_00000040");
  EXPECT_EQ(c.dir, step_dir(run.path(), 40));
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_TRUE(store.pending().empty());
  EXPECT_EQ(read_file(layout::checkpoints_dir(run.path()) / "LATEST"), "step_00000040\n");
  EXPECT_EQ(store.latest(), 40u);

  schemas::JsonFile<schema::CheckpointManifest> doc(c.dir / "checkpoint.json");
  auto m = doc.get();
  EXPECT_EQ(m.getSchemaVersion(), schema::SCHEMA_VERSION);
  EXPECT_EQ(std::string(m.getRunId().cStr()), "run-x");
  EXPECT_EQ(std::string(m.getRecipeHash().cStr()), "hash-y");
  EXPECT_EQ(m.getStep(), 40u);
  EXPECT_EQ(m.getWorld(), 2u);
  ASSERT_EQ(m.getFiles().size(), 2u);
  uint64_t total = fs::file_size(c.dir / "checkpoint.json");
  for (uint32_t r = 0; r < 2; ++r) {
    auto f = m.getFiles()[r];
    const fs::path file = c.dir / fmt::format("rank_{}.safetensors", r);
    EXPECT_EQ(std::string(f.getName().cStr()), file.filename().string());
    EXPECT_EQ(f.getBytes(), fs::file_size(file));
    EXPECT_EQ(std::string(f.getXxh3().cStr()), xxh3_hex(read_file(file)));
    EXPECT_EQ(f.getTensors(), r == 0 ? 4u : 0u);
    total += f.getBytes();
  }
  EXPECT_EQ(c.bytes, total);
  auto v = verify_checkpoint(c.dir);
  EXPECT_TRUE(v.ok) << (v.problems.empty() ? "" : v.problems[0]);

  // A second, later commit moves LATEST; the first stays untouched.
  commit_world2(store, 50);
  EXPECT_EQ(read_file(layout::checkpoints_dir(run.path()) / "LATEST"), "step_00000050\n");
  EXPECT_TRUE(verify_checkpoint(step_dir(run.path(), 40)).ok);
  EXPECT_TRUE(verify_checkpoint(step_dir(run.path(), 50)).ok);
}

// One flipped bit anywhere in any file of a checkpoint — checkpoint.json included, at every
// byte of it, and at every 7th byte of the rank files — fails verify (and so is skipped by a
// resume, which loads only a checkpoint that verifies).
// A Storage that forwards to the local filesystem and notes each operation ("op name", the
// last path component); `fail_rename` makes rename() fail with that errno.
class RecordingStorage final : public Storage {
 public:
  explicit RecordingStorage(std::vector<std::string>& log, int fail_rename = 0)
      : log_(log), fail_rename_(fail_rename) {}
  std::unique_ptr<WritableFile> create(const fs::path& path) override {
    note("create", path);
    return posix_.create(path);
  }
  void write_atomic(const fs::path& path, std::string_view bytes) override {
    note("write_atomic", path);
    posix_.write_atomic(path, bytes);
  }
  std::string read(const fs::path& path) override {
    note("read", path);
    return posix_.read(path);
  }
  uint64_t file_size(const fs::path& path) override {
    note("file_size", path);
    return posix_.file_size(path);
  }
  void remove(const fs::path& path) noexcept override {
    note("remove", path);
    posix_.remove(path);
  }
  bool exists(const fs::path& path) override {
    note("exists", path);
    return posix_.exists(path);
  }
  bool is_directory(const fs::path& path) override {
    note("is_directory", path);
    return posix_.is_directory(path);
  }
  std::vector<Entry> list(const fs::path& dir) override {
    note("list", dir);
    return posix_.list(dir);
  }
  std::error_code make_dirs(const fs::path& dir) noexcept override {
    note("make_dirs", dir);
    return posix_.make_dirs(dir);
  }
  std::error_code rename(const fs::path& from, const fs::path& to) noexcept override {
    note("rename", from, to);
    if (fail_rename_ != 0) return {fail_rename_, std::system_category()};
    return posix_.rename(from, to);
  }
  std::error_code remove_all(const fs::path& path) noexcept override {
    note("remove_all", path);
    return posix_.remove_all(path);
  }
  void sync_dir(const fs::path& dir) override {
    note("sync_dir", dir);
    posix_.sync_dir(dir);
  }

 private:
  void note(std::string_view op, const fs::path& path, const fs::path& to = {}) {
    log_.push_back(fmt::format("{} {}{}", op, path.filename().string(),
                               to.empty() ? "" : " " + to.filename().string()));
  }
  std::vector<std::string>& log_;
  int fail_rename_;
  PosixStorage posix_;
};

// Whether `want` appears in `log` in this order (other operations may lie between).
bool in_order(const std::vector<std::string>& log, const std::vector<std::string>& want) {
  auto at = log.begin();
  for (const auto& w : want) {
    at = std::find(at, log.end(), w);
    if (at == log.end()) return false;
    ++at;
  }
  return true;
}

// The store keeps every file of RUN/checkpoints in its Storage: a step written and committed
// over a recording Storage goes through it in the protocol's order, and the result verifies.
// A node's part of a job across nodes (ranks 2..3 of 4): its first rank's file holds the
// replicated state, each rank its shard. The reader opens the part, reads what its ranks hold
// and names another node's rows in the user's terms.
TEST(CheckpointReader, ANodesPartIsReadForItsOwnRanks) {
  TempDir run;
  CheckpointStore store(run.path(), "run-x", "hash-y");
  store.set_ranks(2, 2);
  auto shard_layout = [](uint32_t rank) {
    return fmt::format(
        R"({{"format": "megacpp.snapshot.v1", "rank": {0}, "world": 4, "shards": {{"optim.m.shard{0}":
        {{"logical": "optim.m", "full_shape": [4, 3], "offset": {0}}}}}}})",
        rank);
  };
  FakeRegion r2;
  r2.add<float>("model.w", "F32", {2, 3}, {1, 2, 3, 4, 5, 6});
  r2.add<float>("optim.m.shard2", "F32", {1, 3}, {7, 8, 9});
  store.write_rank(8, 4, 2, r2.finish(), shard_layout(2));
  EXPECT_FALSE(store.complete(8));
  FakeRegion r3;
  r3.add<float>("optim.m.shard3", "F32", {1, 3}, {10, 11, 12});
  store.write_rank(8, 4, 3, r3.finish(), shard_layout(3));
  ASSERT_TRUE(store.complete(8));
  const CommittedCheckpoint c = store.commit(8);
  EXPECT_TRUE(verify_checkpoint(c.dir).ok);

  const megacpp::checkpoint::CheckpointReader ckpt(c.dir);
  EXPECT_EQ(ckpt.world(), 4u);
  EXPECT_EQ(ckpt.first_rank(), 2u);
  EXPECT_EQ(ckpt.ranks(), 2u);
  std::vector<float> w(6), m(6), one(3);
  ckpt.read_rows(*ckpt.find("model.w"), 0, 2, std::as_writable_bytes(std::span(w)));
  EXPECT_EQ(w, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  ckpt.read_rows(*ckpt.find("optim.m"), 2, 2, std::as_writable_bytes(std::span(m)));
  EXPECT_EQ(m, (std::vector<float>{7, 8, 9, 10, 11, 12}));
  try {
    ckpt.read_rows(*ckpt.find("optim.m"), 0, 1, std::as_writable_bytes(std::span(one)));
    ADD_FAILURE() << "row 0 is another node's";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("in another node's part"), std::string::npos) << e.message();
  }
}

// A run directory names its checkpoint through LATEST; a node's run of a job across nodes
// through JOB_LATEST first (a step every node committed, not its own part's newest).
TEST(CheckpointReader, ARunDirectoryResolvesToTheJobsLatestBeforeItsOwn) {
  TempDir run;
  const fs::path ck = layout::checkpoints_dir(run.path());
  fs::create_directories(ck / "step_00000004");
  fs::create_directories(ck / "step_00000008");
  std::ofstream(ck / "LATEST") << "step_00000008\n";
  EXPECT_EQ(resolve_checkpoint_dir(run.path()), ck / "step_00000008");
  std::ofstream(ck / std::string(kJobLatestName)) << "step_00000004\n";
  EXPECT_EQ(resolve_checkpoint_dir(run.path()), ck / "step_00000004");
  EXPECT_EQ(resolve_checkpoint_dir(ck / "LATEST"), ck / "step_00000008") << "LATEST itself, asked";
}

TEST(CheckpointStore, EveryFileOperationGoesThroughItsStorage) {
  TempDir run;
  std::vector<std::string> log;
  CheckpointStore store(run.path(), "run-x", "hash-y", {}, std::make_unique<RecordingStorage>(log));
  FakeRegion r0 = sample_region(1.0f);
  store.write_rank(3, 1, 0, r0.finish());
  store.commit(3);
  EXPECT_TRUE(in_order(
      log,
      {"make_dirs checkpoints", "list checkpoints", "make_dirs step_00000003.tmp",
       "create rank_0.safetensors", "write_atomic checkpoint.json",
       "rename step_00000003.tmp step_00000003", "sync_dir checkpoints", "write_atomic LATEST"}))
      << fmt::format("{}", fmt::join(log, "\n"));
  const VerifyResult v = verify_checkpoint(step_dir(run.path(), 3));
  EXPECT_TRUE(v.ok) << fmt::format("{}", fmt::join(v.problems, "; "));
  EXPECT_EQ(read_file(layout::checkpoints_dir(run.path()) / "LATEST"), "step_00000003\n");
}

// A rename the storage refuses fails the commit with the errno kept and the same words as
// when the store called rename(2) itself; nothing is committed.
TEST(CheckpointStore, ARefusedCommitRenameIsASystemError) {
  TempDir run;
  std::vector<std::string> log;
  CheckpointStore store(run.path(), "run-x", "hash-y", {},
                        std::make_unique<RecordingStorage>(log, EXDEV));
  FakeRegion r0 = sample_region(1.0f);
  store.write_rank(3, 1, 0, r0.finish());
  try {
    store.commit(3);
    FAIL() << "commit succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kSystem);
    EXPECT_EQ(e.sys_errno(), EXDEV);
    EXPECT_EQ(e.message(), fmt::format("::rename(tmp.c_str(), final_dir.c_str()) failed: {}",
                                       std::strerror(EXDEV)));
  }
  EXPECT_FALSE(fs::exists(step_dir(run.path(), 3)));
  EXPECT_FALSE(fs::exists(layout::checkpoints_dir(run.path()) / "LATEST"));
}

TEST(CheckpointStore, EveryFlippedByteOfEveryFileFailsVerify) {
  TempDir run;
  CheckpointStore store(run.path(), "r", "h");
  CommittedCheckpoint c = commit_world2(store, 3);
  ASSERT_TRUE(verify_checkpoint(c.dir).ok);
  for (const char* name : {"checkpoint.json", "rank_0.safetensors", "rank_1.safetensors"}) {
    const fs::path path = c.dir / name;
    const std::string original = read_file(path);
    const size_t stride = std::string_view(name) == "checkpoint.json" ? 1 : 7;
    size_t tried = 0;
    for (size_t at = 0; at < original.size(); at += stride, ++tried) {
      std::string damaged = original;
      damaged[at] = static_cast<char>(damaged[at] ^ 0x01);
      {
        std::ofstream f(path, std::ios::binary | std::ios::trunc);
        f.write(damaged.data(), static_cast<std::streamsize>(damaged.size()));
      }
      EXPECT_FALSE(verify_checkpoint(c.dir).ok) << name << " byte " << at << " flipped";
    }
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(original.data(), static_cast<std::streamsize>(original.size()));
    EXPECT_GT(tried, 10u) << name;
  }
  EXPECT_TRUE(verify_checkpoint(c.dir).ok);
}

TEST(CheckpointStore, VerifyDetectsFlippedByteAndMissingFile) {
  TempDir run;
  CheckpointStore store(run.path(), "r", "h");
  CommittedCheckpoint c = commit_world2(store, 3);
  ASSERT_TRUE(verify_checkpoint(c.dir).ok);

  // Flip one data byte of rank 0 (same size, header intact: only the checksum notices).
  const fs::path f0 = c.dir / "rank_0.safetensors";
  {
    std::fstream f(f0, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char ch = 0;
    f.read(&ch, 1);
    ch = static_cast<char>(ch ^ 0x40);
    f.seekp(-3, std::ios::end);
    f.write(&ch, 1);
  }
  auto v = verify_checkpoint(c.dir);
  EXPECT_FALSE(v.ok);
  ASSERT_EQ(v.problems.size(), 1u);
  EXPECT_NE(v.problems[0].find("rank_0.safetensors: xxh3"), std::string::npos) << v.problems[0];

  fs::remove(c.dir / "rank_1.safetensors");
  v = verify_checkpoint(c.dir);
  EXPECT_FALSE(v.ok);
  ASSERT_EQ(v.problems.size(), 2u);
  EXPECT_NE(v.problems[1].find("rank_1.safetensors: missing"), std::string::npos) << v.problems[1];

  fs::remove(c.dir / "checkpoint.json");
  v = verify_checkpoint(c.dir);
  EXPECT_FALSE(v.ok);
  EXPECT_EQ(v.problems.size(), 1u);
}

TEST(CheckpointStore, DiscardsLeftoverTmpAtStart) {
  TempDir run;
  {
    CheckpointStore store(run.path(), "r", "h");
    commit_world2(store, 3);
    FakeRegion r0 = sample_region(2.0f);
    store.write_rank(6, 2, 0, r0.finish());  // the "crash": step 6 never completes
  }
  const fs::path ckpts = layout::checkpoints_dir(run.path());
  ASSERT_TRUE(fs::exists(ckpts / "step_00000006.tmp" / "rank_0.safetensors"));
  CheckpointStore store(run.path(), "r", "h");
  EXPECT_FALSE(fs::exists(ckpts / "step_00000006.tmp"));
  EXPECT_TRUE(store.pending().empty());
  EXPECT_EQ(store.latest(), 3u);
  EXPECT_TRUE(verify_checkpoint(step_dir(run.path(), 3)).ok);
  EXPECT_EQ(read_file(ckpts / "LATEST"), "step_00000003\n");

  // Same for an explicit discard.
  store.write_rank(9, 2, 1, {});
  EXPECT_TRUE(fs::exists(ckpts / "step_00000009.tmp"));
  store.discard_all();
  EXPECT_FALSE(fs::exists(ckpts / "step_00000009.tmp"));
}

// ---------------------------------------------------------------------------------------
// The service, with real sockets and real shm regions (in one process: the service is
// driven by poll()).

struct Rank {
  std::unique_ptr<ipc::ShmRegion> region;
  std::unique_ptr<ipc::Channel> dealer;
  std::vector<std::tuple<std::string, std::string, std::vector<uint64_t>, uint64_t, uint64_t>>
      tensors;  // name, dtype, shape, offset, bytes
};

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = fmt::format("/megacpp-cktest-{}-", ::getpid());
    endpoint_ = "ipc://" + (sock_.path() / "ck").string();
    store_ = std::make_unique<CheckpointStore>(run_.path(), "run-svc", "hash");
    router_ = std::make_unique<ipc::Channel>(zmq_, ipc::Channel::Kind::kRouter, endpoint_);
    journal_ = std::make_unique<ipc::JournalWriter>(
        layout::journal_path(run_.path(), schema::StageKind::CHECKPOINTER, 0));
    journal_->set_identity(schema::StageKind::CHECKPOINTER, 0);
    make_service();
    for (uint32_t r = 0; r < 2; ++r) {
      auto& rank = ranks_[r];
      rank.region = std::make_unique<ipc::ShmRegion>(ipc::ShmRegion::Create{},
                                                     layout::staging_shm_name(prefix_, r), 4096);
      rank.dealer = make_dealer(r);
    }
  }
  std::unique_ptr<ipc::Channel> make_dealer(uint32_t r) {
    return std::make_unique<ipc::Channel>(zmq_, ipc::Channel::Kind::kDealer, endpoint_,
                                          layout::process_name(schema::StageKind::TRAINER, r));
  }
  void make_service() {
    service_ = std::make_unique<checkpointer::Service>(
        *store_, *router_, journal_.get(), [this](schema::Phase p) { phases_.push_back(p); },
        [this](uint32_t step) {
          writes_.push_back(step);
          if (on_write_) on_write_();
        });
  }
  // What a relaunched checkpointer does: a fresh store over the same run directory (which
  // discards uncommitted tmp directories) and a fresh ROUTER bound on the same endpoint. The
  // ranks' DEALERs reconnect by themselves.
  void restart() {
    service_.reset();
    router_.reset();
    store_.reset();
    store_ = std::make_unique<CheckpointStore>(run_.path(), "run-svc", "hash");
    router_ = std::make_unique<ipc::Channel>(zmq_, ipc::Channel::Kind::kRouter, endpoint_);
    make_service();
  }
  void TearDown() override {
    service_.reset();
    for (auto& r : ranks_) r.dealer.reset();
    router_.reset();
    for (auto& r : ranks_) r.region.reset();
    EXPECT_TRUE(ipc::list_shm(prefix_).empty());
  }

  // `count` F32 tensors of 4 values (step + i + 0.25 k), 64 bytes apart from `base`.
  static void write_values(std::byte* base, uint32_t step, uint32_t count) {
    for (uint32_t i = 0; i < count; ++i) {
      float vals[4];
      for (int k = 0; k < 4; ++k) vals[k] = static_cast<float>(step + i) + 0.25f * k;
      std::memcpy(base + 64 * i, vals, sizeof vals);
    }
  }
  // Rank r's SnapshotReady of those tensors (at offsets 64 i, or all at `bad_offset`), naming its
  // staging region. With `stamp` != 0 the region's step stamp (its last 64 bytes) is set to it
  // and announced.
  schema::SnapshotReady::Builder init_ready(ipc::ControlMessageBuilder& b, uint32_t r,
                                            uint32_t step, uint32_t count, uint64_t bad_offset,
                                            uint32_t stamp) {
    auto& rank = ranks_[r];
    auto ready = b.root().initSnapshotReady();
    ready.setRank(r);
    ready.setWorld(2);
    ready.setStep(step);
    ready.setRegion(rank.region->name());
    ready.setRegionBytes(rank.region->size());
    auto list = ready.initTensors(count);
    for (uint32_t i = 0; i < count; ++i) {
      auto t = list[i];
      t.setName(fmt::format("r{}.t{}", r, i));
      t.setDtype("F32");
      auto shape = t.initShape(2);
      shape.set(0, 2);
      shape.set(1, 2);
      t.setOffset(bad_offset ? bad_offset : 64 * i);
      t.setBytes(4 * sizeof(float));
    }
    if (stamp != 0) {
      std::byte* p = stamp_of(r);
      ipc::clear_staging_stamp(p);
      ipc::set_staging_stamp(p, stamp);
      ready.setStampOffset(rank.region->size() - ipc::kStagingStampBytes);
    }
    return ready;
  }
  // Fills rank r's staging region with `count` tensors (write_values) and sends their
  // SnapshotReady (init_ready).
  void send_snapshot(uint32_t r, uint32_t step, uint32_t count, uint64_t bad_offset = 0,
                     uint32_t stamp = 0) {
    write_values(ranks_[r].region->data(), step, count);
    ipc::ControlMessageBuilder b;
    init_ready(b, r, step, count, bad_offset, stamp);
    ASSERT_TRUE(ranks_[r].dealer->send(b.message()));
  }

  struct Ack {
    uint32_t rank, step;
    bool ok, committed;
    std::string error;
  };
  Ack receive_ack(uint32_t r) {
    auto msg = ranks_[r].dealer->receive(5000ms);
    EXPECT_TRUE(msg != nullptr);
    if (!msg) return {};
    EXPECT_TRUE(msg->root().isSnapshotAck());
    auto a = msg->root().getSnapshotAck();
    return Ack{a.getRank(), a.getStep(), a.getOk(), a.getCommitted(), a.getError().cStr()};
  }
  void serve_one() { ASSERT_TRUE(service_->poll(5000ms)); }
  std::byte* stamp_of(uint32_t r) {
    return ranks_[r].region->data() + ranks_[r].region->size() - ipc::kStagingStampBytes;
  }

  TempDir run_, sock_;
  std::string prefix_, endpoint_;
  ipc::ZmqContext zmq_;
  std::unique_ptr<CheckpointStore> store_;
  std::unique_ptr<ipc::Channel> router_;
  std::unique_ptr<ipc::JournalWriter> journal_;
  std::unique_ptr<checkpointer::Service> service_;
  std::vector<schema::Phase> phases_;
  std::vector<uint32_t> writes_;    // steps of the rank files written, in order
  std::function<void()> on_write_;  // runs just before a rank file is written
  Rank ranks_[2];
};

fs::path tmp_dir(const fs::path& run, uint32_t step) {
  return layout::checkpoints_dir(run) / (layout::checkpoint_dir_name(step) + ".tmp");
}

// Steps of the checkpointCommitted records in a journal, in order.
std::vector<uint32_t> journaled_commits(const fs::path& journal) {
  std::vector<uint32_t> steps;
  ipc::JournalReader::read_all(journal, [&](schema::JournalRecord::Reader rec) {
    if (rec.isCheckpointCommitted()) steps.push_back(rec.getCheckpointCommitted().getStep());
  });
  return steps;
}

TEST_F(ServiceTest, SnapshotsOfTwoRanksAreCommittedAndAcked) {
  for (uint32_t step : {5u, 10u}) {
    send_snapshot(0, step, 3);
    serve_one();
    Ack a0 = receive_ack(0);
    EXPECT_EQ(a0.rank, 0u);
    EXPECT_EQ(a0.step, step);
    EXPECT_TRUE(a0.ok);
    EXPECT_FALSE(a0.committed);
    EXPECT_TRUE(service_->has_pending());

    send_snapshot(1, step, 1);
    serve_one();
    Ack a1 = receive_ack(1);
    EXPECT_TRUE(a1.ok);
    EXPECT_FALSE(a1.committed);
    for (uint32_t r = 0; r < 2; ++r) {
      Ack c = receive_ack(r);
      EXPECT_EQ(c.rank, r);
      EXPECT_EQ(c.step, step);
      EXPECT_TRUE(c.ok);
      EXPECT_TRUE(c.committed);
    }
    EXPECT_FALSE(service_->has_pending());
    const fs::path dir = step_dir(run_.path(), step);
    auto v = verify_checkpoint(dir);
    EXPECT_TRUE(v.ok) << (v.problems.empty() ? "" : v.problems[0]);
    auto h = read_safetensors_header(dir / "rank_0.safetensors");
    ASSERT_EQ(h.tensors.size(), 3u);
    EXPECT_EQ(h.tensors[2].name, "r0.t2");
    EXPECT_EQ(h.tensors[2].shape, (std::vector<uint64_t>{2, 2}));
    std::string file = read_file(dir / "rank_0.safetensors");
    float v2[4];
    std::memcpy(v2, file.data() + 8 + h.header_bytes + h.tensors[2].begin, sizeof v2);
    EXPECT_EQ(v2[0], static_cast<float>(step + 2));
    EXPECT_EQ(v2[3], static_cast<float>(step + 2) + 0.75f);
  }
  EXPECT_EQ(service_->committed(), 2u);
  EXPECT_EQ(read_file(layout::checkpoints_dir(run_.path()) / "LATEST"), "step_00000010\n");
  EXPECT_FALSE(service_->poll(10ms));
  ASSERT_FALSE(phases_.empty());
  EXPECT_EQ(phases_.back(), schema::Phase::IDLE);
  EXPECT_NE(std::find(phases_.begin(), phases_.end(), schema::Phase::WRITE), phases_.end());

  std::vector<std::pair<uint32_t, std::string>> commits;
  ipc::JournalReader::read_all(journal_->path(), [&](schema::JournalRecord::Reader rec) {
    if (rec.isCheckpointCommitted()) {
      auto c = rec.getCheckpointCommitted();
      commits.emplace_back(c.getStep(), c.getPath().cStr());
      EXPECT_GT(c.getBytes(), 0u);
      EXPECT_GE(c.getSeconds(), 0.0);
    }
  });
  EXPECT_EQ(commits, (std::vector<std::pair<uint32_t, std::string>>{
                         {5, "checkpoints/step_00000005"}, {10, "checkpoints/step_00000010"}}));
}

TEST_F(ServiceTest, RecreatedStagingRegionIsReattached) {
  auto commit_step = [&](uint32_t step) {
    for (uint32_t r = 0; r < 2; ++r) {
      send_snapshot(r, step, 1);
      serve_one();
    }
    for (uint32_t r = 0; r < 2; ++r) {
      EXPECT_TRUE(receive_ack(r).ok);
      EXPECT_TRUE(receive_ack(r).committed);
    }
  };
  commit_step(1);
  // Same name, same size, a new segment (a restarted producer): must not read the old mapping.
  const std::string name = ranks_[0].region->name();
  ranks_[0].region.reset();
  ranks_[0].region = std::make_unique<ipc::ShmRegion>(ipc::ShmRegion::Create{}, name, 4096);
  commit_step(100);
  auto h = read_safetensors_header(step_dir(run_.path(), 100) / "rank_0.safetensors");
  std::string file = read_file(step_dir(run_.path(), 100) / "rank_0.safetensors");
  float v0 = 0;
  std::memcpy(&v0, file.data() + 8 + h.header_bytes, sizeof v0);
  EXPECT_EQ(v0, 100.0f);
}

TEST_F(ServiceTest, PartialStepIsDiscarded) {
  send_snapshot(0, 7, 2);
  serve_one();
  EXPECT_TRUE(receive_ack(0).ok);
  EXPECT_TRUE(service_->has_pending());
  EXPECT_TRUE(fs::exists(layout::checkpoints_dir(run_.path()) / "step_00000007.tmp"));
  service_->discard_pending();
  EXPECT_FALSE(service_->has_pending());
  EXPECT_FALSE(fs::exists(layout::checkpoints_dir(run_.path()) / "step_00000007.tmp"));
  EXPECT_FALSE(fs::exists(step_dir(run_.path(), 7)));
}

TEST_F(ServiceTest, OutOfRegionTensorIsNackedAndThrows) {
  send_snapshot(1, 3, 1, /*bad_offset=*/4090);
  try {
    service_->poll(5000ms);
    ADD_FAILURE() << "accepted a tensor outside the staging region";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol) << e.what();
  }
  Ack a = receive_ack(1);
  EXPECT_FALSE(a.ok);
  EXPECT_FALSE(a.committed);
  EXPECT_NE(a.error.find("outside"), std::string::npos) << a.error;
}

TEST_F(ServiceTest, DuplicateOfAWrittenStepIsAckedAgainWithoutRewriting) {
  send_snapshot(0, 5, 2);
  serve_one();
  Ack first = receive_ack(0);
  EXPECT_TRUE(first.ok);
  EXPECT_FALSE(first.committed);
  const fs::path file = tmp_dir(run_.path(), 5) / "rank_0.safetensors";
  const std::string before = read_file(file);
  // A re-send (here with a different tensor list, so a rewrite would show in the file).
  send_snapshot(0, 5, 1);
  serve_one();
  Ack again = receive_ack(0);
  EXPECT_EQ(again.step, 5u);
  EXPECT_TRUE(again.ok);
  EXPECT_FALSE(again.committed);
  EXPECT_EQ(read_file(file), before);
  EXPECT_EQ(writes_, std::vector<uint32_t>{5});

  send_snapshot(1, 5, 1);
  serve_one();
  EXPECT_TRUE(receive_ack(1).ok);
  EXPECT_TRUE(receive_ack(0).committed);
  EXPECT_TRUE(receive_ack(1).committed);
  EXPECT_EQ(service_->committed(), 1u);
  EXPECT_EQ(writes_, (std::vector<uint32_t>{5, 5}));
  EXPECT_EQ(read_safetensors_header(step_dir(run_.path(), 5) / "rank_0.safetensors").tensors.size(),
            2u);
  EXPECT_TRUE(verify_checkpoint(step_dir(run_.path(), 5)).ok);
}

TEST_F(ServiceTest, DuplicateOfACommittedStepIsAckedCommitted) {
  for (uint32_t r = 0; r < 2; ++r) {
    send_snapshot(r, 5, 2);
    serve_one();
  }
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(receive_ack(r).ok);
    EXPECT_TRUE(receive_ack(r).committed);
  }
  const std::string committed_file = read_file(step_dir(run_.path(), 5) / "rank_1.safetensors");
  for (int i = 0; i < 2; ++i) {
    send_snapshot(1, 5, 1);
    serve_one();
    Ack a = receive_ack(1);
    EXPECT_EQ(a.step, 5u);
    EXPECT_TRUE(a.ok);
    EXPECT_TRUE(a.committed);
  }
  EXPECT_EQ(service_->committed(), 1u);
  EXPECT_EQ(writes_, (std::vector<uint32_t>{5, 5}));
  EXPECT_FALSE(service_->has_pending());
  EXPECT_FALSE(fs::exists(tmp_dir(run_.path(), 5)));
  EXPECT_EQ(read_file(step_dir(run_.path(), 5) / "rank_1.safetensors"), committed_file);
  EXPECT_EQ(journaled_commits(journal_->path()), std::vector<uint32_t>{5});
}

TEST_F(ServiceTest, RestartDiscardsThePartialStepAndCommitsTheResentOneOnce) {
  for (uint32_t r = 0; r < 2; ++r) {
    send_snapshot(r, 3, 1);
    serve_one();
  }
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(receive_ack(r).ok);
    EXPECT_TRUE(receive_ack(r).committed);
  }
  const std::string step3 = read_file(step_dir(run_.path(), 3) / "rank_0.safetensors");
  send_snapshot(0, 7, 2);
  serve_one();
  EXPECT_TRUE(receive_ack(0).ok);  // rank 0's lease is released; step 7 is not committed
  ASSERT_TRUE(fs::exists(tmp_dir(run_.path(), 7) / "rank_0.safetensors"));

  restart();
  EXPECT_FALSE(fs::exists(tmp_dir(run_.path(), 7)));
  EXPECT_TRUE(store_->pending().empty());
  EXPECT_EQ(store_->latest(), 3u);
  EXPECT_FALSE(service_->has_pending());

  // Rank 1 sends step 7 for the first time; rank 0 re-sends it (it still waits for the
  // commit), once more than needed.
  // Like the real rank, re-send until served: a message sent while the DEALER has not yet
  // noticed the old ROUTER is gone goes into the dying connection and is dropped.
  bool served = false;
  for (int attempt = 0; attempt < 10 && !served; ++attempt) {
    send_snapshot(1, 7, 1);
    served = service_->poll(2000ms);
  }
  ASSERT_TRUE(served);
  Ack a1 = receive_ack(1);
  EXPECT_TRUE(a1.ok);
  EXPECT_FALSE(a1.committed);
  EXPECT_FALSE(fs::exists(step_dir(run_.path(), 7)));
  send_snapshot(0, 7, 2);
  send_snapshot(0, 7, 2);
  serve_one();
  Ack a0 = receive_ack(0);
  EXPECT_TRUE(a0.ok);
  EXPECT_FALSE(a0.committed);
  for (uint32_t r = 0; r < 2; ++r) {
    Ack c = receive_ack(r);
    EXPECT_EQ(c.step, 7u);
    EXPECT_TRUE(c.committed);
  }
  serve_one();  // the extra duplicate
  Ack dup = receive_ack(0);
  EXPECT_TRUE(dup.ok);
  EXPECT_TRUE(dup.committed);
  EXPECT_EQ(service_->committed(), 1u);
  EXPECT_EQ(writes_, (std::vector<uint32_t>{3, 3, 7, 7, 7}));
  EXPECT_FALSE(service_->poll(10ms));

  auto v = verify_checkpoint(step_dir(run_.path(), 7));
  EXPECT_TRUE(v.ok) << (v.problems.empty() ? "" : v.problems[0]);
  EXPECT_EQ(read_safetensors_header(step_dir(run_.path(), 7) / "rank_0.safetensors").tensors.size(),
            2u);
  EXPECT_EQ(read_file(step_dir(run_.path(), 3) / "rank_0.safetensors"), step3);
  EXPECT_TRUE(verify_checkpoint(step_dir(run_.path(), 3)).ok);
  EXPECT_FALSE(fs::exists(tmp_dir(run_.path(), 7)));
  EXPECT_EQ(read_file(layout::checkpoints_dir(run_.path()) / "LATEST"), "step_00000007\n");
  EXPECT_EQ(journaled_commits(journal_->path()), (std::vector<uint32_t>{3, 7}));
}

TEST_F(ServiceTest, ACommitDiscardsOlderPartialStepsAndTheirLateSnapshots) {
  send_snapshot(0, 7, 1);
  serve_one();
  EXPECT_TRUE(receive_ack(0).ok);
  for (uint32_t r = 0; r < 2; ++r) {
    send_snapshot(r, 9, 1);
    serve_one();
  }
  EXPECT_TRUE(receive_ack(0).ok);
  EXPECT_TRUE(receive_ack(1).ok);
  EXPECT_TRUE(receive_ack(0).committed);
  EXPECT_TRUE(receive_ack(1).committed);
  EXPECT_FALSE(service_->has_pending());
  EXPECT_FALSE(fs::exists(tmp_dir(run_.path(), 7)));
  // A late (re-sent) snapshot of the superseded step is acked but never written.
  send_snapshot(1, 7, 1);
  serve_one();
  Ack late = receive_ack(1);
  EXPECT_EQ(late.step, 7u);
  EXPECT_TRUE(late.ok);
  EXPECT_FALSE(late.committed);
  EXPECT_EQ(writes_, (std::vector<uint32_t>{7, 9, 9}));
  EXPECT_FALSE(fs::exists(tmp_dir(run_.path(), 7)));
  EXPECT_FALSE(fs::exists(step_dir(run_.path(), 7)));
  EXPECT_FALSE(service_->has_pending());
}

TEST_F(ServiceTest, AThrowingWriteHookFailsTheSnapshot) {
  service_ = std::make_unique<checkpointer::Service>(*store_, *router_, journal_.get(), nullptr,
                                                     [](uint32_t step) {
                                                       if (step == 4)
                                                         throw Error(ErrorKind::kInternal, "fault");
                                                     });
  send_snapshot(0, 4, 1);
  EXPECT_THROW(service_->poll(5000ms), Error);
  Ack a = receive_ack(0);
  EXPECT_FALSE(a.ok);
  EXPECT_NE(a.error.find("fault"), std::string::npos) << a.error;
  EXPECT_FALSE(fs::exists(tmp_dir(run_.path(), 4) / "rank_0.safetensors"));
}

TEST_F(ServiceTest, ACommitPrunesTheStoreAfterAckingTheRanks) {
  service_.reset();
  store_ = std::make_unique<CheckpointStore>(run_.path(), "run-svc", "hash", RetentionPolicy{1, 0});
  make_service();
  for (uint32_t step : {5u, 10u}) {
    for (uint32_t r = 0; r < 2; ++r) {
      send_snapshot(r, step, 1);
      serve_one();
    }
    for (uint32_t r = 0; r < 2; ++r) {
      EXPECT_TRUE(receive_ack(r).ok);
      EXPECT_TRUE(receive_ack(r).committed);
    }
  }
  EXPECT_FALSE(fs::exists(step_dir(run_.path(), 5)));
  EXPECT_TRUE(verify_checkpoint(step_dir(run_.path(), 10)).ok);
  EXPECT_EQ(read_file(layout::checkpoints_dir(run_.path()) / "LATEST"), "step_00000010\n");
  EXPECT_EQ(journaled_commits(journal_->path()), (std::vector<uint32_t>{5, 10}));
  // A late re-send of the pruned step is superseded: acked, never written again.
  send_snapshot(0, 5, 1);
  serve_one();
  Ack late = receive_ack(0);
  EXPECT_TRUE(late.ok);
  EXPECT_FALSE(late.committed);
  EXPECT_FALSE(fs::exists(step_dir(run_.path(), 5)));
  EXPECT_FALSE(fs::exists(tmp_dir(run_.path(), 5)));
}

// The race a step stamp closes: rank 0 re-sent SnapshotReady(5) while it waited, an ack
// released the lease, and the rank reused the region for step 7; the queued duplicate reaches
// a checkpointer that never wrote step 5 (a restarted one). Without the stamp, step 7's bytes
// would be written as step 5's.
TEST_F(ServiceTest, AStaleSnapshotReadyOfAReusedRegionIsNotWritten) {
  send_snapshot(0, 5, 2, 0, /*stamp=*/7);
  serve_one();
  EXPECT_TRUE(writes_.empty());
  EXPECT_FALSE(fs::exists(tmp_dir(run_.path(), 5) / "rank_0.safetensors"));
  EXPECT_FALSE(ranks_[0].dealer->receive(200ms)) << "a stale snapshot was acknowledged";
  // The region's own step is written as usual.
  send_snapshot(0, 7, 2, 0, /*stamp=*/7);
  serve_one();
  const Ack a = receive_ack(0);
  EXPECT_TRUE(a.ok);
  EXPECT_EQ(a.step, 7u);
  EXPECT_TRUE(fs::exists(tmp_dir(run_.path(), 7) / "rank_0.safetensors"));
}

TEST_F(ServiceTest, ARegionReusedDuringTheWriteDropsTheStep) {
  send_snapshot(1, 5, 2, 0, /*stamp=*/5);
  serve_one();
  ASSERT_TRUE(receive_ack(1).ok);
  // Rank 0's region is taken over by step 9 while its step-5 file is being written.
  on_write_ = [this] {
    ipc::clear_staging_stamp(stamp_of(0));
    ipc::set_staging_stamp(stamp_of(0), 9);
  };
  send_snapshot(0, 5, 2, 0, /*stamp=*/5);
  serve_one();
  EXPECT_FALSE(fs::exists(tmp_dir(run_.path(), 5))) << "a mixed rank file was kept";
  EXPECT_FALSE(store_->committed(5));
  EXPECT_FALSE(ranks_[0].dealer->receive(200ms));
}

// ---------------------------------------------------------------------------------------
// Snapshots staged in an exported buffer (DESIGN.md "GPU lane (second part)"), with the memfd
// stand-in of a device buffer: the descriptor over the handle socket, the wait for the copy, a
// rank gone, a checkpointer restarted.

class StagedServiceTest : public ServiceTest {
 protected:
  struct Staged {
    std::unique_ptr<ipc::MemfdBuffer> buffer;
    ipc::StagedBufferInfo info;
    std::unique_ptr<ipc::HandleConnection> conn;
  };
  void SetUp() override {
    ServiceTest::SetUp();
    open_imports();
    for (uint32_t r = 0; r < 2; ++r) {
      staged_[r].buffer = std::make_unique<ipc::MemfdBuffer>(4096);
      staged_[r].info.rank = r;
      staged_[r].info.generation = ipc::new_staged_generation() + r;
      staged_[r].info.kind = std::string(ipc::kStagedMemfd);
      staged_[r].info.bytes = staged_[r].buffer->bytes();
      staged_[r].info.mapping_bytes = staged_[r].buffer->mapping_bytes();
    }
  }
  void TearDown() override {
    service_.reset();
    imports_.reset();
    ServiceTest::TearDown();
  }
  void open_imports() {
    checkpointer::StagingImports::Options o;
    o.buffer_wait = 300ms;
    o.copy_wait = 2000ms;
    imports_ = std::make_unique<checkpointer::StagingImports>(sock_.path() / "staging", o);
    service_->set_staging_imports(imports_.get());
  }
  void restart_staged() {
    imports_.reset();
    restart();
    // New DEALERs: one connected to the old ROUTER can hand a message to the closing connection
    // before its I/O thread sees the close, and ZMQ drops it (seen under load). Delivery across
    // a checkpointer restart is not what these tests are about.
    for (uint32_t r = 0; r < 2; ++r) ranks_[r].dealer = make_dealer(r);
    open_imports();
  }
  // What a rank does once per connection: connects and sends its buffer's descriptor.
  void send_buffer(uint32_t r) {
    auto& st = staged_[r];
    st.conn = ipc::HandleConnection::connect(sock_.path() / "staging", 2000ms);
    ASSERT_TRUE(st.conn != nullptr);
    const int fd = st.buffer->fd();
    ASSERT_TRUE(
        st.conn->send(ipc::encode_staged_buffer(st.info), std::span<const int>(&fd, 1), 1000ms));
  }
  // Rank r's share of `count` F32 tensors of 4 values (step + i + 0.25 k) in its buffer, announced
  // by a SnapshotReady naming the buffer's generation and its region's step stamp. With
  // `finish_copy` false the copy is begun but left for the test to end.
  void send_staged(uint32_t r, uint32_t step, uint32_t count, bool finish_copy = true) {
    auto& st = staged_[r];
    st.buffer->begin_copy();
    if (finish_copy) fill(r, step, count);
    ipc::ControlMessageBuilder b;
    init_ready(b, r, step, count, 0, /*stamp=*/step).setStagedGeneration(st.info.generation);
    ASSERT_TRUE(ranks_[r].dealer->send(b.message()));
  }
  void fill(uint32_t r, uint32_t step, uint32_t count) {
    write_values(staged_[r].buffer->data(), step, count);
    staged_[r].buffer->end_copy();
  }
  float written(uint32_t step, uint32_t r, uint32_t i, int k) {
    const fs::path file = tmp_or_committed(step) / fmt::format("rank_{}.safetensors", r);
    auto h = read_safetensors_header(file);
    const std::string bytes = read_file(file);
    float v[4];
    std::memcpy(v, bytes.data() + 8 + h.header_bytes + h.tensors.at(i).begin, sizeof v);
    return v[k];
  }
  fs::path tmp_or_committed(uint32_t step) {
    return store_->committed(step) ? step_dir(run_.path(), step) : tmp_dir(run_.path(), step);
  }

  std::unique_ptr<checkpointer::StagingImports> imports_;
  Staged staged_[2];
};

TEST_F(StagedServiceTest, SnapshotsAreReadFromTheRanksExportedBuffers) {
  for (uint32_t r = 0; r < 2; ++r) {
    send_buffer(r);
    send_staged(r, 5, 3);
    serve_one();
    EXPECT_TRUE(receive_ack(r).ok);
  }
  for (uint32_t r = 0; r < 2; ++r) EXPECT_TRUE(receive_ack(r).committed);
  auto v = verify_checkpoint(step_dir(run_.path(), 5));
  EXPECT_TRUE(v.ok) << (v.problems.empty() ? "" : v.problems[0]);
  EXPECT_EQ(written(5, 0, 2, 0), 7.0f);
  EXPECT_EQ(written(5, 1, 1, 3), 6.75f);
  // The named regions held only the stamps: the bytes came from the buffers.
  EXPECT_EQ(ranks_[0].region->data()[0], std::byte{0});
}

TEST_F(StagedServiceTest, AStagedSnapshotWaitsForItsCopyToFinish) {
  send_buffer(0);
  send_staged(0, 4, 2, /*finish_copy=*/false);
  // The copy ends 150 ms after the SnapshotReady went out: what is written is the copy's.
  std::thread copier([this] {
    std::this_thread::sleep_for(150ms);
    fill(0, 4, 2);
  });
  serve_one();
  copier.join();
  const Ack a = receive_ack(0);
  EXPECT_TRUE(a.ok) << a.error;
  EXPECT_EQ(written(4, 0, 1, 2), 5.5f);
}

TEST_F(StagedServiceTest, ASnapshotOfARankThatDiedIsDroppedWithoutFailingTheCheckpointer) {
  send_buffer(0);
  send_staged(0, 4, 2, /*finish_copy=*/false);  // its copy never ends: the rank dies first
  staged_[0].conn.reset();
  EXPECT_NO_THROW(serve_one());
  EXPECT_FALSE(ranks_[0].dealer->receive(200ms));  // nobody to ack
  EXPECT_FALSE(fs::exists(tmp_dir(run_.path(), 4)));
  // The other rank is still served.
  send_buffer(1);
  send_staged(1, 4, 1);
  serve_one();
  EXPECT_TRUE(receive_ack(1).ok);
}

// A buffer this process cannot import (here a memfd sent as device memory on a device that does
// not exist: no driver, or no such device) is refused; the rank then stages in host memory and
// closes its connection, and its staged snapshots still queued are refused too (acked), not dropped
// as a dead rank's.
TEST_F(StagedServiceTest, ARefusedRankThatMovedToHostStagingIsNotTakenForDead) {
  staged_[0].info.kind = std::string(ipc::kStagedCuda);
  staged_[0].info.device = "0000:ff:1f.7";
  staged_[0].info.event = std::string(64, '\0');  // an IPC event handle's size
  send_buffer(0);
  send_staged(0, 4, 1);
  EXPECT_NO_THROW(serve_one());
  const Ack first = receive_ack(0);
  EXPECT_FALSE(first.ok);
  EXPECT_NE(first.error.find("cannot import"), std::string::npos) << first.error;
  send_staged(0, 4, 1);  // a re-send queued before the rank moved to host staging
  staged_[0].conn.reset();
  EXPECT_NO_THROW(serve_one());
  const Ack second = receive_ack(0);
  EXPECT_FALSE(second.ok);
  EXPECT_NE(second.error.find("cannot import"), std::string::npos) << second.error;
}

TEST_F(StagedServiceTest, ARestartedCheckpointerImportsTheBufferAgain) {
  send_buffer(0);
  send_staged(0, 3, 1);
  serve_one();
  ASSERT_TRUE(receive_ack(0).ok);
  restart_staged();
  // The re-sent snapshot reaches the new process before the rank reconnected: refused, not failed.
  send_staged(0, 3, 1);
  EXPECT_NO_THROW(serve_one());
  Ack refused = receive_ack(0);
  EXPECT_FALSE(refused.ok);
  EXPECT_NE(refused.error.find("no staging buffer"), std::string::npos) << refused.error;
  // The rank sees its old connection closed, sends its descriptor again and re-sends.
  std::optional<ipc::ReceivedHandles> none = staged_[0].conn->receive(100ms);
  EXPECT_FALSE(none.has_value());
  EXPECT_TRUE(staged_[0].conn->peer_gone());
  send_buffer(0);
  send_staged(0, 3, 1);
  serve_one();
  const Ack a = receive_ack(0);
  EXPECT_TRUE(a.ok) << a.error;
  EXPECT_EQ(written(3, 0, 0, 1), 3.25f);
}

TEST(CheckpointStore, LaggingLatestIsMovedForwardAtStart) {
  TempDir run;
  {
    CheckpointStore store(run.path(), "r", "h");
    commit_world2(store, 3);
    commit_world2(store, 6);
  }
  const fs::path ckpts = layout::checkpoints_dir(run.path());
  write_file_atomic(ckpts / "LATEST", "step_00000003\n");  // killed between rename and LATEST
  CheckpointStore store(run.path(), "r", "h");
  EXPECT_EQ(store.latest(), 6u);
  EXPECT_TRUE(store.committed(6));
  EXPECT_TRUE(store.committed(3));
  EXPECT_FALSE(store.committed(4));
  EXPECT_EQ(read_file(ckpts / "LATEST"), "step_00000006\n");
}

// ---------------------------------------------------------------------------------------
// Retention and running out of space.

// The committed step directories under RUN/checkpoints, ascending.
std::vector<uint32_t> steps_on_disk(const fs::path& run) {
  std::vector<uint32_t> steps;
  for (const auto& e : fs::directory_iterator(layout::checkpoints_dir(run))) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.size() == 13 && name.starts_with("step_")) {
      steps.push_back(static_cast<uint32_t>(std::stoul(name.substr(5))));
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Everything under RUN/checkpoints that is neither a committed step nor LATEST.
std::vector<std::string> leftovers(const fs::path& run) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(layout::checkpoints_dir(run))) {
    const std::string name = e.path().filename().string();
    if (name != "LATEST" && !(name.size() == 13 && name.starts_with("step_"))) out.push_back(name);
  }
  return out;
}

// LATEST names a committed checkpoint that verifies.
void expect_latest_valid(const fs::path& run, uint32_t step) {
  const fs::path ckpts = layout::checkpoints_dir(run);
  EXPECT_EQ(read_file(ckpts / "LATEST"), layout::checkpoint_dir_name(step) + "\n");
  auto v = verify_checkpoint(ckpts / layout::checkpoint_dir_name(step));
  EXPECT_TRUE(v.ok) << (v.problems.empty() ? "" : v.problems[0]);
}

TEST(CheckpointStore, RetentionKeepsTheNewestKPlusMultiplesOfKeepEvery) {
  TempDir run;
  CheckpointStore store(run.path(), "r", "h", RetentionPolicy{2, 30});
  std::vector<uint32_t> committed;
  for (uint32_t step = 10; step <= 90; step += 10) {
    const std::vector<uint32_t> before = steps_on_disk(run.path());
    commit_world2(store, step);
    // A commit alone deletes nothing: pruning comes after LATEST names the new step.
    std::vector<uint32_t> with_new = before;
    with_new.push_back(step);
    EXPECT_EQ(steps_on_disk(run.path()), with_new);
    expect_latest_valid(run.path(), step);

    committed.push_back(step);
    std::vector<uint32_t> expected;
    for (size_t i = 0; i < committed.size(); ++i) {
      if (i + 2 >= committed.size() || committed[i] % 30 == 0) expected.push_back(committed[i]);
    }
    std::vector<uint32_t> gone;
    std::set_difference(with_new.begin(), with_new.end(), expected.begin(), expected.end(),
                        std::back_inserter(gone));
    EXPECT_EQ(store.prune(), gone) << "after step " << step;
    EXPECT_EQ(steps_on_disk(run.path()), expected) << "after step " << step;
    EXPECT_TRUE(leftovers(run.path()).empty());
    expect_latest_valid(run.path(), step);
    for (uint32_t s : expected) EXPECT_TRUE(verify_checkpoint(step_dir(run.path(), s)).ok) << s;
  }
  EXPECT_EQ(steps_on_disk(run.path()), (std::vector<uint32_t>{30, 60, 80, 90}));
  // Pruning again is a no-op.
  EXPECT_TRUE(store.prune().empty());
}

TEST(CheckpointStore, RetentionOfOneKeepsOnlyTheStepLatestNames) {
  TempDir run;
  CheckpointStore store(run.path(), "r", "h", RetentionPolicy{1, 0});
  for (uint32_t step : {4u, 8u, 12u}) {
    commit_world2(store, step);
    store.prune();
    EXPECT_EQ(steps_on_disk(run.path()), std::vector<uint32_t>{step});
    expect_latest_valid(run.path(), step);
  }
  // A step older than LATEST committed late (a re-sent, superseded step) never moves LATEST,
  // and is itself the one pruned.
  commit_world2(store, 6);
  EXPECT_EQ(store.prune(), std::vector<uint32_t>{6});
  EXPECT_EQ(steps_on_disk(run.path()), std::vector<uint32_t>{12});
  expect_latest_valid(run.path(), 12);
}

// A node's part in a job across nodes: no step is pruned before the job named its newest
// (JOB_LATEST), and never that step or a later one: this node's newest part may be the
// job's only later, or never.
TEST(CheckpointStore, ANodesPartKeepsTheJobsLatestAndEveryLaterStep) {
  TempDir run;
  CheckpointStore store(run.path(), "r", "h", RetentionPolicy{1, 0});
  store.set_ranks(0, 2);
  for (uint32_t step : {10u, 20u, 30u}) {
    commit_world2(store, step);
    store.prune();  // as the checkpointer does after each commit
  }
  EXPECT_EQ(steps_on_disk(run.path()), (std::vector<uint32_t>{10, 20, 30}));
  write_file_atomic(layout::checkpoints_dir(run.path()) / "JOB_LATEST", "step_00000020\n");
  commit_world2(store, 40);
  store.prune();
  EXPECT_EQ(steps_on_disk(run.path()), (std::vector<uint32_t>{20, 30, 40}));
  write_file_atomic(layout::checkpoints_dir(run.path()) / "JOB_LATEST", "step_00000040\n");
  store.prune();
  EXPECT_EQ(steps_on_disk(run.path()), (std::vector<uint32_t>{40}));
}

TEST(CheckpointStore, NoPolicyKeepsEveryCheckpoint) {
  TempDir run;
  CheckpointStore store(run.path(), "r", "h");
  for (uint32_t step = 1; step <= 5; ++step) commit_world2(store, step);
  EXPECT_TRUE(store.prune().empty());
  EXPECT_EQ(steps_on_disk(run.path()), (std::vector<uint32_t>{1, 2, 3, 4, 5}));
}

TEST(CheckpointStore, PrunesCheckpointsFoundAtStart) {
  TempDir run;
  {
    CheckpointStore store(run.path(), "r", "h");  // an earlier process, keeping everything
    for (uint32_t step = 1; step <= 5; ++step) commit_world2(store, step);
  }
  CheckpointStore store(run.path(), "r", "h", RetentionPolicy{2, 2});
  EXPECT_EQ(steps_on_disk(run.path()), (std::vector<uint32_t>{2, 4, 5}));
  EXPECT_TRUE(leftovers(run.path()).empty());
  EXPECT_EQ(store.latest(), 5u);
  expect_latest_valid(run.path(), 5);
}

TEST(CheckpointStore, LeftoverDeletingDirectoryIsRemovedAtStart) {
  TempDir run;
  {
    CheckpointStore store(run.path(), "r", "h");
    commit_world2(store, 3);
    commit_world2(store, 6);
  }
  // A process killed while pruning step 3: renamed, its tree partly removed.
  const fs::path ckpts = layout::checkpoints_dir(run.path());
  fs::rename(ckpts / "step_00000003", ckpts / "step_00000003.deleting");
  fs::remove(ckpts / "step_00000003.deleting" / "checkpoint.json");
  CheckpointStore store(run.path(), "r", "h", RetentionPolicy{3, 0});
  EXPECT_FALSE(fs::exists(ckpts / "step_00000003.deleting"));
  EXPECT_TRUE(leftovers(run.path()).empty());
  EXPECT_EQ(steps_on_disk(run.path()), std::vector<uint32_t>{6});
  EXPECT_FALSE(store.committed(3));
  EXPECT_EQ(store.latest(), 6u);
  expect_latest_valid(run.path(), 6);
}

// Runs `body` in a forked child whose files may not grow past `limit` bytes (RLIMIT_FSIZE,
// SIGXFSZ ignored so the write fails with EFBIG, as in megacpp-checkpointer). The child
// writes what `body` returns (empty: passed) to `report`; returns it, or why the child failed.
std::string in_child_with_file_limit(rlim_t limit, const fs::path& report,
                                     const std::function<std::string()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::string result;
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit before{};
    ::getrlimit(RLIMIT_FSIZE, &before);
    const rlimit limited{limit, before.rlim_max};
    if (::setrlimit(RLIMIT_FSIZE, &limited) != 0) {
      result = fmt::format("setrlimit: {}", std::strerror(errno));
    } else {
      try {
        result = body();
      } catch (const std::exception& e) {
        result = fmt::format("unexpected exception: {}", e.what());
      }
    }
    ::setrlimit(RLIMIT_FSIZE, &before);  // the report may be longer than the limit
    { std::ofstream(report) << result; }
    ::_exit(0);
  }
  if (pid < 0) return "fork failed";
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return fmt::format("child status {}", status);
  return fs::exists(report) ? read_file(report) : "the child wrote no report";
}

// What the store must throw when the space runs out while writing step `step`.
std::string check_out_of_space(const Error& e, uint32_t step, const fs::path& ckpts) {
  const std::string what = e.what();
  if (e.kind() != ErrorKind::kSystem) return "kind " + std::string(to_string(e.kind()));
  if (e.sys_errno() != EFBIG) return fmt::format("errno {}", e.sys_errno());
  const std::string head =
      fmt::format("checkpoint step {}: no space left on {} (", step, ckpts.string());
  if (!what.starts_with(head)) return "message: " + what;
  if (what.find("lower --keep-checkpoints") == std::string::npos) return "message: " + what;
  if (what.find('\n') != std::string::npos) return "not one line: " + what;
  return {};
}

TEST(CheckpointStore, ARankFileBeyondTheFileSizeLimitFailsCleanly) {
  TempDir run;
  const fs::path ckpts = layout::checkpoints_dir(run.path());
  {
    CheckpointStore store(run.path(), "r", "h", RetentionPolicy{1, 0});
    commit_world2(store, 3);
  }
  const std::string latest_before = read_file(ckpts / "LATEST");
  const std::string result =
      in_child_with_file_limit(64 << 10, run.path() / "report", [&]() -> std::string {
        CheckpointStore store(run.path(), "r", "h", RetentionPolicy{1, 0});
        store.write_rank(6, 2, 1, {});  // a small rank file of the step is in
        FakeRegion big;
        big.add<float>("big", "F32", {256, 1024}, std::vector<float>(256 * 1024, 1.0f));
        try {
          store.write_rank(6, 2, 0, big.finish());
          return "a 1 MiB rank file was written under a 64 KiB limit";
        } catch (const Error& e) {
          if (auto bad = check_out_of_space(e, 6, ckpts); !bad.empty()) return bad;
          // The file got exactly as far as the limit; its full size is the header plus 1 MiB.
          const std::string what = e.what();
          unsigned long long wrote = 0, of = 0;
          const size_t at = what.find("(wrote ");
          if (at == std::string::npos ||
              std::sscanf(what.c_str() + at,
                          "(wrote %llu of %llu bytes of rank_0.safetensors: ", &wrote, &of) != 2 ||
              wrote != 64 << 10 || of <= 1 << 20) {
            return "message: " + what;
          }
        }
        if (!store.pending().empty()) return "step 6 is still pending";
        return {};
      });
  EXPECT_EQ(result, "");
  EXPECT_EQ(read_file(ckpts / "LATEST"), latest_before);
  expect_latest_valid(run.path(), 3);
  EXPECT_FALSE(fs::exists(ckpts / "step_00000006.tmp"));
  EXPECT_FALSE(fs::exists(ckpts / "step_00000006"));
  EXPECT_EQ(steps_on_disk(run.path()), std::vector<uint32_t>{3});
  EXPECT_TRUE(leftovers(run.path()).empty());
}

TEST(CheckpointStore, AManifestBeyondTheFileSizeLimitFailsTheCommitCleanly) {
  TempDir run;
  const fs::path ckpts = layout::checkpoints_dir(run.path());
  {
    CheckpointStore store(run.path(), "r", "h", RetentionPolicy{1, 0});
    store.write_rank(3, 2, 0, {});
    store.write_rank(3, 2, 1, {});
    store.commit(3);
  }
  // Rank files without tensors fit under the limit, checkpoint.json does not.
  const auto rank_bytes = fs::file_size(ckpts / "step_00000003" / "rank_0.safetensors");
  const auto manifest_bytes = fs::file_size(ckpts / "step_00000003" / "checkpoint.json");
  ASSERT_LT(rank_bytes + 16, manifest_bytes);
  const std::string latest_before = read_file(ckpts / "LATEST");
  const std::string result = in_child_with_file_limit(
      static_cast<rlim_t>(rank_bytes + 16), run.path() / "report", [&]() -> std::string {
        CheckpointStore store(run.path(), "r", "h", RetentionPolicy{1, 0});
        store.write_rank(6, 2, 0, {});
        store.write_rank(6, 2, 1, {});
        try {
          store.commit(6);
          return "checkpoint.json was written past the limit";
        } catch (const Error& e) {
          if (auto bad = check_out_of_space(e, 6, ckpts); !bad.empty()) return bad;
          if (std::string(e.what()).find("checkpoint.json failed") == std::string::npos) {
            return fmt::format("message: {}", e.what());
          }
        }
        if (!store.pending().empty()) return "step 6 is still pending";
        if (store.latest() != 3u) return "latest moved";
        return {};
      });
  EXPECT_EQ(result, "");
  EXPECT_EQ(read_file(ckpts / "LATEST"), latest_before);
  expect_latest_valid(run.path(), 3);
  EXPECT_FALSE(fs::exists(ckpts / "step_00000006.tmp"));
  EXPECT_FALSE(fs::exists(ckpts / "step_00000006"));
  EXPECT_TRUE(leftovers(run.path()).empty());
}

// ---------------------------------------------------------------------------------------
// Python's safetensors reads what we write.

TEST(SafetensorsPython, LoadsWithSafetensorsNumpy) {
  // The repository's own venv (CMake passes <source>/.venv/bin/python). Missing is a failure,
  // not a skip: a skip here silently dropped the round trip in every other clone.
  const fs::path python = MEGACPP_VENV_PYTHON;
  ASSERT_TRUE(fs::exists(python)) << python << " is missing (run `make setup`)";
  ASSERT_EQ(std::system((python.string() + " -c 'import safetensors.numpy' 2>/dev/null").c_str()),
            0)
      << python << " has no safetensors package (run `make setup`)";
  TempDir run;
  CheckpointStore store(run.path(), "run-py", "h");
  CommittedCheckpoint c = commit_world2(store, 2);
  const std::string script = R"PY(
import sys, numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file
d = sys.argv[1]
t = load_file(d + "/rank_0.safetensors")
assert sorted(t) == ["empty", "model.w", "optim.exp_avg.model.w", "optim.step"], sorted(t)
assert t["model.w"].dtype == np.float32 and t["model.w"].shape == (2, 3)
assert (t["model.w"] == np.arange(1, 7, dtype=np.float32).reshape(2, 3)).all()
assert t["optim.step"].dtype == np.int64 and t["optim.step"].shape == () and int(t["optim.step"]) == 42
assert (t["optim.exp_avg.model.w"] == 0.5).all() and t["optim.exp_avg.model.w"].shape == (3, 2)
assert t["empty"].shape == (0, 4)
with safe_open(d + "/rank_0.safetensors", framework="np") as f:
    m = f.metadata()
    assert m["format"] == "pt" and m["step"] == "2" and m["rank"] == "0" and m["world"] == "2", m
assert load_file(d + "/rank_1.safetensors") == {}
print("python-ok")
)PY";
  const fs::path script_path = run.path() / "check.py";
  { std::ofstream(script_path) << script; }
  const std::string cmd =
      fmt::format("{} {} {} 2>&1", python.string(), script_path.string(), c.dir.string());
  FILE* pipe = ::popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[512];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) output.append(buf, n);
  const int status = ::pclose(pipe);
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("python-ok"), std::string::npos) << output;
}

// ---------------------------------------------------------------------------------------
// The megacpp-checkpointer process: launched like the supervisor launches it (a launch.json,
// a control ROUTER to say Hello to), fed by two fake ranks, stopped with SIGTERM.

// The stage executable next to this test binary (both land in the build's bin/).
fs::path sibling_executable(const std::string& name) {
  return fs::read_symlink("/proc/self/exe").parent_path() / name;
}

// A run directory with a launch.json, a supervisor's control ROUTER, two fake ranks (a
// staging region and a DEALER each) and megacpp-checkpointer processes launched on it the
// way the supervisor launches them (stderr appended to the stage's log).
class CheckpointerHarness {
 public:
  explicit CheckpointerHarness(fs::path exe) : exe_(std::move(exe)) {
    control_ = "ipc://" + (sock_.path() / "control").string();
    ck_ = "ipc://" + (sock_.path() / "ck").string();
    test_support::write_test_launch(run_.path(), "run-proc", control_, ck_, 2, "hash-proc");
    supervisor_ = std::make_unique<ipc::Channel>(zmq_, ipc::Channel::Kind::kRouter, control_);
    fs::create_directories(layout::logs_dir(run_.path()));
    prefix_ = fmt::format("/megacpp-ckproc-{}-", ::getpid());
    for (uint32_t r = 0; r < 2; ++r) {
      regions_.push_back(std::make_unique<ipc::ShmRegion>(
          ipc::ShmRegion::Create{}, layout::staging_shm_name(prefix_, r), 1024));
      float v[2] = {1.5f * static_cast<float>(r + 1), -2.0f};
      std::memcpy(regions_[r]->data(), v, sizeof v);
      dealers_.push_back(
          std::make_unique<ipc::Channel>(zmq_, ipc::Channel::Kind::kDealer, ck_,
                                         layout::process_name(schema::StageKind::TRAINER, r)));
    }
  }
  ~CheckpointerHarness() {
    for (pid_t pid : live_) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    dealers_.clear();
    regions_.clear();
    EXPECT_TRUE(ipc::list_shm(prefix_).empty());
  }
  CheckpointerHarness(const CheckpointerHarness&) = delete;
  CheckpointerHarness& operator=(const CheckpointerHarness&) = delete;

  pid_t spawn(uint32_t generation) {
    const fs::path log = this->log();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    std::vector<std::string> args = {
        exe_.string(), "--run-dir",    run_.path().string(),      "--rank",
        "0",           "--generation", std::to_string(generation)};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    const int rc = ::posix_spawn(&pid, exe_.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    EXPECT_EQ(rc, 0);
    if (rc == 0) live_.push_back(pid);
    return pid;
  }
  // Waits (bounded) for `pid` to exit; SIGKILLs it after `limit`. Returns the wait status.
  int wait(pid_t pid, std::chrono::milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        ADD_FAILURE() << "child " << pid << " did not exit in time";
        break;
      }
      std::this_thread::sleep_for(20ms);
    }
    std::erase(live_, pid);
    return status;
  }

  void send(uint32_t r, uint32_t step) {
    ipc::ControlMessageBuilder b;
    auto ready = b.root().initSnapshotReady();
    ready.setRank(r);
    ready.setWorld(2);
    ready.setStep(step);
    ready.setRegion(regions_[r]->name());
    ready.setRegionBytes(regions_[r]->size());
    auto t = ready.initTensors(1)[0];
    t.setName(fmt::format("p{}", r));
    t.setDtype("F32");
    t.initShape(1).set(0, 2);
    t.setBytes(8);
    bool sent = false;
    for (int i = 0; i < 10 && !sent; ++i) sent = dealers_[r]->send(b.message());
    ASSERT_TRUE(sent);
  }
  struct Ack {
    uint32_t step = 0;
    bool ok = false, committed = false;
  };
  std::optional<Ack> receive(uint32_t r, std::chrono::milliseconds timeout) {
    auto msg = dealers_[r]->receive(timeout);
    if (!msg || !msg->root().isSnapshotAck()) return std::nullopt;
    auto a = msg->root().getSnapshotAck();
    return Ack{a.getStep(), a.getOk(), a.getCommitted()};
  }
  std::pair<bool, bool> ack(uint32_t r) {
    auto a = receive(r, 10000ms);
    EXPECT_TRUE(a) << read_file(log());
    return a ? std::make_pair(a->ok, a->committed) : std::make_pair(false, false);
  }
  // What a trainer rank does while it needs an ack: re-send SnapshotReady of `step` every
  // `interval` until an ack of that step with ok (and committed, if asked) arrives. Acks of
  // other steps are ignored. Bounded; returns the number of sends.
  int send_until(uint32_t r, uint32_t step, bool committed, std::chrono::milliseconds interval) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    int sends = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      send(r, step);
      ++sends;
      const auto resend_at = std::chrono::steady_clock::now() + interval;
      while (std::chrono::steady_clock::now() < resend_at) {
        auto a = receive(r, 20ms);
        if (a && a->step == step && a->ok && (a->committed || !committed)) return sends;
      }
    }
    ADD_FAILURE() << "rank " << r << " got no ack of step " << step << "\n" << read_file(log());
    return sends;
  }

  fs::path log() const { return layout::log_path(run_.path(), schema::StageKind::CHECKPOINTER, 0); }
  const fs::path& run() const { return run_.path(); }
  fs::path ckpts() const { return layout::checkpoints_dir(run_.path()); }
  std::vector<std::string> journal_kinds() const {
    std::vector<std::string> kinds;
    ipc::JournalReader::read_all(
        layout::journal_path(run_.path(), schema::StageKind::CHECKPOINTER, 0),
        [&](schema::JournalRecord::Reader rec) {
          if (rec.isProcessStarted()) kinds.push_back("started");
          if (rec.isCheckpointCommitted()) {
            kinds.push_back(rec.getCheckpointCommitted().getPath().cStr());
          }
          if (rec.isProcessFinished()) kinds.push_back("finished");
        });
    return kinds;
  }

 private:
  fs::path exe_;
  TempDir run_, sock_;
  std::string control_, ck_, prefix_;
  ipc::ZmqContext zmq_;
  std::unique_ptr<ipc::Channel> supervisor_;
  std::vector<std::unique_ptr<ipc::ShmRegion>> regions_;
  std::vector<std::unique_ptr<ipc::Channel>> dealers_;
  std::vector<pid_t> live_;
};

TEST(CheckpointerProcess, CommitsAndStopsCleanlyDiscardingAPartialStep) {
  const fs::path exe = sibling_executable("megacpp-checkpointer");
  if (!fs::exists(exe)) GTEST_SKIP() << exe << " is not built";
  CheckpointerHarness h(exe);
  const pid_t pid = h.spawn(0);
  h.send(0, 4);
  EXPECT_EQ(h.ack(0), std::make_pair(true, false));
  h.send(1, 4);
  EXPECT_EQ(h.ack(1), std::make_pair(true, false));
  EXPECT_EQ(h.ack(0), std::make_pair(true, true));
  EXPECT_EQ(h.ack(1), std::make_pair(true, true));
  h.send(0, 8);  // rank 1 never sends step 8
  EXPECT_EQ(h.ack(0), std::make_pair(true, false));

  ::kill(pid, SIGTERM);
  const int status = h.wait(pid, 20000ms);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << "\n"
                                                             << read_file(h.log());
  EXPECT_TRUE(verify_checkpoint(h.ckpts() / "step_00000004").ok);
  EXPECT_EQ(read_file(h.ckpts() / "LATEST"), "step_00000004\n");
  EXPECT_FALSE(fs::exists(h.ckpts() / "step_00000008.tmp"));
  EXPECT_FALSE(fs::exists(h.ckpts() / "step_00000008"));
  EXPECT_EQ(h.journal_kinds(),
            (std::vector<std::string>{"started", "checkpoints/step_00000004", "finished"}));
}

// A rank file past RLIMIT_FSIZE must fail its write with EFBIG (the out-of-space error), so the
// process ignores SIGXFSZ rather than dying of it.
TEST(CheckpointerProcess, IgnoresSigxfsz) {
  const fs::path exe = sibling_executable("megacpp-checkpointer");
  if (!fs::exists(exe)) GTEST_SKIP() << exe << " is not built";
  CheckpointerHarness h(exe);
  const pid_t pid = h.spawn(0);
  h.send_until(0, 2, false, 300ms);  // the process is up, past its main()
  ASSERT_EQ(::kill(pid, SIGXFSZ), 0);
  h.send_until(1, 2, true, 300ms);
  EXPECT_TRUE(verify_checkpoint(h.ckpts() / "step_00000002").ok);
  ::kill(pid, SIGTERM);
  const int status = h.wait(pid, 20000ms);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << "\n"
                                                             << read_file(h.log());
}

// DESIGN.md "Failure model as implemented" (restartable stages): the checkpointer dies -> it is
// relaunched on the same endpoint; the uncommitted checkpoint is discarded, committed ones stay,
// and the ranks' re-sent snapshots commit the step exactly once.
TEST(CheckpointerProcess, SigkilledWhileASnapshotIsPendingARelaunchCommitsTheResentStep) {
  const fs::path exe = sibling_executable("megacpp-checkpointer");
  if (!fs::exists(exe)) GTEST_SKIP() << exe << " is not built";
  CheckpointerHarness h(exe);
  const pid_t first = h.spawn(0);
  h.send_until(0, 2, false, 300ms);
  h.send_until(1, 2, true, 300ms);
  EXPECT_EQ(h.ack(0), std::make_pair(true, true));
  const std::string step2 = read_file(h.ckpts() / "step_00000002" / "rank_0.safetensors");

  // Rank 0's step 4 is written but uncommitted; rank 1's SnapshotReady reaches a process
  // that never handles it (stopped, then killed): it is lost with the process.
  h.send_until(0, 4, false, 300ms);
  ::kill(first, SIGSTOP);
  h.send(1, 4);
  std::this_thread::sleep_for(100ms);
  ::kill(first, SIGKILL);
  const int status = h.wait(first, 10000ms);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  EXPECT_TRUE(fs::exists(h.ckpts() / "step_00000004.tmp" / "rank_0.safetensors"));
  EXPECT_FALSE(fs::exists(h.ckpts() / "step_00000004"));

  const pid_t second = h.spawn(1);
  // Both ranks still need an ack of step 4 (rank 1 its lease, rank 0 the commit of what it
  // will treat as its final snapshot): they re-send until they get it.
  h.send_until(1, 4, false, 300ms);
  h.send_until(0, 4, true, 300ms);
  h.send_until(1, 4, true, 300ms);  // answered at once: the step is committed
  EXPECT_TRUE(verify_checkpoint(h.ckpts() / "step_00000004").ok);
  EXPECT_TRUE(verify_checkpoint(h.ckpts() / "step_00000002").ok);
  EXPECT_EQ(read_file(h.ckpts() / "step_00000002" / "rank_0.safetensors"), step2);
  EXPECT_EQ(read_file(h.ckpts() / "LATEST"), "step_00000004\n");
  EXPECT_FALSE(fs::exists(h.ckpts() / "step_00000004.tmp"));

  ::kill(second, SIGTERM);
  const int status2 = h.wait(second, 20000ms);
  EXPECT_TRUE(WIFEXITED(status2) && WEXITSTATUS(status2) == 0) << "status " << status2 << "\n"
                                                               << read_file(h.log());
  // One journal, two processes: each step committed exactly once.
  EXPECT_EQ(h.journal_kinds(),
            (std::vector<std::string>{"started", "checkpoints/step_00000002", "started",
                                      "checkpoints/step_00000004", "finished"}));
}

}  // namespace
}  // namespace megacpp::checkpoint
