// megacpp::ipc against the real thing: POSIX shm shared with a forked process, ZeroMQ over
// ipc:// and tcp://, journals on disk. Timings are never asserted; every wait is bounded.
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
#include "ipc/channel.h"
#include "ipc/control_client.h"
#include "ipc/detail/zmq.h"
#include "ipc/handle_socket.h"
#include "ipc/journal.h"
#include "ipc/peer_exchange.h"
#include "ipc/shm.h"
#include "ipc/slot_ring.h"
#include "tests/unit/test_support.h"

namespace megacpp::ipc {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

using megacpp::test_support::TempDir;

// A forked child that is killed and reaped if the test leaves early.
class Child {
 public:
  explicit Child(pid_t pid) : pid_(pid) {}
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  // Exit status of the child (-1 if it did not exit normally).
  int wait() {
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  bool exited() {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      return true;
    }
    return pid_ == -1;
  }
  int exit_code() const { return exit_code_; }

 private:
  pid_t pid_;
  int exit_code_ = -1;
};

// Every test's shm names start with a prefix unique to this process and test; TearDown
// removes whatever a failing test left behind.
class ShmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    prefix_ = fmt::format("/megacpp-test-{}-{}-", ::getpid(), counter++);
  }
  void TearDown() override {
    unlink_shm(prefix_);
    EXPECT_TRUE(list_shm(prefix_).empty());
  }
  std::string prefix_;
};

// ---------------------------------------------------------------------------------------
// Shared memory

TEST_F(ShmTest, CreateAttachAndUnlinkOnOwnerExit) {
  const std::string name = prefix_ + "a";
  {
    ShmRegion created(ShmRegion::Create{}, name, 8192);
    EXPECT_TRUE(created.owner());
    EXPECT_EQ(created.size(), 8192u);
    EXPECT_EQ(created.name(), name);
    for (size_t i = 0; i < created.size(); ++i) ASSERT_EQ(created.data()[i], std::byte{0});
    std::memcpy(created.data(), "hello", 5);

    ShmRegion attached(ShmRegion::Attach{}, name);
    EXPECT_FALSE(attached.owner());
    EXPECT_EQ(attached.size(), 8192u);
    EXPECT_EQ(std::memcmp(attached.data(), "hello", 5), 0);
    attached.data()[100] = std::byte{42};
    EXPECT_EQ(created.data()[100], std::byte{42});
    EXPECT_EQ(list_shm(prefix_), std::vector<std::string>{name});
  }
  EXPECT_TRUE(list_shm(prefix_).empty());
  try {
    ShmRegion gone(ShmRegion::Attach{}, name);
    FAIL() << "attached a removed segment";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kSystem);
  }
}

TEST_F(ShmTest, StaleSegmentIsReplaced) {
  const std::string name = prefix_ + "stale";
  ShmRegion first(ShmRegion::Create{}, name, 4096);
  std::memset(first.data(), 0xab, first.size());
  ShmRegion second(ShmRegion::Create{}, name, 8192);
  EXPECT_EQ(second.size(), 8192u);
  EXPECT_EQ(second.data()[0], std::byte{0});
  ShmRegion attached(ShmRegion::Attach{}, name);
  EXPECT_EQ(attached.size(), 8192u);
}

TEST_F(ShmTest, InvalidNamesAreRejected) {
  EXPECT_THROW(ShmRegion(ShmRegion::Create{}, "no-slash", 64), Error);
  EXPECT_THROW(ShmRegion(ShmRegion::Create{}, prefix_ + "a/b", 64), Error);
  EXPECT_THROW(ShmRegion(ShmRegion::Create{}, prefix_ + "empty", 0), Error);
}

TEST_F(ShmTest, ListAndUnlinkByPrefix) {
  auto a = std::make_unique<ShmRegion>(ShmRegion::Create{}, prefix_ + "ring-0", 4096);
  auto b = std::make_unique<ShmRegion>(ShmRegion::Create{}, prefix_ + "ring-1", 4096);
  auto c = std::make_unique<ShmRegion>(ShmRegion::Create{}, prefix_ + "stage-0", 4096);
  EXPECT_EQ(list_shm(prefix_), (std::vector<std::string>{prefix_ + "ring-0", prefix_ + "ring-1",
                                                         prefix_ + "stage-0"}));
  EXPECT_EQ(list_shm(prefix_ + "ring-").size(), 2u);
  EXPECT_EQ(unlink_shm(prefix_ + "ring-"), 2u);
  EXPECT_EQ(list_shm(prefix_), std::vector<std::string>{prefix_ + "stage-0"});
  // Mappings outlive the name; the owners' later unlink of a removed name is harmless.
  std::memset(a->data(), 1, a->size());
  a.reset();
  b.reset();
  EXPECT_EQ(unlink_shm(prefix_), 1u);
  c.reset();
  EXPECT_TRUE(list_shm(prefix_).empty());
  EXPECT_EQ(unlink_shm(prefix_), 0u);
}

