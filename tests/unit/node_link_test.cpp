// supervisor/zmq_node_link.h over loopback: the job controller's ZmqNodeAgentLink and a node's
// NodeAgentServer carry NodeAgentLink's commands and events as InProcessLink does, through
// CURVE with the job's keys; a peer without those keys (another key pair, or no CURVE at all)
// gets nothing through and the node's link goes on; frames that fail to decode are dropped
// and counted at either end. The node runs on a thread of its own, as it would on its host.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include "ipc/channel.h"
#include "ipc/curve_channel.h"
#include "ipc/job_keys.h"
#include "schemas/run_layout.h"
#include "supervisor/node_agent.h"
#include "supervisor/zmq_node_link.h"
#include "tests/unit/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using megacpp::ipc::CurveDealer;
using megacpp::ipc::CurveRouter;
using megacpp::ipc::generate_job_keys;
using megacpp::ipc::JobKeys;
using megacpp::ipc::Millis;
using megacpp::schema::ChildReason;
using megacpp::schema::NodeCommand;
using megacpp::schema::NodeEvent;
using megacpp::schema::NodeLinkFrame;
using megacpp::schema::StageKind;
using megacpp::supervisor::InProcessLink;
using megacpp::supervisor::JobControlEndpoint;
using megacpp::supervisor::kNodeLinkVersion;
using megacpp::supervisor::NodeAgent;
using megacpp::supervisor::NodeAgentLink;
using megacpp::supervisor::NodeAgentServer;
using megacpp::supervisor::RingLevel;
using megacpp::supervisor::Spawner;
using megacpp::supervisor::ZmqNodeAgentLink;
using megacpp::test_support::TempDir;
using Clock = std::chrono::steady_clock;

constexpr const char* kLoopback = "tcp://127.0.0.1:*";

// Spawns nothing: pids from 1000, as tests/unit/node_agent_test.cpp's.
class FakeSpawner final : public Spawner {
 public:
  pid_t spawn(const std::vector<std::string>&, const fs::path&,
              const std::vector<std::string>&) override {
    return next_pid_++;
  }
  void signal(pid_t, int) override {}
  pid_t wait(pid_t, int&) override { return 0; }
  char state(pid_t) override { return 'S'; }
  std::vector<std::string> environment(const std::vector<std::string>&) override { return {}; }

 private:
  pid_t next_pid_ = 1000;
};

// A real NodeAgent (fake spawner, real control ROUTER and signalfd) behind an InProcessLink and
// a NodeAgentServer, on a thread of its own until the object is destroyed.
class NodeHost {
 public:
  NodeHost(const JobKeys& keys, std::string controller, std::string name)
      : thread_([this, keys, controller = std::move(controller), name = std::move(name)] {
          FakeSpawner spawner;
          NodeAgent agent(spawner);
          agent.set_run_dir(dir_.path());
          agent.block_signals();  // this thread's mask only
          agent.open_control(control_);
          InProcessLink local(agent);
          NodeAgentServer server(local, keys, controller, name);
          while (!stop_.load()) server.serve(10);
          dropped_.store(server.dropped());
          agent.release();
        }) {}
  ~NodeHost() { stop(); }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  // The node agent's control endpoint, where its stages connect.
  const std::string& control() const { return control_; }
  uint64_t dropped() const { return dropped_.load(); }

 private:
  TempDir dir_;
  const std::string control_ = "ipc://" + (dir_.path() / "control").string();
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> dropped_{0};
  std::thread thread_;
};

std::string process_of(NodeEvent::Reader e) {
  switch (e.which()) {
    case NodeEvent::STARTED:
      return megacpp::layout::process_name(e.getStarted().getProcess().getStage(),
                                           e.getStarted().getProcess().getRank());
    case NodeEvent::MESSAGE:
      return e.getMessage().getPeer();
    default:
      return {};
  }
}

// An event as the controller's sink saw it.
struct Seen {
  NodeEvent::Which which;
  std::string process;
  int32_t pid = 0;
};

