@0xaad75c7143265e0e;
# RUN/manifest.json and RUN/receipts/*.json: written only by the collector's fold (JobManifest,
# RUN/job.json of a job across nodes, is node 0's supervisor's).
#
# Typed failures: these structs exist only as JSON documents (never as binary messages), and
# a JSON key is its field's name and its position its ordinal. So StageSnapshot.state/role
# and RunError.kind changed type in place, Text -> enum, keeping name and ordinal: the JSON
# is byte-identical because each enumerant's $Json.name is the word the Text used to hold.
using Cxx = import "/capnp/c++.capnp";
using Launch = import "launch.capnp";
$Cxx.namespace("megacpp::schema");
using Common = import "common.capnp";
using Journal = import "journal.capnp";

enum RunState {
  launched @0;
  running @1;
  ok @2;
  error @3;
  detached @4;
  orphaned @5;
  interrupted @6;               # stopped on request (SIGINT/SIGTERM) after a final checkpoint
}

struct StageSnapshot {
  stage @0 :Common.StageKind;
  rank @1 :UInt32;
  pid @2 :Int32;
  state @3 :Common.ProcessState;
  exitCode @4 :Int32;
  signal @5 :Int32;
  lastStep @6 :UInt32;
  lastRecordAt @7 :Text;
  role @8 :Common.FailureRole;  # "" when none
  restarts @9 :UInt32;
  generation @10 :UInt32;
  restartCauses @11 :List(Text);  # one per restart, oldest first: "generation N: why"
}

struct RunError {
  kind @0 :Common.FailureKind;
  stage @1 :Common.StageKind;
  rank @2 :UInt32;
  message @3 :Text;
  phase @4 :Common.Phase;
  step @5 :UInt32;
  pid @6 :Int32;
  at @7 :Text;                  # wall time the cause happened (a death: when it was reaped)
  detectionSeconds @8 :Float64; # cause -> detection; 0 when detectionMeasured is false
  teardownSeconds @9 :Float64;  # detection -> everything gone
  failureDump @10 :Text;        # relative path, when the process wrote one
  backtrace @11 :List(Text);
  stderrTail @12 :List(Text);
  # False when the cause's time is unknown, so detectionSeconds is not a measurement: a death
  # (no kernel source gives a process's exit time), or no first failure at all.
  detectionMeasured @13 :Bool;
  # The teardown's abort of the ranks' collectives (before any signal), one per rank asked.
  collectivesAborted @14 :List(Journal.CollectiveAbort);
}

struct GraphSnapshot {
  reason @0 :Text;
  at @1 :Text;
  entries @2 :List(Journal.GraphEntry);  # as journaled by the supervisor
}

struct JournalSummary {
  name @0 :Text;
  records @1 :UInt32;
  tornBytes @2 :UInt32;         # bytes skipped as a torn or corrupt tail
}

