@0xc572b04758e48d15;
# One record of a process's append-only journal (framed and checksummed by ipc::JournalWriter).
#
# Typed failures: the binary journal is the wire format, and changing a field from Text to an
# enum is not wire compatible. So the enums are NEW fields with new ordinals (failureKind,
# failureRole); the old Text fields are renamed *Text (a rename keeps the wire format), are no
# longer written, and are kept so journals written before them still decode and fold: the
# collector reads them (through the enum's JSON name) only when the enum field is none.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("megacpp::schema");
using Common = import "common.capnp";

struct StepRecord {
  step @0 :UInt32;              # 1-based step just completed
  loss @1 :Float32;
  tokens @2 :UInt32;            # tokens this rank consumed in the step
  stepSeconds @3 :Float64;
  waitSeconds @4 :Float64;      # time blocked on the ring
  forwardSeconds @5 :Float64;
  backwardSeconds @6 :Float64;
  optimizerSeconds @7 :Float64; # all-reduce + update
  # The sampler state once every rank has taken this step (data/sampler.h): the window
  # sequence resumes at (seed, epoch, cursor). Float64: exact below 2^53 windows.
  dataSeed @8 :UInt32;
  dataEpoch @9 :Float64;
  dataCursor @10 :Float64;
  # MoE models: the weighted load-balancing loss of this rank's batch, and this rank's token
  # assignments per expert (MoE layers in order, n_experts each); 0 / empty otherwise.
  auxLoss @11 :Float32;
  expertTokens @12 :List(UInt32);
  # Where the rest of the step's time went (absent in journals written before it existed).
  phases @13 :StepPhases;
  # The rank's host memory in bytes: its peak resident size so far (VmHWM, shared mappings such
  # as the snapshot staging region included once touched), and its resident size before its
  # model was built (libtorch, its groups, the rings). 0 in journals written before them.
  memoryPeak @14 :UInt64;
  memoryBaseline @15 :UInt64;
  # Of those, the pages of mapped files (RssFile: libtorch's code, paged in as it first runs,
  # shared by every rank and reclaimable) at this record and at the baseline. The rank's own
  # memory above its baseline — what the plan estimates — is (memoryPeak - memoryFile) -
  # (memoryBaseline - memoryBaselineFile): exact when no file page came in after the peak, else
  # low by what did. 0 in journals written before them.
  memoryFile @16 :UInt64;
  memoryBaselineFile @17 :UInt64;
  # A rank on a GPU: its device's memory through torch's caching allocator so far, bytes — the
  # most held by tensors at once (what the plan estimates) and the most the allocator held from
  # the driver. 0 on the CPU and in journals written before them.
  deviceMemoryPeak @18 :UInt64;
  deviceMemoryReserved @19 :UInt64;
}

# Parts of one rank's step, host wall seconds. forwardSeconds + backwardSeconds +
# optimizerSeconds + handoffSeconds + snapshotSeconds + betweenSeconds is stepSeconds but for
# the trainer's own bookkeeping between them.
struct StepPhases {
  handoffSeconds @0 :Float64;        # the batch: ring wait (waitSeconds), widening, slot release
  clipSeconds @1 :Float64;           # gradient norm and clipping (within optimizerSeconds)
  reduceSeconds @2 :Float64;         # optimizers: has-grad masks, gradient packing and reduction
  orthogonalizeSeconds @3 :Float64;  # DistMuon's Polar Express / Newton-Schulz
  updateSeconds @4 :Float64;         # optimizers' element-wise math
  gatherSeconds @5 :Float64;         # all-gather of updated parameters
  snapshotSeconds @6 :Float64;       # what the previous step's snapshot blocked the loop for:
                                     # starting its copy into staging, and this step's wait
                                     # for that copy before its update
  betweenSeconds @7 :Float64;        # after the previous step: journal, publish (and the stop
                                     # agreement under tensor parallelism)
}

# A trainer rank's evaluation on the val split after a step (README.md "Validation loss"):
# every rank of the job journals the same loss and tokens (their all-reduced sums).
struct Evaluation {
  step @0 :UInt32;              # the step just trained
  loss @1 :Float64;             # mean cross-entropy over every token the job scored
  tokens @2 :UInt64;            # tokens the job scored (the launch contract's windows x seqLen)
  rankTokens @3 :UInt64;        # of them, this rank's (its tensor-parallel group's)
  seconds @4 :Float64;          # this rank's evaluation: first slot awaited -> the job's sum
  waitSeconds @5 :Float64;      # of which waiting on its validation ring
}

