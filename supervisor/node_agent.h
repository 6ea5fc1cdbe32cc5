// The node agent: owns the stage processes of one host (spawn, reap, signals, the restart of a
// stage's generation, the teardown's signals), its signalfd, its control socket and socket
// directory, and the attempt's batch rings and shm segments. It decides nothing: the job
// controller (supervisor/detail/job_controller.h) sends it commands and hears its events
// through a NodeAgentLink (schemas/node.capnp). DESIGN.md "Lifecycle as implemented".
//
// Blocking: pump() waits at most its timeout in one ipc::Poller wait; every wait for a process
// is bounded (kKillWaitS); spawn forks and returns.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/knobs.h"
#include "core/util.h"
#include "ipc/channel.h"
#include "ipc/shm.h"
#include "ipc/slot_ring.h"
#include "schemas/common.capnp.h"
#include "schemas/node.capnp.h"
#include "supervisor/node_agent_link.h"

namespace megacpp::supervisor {

// How long a SIGKILLed child may take to be reaped before the supervisor gives up on it: a
// process in uninterruptible sleep (stuck I/O) outlives SIGKILL until the I/O completes,
// which may be never. It is then named unkillable and not waited for.
constexpr double kKillWaitS = 1.0;

// What the agent does to processes, so that its bookkeeping is tested without forking.
class Spawner {
 public:
  virtual ~Spawner() = default;
  // detail::spawn: `env` empty inherits the agent's environment. Throws Error{kSystem}.
  virtual pid_t spawn(const std::vector<std::string>& argv, const std::filesystem::path& log,
                      const std::vector<std::string>& env) = 0;
  virtual void signal(pid_t pid, int sig) = 0;
  // waitpid(pid, &status, WNOHANG), pid -1 for any child: the pid reaped, 0 while none has
  // exited, -1 when there is no such child.
  virtual pid_t wait(pid_t pid, int& status) = 0;
  // detail::process_state: 'T' for a stopped process.
  virtual char state(pid_t pid) = 0;
  // detail::environment_with_tunables.
  virtual std::vector<std::string> environment(const std::vector<std::string>& tunables) = 0;
  // A spare (NodeAgent keepSpare): spawn() with `go_fd` as the child's stdin. -1: this spawner
  // keeps no spares (the next launch starts a process as always).
  virtual pid_t spawn_spare(const std::vector<std::string>& /*argv*/,
                            const std::filesystem::path& /*log*/,
                            const std::vector<std::string>& /*env*/, int /*go_fd*/) {
    return -1;
  }
};

// The real one: fork/exec, kill(2), waitpid(2), /proc.
class SystemSpawner final : public Spawner {
 public:
  pid_t spawn(const std::vector<std::string>& argv, const std::filesystem::path& log,
              const std::vector<std::string>& env) override;
  void signal(pid_t pid, int sig) override;
  pid_t wait(pid_t pid, int& status) override;
  char state(pid_t pid) override;
  std::vector<std::string> environment(const std::vector<std::string>& tunables) override;
  pid_t spawn_spare(const std::vector<std::string>& argv, const std::filesystem::path& log,
                    const std::vector<std::string>& env, int go_fd) override;
};

class NodeAgent {
 public:
  using EventSink = NodeAgentLink::EventSink;

  explicit NodeAgent(Spawner& spawner) : spawner_(spawner) {}
  // Spares kill_remaining did not reap are killed (not waited for: they die with it anyway,
  // PR_SET_PDEATHSIG).
  ~NodeAgent();
  NodeAgent(const NodeAgent&) = delete;
  NodeAgent& operator=(const NodeAgent&) = delete;

  void set_sink(EventSink sink) { sink_ = std::move(sink); }

  // Set-up of this host, in the order the run's preparation needs it.
  // Before any thread exists (TCPStore, ZeroMQ): threads inherit the mask, so SIGCHLD can
  // reach nothing but the signalfd. A thread that left it unblocked would swallow exits.
  void block_signals();
  int signal_fd() const { return sigfd_ ? sigfd_->get() : -1; }
  void set_run_dir(const std::filesystem::path& run) { run_ = run; }
  // The socket directory (RUN/sock, or a private /tmp/megacpp-XXXXXX when that path is too long
  // for a Unix socket) and the endpoints in it. `resuming`: an earlier attempt's is removed.
  struct Endpoints {
    std::filesystem::path sock_dir;
    std::string control, checkpoint;
  };
  Endpoints make_socket_dir(const std::string& run_id, bool resuming);
  // Binds the control ROUTER the stages connect to.
  void open_control(const std::string& endpoint);