# One attempt of the run: its first launch, a `--resume`, an automatic job restart.
# How an attempt that started from a checkpoint became productive again, part by part; the
# parts follow one another. Seconds between records of the processes' monotonic clocks (one
# node); -1 where a part was not observed (a resume, a new supervisor, has no teardown or
# preparation of this run to time; records an old attempt did not write).
struct Recovery {
  teardownSeconds @0 :Float64;   # job restart: previous failure detected -> its processes gone
  prepareSeconds @1 :Float64;    # -> checkpoint chosen and verified, next attempt journaled
  relaunchSeconds @2 :Float64;   # -> the slowest rank began restoring (spawn, rendezvous)
  restoreSeconds @3 :Float64;    # -> every rank restored the checkpoint
  firstStepSeconds @4 :Float64;  # -> every rank completed its first step of the attempt
  detectedAt @5 :Text;           # job restart: when the previous failure was detected
  firstStepAt @6 :Text;          # when the last rank completed its first step
}
struct AttemptSummary {
  attempt @0 :UInt32;
  reason @1 :Text;              # "launch" | "resume" | "job_restart"
  fromStep @2 :UInt32;          # the checkpoint step it started from (0: from scratch)
  checkpoint @3 :Text;          # that checkpoint, relative to the run directory
  world @4 :UInt32;
  startedAt @5 :Text;
  endedAt @6 :Text;
  state @7 :RunState;
  lastStep @8 :UInt32;          # the newest step every rank of the attempt completed
  # Steps the attempt completed past the checkpoint the next attempt started from: trained
  # again, and counted once in the receipts.
  stepsLost @9 :UInt32;
  error @10 :RunError;          # its first failure (kind none when it ended ok)
  skippedCheckpoints @11 :List(Text);  # newer checkpoints that did not verify
  recovery @12 :Recovery;       # every attempt after the first (job restart or resume)
}
struct Manifest {
  schemaVersion @0 :UInt32;
  runId @1 :Text;
  recipe @2 :Text;
  recipeHash @3 :Text;
  world @4 :UInt32;
  stepsPlanned @5 :UInt32;
  stepsCompleted @6 :UInt32;
  state @7 :RunState;
  launchedAt @8 :Text;
  runningAt @9 :Text;
  completedAt @10 :Text;
  lastPolledAt @11 :Text;       # time of the newest journal record folded
  error @12 :RunError;
  stages @13 :List(StageSnapshot);
  latestCheckpoint @14 :Text;
  latestCheckpointStep @15 :UInt32;
  receipts @16 :List(Text);
  journals @17 :List(JournalSummary);
  stageGraph @18 :GraphSnapshot;  # at the moment of an error or timeout
  restarts @19 :UInt32;           # restartable-stage restarts over the run
  attempt @20 :UInt32;            # the current attempt (see attempts)
  attempts @21 :List(AttemptSummary);  # every attempt, oldest first
  parent @22 :Launch.ParentRun;   # `--from`: the run and checkpoint this run started from
  stopReason @23 :Text;           # state interrupted: why and where it stopped
  # The model's execution layout and expanded pattern (DESIGN.md "Hybrid recipes"): the
  # recipe's mode, and one block kind per layer (A attention, E experts, F dense MLP,
  # M Mamba-2, R recurrence).
  mode @24 :Text;
  blocks @25 :Text;
  # The recipe's memory settings (recipes/recipe.h TrainConfig): "fp32" | "bf16-mixed", the
  # dtype gradients were summed in across data parallel, and the activation recomputation.
  # Absent when the recipe left them at their defaults (fp32, fp32, none), as its launch
  # contract does, so a run made before they existed folds to the same manifest.
  precision @26 :Text;
  gradReduce @27 :Text;
  recompute @28 :Text;
  validation @29 :ValidationResult;  # absent when the recipe does not evaluate
}

# Held-out evaluation over the run (README.md "Validation loss"; journal Evaluation records that
# still stand), with the launch contract's validation set. Loss figures are absent (0, step 0)
# before the first evaluation.
struct ValidationResult {
  lastLoss @0 :Float64;         # the newest evaluation's mean cross-entropy
  lastStep @1 :UInt32;
  bestLoss @2 :Float64;         # the lowest
  bestStep @3 :UInt32;
  evaluations @4 :UInt32;
  tokens @5 :Float64;           # tokens one evaluation scores, over all ranks
  seconds @6 :Float64;          # every evaluation's time (the slowest rank's), summed: not
                                # in the training tokens/s
  every @7 :UInt32;             # the recipe's eval_every
  windows @8 :UInt64;           # windows per evaluation
  digest @9 :Text;              # the val split's (launch contract Validation.digest)
  off @10 :Text;                # why the run did not evaluate although the recipe asked
  # bench_result.json: its wallSeconds less the evaluations that ended inside it — the time
  # its tokensPerSecond is over (the manifest's: 0).
  trainingSeconds @11 :Float64;
}

