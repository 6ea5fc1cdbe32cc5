#include "supervisor/zmq_node_link.h"

#include <algorithm>
#include <utility>

#include <capnp/message.h>
#include <fmt/format.h>
#include <kj/exception.h>

#include "core/error.h"
#include "core/util.h"

namespace megacpp::supervisor {

namespace {

using Clock = std::chrono::steady_clock;
using schema::NodeLinkFrame;

// The frame's root, checked to the last pointer (a malformed message throws here, caught, never
// in whoever reads it later); false, and `why`, when it is not a frame this build reads.
bool checked_root(ipc::ReceivedFrame& frame, NodeLinkFrame::Reader& root, std::string& why) {
  try {
    root = frame.message().getRoot<NodeLinkFrame>();
    root.totalSize();
    if (root.getVersion() != kNodeLinkVersion) {
      why = fmt::format("version {} (this build speaks {})", root.getVersion(), kNodeLinkVersion);
      return false;
    }
    return true;
  } catch (const kj::Exception& e) {
    why = e.getDescription().cStr();
    return false;
  }
}

void log_dropped(std::string_view where, uint64_t count, const std::string& peer,
                 std::string_view why) {
  if (count <= 10 || count % 1000 == 0) {
    log_warn("{}: dropped frame #{} from '{}': {}", where, count, peer, why);
  }
}

constexpr std::string_view kBeatSuffix = "/beat";

long ms_left(Clock::time_point deadline) {
  const auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  return static_cast<long>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
}

}  // namespace

// ---------------------------------------------------------------------------------------

JobControlEndpoint::JobControlEndpoint(const ipc::JobKeys& keys, const std::string& endpoint)
    : router_(keys, endpoint) {}

void JobControlEndpoint::attach(const std::string& node, ZmqNodeAgentLink* link) {
  const bool fresh = queues_.try_emplace(node).second;
  MEGACPP_CHECK(fresh, ErrorKind::kInternal,
                fmt::format("node '{}' already has a link on this endpoint", node));
  heard_[node] = Clock::now();
  links_[node] = link;
}

void JobControlEndpoint::detach(const std::string& node) {
  queues_.erase(node);
  heard_.erase(node);
  links_.erase(node);
}

void JobControlEndpoint::poll(int timeout_ms) {
  const bool queued = std::ranges::any_of(queues_, [](const auto& q) { return !q.second.empty(); });
  if (!queued) {
    if (auto f = router_.receive(ipc::Millis(std::max(timeout_ms, 0)))) sort(std::move(f));
  }
  drain();
  for (auto& [node, link] : links_) {
    link->take_queued();
    link->check_silence();
  }
}

bool JobControlEndpoint::sort(std::unique_ptr<ipc::ReceivedFrame> f) {
  std::string node = f->peer();
  const bool beat = node.ends_with(kBeatSuffix);
  if (beat) node.resize(node.size() - kBeatSuffix.size());
  const auto it = queues_.find(node);
  if (it == queues_.end()) {
    ++strangers_;
    log_dropped("node link", strangers_, f->peer(), "no node of this job by that name");
    return false;
  }
  heard_[node] = Clock::now();
  if (!beat) it->second.push_back(std::move(f));
  return true;
}

void JobControlEndpoint::drain() {
  while (auto f = router_.receive(ipc::Millis(0))) sort(std::move(f));
}

std::unique_ptr<ipc::ReceivedFrame> JobControlEndpoint::next(const std::string& node,
                                                             Clock::time_point deadline) {
  auto& mine = queues_.at(node);
  if (!mine.empty()) {
    auto f = std::move(mine.front());
    mine.pop_front();
    return f;
  }
  for (;;) {
    auto f = router_.receive(ipc::Millis(ms_left(deadline)));
    if (!f) return nullptr;
    sort(std::move(f));
    if (!mine.empty()) {
      auto g = std::move(mine.front());
      mine.pop_front();
      return g;
    }
  }
}

bool JobControlEndpoint::send_to(const std::string& node, capnp::MessageBuilder& message) {
  return router_.send_to(node, message, ipc::Millis(1000));
}

// ---------------------------------------------------------------------------------------

ZmqNodeAgentLink::ZmqNodeAgentLink(JobControlEndpoint& endpoint, std::string node, Options options)
    : endpoint_(endpoint), node_(std::move(node)), options_(options) {
  endpoint_.attach(node_, this);
}

ZmqNodeAgentLink::~ZmqNodeAgentLink() {
  endpoint_.detach(node_);
}

uint64_t ZmqNodeAgentLink::take(ipc::ReceivedFrame& frame, bool& delivered) {
  NodeLinkFrame::Reader root;
  std::string why;
  if (!checked_root(frame, root, why)) {
    log_dropped("node link", ++dropped_, node_, why);
    return 0;
  }
  // Any frame the node's key let through shows it connected: a controller that came back on
  // the same port never sees the hello the node said to its predecessor.
  connected_ = true;
  switch (root.which()) {
    case NodeLinkFrame::HELLO:
    case NodeLinkFrame::BEAT:  // heard, which is all a beat says
      return 0;
    case NodeLinkFrame::EVENT:
      deliver(root.getEvent());
      return 0;
    case NodeLinkFrame::DONE:
      delivered = root.getDone().getDelivered();
      return root.getDone().getSequence();
    case NodeLinkFrame::RINGS: {
      rings_.clear();
      for (auto r : root.getRings()) rings_.push_back({r.getDepth(), r.getSlots()});
      return 0;
    }
    default:
      log_dropped("node link", ++dropped_, node_, "a command sent up by a node");
      return 0;
  }
}

bool ZmqNodeAgentLink::wait_connected(int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!connected_) {
    auto f = endpoint_.next(node_, deadline);
    if (!f) return false;
    bool unused = false;
    take(*f, unused);
  }
  return true;
}

