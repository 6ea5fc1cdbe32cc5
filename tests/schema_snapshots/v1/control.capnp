@0xe7b1ed8d2a503d48;
# Control-plane messages (ZeroMQ, one Cap'n Proto message per frame).
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("megacpp::schema");
using Common = import "common.capnp";

struct Hello {
  stage @0 :Common.StageKind;
  rank @1 :UInt32;
  pid @2 :Int32;
  generation @3 :UInt32;
}

struct Heartbeat {
  stage @0 :Common.StageKind;
  rank @1 :UInt32;
  step @2 :UInt32;              # last completed step (trainer), batches produced (loader), ...
  phase @3 :Common.Phase;
  phaseStartedMonoNs @4 :Int64;
  monoNs @5 :Int64;
  tokens @6 :Float64;           # tokens processed so far (exact below 2^53)
  loss @7 :Float32;             # last step's loss (trainer); NaN otherwise
  stepSeconds @8 :Float64;      # last step's wall time (trainer)
  lagSeconds @9 :Float64;       # collector: append -> fold delay of the newest records
  generation @10 :UInt32;       # launch generation of the sender (restarts bump it)
  # Progress as the stage's working thread (not the heartbeat thread) last reported it:
  # a wedged fold, write or fill stops these while heartbeats go on.
  progressMonoNs @11 :Int64;    # when the working thread last made progress (0: not yet)
  workDone @12 :UInt64;         # units of work done: folds, commits, batches produced
  pendingSinceMonoNs @13 :Int64;  # since when the oldest owed piece of work waits (0: none)
  # A trainer's newest held-out evaluation: its loss (NaN before the first) and the step it
  # followed (0: none yet).
  valLoss @14 :Float32;
  valStep @15 :UInt32;
}

struct Stop {
  reason @0 :Text;
  # A graceful stop (SIGINT/SIGTERM to `megacpp run`): a trainer finishes the step in flight,
  # every rank agrees on that step, commits a checkpoint of it and exits 0. False: leave now.
  afterCheckpoint @1 :Bool;
}

struct Failure {
  stage @0 :Common.StageKind;
  rank @1 :UInt32;
  kind @2 :Text;                # the name of `report`, for readers of schema 1 (not read)
  message @3 :Text;
  phase @4 :Common.Phase;
  step @5 :UInt32;
  monoNs @6 :Int64;             # when the process met the failure (CLOCK_MONOTONIC)
  errorKind @7 :Common.ErrorKind = none;  # what was thrown (peerFailure / timeout mark a victim)
  report @8 :Common.FailureReport;        # how the process met the failure
}

struct TensorEntry {
  name @0 :Text;
  dtype @1 :Text;               # safetensors dtype names: F32, F16, BF16, I64, ...
  shape @2 :List(UInt64);
  offset @3 :UInt64;            # byte offset in the staging region
  bytes @4 :UInt64;
}

struct SnapshotReady {
  rank @0 :UInt32;
  world @1 :UInt32;
  step @2 :UInt32;
  region @3 :Text;              # shm name of the rank's staging region (registered once, leased)
  regionBytes @4 :UInt64;
  tensors @5 :List(TensorEntry);
  final @6 :Bool;               # the end-of-training snapshot
  layout @7 :Text;              # JSON: how to reassemble sharded entries (train_step.h
                                # snapshot_metadata); stored as "megacpp.layout" in the file
  # Where the region's step stamp lies (ipc/staging_stamp.h StagingStamp); 0: the sender has none.
  stampOffset @8 :UInt64;
  # Nonzero: the tensors lie in the rank's exported staging buffer of this generation (a device
  # buffer, or its memfd stand-in; described by the StagedBuffer sent over the handle socket),
  # not in `region`, which then holds only the step stamp.
  stagedGeneration @9 :UInt64;
}

# Trainer -> checkpointer over the handle socket (ipc/handle_socket.h), with the descriptor of the
# rank's exported staging buffer: what that descriptor is. Sent once per connection (a restarted
# checkpointer gets it again on the rank's next connection).
struct StagedBuffer {
  rank @0 :UInt32;
  generation @1 :UInt64;        # nonzero, new for every buffer a rank exports
  kind @2 :Text;                # "cuda": a CUDA virtual-memory allocation; "memfd": host memory
  bytes @3 :UInt64;             # usable bytes
  mappingBytes @4 :UInt64;      # the allocation's size, what the importer maps
  device @5 :Text;              # cuda: the device's PCI bus id
  event @6 :Data;               # cuda: the IPC handle of the event recorded after each copy
}

struct SnapshotAck {
  rank @0 :UInt32;
  step @1 :UInt32;
  ok @2 :Bool;                  # staging region may be reused
  committed @3 :Bool;           # the step's checkpoint (all ranks) is committed
  error @4 :Text;
  # With ok = false: this checkpointer cannot import the rank's exported staging buffer (error
  # says why; it will not on a re-send either). The rank stages this snapshot and every later
  # one in its host region and re-sends, or fails when device staging was forced.
  stagingRefused @5 :Bool;
}

# Supervisor -> trainer, in a failed job's teardown before any signal: abort the rank's process
# group (ProcessGroupNCCL's abort, ncclCommAbort, so no kernel is left spinning in a collective;
# on Gloo, every wait in a collective ends), then reply CollectivesAborted. Sent to every rank
# that is alive and not stopped.
struct AbortCollectives {
  reason @0 :Text;
}

# Trainer -> supervisor: what AbortCollectives did, sent from the rank's control thread once
# the abort returned (so even a rank whose main thread is stuck in a collective answers).
struct CollectivesAborted {
  rank @0 :UInt32;
  hadGroup @1 :Bool;            # false: the rank had no group yet (or a world of 1)
  ok @2 :Bool;                  # the abort returned without an error
  error @3 :Text;
  seconds @4 :Float64;          # the abort call's duration
}

struct ControlMessage {
  schemaVersion @0 :UInt32;
  union {
    hello @1 :Hello;
    heartbeat @2 :Heartbeat;
    stop @3 :Stop;
    failure @4 :Failure;
    snapshotReady @5 :SnapshotReady;
    snapshotAck @6 :SnapshotAck;
    abortCollectives @7 :AbortCollectives;
    collectivesAborted @8 :CollectivesAborted;
  }
}
