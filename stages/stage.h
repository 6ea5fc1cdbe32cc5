// megacpp::stage — what every stage process shares: argument parsing, the launch contract,
// its journal, its control client, and the way it goes down.
//
// Contract of run_stage_main: the process dies with its parent (PR_SET_PDEATHSIG=SIGKILL),
// journals processStarted first and processFinished only on a clean return, and on an
// exception writes RUN/failures/<stage>-<rank>.json (typed kind, message, phase, step),
// sends a Failure to the supervisor, and exits 1. SIGTERM requests a stop (stop_requested()).
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string_view>

#include "ipc/ipc.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"

namespace megacpp::stage {

struct StageArgs {
  std::filesystem::path run_dir;
  uint32_t rank = 0;
  uint32_t generation = 0;
};

class StageContext {
 public:
  StageContext(schema::StageKind kind, const StageArgs& args);
  ~StageContext();
  StageContext(const StageContext&) = delete;
  StageContext& operator=(const StageContext&) = delete;

  schema::StageKind kind() const noexcept { return kind_; }
  uint32_t rank() const noexcept { return args_.rank; }
  const std::filesystem::path& run_dir() const noexcept { return args_.run_dir; }
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

 private:
  schema::StageKind kind_;
  StageArgs args_;
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
// progress while heartbeats go on) | stop (SIGSTOP itself: heartbeats stop too).
// A no-op, costing one comparison, unless the knob names this process, point and step.
void fault_point(StageContext& ctx, std::string_view point, uint32_t step);

// The main() of a stage executable. Parses --run-dir, --rank, --generation (and --help).
int run_stage_main(int argc, char** argv, schema::StageKind kind, std::string_view description,
                   const std::function<void(StageContext&)>& body);

}  // namespace megacpp::stage