class NodeLinkTest : public ::testing::Test {
 protected:
  NodeLinkTest() {
    link.connect([this](NodeEvent::Reader e) {
      Seen s{e.which(), process_of(e)};
      if (e.isStarted()) s.pid = e.getStarted().getPid();
      events.push_back(s);
    });
  }

  template <class F>
  bool command(F&& build) {
    capnp::MallocMessageBuilder msg;
    build(msg.initRoot<NodeCommand>());
    return link.command(msg.getRoot<NodeCommand>().asReader());
  }
  bool launch(StageKind stage, uint32_t rank) {
    return command([&](NodeCommand::Builder c) {
      auto l = c.initLaunch();
      l.getProcess().setStage(stage);
      l.getProcess().setRank(rank);
      l.setReason(ChildReason::LAUNCH);
    });
  }
  // Polls the link until `done` holds or `ms` pass.
  bool poll_until(const std::function<bool()>& done, int ms = 5000) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(ms);
    while (!done()) {
      if (Clock::now() > deadline) return false;
      link.poll(20);
    }
    return true;
  }

  const JobKeys keys = generate_job_keys();
  JobControlEndpoint endpoint{keys, kLoopback};
  ZmqNodeAgentLink link{endpoint, "node-1", {std::chrono::milliseconds(2000)}};
  std::vector<Seen> events;
};

TEST_F(NodeLinkTest, CommandsAndEventsRoundTripAsInProcess) {
  NodeHost node(keys, endpoint.endpoint(), "node-1");
  ASSERT_TRUE(link.wait_connected(5000));

  // A launch: `started` reaches the sink before command() returns, and its result comes back.
  ASSERT_TRUE(launch(StageKind::TRAINER, 0));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].which, NodeEvent::STARTED);
  EXPECT_EQ(events[0].process, "trainer-0");
  EXPECT_EQ(events[0].pid, 1000);
  // A stop the stage cannot hear (its control socket is not connected): false comes back.
  EXPECT_FALSE(command([](NodeCommand::Builder c) {
    auto s = c.initStop();
    s.getProcess().setStage(StageKind::TRAINER);
    s.getProcess().setRank(0);
    s.setReason("test");
  }));

  // The node's own events: a stage's hello on the agent's control socket comes up through poll.
  megacpp::ipc::ZmqContext ctx;
  megacpp::ipc::Channel stage(ctx, megacpp::ipc::Channel::Kind::kDealer, node.control(),
                              "trainer-0");
  megacpp::ipc::ControlMessageBuilder hello;
  hello.root().initHello().setRank(0);
  ASSERT_TRUE(stage.send(hello.message()));
  ASSERT_TRUE(poll_until([&] { return events.size() == 2; }));
  EXPECT_EQ(events[1].which, NodeEvent::MESSAGE);
  EXPECT_EQ(events[1].process, "trainer-0");

  // The attempt's rings: the controller sees the node's levels.
  const std::string prefix = fmt::format("/megacpp-nodelink-{}-", ::getpid());
  ASSERT_TRUE(command([&](NodeCommand::Builder c) {
    auto p = c.initPrepareAttempt();
    p.setShmPrefix(prefix);
    p.setRanks(2);
    p.setRingSlots(4);
    p.setRingSlotBytes(128);
  }));
  ASSERT_TRUE(poll_until([&] { return link.ring_levels().size() == 2; }));
  EXPECT_EQ(link.ring_levels()[0].slots, 4u);
  EXPECT_EQ(link.ring_levels()[1].depth, 0u);
  ASSERT_TRUE(command([](NodeCommand::Builder c) { c.setReleaseAttempt(); }));
  ASSERT_TRUE(poll_until([&] { return link.ring_levels().empty(); }));

  EXPECT_EQ(link.dropped(), 0u);
  EXPECT_EQ(endpoint.refused(), 0u);
}

// A forged `started` event, as a NodeLinkFrame: what a rogue node would send up.
kj::Array<capnp::word> forged_event() {
  capnp::MallocMessageBuilder message;
  auto frame = message.initRoot<NodeLinkFrame>();
  frame.setVersion(kNodeLinkVersion);
  auto s = frame.initEvent().initStarted();
  s.getProcess().setStage(StageKind::TRAINER);
  s.getProcess().setRank(7);
  s.setPid(4242);
  return capnp::messageToFlatArray(message);
}

