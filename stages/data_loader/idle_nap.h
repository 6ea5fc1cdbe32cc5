// megacpp::data_loader::IdleNap — how the data loader waits when no rank's ring has room.
//
// A ring gets room when its trainer releases a slot; the loader should notice soon, so the
// ring does not run dry behind a fast trainer, yet cost almost no CPU while every trainer is
// busy computing (the usual case). So the first nap after a productive turn is short and
// each further one doubles, up to the cap; a turn that produced resets it. The process should
// also lower its timer slack (prctl PR_SET_TIMERSLACK; Linux's default of 50 us otherwise
// stretches every short nap by that much).
//
// Contract: header-only, not thread-safe (one per loop), never throws.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace megacpp::data_loader {

class IdleNap {
 public:
  using Micros = std::chrono::microseconds;
  static constexpr Micros kFirst{10};
  static constexpr Micros kMax{200};

  // A turn produced something: the next idle wait starts short again.
  void reset() noexcept { next_ = kFirst; }
  // The length of the nap the next wait() takes.
  Micros next() const noexcept { return next_; }
  // Sleeps next(), then doubles it up to kMax.
  void wait() {
    std::this_thread::sleep_for(next_);
    next_ = std::min(next_ * 2, kMax);
  }

 private:
  Micros next_ = kFirst;
};

}  // namespace megacpp::data_loader