struct CheckpointRecord {
  step @0 :UInt32;
  path @1 :Text;                # relative to the run directory
  bytes @2 :UInt64;
  seconds @3 :Float64;          # first snapshot received -> directory committed
}

struct ChildEvent {
  stage @0 :Common.StageKind;
  rank @1 :UInt32;
  pid @2 :Int32;
  exitCode @3 :Int32;           # -1 when signaled
  signal @4 :Int32;             # 0 when exited
  generation @5 :UInt32;
  note @6 :Text;                # obsolete: the reason as text, read only when childReason is none
  cause @7 :Text;               # restart: why the previous generation was replaced
  childReason @8 :Common.ChildReason;
}

struct RunStarted {
  world @0 :UInt32;
  stepsPlanned @1 :UInt32;
}

struct RunFinished {
  ok @0 :Bool;
  reason @1 :Text;
  kindText @2 :Text;            # obsolete: the kind as a name; read only when failureKind is none
  stage @3 :Common.StageKind;
  rank @4 :UInt32;
  teardownSeconds @5 :Float64;  # failure detected -> every process gone and shm/sockets removed
  failureKind @6 :Common.FailureKind;  # typed reason when not ok
  # A graceful stop: the signal `megacpp run` got (SIGINT 2, SIGTERM 15); every rank committed
  # a checkpoint of the agreed step and exited. ok is false, failureKind interrupted, and no
  # process is a first failure.
  stoppedBySignal @7 :Int32;
}

# A failure the supervisor observed, with the role it assigned once teardown was over.
struct FailureEvent {
  stage @0 :Common.StageKind;
  rank @1 :UInt32;
  kindText @2 :Text;            # obsolete (see failureKind): read only when failureKind is none
  message @3 :Text;
  roleText @4 :Text;            # obsolete (see failureRole): read only when failureRole is none
  evidenceMonoNs @5 :Int64;     # when the cause happened (death, silence start, phase start, throw)
  detectedMonoNs @6 :Int64;     # when the supervisor learned of it
  phase @7 :Common.Phase;
  step @8 :UInt32;
  pid @9 :Int32;
  stderrTail @10 :List(Text);
  backtrace @11 :List(Text);
  # True when evidenceMonoNs is not when the cause happened but when the supervisor learned of
  # it: a death, whose exit time no kernel interface gives an unprivileged parent (SIGCHLD,
  # waitid and pidfds carry no timestamp), so it is the reap time.
  evidenceUnmeasured @12 :Bool;
  failureKind @13 :Common.FailureKind;
  failureRole @14 :Common.FailureRole;
}

struct GraphEntry {
  stage @0 :Common.StageKind;
  rank @1 :UInt32;
  pid @2 :Int32;
  generation @3 :UInt32;
  state @4 :Text;               # a Common.ProcessState name: running | exited | signaled
  heartbeatAgeSeconds @5 :Float64;
  phaseAgeSeconds @6 :Float64;
  step @7 :UInt32;
  phase @8 :Common.Phase;
  restarts @9 :UInt32;
  progressAgeSeconds @10 :Float64;  # since the working thread last reported progress (-1: never)
  workDone @11 :UInt64;             # folds / commits / batches produced, as last reported
  pendingAgeSeconds @12 :Float64;   # age of the oldest owed piece of work (0: none)
}

# The stage graph at the moment of an error or timeout.
struct StageGraph {
  reason @0 :Text;
  entries @1 :List(GraphEntry);
}

# Written by `megacpp status`/`collect` when the supervisor is gone and the run never finished.
struct RunOrphaned {
  supervisorPid @0 :Int32;
  reason @1 :Text;
}

