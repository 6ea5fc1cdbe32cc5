@0xaaed8b688d2868f1;
# The launch contract, RUN/launch.json: written once by the supervisor, read by every stage.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("megacpp::schema");

struct ModelSpec {
  vocabSize @0 :UInt32;
  seqLen @1 :UInt32;
  dModel @2 :UInt32;
  nLayers @3 :UInt32;
  nHeads @4 :UInt32;
  mlpMult @5 :UInt32;
  arch @6 :ArchSpec;            # absent for the plain attention decoder (every field at its default)
}

struct ArchSpec {               # recipes/recipe.h ModelConfig's hybrid fields, [moe], [ssm], [rnn]
  mode @0 :Text;                # "author_dp" | "nemo_native"
  nKvHeads @1 :UInt32;          # 0 = nHeads
  ropeTheta @2 :Float64;
  ffnHidden @3 :UInt32;         # 0 = mlpMult * dModel
  moeEnabled @4 :Bool;
  moeExperts @5 :UInt32;
  moeTopK @6 :UInt32;
  moeExpertHidden @7 :UInt32;
  moeSharedHidden @8 :UInt32;
  moeAuxLossCoef @9 :Float64;
  ssmDState @10 :UInt32;
  ssmHeadDim @11 :UInt32;
  ssmExpand @12 :UInt32;
  ssmConvKernel @13 :UInt32;
  ssmChunk @14 :UInt32;
  rnnWidth @15 :UInt32;         # 0 = dModel
  rnnConvKernel @16 :UInt32;
}

struct OptimSpec {               # recipe [optim]; see recipes/recipe.h OptimConfig
  embedLr @0 :Float64;
  headLr @1 :Float64;
  adamLr @2 :Float64;
  adamBeta1 @3 :Float64;
  adamBeta2 @4 :Float64;
  adamEps @5 :Float64;
  adamWeightDecay @6 :Float64;
  adamwCrossover @7 :UInt32;
  muonLr @8 :Float64;
  muonMomentum @9 :Float64;
  muonBeta2 @10 :Float64;
  muonWeightDecay @11 :Float64;
  muonOrthogonalizer @12 :Text;  # "polar_express" | "newton_schulz"
  muonNsSteps @13 :UInt32;
  muonBf16 @14 :Bool;
  qkvSplit @15 :Bool;
}

struct TrainSpec {
  batchSize @0 :UInt32;         # sequences per rank per step
  minLrRatio @1 :Float64;
  warmupSteps @2 :UInt32;
  gradClip @3 :Float64;
  seed @4 :UInt32;
  checkpointEvery @5 :UInt32;
  optim @6 :OptimSpec;
  memory @7 :MemorySpec;        # written only when a field differs from its default
  eval @8 :EvalSpec;            # written only when the recipe evaluates (evalEvery > 0)
}

# recipe [train] eval_every, eval_tokens; see recipes/recipe.h TrainConfig
struct EvalSpec {
  every @0 :UInt32;             # steps between evaluations (and the last step); 0: none
  tokens @1 :UInt32;            # tokens per evaluation, over all ranks
}

# recipe [train] precision, grad_reduce, recompute; see recipes/recipe.h TrainConfig
struct MemorySpec {
  precision @0 :Text;           # "fp32" | "bf16-mixed"
  gradReduce @1 :Text;          # "fp32" | "bf16"
  recompute @2 :Text;           # "none" | "selective" | "full"
}

struct DataSpec {                # recipe [data]; see recipes/recipe.h DataConfig
  source @0 :Text;              # "builtin" | "llmc" | "megatron"
  shardTokens @1 :UInt32;       # builtin
  shards @2 :UInt32;            # builtin
  path @3 :Text;
  split @4 :Text;
  pack @5 :Bool;
  eosId @6 :Int64;              # -1: none
}

# One token file the run reads, as the supervisor validated it before any stage started.
struct DataFile {
  path @0 :Text;                # absolute; the file holding the tokens (.bin)
  tokens @1 :Float64;           # exact below 2^53
  bytes @2 :Float64;
  documents @3 :Float64;        # documents the index or EOS ids delimit (0: not split)
  maxToken @4 :UInt32;
  xxh3 @5 :Text;                # of the whole file
}

