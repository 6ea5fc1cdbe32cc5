#include "supervisor/job_watch.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "core/fd.h"
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

// `host`'s first IPv4 address (a name or an address), with `port`.
std::optional<sockaddr_in> resolve4(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr)
    return std::nullopt;
  sockaddr_in a{};
  std::memcpy(&a, res->ai_addr, sizeof a);
  ::freeaddrinfo(res);
  a.sin_port = htons(port);
  return a;
}

// Node k's side: a connection to node 0's liveness port carrying its hello, then nothing; an
// invalid Fd when node 0 cannot be reached within `timeout` (the silence still judges).
Fd connect_liveness(const std::string& host, uint16_t port, std::string_view hello,
                    std::chrono::milliseconds timeout) {
  const auto addr = resolve4(host, port);
  if (!addr) return Fd();
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0) return Fd();
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) != 0) {
    if (errno != EINPROGRESS) return Fd();
    pollfd p{fd.get(), POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof err;
    if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1 ||
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)
      return Fd();
  }
  std::string line(hello);
  line += '\n';
  if (::send(fd.get(), line.data(), line.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(line.size()))
    return Fd();
  return fd;
}

}  // namespace

// Node 0's side: a listening socket on the master address and a thread that accepts each
// node's connection, checks its hello (node and seal) and reports the node when its connection
// closes (EOF or an error: the process that held it is gone).
class JobWatch::Liveness {
 public:
  Liveness(const std::string& host, std::function<std::optional<uint32_t>(std::string_view)> hello,
           std::function<void(uint32_t, int64_t)> closed, std::function<void()> nudged)
      : hello_(std::move(hello)), closed_(std::move(closed)), nudged_(std::move(nudged)) {
    const auto addr = resolve4(host, 0);
    MEGACPP_CHECK(addr.has_value(), ErrorKind::kInvalidArgument,
                  fmt::format("the job's master address {} does not resolve to IPv4", host));
    listen_ = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    SYSCALL_CHECK(listen_.get());
    SYSCALL_CHECK(::bind(listen_.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr));
    SYSCALL_CHECK(::listen(listen_.get(), 64));
    sockaddr_in bound{};
    socklen_t len = sizeof bound;
    SYSCALL_CHECK(::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&bound), &len));
    port_ = ntohs(bound.sin_port);
    int pipe_fds[2];
    SYSCALL_CHECK(::pipe2(pipe_fds, O_CLOEXEC));
    wake_read_ = Fd(pipe_fds[0]);
    wake_write_ = Fd(pipe_fds[1]);
    thread_ = std::thread([this] { run(); });
  }
  ~Liveness() {
    const char c = 0;
    if (::write(wake_write_.get(), &c, 1) < 0) {
      // The pipe is ours and empty: a failed write leaves only the poll timeout below.
    }
    if (thread_.joinable()) thread_.join();
  }
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;
  uint16_t port() const noexcept { return port_; }
  // One byte to every node's connection (by the thread): a failure record to read now.
  void nudge_all() {
    const char c = 'N';
    if (::write(wake_write_.get(), &c, 1) < 0) {
      // Full pipe: nudges already queued do the same.
    }
  }

 private:
  void run() {
    struct Peer {
      Fd fd;
      std::optional<uint32_t> node;  // once its hello checked
      std::string hello;
    };
    std::map<int, Peer> peers;
    for (;;) {
      std::vector<pollfd> fds{{wake_read_.get(), POLLIN, 0}, {listen_.get(), POLLIN, 0}};
      for (const auto& [fd, p] : peers) fds.push_back({fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 1000) < 0 && errno != EINTR) return;
      if (fds[0].revents != 0) {
        char cmd[64];
        const ssize_t got = ::read(wake_read_.get(), cmd, sizeof cmd);
        if (got <= 0 || std::memchr(cmd, 0, static_cast<size_t>(got)) != nullptr) return;
        for (const auto& [fd, p] : peers)
          if (p.node) ::send(fd, "F", 1, MSG_NOSIGNAL | MSG_DONTWAIT);  // lost: its beat's read
      }
      if (fds[1].revents & POLLIN) {
        Fd c(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (c.get() >= 0) {
          const int fd = c.get();
          peers[fd].fd = std::move(c);
        }
      }
      for (size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        auto it = peers.find(fds[i].fd);
        char buf[256];
        const ssize_t n = ::recv(fds[i].fd, buf, sizeof buf, 0);
        if (n > 0 && !it->second.node) {
          it->second.hello.append(buf, static_cast<size_t>(n));
          const auto nl = it->second.hello.find('\n');
          if (nl != std::string::npos) {
            it->second.node = hello_(std::string_view(it->second.hello).substr(0, nl));
            if (!it->second.node) peers.erase(it);  // not a node of this job
          } else if (it->second.hello.size() > 512) {
            peers.erase(it);
          }
          continue;
        }
        if (n > 0) {  // after its hello, a node only nudges: it offered a failure
          nudged_();
          continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (it->second.node) closed_(*it->second.node, mono_ns());
        peers.erase(it);
      }
    }
  }
  std::function<std::optional<uint32_t>(std::string_view)> hello_;
  std::function<void(uint32_t, int64_t)> closed_;
  std::function<void()> nudged_;
  Fd listen_, wake_read_, wake_write_;
  uint16_t port_ = 0;
  std::thread thread_;
};

std::string JobWatch::hello_text(uint32_t node) const {
  return fmt::format("liveness\n{}\n{}", prefix_, node);
}

JobWatch::JobWatch(const NodePlacement& placement, std::string prefix, Options options,
                   SealedRecords::Seal seal)
    : node_(placement.node_rank),
      nodes_(placement.nodes),
      prefix_(std::move(prefix)),
      hosts_(placement.hosts),
      options_(options),
      seal_(std::move(seal)),
      wake_(SYSCALL_CHECK(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK))),
      thread_wake_(SYSCALL_CHECK(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK))) {
  MEGACPP_CHECK(nodes_ > 1 && node_ < nodes_ && !prefix_.empty(), ErrorKind::kInvalidArgument,
                fmt::format("a job watch of node {} of {}", node_, nodes_));
  if (node_ == 0) {
    try {
      liveness_ = std::make_unique<Liveness>(
          placement.master_host,
          [this](std::string_view line) -> std::optional<uint32_t> {
            const auto sp = line.find(' ');
            uint32_t k = 0;
            try {
              k = static_cast<uint32_t>(std::stoul(std::string(line.substr(0, sp))));
            } catch (const std::exception&) {
              return std::nullopt;
            }
            if (k == 0 || k >= nodes_) return std::nullopt;
            if (seal_ && (sp == std::string_view::npos ||
                          !seal_matches(seal_, hello_text(k), line.substr(sp + 1))))
              return std::nullopt;
            return k;
          },
          [this](uint32_t k, int64_t when) {
            {
              std::lock_guard lk(mu_);
              closed_.emplace_back(k, when);
            }
            cv_.notify_all();
          },
          [this] {
            {
              std::lock_guard lk(mu_);
              nudge_ = true;
            }
            cv_.notify_all();
          });
    } catch (const std::exception& e) {
      // Silence alone still judges every node; only the faster word on a killed one is lost.
      log_warn(
          "the job watch's liveness port on {} could not be opened ({}); a killed node is "
          "named after its silence",
          placement.master_host, user_message(e));
    }
  }
  thread_ = std::thread([this, host = placement.master_host,
                         port = static_cast<uint16_t>(placement.master_port)] { run(host, port); });
}