# The supervisor began an attempt of the run (a resume or an automatic job restart; the first
# launch journals none): training continues from the checkpoint of fromStep.
struct AttemptStarted {
  attempt @0 :UInt32;
  fromStep @1 :UInt32;
  checkpoint @2 :Text;          # relative to the run directory
  reason @3 :Text;              # "resume" | "job_restart"
  world @4 :UInt32;
  # Newer checkpoints that did not verify and were set aside: "checkpoints/step_N: problem".
  skipped @5 :List(Text);
}
# A trainer rank loaded a checkpoint before its first step of the attempt.
struct CheckpointRestored {
  step @0 :UInt32;
  checkpoint @1 :Text;          # as the launch contract names it
  world @2 :UInt32;             # ranks that wrote the checkpoint
  seconds @3 :Float64;          # open -> every parameter and optimizer tensor copied in
}
struct FirstForward {
  seconds @0 :Float64;          # process start -> first forward done
}
# A trainer rank reached a start-up milestone (rendezvousDone: its process groups are joined;
# firstBackward: its first step's backward is done); the record's wallNs is when.
struct Milestone {
  seconds @0 :Float64;          # process start -> the milestone
}
# What a trainer rank computes with, journaled once it has joined its process groups.
struct BackendIdentity {
  torchVersion @0 :Text;        # the libtorch the rank runs (TORCH_VERSION of its headers)
  backend @1 :Text;             # "gloo" | "nccl" | "none" (one rank)
  backendVersion @2 :Text;      # NCCL's version on CUDA; Gloo is torch's own
  device @3 :Text;              # "cpu" | "cuda:N"
  deviceName @4 :Text;          # the CPU model, or the CUDA device's name
  threads @5 :UInt32;           # torch intra-op threads
  tensorParallel @6 :UInt32;    # 1, or the size of its tensor-parallel group
  compiler @7 :Text;            # of the trainer binary
  buildType @8 :Text;
  orthogonalization @9 :Text;   # DistMuon's precision: "bfloat16" | "float32"
  cpuBf16Units @10 :Text;       # the host CPU's bfloat16 matrix units ("amx_bf16 avx512_bf16", "")
  hostAllocator @11 :Text;      # CPU tensors: "cache >= N bytes" (MEGACPP_HOST_ALLOCATOR) | "system"
}

# The supervisor asked a rank to abort its collectives in a failed job's teardown (before any
# signal): what the rank replied, or that it did not within the wait.
struct CollectiveAbort {
  rank @0 :UInt32;
  answered @1 :Bool;            # false: no reply within abortWaitSeconds (or the rank exited)
  hadGroup @2 :Bool;
  ok @3 :Bool;
  error @4 :Text;
  abortSeconds @5 :Float64;     # the rank's abort call
  replySeconds @6 :Float64;     # request sent -> reply received (-1 when not answered)
}

struct JournalRecord {
  schemaVersion @0 :UInt32;
  monoNs @1 :Int64;
  wallNs @2 :Int64;
  stage @3 :Common.StageKind;
  rank @4 :UInt32;
  pid @5 :Int32;
  union {
    processStarted @6 :Void;
    processFinished @7 :Void;
    step @8 :StepRecord;
    checkpointCommitted @9 :CheckpointRecord;
    childStarted @10 :ChildEvent;
    childExited @11 :ChildEvent;
    runStarted @12 :RunStarted;
    runFinished @13 :RunFinished;
    firstForward @14 :FirstForward;
    failureObserved @15 :FailureEvent;
    stageGraph @16 :StageGraph;
    runOrphaned @17 :RunOrphaned;
    # The supervisor gave up on a child that outlived SIGKILL and its bound (e.g. stuck in
    # uninterruptible I/O); it was not reaped. exitCode and signal are 0.
    childUnkillable @18 :ChildEvent;
    attemptStarted @20 :AttemptStarted;
    checkpointRestored @21 :CheckpointRestored;
    collectivesAborted @22 :CollectiveAbort;
    rendezvousDone @23 :Milestone;
    firstBackward @24 :Milestone;
    backendIdentity @25 :BackendIdentity;
    # Node 0's supervisor in a job across nodes: the job's manifest as its job watch sees every
    # node (a JobManifest of manifest.capnp, as JSON: this file cannot import that one), at most
    # once a second and at the job's end. The collector folds the newest into RUN/job.json.
    jobView @26 :Text;
    evaluation @27 :Evaluation;
  }
  # The run attempt that wrote the record (launch.json's attempt; 0 in journals written
  # before attempts existed).
  attempt @19 :UInt32;
}

# RUN/failures/<stage>-<rank>.json: written by a process on its way down.
struct FailureDump {
  schemaVersion @0 :UInt32;
  stage @1 :Common.StageKind;
  rank @2 :UInt32;
  pid @3 :Int32;
  kind @4 :Text;                # exception | signal | ...
  errorKind @5 :Text;           # megacpp::ErrorKind name when the exception was ours
  message @6 :Text;
  phase @7 :Common.Phase;
  step @8 :UInt32;
  monoNs @9 :Int64;
  at @10 :Text;
  backtrace @11 :List(Text);
}
