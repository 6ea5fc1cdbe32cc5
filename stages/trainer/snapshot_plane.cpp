// The rank's side of the snapshot plane: staging region, SnapshotReady, acks, re-sends.
#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "stages/trainer/snapshot_plane.h"

#include "ipc/staging_stamp.h"
#include "stages/trainer/train_step.h"

namespace megacpp::trainer {

namespace {
using Clock = std::chrono::steady_clock;
// Longest single receive while waiting: bounds how late a stop request or a due re-send is
// noticed.
constexpr std::chrono::milliseconds kPoll{100};
// The first send may wait this long for room in the DEALER's queue (it holds up to the
// high-water mark even while the checkpointer is away, so this only fails on a flood).
constexpr std::chrono::milliseconds kSendTimeout{5000};
}  // namespace

SnapshotPlane::SnapshotPlane(ipc::ZmqContext& zmq, const TrainStep& ts,
                             SnapshotPlaneOptions options)
    : ts_(ts),
      options_(std::move(options)),
      channel_(zmq, ipc::Channel::Kind::kDealer, options_.endpoint, options_.identity) {
  MEGACPP_CHECK(options_.lease_timeout.count() > 0 && options_.commit_timeout.count() > 0 &&
                    options_.resend_interval.count() > 0,
                ErrorKind::kInvalidArgument, "snapshot plane timeouts must be > 0");
}

SnapshotPlane::~SnapshotPlane() = default;

bool SnapshotPlane::needs_ack() const {
  if (!pending_) return false;
  if (leased_) return true;
  return pending_final_ && (!committed_ || *committed_ < pending_step_);
}

void SnapshotPlane::resend_if_due() {
  if (!needs_ack() || Clock::now() - last_send_ < options_.resend_interval) return;
  last_send_ = Clock::now();
  send_handles();
  // A duplicate that cannot be queued now is simply tried again at the next interval.
  if (channel_.send(pending_->message(), ipc::Millis(0))) {
    ++resends_;
    log_info("re-sent SnapshotReady of step {} to {} (no {} yet)", pending_step_,
             options_.peer_name, leased_ ? "ack" : "commit");
  }
}

void SnapshotPlane::poll() {
  if (copying_ && copy_.ready()) send_ready();
  while (auto msg = channel_.receive(ipc::Millis(0))) handle(*msg);
  resend_if_due();
}

template <typename Pred>
bool SnapshotPlane::wait_for(Pred done, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  poll();
  auto stop = [&] { return options_.stop_requested && options_.stop_requested(); };
  while (!done() && !stop() && Clock::now() < deadline) {
    const auto now = Clock::now();
    Clock::duration wait = std::min<Clock::duration>(kPoll, deadline - now);
    if (needs_ack()) wait = std::min(wait, last_send_ + options_.resend_interval - now);
    wait = std::max(wait, Clock::duration::zero());
    if (auto msg = channel_.receive(std::chrono::ceil<std::chrono::milliseconds>(wait))) {
      handle(*msg);
    }
    resend_if_due();
  }
  return done();
}

std::string SnapshotPlane::last_error_note() const {
  std::string note = fmt::format("re-sent {} time(s)", resends_);
  if (!last_error_.empty()) note += "; last error: " + last_error_;
  return note;
}

bool SnapshotPlane::take(uint32_t step, bool final) {
  settle();
  if (leased_) {
    const uint32_t prev = *leased_;
    const bool freed = wait_for([&] { return !leased_; }, options_.lease_timeout);
    if (!freed && options_.stop_requested && options_.stop_requested()) return false;
    MEGACPP_CHECK(freed, ErrorKind::kTimeout,
                  fmt::format("{} did not acknowledge the snapshot of step {} within {} s ({}); "
                              "staging region still leased at step {}",
                              options_.peer_name, prev, options_.lease_timeout.count() / 1000.0,
                              last_error_note(), step));
  }
  // Sized once, by the first snapshot's layout: a rank's share keeps its layout for the run
  // (the copy refuses a share that outgrew its staging, naming both sizes).
  if (share_bytes_ == 0)
    share_bytes_ = std::max(ts_.snapshot_layout().total_bytes, kSnapshotAlignment);
  if (options_.make_staging && !staged_) {
    try {
      staged_ = options_.make_staging(share_bytes_);
      log_info("snapshots of rank {} are staged in an exported {} buffer of {} bytes", ts_.rank(),
               staged_->info().kind, staged_->bytes());
    } catch (const Error& e) {
      if (!options_.staging_fallback || e.kind() != ErrorKind::kSystem) throw;
      log_warn("snapshots of rank {} are staged in host memory: no exported staging buffer ({})",
               ts_.rank(), e.what());
      options_.make_staging = nullptr;
    }
  }
  // The region holds the share (or, staged in an exported buffer, nothing), then the step stamp
  // (ipc/staging_stamp.h StagingStamp).
  if (!region_) {
    region_ = std::make_unique<ipc::ShmRegion>(ipc::ShmRegion::Create{}, options_.region_name,
                                               stamp_offset() + ipc::kStagingStampBytes);
  }
  ipc::clear_staging_stamp(region_->data() + stamp_offset());
  copy_ = staged_ ? ts_.start_staged_copy(*staged_, step, &copy_layout_)
                  : ts_.start_snapshot_copy({region_->data(), share_bytes_}, &copy_layout_);
  copying_ = true;
  copy_step_ = step;
  copy_final_ = final;
  if (staged_) {
    send_ready();
    staged_fence_ = true;
  } else if (copy_.ready()) {
    send_ready();
  }
  return true;
}

double SnapshotPlane::settle() {
  if (staged_fence_) {
    // The copy was issued and announced at take(); only its ordering before the update is owed.
    const auto start = Clock::now();
    staged_fence_ = false;
    copy_.wait();
    return std::chrono::duration<double>(Clock::now() - start).count();
  }
  if (!copying_) return 0;
  const auto start = Clock::now();
  copy_.wait();
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  send_ready();
  return waited;
}

void SnapshotPlane::send_ready() {
  // A host copy is joined first: its bytes are visible before the stamp. A staged copy is only
  // issued: the checkpointer waits for it, and settle() orders the update after it.
  if (!staged_) copy_.wait();
  copying_ = false;
  const uint32_t step = copy_step_;
  ipc::set_staging_stamp(region_->data() + stamp_offset(), step);
  send_handles();
  auto message = std::make_unique<ipc::ControlMessageBuilder>();
  auto ready = message->root().initSnapshotReady();
  ready.setRank(ts_.rank());
  ready.setWorld(ts_.world());
  ready.setStep(step);
  ready.setRegion(region_->name());
  ready.setRegionBytes(region_->size());
  fill_tensor_entries(copy_layout_,
                      ready.initTensors(static_cast<uint32_t>(copy_layout_.entries.size())));
  ready.setFinal(copy_final_);
  ready.setLayout(ts_.snapshot_metadata());
  ready.setStampOffset(stamp_offset());
  if (staged_) ready.setStagedGeneration(staged_->info().generation);
  MEGACPP_CHECK(
      channel_.send(message->message(), kSendTimeout), ErrorKind::kPeerFailure,
      fmt::format("could not queue SnapshotReady of step {} for {}", step, options_.peer_name));
  pending_ = std::move(message);
  pending_step_ = step;
  pending_final_ = copy_final_;
  last_send_ = Clock::now();
  last_error_.clear();
  leased_ = step;
}

void SnapshotPlane::send_handles() {
  if (!staged_) return;
  if (handles_) {
    // The checkpointer never writes here: a readable socket is one whose peer went away (a
    // checkpointer that exited); its successor needs the descriptor again.
    while (handles_->receive(ipc::Millis(0))) {
    }
    if (!handles_->peer_gone()) return;
    handles_.reset();
  }
  // Short waits: the SnapshotReady goes out regardless, and the checkpointer refuses it (acking
  // ok=false) until the descriptor arrives; the re-send tries again.
  handles_ = ipc::HandleConnection::connect(options_.handle_socket, ipc::Millis(200));
  if (!handles_) {
    log_warn("no handle socket at {} yet: the staging buffer goes with a later SnapshotReady",
             options_.handle_socket.string());
    return;
  }
  const int fd = staged_->fd();
  if (!handles_->send(ipc::encode_staged_buffer(staged_->info()), std::span<const int>(&fd, 1),
                      ipc::Millis(1000))) {
    log_warn("could not send the staging buffer to {}; trying again with the next SnapshotReady",
             options_.handle_socket.string());
    handles_.reset();
    return;
  }
  log_info("sent the staging buffer (generation {:#x}) to {}", staged_->info().generation,
           options_.handle_socket.string());
}

void SnapshotPlane::stage_in_host(const std::string& why) {
  MEGACPP_CHECK(options_.staging_fallback, ErrorKind::kInvalidArgument,
                fmt::format("{} refused rank {}'s {} staging buffer ({}), and this run may not "
                            "stage snapshots in host memory: set MEGACPP_SNAPSHOT_STAGING to "
                            "auto or host",
                            options_.peer_name, ts_.rank(), staged_->info().kind, why));
  log_warn(
      "{} refused rank {}'s {} staging buffer; the snapshot of step {} and every later one "
      "are staged in host memory ({})",
      options_.peer_name, ts_.rank(), staged_->info().kind, pending_step_, why);
  // The copy's ordering is settled and its tensors released before the buffer goes.
  copy_.wait();
  copy_ = SnapshotCopy();
  staged_fence_ = false;
  // The region is made again at the host layout's size (the share, then the stamp); the
  // checkpointer attaches the new one by its inode.
  region_.reset();
  region_ = std::make_unique<ipc::ShmRegion>(ipc::ShmRegion::Create{}, options_.region_name,
                                             share_bytes_ + ipc::kStagingStampBytes);
  ipc::clear_staging_stamp(region_->data() + share_bytes_);
  staged_->read_back({region_->data(), std::min<uint64_t>(share_bytes_, staged_->bytes())});
  staged_.reset();
  handles_.reset();
  options_.make_staging = nullptr;
  // The same snapshot again, now from the region.
  copy_step_ = pending_step_;
  copy_final_ = pending_final_;
  send_ready();
}

bool SnapshotPlane::wait_committed(uint32_t step) {
  settle();
  const bool done =
      wait_for([&] { return committed_ && *committed_ >= step; }, options_.commit_timeout);
  if (!done && options_.stop_requested && options_.stop_requested()) return false;
  MEGACPP_CHECK(done, ErrorKind::kTimeout,
                fmt::format("{} did not commit the final checkpoint (step {}) within {} s ({})",
                            options_.peer_name, step, options_.commit_timeout.count() / 1000.0,
                            last_error_note()));
  return true;
}

void SnapshotPlane::handle(ipc::Received& msg) {
  auto root = msg.root();
  if (root.which() != schema::ControlMessage::SNAPSHOT_ACK) {
    log_warn("ignoring a non-SnapshotAck message ({}) on the snapshot channel",
             static_cast<int>(root.which()));
    return;
  }
  auto ack = root.getSnapshotAck();
  const uint32_t step = ack.getStep();
  if (ack.getRank() != ts_.rank()) {
    log_warn("ignoring a SnapshotAck for rank {} (step {})", ack.getRank(), step);
    return;
  }
  const bool current = pending_ && step == pending_step_;
  if (!ack.getOk()) {
    const std::string error = ack.hasError() && ack.getError().size() > 0
                                  ? std::string(ack.getError().cStr())
                                  : std::string("no reason given");
    // The checkpointer goes down after a failed snapshot; a relaunched one gets the re-sent
    // SnapshotReady, and one that stays down is the supervisor's failure to report.
    if (current && staged_ && ack.getStagingRefused()) {
      stage_in_host(error);
      return;
    }
    log_warn("{} failed the snapshot of step {}{}: {}", options_.peer_name, step,
             current ? "; re-sending it" : " (not pending; ignored)", error);
    if (current) last_error_ = error;
    return;
  }
  if (leased_ && step == *leased_) leased_.reset();
  if (ack.getCommitted()) committed_ = std::max(committed_.value_or(0), step);
}

}  // namespace megacpp::trainer