// ---------------------------------------------------------------------------------------
// Slot ring

using RingTest = ShmTest;

TEST_F(RingTest, FormatValidatesGeometry) {
  EXPECT_GE(SlotRing::region_bytes(4, 100), 256u + 4 * 128);
  EXPECT_THROW(SlotRing::region_bytes(0, 100), Error);
  // Sizes are 64-bit: a slot one byte over the 32-bit limit is refused, not truncated to 1.
  EXPECT_THROW(SlotRing::region_bytes(4, SlotRing::kMaxSlotBytes + 2), Error);
  EXPECT_GT(SlotRing::region_bytes(2, SlotRing::kMaxSlotBytes), 2 * SlotRing::kMaxSlotBytes);
  ShmRegion small(ShmRegion::Create{}, prefix_ + "small", 512);
  EXPECT_THROW(SlotRing::format(small, 16, 1024), Error);
  try {
    SlotRing unformatted(small);
    FAIL() << "accepted an unformatted region";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kCorruption);
  }

  ShmRegion region(ShmRegion::Create{}, prefix_ + "ring", SlotRing::region_bytes(4, 100));
  SlotRing::format(region, 4, 100);
  SlotRing ring(region);
  EXPECT_EQ(ring.slots(), 4u);
  EXPECT_EQ(ring.slot_bytes(), 100u);
  EXPECT_EQ(ring.depth(), 0u);
  // Corrupting the geometry is detected by the next attacher.
  reinterpret_cast<uint32_t*>(region.data())[3] = 7;  // slots
  EXPECT_THROW(SlotRing again(region), Error);
}

TEST_F(RingTest, FullAndEmptyAreReturnValues) {
  ShmRegion region(ShmRegion::Create{}, prefix_ + "ring", SlotRing::region_bytes(4, 100));
  SlotRing::format(region, 4, 100);
  SlotRing ring(region);

  EXPECT_FALSE(ring.try_peek().has_value());
  EXPECT_FALSE(ring.peek(Millis(20)).has_value());
  EXPECT_THROW(ring.release(), Error);

  for (uint32_t i = 0; i < 4; ++i) {
    auto slot = ring.try_acquire();
    ASSERT_TRUE(slot.has_value());
    EXPECT_EQ(slot->size(), 100u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(slot->data()) % 64, 0u) << "payload not 64-byte aligned";
    (*slot)[0] = std::byte(i);
    ring.publish(1, 100 + i);
  }
  EXPECT_EQ(ring.depth(), 4u);
  EXPECT_FALSE(ring.try_acquire().has_value());
  EXPECT_FALSE(ring.acquire(Millis(20)).has_value());
  EXPECT_THROW(ring.publish(1, 0), Error);

  auto head = ring.try_peek();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->seq, 0u);
  EXPECT_EQ(head->tag, 100u);
  EXPECT_EQ(head->data.size(), 1u);
  ring.release();
  ASSERT_TRUE(ring.try_acquire().has_value());
  EXPECT_THROW(ring.publish(101, 0), Error);  // larger than a slot
  ring.publish(100, 7);
  EXPECT_EQ(ring.produced(), 5u);
  EXPECT_EQ(ring.consumed(), 1u);
}

