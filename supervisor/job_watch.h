// megacpp::supervisor JobWatch — a job across nodes watches itself through node 0's c10d store
// (DESIGN.md "Failures across nodes"): every node beats, node 0 declares a node that goes silent
// lost, and the first failure any node offers becomes the job's, which every other node reads
// and tears down for. Torch-free (the store through libmegacpp_store.so, rendezvous.h).
//
// Keys, under the job's secret prefix: `beat/<r>` (node r's beat number, raised every beat),
// `finished/<r>` (node r's part of the job is done: silence after it is no loss), `failures` (a
// counter: the node whose add returns 1 offers the job's first failure), `failure`
// ("<node>\n<what>", set once by that node), `committed/<r>` (the newest step node r committed
// its part of), `job_committed` (node 0: the newest step every node committed, the job's
// LATEST — the second phase of a job's checkpoint) and `progress/<r>` (node r's newest step).
//
// Liveness: every other node's watch keeps one TCP connection to node 0's watch (its port in
// `liveness`), opened with a sealed hello naming the node. The kernel closes it when the node's
// supervisor dies, whatever killed it, so node 0 names a killed node as soon as the close
// arrives instead of after its silence; a hung node or a cut link closes nothing and is judged
// by its silence as before. A node that finished closes it too: `finished/<r>` is read first.
// The connection also carries nudges, one byte that says "read the job's failure record now":
// a node that offered the job's first failure nudges node 0, node 0 then nudges every node, so
// a failure reaches every node in a few round trips instead of a beat or two. A nudge carries
// nothing to trust: what it makes a node read is the sealed record.
//
// Threads: one of its own, with a StoreClient of its own (a client is for one thread); every
// public call only takes a mutex. Blocking: the thread's store calls are bounded by the
// client's timeout (Options::store_timeout), so a hung or unreachable node 0 is a verdict
// after at most that long, never a hang.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/fd.h"
#include "supervisor/placement.h"
#include "supervisor/rendezvous.h"

namespace megacpp::supervisor {

class JobWatch {
 public:
  struct Options {
    std::chrono::milliseconds beat{100};
    // Node 0 declares a node lost after this long without a beat: ten beats, the goal
    // for a dead node (<= 1 s), well inside the heartbeat budget for a hung node or a cut link.
    std::chrono::milliseconds silence_limit{1000};
    // Every store call of a node other than node 0 waits at most this long: node 0 hung or cut
    // off is a verdict after it.
    std::chrono::milliseconds store_timeout{2000};
    // The silence that makes a node lost once a node suspected one (suspect()): three beats.
    std::chrono::milliseconds suspected_silence{300};
    // A node other than 0 keeps its liveness connection to node 0 (above); off, its death is
    // judged by its silence alone (tests of the silence).
    bool liveness = true;
  };
  struct Verdict {
    enum class Kind : uint8_t {
      kNodeLost,    // `node` went silent (node 0's view), or node 0 became unreachable
      kNodeFailed,  // `node` offered the job's first failure (`message`)
    };
    Kind kind = Kind::kNodeLost;
    uint32_t node = 0;
    std::string message;  // one line, naming the node
    // When the node's silence began (CLOCK_MONOTONIC ns: its last beat seen, plus one beat);
    // for kNodeFailed, when this node read it.
    int64_t evidence_ns = 0;
  };

  // Starts beating at once. `prefix` is the job's store prefix (ipc::job_store_prefix).
  // Throws what StoreClient's constructor throws (node 0's store unreachable).
  // `seal`: the job's record sealer (ipc::RecordSealer); empty, records go unsealed (tests).
  JobWatch(const NodePlacement& placement, std::string prefix, Options options,
           SealedRecords::Seal seal = {});
  JobWatch(const NodePlacement& placement, std::string prefix)
      : JobWatch(placement, std::move(prefix), Options{}) {}
  ~JobWatch();
  JobWatch(const JobWatch&) = delete;
  JobWatch& operator=(const JobWatch&) = delete;

