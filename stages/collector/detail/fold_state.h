// The fold's state (internal to megacpp::collector): what the journals of a run said so far,
// merged so that the result does not depend on how records were split across polls. It holds
// no file and no reader: the Collector feeds it records and journal counts, and the document
// functions (detail/documents.h) read it, so a test can script one record by record.
#pragma once

#include <capnp/message.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "schemas/common.capnp.h"
#include "schemas/journal.capnp.h"
#include "schemas/launch.capnp.h"
#include "schemas/manifest.capnp.h"

namespace megacpp::collector::detail {

// Which run the documents describe: computed once from launch.json when the fold begins and
// stamped unchanged into the manifest and every receipt (stamp_identity, detail/documents.h).
// Not movable: `build` is a copy held in its own message.
struct RunIdentity {
  std::string run_id;
  std::string recipe, recipe_hash;
  uint32_t world = 0;  // the current attempt's
  // The ranks whose journals are here: this node's, first_rank .. first_rank + ranks - 1 (the
  // whole world on one node; a node of a job across nodes folds its own ranks).
  uint32_t first_rank = 0;
  uint32_t ranks = 0;
  uint32_t attempt = 0;      // the current attempt (launch.json's)
  std::string mode, blocks;  // the recipe's mode and expanded pattern (launch contract)
  std::string precision, grad_reduce, recompute;  // the recipe's memory settings
  bool memory_declared = false;  // the launch contract names them (not all defaults)
  std::string device;            // launch.json's, "cpu" when it names none
  // The supervisor's build (launch.json's provenance). Written once, by read_identity;
  // mutable only because a message builder hands out its root through a non-const accessor.
  mutable capnp::MallocMessageBuilder build_copy;
  schema::Provenance::Reader build() const;
};

// Fills `id` from a launch contract. Throws Error{kInvalidArgument} for a recipe the model
// configuration refuses.
void read_identity(schema::LaunchContract::Reader launch, RunIdentity& id);

// What is known about one process (stage, rank).
struct Process {
  // pid of the record/event with the greatest monoNs (ties: greatest pid).
  std::optional<std::pair<int64_t, int32_t>> pid;
  std::optional<int64_t> started_mono;   // latest processStarted / childStarted
  std::optional<int64_t> finished_mono;  // latest processFinished
  struct Exit {
    int64_t mono;
    int32_t code;
    int32_t signal;
    auto key() const { return std::tie(mono, code, signal); }
  };
  std::optional<Exit> exited;              // latest childExited
  std::optional<int64_t> unkillable_mono;  // latest childUnkillable
  uint32_t last_step = 0;
  std::optional<int64_t> last_wall;         // newest wallNs among the process's own records
  uint32_t restarts = 0;                    // childStarted records with reason "restart"
  std::vector<std::string> restart_causes;  // their causes, in journal order
  uint32_t generation = 0;
  schema::FailureRole role =
      schema::FailureRole::NONE;  // from the supervisor's failureObserved records

  void see_pid(int64_t mono, int32_t p) {
    if (!pid || std::make_pair(mono, p) > *pid) pid = std::make_pair(mono, p);
  }
  static void latest(std::optional<int64_t>& slot, int64_t mono) {
    if (!slot || mono > *slot) slot = mono;
  }
};

inline constexpr size_t kStepPhaseParts = 11;

struct StepData {
  uint32_t attempt = 0;  // the run attempt that trained it (a later attempt's record wins)
  double loss = 0;
  uint32_t tokens = 0;
  double step_seconds = 0;
  double wait_seconds = 0;
  int64_t wall_ns = 0;
  double data_epoch = 0;  // the sampler state after the step (schema StepRecord)
  double data_cursor = 0;
  double aux_loss = 0;                  // MoE models (schema StepRecord)
  std::vector<uint32_t> expert_tokens;  // empty without MoE
  // The parts of the step (schema StepPhasePoint's order), when the trainer journaled them.
  std::optional<std::array<double, kStepPhaseParts>> phases;
  uint64_t memory_peak = 0, memory_baseline = 0;  // bytes (schema StepRecord)
  uint64_t memory_file = 0, memory_baseline_file = 0;
  uint64_t device_memory_peak = 0, device_memory_reserved = 0;  // bytes; 0 on CPUs
};

// One rank's journal Evaluation record.
struct EvalData {
  uint32_t attempt = 0;  // a later attempt's record wins, as for steps
  double loss = 0;
  double tokens = 0;  // the job's
  double seconds = 0, wait_seconds = 0;
  int64_t wall_ns = 0;
};

// One journal file's counts as of the last poll.
struct JournalCount {
  uint64_t records = 0;
  uint64_t torn_bytes = 0;
  bool trainer = false;  // named trainer-<rank>.journal
};

struct FoldState {
  // From launch.json, once.
  RunIdentity run;
  std::string created_at;
  uint32_t steps_planned = 0;
  uint32_t resume_step = 0;  // where the current attempt began
  // The dataset, volumes and provenance, copied into the receipts. Written once, by
  // read_launch; mutable only because a message builder hands out its root through a
  // non-const accessor.
  mutable capnp::MallocMessageBuilder launch_copy;
  schema::LaunchContract::Reader launch() const;

  // Fills the fields above from a launch contract (throws as read_identity).
  void read_launch(schema::LaunchContract::Reader launch);

  // The run's journals by file name (the fold order), as the Collector last counted them.
  std::map<std::string, JournalCount> journals;