TEST_F(RingTest, ProducerInChildProcessConsumerInParent) {
  constexpr uint32_t kSlots = 8;
  constexpr uint32_t kSlotBytes = 200;
  constexpr uint64_t kItems = 20000;  // wraps the ring 2500 times
  const std::string name = prefix_ + "ring-0";
  ShmRegion region(ShmRegion::Create{}, name, SlotRing::region_bytes(kSlots, kSlotBytes));
  SlotRing::format(region, kSlots, kSlotBytes);

  auto bytes_for = [](uint64_t i) { return static_cast<uint32_t>(8 + i % (kSlotBytes - 7)); };
  auto byte_at = [](uint64_t i, uint32_t k) { return std::byte((i * 31 + k) & 0xff); };

  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 0;
    try {
      ShmRegion attached(ShmRegion::Attach{}, name);
      SlotRing ring(attached);
      for (uint64_t i = 0; i < kItems && code == 0; ++i) {
        auto slot = ring.acquire(Millis(10000));
        if (!slot) {
          code = 2;
          break;
        }
        uint32_t bytes = bytes_for(i);
        std::memcpy(slot->data(), &i, sizeof i);
        for (uint32_t k = 8; k < bytes; ++k) (*slot)[k] = byte_at(i, k);
        ring.publish(bytes, i * 3 + 1);
      }
    } catch (...) {
      code = 3;
    }
    ::_exit(code);
  }
  Child child(pid);

  SlotRing ring(region);
  for (uint64_t i = 0; i < kItems; ++i) {
    auto slot = ring.peek(Millis(10000));
    ASSERT_TRUE(slot.has_value()) << "producer stalled at item " << i;
    ASSERT_EQ(slot->seq, i);
    ASSERT_EQ(slot->tag, i * 3 + 1);
    ASSERT_EQ(slot->data.size(), bytes_for(i));
    uint64_t seq;
    std::memcpy(&seq, slot->data.data(), sizeof seq);
    ASSERT_EQ(seq, i);
    bool same = true;
    for (uint32_t k = 8; k < slot->data.size(); ++k) same = same && slot->data[k] == byte_at(i, k);
    ASSERT_TRUE(same) << "payload of item " << i << " differs";
    ring.release();
  }
  EXPECT_EQ(child.wait(), 0);
  EXPECT_EQ(ring.produced(), kItems);
  EXPECT_EQ(ring.consumed(), kItems);
  EXPECT_FALSE(ring.peek(Millis(10)).has_value());
}

// ---------------------------------------------------------------------------------------
// Peer exchange

