// The job controller: decides everything about one job (`megacpp run`) and owns no process.
// Not a public header (supervisor.h is). One JobController per `megacpp run`; it talks to the
// node agent of its host (supervisor/node_agent.h) only through a NodeAgentLink: commands
// (launch, stop, tear down, restart a stage, ...) go down, events (started, exited, a stage's
// hello, heartbeat and failure, a stop request) come back (schemas/node.capnp). Its members are
// split by what they do: run_dir.cpp (pre-flight, run directory, launch contract), children.cpp
// (what the controller does on a stage's start and exit, graceful stop, restarts), watch.cpp
// (the watch loop and the run's lifecycle), teardown.cpp (teardown and cleanup), report.cpp
// (roles, the final journal records, the report). The rules the watch loop applies are
// failure_policy.h's.
//
// Blocking: the watch loop blocks only in NodeAgentLink::poll with a 100 ms timeout (the
// agent's ipc::Poller wait over the control ROUTER and a signalfd). Every wait for a child is
// bounded.
#pragma once

#include <sys/types.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <capnp/message.h>

#include "core/knobs.h"
#include "data/dataset.h"
#include "ipc/channel.h"
#include "ipc/journal.h"
#include "recipes/plan.h"
#include "recipes/recipe.h"
#include "schemas/common.capnp.h"
#include "supervisor/console.h"
#include "supervisor/failure_policy.h"
#include "supervisor/job_watch.h"
#include "supervisor/membership.h"
#include "supervisor/metrics.h"
#include "supervisor/node_agent.h"
#include "supervisor/node_agent_link.h"
#include "supervisor/rendezvous.h"
#include "supervisor/supervisor.h"

namespace megacpp::supervisor {

namespace fs = std::filesystem;

// Slots of each rank's validation ring: the loader fills an evaluation's next slots while the
// rank scores the current ones.
inline constexpr uint32_t kValidationRingSlots = 2;
using schema::Phase;
using schema::StageKind;

namespace detail {

struct Child {
  StageKind stage;
  uint32_t rank;
  std::string name;
  pid_t pid = -1;
  uint32_t generation = 0;
  uint32_t restarts = 0;
  bool alive = false;
  bool seen = false;  // a Hello or heartbeat of this generation arrived
  bool stop_sent = false;
  // A trainer told of the graceful stop under way (JobController::ask_to_stop). One whose control
  // socket had not connected when the stop began is told on its hello.
  bool stop_asked = false;
  int exit_code = 0;
  int signal = 0;
  int64_t started_ns = 0;
  int64_t heartbeat_ns = 0;      // last heartbeat or hello (supervisor's receive time)
  int64_t phase_started_ns = 0;  // from the heartbeat (CLOCK_MONOTONIC is shared by the host)
  int64_t progress_ns = 0;       // last time the step advanced
  double last_step_wall = 0;
  uint32_t step = 0;
  Phase phase = Phase::STARTUP;
  double tokens = 0;
  float loss = NAN;
  float val_loss = NAN;   // the newest held-out evaluation's (trainers)
  uint32_t val_step = 0;  // the step it followed; 0: none yet
  double step_seconds = 0;
  double lag_seconds = 0;
  // As the working thread reported it (CLOCK_MONOTONIC of the stage; 0: not reported yet).
  int64_t work_ns = 0;
  uint64_t work_done = 0;
  int64_t pending_since_ns = 0;
  // A restart in progress: the previous generation was sent SIGKILL at dying_since_ns and
  // the next one is launched only once dying_pid is reaped, so two generations never share
  // a ring, a socket or the manifest.
  pid_t dying_pid = 0;
  int64_t dying_since_ns = 0;
  std::string restart_cause{};
};

using policy::Event;

struct Failure {
  schema::FailureKind kind = schema::FailureKind::NONE;
  StageKind stage = StageKind::SUPERVISOR;
  uint32_t rank = 0;
  std::string message;
  uint32_t step = 0;  // the failed process's step when it happened
};

// How the ranks' collectives time out and are torn down: launch.json's collectives
// (schemas/launch.capnp CollectivePolicy), and what it adds to each trainer's environment.
struct CollectivePlan {
  std::string backend = "gloo";
  double timeout_s = 300;
  int nccl_async_error_handling = 0;  // NCCL only (0 for Gloo)
  bool nccl_enable_monitoring = false;
  int nccl_heartbeat_timeout_s = 0;
  std::vector<std::string> env;  // "K=V" for each trainer (NCCL's, where the user set none)
};

// A rank's reply to AbortCollectives, as on_message stored it.
struct AbortReply {
  bool had_group = false;
  bool ok = false;
  std::string error;
  double abort_s = 0;
  int64_t received_ns = 0;
};

class JobController {
 public:
  // `megacpp run`: the node agent of this host, in process.
  explicit JobController(RunOptions o);
  // A controller over `link` for the run directory `run`, with its journals and metrics (no
  // /metrics server) but no pre-flight and no launch contract: what supervise() needs. Tests
  // drive it with scripted node events.
  JobController(RunOptions o, NodeAgentLink& link, const fs::path& run);
  ~JobController() { cleanup(); }
  JobController(const JobController&) = delete;
  JobController& operator=(const JobController&) = delete;

