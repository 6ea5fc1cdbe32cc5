// megacpp::supervisor — launches and watches the stage graph of one node (DESIGN.md "Lifecycle as
// implemented", "Failure model as implemented").
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "supervisor/placement.h"

namespace megacpp::recipe {
struct PlanOptions;
}  // namespace megacpp::recipe

namespace megacpp::supervisor {

// Everything `megacpp run` takes. validate() is the one place the rules live; a violation is
// an Error{kInvalidArgument} whose message names the rule. Nothing is written before it passes.
// What malloc_tuning adds to a trainer's GLIBC_TUNABLES: 32 MiB is glibc's own ceiling for the
// dynamic mmap threshold, so later steps behave as they did; 1 GiB of free heap top is kept.
inline const std::vector<std::string> kTrainerMallocTunables = {
    "glibc.malloc.hugetlb=1", "glibc.malloc.mmap_threshold=33554432",
    "glibc.malloc.trim_threshold=1073741824"};

// What a trainer's environment gains unless the user's already names it: oneDNN (torch's bf16
// matmuls on the CPU) keeps a primitive and its JIT kernel per matrix shape in two caches of
// 1024 entries (oneDNN's own and ideep's), and a routed expert's token count makes new shapes
// every step: tiny-hybrid in bf16-mixed grew from 0.20 to 0.41 GiB above its baseline between
// steps 5 and 20, all of it glibc heap. 16 entries each: 0.113 and 0.117 GiB, the same tokens/s
// there and for `large` (AMD EPYC, 2 ranks).
inline const std::vector<std::string> kTrainerLibraryEnv = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY=16",
                                                            "LRU_CACHE_CAPACITY=16"};