# The data a run trains on, resolved from the recipe's [data] and --data-dir.
struct Dataset {
  format @0 :Text;              # "llmc" | "megatron"
  tokenBytes @1 :UInt32;        # shard token width: 2 or 4 (every file alike)
  slotTokenBytes @2 :UInt32;    # batch slot token width (recipes/batch_spec.h)
  windows @3 :Float64;          # windows per epoch
  documentsWithoutWindow @4 :Float64;  # pack = false: documents shorter than one window
  files @5 :List(DataFile);
  stagedFrom @6 :Text;          # --stage-data: the volume the files were copied from
  eosId @7 :Int64;              # the recipe's, else the dataset manifest's; -1: none
  manifest @8 :Text;            # the dataset.json beside the files, if any
  tokenizer @9 :Text;           # its tokenizer kind
  manifestXxh3 @10 :Text;       # XXH3 of that dataset.json; absent without one
}

# Where each kind of durable output of the run lives (seed 004's storage policy).
struct VolumeUse {
  role @0 :Text;                # "data" | "checkpoints" | "logs"
  filesystem @1 :FilesystemInfo;
}

struct RecipeSpec {
  name @0 :Text;
  path @1 :Text;
  hash @2 :Text;                # xxh3 of the canonical expanded recipe
  pattern @3 :Text;             # block-family pattern, e.g. "AA"
  layers @4 :List(Text);        # the pattern expanded to one entry per layer
  model @5 :ModelSpec;
  train @6 :TrainSpec;
  data @7 :DataSpec;
}

struct EnvVar {
  name @0 :Text;
  value @1 :Text;
}

struct FilesystemInfo {
  path @0 :Text;
  type @1 :Text;                # e.g. ext4, overlay, tmpfs
  device @2 :Text;              # st_dev as major:minor
  isRootVolume @3 :Bool;        # same device as "/"
}

struct Provenance {
  version @0 :Text;
  gitRevision @1 :Text;
  gitDirty @2 :Bool;
  buildType @3 :Text;
  compiler @4 :Text;
  hostname @5 :Text;
  torchVersion @6 :Text;
  kernel @7 :Text;              # uname: sysname release version machine
  cpuModel @8 :Text;            # /proc/cpuinfo "model name"
  cpuCount @9 :UInt32;          # online CPUs
  buildFlags @10 :Text;         # the C++ flags of this build type
}

# Where training starts when it does not start from scratch (DESIGN.md "Resume and recovery").
struct ResumePoint {
  step @0 :UInt32;              # the checkpoint's step: training continues at step + 1 (0: none)
  checkpoint @1 :Text;          # the checkpoint directory, absolute
  world @2 :UInt32;             # the world size that wrote it
  # Sequences per rank and step in this attempt when they differ from the recipe's: a resume
  # at another world size keeps the global batch (recipe batch x the run's first world), so
  # every step trains on the same windows. 0: the recipe's.
  rankBatch @3 :UInt32;
  # The global data position where step + 1 begins (windows of the permuted order taken before
  # it): where the run's data order stood after `step`, also across a branch (`--from`) to
  # another world or batch size. 0 in contracts written before the field: step x the global
  # batch, which held while a run could only continue at its own global batch.
  dataPosition @4 :UInt64;
}

# A run started from another run's checkpoint (`megacpp run --from CKPT`).
struct ParentRun {
  runDir @0 :Text;              # absolute
  runId @1 :Text;
  step @2 :UInt32;
  checkpoint @3 :Text;          # absolute
}

# Which committed checkpoints the checkpointer keeps (`megacpp run --keep-checkpoints`,
# `--keep-every`): the newest `keep` plus every step that is a multiple of `keepEvery` (0: none
# pinned). The supervisor writes keep >= 1; keep 0, like a contract without this struct, keeps
# every checkpoint.
struct CheckpointPolicy {
  keep @0 :UInt32;
  keepEvery @1 :UInt32;
}

