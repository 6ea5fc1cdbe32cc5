// ipc/handle_socket.h: descriptors passed over a Unix socket to a forked fake checkpointer.
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
#include "ipc/handle_socket.h"
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
// Handle socket: a device staging buffer passed once by descriptor, on a fake device

// The fake device: a memfd is the rank's staging buffer as the CUDA virtual-memory API exports
// it (a POSIX file descriptor), an eventfd the IPC event the rank records after its
// device-to-device copy into it. The checkpointer (a forked child) imports both once per
// connection, waits for the event, copies the buffer out itself and acks the step with the
// copy's checksum. Killed and started again, it re-imports from the rank's re-sent handles.
constexpr size_t kStagingBytes = 1 << 20;

void fill_staging(std::byte* staging, uint32_t step) {
  for (size_t i = 0; i < kStagingBytes; ++i)
    staging[i] = static_cast<std::byte>((i * 131 + step * 7) & 0xff);
}

// The checkpointer's side; returns the child's exit status. Acks "step=<n> sum=<xxh3>" per event.
int fake_checkpointer(const fs::path& socket) {
  try {
    HandleListener listener(socket);
    auto conn = listener.accept(Millis(10'000));
    if (!conn) return 3;
    auto handles = conn->receive(Millis(10'000));
    if (!handles || handles->count() != 2 || handles->payload() != "rank=0 bytes=1048576") return 4;
    const int memory = handles->fd(0), event = handles->fd(1);
    void* mapped = ::mmap(nullptr, kStagingBytes, PROT_READ, MAP_SHARED, memory, 0);
    if (mapped == MAP_FAILED) return 5;
    std::vector<std::byte> host(kStagingBytes);
    for (;;) {
      pollfd p[2] = {{event, POLLIN, 0}, {conn->fd(), POLLIN, 0}};
      if (::poll(p, 2, 10'000) <= 0) return 6;
      if ((p[1].revents & (POLLIN | POLLHUP)) != 0 && (p[0].revents & POLLIN) == 0) return 0;
      uint64_t step = 0;
      if (::read(event, &step, sizeof step) != sizeof step) return 7;
      std::memcpy(host.data(), mapped, kStagingBytes);
      const std::string ack =
          fmt::format("step={} sum={}", step, XXH3_64bits(host.data(), host.size()));
      if (!conn->send(ack, {}, Millis(10'000))) return 8;
    }
  } catch (const std::exception& e) {
    fprintf(stderr, "fake checkpointer: %s\n", e.what());
    return 2;
  }
}

pid_t start_fake_checkpointer(const fs::path& socket) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(fake_checkpointer(socket));
  return pid;
}

TEST(HandleSocketTest, StagingBufferSurvivesACheckpointerRestart) {
  TempDir dir;
  const fs::path socket = dir.path() / "staging.sock";
  const int memory = ::memfd_create("megacpp-fake-staging", MFD_CLOEXEC);
  ASSERT_GE(memory, 0);
  ASSERT_EQ(::ftruncate(memory, kStagingBytes), 0);
  auto* staging = static_cast<std::byte*>(
      ::mmap(nullptr, kStagingBytes, PROT_READ | PROT_WRITE, MAP_SHARED, memory, 0));
  ASSERT_NE(staging, MAP_FAILED);
  const int event = ::eventfd(0, EFD_CLOEXEC);
  ASSERT_GE(event, 0);
  const int exported[] = {memory, event};

  // One checkpoint: the "device-to-device copy" into staging, the event, the ack.
  auto checkpoint = [&](HandleConnection& conn, uint32_t step) {
    fill_staging(staging, step);
    const uint64_t one = step;
    EXPECT_EQ(::write(event, &one, sizeof one), static_cast<ssize_t>(sizeof one));
    auto ack = conn.receive(Millis(10'000));
    if (!ack) return std::string("no ack");
    EXPECT_EQ(ack->count(), 0u);
    return ack->payload();
  };
  std::vector<std::byte> expected(kStagingBytes);
  auto expected_ack = [&](uint32_t step) {
    fill_staging(expected.data(), step);
    return fmt::format("step={} sum={}", step, XXH3_64bits(expected.data(), expected.size()));
  };

  pid_t first = start_fake_checkpointer(socket);
  auto conn = HandleConnection::connect(socket, Millis(10'000));
  ASSERT_NE(conn, nullptr);
  ASSERT_TRUE(conn->send("rank=0 bytes=1048576", exported, Millis(1000)));
  EXPECT_EQ(checkpoint(*conn, 1), expected_ack(1));
  EXPECT_EQ(checkpoint(*conn, 2), expected_ack(2));

  // The checkpointer dies; the rank sees its end go and re-sends the same handles to the next.
  ::kill(first, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(first, &status, 0), first);
  EXPECT_FALSE(conn->receive(Millis(5000)));
  EXPECT_TRUE(conn->peer_gone());
  EXPECT_FALSE(conn->send("late", {}, Millis(100)));
  const pid_t second = start_fake_checkpointer(socket);
  conn = HandleConnection::connect(socket, Millis(10'000));
  ASSERT_NE(conn, nullptr);
  ASSERT_TRUE(conn->send("rank=0 bytes=1048576", exported, Millis(1000)));
  EXPECT_EQ(checkpoint(*conn, 3), expected_ack(3));
  conn.reset();  // the rank's end closes: the checkpointer exits 0
  ASSERT_EQ(::waitpid(second, &status, 0), second);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;

  ::munmap(staging, kStagingBytes);
  ::close(memory);
  ::close(event);
}

TEST(HandleSocketTest, LimitsAndAbsentListener) {
  TempDir dir;
  EXPECT_EQ(HandleConnection::connect(dir.path() / "nobody.sock", Millis(30)), nullptr);
  HandleListener listener(dir.path() / "l.sock");
  EXPECT_EQ(listener.accept(Millis(10)), nullptr);
  auto client = HandleConnection::connect(listener.path(), Millis(1000));
  ASSERT_NE(client, nullptr);
  auto server = listener.accept(Millis(1000));
  ASSERT_NE(server, nullptr);
  EXPECT_THROW(client->send(std::string(kMaxHandlePayload + 1, 'x'), {}, Millis(10)), Error);
  // An empty payload with no descriptors is still a message, not the peer's end.
  ASSERT_TRUE(client->send("", {}, Millis(100)));
  auto empty = server->receive(Millis(1000));
  ASSERT_TRUE(empty);
  EXPECT_EQ(empty->payload(), "");
  EXPECT_FALSE(server->peer_gone());
  EXPECT_FALSE(server->receive(Millis(10)));
  EXPECT_FALSE(server->peer_gone());
}

// A checkpointer killed before it read a rank's buffer closes with that message unread; the
// kernel then reports a reset, not an end, to the rank's next receive: the rank must see its
// peer gone (and reconnect), not fail on the error.
TEST(HandleSocketTest, APeerThatClosedWithOurMessageUnreadIsGone) {
  TempDir dir;
  HandleListener listener(dir.path() / "l.sock");
  auto rank = HandleConnection::connect(listener.path(), Millis(1000));
  ASSERT_NE(rank, nullptr);
  auto checkpointer = listener.accept(Millis(1000));
  ASSERT_NE(checkpointer, nullptr);
  ASSERT_TRUE(rank->send("buffer", {}, Millis(100)));
  checkpointer.reset();  // closed with "buffer" in its queue
  EXPECT_FALSE(rank->receive(Millis(1000)));
  EXPECT_TRUE(rank->peer_gone());
  EXPECT_FALSE(rank->send("again", {}, Millis(100)));
}

}  // namespace
}  // namespace megacpp::ipc
