// Metrics: one mutex around plain maps (updates are a few per heartbeat, a render is a few
// kilobytes once per scrape; nothing here is hot). MetricsServer: cpp-httplib, bound before
// its thread starts so a bind failure is the constructor's error.
#include "supervisor/metrics.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <httplib.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/fd.h"
#include "schemas/enums.h"
#include "schemas/run_layout.h"

namespace megacpp::supervisor {

namespace detail {

// The exit reasons counted per stage kind: a clean exit (none), then the failure kinds a
// process ends with; labelled by exit_label().
constexpr std::array<schema::FailureKind, 7> kExitReasons = {
    schema::FailureKind::NONE,          schema::FailureKind::EXITED,
    schema::FailureKind::SIGNALED,      schema::FailureKind::STALLED,
    schema::FailureKind::TORN_DOWN,     schema::FailureKind::HUNG,
    schema::FailureKind::HEARTBEAT_LOST};

std::string_view exit_label(schema::FailureKind kind) {
  return kind == schema::FailureKind::NONE ? "clean" : schemas::name(kind);
}
// Seconds; from sub-10 ms CPU toy steps to a minute-long step of a large model.
constexpr std::array<double, 14> kStepBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                 1,     2.5,  5,     10,   20,  30,   60};
constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

struct StageSeries {
  bool up = false;
  double heartbeat_ts = 0;
  double progress_ts = 0;
  uint32_t last_step = 0;
  double last_step_ts = 0;
  uint64_t restarts = 0;
};

struct TrainerSeries {
  uint64_t steps = 0;
  double tokens = 0;
  std::array<uint64_t, kStepBuckets.size()> buckets{};  // per bucket, not cumulative
  uint64_t count = 0;
  double sum = 0;
};

struct QueueSeries {
  uint32_t depth = 0;
  uint32_t capacity = 0;
};

struct MetricsState {
  std::string version, revision, torch;
  mutable std::mutex mu;
  // Keyed by (stage name, rank) so the render order is by name, then rank numerically.
  std::map<std::pair<std::string, uint32_t>, StageSeries> stages;
  std::map<std::pair<std::string, std::string>, uint64_t> exits;  // (stage name, reason)
  std::map<uint32_t, TrainerSeries> trainers;
  std::map<std::string, QueueSeries> queues;
  uint32_t checkpoint_step = 0;
  double checkpoint_duration = 0;
  double checkpoint_ts = 0;
  double collector_lag = 0;
  uint32_t validation_step = 0;  // 0: no evaluation yet (the family is left out)
  double validation_loss = 0;
  uint64_t job_restarts = 0;
  uint32_t job_nodes = 0;  // 0: one node (no job series)
  uint32_t job_node_rank = 0;
  uint32_t job_nodes_up = 0;
  std::vector<uint32_t> job_steps;  // node 0: every node's newest step

  // Callers hold mu.
  StageSeries& stage(schema::StageKind kind, uint32_t rank) {
    std::string name(layout::stage_name(kind));
    for (auto reason : kExitReasons) exits.try_emplace({name, std::string(exit_label(reason))}, 0);
    if (kind == schema::StageKind::TRAINER) trainers.try_emplace(rank);
    return stages[{std::move(name), rank}];
  }
};

struct MetricsHttp {
  httplib::Server server;
  std::atomic<bool> finished{false};
};

namespace {

void append_double(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "NaN";
  } else if (std::isinf(v)) {
    out += v > 0 ? "+Inf" : "-Inf";
  } else {
    char buf[64];
    auto r = std::to_chars(buf, buf + sizeof(buf), v);  // shortest text that round-trips
    out.append(buf, r.ptr);
  }
}

std::string fmt_double(double v) {
  std::string s;
  append_double(s, v);
  return s;
}

// Label values escape backslash, double quote and line feed (exposition format 0.0.4).
void append_label_value(std::string& out, std::string_view v) {
  for (char c : v) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
}

using Labels = std::vector<std::pair<std::string_view, std::string_view>>;

void header(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void sample(std::string& out, std::string_view name, const Labels& labels, std::string_view value) {
  out += name;
  if (!labels.empty()) {
    out += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      if (i) out += ',';
      out += labels[i].first;
      out += "=\"";
      append_label_value(out, labels[i].second);
      out += '"';
    }
    out += '}';
  }
  out += ' ';
  out += value;
  out += '\n';
}

// Why host:port cannot be bound, found by trying it with the options the server uses
// (cpp-httplib reports only that it failed). Failures are the answer here, not errors.
std::string bind_failure_reason(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
  if (rc != 0) return ::gai_strerror(rc);
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, &::freeaddrinfo);
  std::string reason = "no address to bind";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    const Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd.valid()) {
      reason = std::strerror(errno);
      continue;
    }
    int yes = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    bool ok = ::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd.get(), 1) == 0;
    int err = errno;
    if (ok) return "the address could not be bound, but is free now";
    reason = std::strerror(err);
  }
  return reason;
}

