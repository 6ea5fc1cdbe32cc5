// The job controller <-> node agent link across hosts: the NodeAgentLink of a node agent on
// another host, over ZeroMQ with CURVE (ipc/curve_channel.h) and the job's keys
// (ipc/job_keys.h). The same commands and events as InProcessLink (schemas/node.capnp), each
// in a NodeLinkFrame. DESIGN.md "The control channel across hosts".
//
//   controller's host                         a node's host
//   ZmqNodeAgentLink, one per node            NodeAgentServer -> InProcessLink -> NodeAgent
//   JobControlEndpoint: ROUTER <-- CURVE --> DEALER, identity = the node's name
//
// Protocol: the node says `hello` (its name) when it connects; a command goes down with a
// sequence number and comes back as the events it caused, then `done` with that sequence and
// NodeAgentLink::command's result; the events of the node's own polling (exits, stage
// messages) come up as they happen; `rings` when the attempt's ring levels change.
//
// Not wired into `megacpp run` yet: the job controller drives an InProcessLink. This is the
// seam the multi-node launch plugs in.
//
// Liveness: the node's beat thread sends a `beat` every Options::beat_interval on a connection
// of its own (identity "<node>/beat"), whatever the node's serve loop is doing (a command that
// blocks it for seconds, a teardown waiting out a grace). The controller records the time of
// every frame from a node, beats included, as it receives it, and a link whose node has been
// silent for longer than its silence_limit is lost (lost()): a node whose processes were
// killed, a hung node (its supervisor stopped), a cut link — all are silence; TCP tells
// nothing of the last two. The link says so once and stays lost: a node that speaks again
// has lost its place in the attempt (the controller restarts the job, it does not re-admit).
//
// Failure: a frame that fails to decode (not a NodeLinkFrame, another version, a direction
// that makes no sense) is dropped and counted in dropped(), never thrown; a peer without the
// job's keys never gets a frame through (ipc::CurveRouter refuses it). A node that does not
// answer a command within Options::command_timeout makes command() return false.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ipc/curve_channel.h"
#include "ipc/job_keys.h"
#include "schemas/node.capnp.h"
#include "supervisor/node_agent_link.h"

namespace megacpp::supervisor {

// NodeLinkFrame.version this build speaks; a frame with another is dropped.
constexpr uint32_t kNodeLinkVersion = 1;

class ZmqNodeAgentLink;

// The controller's ROUTER that every node of the job connects to, and the sorting of what
// arrives into one queue per node. One thread uses it and its links.
class JobControlEndpoint {
 public:
  // `endpoint`: tcp://ADDRESS:PORT on the interface the job names (ipc::CurveRouter).
  JobControlEndpoint(const ipc::JobKeys& keys, const std::string& endpoint);

  std::string endpoint() const { return router_.endpoint(); }
  // Handshakes refused for want of the job's keys.
  uint64_t refused() const noexcept { return router_.refused(); }
  // Frames dropped: malformed, or from a peer that is no node of a link here.
  uint64_t dropped() const noexcept { return router_.malformed() + strangers_; }

  // One wait over every node of the job: up to timeout_ms for the first frame of any node,
  // then everything that has come is delivered to its link's sink, and every link judges its
  // node's silence (ZmqNodeAgentLink::lost). The watch loop of a job across nodes calls this
  // instead of each link's poll(), which waits on its own node only.
  void poll(int timeout_ms);

 private:
  friend class ZmqNodeAgentLink;
  using Clock = std::chrono::steady_clock;
  void attach(const std::string& node, ZmqNodeAgentLink* link);
  void detach(const std::string& node);
  // The next frame from `node`, waiting until `deadline` at most (frames of other attached
  // nodes that arrive meanwhile are queued for them).
  std::unique_ptr<ipc::ReceivedFrame> next(const std::string& node, Clock::time_point deadline);
  bool send_to(const std::string& node, capnp::MessageBuilder& message);
  // When a frame from `node` (or its beat connection) last arrived; the attach time before any.
  Clock::time_point last_heard(const std::string& node) const { return heard_.at(node); }
  // Every frame waiting in the socket, sorted to its node's queue (beats recorded and dropped).
  void drain();
  // Queues `f` for its node, or records its beat; false for a stranger's frame (dropped).
  bool sort(std::unique_ptr<ipc::ReceivedFrame> f);