// Forks `world` ranks; rank r makes its outbox, swaps tokens with the others through files in
// `dir`, attaches every peer's, unlinks its name once all attached, and returns body(x, r)
// (2 on an exception). Returns each rank's exit code (-1: it did not exit normally).
std::vector<int> run_exchange_ranks(uint32_t world, const std::string& prefix, const fs::path& dir,
                                    size_t slot_bytes,
                                    const std::function<int(PeerExchange&, uint32_t)>& body) {
  auto wait_file = [](const fs::path& p) {
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (!fs::exists(p)) {
      if (Clock::now() > deadline) throw std::runtime_error("no " + p.string());
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  auto publish = [](const fs::path& p, const std::string& text) {
    std::ofstream(p.string() + ".tmp") << text;
    fs::rename(p.string() + ".tmp", p);
  };
  std::vector<std::unique_ptr<Child>> children;
  for (uint32_t r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int code = 2;
      try {
        PeerExchange x(
            {.name_prefix = prefix, .rank = r, .world = world, .slot_bytes = slot_bytes});
        publish(dir / fmt::format("token-{}", r), x.token());
        for (uint32_t q = 0; q < world; ++q) {
          if (q == r) continue;
          wait_file(dir / fmt::format("token-{}", q));
          std::ifstream in(dir / fmt::format("token-{}", q));
          std::string token;
          std::getline(in, token);
          x.attach(q, token);
        }
        publish(dir / fmt::format("attached-{}", r), "1");
        for (uint32_t q = 0; q < world; ++q) wait_file(dir / fmt::format("attached-{}", q));
        x.unlink();
        code = body(x, r);
      } catch (const std::exception& e) {
        fprintf(stderr, "rank %u: %s\n", r, e.what());
      }
      ::_exit(code);
    }
    children.push_back(std::make_unique<Child>(pid));
  }
  std::vector<int> codes;
  for (auto& c : children) codes.push_back(c->wait());
  return codes;
}

uint8_t pattern(uint32_t from, uint32_t to, int round, size_t k) {
  return static_cast<uint8_t>(from * 31 + to * 7 + static_cast<uint32_t>(round) * 13 + k);
}

// Kind of the Error `f` throws and how long it took; kInternal when it threw nothing.
std::pair<ErrorKind, double> failure_of(const std::function<void()>& f, std::string* what) {
  const auto t0 = Clock::now();
  try {
    f();
  } catch (const Error& e) {
    *what = e.what();
    return {e.kind(), std::chrono::duration<double>(Clock::now() - t0).count()};
  }
  return {ErrorKind::kInternal, std::chrono::duration<double>(Clock::now() - t0).count()};
}

class PeerExchangeTest : public ShmTest {
 protected:
  TempDir dir_;
};

// Three ranks, slots of 4 KiB: messages of no bytes, of less than, exactly and just over a
// slot, and of many slots (streamed through the two slots) arrive intact, round after round.
TEST_F(PeerExchangeTest, MessagesOfEverySizeArriveIntact) {
  constexpr uint32_t kWorld = 3;
  const std::vector<size_t> sizes{0, 1, 4095, 4096, 4097, 3 * 4096 + 17, 200'000};
  const auto codes =
      run_exchange_ranks(kWorld, prefix_, dir_.path(), 4096, [&](PeerExchange& x, uint32_t r) {
        for (int round = 0; round < 2 * static_cast<int>(sizes.size()); ++round) {
          const size_t n = sizes[static_cast<size_t>(round) % sizes.size()];
          std::vector<std::vector<std::byte>> out(kWorld), in(kWorld);
          std::vector<PeerExchange::Transfer> transfers;
          for (uint32_t q = 0; q < kWorld; ++q) {
            if (q == r) continue;
            out[q].resize(n);
            in[q].assign(n, std::byte{0});
            for (size_t k = 0; k < n; ++k) out[q][k] = std::byte{pattern(r, q, round, k)};
            transfers.push_back({q, out[q], in[q]});
          }
          x.exchange("test", transfers, std::chrono::seconds(20));
          for (uint32_t q = 0; q < kWorld; ++q) {
            if (q == r) continue;
            for (size_t k = 0; k < n; ++k)
              if (in[q][k] != std::byte{pattern(q, r, round, k)}) return 10 + round;
          }
        }
        return 0;
      });
  for (uint32_t r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  EXPECT_TRUE(list_shm(prefix_).empty()) << "every name is unlinked once all attached";
}

// A peer that exits instead of exchanging is named within a nap or two, not at the deadline;
// a peer that is alive but silent is a timeout at the deadline; abort() ends a wait, and
// every later exchange fails at once.
TEST_F(PeerExchangeTest, ExitTimeoutAndAbortEndTheWait) {
  for (const std::string mode : {"exit", "timeout", "abort"}) {
    fs::remove_all(dir_.path());
    fs::create_directories(dir_.path());
    const auto codes =
        run_exchange_ranks(2, prefix_, dir_.path(), 0, [&](PeerExchange& x, uint32_t r) {
          if (r == 1) {
            if (mode != "exit") std::this_thread::sleep_for(std::chrono::milliseconds(1500));
            return 0;
          }
          std::vector<std::byte> out(64), in(64);
          const PeerExchange::Transfer t{1, out, in};
          std::thread aborter;
          if (mode == "abort") {
            aborter = std::thread([&x] {
              std::this_thread::sleep_for(std::chrono::milliseconds(200));
              x.abort();
            });
          }
          const auto timeout = mode == "timeout" ? std::chrono::milliseconds(300)
                                                 : std::chrono::milliseconds(20'000);
          std::string what;
          const auto [kind, took] = failure_of(
              [&] {
                x.exchange("step 1", {&t, 1}, timeout);
              },
              &what);
          if (aborter.joinable()) aborter.join();
          fprintf(stderr, "%s: %s (%.3f s)\n", mode.c_str(), what.c_str(), took);
          if (mode == "exit" && !(kind == ErrorKind::kPeerFailure && took < 1.2 &&
                                  what.find("rank 1") != std::string::npos))
            return 10;
          if (mode == "timeout" && !(kind == ErrorKind::kTimeout && took >= 0.29 && took < 1.2))
            return 11;
          if (mode == "abort") {
            if (!(kind == ErrorKind::kPeerFailure && took < 1.2 &&
                  what.find("aborted") != std::string::npos))
              return 12;
            const auto [again, took2] = failure_of(
                [&] {
                  x.exchange("step 2", {&t, 1}, timeout);
                },
                &what);
            if (again != ErrorKind::kPeerFailure || took2 > 0.5) return 13;
          }
          return 0;
        });
    EXPECT_EQ(codes[0], 0) << mode;
    EXPECT_EQ(codes[1], 0) << mode;
  }
}

// The two ranks disagree on a message's size: each receiver says so instead of reading a
// message of another exchange as its own.
TEST_F(PeerExchangeTest, SizesThatDisagreeAreAProtocolError) {
  const auto codes =
      run_exchange_ranks(2, prefix_, dir_.path(), 4096, [&](PeerExchange& x, uint32_t r) {
        std::vector<std::byte> out(r == 0 ? 100 : 200), in(r == 0 ? 100 : 200);
        const PeerExchange::Transfer t{1 - r, out, in};
        std::string what;
        const auto [kind, took] = failure_of(
            [&] {
              x.exchange("mismatch", {&t, 1}, std::chrono::seconds(5));
            },
            &what);
        return kind == ErrorKind::kProtocol ? 0 : 10;
      });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

// Only the outbox a token names is attached: another segment under that name (a stale run's,
// another group's) is refused, and so is a name with nothing behind it.
TEST_F(PeerExchangeTest, AttachRefusesAnotherOutbox) {
  PeerExchange a({.name_prefix = prefix_ + "a", .rank = 0, .world = 2, .slot_bytes = 4096});
  PeerExchange b({.name_prefix = prefix_ + "b", .rank = 1, .world = 2, .slot_bytes = 4096});
  PeerExchange c({.name_prefix = prefix_ + "c", .rank = 0, .world = 2, .slot_bytes = 4096});
  const std::string token = b.token();
  const std::string name = token.substr(0, token.find(' '));
  auto kind_of = [&](PeerExchange& x, uint32_t rank, const std::string& t) {
    try {
      x.attach(rank, t);
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::kInternal;
  };
  EXPECT_EQ(kind_of(a, 1, name + " 0123456789abcdef"), ErrorKind::kCorruption) << "nonce";
  EXPECT_EQ(kind_of(a, 1, c.token()), ErrorKind::kCorruption) << "rank 0's outbox as rank 1's";
  EXPECT_EQ(kind_of(a, 1, prefix_ + "none1 0123456789abcdef"), ErrorKind::kSystem);
  EXPECT_EQ(kind_of(a, 1, "no-token"), ErrorKind::kProtocol);
  EXPECT_EQ(kind_of(a, 1, token), ErrorKind::kInternal) << "the right token attaches";
  b.unlink();
  EXPECT_EQ(list_shm(prefix_ + "b"), std::vector<std::string>{});
}

// ---------------------------------------------------------------------------------------
// Control channel

// A raw libzmq socket, for sending what Channel never would.
class RawDealer {
 public:
  RawDealer(ZmqContext& ctx, const std::string& endpoint, const std::string& identity)
      : socket_(zmq_socket(detail::ZmqAccess::context(ctx), ZMQ_DEALER)) {
    int zero = 0;
    zmq_setsockopt(socket_, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(socket_, ZMQ_ROUTING_ID, identity.data(), identity.size());
    if (zmq_connect(socket_, endpoint.c_str()) != 0) throw std::runtime_error("connect");
  }
  ~RawDealer() { zmq_close(socket_); }
  RawDealer(const RawDealer&) = delete;
  RawDealer& operator=(const RawDealer&) = delete;
  void send(const void* data, size_t size, bool more = false) {
    ASSERT_EQ(zmq_send(socket_, data, size, more ? ZMQ_SNDMORE : 0), static_cast<int>(size));
  }
  void send(const kj::Array<capnp::word>& words, bool more = false) {
    auto bytes = words.asBytes();
    send(bytes.begin(), bytes.size(), more);
  }

 private:
  void* socket_;
};

void fill_hello(ControlMessageBuilder& m, uint32_t rank) {
  auto h = m.root().initHello();
  h.setStage(schema::StageKind::TRAINER);
  h.setRank(rank);
  h.setPid(::getpid());
  h.setGeneration(2);
}

void round_trip(const std::string& endpoint) {
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);
  Channel dealer(ctx, Channel::Kind::kDealer, router.endpoint(), "trainer-1");

  ControlMessageBuilder h;
  fill_hello(h, 1);
  ASSERT_TRUE(dealer.send(h.message()));
  auto got = router.receive(Millis(10000));
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->peer(), "trainer-1");
  auto root = got->root();
  EXPECT_EQ(root.getSchemaVersion(), schema::SCHEMA_VERSION);
  ASSERT_TRUE(root.isHello());
  EXPECT_EQ(root.getHello().getStage(), schema::StageKind::TRAINER);
  EXPECT_EQ(root.getHello().getRank(), 1u);
  EXPECT_EQ(root.getHello().getPid(), ::getpid());
  EXPECT_EQ(root.getHello().getGeneration(), 2u);

  ControlMessageBuilder stop;
  stop.root().initStop().setReason("done");
  ASSERT_TRUE(router.send_to(got->peer(), stop.message()));
  auto reply = dealer.receive(Millis(10000));
  ASSERT_NE(reply, nullptr);
  ASSERT_TRUE(reply->root().isStop());
  EXPECT_EQ(std::string(reply->root().getStop().getReason().cStr()), "done");

  // An unknown identity is refused rather than silently dropped.
  EXPECT_FALSE(router.send_to("trainer-9", stop.message(), Millis(50)));
  EXPECT_EQ(router.receive(Millis(20)), nullptr);
  EXPECT_EQ(dealer.receive(Millis(20)), nullptr);
  EXPECT_EQ(router.malformed(), 0u);
  EXPECT_EQ(dealer.malformed(), 0u);
}

TEST(ChannelTest, RoundTripOverIpc) {
  TempDir dir;
  const fs::path sock = dir.path() / "control";
  round_trip("ipc://" + sock.string());
  EXPECT_FALSE(fs::exists(sock)) << "the ROUTER left its socket file behind";
}

TEST(ChannelTest, RoundTripOverTcp) {
  round_trip("tcp://127.0.0.1:*");
}

// A Poller numbers its sources in the order they were added and reports each one readable
// only while it has input; a wait with nothing to read ends at its timeout with 0.
TEST(PollerTest, ChannelAndDescriptorTogether) {
  TempDir dir;
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, "ipc://" + (dir.path() / "control").string());
  Channel dealer(ctx, Channel::Kind::kDealer, router.endpoint(), "trainer-0");
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);

  Poller poller;
  const size_t channel = poller.add(router);
  const size_t pipe = poller.add(fds[0]);
  EXPECT_EQ(channel, 0u);
  EXPECT_EQ(pipe, 1u);
  EXPECT_EQ(poller.wait(Millis(20)), 0u);
  EXPECT_FALSE(poller.readable(channel));
  EXPECT_FALSE(poller.readable(pipe));
  EXPECT_THROW(poller.readable(2), Error);

  ASSERT_EQ(::write(fds[1], "x", 1), 1);
  EXPECT_EQ(poller.wait(Millis(10000)), 1u);
  EXPECT_FALSE(poller.readable(channel));
  EXPECT_TRUE(poller.readable(pipe));
  char byte;
  ASSERT_EQ(::read(fds[0], &byte, 1), 1);

  ControlMessageBuilder h;
  fill_hello(h, 0);
  ASSERT_TRUE(dealer.send(h.message()));
  EXPECT_EQ(poller.wait(Millis(10000)), 1u);
  EXPECT_TRUE(poller.readable(channel));
  EXPECT_FALSE(poller.readable(pipe));
  auto got = router.receive(Millis(0));
  ASSERT_NE(got, nullptr);
  EXPECT_TRUE(got->root().isHello());
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(ChannelTest, MalformedFramesAreCountedAndSkipped) {
  TempDir dir;
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, "ipc://" + (dir.path() / "control").string());
  RawDealer raw(ctx, router.endpoint(), "garbage-0");

  raw.send("hello", 5);  // not a multiple of 8
  std::vector<uint8_t> ff(16, 0xff);
  raw.send(ff.data(), ff.size());                    // impossible segment table
  uint32_t oob[4] = {0, 1, 0x00000fa0, 0x00010000};  // root pointer far out of bounds
  raw.send(oob, sizeof oob);
  {
    ControlMessageBuilder v0;
    fill_hello(v0, 0);
    v0.root().setSchemaVersion(0);
    raw.send(capnp::messageToFlatArray(v0.message()));
    ControlMessageBuilder future;
    fill_hello(future, 0);
    future.root().setSchemaVersion(schema::SCHEMA_VERSION + 1);
    raw.send(capnp::messageToFlatArray(future.message()));
    ControlMessageBuilder two_parts;
    fill_hello(two_parts, 0);
    raw.send(capnp::messageToFlatArray(two_parts.message()), true);
    raw.send("x", 1);
  }
  ControlMessageBuilder good;
  fill_hello(good, 7);
  raw.send(capnp::messageToFlatArray(good.message()));

  auto got = router.receive(Millis(10000));
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->peer(), "garbage-0");
  ASSERT_TRUE(got->root().isHello());
  EXPECT_EQ(got->root().getHello().getRank(), 7u);
  EXPECT_EQ(router.malformed(), 6u);
  EXPECT_EQ(router.receive(Millis(20)), nullptr);
}

TEST(ChannelTest, ReceiveTimesOutAndDealerWithoutPeerDoesNotBlock) {
  TempDir dir;
  ZmqContext ctx;
  Channel dealer(ctx, Channel::Kind::kDealer, "ipc://" + (dir.path() / "nobody").string(),
                 "loader-0");
  EXPECT_EQ(dealer.receive(Millis(30)), nullptr);
  EXPECT_EQ(dealer.receive(Millis(0)), nullptr);
  ControlMessageBuilder h;
  fill_hello(h, 0);
  // Queued locally (bounded by the high-water mark) until a ROUTER appears.
  EXPECT_TRUE(dealer.send(h.message(), Millis(0)));
  EXPECT_THROW(Channel bad(ctx, Channel::Kind::kDealer, "ipc://x", ""), Error);
  EXPECT_THROW(Channel bad(ctx, Channel::Kind::kRouter, "bogus://endpoint"), Error);
}

// ---------------------------------------------------------------------------------------
// Control client

// Receives until `match` accepts a message or ~10 s pass.
template <typename F>
std::unique_ptr<Received> receive_until(Channel& router, F&& match) {
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    auto r = router.receive(Millis(100));
    if (r && match(*r)) return r;
  }
  return nullptr;
}

TEST(ControlClientTest, HelloHeartbeatsStopAndFailure) {
  TempDir dir;
  const std::string endpoint = "ipc://" + (dir.path() / "control").string();
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);

  ControlClient client(endpoint, {schema::StageKind::TRAINER, 1, 3}, Millis(20));
  auto first = router.receive(Millis(10000));
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->peer(), "trainer-1");
  ASSERT_TRUE(first->root().isHello());
  EXPECT_EQ(first->root().getHello().getRank(), 1u);
  EXPECT_EQ(first->root().getHello().getGeneration(), 3u);
  EXPECT_EQ(first->root().getHello().getPid(), ::getpid());

  auto hb0 = receive_until(router, [](Received& r) { return r.root().isHeartbeat(); });
  ASSERT_NE(hb0, nullptr);
  EXPECT_EQ(hb0->root().getHeartbeat().getPhase(), schema::Phase::STARTUP);
  EXPECT_TRUE(std::isnan(hb0->root().getHeartbeat().getLoss()));

  client.set_phase(schema::Phase::FORWARD);
  client.publish({.step = 5, .tokens = 1000.0, .loss = 2.5f, .step_seconds = 0.25});
  auto hb = receive_until(router, [](Received& r) {
    return r.root().isHeartbeat() && r.root().getHeartbeat().getStep() == 5 &&
           r.root().getHeartbeat().getPhase() == schema::Phase::FORWARD;
  });
  ASSERT_NE(hb, nullptr);
  auto beat = hb->root().getHeartbeat();
  EXPECT_EQ(hb->peer(), "trainer-1");
  EXPECT_EQ(beat.getStage(), schema::StageKind::TRAINER);
  EXPECT_EQ(beat.getRank(), 1u);
  EXPECT_EQ(beat.getTokens(), 1000.0);
  EXPECT_EQ(beat.getLoss(), 2.5f);
  EXPECT_EQ(beat.getStepSeconds(), 0.25);
  EXPECT_GT(beat.getPhaseStartedMonoNs(), 0);
  EXPECT_GE(beat.getMonoNs(), beat.getPhaseStartedMonoNs());

  EXPECT_FALSE(client.stop_requested());
  ControlMessageBuilder stop;
  stop.root().initStop().setReason("teardown: trainer-0 exited");
  ASSERT_TRUE(router.send_to("trainer-1", stop.message()));
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!client.stop_requested() && Clock::now() < deadline) {
    std::this_thread::sleep_for(Millis(5));
  }
  ASSERT_TRUE(client.stop_requested());
  EXPECT_EQ(client.stop_reason(), "teardown: trainer-0 exited");

  client.set_step(6);
  client.report_failure("exception", "boom");
  auto failure = receive_until(router, [](Received& r) { return r.root().isFailure(); });
  ASSERT_NE(failure, nullptr);
  auto f = failure->root().getFailure();
  EXPECT_EQ(std::string(f.getKind().cStr()), "exception");
  EXPECT_EQ(std::string(f.getMessage().cStr()), "boom");
  EXPECT_EQ(f.getRank(), 1u);
  EXPECT_EQ(f.getStep(), 6u);
  EXPECT_EQ(f.getPhase(), schema::Phase::FORWARD);
  EXPECT_EQ(router.malformed(), 0u);
}