std::string host_port(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

}  // namespace
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Metrics

Metrics::Metrics(std::string version, std::string revision, std::string torch_version)
    : state_(std::make_unique<detail::MetricsState>()) {
  state_->version = std::move(version);
  state_->revision = std::move(revision);
  state_->torch = std::move(torch_version);
}

Metrics::~Metrics() = default;

void Metrics::declare_stage(schema::StageKind stage, uint32_t rank) {
  std::lock_guard lock(state_->mu);
  state_->stage(stage, rank);
}

void Metrics::set_up(schema::StageKind stage, uint32_t rank, bool up) {
  std::lock_guard lock(state_->mu);
  state_->stage(stage, rank).up = up;
}

void Metrics::set_heartbeat(schema::StageKind stage, uint32_t rank, double unix_seconds) {
  std::lock_guard lock(state_->mu);
  state_->stage(stage, rank).heartbeat_ts = unix_seconds;
}

void Metrics::set_progress(schema::StageKind stage, uint32_t rank, double unix_seconds) {
  std::lock_guard lock(state_->mu);
  state_->stage(stage, rank).progress_ts = unix_seconds;
}

void Metrics::set_last_step(schema::StageKind stage, uint32_t rank, uint32_t step,
                            double unix_seconds) {
  std::lock_guard lock(state_->mu);
  auto& s = state_->stage(stage, rank);
  s.last_step = step;
  s.last_step_ts = unix_seconds;
}

void Metrics::set_job_nodes(uint32_t nodes, uint32_t node_rank, uint32_t nodes_up) {
  std::lock_guard lock(state_->mu);
  state_->job_nodes = nodes;
  state_->job_node_rank = node_rank;
  state_->job_nodes_up = nodes_up;
}

void Metrics::set_job_steps(std::vector<uint32_t> steps) {
  std::lock_guard lock(state_->mu);
  state_->job_steps = std::move(steps);
}

void Metrics::add_job_restart() {
  std::lock_guard lock(state_->mu);
  ++state_->job_restarts;
}

void Metrics::add_restart(schema::StageKind stage, uint32_t rank) {
  std::lock_guard lock(state_->mu);
  ++state_->stage(stage, rank).restarts;
}

void Metrics::add_exit(schema::StageKind stage, schema::FailureKind reason) {
  MEGACPP_CHECK(std::find(detail::kExitReasons.begin(), detail::kExitReasons.end(), reason) !=
                    detail::kExitReasons.end(),
                ErrorKind::kInternal,
                fmt::format("{} ({}) is not an exit reason", schemas::name(reason),
                            static_cast<uint16_t>(reason)));
  std::lock_guard lock(state_->mu);
  ++state_
        ->exits[{std::string(layout::stage_name(stage)), std::string(detail::exit_label(reason))}];
  // The other reasons of this stage kind exist from now on too.
  for (auto r : detail::kExitReasons) {
    state_->exits.try_emplace(
        {std::string(layout::stage_name(stage)), std::string(detail::exit_label(r))}, 0);
  }
}

void Metrics::set_trainer_progress(uint32_t rank, uint64_t steps, double tokens) {
  std::lock_guard lock(state_->mu);
  state_->stage(schema::StageKind::TRAINER, rank);
  auto& t = state_->trainers[rank];
  t.steps = std::max(t.steps, steps);
  if (tokens > t.tokens) t.tokens = tokens;
}

