// ipc/channel.h: Channel and Poller over ZeroMQ ipc:// and tcp://, and raw libzmq sockets that send
// what a Channel never would. Against the real thing; timings are never asserted, every wait is
// bounded.
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

#include "core/error.h"
#include "ipc/channel.h"
#include "ipc/detail/zmq.h"
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

}  // namespace
}  // namespace megacpp::ipc
