// megacpp::trainer snapshot plane — the rank's side of handing snapshots to the checkpointer.
//
// Contract: one owner thread; every wait is bounded (lease_timeout / commit_timeout) and
// gives up early on a stop request; failures throw Error{kTimeout} / Error{kPeerFailure}.
// The staging region lives as long as the SnapshotPlane. No torch types here: the share is
// produced by the TrainStep this plane refers to.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ipc/channel.h"
#include "ipc/shm.h"
#include "stages/trainer/snapshot_copy.h"
#include "stages/trainer/snapshot_layout.h"

namespace megacpp::trainer {

class TrainStep;

// The rank's side of the snapshot plane (DESIGN.md "Decisions": snapshot ownership): one staging
// region, created at the first snapshot and unlinked with this object, leased to the checkpointer
// from a SnapshotReady until the SnapshotAck{ok} of that step.
//
// Surviving a checkpointer restart: the checkpointer may die and be relaunched under the
// same identity and endpoint, discarding what it had not committed. While this rank needs an
// ack — the lease of its last snapshot, or the commit of its final one — it re-sends that
// snapshot's SnapshotReady every resend_interval; the staging region still holds exactly
// that snapshot (it is leased, or it is the final one and never overwritten). The
// checkpointer treats a duplicate as idempotent. Acks are matched by step: an ack for any
// other step neither releases the lease nor fails the rank. SnapshotAck{ok=false} for the
// pending step (the checkpointer failed and goes down) is logged and waited out: a relaunched
// checkpointer gets the re-sent snapshot, and the supervisor handles one that stays dead.
// Every wait is bounded by lease_timeout / commit_timeout.
struct SnapshotPlaneOptions {
  std::string endpoint;     // the checkpointer's ROUTER
  std::string identity;     // this rank's DEALER routing identity ("trainer-<rank>")
  std::string peer_name;    // names the checkpointer in errors ("checkpointer-0")
  std::string region_name;  // the staging shm segment (created here; must not exist)
  std::chrono::milliseconds lease_timeout{60'000};
  std::chrono::milliseconds commit_timeout{120'000};
  std::chrono::milliseconds resend_interval{2'000};
  // Polled while waiting; when it returns true the wait gives up. May be empty.
  std::function<bool()> stop_requested;
};

// Overlapped copy: take() copies a host share on a thread of its own (SnapshotCopy) and returns;
// the SnapshotReady goes out once the copy is done — from poll(), settle(), the next take() or
// wait_committed(), whichever comes first. The loop must call settle() before its next update
// changes the state being copied (StepHooks::before_update). A share on a device is copied
// before take() returns.
//
// Not thread-safe: one owner (the rank's loop). Keeps a reference to `ts` and `zmq`.
class SnapshotPlane {
 public:
  SnapshotPlane(ipc::ZmqContext& zmq, const TrainStep& ts, SnapshotPlaneOptions options);
  ~SnapshotPlane();
  SnapshotPlane(const SnapshotPlane&) = delete;
  SnapshotPlane& operator=(const SnapshotPlane&) = delete;

  // Sends the SnapshotReady of a finished copy, handles every ack already queued and re-sends
  // the pending SnapshotReady when one is needed and due. Never blocks.
  void poll();
  // Waits for the lease of the previous snapshot (re-sending it), then starts copying this
  // rank's share into staging for `step`; its SnapshotReady is sent once the copy is done.
  // Returns false (nothing started) when a stop was requested while waiting. Throws
  // Error{kTimeout} when the lease is not released within lease_timeout, Error{kPeerFailure}
  // when a SnapshotReady cannot even be queued.
  bool take(uint32_t step, bool final);
  // Waits for a copy in flight and sends its SnapshotReady; afterwards the state may change.
  // Returns the seconds it waited for the copy (0 when none was in flight). Throws as take().
  double settle();
  // Settles, then waits for SnapshotAck{committed} of a step >= `step`, re-sending the last
  // snapshot. Returns false on a stop request; throws Error{kTimeout} after commit_timeout.
  bool wait_committed(uint32_t step);

  // The step whose staging lease is still held; the newest step acked as committed; the
  // number of duplicate SnapshotReady messages sent so far.
  std::optional<uint32_t> leased() const noexcept { return leased_; }
  std::optional<uint32_t> committed() const noexcept { return committed_; }
  uint64_t resends() const noexcept { return resends_; }

 private:
  template <typename Pred>
  bool wait_for(Pred done, std::chrono::milliseconds timeout);
  bool needs_ack() const;
  void resend_if_due();
  void handle(ipc::Received& msg);
  void send_ready();
  std::string last_error_note() const;

  const TrainStep& ts_;
  SnapshotPlaneOptions options_;
  ipc::Channel channel_;
  std::unique_ptr<ipc::ShmRegion> region_;
  // The copy in flight and what its SnapshotReady will say; copying_ is false once it is sent.
  SnapshotCopy copy_;
  bool copying_ = false;
  uint32_t copy_step_ = 0;
  bool copy_final_ = false;
  SnapshotLayout copy_layout_;
  uint64_t share_bytes_ = 0;
  // The last SnapshotReady sent, kept for re-sending while its ack is needed.
  std::unique_ptr<ipc::ControlMessageBuilder> pending_;
  uint32_t pending_step_ = 0;
  bool pending_final_ = false;
  std::chrono::steady_clock::time_point last_send_{};
  std::optional<uint32_t> leased_;
  std::optional<uint32_t> committed_;
  std::string last_error_;  // from the last SnapshotAck{ok=false} of the pending step
  uint64_t resends_ = 0;
};

}  // namespace megacpp::trainer
