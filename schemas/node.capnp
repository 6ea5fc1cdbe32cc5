@0xc4a73dc489090d90;
# The job controller <-> node agent plane (DESIGN.md "Lifecycle as implemented"): the commands a
# job controller sends the node agent that owns the processes of one host, and the events the
# agent sends back. In-process on one host (supervisor/node_agent.h InProcessLink); between
# hosts the same messages travel in NodeLinkFrames over ZeroMQ with CURVE
# (supervisor/zmq_node_link.h). A process is named by its stage and rank
# (layout::process_name). Not written to any file: no snapshot under tests/schema_snapshots;
# both ends of a link run the same build (the job checks it), and a frame of another
# NodeLinkFrame version is dropped and counted.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("megacpp::schema");
using Common = import "common.capnp";
using Control = import "control.capnp";

struct StageRef {
  stage @0 :Common.StageKind;
  rank @1 :UInt32;
}

# Commands (controller -> agent).

struct LaunchStage {
  process @0 :StageRef;
  generation @1 :UInt32;
  reason @2 :Common.ChildReason;  # echoed in `started`
  cause @3 :Text;                 # a restart's cause, echoed in `started`
  # The stage's environment: the agent's own, unless tuneEnvironment, then the agent's with
  # these GLIBC_TUNABLES entries (a value its environment sets is kept), plus extraEnv.
  tuneEnvironment @4 :Bool;
  tunables @5 :List(Text);
  extraEnv @6 :List(Text);        # "K=V"
}

struct StopStage {
  process @0 :StageRef;
  reason @1 :Text;
  afterCheckpoint @2 :Bool;       # a graceful stop: finish the step in flight, commit, exit
  sigtermIfUnreachable @3 :Bool;  # its control socket is not connected: SIGTERM instead
}

struct AbortStageCollectives {
  process @0 :StageRef;
  reason @1 :Text;
}

struct TearDown {
  # false: the teardown signal to every live process (SIGTERM; SIGKILL at once to one that is
  # stopped or listed in `silent`); true: SIGKILL to every one still alive after graceSeconds.
  kill @0 :Bool;
  silent @1 :List(StageRef);
  graceSeconds @2 :Float64;
}

struct RestartStage {
  process @0 :StageRef;           # SIGKILL to its live generation; `exited` (restart) at the reap
}

struct SignalStage {
  process @0 :StageRef;
  signal @1 :Int32;
}

struct GiveUp {
  process @0 :StageRef;           # outlived SIGKILL: never waited for again (`unkillable` once)
  waitedSeconds @1 :Float64;
}

struct PrepareAttempt {
  shmPrefix @0 :Text;             # the attempt's batch plane: one slot ring per rank
  ranks @1 :UInt32;
  ringSlots @2 :UInt32;
  ringSlotBytes @3 :UInt64;
  firstRank @4 :UInt32;           # the rings are ranks firstRank .. firstRank + ranks - 1
  validationSlots @5 :UInt32;     # slots of each rank's validation ring; 0: none (no evaluation)
}

struct NodeCommand {
  union {
    launch @0 :LaunchStage;
    stop @1 :StopStage;
    abortCollectives @2 :AbortStageCollectives;
    tearDown @3 :TearDown;
    restartStage @4 :RestartStage;
    signal @5 :SignalStage;
    giveUp @6 :GiveUp;
    prepareAttempt @7 :PrepareAttempt;
    releaseAttempt @8 :Void;      # the attempt's rings and shm segments go
    # A job restart: the generations killed for a restart that have exited are reaped (their
    # `exited` events), then the attempt's processes are forgotten (an unkillable one stays so).
    endAttempt @9 :Void;
    # Start a spare of this process (a trainer): a process of its executable, with the
    # environment and log of its current launch, loaded and waiting on its stdin. The process's
    # next launch with the same environment hands the spare its generation instead of starting
    # a process (no exec, no library load on a job restart's path). At most one per process;
    # spares outlive an attempt's teardown and are killed with the node's processes at the end.
    keepSpare @10 :StageRef;
  }
}

# Events (agent -> controller).

struct StageStarted {
  process @0 :StageRef;
  pid @1 :Int32;
  generation @2 :UInt32;
  reason @3 :Common.ChildReason;
  cause @4 :Text;
}

struct StageExited {
  process @0 :StageRef;
  pid @1 :Int32;
  generation @2 :UInt32;
  exitCode @3 :Int32;             # -1 when it did not exit on its own
  signal @4 :Int32;
  restart @5 :Bool;               # the generation a restartStage killed
}

# What a stage said on the control plane, as it said it: hello, heartbeat (its progress),
# failure, collectivesAborted.
struct StageMessage {
  peer @0 :Text;                  # the stage's control socket identity (its process name)
  message @1 :Control.ControlMessage;
}

struct StageUnkillable {
  process @0 :StageRef;
  pid @1 :Int32;
  waitedSeconds @2 :Float64;
}

struct NodeEvent {
  union {
    started @0 :StageStarted;
    exited @1 :StageExited;
    message @2 :StageMessage;
    unkillable @3 :StageUnkillable;
    stopRequested @4 :Int32;      # SIGINT or SIGTERM reached the supervisor: its number
  }
}

# Between hosts (supervisor/zmq_node_link.h): one frame per ZeroMQ message, each way.

struct RingLevelReport {
  depth @0 :UInt32;
  slots @1 :UInt32;
}

struct CommandDone {
  sequence @0 :UInt64;            # the command's
  delivered @1 :Bool;             # NodeAgentLink::command's result
}

struct NodeLinkFrame {
  version @0 :UInt32;             # kNodeLinkVersion (supervisor/zmq_node_link.h)
  union {
    # node -> controller, once per connection: the node's name (its DEALER identity).
    hello @1 :Text;
    # controller -> node; answered by the events it causes, then `done` with its sequence.
    command @2 :NodeCommand;
    event @3 :NodeEvent;          # node -> controller
    done @4 :CommandDone;         # node -> controller
    rings @5 :List(RingLevelReport);  # node -> controller: the attempt's rings, when they change
    # node -> controller, every beat interval, from the node's beat thread on a connection of
    # its own (identity "<node>/beat"): the count of beats sent. Silence beyond the link's
    # limit is a lost node.
    beat @7 :UInt64;
  }
  sequence @6 :UInt64;            # a command's (controller -> node)
}