bool ZmqNodeAgentLink::command(schema::NodeCommand::Reader c) {
  capnp::MallocMessageBuilder message;
  auto frame = message.initRoot<NodeLinkFrame>();
  frame.setVersion(kNodeLinkVersion);
  const uint64_t sequence = ++sequence_;
  frame.setSequence(sequence);
  frame.setCommand(c);
  if (!endpoint_.send_to(node_, message)) {
    log_warn("node link: command #{} not sent to node '{}' (not connected)", sequence, node_);
    return false;
  }
  const auto deadline = Clock::now() + options_.command_timeout;
  for (;;) {
    auto f = endpoint_.next(node_, deadline);
    if (!f) {
      log_warn("node link: node '{}' did not answer command #{} within {} ms", node_, sequence,
               options_.command_timeout.count());
      return false;
    }
    bool delivered = false;
    // A `done` of an earlier command that timed out is stale: skipped.
    if (take(*f, delivered) == sequence) return delivered;
  }
}

void ZmqNodeAgentLink::poll(int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
  auto f = endpoint_.next(node_, deadline);
  while (f) {
    bool unused = false;
    take(*f, unused);
    f = endpoint_.next(node_, Clock::now());  // what else has come, without waiting
  }
  check_silence();
}

void ZmqNodeAgentLink::take_queued() {
  while (auto f = endpoint_.next(node_, Clock::now())) {
    bool unused = false;
    take(*f, unused);
  }
}

void ZmqNodeAgentLink::check_silence() {
  if (!connected_ || lost_) return;
  // Every frame already in the socket counts as heard now, not when this link next reads it:
  // a controller that was busy must not take its own delay for the node's silence.
  endpoint_.drain();
  const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(
      Clock::now() - endpoint_.last_heard(node_));
  if (silent <= options_.silence_limit) return;
  lost_ = Loss{silent};
  log_error(
      "node link: node '{}' lost: silent for {} ms (limit {} ms): its processes died, it "
      "hangs, or the link to it is cut",
      node_, silent.count(), options_.silence_limit.count());
}

// ---------------------------------------------------------------------------------------