void JobWatch::wake_thread() {
  cv_.notify_all();
  const uint64_t one = 1;
  [[maybe_unused]] const auto n = ::write(thread_wake_.get(), &one, sizeof one);
}

JobWatch::~JobWatch() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  wake_thread();
  if (thread_.joinable()) thread_.join();
}

void JobWatch::report(std::string what) {
  {
    std::lock_guard lk(mu_);
    if (report_) return;
    report_ = std::move(what);
  }
  wake_thread();
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
  wake_thread();
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
  wake_thread();
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
  if (verdict_ || finishing_) return;
  verdict_ = std::move(v);
  const uint64_t one = 1;
  // Cannot fail short of a counter at its maximum, which one write per verdict never reaches.
  [[maybe_unused]] const auto n = ::write(wake_.get(), &one, sizeof one);
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
  if (liveness_) rec->set(key("liveness"), std::to_string(liveness_->port()));
  Fd link;  // a node other than 0: its liveness connection to node 0, once made
  constexpr uint32_t kLinkTries = 50;
  uint32_t link_tries = 0;
  // Node 0: every node reads the job's failure record now instead of at its next beat.
  bool told_all = false;
  auto tell_all = [&] {
    if (told_all || !liveness_) return;
    told_all = true;
    liveness_->nudge_all();
  };
  auto connect_link = [&] {
    if (node_ == 0 || !options_.liveness || link.get() >= 0 || link_tries >= kLinkTries) return;
    ++link_tries;
    const auto p = rec->get(key("liveness"), std::chrono::milliseconds(0));
    if (!p) return;
    const std::string hello =
        seal_ ? fmt::format("{} {}", node_, seal_(hello_text(node_))) : std::to_string(node_);
    link = connect_liveness(host, static_cast<uint16_t>(std::stoul(*p)), hello,
                            std::chrono::milliseconds(100));
  };
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
  std::vector<bool> peers_read(nodes_, false);      // node 0: nodes that read the final fold
  bool final_fold = false;  // node 0: every node finished and their final commits are folded
  bool reported = false, finished_self = false, suspected = false, told_suspicion = false,
       told_suspicion_store = false;
  connect_link();  // at once when node 0's port is known: a death in the first beat closes it
  try {
    for (;;) {
      std::optional<std::string> report;
      bool finishing = false;
      {
        std::unique_lock lk(mu_);
        auto ready = [&] {
          return stop_ || (finishing_ && !finished_self) || (!reported && report_) ||
                 (suspect_ && !told_suspicion) || (!closed_.empty() && !finishing_) || nudge_;
        };
        if (link.get() < 0) {
          cv_.wait_for(lk, options_.beat, ready);
        } else if (!ready()) {
          // A node other than 0 also wakes for node 0's nudge on its liveness connection.
          lk.unlock();
          pollfd w[2] = {{thread_wake_.get(), POLLIN, 0}, {link.get(), POLLIN, 0}};
          if (::poll(w, 2, static_cast<int>(options_.beat.count())) > 0) {
            uint64_t n = 0;
            if (w[0].revents != 0 && ::read(thread_wake_.get(), &n, sizeof n) < 0) {
              // Drained already.
            }
            if (w[1].revents != 0) {
              char b[64];
              const ssize_t got = ::recv(link.get(), b, sizeof b, MSG_DONTWAIT);
              // Node 0 closed it (its end, or its death: the store says which): no more nudges.
              if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
                link.reset();
                link_tries = kLinkTries;
              }
            }
          }
          lk.lock();
        }
        nudge_ = false;
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
        if (store->add(key("failures"), 1) == 1) {
          rec->set(key("failure"), encode(Verdict::Kind::kNodeFailed, node_, *report));
          // Node 0 reads it now, and tells every other node, instead of at their next beats.
          if (link.get() >= 0) ::send(link.get(), "F", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
          tell_all();
        }
      }
      if (finishing && !finished_self) {
        publish_commit();  // its final step, before it says it finished
        rec->set(key("finished/" + me), "1");
        finished_self = true;
        if (node_ == 0) view[0].finished = true;
      }
      if (finishing) {
        // Node 0 stays until every node that is not lost has finished, then folds their final
        // commits; the others wait for that fold to reach their own final step, and say they
        // read it (`read/<k>`): node 0's store goes with node 0, so node 0 also stays until
        // every node that finished has read the fold (a node whose next beat came after the
        // store went would never learn that its final step is the job's).
        bool all = true;
        if (node_ != 0) {
          set_job_committed(read_step("job_committed"));
          {
            std::lock_guard lk(mu_);
            all = committed_ == 0 || (job_committed_ && *job_committed_ >= committed_);
          }
          if (all) rec->set(key("read/" + me), "1");
        } else {
          for (uint32_t k = 1; k < nodes_; ++k) {
            if (lost[k] || peers_finished[k]) continue;
            if (rec->get(key(fmt::format("finished/{}", k)), std::chrono::milliseconds(0)))
              peers_finished[k] = view[k].finished = true;
            else
              all = false;
          }
          if (all) {
            // Once: a node that finished publishes nothing more.
            if (!final_fold) fold_commits();
            final_fold = true;
            for (uint32_t k = 1; k < nodes_ && all; ++k) {
              if (lost[k] || peers_read[k]) continue;
              peers_read[k] = rec->get(key(fmt::format("read/{}", k)), std::chrono::milliseconds(0))
                                  .has_value();
              all = peers_read[k];
            }
          }
        }
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
      connect_link();
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
          tell_all();
        }
      }
      if (node_ != 0) continue;
      if (!suspected && store->get(key("suspect"), std::chrono::milliseconds(0))) suspected = true;
      const auto limit = suspected ? std::min(options_.silence_limit, options_.suspected_silence)
                                   : options_.silence_limit;
      auto declare_lost = [&](uint32_t k, const std::string& what, int64_t evidence_ns) {
        lost[k] = view[k].lost = true;
        {
          std::lock_guard lk(mu_);
          ++lost_count_;
          view_ = view;  // before the verdict: whoever reads the verdict sees the node lost
        }
        // The job's first failure, unless a node offered one before: then that one is the
        // job's (a node that failed first and then closed its connection is named for its
        // failure, not for the close). It is written just after its offer: wait a beat for it.
        if (store->add(key("failures"), 1) != 1) {
          if (auto f = rec->get(key("failure"), options_.beat)) {
            if (auto v = decode(*f)) {
              if (v->kind == Verdict::Kind::kNodeFailed)
                v->message = fmt::format("{} failed first: {}", host_of(v->node), v->message);
              v->evidence_ns = mono_of(Clock::now());
              decide(std::move(*v));
              return;
            }
          }
        } else {
          rec->set(key("failure"), encode(Verdict::Kind::kNodeLost, k, what));
          tell_all();
        }
        decide({Verdict::Kind::kNodeLost, k, what, evidence_ns});
      };
      // A node whose liveness connection closed: its supervisor is gone, unless it finished.
      std::vector<std::pair<uint32_t, int64_t>> closed;
      {
        std::lock_guard lk(mu_);
        closed.swap(closed_);
      }
      for (const auto& [k, when] : closed) {
        if (lost[k] || peers_finished[k]) continue;
        if (rec->get(key(fmt::format("finished/{}", k)), std::chrono::milliseconds(0))) {
          peers_finished[k] = view[k].finished = true;
          continue;
        }
        declare_lost(k,
                     fmt::format("{} lost: its supervisor's connection to node 0 closed (its "
                                 "processes died)",
                                 host_of(k)),
                     when);
      }
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
        const double silent = std::chrono::duration<double>(now - changed[k]).count();
        declare_lost(k,
                     fmt::format("{} lost: no beat for {:.2f} s (dead, hung, or cut off from "
                                 "node 0)",
                                 host_of(k), silent),
                     mono_of(changed[k] + options_.beat));
      }
    }
  } catch (const std::exception& e) {
    // Node 0's own store failing under it is as fatal to the job as its loss.
    node0_lost(std::string(user_message(e)));
  }
}

}  // namespace megacpp::supervisor