// The progress stamp is set by report_progress() alone (the working thread); heartbeats that
// go on without it carry the old stamp, which is what lets the supervisor see a wedged stage.
TEST(ControlClientTest, ProgressIsStampedOnlyByTheWorkingThread) {
  TempDir dir;
  const std::string endpoint = "ipc://" + (dir.path() / "control").string();
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);
  ControlClient client(endpoint, {schema::StageKind::CHECKPOINTER, 0, 0}, Millis(20));

  auto hb0 = receive_until(router, [](Received& r) { return r.root().isHeartbeat(); });
  ASSERT_NE(hb0, nullptr);
  EXPECT_EQ(hb0->root().getHeartbeat().getProgressMonoNs(), 0);  // nothing reported yet

  const int64_t before = mono_ns();
  client.report_progress(7, before - 1000);
  auto hb = receive_until(router, [](Received& r) {
    return r.root().isHeartbeat() && r.root().getHeartbeat().getWorkDone() == 7;
  });
  ASSERT_NE(hb, nullptr);
  const int64_t stamp = hb->root().getHeartbeat().getProgressMonoNs();
  EXPECT_GE(stamp, before);
  EXPECT_EQ(hb->root().getHeartbeat().getPendingSinceMonoNs(), before - 1000);

  // Later heartbeats, with no report in between, keep the same stamp.
  for (int i = 0; i < 3; ++i) {
    auto later = receive_until(router, [](Received& r) { return r.root().isHeartbeat(); });
    ASSERT_NE(later, nullptr);
    EXPECT_EQ(later->root().getHeartbeat().getProgressMonoNs(), stamp);
    EXPECT_GT(later->root().getHeartbeat().getMonoNs(), stamp);
  }
}

