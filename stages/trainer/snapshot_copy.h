// megacpp::trainer snapshot copy — a rank's share copied into its staging region on a thread
// of its own while the rank computes the next forward and backward.
//
// Contract: forward and backward only read parameters and optimizer state, so a copy started
// after step N's update and finished before step N+1's update holds exactly step N's state.
// The owner calls wait() before anything changes that state (StepHooks::before_update); the
// thread only moves bytes (no torch call) and keeps the tensors it reads alive until it is
// joined. wait() and the destructor join it; neither throws for an expected condition. No
// torch types here.
#pragma once

#include <memory>

namespace megacpp::trainer {

class SnapshotCopy {
 public:
  SnapshotCopy() noexcept;  // nothing in flight: ready() and wait() return at once
  SnapshotCopy(SnapshotCopy&&) noexcept;
  SnapshotCopy& operator=(SnapshotCopy&&) noexcept;
  ~SnapshotCopy();  // joins the thread: blocks until the copy is done

  // True when every byte is in the region (wait() will not block). Never blocks.
  bool ready() const noexcept;
  // Blocks until every byte is in the region and visible to a later store of this thread
  // (the streaming stores are fenced and the thread joined). Idempotent.
  void wait() noexcept;

  struct State;  // the pieces, the thread (train_step.cpp)

 private:
  friend class TrainStep;
  std::unique_ptr<State> s_;
};

}  // namespace megacpp::trainer