struct BenchResult {
  schemaVersion @0 :UInt32;
  runId @1 :Text;
  recipe @2 :Text;
  recipeHash @3 :Text;
  world @4 :UInt32;
  steps @5 :UInt32;
  tokens @6 :Float64;
  firstLoss @7 :Float64;        # mean over ranks of the first step trained (after the parent's, for --from)
  lastLoss @8 :Float64;
  wallSeconds @9 :Float64;      # first step start (rank 0) -> last step end
  tokensPerSecond @10 :Float64;
  meanStepSeconds @11 :Float64;
  # What the numbers were measured on, from launch.json: the data files with their token
  # counts and XXH3 (and where a staged copy came from), and the filesystem that data,
  # checkpoints and logs lived on.
  dataset @12 :Launch.Dataset;
  volumes @13 :List(Launch.VolumeUse);
  # Where and over what the ranks trained: "cpu" | "cuda", and how their collectives time out
  # and are aborted (launch.json's collectives).
  device @14 :Text;
  collectives @15 :Launch.CollectivePolicy;
  mode @16 :Text;               # as Manifest.mode: the comparison class of these figures
  blocks @17 :Text;             # as Manifest.blocks
  precision @18 :Text;          # as Manifest.precision, gradReduce and recompute
  gradReduce @19 :Text;
  recompute @20 :Text;
  memory @21 :RankMemory;       # absent when no step recorded it (journals before the field)
  # Absent when the recipe does not evaluate; else its trainingSeconds (wallSeconds less the
  # evaluations inside it) is what tokensPerSecond divides by.
  validation @22 :ValidationResult;
}

# Host memory per rank, bytes, the largest over the ranks of the current attempt (journal
# StepRecord): the peak resident size, and the peak above the resident size before the model
# was built, both without the pages of mapped files (libtorch's code, shared and reclaimable) —
# what `megacpp plan` estimates per rank.
struct RankMemory {
  peak @0 :Float64;
  aboveBaseline @1 :Float64;
  # Ranks on GPUs: the largest over the ranks of the device memory held by tensors at once and
  # of what torch's caching allocator held from the driver (journal StepRecord), each plus the
  # snapshot staging buffer when it is staged on the device; 0 on CPUs.
  devicePeak @2 :Float64;
  deviceReserved @3 :Float64;
}

struct StepPoint {
  step @0 :UInt32;
  loss @1 :Float64;             # mean over ranks
  stepSeconds @2 :Float64;      # max over ranks
  waitSeconds @3 :Float64;      # max over ranks
  # The sampler state after the step (data/sampler.h): the global window sequence resumes at
  # epoch x windows + cursor. An epoch boundary shows as dataEpoch rising.
  dataEpoch @4 :Float64;
  dataCursor @5 :Float64;
  moe @6 :MoeStepPoint;         # absent for a model without MoE layers
  phases @7 :StepPhasePoint;    # absent when the trainers journaled no phases
}

# Where a step's time went, the mean over ranks of each part (journal StepRecord and
# StepPhases). bench/train_step.py prints it beside its Python twin's.
struct StepPhasePoint {
  forwardSeconds @0 :Float64;
  backwardSeconds @1 :Float64;
  optimizerSeconds @2 :Float64;
  handoffSeconds @3 :Float64;
  clipSeconds @4 :Float64;
  reduceSeconds @5 :Float64;
  orthogonalizeSeconds @6 :Float64;
  updateSeconds @7 :Float64;
  gatherSeconds @8 :Float64;
  snapshotSeconds @9 :Float64;
  betweenSeconds @10 :Float64;
}

struct MoeStepPoint {
  auxLoss @0 :Float64;          # the weighted load-balancing loss, mean over ranks
  # Token assignments per expert summed over ranks: MoE layers in order, n_experts each.
  expertTokens @1 :List(UInt32);
}

struct BenchTelemetry {
  schemaVersion @0 :UInt32;
  runId @1 :Text;
  steps @2 :List(StepPoint);
  firstForwardSeconds @3 :List(Float64);  # per rank
  telemetryTruncated @4 :Bool;
  evaluations @5 :List(EvaluationPoint);  # every evaluation that still stands, by step
}

# One held-out evaluation (journal Evaluation): after `step`, the job's mean cross-entropy over
# `tokens` tokens of the val split.
struct EvaluationPoint {
  step @0 :UInt32;
  loss @1 :Float64;
  tokens @2 :Float64;
  seconds @3 :Float64;          # the slowest rank's
  waitSeconds @4 :Float64;      # the longest any rank waited on its validation ring
}