# How the ranks' collectives fail and are torn down (DESIGN.md "Failure model as implemented").
struct CollectivePolicy {
  backend @0 :Text;                     # "gloo" | "nccl"
  # A collective gives up after this (Gloo's timeout; NCCL's watchdog timeout).
  timeoutSeconds @1 :Float64;
  # A failed job's teardown sends AbortCollectives to every live, unstopped rank and waits up to
  # abortWaitSeconds for their replies before any signal.
  abortOnTeardown @2 :Bool;
  abortWaitSeconds @3 :Float64;
  # NCCL only, as ProcessGroupNCCL reads them from each rank's environment (the supervisor sets
  # TORCH_NCCL_ASYNC_ERROR_HANDLING, TORCH_NCCL_ENABLE_MONITORING and
  # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC; a value the user set is kept and recorded here).
  ncclAsyncErrorHandling @4 :Int32;     # 2 (CleanUpOnly): a timed-out collective aborts its
                                        # communicator and the rank's wait throws
  ncclEnableMonitoring @5 :Bool;
  ncclHeartbeatTimeoutSeconds @6 :Int32;
}

# One attempt's batch geometry (recipes/batch_spec.h BatchGeometry), resolved once by the
# supervisor from the recipe, the world and a resume's batch per rank. The data loader and the
# trainers read it, never the recipe's batchSize. Absent in contracts written before the field:
# the recipe, world and resume.rankBatch then say it (recipes/recipe.h batch_geometry).
struct BatchGeometry {
  rankBatch @0 :UInt32;         # rows per rank and step
  seqLen @1 :UInt32;            # tokens trained on per row; a row holds seqLen + 1
  tokenBytes @2 :UInt32;        # batch slot token width: 2 or 4
  slotBytes @3 :UInt32;         # one rank's slot: 64-byte header, rankBatch x (seqLen + 1) tokens
  tensorParallel @4 :UInt32;    # consecutive ranks of a group train on one batch
  dataRanks @5 :UInt32;         # world / tensorParallel: ranks with a batch of their own
  windowsPerStep @6 :UInt64;    # the global batch: dataRanks x rankBatch
}

# This node's place in its job (supervisor/placement.h; DESIGN.md "Joining a job across
# nodes"): which engine placed it and what it said. Absent in contracts written before the field
# (one node, placed by nothing).
struct Placement {
  source @0 :Text;              # "flags", "torchrun", "slurm", "kubernetes" or "single"
  nodes @1 :UInt32;
  nodeRank @2 :UInt32;
  masterHost @3 :Text;          # node 0's address; empty with source "single"
  masterPort @4 :UInt32;        # 0 when there is no master
  hosts @5 :List(Text);         # every node's host, by node rank, when the engine names them
  jobId @6 :Text;               # the engine's job id (SLURM_JOB_ID, TORCHELASTIC_RUN_ID, ...)
  attempt @7 :UInt32;           # the engine's restart count (not the run's attempt)
  iface @8 :Text;               # the interface named for cross-node traffic; empty: default
  nodesFrom @9 :Text;           # what stated the node count: "SLURM_NNODES=4", "--nodes 2"
  engineStore @10 :Bool;        # node 0's store is the engine's (torchrun's agent store)
}