// AbortCollectives runs the owner's abort handler on the client's thread, which replies
// CollectivesAborted: with no handler (no group), with one, and with one that throws.
TEST(ControlClientTest, AbortCollectivesRunsTheHandlerAndReplies) {
  TempDir dir;
  const std::string endpoint = "ipc://" + (dir.path() / "control").string();
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);
  ControlClient client(endpoint, {schema::StageKind::TRAINER, 2, 0}, Millis(20));
  ASSERT_NE(receive_until(router, [](Received& r) { return r.root().isHello(); }), nullptr);

  auto abort_and_reply = [&] {
    ControlMessageBuilder abort;
    abort.root().initAbortCollectives().setReason("teardown: trainer-1 hung");
    EXPECT_TRUE(router.send_to("trainer-2", abort.message()));
    return receive_until(router, [](Received& r) { return r.root().isCollectivesAborted(); });
  };

  auto none = abort_and_reply();
  ASSERT_NE(none, nullptr);
  EXPECT_EQ(none->root().getCollectivesAborted().getRank(), 2u);
  EXPECT_FALSE(none->root().getCollectivesAborted().getHadGroup());
  EXPECT_TRUE(none->root().getCollectivesAborted().getOk());

  std::atomic<int> calls{0};
  std::atomic<bool> on_client_thread{false};
  const auto owner = std::this_thread::get_id();
  client.set_abort_handler([&] {
    on_client_thread = std::this_thread::get_id() != owner;
    std::this_thread::sleep_for(Millis(20));
    ++calls;
  });
  auto done = abort_and_reply();
  ASSERT_NE(done, nullptr);
  auto a = done->root().getCollectivesAborted();
  EXPECT_TRUE(a.getHadGroup());
  EXPECT_TRUE(a.getOk());
  EXPECT_GE(a.getSeconds(), 0.015);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_TRUE(on_client_thread.load());

  client.set_abort_handler([] { throw std::runtime_error("ncclCommAbort failed"); });
  auto failed = abort_and_reply();
  ASSERT_NE(failed, nullptr);
  EXPECT_TRUE(failed->root().getCollectivesAborted().getHadGroup());
  EXPECT_FALSE(failed->root().getCollectivesAborted().getOk());
  EXPECT_EQ(std::string(failed->root().getCollectivesAborted().getError().cStr()),
            "ncclCommAbort failed");
  client.set_abort_handler({});
  EXPECT_EQ(calls.load(), 1);
}

