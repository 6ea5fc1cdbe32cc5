// The narrow interface between the job controller (supervisor/detail/job_controller.h), which
// decides, and the node agent (supervisor/node_agent.h), which owns the processes of one host:
// commands go down, events come back, both as Cap'n Proto messages (schemas/node.capnp). On one
// host the link is in-process (InProcessLink); between hosts it is meant to be ZeroMQ, the same
// messages as frames.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "schemas/node.capnp.h"

namespace megacpp::supervisor {

// A rank's batch ring as the agent sees it: what a progress event will carry between hosts.
struct RingLevel {
  uint32_t depth = 0;
  uint32_t slots = 0;
};

class NodeAgentLink {
 public:
  using EventSink = std::function<void(schema::NodeEvent::Reader)>;

  virtual ~NodeAgentLink() = default;

  // Where the node's events go. Called from command() and poll() only, on the caller's thread.
  void connect(EventSink sink) { sink_ = std::move(sink); }

  // Hands one command to the agent. The events it causes (`started` for a launch) reach the
  // sink before it returns. False: a stop or an abort of collectives did not reach the stage
  // (its control socket is not connected yet, or it is stopped); true otherwise.
  virtual bool command(schema::NodeCommand::Reader c) = 0;

  // Waits up to timeout_ms for the node (control messages, exits, a stop request) and delivers
  // what came to the sink. Never blocks longer than timeout_ms.
  virtual void poll(int timeout_ms) = 0;

  // The attempt's batch rings, one per rank (empty: none, or not on this host).
  virtual std::vector<RingLevel> ring_levels() const = 0;

 protected:
  void deliver(schema::NodeEvent::Reader e) const {
    if (sink_) sink_(e);
  }

 private:
  EventSink sink_;
};

}  // namespace megacpp::supervisor