  // Attempts. Records of the current attempt (run.attempt) feed every field below; records
  // of other attempts feed only their attempt's summary, the step series and the checkpoints.
  struct FirstFailure {
    schema::FailureKind kind = schema::FailureKind::NONE;
    std::string message;
    schema::StageKind stage = schema::StageKind::SUPERVISOR;
    uint32_t rank = 0;
    schema::Phase phase = schema::Phase::STARTUP;
    uint32_t step = 0;
    int32_t pid = 0;
    int64_t evidence_wall = 0;
    int64_t detected_mono = 0, detected_wall = 0;
    double detection_seconds = 0;
    bool detection_measured = false;
    std::vector<std::string> backtrace, stderr_tail;
  };
  // The failureObserved record of a first failure, as the manifest reports it.
  static FirstFailure first_failure_of(schema::JournalRecord::Reader rec);
  struct Attempt {
    std::optional<int64_t> started_wall;  // attemptStarted, else runStarted
    std::optional<int64_t> ended_wall;    // runFinished or runOrphaned
    std::optional<uint32_t> from_step;    // attemptStarted
    std::string checkpoint, reason;
    uint32_t world = 0;
    std::vector<std::string> skipped;
    std::optional<bool> ok;    // runFinished
    bool interrupted = false;  // runFinished of a graceful stop
    schema::FailureKind finished_kind = schema::FailureKind::NONE;
    std::string finished_reason;
    schema::StageKind finished_stage = schema::StageKind::SUPERVISOR;
    uint32_t finished_rank = 0;
    bool orphaned = false;
    std::optional<FirstFailure> first_failure;  // the current attempt's is the manifest's
    std::map<uint32_t, uint32_t> last_step;     // trainer rank -> newest step it journaled
    // The recovery's timeline (monotonic ns of one node).
    std::optional<int64_t> started_mono;                         // attemptStarted
    std::optional<double> teardown_seconds;                      // runFinished of a failure
    std::map<uint32_t, std::pair<int64_t, int64_t>> restored;    // rank -> restore begin, end
    std::map<uint32_t, std::pair<int64_t, int64_t>> first_step;  // rank -> mono, wall
  };
  std::map<uint32_t, Attempt> attempts;
  // Committed checkpoints: (attempt, step) -> path.
  std::map<std::pair<uint32_t, uint32_t>, std::string> commits;

  std::optional<int64_t> run_started_wall;
  struct Finished {
    bool ok = false;
    std::string reason;
    schema::FailureKind kind = schema::FailureKind::NONE;
    schema::StageKind stage = schema::StageKind::SUPERVISOR;
    uint32_t rank = 0;
    int64_t wall_ns = 0;
    int32_t stopped_by_signal = 0;  // a graceful stop
  };
  std::optional<Finished> finished;
  std::optional<int64_t> newest_wall;
  std::map<std::pair<schema::StageKind, uint32_t>, Process> processes;
  std::map<uint32_t, std::map<uint32_t, StepData>> steps;  // trainer rank -> step -> data
  // Held-out evaluations: trainer rank -> the step they followed -> data (every attempt's).
  std::map<uint32_t, std::map<uint32_t, EvalData>> evaluations;
  std::map<uint32_t, double> first_forward;  // trainer rank -> seconds
  // The current attempt's start-up, per trainer rank (receipts/first_forward.json): wall ns of
  // its process start, groups joined, first forward and first backward done; and the launch,
  // the earliest stage the supervisor started in the attempt.
  struct StartUp {
    std::optional<int64_t> process, rendezvous, forward, backward;
  };
  std::map<uint32_t, StartUp> start_up;
  std::optional<int64_t> launch_wall;
  // The current attempt's trainer ranks' BackendIdentity records (receipts/backend_identity.json).
  std::map<uint32_t, std::unique_ptr<capnp::MallocMessageBuilder>> identities;
  // The supervisor's newest jobView record (a job across nodes, node 0): RUN/job.json.
  std::optional<std::string> job_view;
  double teardown_seconds = 0;
  struct Graph {
    std::string reason;
    int64_t wall = 0;
    capnp::MallocMessageBuilder message;
  };
  std::unique_ptr<Graph> graph;
  std::optional<std::pair<int64_t, std::string>> orphaned;  // wall, reason
  // The current attempt's teardown abort of the ranks' collectives, one record per rank asked.
  struct Abort {
    uint32_t rank = 0;
    bool answered = false, had_group = false, ok = false;
    std::string error;
    double abort_seconds = 0, reply_seconds = -1;
  };
  std::vector<Abort> aborts;

  // Folds one journal record. Throws Error{kInvalidArgument} for a record of a newer run format.
  void fold(schema::JournalRecord::Reader rec);
  void fold_attempt(schema::JournalRecord::Reader rec);
  // Where attempt `a` began (0 for the first), from its attemptStarted or launch.json.
  std::optional<uint32_t> from_step(uint32_t a) const;
  // A record of attempt `a` about step `step` still stands unless a later attempt began from
  // an earlier checkpoint (the state it describes was rolled back and trained again).
  bool stands(uint32_t a, uint32_t step) const;
  using Series = std::map<uint32_t, std::map<uint32_t, StepData>>;  // rank -> step -> data
  Series effective_steps() const;
  // The evaluations that still stand, by step: each rank's record (the same loss on every rank).
  std::map<uint32_t, std::map<uint32_t, EvalData>> effective_evaluations() const;
  uint32_t steps_completed(const Series& eff) const;
  bool truncated(const Series& eff) const;
};

}  // namespace megacpp::collector::detail