void Metrics::observe_step_seconds(uint32_t rank, double seconds) {
  std::lock_guard lock(state_->mu);
  state_->stage(schema::StageKind::TRAINER, rank);
  auto& t = state_->trainers[rank];
  auto it = std::lower_bound(detail::kStepBuckets.begin(), detail::kStepBuckets.end(), seconds);
  if (it != detail::kStepBuckets.end()) ++t.buckets[it - detail::kStepBuckets.begin()];
  ++t.count;
  t.sum += seconds;
}

void Metrics::set_queue(const std::string& edge, uint32_t depth, uint32_t capacity) {
  std::lock_guard lock(state_->mu);
  state_->queues[edge] = {depth, capacity};
}

void Metrics::set_checkpoint(uint32_t step, double duration_seconds, double unix_seconds) {
  std::lock_guard lock(state_->mu);
  state_->checkpoint_step = step;
  state_->checkpoint_duration = duration_seconds;
  state_->checkpoint_ts = unix_seconds;
}

void Metrics::set_validation(uint32_t step, double loss) {
  std::lock_guard lock(state_->mu);
  if (step < state_->validation_step) return;
  state_->validation_step = step;
  state_->validation_loss = loss;
}

void Metrics::set_collector_lag(double seconds) {
  std::lock_guard lock(state_->mu);
  state_->collector_lag = seconds;
}