TEST_F(NodeLinkTest, APeerWithAnotherKeyPairIsRefusedAndTheNodeGoesOn) {
  NodeHost node(keys, endpoint.endpoint(), "node-1");
  ASSERT_TRUE(link.wait_connected(5000));

  // The job's server key (public, say it leaked) with a client pair of its own, under the
  // node's very name: were it let in, ROUTER_HANDOVER would give it node-1's route.
  JobKeys rogue_keys = generate_job_keys();
  rogue_keys.server.public_key = keys.server.public_key;
  CurveDealer rogue(rogue_keys, endpoint.endpoint(), "node-1");
  capnp::MallocMessageBuilder hello;
  hello.initRoot<NodeLinkFrame>().setVersion(kNodeLinkVersion);
  hello.getRoot<NodeLinkFrame>().setHello("node-1");
  rogue.send(hello, Millis(100));
  capnp::MallocMessageBuilder forged;
  forged.setRoot(capnp::FlatArrayMessageReader(forged_event()).getRoot<NodeLinkFrame>());
  rogue.send(forged, Millis(100));

  // The ZAP handler refuses the handshake; nothing the rogue sent reaches the controller.
  poll_until([&] { return endpoint.refused() >= 1 || !events.empty(); });
  link.poll(300);
  EXPECT_TRUE(events.empty()) << "a forged event from " << events[0].process << " got through";
  EXPECT_GE(endpoint.refused(), 1u);

  // The node's link goes on, and the rogue hears none of it.
  ASSERT_TRUE(launch(StageKind::DATA_LOADER, 0));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].process, "data_loader-0");
  EXPECT_EQ(events[0].pid, 1000);
  EXPECT_EQ(rogue.receive(Millis(300)), nullptr);
  EXPECT_EQ(link.dropped(), 0u);
}

TEST_F(NodeLinkTest, APeerWithoutCurveIsRefusedAndTheNodeGoesOn) {
  NodeHost node(keys, endpoint.endpoint(), "node-1");
  ASSERT_TRUE(link.wait_connected(5000));

  // A plain ZeroMQ DEALER (the NULL mechanism), under the node's name.
  void* ctx = zmq_ctx_new();
  void* plain = zmq_socket(ctx, ZMQ_DEALER);
  int zero = 0;
  zmq_setsockopt(plain, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(plain, ZMQ_ROUTING_ID, "node-1", 6);
  ASSERT_EQ(zmq_connect(plain, endpoint.endpoint().c_str()), 0);
  const auto words = forged_event();
  for (int i = 0; i < 3; ++i) {
    zmq_send(plain, words.asBytes().begin(), words.asBytes().size(), ZMQ_DONTWAIT);
  }
  link.poll(500);
  EXPECT_TRUE(events.empty());

  // A command to node-1 reaches the node, not the plain peer.
  ASSERT_TRUE(launch(StageKind::TRAINER, 3));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].process, "trainer-3");
  zmq_pollitem_t item{plain, 0, ZMQ_POLLIN, 0};
  EXPECT_EQ(zmq_poll(&item, 1, 300), 0);
  zmq_close(plain);
  zmq_ctx_term(ctx);
  EXPECT_EQ(link.dropped(), 0u);
}

TEST(NodeLink, ANodeNeverTalksToAServerWithoutTheJobsKey) {
  const JobKeys keys = generate_job_keys();
  // An impostor controller: its own server pair, and it accepts the job's client key.
  JobKeys impostor = generate_job_keys();
  impostor.client = keys.client;
  JobControlEndpoint fake(impostor, kLoopback);
  ZmqNodeAgentLink link(fake, "node-1");
  // The node expects the job's server key: the handshake never completes.
  NodeHost node(keys, fake.endpoint(), "node-1");
  EXPECT_FALSE(link.wait_connected(500));
}

