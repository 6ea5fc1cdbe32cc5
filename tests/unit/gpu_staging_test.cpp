// The snapshot plane's device staging (gpu/staging.h) on a real device: a buffer exported by this
// process (the rank) is imported by gpu_staging_peer (the checkpointer's StagingImports) through
// the handle socket; the peer killed and started again imports it again; a rank whose
// connection closed is refused by name. Label gpu: without a CUDA driver and device every case
// skips with the reason. ctest gpu_staging_on_fake_driver runs the same binary on any machine
// against tests/unit/fake_cuda.cpp (MEGACPP_FAKE_CUDA=1), which also holds a copy or fails a
// call for the failure cases a real device cannot be made to show on demand.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "gpu/staging.h"
#include "ipc/handle_socket.h"
#include "ipc/staged_buffer.h"
#include "temp_dir.h"

extern char** environ;

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

fs::path sibling_executable(const std::string& name) {
  return fs::read_symlink("/proc/self/exe").parent_path() / name;
}

// gpu_staging_peer with a pipe to its stdin and one from its stdout.
class Peer {
 public:
  Peer(const fs::path& socket, uint64_t generation, uint64_t bytes, const fs::path& out) {
    int in[2], res[2];
    EXPECT_EQ(::pipe(in), 0);
    EXPECT_EQ(::pipe(res), 0);
    posix_spawn_file_actions_t a;
    posix_spawn_file_actions_init(&a);
    posix_spawn_file_actions_adddup2(&a, in[0], 0);
    posix_spawn_file_actions_adddup2(&a, res[1], 1);
    posix_spawn_file_actions_addclose(&a, in[1]);
    posix_spawn_file_actions_addclose(&a, res[0]);
    const std::string exe = sibling_executable("gpu_staging_peer").string();
    std::vector<std::string> args = {exe, socket.string(), std::to_string(generation),
                                     std::to_string(bytes), out.string()};
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    EXPECT_EQ(::posix_spawn(&pid_, exe.c_str(), &a, nullptr, argv.data(), environ), 0) << exe;
    posix_spawn_file_actions_destroy(&a);
    ::close(in[0]);
    ::close(res[1]);
    to_ = ::fdopen(in[1], "w");
    from_ = ::fdopen(res[0], "r");
    EXPECT_EQ(line(), "listening");
  }
  ~Peer() { stop(SIGKILL); }
  std::string read(int i) {
    ask(i);
    return line();
  }
  // read() in two halves, for acting while the peer waits.
  void ask(int i) {
    std::fprintf(to_, "read %d\n", i);
    std::fflush(to_);
  }
  std::string answer() { return line(); }
  int stop(int sig) {
    if (pid_ <= 0) return -1;
    if (sig != 0) ::kill(pid_, sig);
    if (to_ != nullptr) std::fclose(to_);
    to_ = nullptr;
    // Bounded: a peer hung releasing its import (a stream held by a dead rank's event) fails the
    // test instead of hanging it.
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + 15s;
    while (::waitpid(pid_, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() >= deadline) {
        ADD_FAILURE() << "gpu_staging_peer did not exit within 15 s of its end of input: hung";
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    pid_ = -1;
    if (from_ != nullptr) std::fclose(from_);
    from_ = nullptr;
    return status;
  }

 private:
  std::string line() {
    char buf[256] = {};
    if (std::fgets(buf, sizeof buf, from_) == nullptr) return "<eof>";
    std::string s(buf);
    if (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

std::vector<std::byte> pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937 gen(seed);
  for (auto& b : v) b = static_cast<std::byte>(gen());
  return v;
}

std::vector<std::byte> read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  std::memcpy(out.data(), c.data(), c.size());
  return out;
}

// A staging buffer of rank 0, described as a rank sends it, and its connection to a checkpointer.
struct Exported {
  explicit Exported(uint64_t bytes) : buffer(0, bytes) {
    info.rank = 0;
    info.generation = megacpp::ipc::new_staged_generation();
    info.kind = std::string(megacpp::ipc::kStagedCuda);
    info.bytes = buffer.bytes();
    info.mapping_bytes = buffer.mapping_bytes();
    info.device = buffer.pci_bus_id();
    info.event = buffer.event_handle();
  }
  std::unique_ptr<megacpp::ipc::HandleConnection> connect(const fs::path& socket) {
    auto conn = megacpp::ipc::HandleConnection::connect(socket, megacpp::ipc::Millis(10000));
    EXPECT_TRUE(conn != nullptr);
    const int fd = buffer.fd();
    EXPECT_TRUE(conn->send(megacpp::ipc::encode_staged_buffer(info), std::span<const int>(&fd, 1),
                           megacpp::ipc::Millis(2000)));
    return conn;
  }
  megacpp::gpu::ExportedBuffer buffer;
  megacpp::ipc::StagedBufferInfo info;
};

// What every peer of these tests must do at the end of its input: exit 0, not hang or fail.
void expect_clean_exit(Peer& peer) {
  const int status = peer.stop(0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST(GpuStaging, AnExportedBufferIsReadByTheCheckpointerAcrossItsRestart) {
  std::string why;
  if (!megacpp::gpu::driver_available(&why)) GTEST_SKIP() << "no GPU: " << why;
  megacpp::test_support::TempDir dir;
  const fs::path socket = dir.path() / "staging";
  // Two pieces at different offsets, the second unaligned in size.
  constexpr uint64_t kA = 3 << 20, kB = 1000003, kBytes = kA + 4096 + kB;
  megacpp::gpu::DeviceBlock src(0, kA + kB);
  Exported staged(kBytes);
  const auto* base = static_cast<const std::byte*>(src.pointer());
  const megacpp::gpu::CopyPiece pieces[] = {{0, base, kA}, {kA + 4096, base + kA, kB}};

  auto expect_staged = [&](const std::vector<std::byte>& want, int i) {
    const auto got = read_bytes(dir.path() / ("read-" + std::to_string(i) + ".bin"));
    ASSERT_EQ(got.size(), kBytes);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), kA), 0);
    EXPECT_EQ(std::memcmp(got.data() + kA + 4096, want.data() + kA, kB), 0);
  };

  const auto first = pattern(kA + kB, 1);
  src.upload(first);
  {
    Peer peer(socket, staged.info.generation, kBytes, dir.path());
    auto conn = staged.connect(socket);
    staged.buffer.copy_async(nullptr, pieces, 1);  // after the upload, on the legacy default stream
    EXPECT_EQ(peer.read(1), "status 1 ok");
    expect_staged(first, 1);
    // The checkpointer dies; its successor imports the buffer from the descriptor sent again.
    const int status = peer.stop(SIGKILL);
    EXPECT_TRUE(WIFSIGNALED(status)) << status;
  }
  const auto second = pattern(kA + kB, 2);
  src.upload(second);
  Peer peer(socket, staged.info.generation, kBytes, dir.path());
  auto conn = staged.connect(socket);
  staged.buffer.copy_async(nullptr, pieces, 2);
  EXPECT_EQ(peer.read(2), "status 2 ok");
  expect_staged(second, 2);
  // The buffer is sealed by step 2's copy: it is not step 4's, whatever its event says.
  EXPECT_EQ(peer.read(4), "status 4 not-copied");
  // The rank's connection closes (as at its death): its snapshot is refused by name.
  conn.reset();
  EXPECT_EQ(peer.read(3), "status 3 gone");
  expect_clean_exit(peer);
  staged.buffer.synchronize();
}

// Sets an environment variable for this scope (the fake driver reads it at each call, and a
// peer spawned meanwhile inherits it).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

// The fake driver's cases: one piece of `bytes` from a device block into an exported buffer.
struct OneShare {
  explicit OneShare(uint64_t bytes)
      : src(0, bytes), staged(bytes), piece{0, src.pointer(), bytes} {}
  megacpp::test_support::TempDir dir;
  fs::path socket = dir.path() / "staging";
  megacpp::gpu::DeviceBlock src;
  Exported staged;
  megacpp::gpu::CopyPiece piece;
  std::span<const megacpp::gpu::CopyPiece> pieces() const { return {&piece, 1}; }
};

bool on_fake_driver(std::string* why) {
  if (std::getenv("MEGACPP_FAKE_CUDA") == nullptr) {
    *why =
        "a real device cannot hold a copy or fail a call on demand: ctest "
        "gpu_staging_on_fake_driver runs this case against the fake driver";
    return false;
  }
  return megacpp::gpu::driver_available(why);
}

// A rank that dies while the checkpointer waits for its copy (the copy never ends): the wait is
// abandoned when the connection closes, the snapshot is refused by name, and the checkpointer
// neither fails nor hangs releasing the import.
TEST(GpuStaging, ARankThatDiesWithItsCopyQueuedLeavesTheCheckpointerUp) {
  std::string why;
  if (!on_fake_driver(&why)) GTEST_SKIP() << why;
  constexpr uint64_t kBytes = 1 << 20;
  OneShare s(kBytes);
  Peer peer(s.socket, s.staged.info.generation, kBytes, s.dir.path());
  auto conn = s.staged.connect(s.socket);
  {
    ScopedEnv hold("MEGACPP_FAKE_CUDA_HOLD", "1");
    s.staged.buffer.copy_async(nullptr, s.pieces(), 1);
  }
  peer.ask(1);
  std::this_thread::sleep_for(300ms);  // the peer polls the rank's event meanwhile
  conn.reset();
  EXPECT_EQ(peer.answer(), "status 1 gone");
  expect_clean_exit(peer);
}

// A copy out of the buffer that the driver refuses after the import (page-locked memory not
// given): the rank's snapshots are refused with the driver's reason, and the checkpointer stays.
TEST(GpuStaging, ADriverErrorAfterTheImportIsARefusalNotACrash) {
  std::string why;
  if (!on_fake_driver(&why)) GTEST_SKIP() << why;
  constexpr uint64_t kBytes = 1 << 20;
  OneShare s(kBytes);
  std::unique_ptr<Peer> peer;
  {
    ScopedEnv fail("MEGACPP_FAKE_CUDA_FAIL", "cuMemHostAlloc");
    peer = std::make_unique<Peer>(s.socket, s.staged.info.generation, kBytes, s.dir.path());
  }
  auto conn = s.staged.connect(s.socket);
  s.staged.buffer.copy_async(nullptr, s.pieces(), 1);
  EXPECT_EQ(peer->read(1), "status 1 refused");
  EXPECT_EQ(peer->read(2), "status 2 refused");
  expect_clean_exit(*peer);
}

// A copy that never ran while its event reports it done (a context torn down with the copy
// queued): the seal it never wrote keeps the buffer from being taken for that step's snapshot;
// the next copy that runs is read.
TEST(GpuStaging, ACopyThatNeverRanIsNotTakenForOne) {
  std::string why;
  if (!on_fake_driver(&why)) GTEST_SKIP() << why;
  constexpr uint64_t kBytes = 4096 + 3;
  OneShare s(kBytes);
  Peer peer(s.socket, s.staged.info.generation, kBytes, s.dir.path());
  auto conn = s.staged.connect(s.socket);
  {
    ScopedEnv drop("MEGACPP_FAKE_CUDA_DROP", "1");
    s.staged.buffer.copy_async(nullptr, s.pieces(), 1);
  }
  EXPECT_EQ(peer.read(1), "status 1 not-copied");
  const auto bytes = pattern(kBytes, 3);
  s.src.upload(bytes);
  s.staged.buffer.copy_async(nullptr, s.pieces(), 2);
  EXPECT_EQ(peer.read(2), "status 2 ok");
  EXPECT_EQ(read_bytes(s.dir.path() / "read-2.bin"), bytes);
  expect_clean_exit(peer);
}

TEST(GpuStaging, WithoutADriverTheReasonIsOneLine) {
  std::string why;
  if (megacpp::gpu::driver_available(&why)) GTEST_SKIP() << "a driver is present";
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  if (megacpp::gpu::built()) {
    try {
      megacpp::gpu::ExportedBuffer buffer(0, 4096);
      ADD_FAILURE() << "a staging buffer without a driver";
    } catch (const megacpp::Error& e) {
      EXPECT_EQ(e.kind(), megacpp::ErrorKind::kSystem);
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
}

}  // namespace