std::string Metrics::render() const {
  using detail::append_double;
  using detail::fmt_double;
  using detail::header;
  using detail::sample;
  const detail::MetricsState& s = *state_;
  std::lock_guard lock(s.mu);
  std::string out;
  out.reserve(4096 + 2048 * s.trainers.size());

  // Per stage: one family at a time, every (stage, rank) in each.
  struct StageGauge {
    const char* name;
    const char* type;
    const char* help;
    std::string (*value)(const detail::StageSeries&);
  };
  const StageGauge stage_families[] = {
      {"megacpp_stage_up", "gauge",
       "Whether the stage process is alive (1) or dead, stopped or not yet started (0).",
       [](const detail::StageSeries& v) { return std::string(v.up ? "1" : "0"); }},
      {"megacpp_stage_last_heartbeat_timestamp_seconds", "gauge",
       "Unix time of the stage's last heartbeat (0 before the first).",
       [](const detail::StageSeries& v) { return fmt_double(v.heartbeat_ts); }},
      {"megacpp_stage_last_progress_timestamp_seconds", "gauge",
       "Unix time at which the stage's working thread last reported progress (0 before the "
       "first; trainers report steps instead).",
       [](const detail::StageSeries& v) { return fmt_double(v.progress_ts); }},
      {"megacpp_stage_last_step", "gauge", "The last step the stage reported done.",
       [](const detail::StageSeries& v) { return std::to_string(v.last_step); }},
      {"megacpp_stage_last_step_timestamp_seconds", "gauge",
       "Unix time at which the stage last reported a step done (0 before the first).",
       [](const detail::StageSeries& v) { return fmt_double(v.last_step_ts); }},
      {"megacpp_stage_restarts_total", "counter",
       "Times the supervisor restarted this stage process.",
       [](const detail::StageSeries& v) { return std::to_string(v.restarts); }},
  };
  if (!s.stages.empty()) {
    for (const auto& f : stage_families) {
      header(out, f.name, f.type, f.help);
      for (const auto& [key, v] : s.stages) {
        std::string rank = std::to_string(key.second);
        sample(out, f.name, {{"stage", key.first}, {"rank", rank}}, f.value(v));
      }
    }
  }
  if (!s.exits.empty()) {
    header(out, "megacpp_stage_exits_total", "counter",
           "Stage process exits by reason (clean, exited, signaled, stalled, torn_down, hung, "
           "heartbeat_lost).");
    for (const auto& [key, n] : s.exits) {
      sample(out, "megacpp_stage_exits_total", {{"stage", key.first}, {"reason", key.second}},
             std::to_string(n));
    }
  }

  if (!s.trainers.empty()) {
    header(out, "megacpp_trainer_steps_total", "counter", "Optimizer steps done by the rank.");
    for (const auto& [rank, t] : s.trainers) {
      sample(out, "megacpp_trainer_steps_total", {{"rank", std::to_string(rank)}},
             std::to_string(t.steps));
    }
    header(out, "megacpp_trainer_tokens_total", "counter", "Tokens trained on by the rank.");
    for (const auto& [rank, t] : s.trainers) {
      sample(out, "megacpp_trainer_tokens_total", {{"rank", std::to_string(rank)}},
             fmt_double(t.tokens));
    }
    header(out, "megacpp_trainer_step_duration_seconds", "histogram",
           "Wall time of one training step of the rank.");
    for (const auto& [rank, t] : s.trainers) {
      std::string r = std::to_string(rank);
      uint64_t cumulative = 0;
      for (size_t i = 0; i < detail::kStepBuckets.size(); ++i) {
        cumulative += t.buckets[i];
        sample(out, "megacpp_trainer_step_duration_seconds_bucket",
               {{"rank", r}, {"le", fmt_double(detail::kStepBuckets[i])}},
               std::to_string(cumulative));
      }
      sample(out, "megacpp_trainer_step_duration_seconds_bucket", {{"rank", r}, {"le", "+Inf"}},
             std::to_string(t.count));
      sample(out, "megacpp_trainer_step_duration_seconds_sum", {{"rank", r}}, fmt_double(t.sum));
      sample(out, "megacpp_trainer_step_duration_seconds_count", {{"rank", r}},
             std::to_string(t.count));
    }
  }

  if (!s.queues.empty()) {
    header(out, "megacpp_queue_depth", "gauge", "Filled slots of the ring on this edge.");
    for (const auto& [edge, q] : s.queues) {
      sample(out, "megacpp_queue_depth", {{"edge", edge}}, std::to_string(q.depth));
    }
    header(out, "megacpp_queue_capacity", "gauge", "Slots of the ring on this edge.");
    for (const auto& [edge, q] : s.queues) {
      sample(out, "megacpp_queue_capacity", {{"edge", edge}}, std::to_string(q.capacity));
    }
  }

  header(out, "megacpp_job_restarts_total", "counter",
         "Times the supervisor relaunched the whole job from its newest committed checkpoint "
         "after a failure (--max-job-restarts).");
  sample(out, "megacpp_job_restarts_total", {}, std::to_string(s.job_restarts));
  if (s.job_nodes > 0) {
    const std::string node = std::to_string(s.job_node_rank);
    header(out, "megacpp_job_nodes", "gauge", "Nodes of the job across nodes.");
    sample(out, "megacpp_job_nodes", {{"node", node}}, std::to_string(s.job_nodes));
    header(out, "megacpp_job_nodes_up", "gauge",
           "Nodes of the job this node knows to be up (node 0: not declared lost).");
    sample(out, "megacpp_job_nodes_up", {{"node", node}}, std::to_string(s.job_nodes_up));
    if (!s.job_steps.empty()) {
      header(out, "megacpp_job_node_step", "gauge",
             "The newest step every rank of a node completed, as node 0 last read it.");
      for (size_t k = 0; k < s.job_steps.size(); ++k)
        sample(out, "megacpp_job_node_step", {{"node", std::to_string(k)}},
               std::to_string(s.job_steps[k]));
      header(out, "megacpp_job_slowest_step", "gauge",
             "The newest step every rank of every node completed (the slowest node's).");
      sample(out, "megacpp_job_slowest_step", {},
             std::to_string(*std::min_element(s.job_steps.begin(), s.job_steps.end())));
    }
  }
  header(out, "megacpp_checkpoint_last_committed_step", "gauge",
         "Step of the last committed checkpoint (0 before the first).");
  sample(out, "megacpp_checkpoint_last_committed_step", {}, std::to_string(s.checkpoint_step));
  header(out, "megacpp_checkpoint_last_duration_seconds", "gauge",
         "Seconds from snapshot to commit of the last committed checkpoint.");
  sample(out, "megacpp_checkpoint_last_duration_seconds", {}, fmt_double(s.checkpoint_duration));
  header(out, "megacpp_checkpoint_last_committed_timestamp_seconds", "gauge",
         "Unix time of the last checkpoint commit (0 before the first).");
  sample(out, "megacpp_checkpoint_last_committed_timestamp_seconds", {},
         fmt_double(s.checkpoint_ts));
  header(out, "megacpp_collector_lag_seconds", "gauge",
         "How far the collector's folded manifest trails the journals.");
  sample(out, "megacpp_collector_lag_seconds", {}, fmt_double(s.collector_lag));
  if (s.validation_step > 0) {
    header(out, "megacpp_validation_loss", "gauge",
           "Mean cross-entropy of the newest held-out evaluation on the val split.");
    sample(out, "megacpp_validation_loss", {}, fmt_double(s.validation_loss));
    header(out, "megacpp_validation_step", "gauge",
           "The step the newest held-out evaluation followed.");
    sample(out, "megacpp_validation_step", {}, std::to_string(s.validation_step));
  }
  header(out, "megacpp_build_info", "gauge", "Build identity of the supervisor; always 1.");
  sample(out, "megacpp_build_info",
         {{"version", s.version}, {"revision", s.revision}, {"torch", s.torch}}, "1");
  return out;
}