  int execute();
  // The attempts of the job: launch, watch, finish or tear down and classify, a job restart
  // when the policy allows one. Returns the first failure of the last attempt (nullopt: ok, or
  // stopped gracefully).
  std::optional<Failure> supervise();

 private:
  void prepare();
  // A job across nodes: what this build refuses of one (each in one line), in one place.
  void check_job_across_nodes();
  // The ranks' store: this host's own (one node), or node 0's after the job's nodes agreed on
  // what they run (membership.h join_job).
  void host_or_join_store();
  // A job across nodes: this node's /metrics target into the store; node 0 writes them all as
  // RUN/metrics_sd.json (Prometheus file_sd).
  void publish_metrics_targets(const std::string& prefix);
  // Node 0 of a job across nodes: RUN/job.json (schema::JobManifest), every node's section from
  // its job watch's view; `state` running | ok | error. At most once a second while running.
  void write_job_manifest(std::string_view state);
  // Global rank of this node's local rank `local`.
  uint32_t global_rank(uint32_t local) const { return first_rank_ + local; }
  // --device cuda: the trainer's CUDA plugin is built and one device per rank is visible, or a
  // one-line Error{kInvalidArgument}.
  void check_cuda_devices() const;
  void adopt_previous_attempt();
  void adopt_parent_checkpoint();
  void begin_attempt();
  // The earlier attempt's contract and failure dumps to RUN/attempts/<previous_attempt_>/;
  // checkpoints that did not verify set aside; LATEST names the one resumed from.
  void archive_attempt();
  // resume_ := the newest checkpoint of the run that verifies (none: reset), no later than
  // `at_most`; the newer ones that do not are logged (prefixed by `why`) into skipped_ /
  // skipped_steps_.
  void choose_checkpoint(std::string_view why, std::optional<uint32_t> at_most = std::nullopt);
  // A job across nodes: resume_ := the newest step whose part verifies on every node, agreed
  // through the store (this node's newer parts are set aside with skipped_steps_). Blocks until
  // every node offered (store timeout per round); no-op on one node.
  void agree_checkpoint(std::string_view why);
  // The recipe the command line names, with its overrides (--data-source, --data-path, --mode)
  // composed over it and rehashed: a new run's, and what an engine's restart is checked against.
  recipe::Recipe command_line_recipe() const;
  // A job across nodes restarts in place only when every node can (its refusal and theirs,
  // through the store; a node that does not answer within 60 s refuses): the refusal, or
  // nullopt to restart. One node: `mine`.
  // A new job across nodes (not a resume): every node's --from, or its absence, is every other
  // node's (through the store), else one line naming both.
  void agree_branch();
  std::optional<std::string> agree_job_restart(std::optional<std::string> mine);
  void start_job_watch();  // this attempt's JobWatch (keys under watch/a<attempt>)
  void journal_attempt_started(std::string_view reason);  // attemptStarted of attempt_, synced
  void create_rings();  // the batch plane of this attempt: shm_prefix_, batch_'s slots
  // The supervisor's journal (ProcessStarted appended) and the checkpointer's, read for commits.
  void open_journals();
  void launch_attempt();
  // Why the failure just classified is not retried as the next attempt; nullopt: retry it.
  std::optional<std::string> job_restart_refusal() const;
  // The newest step every rank of this attempt journaled (the trainers' journals, not their
  // heartbeats, which a dying rank may not have sent): where the job stood when it failed.
  uint32_t journaled_progress() const;
  // Ends the failed attempt in the journal and prepares the next one in this process: new
  // rings and launch contract, state reset; the stages are launched by launch_attempt().
  void restart_job();
  void write_launch_contract();
  void launch(StageKind stage, uint32_t rank, uint32_t generation, schema::ChildReason reason,
              const std::string& cause = {});
  void watch();
  // RunOptions::detach, once every stage said hello: tells the launching command (stdout) and
  // moves stdout and stderr to logs/supervisor.log.
  void detach_output();
  // Moves stdout and stderr to RUN/logs/supervisor.log (a detached run, from then on).
  void move_output_to_log();
  // A detached run's launching command closed its end of the output pipe (it died).
  bool launcher_gone() const;
  void pump(int timeout_ms);
  // A node event (schemas/node.capnp), handled on the caller's thread.
  void on_event(schema::NodeEvent::Reader e);
  void on_started(schema::StageStarted::Reader s);
  void on_exited(schema::StageExited::Reader x);
  void on_message(const std::string& peer, schema::ControlMessage::Reader root);
  // SIGINT/SIGTERM reached the supervisor: the graceful stop, or a second time, stop at once.
  void on_stop_request(int signo);
  void begin_graceful_stop(int signo);
  // Sends the graceful stop to one trainer; false when its control socket is not connected yet.
  bool ask_to_stop(Child& c);
  void journal_child_exited(const Child& c, schema::ChildReason reason);
  void check_liveness();
  // RunOptions::spare_trainers: asks the agent for one spare per trainer, once per attempt.
  void keep_spares();
  // A job across nodes: another node's failure or a lost node (JobWatch's verdict) ends this
  // node's attempt as the supervisor's event.
  void check_job_watch();
  // After this node's teardown for a failure only victims claim (a rank that lost a peer): the
  // job's verdict, awaited up to the watch's silence limit, names the node that caused it.
  void adopt_job_verdict();
  Event job_verdict_event(const JobWatch::Verdict& v, int64_t now) const;
  void restart_or_fail(Child& c, const std::string& why, Event ev);
  void record(Child& c, Event ev);
  void finish_ok();
  void teardown();
  // The first part of teardown(): AbortCollectives to every live, unstopped trainer, a bounded
  // wait for their replies, one journal record per rank asked (DESIGN.md "GPU lane (first
  // part)": abort before signals).
  void abort_collectives();
  void plan_collectives();  // collectives_ from the options, the knobs and the environment
  void classify();
  void journal_graph(const std::string& reason);
  bool wait_for(const std::function<bool()>& done, double seconds);
  void stop_child(Child& c);
  void kill_child(const Child& c, int sig);
  void give_up_on(const Child& c, double waited_s = kKillWaitS);
  void journal_run_finished(bool process_finished = true);
  void update_metrics();
  void poll_commits();  // the checkpointer's journal: /metrics and committed_step_
  // A job across nodes: RUN/checkpoints/JOB_LATEST names the newest step every node committed,
  // once the job watch says it moved (the second phase of the job's checkpoint).
  void advance_job_latest();
  void publish_progress();  // a job across nodes: this node's slowest rank's step to the watch
  void release_ipc();
  void release_attempt_ipc();  // the attempt's rings (and shm segments) only
  int report();
  void cleanup();
  Child* by_name(const std::string& n);
  // A generation killed for a restart was reaped: journal it and launch the next one
  // (unless the run is ending).
  void reaped_dying(Child& dying, int exit_code, int signal);
  // One command to the node agent (schemas/node.capnp NodeCommand); its result as
  // NodeAgentLink::command says.
  template <class F>
  bool command(F&& build);
  bool all_trainers_done() const;
  double phase_budget(const Child& c) const;
  double stall_budget(StageKind s) const;
  const Child* waited_on(const Child& trainer);
  void check_stage_progress(Child& c, int64_t now);

