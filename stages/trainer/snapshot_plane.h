// megacpp::trainer snapshot plane — the rank's side of handing snapshots to the checkpointer.
//
// Contract: one owner thread; every wait is bounded (lease_timeout / commit_timeout) and
// gives up early on a stop request; failures throw Error{kTimeout} / Error{kPeerFailure}.
// The staging region lives as long as the SnapshotPlane. No torch types here: the share is
// produced by the TrainStep this plane refers to.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ipc/channel.h"
#include "ipc/handle_socket.h"
#include "ipc/shm.h"
#include "stages/trainer/snapshot_copy.h"
#include "stages/trainer/snapshot_layout.h"
#include "stages/trainer/staged_snapshot.h"

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
  // Staging in an exported buffer (staged_snapshot.h) instead of the named host region: makes
  // the buffer for a share of `bytes`, once. Empty: the host region. With it, `region_name`
  // holds only the step stamp and the buffer's descriptor goes to `handle_socket` once per
  // connection (again after a checkpointer restart, before the re-sent SnapshotReady).
  std::function<std::unique_ptr<StagingTarget>(uint64_t bytes)> make_staging;
  std::filesystem::path handle_socket;
  // When make_staging throws Error{kSystem} (a driver that cannot export the buffer), or the
  // checkpointer cannot import it (SnapshotAck.stagingRefused): true, the rank stages in the
  // host region from then on, saying so (a refused snapshot is read back from the buffer into
  // the region and re-sent, so no step is lost); false, Error{kSystem} / Error{kInvalidArgument}
  // fails the rank, naming the reason and the knob.
  bool staging_fallback = false;
};

// Overlapped copy: take() copies a host share on a thread of its own (SnapshotCopy) and returns;
// the SnapshotReady goes out once the copy is done — from poll(), settle(), the next take() or
// wait_committed(), whichever comes first. The loop must call settle() before its next update
// changes the state being copied (StepHooks::before_update). A share on a device is copied
// before take() returns. With make_staging, take() only issues the copy into the exported
// buffer and sends the SnapshotReady at once (the checkpointer waits for the copy itself);
// settle() then orders the update after the copy (on a device, without blocking the host).
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
  // Device memory held by the staging buffer when it is staged on the device; 0 otherwise.
  uint64_t staged_device_bytes() const noexcept {
    return staged_ && staged_->device() ? staged_->info().mapping_bytes : 0;
  }

 private:
  template <typename Pred>
  bool wait_for(Pred done, std::chrono::milliseconds timeout);
  bool needs_ack() const;
  void resend_if_due();
  void handle(ipc::Received& msg);
  void send_ready();
  void send_handles();
  // The checkpointer refused the exported buffer (`why`): moves the pending snapshot into a host
  // region and re-sends it; later snapshots are staged there. Throws when fallback is off.
  void stage_in_host(const std::string& why);
  // Where the region's step stamp lies: after the share, or, staged in an exported buffer, at a
  // nonzero offset of its own (0 says "no stamp").
  uint64_t stamp_offset() const noexcept { return staged_ ? kSnapshotAlignment : share_bytes_; }
  std::string last_error_note() const;

  const TrainStep& ts_;
  SnapshotPlaneOptions options_;
  ipc::Channel channel_;
  std::unique_ptr<ipc::ShmRegion> region_;
  // Staging in an exported buffer: the buffer, its connection to the checkpointer's handle
  // socket (null until connected), and whether settle() still owes the copy's ordering.
  std::unique_ptr<StagingTarget> staged_;
  std::unique_ptr<ipc::HandleConnection> handles_;
  bool staged_fence_ = false;
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
