// StepProfile: torch's profiler (Kineto) over a range of a rank's training steps, for the
// question a step's journaled phases cannot answer on a device — where the device's time goes,
// kernel by kernel, and how much of the wall time the device is idle (the host not keeping it
// fed). The journal's phases are the host's time to issue each part's work (DESIGN.md "GPU lane
// (second part)"); this is the device's view, without Nsight Systems on the machine.
//
// MEGACPP_PROFILE_STEPS=FIRST:LAST turns it on for a trainer rank: the profiler starts before
// step FIRST's batch is waited for and stops after step LAST's result is read (the step's one
// host read has the device's work of the step done, so no kernel of the range is missing), and
// writes into the run's logs:
//   profile-<rank>.txt   the device's work by kernel (total, calls, mean, share of all the
//                        device's work), the busy time as a share of the wall time (overlapping
//                        work on two streams counted once), and torch's operators by host time
//   profile-<rank>.json  the Chrome trace (chrome://tracing, Perfetto) of the same steps
// On a CPU rank the host's operators are the profile. Profiling slows the host (every operator
// is recorded), so a profiled step's wall time is not a training step's; kernel times are the
// device's own.
//
// Failure: a knob value that is not FIRST:LAST with 1 <= FIRST <= LAST is Error{kInvalidArgument}
// naming the knob. Writing the files is best effort for the run (a failure is logged, never
// the rank's), since a profile is a diagnosis, not a result.
//
// Lifetime: one per rank, on the training thread. A rank that ends before LAST (a stop, an
// error) stops the profiler in the destructor without writing: torch's profiler is
// process-wide and must not outlive the loop.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace megacpp::trainer {

struct ProfileSteps {
  uint32_t first = 0;
  uint32_t last = 0;
};

// MEGACPP_PROFILE_STEPS's value; nullopt for an empty one.
std::optional<ProfileSteps> parse_profile_steps(std::string_view text);

class StepProfile {
 public:
  // `cuda`: record the device's kernels and copies too. `out` is the files' path without the
  // extension (RUN/logs/profile-<rank>); `device` names the device in the summary's first line.
  StepProfile(ProfileSteps steps, bool cuda, std::filesystem::path out, std::string device);
  ~StepProfile();
  StepProfile(const StepProfile&) = delete;
  StepProfile& operator=(const StepProfile&) = delete;

  // Called before each step's work and after its result is read; the range's ends start and
  // stop the profiler. after() at LAST writes the files.
  void before(uint32_t step);
  void after(uint32_t step);

 private:
  ProfileSteps steps_;
  bool cuda_;
  std::filesystem::path out_;
  std::string device_;
  bool on_ = false;
  std::chrono::steady_clock::time_point started_;
};

}  // namespace megacpp::trainer