  // This node's first failure, offered as the job's (one line). Only the first call counts;
  // the thread publishes it within one beat.
  void report(std::string what);
  // The job's verdict for this node, once there is one (then it does not change). Never this
  // node's own reported failure.
  std::optional<Verdict> verdict() const;
  // An eventfd that becomes readable when verdict() is first set: the supervisor's loop polls
  // it beside its other descriptors, so a verdict is acted on at once instead of at the loop's
  // next timeout. The reader drains it (read 8 bytes); verdict() stays the state.
  int wake_fd() const { return wake_.get(); }
  // A rank of this node lost a peer (its collective's connection closed): some node may be
  // dead. Node 0 then judges every node by a shorter silence (Options::suspected_silence), so
  // a dead node is named within a few beats instead of the silence limit. Any node may call
  // it; it travels through the store (`watch/suspect`).
  void suspect();
  // This node committed its part of `step` (the first phase of the job's checkpoint): published
  // within a beat; node 0 folds every node's into job_committed().
  void committed(uint32_t step);
  // The newest step every node of the job committed its part of, once there is one.
  std::optional<uint32_t> job_committed() const;
  // The newest step every rank of this node completed: published within a beat (`progress/<r>`).
  void progress(uint32_t step);
  // Node 0's view of every node (its own included), as of its last beat; empty on other nodes.
  struct NodeView {
    uint32_t step = 0;       // its progress()
    uint32_t committed = 0;  // its committed()
    bool lost = false;       // declared lost by node 0
    bool finished = false;   // said it finished
  };
  std::vector<NodeView> nodes() const;
  // This node's part of the job is done (its final checkpoint committed and passed to
  // committed()): says so to node 0 and stops beating and judging (a node that finished is not
  // lost, and node 0 going away after the job is no loss).
  void finish();
  // At the end of the job, after finish(): node 0 waits up to `timeout` for every node that is
  // not lost to have finished, folds their final commits, and waits for each of them to have
  // read the fold, so that none loses node 0's store while it still needs it; another node waits
  // for job_committed() to reach its own final step and says it read it. False when that did
  // not happen in time.
  bool wait_finished(std::chrono::milliseconds timeout);
  // Nodes node 0 has declared lost (always 0 on other nodes).
  uint32_t lost_nodes() const;
  // Records read whose seal was not the job's (a peer without the keys wrote them); ignored.
  uint64_t forged_records() const;

 private:
  class Liveness;
  void run(std::string host, uint16_t port);
  void decide(Verdict v);
  void wake_thread();  // cv_ and thread_wake_: a public call's news for the thread
  std::string hello_text(uint32_t node) const;  // what a node's liveness hello seals

  const uint32_t node_, nodes_;
  const std::string prefix_;
  const std::vector<std::string> hosts_;
  const Options options_;
  const SealedRecords::Seal seal_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool finishing_ = false;
  bool finished_ = false;  // the thread set finished/<node> and ended
  bool suspect_ = false;
  uint32_t lost_count_ = 0;
  uint64_t forged_ = 0;
  uint32_t committed_ = 0;
  uint32_t progress_ = 0;
  std::optional<uint32_t> job_committed_;
  std::vector<NodeView> view_;  // node 0
  // Node 0: nodes whose liveness connection closed (node, when), not yet judged.
  std::vector<std::pair<uint32_t, int64_t>> closed_;
  std::unique_ptr<Liveness> liveness_;  // node 0
  std::optional<std::string> report_;
  std::optional<Verdict> verdict_;
  Fd wake_;             // wake_fd()
  Fd thread_wake_;      // the thread's wait ends when written (wake_thread)
  bool nudge_ = false;  // node 0: a node nudged on its liveness connection (its failure offered)
  std::thread thread_;
};

}  // namespace megacpp::supervisor
