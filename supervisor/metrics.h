// The supervisor's Prometheus /metrics (README.md "Metrics"): a registry of the series the
// supervisor knows about every stage it watches, rendered in the text exposition format 0.0.4, and
// a loopback HTTP server that serves it.
//
// Contract: series names are fixed (see metrics.cpp); labels only ever take bounded values
// (stage kind, rank, exit reason, queue edge, build identity), never a per-step or per-run
// value. Every method of Metrics is thread-safe: the watch loop updates while the HTTP
// thread renders. Metrics never talks to the network and never includes torch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "schemas/common.capnp.h"

namespace megacpp::supervisor {

namespace detail {
struct MetricsState;
struct MetricsHttp;
}  // namespace detail

class Metrics {
 public:
  // The three strings become megacpp_build_info's labels (escaped as label values).
  Metrics(std::string version, std::string revision, std::string torch_version);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;
  Metrics(Metrics&&) = delete;
  Metrics& operator=(Metrics&&) = delete;

  // Creates every per-stage series for (stage, rank) with up=0, so a dead stage is a 0, never
  // a missing series: the stage gauges and restarts counter, the exits counter for every
  // reason of this stage kind, and for a trainer its steps/tokens counters and histogram.
  // Idempotent: declaring again keeps the current values. The setters below declare an
  // undeclared (stage, rank) implicitly.
  void declare_stage(schema::StageKind stage, uint32_t rank);
  void set_up(schema::StageKind stage, uint32_t rank, bool up);
  void set_heartbeat(schema::StageKind stage, uint32_t rank, double unix_seconds);
  // When the stage's working thread last reported progress (its heartbeats may go on while
  // the work is wedged; this is the series to alert on).
  void set_progress(schema::StageKind stage, uint32_t rank, double unix_seconds);
  void set_last_step(schema::StageKind stage, uint32_t rank, uint32_t step, double unix_seconds);
  void add_restart(schema::StageKind stage, uint32_t rank);
  // reason: clean | exited | signaled | stalled | torn_down | hung | heartbeat_lost; any other
  // value is a bug (Error{kInternal}), since an open label set would be unbounded.
  void add_exit(schema::StageKind stage, schema::FailureKind reason);
  // Totals, not increments. A counter never goes down: a smaller total than the one already
  // recorded (a late or reordered report) is ignored.
  void set_trainer_progress(uint32_t rank, uint64_t steps, double tokens);
  // One observation of megacpp_trainer_step_duration_seconds (buckets 0.005 s .. 60 s).
  void observe_step_seconds(uint32_t rank, double seconds);
  // edge names one ring, e.g. "data_loader->trainer-0"; the set of edges must be fixed by the
  // stage graph (it is a label).
  void set_queue(const std::string& edge, uint32_t depth, uint32_t capacity);
  // The last committed checkpoint. Before the first commit the three gauges read 0.
  void set_checkpoint(uint32_t step, double duration_seconds, double unix_seconds);
  void set_collector_lag(double seconds);
  // The newest held-out evaluation (README.md "Validation loss"): megacpp_validation_loss and
  // megacpp_validation_step. Absent before the first. An older step than the one recorded is
  // ignored.
  void set_validation(uint32_t step, double loss);
  // One automatic job restart (--max-job-restarts): the whole stage graph relaunched from the
  // newest committed checkpoint.
  void add_job_restart();
  // A job across nodes: its node count, this node's rank, and how many nodes this node knows to
  // be up (node 0: every node its job watch has not declared lost). Absent on one node.
  void set_job_nodes(uint32_t nodes, uint32_t node_rank, uint32_t nodes_up);
  // Node 0 of a job across nodes: every node's newest step (its slowest rank's), as the job
  // watch last read them: megacpp_job_node_step{node} and megacpp_job_slowest_step.
  void set_job_steps(std::vector<uint32_t> steps);

  // Prometheus text exposition format 0.0.4. Deterministic: families in a fixed order, series
  // sorted by their labels (stage by name, rank numerically). Families without a series yet
  // (e.g. queues before the first set_queue) are left out.
  std::string render() const;

 private:
  std::unique_ptr<detail::MetricsState> state_;
};

// Serves GET /metrics (content type exactly "text/plain; version=0.0.4; charset=utf-8") and
// 404 on any other path, from its own threads, until destroyed.
//
// host is an address to bind (callers default to 127.0.0.1); port 0 binds an ephemeral port,
// which port() reports. A port that cannot be bound throws
// Error{kInvalidArgument, "cannot serve /metrics on HOST:PORT: <reason>"} from the
// constructor. SIGPIPE is blocked on the serving threads, so a client that hangs up cannot
// kill the process. The destructor stops accepting and joins; it is bounded by the
// connection timeouts (about a second for an idle keep-alive connection, a few seconds for a
// client stuck mid-request). `metrics` must outlive the server.
class MetricsServer {
 public:
  MetricsServer(const Metrics& metrics, const std::string& host, uint16_t port);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  MetricsServer(MetricsServer&&) = delete;
  MetricsServer& operator=(MetricsServer&&) = delete;

  uint16_t port() const { return port_; }

 private:
  void stop_and_join() noexcept;

  std::unique_ptr<detail::MetricsHttp> http_;
  uint16_t port_ = 0;
  std::thread thread_;
};

}  // namespace megacpp::supervisor