// ---------------------------------------------------------------------------------------------
// MetricsServer

MetricsServer::MetricsServer(const Metrics& metrics, const std::string& host, uint16_t port)
    : http_(std::make_unique<detail::MetricsHttp>()) {
  httplib::Server& srv = http_->server;
  // Only SO_REUSEADDR (a restart may bind over TIME_WAIT). cpp-httplib's default also sets
  // SO_REUSEPORT, which would let a second server share a port already in use.
  srv.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // These bound the destructor: a worker gives up an idle keep-alive connection after 1 s and
  // a stuck client after 2 s.
  srv.set_keep_alive_timeout(1);
  srv.set_read_timeout(2, 0);
  srv.set_write_timeout(2, 0);
  // cpp-httplib's API takes ownership of a raw TaskQueue pointer.
  srv.new_task_queue = [] { return new httplib::ThreadPool(2); };
  srv.Get("/metrics", [&metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(), detail::kContentType);
  });

  int bound = -1;
  if (port == 0) {
    bound = srv.bind_to_any_port(host);
  } else if (srv.bind_to_port(host, port)) {
    bound = port;
  }
  if (bound <= 0) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "cannot serve /metrics on {}: {}",
                 detail::host_port(host, port), detail::bind_failure_reason(host, port));
  }
  port_ = static_cast<uint16_t>(bound);

  // The serving thread and the workers it starts inherit this mask: a client that hangs up
  // mid-response then costs an EPIPE, not the process.
  sigset_t pipe, old;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  int rc = ::pthread_sigmask(SIG_BLOCK, &pipe, &old);
  MEGACPP_CHECK(rc == 0, ErrorKind::kSystem, fmt::format("pthread_sigmask: {}", strerror(rc)));
  try {
    thread_ = std::thread([http = http_.get()] {
      http->server.listen_after_bind();
      http->finished = true;
    });
  } catch (...) {
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    throw;
  }
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);

  // stop() is a no-op until the thread is listening, so the server is not handed out before.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!srv.is_running() && !http_->finished) {
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!srv.is_running()) {
    stop_and_join();
    MEGACPP_FAIL(ErrorKind::kInternal, "the /metrics server on {} did not start listening",
                 detail::host_port(host, port_));
  }
}

MetricsServer::~MetricsServer() {
  stop_and_join();
}

void MetricsServer::stop_and_join() noexcept {
  if (!thread_.joinable()) return;
  // stop() does nothing before listen_after_bind() has marked the server running (the
  // constructor waits for that, except when it gives up), and must be called only once.
  while (!http_->finished) {
    if (http_->server.is_running()) {
      http_->server.stop();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  thread_.join();
}

}  // namespace megacpp::supervisor
