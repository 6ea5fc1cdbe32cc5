@0xea6f9595883342d2;
# Shared enums. Schemas only ever add fields and enumerants (old files stay readable).
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("megacpp::schema");
using Json = import "/capnp/compat/json.capnp";

const schemaVersion :UInt32 = 1;

enum StageKind {
  supervisor @0;
  dataLoader @1;
  trainer @2;
  collector @3;
  checkpointer @4;
}

enum Phase {
  startup @0;      # process start to first useful work (budget: generous)
  waitBatch @1;    # trainer waiting on its ring
  forward @2;
  backward @3;
  optimizer @4;    # includes the gradient all-reduce
  snapshot @5;     # copying state into the staging region
  idle @6;         # a service stage with nothing to do
  shutdown @7;
  produce @8;      # data loader filling rings
  write @9;        # checkpointer writing / collector folding
  evaluate @10;    # trainer scoring one slot of held-out (val) data
}

# Typed failures. Enumerants are camelCase; their $Json.name is the snake_case word the
# JSON files (manifest, receipts, failure dumps) have always carried, so the JSON stays
# byte-identical (schemas/json.cpp registers these enums with the codec by annotation).
# Code switches on the enums; schemas/enums.h gives their names for logs and metrics.

# What the supervisor observed (FailureEvent, RunFinished) or the run ended with (RunError).
enum FailureKind {
  none @0 $Json.name("");                      # no failure (an ok RunFinished)
  exited @1;                                   # died with a non-zero exit code
  signaled @2;                                 # killed by a signal
  hung @3;                                     # no progress within its phase budget
  heartbeatLost @4 $Json.name("heartbeat_lost");  # no heartbeat within the timeout
  exception @5;                                # reported a Failure (threw)
  interrupted @6;                              # the supervisor got SIGTERM/SIGINT
  unkillable @7;                               # outlived SIGKILL and its bound
  tornDown @8 $Json.name("torn_down");         # stopped by the teardown of a failed run
  stalled @9;                                  # a restartable stage starved its consumers
  incomplete @10;                              # finished short of the planned steps
  orphaned @11;                                # the supervisor vanished before the end
  diverged @12;                                # a non-finite loss, gradient or parameter
  # A job across nodes (supervisor/job_watch.h): a node went silent (dead, hung or cut off), or
  # another node's first failure ended the job.
  nodeLost @13 $Json.name("node_lost");
  nodeFailed @14 $Json.name("node_failed");
}

# How a process met its own failure, as it reports it (control Failure, failure dump).
enum FailureReport {
  exception @0;                                # an exception left the stage's body
  terminate @1;                                # std::terminate (e.g. one escaped a thread)
  signal @2;                                   # a fatal signal (the crash handler's dump)
}

# The role the supervisor assigned a failed process once teardown was over.
enum FailureRole {
  none @0 $Json.name("");
  firstFailure @1 $Json.name("first_failure");
  victim @2;
  tornDown @3 $Json.name("torn_down");
}

# A process's state as the collector folds it (manifest StageSnapshot.state).
enum ProcessState {
  started @0;
  finished @1;
  exited @2;
  signaled @3;
  unkillable @4;                               # outlived SIGKILL; never reaped
  tornDown @5 $Json.name("torn_down");
  running @6;                                  # alive (journal GraphEntry.state only)
}

# Why the supervisor journaled a child starting, exiting or outliving SIGKILL
# (journal ChildEvent.childReason).
enum ChildReason {
  none @0 $Json.name("");                      # a journal written before this enum: see note
  launch @1;                                   # childStarted: first generation
  restart @2;                                  # childStarted: a new generation; childExited: the replaced one
  exit @3;                                     # childExited: on its own
  stop @4;                                     # childExited: after the supervisor's Stop
  teardown @5;                                 # childExited: by the teardown of a failed run
  survivedKill @6 $Json.name("survived_kill"); # childUnkillable
}

# megacpp::ErrorKind (core/error.h) one to one, in the same order, then the foreign
# exceptions a stage can meet; converted only by schemas/enums.h to_schema/from_schema.
enum ErrorKind {
  invalidArgument @0 $Json.name("invalid_argument");
  system @1;
  zmq @2;
  protocol @3;
  corruption @4;
  timeout @5;
  peerFailure @6 $Json.name("peer_failure");
  interrupted @7;
  internal @8;
  capnp @9;                                    # a kj::Exception
  c10 @10;                                     # a c10::Error (LibTorch)
  std @11;                                     # any other std::exception
  unknown @12;                                 # anything else
  none @13 $Json.name("");                     # not reported (a Failure that is no exception)
  diverged @14;                                # a non-finite loss, gradient or parameter
}