  static policy::Budgets budgets_of(const RunOptions& o) {
    return policy::Budgets{o.startup_budget_s,
                           o.hang_budget_s,
                           o.hang_multiple,
                           o.heartbeat_timeout_s,
                           o.heartbeat_interval_ms / 1000.0,
                           o.collector_stall_s,
                           o.loader_stall_s,
                           o.checkpointer_stall_s};
  }

  RunOptions opt_;
  policy::Budgets budgets_;
  recipe::Recipe recipe_;
  // How the recipe's muon_bf16 was settled (recipe::resolve_muon_precision), for the launch
  // contract: e.g. "bfloat16 (auto: cpu with amx_bf16)".
  std::string muon_precision_;
  std::string snapshot_staging_ = "host";  // the launch contract's snapshotStaging
  std::vector<recipe::Gate> gates_;  // the plan's verdicts for recipe_ at this world (all passed)
  NodePlacement placement_;          // this node's place in its job, resolved in prepare()
  // The job's world (nodes x ranks per node) and this node's first global rank; opt_.ranks is
  // the ranks of this node. Set in prepare() once the world is known.
  uint32_t world_ = 0;
  uint32_t first_rank_ = 0;
  std::string store_host_;
  uint16_t store_port_ = 0;
  std::string store_prefix_;   // empty: one node ("megacpp/<run id>/")
  std::string job_prefix_;     // a job across nodes: ipc::job_store_prefix of its key file
  std::string engine_prefix_;  // job_prefix_/r<round>: this start's keys (membership.h)
  std::vector<std::string> metrics_targets_;  // node 0: every node's /metrics host:port
  int64_t job_manifest_ns_ = 0;               // when job.json was last written
  std::unique_ptr<JoinedJob> joined_;  // a job across nodes: the membership and node 0's store
  SealedRecords::Seal job_seal_;       // a job across nodes: ipc::RecordSealer of its keys
  std::unique_ptr<SealedRecords> job_records_;  // the agreements' records, over joined_'s store
  std::unique_ptr<JobWatch> job_watch_;  // a job across nodes: beats and the job's first failure
  // Attempts (DESIGN.md "Resume and recovery"): 0 for a run's first launch.
  struct ResumeInfo {
    uint32_t step = 0;
    fs::path dir;               // the checkpoint directory, absolute
    std::string relative_path;  // as the manifest names it
    uint32_t world = 0;         // the world that wrote it
  };
  struct ParentInfo {
    std::string run_dir, run_id;
    uint32_t step = 0;
    std::string checkpoint;
  };
  uint32_t attempt_ = 0;
  uint32_t previous_attempt_ = 0;
  std::optional<ResumeInfo> resume_;
  std::optional<ParentInfo> parent_;
  uint64_t global_batch_ = 0;
  // The run's data order (data/sampler.h SamplerConfig::start): step data_base_step_ ended at
  // global position data_base_position_, and each later step takes the run's global batch. 0, 0
  // for a run from scratch; a branch (--from) starts where its parent's data order stood after
  // the checkpoint's step, whatever its own world and batch.
  uint32_t data_base_step_ = 0;
  uint64_t data_base_position_ = 0;
  // Where step `step` ends in the run's data order.
  uint64_t data_position_after(uint32_t step) const;
  uint32_t rank_batch_ = 0;           // 0: the recipe's batch per rank
  std::vector<std::string> skipped_;  // "checkpoints/step_N: problems"
  std::vector<uint32_t> skipped_steps_;
  data::ResolvedDataset previous_dataset_;
  std::string previous_validation_digest_;  // a resumed run's val split, as it started
  std::string created_at_;
  data::ResolvedDataset dataset_;
  data::ResolvedValidation validation_;  // the val split (recipe train.eval_every)
  fs::path run_;
  fs::path sock_dir_;
  std::string run_id_, shm_prefix_, control_ep_, checkpoint_ep_;
  std::string fs_type_, fs_device_;
  bool fs_root_ = false;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<MetricsServer> metrics_server_;
  std::string metrics_endpoint_;
  std::string metrics_target_;  // host:port of /metrics (the file_sd target)
  std::unique_ptr<StoreServer> store_;
  // This host's node agent and the link to it (`megacpp run`); a test's controller has only
  // link_, its own.
  std::unique_ptr<SystemSpawner> spawner_;
  std::unique_ptr<NodeAgent> agent_;
  std::unique_ptr<InProcessLink> in_process_;
  NodeAgentLink* link_ = nullptr;
  std::unique_ptr<ipc::JournalWriter> journal_;
  std::unique_ptr<ipc::JournalReader> checkpoint_journal_;
  std::vector<Child> children_;
  std::set<pid_t> unkillable_;           // the agent gave up on them (outlived SIGKILL)
  std::map<std::string, Event> events_;  // by process name: the most telling event of each
  int64_t detected_ns_ = 0;              // first event; 0 while the run is healthy
  std::string detected_what_;            // that event, as logged
  int64_t teardown_started_ns_ = 0;
  int64_t teardown_done_ns_ = 0;  // every process of the attempt gone (or given up on)
  CollectivePlan collectives_;
  std::map<std::string, AbortReply> abort_replies_;  // by process name, this teardown's
  int stop_signal_ = 0;  // the graceful stop under way (SIGINT/SIGTERM), 0: none
  // A second SIGINT/SIGTERM during the graceful stop: the user asked to stop at once. The job
  // is torn down without waiting for the step in flight; the run ends `interrupted` (not a
  // failure) with the newest committed checkpoint as it was.
  int stop_at_once_signal_ = 0;
  int64_t stop_deadline_ns_ = 0;  // --stop-grace-s after it began
  uint32_t committed_step_ = 0;   // newest checkpoint this attempt committed
  uint32_t job_latest_ = 0;       // the step JOB_LATEST names (a job across nodes)
  uint32_t job_restarts_ = 0;
  bool spares_kept_ = false;  // this attempt asked for its spares (keep_spares)
  // This start is an engine's restart of the run in --run-dir (prepare): it resumes, from step
  // 0 when no checkpoint is there yet.
  bool engine_restart_ = false;
  std::optional<uint32_t> failed_progress_;    // this attempt's, once it failed
  std::optional<uint32_t> previous_progress_;  // the last attempt's, in this process
  recipe::BatchGeometry batch_;       // this attempt's batch geometry (launch contract batch)
  std::optional<Failure> failure_;    // the first failure, once classified
  std::vector<double> step_samples_;  // trainer step seconds (for the median)
  bool done_ = false;
  // finish_ok() began: training ended with its final checkpoint committed, and the loader, the
  // checkpointer and then the collector are asked to stop. One that dies now is not restarted
  // (a new generation would never be told to stop, and nothing is left for it to do: the
  // supervisor folds the final state itself).
  bool draining_ = false;
  bool detached_ = false;  // RunOptions::detach: output moved to logs/supervisor.log
  bool released_ = false;
  bool cleaned_ = false;
  // The source's git revision, read once (two git processes, tens of ms): the /metrics build
  // info, the job's identity check and every attempt's launch contract name the same one.
  struct SourceRevision {
    std::string revision;
    bool dirty = false;
  };
  std::optional<SourceRevision> source_revision_;
  const SourceRevision& source_revision();
  std::unique_ptr<Console> console_;
};

template <class F>
bool JobController::command(F&& build) {
  capnp::MallocMessageBuilder msg;
  build(msg.initRoot<schema::NodeCommand>());
  return link_->command(msg.getRoot<schema::NodeCommand>().asReader());
}

}  // namespace detail
}  // namespace megacpp::supervisor