  // One command (schemas/node.capnp NodeCommand); see NodeAgentLink::command.
  bool handle(schema::NodeCommand::Reader c);
  // One bounded wait over the control socket, the signalfd and the wake descriptor; events to
  // the sink.
  void pump(int timeout_ms);
  // A descriptor (an eventfd, not owned, outliving every pump) whose readiness ends pump()'s
  // wait: the job watch's verdict. pump() drains it; -1: none.
  void set_wake_fd(int fd) { wake_fd_ = fd; }
  // Every exited child reaped (non-blocking): an `exited` event for each one it launched.
  void reap();
  std::vector<RingLevel> ring_levels() const;

  // The end of the run. No blocking wait: a child that outlives SIGKILL would hang `megacpp
  // run` forever. The processes still alive get SIGKILL and, together, kKillWaitS to be
  // reaped; one already given up on is not waited for again. A generation killed for a restart
  // gets the same bound to be reaped (its `exited` event). Those left are given up on.
  void kill_remaining();
  // The control socket, the ZeroMQ context, the rings and the private socket directory.
  void release();
  void close_signals() { sigfd_.reset(); }

 private:
  struct Process {
    schema::StageKind stage;
    uint32_t rank;
    std::string name;
    pid_t pid = -1;
    uint32_t generation = 0;
    bool alive = false;
    // A restart in progress: SIGKILL sent to this generation, its reap not seen yet.
    pid_t dying_pid = 0;
    std::vector<std::string> env = {};  // of its current launch (empty: the agent's own)
  };
  // A loaded process of a stage's executable waiting on `go` (its stdin, a socket) for the
  // generation it becomes (keepSpare in schemas/node.capnp).
  struct Spare {
    schema::StageKind stage;
    uint32_t rank;
    pid_t pid;
    Fd go;
    std::vector<std::string> env;
  };

  Process* find(schema::StageRef::Reader ref);
  void launch(schema::LaunchStage::Reader l);
  void keep_spare(schema::StageRef::Reader ref);
  // The spare of `p` started with `env`, handed `generation`: its pid; -1 when there is none
  // or it is gone (then it is killed and forgotten).
  pid_t take_spare(const Process& p, uint32_t generation, const std::vector<std::string>& env);
  bool send_stop(schema::StopStage::Reader s);
  bool abort_collectives(schema::AbortStageCollectives::Reader a);
  void tear_down(schema::TearDown::Reader t);
  void restart(schema::StageRef::Reader ref);
  void kill_child(const Process& p, int sig);
  void give_up_on(const Process& p, double waited_s);
  void create_rings(schema::PrepareAttempt::Reader p);
  void release_attempt();
  void on_signals();
  void exited(const Process& p, pid_t pid, int status, bool restart);
  void reap_dying();
  template <class F>
  void emit(F&& build);

  Spawner& spawner_;
  EventSink sink_;
  std::filesystem::path run_;
  std::vector<Process> processes_;
  std::vector<Spare> spares_;
  std::set<pid_t> unkillable_;  // outlived SIGKILL and kKillWaitS: never waited for again
  std::optional<Fd> sigfd_;
  int wake_fd_ = -1;
  std::filesystem::path sock_dir_;
  bool sock_dir_private_ = false;
  std::unique_ptr<ipc::ZmqContext> zmq_;
  std::unique_ptr<ipc::Channel> router_;
  std::string shm_prefix_;
  std::vector<std::unique_ptr<ipc::ShmRegion>> rings_;
  std::vector<std::unique_ptr<ipc::SlotRing>> ring_views_;
  std::vector<std::unique_ptr<ipc::ShmRegion>> validation_rings_;  // one per rank when evaluating
  bool released_ = false;
  // MEGACPP_TEST_UNKILLABLE: the process name whose teardown signals are not sent.
  const std::string unkillable_for_test_ = knob_string(Knob::kTestUnkillable);
};

// The link of a job controller and the node agent of its own host: commands are handled and
// events delivered on the caller's thread, in order.
class InProcessLink final : public NodeAgentLink {
 public:
  explicit InProcessLink(NodeAgent& agent) : agent_(agent) {
    agent_.set_sink([this](schema::NodeEvent::Reader e) { deliver(e); });
  }
  ~InProcessLink() override { agent_.set_sink({}); }
  InProcessLink(const InProcessLink&) = delete;
  InProcessLink& operator=(const InProcessLink&) = delete;

  bool command(schema::NodeCommand::Reader c) override { return agent_.handle(c); }
  void poll(int timeout_ms) override { agent_.pump(timeout_ms); }
  std::vector<RingLevel> ring_levels() const override { return agent_.ring_levels(); }

 private:
  NodeAgent& agent_;
};

}  // namespace megacpp::supervisor
