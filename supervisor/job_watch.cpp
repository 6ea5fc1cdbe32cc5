#include "supervisor/job_watch.h"

#include <pthread.h>
#include <signal.h>

#include <memory>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "supervisor/rendezvous.h"

namespace megacpp::supervisor {

namespace {

using Clock = std::chrono::steady_clock;

int64_t mono_of(Clock::time_point t) {
  // steady_clock is CLOCK_MONOTONIC on Linux: the same clock as mono_ns().
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The job's failure as `failure` holds it: "<kind> <node>\n<what>", kind "lost" (node 0 declared
// <node> lost) or "failed" (<node> offered its own first failure).
std::string encode(JobWatch::Verdict::Kind kind, uint32_t node, const std::string& what) {
  return fmt::format("{} {}\n{}", kind == JobWatch::Verdict::Kind::kNodeLost ? "lost" : "failed",
                     node, what);
}

std::optional<JobWatch::Verdict> decode(const std::string& text) {
  const auto nl = text.find('\n');
  const auto sp = text.find(' ');
  if (nl == std::string::npos || sp == std::string::npos || sp > nl) return std::nullopt;
  JobWatch::Verdict v;
  const std::string kind = text.substr(0, sp);
  if (kind == "lost") {
    v.kind = JobWatch::Verdict::Kind::kNodeLost;
  } else if (kind == "failed") {
    v.kind = JobWatch::Verdict::Kind::kNodeFailed;
  } else {
    return std::nullopt;
  }
  try {
    v.node = static_cast<uint32_t>(std::stoul(text.substr(sp + 1, nl - sp - 1)));
  } catch (const std::exception&) {
    return std::nullopt;
  }
  v.message = text.substr(nl + 1);
  return v;
}

}  // namespace

JobWatch::JobWatch(const NodePlacement& placement, std::string prefix, Options options,
                   SealedRecords::Seal seal)
    : node_(placement.node_rank),
      nodes_(placement.nodes),
      prefix_(std::move(prefix)),
      hosts_(placement.hosts),
      options_(options),
      seal_(std::move(seal)) {
  MEGACPP_CHECK(nodes_ > 1 && node_ < nodes_ && !prefix_.empty(), ErrorKind::kInvalidArgument,
                fmt::format("a job watch of node {} of {}", node_, nodes_));
  thread_ = std::thread([this, host = placement.master_host,
                         port = static_cast<uint16_t>(placement.master_port)] { run(host, port); });
}

JobWatch::~JobWatch() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void JobWatch::report(std::string what) {
  {
    std::lock_guard lk(mu_);
    if (report_) return;
    report_ = std::move(what);
  }
  cv_.notify_all();
}

std::optional<JobWatch::Verdict> JobWatch::verdict() const {
  std::lock_guard lk(mu_);
  return verdict_;
}

void JobWatch::suspect() {
  {
    std::lock_guard lk(mu_);
    suspect_ = true;
  }
  cv_.notify_all();
}

void JobWatch::committed(uint32_t step) {
  std::lock_guard lk(mu_);
  committed_ = std::max(committed_, step);
}

std::optional<uint32_t> JobWatch::job_committed() const {
  std::lock_guard lk(mu_);
  return job_committed_;
}

void JobWatch::progress(uint32_t step) {
  std::lock_guard lk(mu_);
  progress_ = std::max(progress_, step);
}

std::vector<JobWatch::NodeView> JobWatch::nodes() const {
  std::lock_guard lk(mu_);
  return view_;
}

void JobWatch::finish() {
  {
    std::lock_guard lk(mu_);
    finishing_ = true;
  }
  cv_.notify_all();
}

bool JobWatch::wait_finished(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  return cv_.wait_for(lk, timeout, [&] { return finished_ || stop_; }) && finished_;
}

uint64_t JobWatch::forged_records() const {
  std::lock_guard lk(mu_);
  return forged_;
}

uint32_t JobWatch::lost_nodes() const {
  std::lock_guard lk(mu_);
  return lost_count_;
}

void JobWatch::decide(Verdict v) {
  std::lock_guard lk(mu_);
  if (!verdict_ && !finishing_) verdict_ = std::move(v);
}

void JobWatch::run(std::string host, uint16_t port) {
  // A write to node 0's store after it died is EPIPE for this thread, not a SIGPIPE that would
  // end the supervisor (SIGPIPE from a write is directed at the writing thread).
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  const std::string me = std::to_string(node_);
  auto key = [&](std::string_view what) { return fmt::format("{}/{}", prefix_, what); };
  auto host_of = [&](uint32_t k) {
    return k < hosts_.size() ? fmt::format("node {} ({})", k, hosts_[k])
                             : fmt::format("node {}", k);
  };
  Clock::time_point last_answer = Clock::now();
  auto node0_lost = [&](const std::string& why) {
    decide({Verdict::Kind::kNodeLost, 0,
            fmt::format("node 0 ({}:{}, the job's store) unreachable: {}", host, port, why),
            mono_of(last_answer + options_.beat)});
  };
  std::unique_ptr<StoreClient> store;
  try {
    store = std::make_unique<StoreClient>(host, port, options_.store_timeout);
  } catch (const std::exception& e) {
    node0_lost(std::string(user_message(e)));
    return;
  }
  // Every record this watch reads or writes, but the `failures` and `suspect` markers, sealed
  // with the job's keys (SealedRecords).
  auto rec = std::make_unique<SealedRecords>(*store, seal_);
  int64_t beat = 0;
  uint32_t published = 0, published_progress = 0;  // what committed/<me>, progress/<me> hold
  std::vector<NodeView> view(node_ == 0 ? nodes_ : 0);
  auto publish_commit = [&] {
    uint32_t mine = 0, step = 0;
    {
      std::lock_guard lk(mu_);
      mine = committed_;
      step = progress_;
    }
    if (mine > published) {
      rec->set(key("committed/" + me), std::to_string(mine));
      published = mine;
    }
    if (step > published_progress) {
      rec->set(key("progress/" + me), std::to_string(step));
      published_progress = step;
    }
    if (node_ == 0) {
      view[0].step = step;
      view[0].committed = mine;
    }
  };
  auto set_job_committed = [&](uint32_t step) {
    std::lock_guard lk(mu_);
    if (step > 0 && (!job_committed_ || step > *job_committed_)) job_committed_ = step;
  };
  auto read_step = [&](const std::string& k) -> uint32_t {
    const auto v = rec->get(key(k), std::chrono::milliseconds(0));
    return v ? static_cast<uint32_t>(std::stoul(*v)) : 0;
  };
  // Node 0: the newest step every node committed, published when it moves.
  uint32_t job_published = 0;
  auto fold_commits = [&] {
    uint32_t lowest = published;
    for (uint32_t k = 1; k < nodes_; ++k) {
      view[k].committed = read_step(fmt::format("committed/{}", k));
      view[k].step = read_step(fmt::format("progress/{}", k));
      lowest = std::min(lowest, view[k].committed);
    }
    if (lowest > job_published) {
      rec->set(key("job_committed"), std::to_string(lowest));
      job_published = lowest;
      set_job_committed(lowest);
    }
    std::lock_guard lk(mu_);
    view_ = view;
  };
  std::vector<int64_t> beats(nodes_, -1);
  std::vector<Clock::time_point> changed(nodes_, Clock::now());
  std::vector<bool> lost(nodes_, false);
  std::vector<bool> peers_finished(nodes_, false);  // node 0: nodes that said they finished
  bool reported = false, finished_self = false, suspected = false, told_suspicion = false,
       told_suspicion_store = false;
  try {
    for (;;) {
      std::optional<std::string> report;
      bool finishing = false;
      {
        std::unique_lock lk(mu_);
        cv_.wait_for(lk, options_.beat, [&] {
          return stop_ || (finishing_ && !finished_self) || (!reported && report_) ||
                 (suspect_ && !told_suspicion);
        });
        if (stop_) return;
        finishing = finishing_;
        if (!reported && report_) report = report_;
        if (suspect_ && !told_suspicion) {
          told_suspicion = true;
          suspected = true;
        }
      }
      if (suspected && node_ != 0 && !told_suspicion_store) {
        told_suspicion_store = true;
        store->set(key("suspect"), me);
      }
      if (report) {
        reported = true;
        if (store->add(key("failures"), 1) == 1)
          rec->set(key("failure"), encode(Verdict::Kind::kNodeFailed, node_, *report));
      }
      if (finishing && !finished_self) {
        publish_commit();  // its final step, before it says it finished
        rec->set(key("finished/" + me), "1");
        finished_self = true;
        if (node_ == 0) view[0].finished = true;
      }
      if (finishing) {
        // Node 0 stays until every node that is not lost has finished, then folds their final
        // commits; the others wait for that fold to reach their own final step.
        bool all = true;
        if (node_ != 0) {
          set_job_committed(read_step("job_committed"));
          std::lock_guard lk(mu_);
          all = committed_ == 0 || (job_committed_ && *job_committed_ >= committed_);
        } else {
          for (uint32_t k = 1; k < nodes_; ++k) {
            if (lost[k] || peers_finished[k]) continue;
            if (rec->get(key(fmt::format("finished/{}", k)), std::chrono::milliseconds(0)))
              peers_finished[k] = view[k].finished = true;
            else
              all = false;
          }
        }
        if (all && node_ == 0) fold_commits();
        if (all) {
          std::lock_guard lk(mu_);
          finished_ = true;
          cv_.notify_all();
          return;
        }
        continue;
      }
      rec->set(key("beat/" + me), std::to_string(++beat));
      last_answer = Clock::now();
      publish_commit();
      {
        std::lock_guard lk(mu_);
        forged_ = rec->forged();
      }
      if (node_ == 0)
        fold_commits();
      else
        set_job_committed(read_step("job_committed"));
      if (auto f = rec->get(key("failure"), std::chrono::milliseconds(0))) {
        if (auto v = decode(*f);
            v && !(v->kind == Verdict::Kind::kNodeFailed && v->node == node_)) {
          if (v->kind == Verdict::Kind::kNodeFailed)
            v->message = fmt::format("{} failed first: {}", host_of(v->node), v->message);
          v->evidence_ns = mono_of(Clock::now());
          decide(std::move(*v));
        }
      }
      if (node_ != 0) continue;
      if (!suspected && store->get(key("suspect"), std::chrono::milliseconds(0))) suspected = true;
      const auto limit = suspected ? std::min(options_.silence_limit, options_.suspected_silence)
                                   : options_.silence_limit;
      for (uint32_t k = 1; k < nodes_; ++k) {
        if (lost[k] || peers_finished[k]) continue;
        // A beat counts only when it is the node's (sealed) and newer: a replayed older one
        // does not hide a silence.
        int64_t b = beats[k];
        if (const auto v = rec->get(key(fmt::format("beat/{}", k)), std::chrono::milliseconds(0)))
          b = std::max(b, static_cast<int64_t>(std::stoll(*v)));
        const Clock::time_point now = Clock::now();
        if (b != beats[k]) {
          beats[k] = b;
          changed[k] = now;
          continue;
        }
        if (now - changed[k] <= limit) continue;
        if (rec->get(key(fmt::format("finished/{}", k)), std::chrono::milliseconds(0))) {
          peers_finished[k] = view[k].finished = true;
          continue;
        }
        lost[k] = view[k].lost = true;
        {
          std::lock_guard lk(mu_);
          ++lost_count_;
          view_ = view;  // before the verdict: whoever reads the verdict sees the node lost
        }
        const double silent = std::chrono::duration<double>(now - changed[k]).count();
        const std::string what =
            fmt::format("{} lost: no beat for {:.2f} s (dead, hung, or cut off from node 0)",
                        host_of(k), silent);
        // The job's first failure, unless a node offered one before.
        if (store->add(key("failures"), 1) == 1)
          rec->set(key("failure"), encode(Verdict::Kind::kNodeLost, k, what));
        decide({Verdict::Kind::kNodeLost, k, what, mono_of(changed[k] + options_.beat)});
      }
    }
  } catch (const std::exception& e) {
    // Node 0's own store failing under it is as fatal to the job as its loss.
    node0_lost(std::string(user_message(e)));
  }
}

}  // namespace megacpp::supervisor