TEST(ControlClientTest, PendingFailureIsFlushedByDestructor) {
  TempDir dir;
  const std::string endpoint = "ipc://" + (dir.path() / "control").string();
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);
  {
    // A long interval: only the destructor's flush can deliver the report in time.
    ControlClient client(endpoint, {schema::StageKind::DATA_LOADER, 0, 1}, Millis(60000));
    client.report_failure("signal", "SIGSEGV");
  }
  auto failure = receive_until(router, [](Received& r) { return r.root().isFailure(); });
  ASSERT_NE(failure, nullptr);
  EXPECT_EQ(failure->peer(), "data_loader-0");
  EXPECT_EQ(std::string(failure->root().getFailure().getKind().cStr()), "signal");
}

TEST(ControlClientTest, AbsentSupervisorNeverBlocks) {
  TempDir dir;
  {
    ControlClient client("ipc://" + (dir.path() / "control").string(),
                         {schema::StageKind::COLLECTOR, 0, 1}, Millis(5));
    client.set_phase(schema::Phase::WRITE);
    for (uint32_t i = 0; i < 50; ++i)
      client.publish({.step = i, .tokens = static_cast<double>(i), .loss = 0.0f});
    std::this_thread::sleep_for(Millis(50));
    client.report_failure("exception", "nobody listens");
    EXPECT_FALSE(client.stop_requested());
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

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

}  // namespace
}  // namespace megacpp::ipc