// A message whose root is a list: no NodeLinkFrame can be read from it.
void undecodable(capnp::MallocMessageBuilder& message) {
  message.getRoot<capnp::AnyPointer>().initAs<capnp::List<uint32_t>>(3);
}

TEST(NodeLink, FramesThatFailToDecodeAreDroppedAndCountedAtTheController) {
  const JobKeys keys = generate_job_keys();
  JobControlEndpoint endpoint(keys, kLoopback);
  ZmqNodeAgentLink link(endpoint, "node-2");
  int delivered = 0;
  link.connect([&](NodeEvent::Reader) { ++delivered; });
  capnp::MallocMessageBuilder hello;
  hello.initRoot<NodeLinkFrame>().setVersion(kNodeLinkVersion);
  hello.getRoot<NodeLinkFrame>().setHello("node-2");

  // A peer with the job's keys that sends NodeLinkFrames no link can take, then a hello.
  CurveDealer peer(keys, endpoint.endpoint(), "node-2");
  capnp::MallocMessageBuilder bad_root;
  undecodable(bad_root);
  ASSERT_TRUE(peer.send(bad_root));
  capnp::MallocMessageBuilder other_version;
  other_version.initRoot<NodeLinkFrame>().setVersion(kNodeLinkVersion + 1);
  other_version.getRoot<NodeLinkFrame>().setHello("node-2");
  ASSERT_TRUE(peer.send(other_version));
  capnp::MallocMessageBuilder command_up;  // a command has no business going up
  auto up = command_up.initRoot<NodeLinkFrame>();
  up.setVersion(kNodeLinkVersion);
  up.initCommand().setReleaseAttempt();
  ASSERT_TRUE(peer.send(command_up));
  ASSERT_TRUE(peer.send(hello));
  // The endpoint reads on past what the link dropped, in order.
  ASSERT_TRUE(link.wait_connected(5000));
  EXPECT_EQ(link.dropped(), 3u);
  EXPECT_EQ(endpoint.dropped(), 0u);
  EXPECT_EQ(delivered, 0);

  // Bytes that are no Cap'n Proto message at all (a segment table that overruns the frame)
  // and a frame that is not whole words, from a raw socket with the job's keys as node-3.
  ZmqNodeAgentLink link3(endpoint, "node-3");
  void* ctx = zmq_ctx_new();
  void* raw = zmq_socket(ctx, ZMQ_DEALER);
  int zero = 0;
  zmq_setsockopt(raw, ZMQ_LINGER, &zero, sizeof zero);
  ASSERT_EQ(zmq_setsockopt(raw, ZMQ_CURVE_SERVERKEY, keys.server.public_key.c_str(), 41), 0);
  ASSERT_EQ(zmq_setsockopt(raw, ZMQ_CURVE_PUBLICKEY, keys.client.public_key.c_str(), 41), 0);
  ASSERT_EQ(zmq_setsockopt(raw, ZMQ_CURVE_SECRETKEY, keys.client.secret_key.c_str(), 41), 0);
  ASSERT_EQ(zmq_setsockopt(raw, ZMQ_ROUTING_ID, "node-3", 6), 0);
  ASSERT_EQ(zmq_connect(raw, endpoint.endpoint().c_str()), 0);
  const uint8_t garbage[16] = {0, 0, 0, 0, 0xff, 0xff, 0xff, 0x0f, 1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_EQ(zmq_send(raw, garbage, sizeof garbage, 0), 16);
  ASSERT_EQ(zmq_send(raw, garbage, 5, 0), 5);
  capnp::MallocMessageBuilder hello3;
  hello3.initRoot<NodeLinkFrame>().setVersion(kNodeLinkVersion);
  hello3.getRoot<NodeLinkFrame>().setHello("node-3");
  const auto words = capnp::messageToFlatArray(hello3);
  ASSERT_GT(zmq_send(raw, words.asBytes().begin(), words.asBytes().size(), 0), 0);
  ASSERT_TRUE(link3.wait_connected(5000));
  EXPECT_EQ(endpoint.dropped(), 2u);
  EXPECT_EQ(link3.dropped(), 0u);
  zmq_close(raw);
  zmq_ctx_term(ctx);

  // And a frame from a name no link here has: dropped at the endpoint.
  CurveDealer stranger(keys, endpoint.endpoint(), "node-9");
  ASSERT_TRUE(stranger.send(hello));
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (endpoint.dropped() == 2 && Clock::now() < deadline) link.poll(20);
  EXPECT_EQ(endpoint.dropped(), 3u);
  EXPECT_EQ(delivered, 0);
}

TEST(NodeLink, AnyFrameFromTheNodeShowsItConnectedNotOnlyItsHello) {
  // A controller that comes back on the same port after the node said hello to its
  // predecessor: the node's next frame (here its ring levels) is the sign it is there.
  const JobKeys keys = generate_job_keys();
  JobControlEndpoint endpoint(keys, kLoopback);
  ZmqNodeAgentLink link(endpoint, "node-1");
  CurveDealer node(keys, endpoint.endpoint(), "node-1");
  capnp::MallocMessageBuilder rings;
  auto frame = rings.initRoot<NodeLinkFrame>();
  frame.setVersion(kNodeLinkVersion);
  frame.initRings(1)[0].setSlots(8);
  ASSERT_TRUE(node.send(rings));
  ASSERT_TRUE(link.wait_connected(5000));
  ASSERT_EQ(link.ring_levels().size(), 1u);
  EXPECT_EQ(link.ring_levels()[0].slots, 8u);
}

// Records what reaches it as the node's local link; events only when told to.
class RecordingLink final : public NodeAgentLink {
 public:
  std::atomic<int> commands{0};
  bool command(NodeCommand::Reader c) override {
    ++commands;
    return c.isReleaseAttempt();
  }
  void poll(int timeout_ms) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
  }
  std::vector<RingLevel> ring_levels() const override { return {}; }
};