  ipc::CurveRouter router_;
  std::map<std::string, std::deque<std::unique_ptr<ipc::ReceivedFrame>>> queues_;
  std::map<std::string, Clock::time_point> heard_;
  std::map<std::string, ZmqNodeAgentLink*> links_;
  uint64_t strangers_ = 0;
};

// The job controller's NodeAgentLink to the node agent of another host.
class ZmqNodeAgentLink final : public NodeAgentLink {
 public:
  struct Options {
    // How long command() waits for the node's `done`.
    std::chrono::milliseconds command_timeout{5000};
    // Silence after which the node is lost: ten beats of NodeAgentServer's default interval,
    // the goal for a dead node (<= 1 s) and well inside the heartbeat budget for a hung
    // node or a cut link (<= 10 s).
    std::chrono::milliseconds silence_limit{1000};
  };
  // Why a node was declared lost.
  struct Loss {
    std::chrono::milliseconds silent{0};  // silence when it was declared
  };

  // `node`: the node's name, the identity its NodeAgentServer connects with. The endpoint
  // must outlive the link.
  ZmqNodeAgentLink(JobControlEndpoint& endpoint, std::string node, Options options);
  ZmqNodeAgentLink(JobControlEndpoint& endpoint, std::string node)
      : ZmqNodeAgentLink(endpoint, std::move(node), Options{}) {}
  ~ZmqNodeAgentLink() override;
  ZmqNodeAgentLink(const ZmqNodeAgentLink&) = delete;
  ZmqNodeAgentLink& operator=(const ZmqNodeAgentLink&) = delete;

  // Waits up to timeout_ms for the node's hello, or any other frame it sends (events that
  // arrive meanwhile reach the sink).
  bool wait_connected(int timeout_ms);
  bool connected() const noexcept { return connected_; }

  // False also when the node is not connected or did not answer within command_timeout.
  bool command(schema::NodeCommand::Reader c) override;
  void poll(int timeout_ms) override;
  // As the node last reported them.
  std::vector<RingLevel> ring_levels() const override { return rings_; }

  // Frames from this node that failed to decode.
  uint64_t dropped() const noexcept { return dropped_; }

  // Set by poll() once the node has been silent beyond silence_limit after it connected.
  const std::optional<Loss>& lost() const noexcept { return lost_; }

 private:
  friend class JobControlEndpoint;
  void check_silence();
  // Takes every frame already queued for this node (no wait).
  void take_queued();
  // Decodes and acts on one frame; returns the sequence of a `done` (and its result in
  // `delivered`), 0 for anything else.
  uint64_t take(ipc::ReceivedFrame& frame, bool& delivered);

  JobControlEndpoint& endpoint_;
  std::string node_;
  Options options_;
  bool connected_ = false;
  uint64_t sequence_ = 0;
  uint64_t dropped_ = 0;
  std::vector<RingLevel> rings_;
  std::optional<Loss> lost_;
};

// The node's end: connects to the job controller's endpoint, hands each command to the local
// link (an InProcessLink over this host's NodeAgent) and sends up every event it delivers.
// One thread calls serve(); the local link is used on that thread only.
class NodeAgentServer {
 public:
  struct Options {
    // Between two beats of the beat thread; 0: no beat thread (a node the controller cannot
    // tell from a lost one — for tests of the frames alone).
    std::chrono::milliseconds beat_interval{100};
  };
  NodeAgentServer(NodeAgentLink& local, const ipc::JobKeys& keys,
                  const std::string& controller_endpoint, const std::string& node, Options options);
  NodeAgentServer(NodeAgentLink& local, const ipc::JobKeys& keys,
                  const std::string& controller_endpoint, const std::string& node)
      : NodeAgentServer(local, keys, controller_endpoint, node, Options{}) {}
  ~NodeAgentServer();
  NodeAgentServer(const NodeAgentServer&) = delete;
  NodeAgentServer& operator=(const NodeAgentServer&) = delete;

  // Runs for timeout_ms: commands as they come, and the local link polled in slices of at most
  // kPollSliceMs between them (the bound on a command's wait while the node is quiet).
  void serve(int timeout_ms);
  static constexpr int kPollSliceMs = 5;

  uint64_t dropped() const noexcept { return dropped_; }
  uint64_t commands() const noexcept { return commands_; }
  // Frames that could not be queued to the controller within a second (it is gone or stuck).
  uint64_t unsent() const noexcept { return unsent_; }

 private:
  void take(ipc::ReceivedFrame& frame);
  void send(capnp::MessageBuilder& message);
  void report_rings();

  // The beat thread's loop: its own dealer, so it never shares a socket with serve().
  void beat(const ipc::JobKeys& keys, const std::string& endpoint, const std::string& node,
            std::chrono::milliseconds interval);

  NodeAgentLink& local_;
  ipc::CurveDealer dealer_;
  std::mutex beat_mu_;
  std::condition_variable beat_cv_;
  bool beat_stop_ = false;
  std::thread beat_thread_;
  std::vector<RingLevel> rings_sent_;
  uint64_t dropped_ = 0;
  uint64_t commands_ = 0;
  uint64_t unsent_ = 0;
};

}  // namespace megacpp::supervisor
