// megacpp::data_loader::IdleNap — how the data loader waits when no rank's ring has room.
//
// A ring gets room when its trainer releases a slot; the loader should notice soon, so the
// ring does not run dry behind a fast trainer, yet cost almost no CPU while every trainer is
// busy computing (the usual case). So the first nap after a productive turn is short and
// each further one doubles, up to the cap; a turn that produced resets it. The process should
// also lower its timer slack (prctl PR_SET_TIMERSLACK; Linux's default of 50 us otherwise
// stretches every short nap by that much).
//
// How long a nap may grow is the caller's to say (wait's `cap`): kMax while a trainer could run
// dry soon, longer while every ring still holds batches for the next steps. Each wake-up of an
// idle loader preempts a trainer on a busy core; at kMax that is 5,000 a second, several
// per cent of a core taken from the ranks at every step.
//
// Contract: header-only, not thread-safe (one per loop), never throws.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
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
  // Sleeps next() (at most `cap`), then doubles it up to `cap`.
  void wait(Micros cap = kMax) {
    next_ = std::min(next_, cap);
    std::this_thread::sleep_for(next_);
    next_ = std::min(next_ * 2, cap);
  }

  // The cap for a loader whose fullest-fed trainer still has `queued` batches published and
  // that produced a batch every `interval` in the steady state: half the interval when every
  // ring holds at least two batches (a trainer needs longer than that to finish two steps and
  // drain its ring), else kMax; never more than kLongest.
  static Micros cap_for(uint32_t queued, Micros interval) {
    if (queued < 2) return kMax;
    return std::clamp(interval / 2, kMax, kLongest);
  }
  static constexpr Micros kLongest{20000};

 private:
  Micros next_ = kFirst;
};

}  // namespace megacpp::data_loader
