// megacpp::supervisor — launches and watches the stage graph of one node (DESIGN §3, §4).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace megacpp::supervisor {

// Everything `megacpp run` takes. validate() is the one place the rules live; a violation is
// an Error{kInvalidArgument} whose message names the rule. Nothing is written before it passes.
struct RunOptions {
  std::string recipe = "tiny";  // a name in recipes/ or a path to a .toml
  uint32_t ranks = 2;
  uint32_t steps = 60;
  std::filesystem::path run_dir;     // must not exist yet, or be an empty directory
  std::filesystem::path data_dir;    // default: <run_dir>/../data
  bool require_data_volume = false;  // refuse a run directory on the root volume
  uint32_t heartbeat_interval_ms = 200;
  uint32_t ring_slots = 4;
  double startup_budget_s = 120;  // no heartbeat progress during start-up / first step
  double hang_budget_s = 60;      // no progress after the first step
  double teardown_grace_s = 2;    // SIGTERM -> SIGKILL
  std::string progress = "auto";  // auto | tty | plain | none
  std::vector<std::string> argv;  // recorded in the launch contract

  void validate() const;
};

// Runs the job to completion. Returns the process exit code: 0 only when the manifest ends ok.
int run(RunOptions options);

// `megacpp status RUN`: prints the manifest readably; returns 0 if it could be read.
int status(const std::filesystem::path& run_dir);

}  // namespace megacpp::supervisor