# receipts/backend_identity.json: what built the run and what each rank computed with.
struct BackendIdentityReceipt {
  schemaVersion @0 :UInt32;
  runId @1 :Text;
  build @2 :Launch.Provenance;  # the supervisor's build: version, revision, compiler, flags
  ranks @3 :List(RankBackend);  # the current attempt's trainer ranks, by rank
}
struct RankBackend {
  rank @0 :UInt32;
  attempt @1 :UInt32;
  identity @2 :Journal.BackendIdentity;  # absent when the rank never joined its groups
}

# receipts/runtime_provenance.json: where and how the run was launched.
struct RuntimeProvenance {
  schemaVersion @0 :UInt32;
  runId @1 :Text;
  recipe @2 :Text;
  recipeHash @3 :Text;
  argv @4 :List(Text);
  env @5 :List(Launch.EnvVar);  # the overlay the launch contract recorded (no secret-like names)
  hostname @6 :Text;
  kernel @7 :Text;
  cpuModel @8 :Text;
  cpuCount @9 :UInt32;
  volumes @10 :List(Launch.VolumeUse);  # run data, checkpoints and logs directories' filesystems
  dataset @11 :Launch.Dataset;          # its files' XXH3 digests when data came from a manifest
  device @12 :Text;
  attempt @13 :UInt32;
  placement @14 :Launch.Placement;  # this node's place in its job (absent before the field)
}

# receipts/first_forward.json: per rank of the current attempt, seconds from the attempt's
# launch (its first stage started) to the rank's start-up milestones; -1 when not reached. A
# rank far behind the others points at a compile, load or rendezvous divergence, not a hang.
struct FirstForwardReceipt {
  schemaVersion @0 :UInt32;
  runId @1 :Text;
  attempt @2 :UInt32;
  ranks @3 :List(RankFirstForward);
  slowestRank @4 :Int32;        # by first backward (-1: none reached it)
  spreadSeconds @5 :Float64;    # slowest minus fastest first backward (0 with one rank)
}
struct RankFirstForward {
  rank @0 :UInt32;
  processStartSeconds @1 :Float64;   # launch -> the rank's process started
  rendezvousSeconds @2 :Float64;     # launch -> its process groups joined
  firstForwardSeconds @3 :Float64;   # launch -> first forward done
  firstBackwardSeconds @4 :Float64;  # launch -> first backward done
}

# RUN/job.json on node 0 of a job across nodes: the job-wide manifest, one section per node,
# written by node 0's supervisor from what every node published through the job's store (its
# job watch: beats, steps, committed parts), as the job goes and when it ends. Each node's own
# RUN/manifest.json (the collector's) stays the record of its ranks.
struct JobManifest {
  schemaVersion @0 :UInt32;
  runId @1 :Text;               # node 0's run
  jobId @2 :Text;               # the engine's (SLURM_JOB_ID, TORCHELASTIC_RUN_ID, ...)
  source @3 :Text;              # where the placement came from (slurm, torchrun, flags, ...)
  state @4 :Text;               # running | ok | error
  firstFailure @5 :Text;        # the job's first failure, naming its node ("" while none)
  nodes @6 :UInt32;
  ranksPerNode @7 :UInt32;
  world @8 :UInt32;
  attempt @9 :UInt32;           # the run's attempt (job restarts in place)
  slowestStep @10 :UInt32;      # the newest step every rank of every node completed
  jobLatest @11 :UInt32;        # the step RUN/checkpoints/JOB_LATEST names (0: none yet)
  updatedAt @12 :Text;
  nodeList @13 :List(JobNode);
}
struct JobNode {
  node @0 :UInt32;
  host @1 :Text;
  firstRank @2 :UInt32;
  ranks @3 :UInt32;
  step @4 :UInt32;              # the newest step every rank of the node completed
  committed @5 :UInt32;         # the newest step it committed its part of
  state @6 :Text;               # running | finished | lost
  metrics @7 :Text;             # its /metrics (host:port), as node 0's file_sd lists it
}
