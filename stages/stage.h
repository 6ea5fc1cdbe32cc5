// megacpp::stage — what every stage process shares: argument parsing, the launch contract,
// its journal, its control client, and the way it goes down.
//
// Contract of run_stage_main: the process dies with its parent (PR_SET_PDEATHSIG=SIGKILL),
// journals processStarted first and processFinished only on a clean return, and goes down
// leaving RUN/failures/<stage>-<rank>.json (schema::FailureDump: kind, errorKind, message,
// phase, step, monoNs, native backtrace) whichever way it goes down:
//   - an exception out of the body (megacpp::Error, kj::Exception, std::exception incl.
//     c10::Error): kind "exception", errorKind the ErrorKind name (or capnp | c10 | std |
//     unknown); the same kind/errorKind/message and monoNs (when the Error was constructed,
//     else when it was caught) go to the supervisor in a Failure; exit status 1;
//   - std::terminate (an exception escaping a thread or a noexcept function): kind
//     "terminate", then abort() (status: signaled SIGABRT);
//   - a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT): kind "signal", written with
//     async-signal-safe calls only (frames as backtrace_symbols_fd prints them; symbolised
//     frames also go to stderr), then the signal is re-raised with its default action, so
//     the exit status still says "signaled".
// SIGTERM/SIGINT request a stop (stop_requested()); in a step's compute phases (forward,
// backward, optimizer) they end the process at once with status 128 + signal and no dump:
// the step would be thrown away, and a teardown should not wait for it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ipc/channel.h"
#include "ipc/control_client.h"
#include "ipc/journal.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"

namespace megacpp::stage {

struct StageArgs {
  std::filesystem::path run_dir;
  uint32_t rank = 0;
  uint32_t generation = 0;
  // A spare (--spare): when its generation arrived on stdin. Its startup is timed from here,
  // not from the process's start.
  std::optional<std::chrono::steady_clock::time_point> activated;
};

namespace detail {
enum class FaultAction { kThrow, kAbort, kSegv, kExit, kHang, kStop, kForeign, kNan };
struct Fault {
  std::string point;
  uint32_t step;
  FaultAction action;
};
// Parses a MEGACPP_FAULT value (see fault_point) and keeps the entries naming `stage`, `rank`
// and `generation`. Every entry is validated, also those for other processes, so a typo fails
// every stage at start-up. An entry with a generation number (default 0) fires in the run's
// first attempt only, so a resumed or restarted job does not fail again at the same point;
// `*` fires in every generation of every attempt. Throws Error{kInvalidArgument} quoting the
// offending entry.
std::vector<Fault> parse_faults(std::string_view spec, schema::StageKind stage, uint32_t rank,
                                uint32_t generation, uint32_t attempt = 0);
// A spare's wait (--spare): blocks on `fd` for one line holding a generation number. None when
// the input ends first or the line is not a number (the supervisor let the spare go).
std::optional<uint32_t> read_spare_generation(int fd);
}  // namespace detail

class StageContext {
 public:
  // Throws Error{kInvalidArgument} for an invalid MEGACPP_FAULT.
  StageContext(schema::StageKind kind, const StageArgs& args);
  ~StageContext();
  StageContext(const StageContext&) = delete;
  StageContext& operator=(const StageContext&) = delete;

  schema::StageKind kind() const noexcept { return kind_; }
  uint32_t rank() const noexcept { return args_.rank; }
  const std::filesystem::path& run_dir() const noexcept { return args_.run_dir; }
  // Set for a spare: when it became this generation (StageArgs::activated).
  std::optional<std::chrono::steady_clock::time_point> activated() const noexcept {
    return args_.activated;
  }
  schema::LaunchContract::Reader launch() { return launch_.get(); }
  ipc::ZmqContext& zmq() { return zmq_; }
  ipc::JournalWriter& journal() { return journal_; }
  ipc::ControlClient& control() { return *control_; }

  // Phase and step as last set; recorded in a failure dump.
  void set_phase(schema::Phase phase);
  void set_step(uint32_t step);
  schema::Phase phase() const noexcept { return phase_.load(); }
  uint32_t step() const noexcept { return step_.load(); }
  // True once the supervisor sent Stop or the process got SIGTERM/SIGINT.
  bool stop_requested() const;
  // Sleeps up to `d` (one nanosleep: a signal to this thread, such as the SIGTERM of a
  // teardown, ends it early, where std::this_thread::sleep_for would sleep on). For idle
  // loops that check stop_requested() between naps.
  static void nap(std::chrono::milliseconds d);
  // The supervisor asked for a graceful stop (a Stop{afterCheckpoint}): finish the work in
  // flight, make it durable, exit 0. stop_requested() stays false for it.
  bool graceful_stop_requested() const;

 private:
  friend bool fault_point(StageContext& ctx, std::string_view point, uint32_t step);

  schema::StageKind kind_;
  StageArgs args_;
  std::vector<detail::Fault> faults_;  // MEGACPP_FAULT entries naming this process
  schemas::JsonFile<schema::LaunchContract> launch_;
  ipc::ZmqContext zmq_;
  ipc::JournalWriter journal_;
  std::unique_ptr<ipc::ControlClient> control_;
  std::atomic<schema::Phase> phase_{schema::Phase::STARTUP};
  std::atomic<uint32_t> step_{0};
};

// Fault injection for the chaos suite and the failure benchmark. MEGACPP_FAULT holds a
// comma-separated list of "<stage>:<rank>:<point>:<step>:<action>" (stage as in
// layout::stage_name; point names a place in that stage's loop, e.g. trainer: forward,
// backward, optimizer; data_loader: produce; collector: fold; checkpointer: write).
// action: throw (an Error{kInternal}) | abort | segv | exit (exit code 3) | hang (stop making
// progress while heartbeats go on) | stop (SIGSTOP itself: heartbeats stop too) | foreign (a
// std::runtime_error, standing for a library's own exception such as a c10::Error) | nan (the
// caller makes its values non-finite: fault_point returns true; trainer: its gradients at
// optimizer, the point where they are complete).
// An optional sixth field names the launch generation the fault applies to (default 0, the
// first launch, so a restarted stage does not fail again at the same step; * for every one).
// A no-op, costing one comparison, unless the knob names this process, point and step.
// Example: MEGACPP_FAULT=trainer:1:backward:5:segv,data_loader:0:produce:3:exit:*
// Returns true when a nan fault fired here (the caller poisons its values), else false.
bool fault_point(StageContext& ctx, std::string_view point, uint32_t step);

// This node's ranks of the job's world, as the launch contract says: first .. first + count - 1
// (a job across nodes: node rank x ranks per node onwards). A contract written before the
// fields: every rank of the world.
struct LocalRanks {
  uint32_t first = 0;
  uint32_t count = 0;
  uint32_t end() const noexcept { return first + count; }
  bool contains(uint32_t rank) const noexcept { return rank >= first && rank - first < count; }
};
inline LocalRanks local_ranks(schema::LaunchContract::Reader launch) {
  if (launch.getLocalRanks() == 0) return {0, launch.getWorld()};
  return {launch.getFirstRank(), launch.getLocalRanks()};
}

// The main() of a stage executable. Parses --run-dir, --rank, --generation (and --help).
// --spare: the process was started ahead of its launch (keepSpare, schemas/node.capnp); it
// waits on stdin for one line, its generation, and then runs as that generation's launch would
// (launch.json is read after it). End of input without a line: it exits 0, never needed.
int run_stage_main(int argc, char** argv, schema::StageKind kind, std::string_view description,
                   const std::function<void(StageContext&)>& body);

}  // namespace megacpp::stage