TEST(NodeLink, FramesThatFailToDecodeAreDroppedAndCountedAtTheNode) {
  const JobKeys keys = generate_job_keys();
  CurveRouter controller(keys, kLoopback);
  RecordingLink local;
  std::optional<NodeAgentServer> server;
  // No beat thread: this test reads the node's frames one by one.
  server.emplace(local, keys, controller.endpoint(), "node-1",
                 NodeAgentServer::Options{.beat_interval = std::chrono::milliseconds(0)});
  // The node's hello names it.
  std::unique_ptr<megacpp::ipc::ReceivedFrame> hello;
  for (int i = 0; i < 100 && !hello; ++i) {
    server->serve(10);
    hello = controller.receive(Millis(10));
  }
  ASSERT_TRUE(hello);
  EXPECT_EQ(hello->peer(), "node-1");
  EXPECT_EQ(std::string(hello->message().getRoot<NodeLinkFrame>().getHello()), "node-1");

  capnp::MallocMessageBuilder bad_root;
  undecodable(bad_root);
  ASSERT_TRUE(controller.send_to("node-1", bad_root));
  capnp::MallocMessageBuilder not_a_command;
  not_a_command.initRoot<NodeLinkFrame>().setVersion(kNodeLinkVersion);
  not_a_command.getRoot<NodeLinkFrame>().setHello("controller");
  ASSERT_TRUE(controller.send_to("node-1", not_a_command));
  capnp::MallocMessageBuilder good;
  auto g = good.initRoot<NodeLinkFrame>();
  g.setVersion(kNodeLinkVersion);
  g.setSequence(41);
  g.initCommand().setReleaseAttempt();
  ASSERT_TRUE(controller.send_to("node-1", good));

  std::unique_ptr<megacpp::ipc::ReceivedFrame> done;
  for (int i = 0; i < 200 && !done; ++i) {
    server->serve(10);
    done = controller.receive(Millis(0));
  }
  ASSERT_TRUE(done);
  auto d = done->message().getRoot<NodeLinkFrame>();
  ASSERT_TRUE(d.isDone());
  EXPECT_EQ(d.getDone().getSequence(), 41u);
  EXPECT_TRUE(d.getDone().getDelivered());
  EXPECT_EQ(server->dropped(), 2u);
  EXPECT_EQ(server->commands(), 1u);
  EXPECT_EQ(local.commands.load(), 1);
}