struct LaunchContract {
  schemaVersion @0 :UInt32;
  runId @1 :Text;
  generation @2 :UInt32;
  createdAt @3 :Text;
  runDir @4 :Text;              # absolute
  dataDir @5 :Text;             # absolute; token shards live here
  sockDir @6 :Text;             # short private 0700 directory for ipc:// endpoints
  shmPrefix @7 :Text;           # every shm segment of this run starts with it
  controlEndpoint @8 :Text;
  checkpointEndpoint @9 :Text;
  storeHost @10 :Text;
  storePort @11 :UInt32;
  world @12 :UInt32;
  steps @13 :UInt32;
  ringSlots @14 :UInt32;
  ringSlotBytes @15 :UInt32;
  heartbeatIntervalMs @16 :UInt32;
  recipe @17 :RecipeSpec;
  filesystem @18 :FilesystemInfo;
  argv @19 :List(Text);
  env @20 :List(EnvVar);
  provenance @21 :Provenance;
  supervisorPid @22 :Int32;
  supervisorStartTicks @23 :UInt64;  # /proc/<pid>/stat starttime: tells a reused pid apart
  metricsEndpoint @24 :Text;         # http://127.0.0.1:PORT/metrics
  # Progress budgets of the restartable stages: a stage whose working thread reports no
  # progress for this long is hung and restarted. The trainer sizes its snapshot waits on
  # the checkpointer's budget, so a wedged checkpointer is replaced before a rank gives up.
  collectorStallSeconds @25 :Float64;
  loaderStallSeconds @26 :Float64;
  checkpointerStallSeconds @27 :Float64;
  dataset @28 :Dataset;
  volumes @29 :List(VolumeUse);
  # Attempts: 0 for a run's first launch, then one more for every `--resume` and every
  # automatic job restart. launch.json is the current attempt's contract (earlier ones are
  # kept as RUN/attempts/<n>/launch.json); every journal record carries its attempt.
  attempt @30 :UInt32;
  resume @31 :ResumePoint;
  parent @32 :ParentRun;
  checkpointPolicy @33 :CheckpointPolicy;
  # Where every rank trains: "cpu" (Gloo) or "cuda" (rank r on CUDA device r of those visible,
  # NCCL). Empty, as in contracts written before the field existed, means "cpu".
  device @34 :Text;
  # Empty in contracts written before the field existed: Gloo, MEGACPP_COLLECTIVE_TIMEOUT_S, no
  # abort on teardown.
  collectives @35 :CollectivePolicy;
  # The plan's gates this launch passed (recipes/plan.h; DESIGN.md "Hybrid recipes"), for the
  # recipe's mode and this world. Empty in contracts written before the field existed.
  gates @36 :List(GateVerdict);
  # The precision DistMuon orthogonalizes in and how it was chosen (recipe optim.muon_bf16:
  # true, false, or "auto" settled for this device), e.g. "bfloat16 (auto: cpu with amx_bf16)".
  # Empty in contracts written before the field existed (the recipe's muonBf16 then says it).
  muonPrecision @37 :Text;
  # This attempt's batch geometry; ringSlotBytes is its slotBytes. Absent in contracts written
  # before the field existed.
  batch @38 :BatchGeometry;
  placement @39 :Placement;
  # This node's ranks of the world: firstRank .. firstRank + localRanks - 1 (global rank = node
  # rank x ranks per node + local rank). localRanks 0, as in contracts written before the
  # fields: every rank of the world, on this node.
  firstRank @40 :UInt32;
  localRanks @41 :UInt32;
  # Every key the ranks write to the store starts with it (a job across nodes: the job's
  # secret prefix, the same on every node). Empty, as in contracts written before the field:
  # "megacpp/<runId>/".
  storePrefix @42 :Text;
  # Held-out evaluation (recipe train.eval_every): absent when the recipe does not evaluate.
  validation @43 :Validation;
  # Where the ranks stage their snapshots, settled by the supervisor from MEGACPP_SNAPSHOT_STAGING
  # and the plan (recipes/plan.h): "host" (the named shm region), "device" (exported device
  # memory the checkpointer imports) or "memfd" (the same protocol over host memory). Empty, as
  # in contracts written before the field: "host".
  snapshotStaging @44 :Text;
}

# How the run evaluates on its data's val split (README.md "Validation loss"; recipes/batch_spec.h
# ValidationShare). The supervisor resolves it with the training data.
struct Validation {
  every @0 :UInt32;             # the recipe's eval_every
  windows @1 :UInt64;           # windows per evaluation, over all ranks: eval_tokens / seqLen,
                                # at most splitWindows
  splitWindows @2 :UInt64;      # windows the val split holds
  dataset @3 :Dataset;          # the val split's files; absent when off
  off @4 :Text;                 # why the run does not evaluate although the recipe asks; empty
                                # when it does
  ringSlots @5 :UInt32;         # slots of each rank's validation ring (0 when off)
  digest @6 :Text;              # XXH3 of the files' XXH3s and token counts, and the windows:
                                # the comparison class's "validation"
}

struct GateVerdict {            # recipes/plan.h Gate
  rule @0 :Text;
  passed @1 :Bool;
  checked @2 :Bool;             # false: not applicable to this recipe, or not asked for
  detail @3 :Text;
  reason @4 :Text;
  retires @5 :Text;
}