struct RunOptions {
  std::string recipe = "tiny";  // a name in recipes/ or a path to a .toml
  uint32_t ranks = 2;
  uint32_t steps = 60;
  std::filesystem::path run_dir;  // must not exist yet, or be an empty directory
  // --resume RUN: continue the run in RUN (recipe, steps, world and data as it recorded them)
  // from its newest checkpoint that verifies, as its next attempt. Excludes run_dir.
  std::filesystem::path resume;
  // --from CKPT: a new run (run_dir) whose training starts from that checkpoint's parameters
  // and optimizer state, at the step after it; its manifest names the parent run and step.
  std::filesystem::path from;
  std::filesystem::path data_dir;  // default: <run_dir>/../data
  std::string data_source;         // overrides the recipe's [data] source when set
  std::string data_path;           // overrides the recipe's [data] path when set
  // Overrides the recipe's mode ("author_dp" | "nemo_native"); the hash covers what runs.
  std::string mode;
  // Per-rank memory the plan may need (GiB; 0 = not checked): the memory-budget gate.
  double memory_budget_gib = 0;
  // A local hot directory: the dataset (`megacpp prepare` output on a slow or network volume)
  // is copied there, verified against its dataset.json, and read from there.
  std::filesystem::path stage_data;
  bool require_data_volume = false;  // refuse a run directory on the root volume
  uint32_t heartbeat_interval_ms = 200;
  uint32_t ring_slots = 4;
  // Detection. A trainer's current phase may last startup_budget_s until its first step is
  // done, then max(hang_budget_s, hang_multiple x median step time). A process whose
  // heartbeats stop for min(heartbeat_timeout_s, its phase budget) is heartbeat_lost.
  double startup_budget_s = 300;
  double hang_budget_s = 30;
  double hang_multiple = 20;
  double heartbeat_timeout_s = 10;
  // Progress budgets of the restartable stages. Their heartbeats come from a helper thread,
  // so a stage is judged by the progress its working thread reports: a collector that has
  // not finished a fold, a loader that has not filled a ring with room, a checkpointer whose
  // loop or write has not moved, for this long, is hung and restarted. A rank waiting on
  // the loader or the checkpointer gets that stage's budget on top of its own, so the wedged
  // stage is acted on first and the rank is never blamed for it.
  double collector_stall_s = 30;
  double loader_stall_s = 30;
  double checkpointer_stall_s = 60;
  double teardown_grace_s = 1.5;  // SIGTERM -> SIGKILL
  // A failed job's teardown first asks every live, unstopped rank to abort its process group
  // (NCCL: ncclCommAbort, so no kernel is left spinning in a collective; Gloo: the rank's waits
  // in collectives end) and waits up to abort_wait_s for the replies; then the signals.
  bool abort_collectives = true;
  double abort_wait_s = 2.0;
  // Trainers' malloc is tuned through GLIBC_TUNABLES (kTrainerMallocTunables; a tunable the
  // user already set keeps the user's value): transparent huge pages, so a rank's first step
  // after a (re)launch takes a few hundred page faults instead of tens of thousands and its exit
  // (the teardown after a failure) frees 2 MiB pages; and a fixed mmap threshold with no
  // trimming, so the first step's allocations come from a heap that later steps reuse, as the
  // dynamic threshold only arranges after a step has freed them. glibc < 2.35 ignores hugetlb.
  bool malloc_tuning = true;
  // "cpu" (Gloo) or "cuda": rank r trains on CUDA device r of those visible, over NCCL, through
  // the trainer's CUDA plugin (refused before anything is written when the plugin or enough
  // devices are missing).
  std::string device = "cpu";
  // SIGINT/SIGTERM to `megacpp run` stop it gracefully: the ranks finish the step in flight,
  // commit its checkpoint and exit. If that takes longer than this, or a second signal comes,
  // the job is torn down at once (the newest committed checkpoint stays intact).
  double stop_grace_s = 120;
  uint32_t max_restarts = 3;  // per restartable stage (collector, loader, checkpointer)
  // After a failure tears the job down, relaunch every stage from the newest committed
  // checkpoint as the run's next attempt, at most this many times. A failure at the same step
  // as the previous attempt's is not retried (it is repeating).
  uint32_t max_job_restarts = 0;
  // While a job restart is left: one spare per trainer (a trainer process loaded and waiting,
  // keepSpare in schemas/node.capnp), started once every trainer finished its attempt's first
  // step, so that the restart hands the spares their generation instead of starting processes.
  // Each holds its executable's libraries in host memory, none on a device.
  bool spare_trainers = true;
  // Checkpoint retention (launch contract `checkpointPolicy`): the newest keep_checkpoints
  // committed checkpoints stay, plus every step that is a multiple of keep_every (0: none).
  uint32_t keep_checkpoints = 3;
  uint32_t keep_every = 0;
  std::string metrics_addr = "127.0.0.1:0";  // HOST:PORT of /metrics; port 0 = any free port
  double metrics_linger_s = 0;               // keep serving /metrics this long after the run ends
  std::string progress = "auto";             // auto | tty | plain | none
  // --nodes, --node-rank, --master, --iface as typed: with the environment (Slurm, torchrun,
  // Kubernetes) they resolve this node's place in its job at start-up (placement.h), recorded
  // in the launch contract. `ranks` is then the ranks of each node.
  PlacementFlags placement;
  // A job across nodes: the job's key file (ipc/job_keys.h, `megacpp keys FILE`), the same on
  // every node. Its store prefix keys the job's membership and rendezvous in node 0's store.
  std::filesystem::path job_keys;
  std::vector<std::string> argv;  // recorded in the launch contract
  // Set by run_detached in the supervisor it forks: once every stage has said hello, the
  // supervisor prints kDetachedMarker and moves its stdout and stderr to RUN/logs/supervisor.log.
  bool detach = false;

  void validate() const;
};

// Runs the job to completion. Returns the process exit code: 0 only when the manifest ends ok.
int run(RunOptions options);

// `megacpp run --detach`: forks the supervisor into its own Unix session and relays its output
// until the stage graph is up (every stage said hello), then returns 0 while the supervisor
// goes on, logging to RUN/logs/supervisor.log. A run that ends before that (a refusal, a failed
// launch) returns its exit code, its output relayed.
int run_detached(RunOptions options);
inline constexpr const char* kDetachedMarker = "megacpp: detached";

// Whether the CUDA trainer plugin was built beside this executable: the feature-built gate of
// --device cuda (recipes/plan.h).
bool cuda_trainer_built();
// MEGACPP_SNAPSHOT_STAGING into a plan's options (`run` and `plan`), and on --device cuda whether
// a CUDA driver here can export a staging buffer. Throws Error{kInvalidArgument}, one line naming
// the knob, for a value it does not know, device on a CPU run, or device without a driver.
void set_snapshot_staging_options(recipe::PlanOptions& po);
// The memory-budget gate's default for --device cuda (`run` and `plan`): when `budget_gib` is 0,
// the memory of the smallest CUDA device visible to this process, in GiB, as the CUDA plugin
// reads it (loading the plugin, and with it torch's CUDA libraries, into this process), and
// `source` saying so. Leaves both as they are when the plugin is not built or no device is
// visible.
void default_cuda_memory_budget(double& budget_gib, std::string& source);

}  // namespace megacpp::supervisor