TEST(NodeLink, TheControllerListensOnlyOnAnInterfaceItIsGiven) {
  const JobKeys keys = generate_job_keys();
  for (const char* wildcard : {"tcp://*:0", "tcp://0.0.0.0:0", "tcp://[::]:0"}) {
    try {
      JobControlEndpoint endpoint(keys, wildcard);
      ADD_FAILURE() << wildcard << " was bound";
    } catch (const megacpp::Error& e) {
      EXPECT_EQ(e.kind(), megacpp::ErrorKind::kInvalidArgument);
      EXPECT_NE(e.message().find("every interface"), std::string::npos) << e.message();
    }
  }
}

}  // namespace

// ---- Liveness: silence beyond the link's limit is a lost node, whatever caused it.

// A node in a process of its own (node_link_node beside this test's binary, exec'd), killed
// with the guard.
class NodeProcess {
 public:
  NodeProcess(const JobKeys& keys, const std::string& endpoint,
              const std::string& name = "node-1") {
    const fs::path keyfile = dir_.path() / "job.keys";
    megacpp::ipc::write_job_keys(keyfile, keys);
    const fs::path exe = fs::read_symlink("/proc/self/exe").parent_path() / "node_link_node";
    const std::string key_arg = keyfile.string(), exe_arg = exe.string();
    pid_ = fork();
    if (pid_ == 0) {
      execl(exe_arg.c_str(), exe_arg.c_str(), key_arg.c_str(), endpoint.c_str(), name.c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  ~NodeProcess() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    kill(pid_, SIGCONT);
    waitpid(pid_, nullptr, 0);
  }
  NodeProcess(const NodeProcess&) = delete;
  NodeProcess& operator=(const NodeProcess&) = delete;
  pid_t pid() const { return pid_; }

 private:
  TempDir dir_;
  pid_t pid_ = -1;
};

// Polls `link` until it declares its node lost or `bound` passes; the time it took.
std::optional<std::chrono::milliseconds> time_to_lost(ZmqNodeAgentLink& link,
                                                      std::chrono::seconds bound) {
  const auto start = Clock::now();
  while (!link.lost()) {
    if (Clock::now() - start > bound) return std::nullopt;
    link.poll(20);
  }
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
}

constexpr std::chrono::milliseconds kSilenceLimit{500};

TEST(NodeLiveness, ANodeThatBeatsIsNeverLostEvenWhileACommandBlocksIt) {
  const JobKeys keys = generate_job_keys();
  JobControlEndpoint endpoint(keys, kLoopback);
  ZmqNodeAgentLink link(
      endpoint, "node-1",
      {.command_timeout = std::chrono::seconds(10), .silence_limit = kSilenceLimit});
  // The node's serve loop is busy for 3 silence limits in one command (a teardown waiting out
  // its grace does that); its beat thread goes on.
  class SlowLink final : public NodeAgentLink {
   public:
    bool command(NodeCommand::Reader) override {
      std::this_thread::sleep_for(3 * kSilenceLimit);
      return true;
    }
    void poll(int timeout_ms) override {
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    }
    std::vector<RingLevel> ring_levels() const override { return {}; }
  };
  std::atomic<bool> stop{false};
  std::thread node([&] {
    SlowLink local;
    NodeAgentServer server(local, keys, endpoint.endpoint(), "node-1");
    while (!stop.load()) server.serve(10);
  });
  ASSERT_TRUE(link.wait_connected(5000));
  capnp::MallocMessageBuilder msg;
  msg.initRoot<NodeCommand>().setReleaseAttempt();
  EXPECT_TRUE(link.command(msg.getRoot<NodeCommand>().asReader()));
  const auto until = Clock::now() + 4 * kSilenceLimit;
  while (Clock::now() < until) link.poll(20);
  EXPECT_FALSE(link.lost()) << "silent for " << link.lost()->silent.count() << " ms";
  stop.store(true);
  node.join();
}

// A node in a process of its own, beating and not lost, then sent `sig`: declared lost once
// silent beyond the limit. `what` names the node's state in the messages.
void expect_lost_after(int sig, const char* what) {
  const JobKeys keys = generate_job_keys();
  JobControlEndpoint endpoint(keys, kLoopback);
  ZmqNodeAgentLink link(endpoint, "node-1", {.silence_limit = kSilenceLimit});
  NodeProcess node(keys, endpoint.endpoint());
  ASSERT_GT(node.pid(), 0);
  ASSERT_TRUE(link.wait_connected(5000));
  for (int i = 0; i < 10; ++i) link.poll(50);  // beating: not lost
  ASSERT_FALSE(link.lost());
  ASSERT_EQ(kill(node.pid(), sig), 0);
  const auto took = time_to_lost(link, std::chrono::seconds(10));
  ASSERT_TRUE(took) << "a " << what << " node was never declared lost";
  EXPECT_GT(link.lost()->silent, kSilenceLimit);
  printf("%s node declared lost after %lld ms (silence limit %lld ms)\n", what,
         static_cast<long long>(took->count()), static_cast<long long>(kSilenceLimit.count()));
}

TEST(NodeLiveness, AKilledNodeIsLost) {
  expect_lost_after(SIGKILL, "killed");
}

TEST(NodeLiveness, AHungNodeIsLost) {
  // Every process of the node stopped (SIGSTOP): its connections stay open, so TCP says
  // nothing; only the silence does.
  expect_lost_after(SIGSTOP, "stopped");
}

TEST(NodeLiveness, OneWaitOverEveryNodeDeliversEachNodesEventsAndNamesTheOneLost) {
  // Two nodes on one endpoint, polled together: each node's frames reach its own link, and
  // killing one makes that link lost while the other stays alive.
  const JobKeys keys = generate_job_keys();
  JobControlEndpoint endpoint(keys, kLoopback);
  std::map<std::string, std::unique_ptr<ZmqNodeAgentLink>> links;
  std::map<std::string, int> hellos;
  for (const char* name : {"node-0", "node-1"}) {
    links[name] = std::make_unique<ZmqNodeAgentLink>(
        endpoint, name, ZmqNodeAgentLink::Options{.silence_limit = kSilenceLimit});
  }
  // Node 0 on a thread (a real agent: a stage's hello comes up as an event), node 1 in a
  // process of its own, to be killed.
  NodeHost node0(keys, endpoint.endpoint(), "node-0");
  NodeProcess node1(keys, endpoint.endpoint(), "node-1");
  ASSERT_GT(node1.pid(), 0);
  links["node-0"]->connect([&](NodeEvent::Reader e) {
    if (e.isMessage()) ++hellos["node-0"];
  });
  links["node-1"]->connect([&](NodeEvent::Reader) { ++hellos["node-1"]; });
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!(links["node-0"]->connected() && links["node-1"]->connected()) && Clock::now() < deadline)
    endpoint.poll(20);
  ASSERT_TRUE(links["node-0"]->connected() && links["node-1"]->connected());

  // A stage of node 0 says hello on its agent's control socket: the event reaches node 0's
  // link through the endpoint's poll.
  megacpp::ipc::ZmqContext ctx;
  megacpp::ipc::Channel stage(ctx, megacpp::ipc::Channel::Kind::kDealer, node0.control(),
                              "trainer-0");
  megacpp::ipc::ControlMessageBuilder hello;
  hello.root().initHello().setRank(0);
  ASSERT_TRUE(stage.send(hello.message()));
  while (hellos["node-0"] == 0 && Clock::now() < deadline) endpoint.poll(20);
  EXPECT_EQ(hellos["node-0"], 1);
  EXPECT_EQ(hellos["node-1"], 0);

  ASSERT_EQ(kill(node1.pid(), SIGKILL), 0);
  while (!links["node-1"]->lost() && Clock::now() < deadline + std::chrono::seconds(5))
    endpoint.poll(20);
  EXPECT_TRUE(links["node-1"]->lost());
  EXPECT_FALSE(links["node-0"]->lost());
}