NodeAgentServer::NodeAgentServer(NodeAgentLink& local, const ipc::JobKeys& keys,
                                 const std::string& controller_endpoint, const std::string& node,
                                 Options options)
    : local_(local), dealer_(keys, controller_endpoint, node) {
  if (options.beat_interval.count() > 0) {
    beat_thread_ = std::thread([this, keys, controller_endpoint, node, options] {
      beat(keys, controller_endpoint, node, options.beat_interval);
    });
  }
  capnp::MallocMessageBuilder hello;
  auto frame = hello.initRoot<NodeLinkFrame>();
  frame.setVersion(kNodeLinkVersion);
  frame.setHello(node);
  send(hello);
  local_.connect([this](schema::NodeEvent::Reader e) {
    capnp::MallocMessageBuilder message;
    auto frame = message.initRoot<NodeLinkFrame>();
    frame.setVersion(kNodeLinkVersion);
    frame.setEvent(e);
    send(message);
  });
}

NodeAgentServer::~NodeAgentServer() {
  {
    std::lock_guard lock(beat_mu_);
    beat_stop_ = true;
  }
  beat_cv_.notify_all();
  if (beat_thread_.joinable()) beat_thread_.join();
  local_.connect({});
}

void NodeAgentServer::beat(const ipc::JobKeys& keys, const std::string& endpoint,
                           const std::string& node, std::chrono::milliseconds interval) {
  try {
    ipc::CurveDealer dealer(keys, endpoint, node + std::string(kBeatSuffix));
    uint64_t count = 0;
    std::unique_lock lock(beat_mu_);
    while (!beat_stop_) {
      lock.unlock();
      capnp::MallocMessageBuilder message;
      auto frame = message.initRoot<NodeLinkFrame>();
      frame.setVersion(kNodeLinkVersion);
      frame.setBeat(++count);
      // A beat that cannot be queued within its interval is one missed beat, not a wait: the
      // controller counts silence, and a late beat would only hide it.
      dealer.send(message, ipc::Millis(interval.count()));
      lock.lock();
      beat_cv_.wait_for(lock, interval, [this] { return beat_stop_; });
    }
  } catch (const std::exception& e) {
    // Without beats the controller declares this node lost: the failure is named there.
    log_error("node link: the beat thread of node '{}' stopped: {}", node, e.what());
  }
}

void NodeAgentServer::send(capnp::MessageBuilder& message) {
  if (!dealer_.send(message, ipc::Millis(1000))) {
    ++unsent_;
    if (unsent_ <= 10 || unsent_ % 1000 == 0) {
      log_warn("node link: frame #{} not queued to the job controller within 1 s", unsent_);
    }
  }
}

void NodeAgentServer::take(ipc::ReceivedFrame& frame) {
  NodeLinkFrame::Reader root;
  std::string why;
  if (!checked_root(frame, root, why)) {
    log_dropped("node agent server", ++dropped_, "job controller", why);
    return;
  }
  if (root.which() != NodeLinkFrame::COMMAND) {
    log_dropped("node agent server", ++dropped_, "job controller", "not a command");
    return;
  }
  ++commands_;
  const bool delivered = local_.command(root.getCommand());
  capnp::MallocMessageBuilder message;
  auto done = message.initRoot<NodeLinkFrame>();
  done.setVersion(kNodeLinkVersion);
  auto d = done.initDone();
  d.setSequence(root.getSequence());
  d.setDelivered(delivered);
  send(message);
  report_rings();
}

void NodeAgentServer::report_rings() {
  std::vector<RingLevel> now = local_.ring_levels();
  const bool same = now.size() == rings_sent_.size() &&
                    std::equal(now.begin(), now.end(), rings_sent_.begin(),
                               [](const RingLevel& a, const RingLevel& b) {
                                 return a.depth == b.depth && a.slots == b.slots;
                               });
  if (same) return;
  capnp::MallocMessageBuilder message;
  auto frame = message.initRoot<NodeLinkFrame>();
  frame.setVersion(kNodeLinkVersion);
  auto list = frame.initRings(static_cast<unsigned>(now.size()));
  for (unsigned i = 0; i < now.size(); ++i) {
    list[i].setDepth(now[i].depth);
    list[i].setSlots(now[i].slots);
  }
  send(message);
  rings_sent_ = std::move(now);
}

void NodeAgentServer::serve(int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
  for (;;) {
    while (auto f = dealer_.receive(ipc::Millis(0))) take(*f);
    const long left = ms_left(deadline);
    if (left == 0) return;
    local_.poll(static_cast<int>(std::min<long>(left, kPollSliceMs)));
    report_rings();
  }
}

}  // namespace megacpp::supervisor
