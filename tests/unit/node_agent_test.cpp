// The node agent with a fake spawner (no fork, no signal sent): what it spawns, what it
// signals, and the events it says back (schemas/node.capnp), torch-free.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <capnp/message.h>

#include <algorithm>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "schemas/run_layout.h"
#include "supervisor/node_agent.h"
#include "tests/unit/supervisor_test_support.h"
#include "tests/unit/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using megacpp::schema::ChildReason;
using megacpp::schema::NodeCommand;
using megacpp::schema::NodeEvent;
using megacpp::schema::StageKind;
using megacpp::supervisor::NodeAgent;
using megacpp::supervisor::Spawner;
using megacpp::supervisor::test::name_of;
using megacpp::supervisor::test::set_ref;
using megacpp::supervisor::test::with_message;
namespace layout = megacpp::layout;
using megacpp::test_support::TempDir;

class FakeSpawner final : public Spawner {
 public:
  struct Spawned {
    std::vector<std::string> argv;
    fs::path log;
    std::vector<std::string> env;
  };
  std::vector<Spawned> spawned;
  std::vector<std::pair<pid_t, int>> signals;
  std::deque<std::pair<pid_t, int>> exits;  // (pid, wait status) the next wait()s return
  std::map<pid_t, char> states;
  pid_t next_pid = 1000;

  pid_t spawn(const std::vector<std::string>& argv, const fs::path& log,
              const std::vector<std::string>& env) override {
    spawned.push_back({argv, log, env});
    return next_pid++;
  }
  // Spares: what was asked, and the child's end of each go socket (read by the test).
  std::vector<Spawned> spares;
  std::vector<int> spare_go;
  pid_t spawn_spare(const std::vector<std::string>& argv, const fs::path& log,
                    const std::vector<std::string>& env, int go_fd) override {
    spares.push_back({argv, log, env});
    spare_go.push_back(::dup(go_fd));
    return next_pid++;
  }
  ~FakeSpawner() override {
    for (int fd : spare_go) ::close(fd);
  }
  void signal(pid_t pid, int sig) override { signals.emplace_back(pid, sig); }
  pid_t wait(pid_t pid, int& status) override {
    for (auto it = exits.begin(); it != exits.end(); ++it) {
      if (pid != -1 && it->first != pid) continue;
      const pid_t reaped = it->first;
      status = it->second;
      exits.erase(it);
      return reaped;
    }
    return 0;
  }
  char state(pid_t pid) override {
    const auto it = states.find(pid);
    return it == states.end() ? 'S' : it->second;
  }
  std::vector<std::string> environment(const std::vector<std::string>& tunables) override {
    std::string t = "GLIBC_TUNABLES=";
    for (const auto& x : tunables) t += x + ":";
    return {"BASE=1", t};
  }
};

// An event as the test reads it.
struct Seen {
  NodeEvent::Which which = NodeEvent::STARTED;
  std::string process;
  int32_t pid = 0, exit_code = 0, signal = 0;
  uint32_t generation = 0;
  bool restart = false;
  ChildReason reason = ChildReason::NONE;
  std::string cause;
};

class NodeAgentTest : public ::testing::Test {
 protected:
  NodeAgentTest() {
    agent.set_run_dir(dir.path());
    agent.set_sink([this](NodeEvent::Reader e) {
      Seen s;
      s.which = e.which();
      switch (e.which()) {
        case NodeEvent::STARTED: {
          auto x = e.getStarted();
          s.process = name_of(x.getProcess());
          s.pid = x.getPid();
          s.generation = x.getGeneration();
          s.reason = x.getReason();
          s.cause = x.getCause();
          break;
        }
        case NodeEvent::EXITED: {
          auto x = e.getExited();
          s.process = name_of(x.getProcess());
          s.pid = x.getPid();
          s.generation = x.getGeneration();
          s.exit_code = x.getExitCode();
          s.signal = x.getSignal();
          s.restart = x.getRestart();
          break;
        }
        case NodeEvent::UNKILLABLE: {
          auto x = e.getUnkillable();
          s.process = name_of(x.getProcess());
          s.pid = x.getPid();
          break;
        }
        default:
          break;
      }
      events.push_back(s);
    });
  }

  template <class F>
  bool command(F&& build) {
    return with_message<NodeCommand>(build, [&](NodeCommand::Reader c) { return agent.handle(c); });
  }
  pid_t launch(StageKind stage, uint32_t rank, uint32_t generation = 0) {
    command([&](NodeCommand::Builder c) {
      auto l = c.initLaunch();
      set_ref(l.getProcess(), stage, rank);
      l.setGeneration(generation);
      l.setReason(generation == 0 ? ChildReason::LAUNCH : ChildReason::RESTART);
    });
    return events.back().pid;
  }
  template <class Init>
  bool on(StageKind stage, uint32_t rank, Init&& init) {
    return command([&](NodeCommand::Builder c) { set_ref(init(c), stage, rank); });
  }

  TempDir dir;
  FakeSpawner spawner;
  NodeAgent agent{spawner};
  std::vector<Seen> events;
};

TEST_F(NodeAgentTest, LaunchSpawnsTheStageWithItsGenerationAndSaysStarted) {
  command([&](NodeCommand::Builder c) {
    auto l = c.initLaunch();
    set_ref(l.getProcess(), StageKind::TRAINER, 1);
    l.setGeneration(2);
    l.setReason(ChildReason::RESTART);
    l.setCause("generation 1: hung");
    l.setTuneEnvironment(true);
    l.initTunables(1).set(0, "glibc.malloc.hugetlb=1");
    l.initExtraEnv(1).set(0, "TORCH_NCCL_ASYNC_ERROR_HANDLING=2");
  });
  const pid_t loader = launch(StageKind::DATA_LOADER, 0);
  ASSERT_EQ(spawner.spawned.size(), 2u);
  const auto& t = spawner.spawned[0];
  EXPECT_EQ(fs::path(t.argv[0]).filename(), "megacpp-trainer");
  EXPECT_EQ(std::vector<std::string>(t.argv.begin() + 1, t.argv.end()),
            (std::vector<std::string>{"--run-dir", dir.path().string(), "--rank", "1",
                                      "--generation", "2"}));
  EXPECT_EQ(t.log, layout::log_path(dir.path(), StageKind::TRAINER, 1));
  EXPECT_EQ(t.env, (std::vector<std::string>{"BASE=1", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1:",
                                             "TORCH_NCCL_ASYNC_ERROR_HANDLING=2"}));
  // No environment asked for: the stage inherits the agent's.
  EXPECT_EQ(fs::path(spawner.spawned[1].argv[0]).filename(), "megacpp-data-loader");
  EXPECT_TRUE(spawner.spawned[1].env.empty());
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].which, NodeEvent::STARTED);
  EXPECT_EQ(events[0].process, "trainer-1");
  EXPECT_EQ(events[0].pid, 1000);
  EXPECT_EQ(events[0].generation, 2u);
  EXPECT_EQ(events[0].reason, ChildReason::RESTART);
  EXPECT_EQ(events[0].cause, "generation 1: hung");
  EXPECT_EQ(events[1].pid, loader);
}

TEST_F(NodeAgentTest, AReapSaysWhoExitedAndHowAndIgnoresAPidItDidNotLaunch) {
  const pid_t trainer = launch(StageKind::TRAINER, 0);
  const pid_t loader = launch(StageKind::DATA_LOADER, 0);
  events.clear();
  spawner.exits = {{4242, W_EXITCODE(0, 0)}, {trainer, W_EXITCODE(3, 0)}, {loader, SIGSEGV}};
  agent.reap();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].which, NodeEvent::EXITED);
  EXPECT_EQ(events[0].process, "trainer-0");
  EXPECT_EQ(events[0].exit_code, 3);
  EXPECT_EQ(events[0].signal, 0);
  EXPECT_FALSE(events[0].restart);
  EXPECT_EQ(events[1].process, "data_loader-0");
  EXPECT_EQ(events[1].exit_code, -1);
  EXPECT_EQ(events[1].signal, SIGSEGV);
  // Reaped once: a second reap of the same pid (it cannot happen, but a stale one) says nothing.
  spawner.exits = {{trainer, W_EXITCODE(0, 0)}};
  agent.reap();
  EXPECT_EQ(events.size(), 2u);
}

TEST_F(NodeAgentTest, ARestartKillsTheGenerationAndItsReapSaysRestartNotAnExit) {
  const pid_t first = launch(StageKind::CHECKPOINTER, 0);
  on(StageKind::CHECKPOINTER, 0,
     [](NodeCommand::Builder c) { return c.initRestartStage().initProcess(); });
  ASSERT_EQ(spawner.signals.size(), 1u);
  EXPECT_EQ(spawner.signals[0], std::make_pair(first, SIGKILL));
  // The teardown of a dying generation sends nothing more: it is no longer alive.
  command([](NodeCommand::Builder c) { c.initTearDown(); });
  EXPECT_EQ(spawner.signals.size(), 1u);
  events.clear();
  spawner.exits = {{first, SIGKILL}};
  agent.reap();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(events[0].restart);
  EXPECT_EQ(events[0].pid, first);
  EXPECT_EQ(events[0].signal, SIGKILL);
  const pid_t second = launch(StageKind::CHECKPOINTER, 0, 1);
  spawner.exits = {{second, W_EXITCODE(1, 0)}};
  agent.reap();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_FALSE(events[2].restart);
  EXPECT_EQ(events[2].generation, 1u);
}

TEST_F(NodeAgentTest, TheTeardownSignalsByPolicyThenKillsWhatIsLeft) {
  const pid_t running = launch(StageKind::TRAINER, 0);
  const pid_t stopped = launch(StageKind::TRAINER, 1);
  const pid_t silent = launch(StageKind::DATA_LOADER, 0);
  const pid_t gone = launch(StageKind::COLLECTOR, 0);
  spawner.states[stopped] = 'T';
  spawner.exits = {{gone, W_EXITCODE(0, 0)}};
  agent.reap();
  command([](NodeCommand::Builder c) {
    set_ref(c.initTearDown().initSilent(1)[0], StageKind::DATA_LOADER, 0);
  });
  EXPECT_EQ(spawner.signals, (std::vector<std::pair<pid_t, int>>{
                                 {running, SIGTERM}, {stopped, SIGKILL}, {silent, SIGKILL}}));
  spawner.signals.clear();
  spawner.exits = {{running, SIGTERM}};
  agent.reap();
  command([](NodeCommand::Builder c) { c.initTearDown().setKill(true); });
  EXPECT_EQ(spawner.signals,
            (std::vector<std::pair<pid_t, int>>{{stopped, SIGKILL}, {silent, SIGKILL}}));
}

TEST_F(NodeAgentTest, AStopOrAbortThatCannotReachTheStageSaysSo) {
  const pid_t loader = launch(StageKind::DATA_LOADER, 0);
  const pid_t rank = launch(StageKind::TRAINER, 0);
  // No control socket is bound: nothing reaches a stage. "run complete" falls back to SIGTERM;
  // a graceful stop does not (the other ranks' agreement stops the rank).
  EXPECT_FALSE(on(StageKind::DATA_LOADER, 0, [](NodeCommand::Builder c) {
    auto s = c.initStop();
    s.setReason("run complete");
    s.setSigtermIfUnreachable(true);
    return s.initProcess();
  }));
  EXPECT_FALSE(on(StageKind::TRAINER, 0, [](NodeCommand::Builder c) {
    auto s = c.initStop();
    s.setAfterCheckpoint(true);
    return s.initProcess();
  }));
  EXPECT_EQ(spawner.signals, (std::vector<std::pair<pid_t, int>>{{loader, SIGTERM}}));
  spawner.states[rank] = 'T';
  EXPECT_FALSE(on(StageKind::TRAINER, 0,
                  [](NodeCommand::Builder c) { return c.initAbortCollectives().initProcess(); }));
}

TEST_F(NodeAgentTest, AProcessGivenUpOnIsNamedUnkillableOnce) {
  const pid_t pid = launch(StageKind::TRAINER, 0);
  events.clear();
  for (int i = 0; i < 2; ++i) {
    on(StageKind::TRAINER, 0, [](NodeCommand::Builder c) {
      auto g = c.initGiveUp();
      g.setWaitedSeconds(1.0);
      return g.initProcess();
    });
  }
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].which, NodeEvent::UNKILLABLE);
  EXPECT_EQ(events[0].pid, pid);
}

TEST_F(NodeAgentTest, KillRemainingIsBoundedAndGivesUpOnWhatOutlivesSigkill) {
  const pid_t reaped = launch(StageKind::TRAINER, 0);
  const pid_t stuck = launch(StageKind::TRAINER, 1);
  events.clear();
  spawner.exits = {{reaped, SIGKILL}};
  agent.kill_remaining();
  EXPECT_EQ(spawner.signals,
            (std::vector<std::pair<pid_t, int>>{{reaped, SIGKILL}, {stuck, SIGKILL}}));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].which, NodeEvent::UNKILLABLE);
  EXPECT_EQ(events[0].pid, stuck);
}

TEST_F(NodeAgentTest, AJobRestartReapsTheDyingGenerationThenForgetsTheAttempt) {
  const pid_t dying = launch(StageKind::COLLECTOR, 0);
  on(StageKind::COLLECTOR, 0,
     [](NodeCommand::Builder c) { return c.initRestartStage().initProcess(); });
  events.clear();
  spawner.exits = {{dying, SIGKILL}};
  command([](NodeCommand::Builder c) { c.setEndAttempt(); });
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(events[0].restart);
  // Forgotten: a teardown after it signals nothing, a give-up names nobody.
  command([](NodeCommand::Builder c) { c.initTearDown().setKill(true); });
  EXPECT_EQ(spawner.signals.size(), 1u);
}

}  // namespace

// What a spare read on its stdin (the go socket) so far, without waiting.
std::string read_go(int fd) {
  std::string out;
  char b[64];
  ssize_t n = 0;
  while ((n = ::recv(fd, b, sizeof b, MSG_DONTWAIT)) > 0) out.append(b, static_cast<size_t>(n));
  return out;
}

TEST_F(NodeAgentTest,
       ASpareIsStartedWithItsProcesssEnvironmentAndTheNextLaunchHandsItTheGeneration) {
  command([&](NodeCommand::Builder c) {
    auto l = c.initLaunch();
    set_ref(l.getProcess(), StageKind::TRAINER, 1);
    l.setTuneEnvironment(true);
    l.initExtraEnv(1).set(0, "GLOO_SOCKET_IFNAME=eth0");
  });
  const pid_t first = events.back().pid;
  ASSERT_TRUE(on(StageKind::TRAINER, 1, [](NodeCommand::Builder c) { return c.initKeepSpare(); }));
  ASSERT_EQ(spawner.spares.size(), 1u);
  const auto& sp = spawner.spares[0];
  EXPECT_EQ(fs::path(sp.argv[0]).filename(), "megacpp-trainer");
  EXPECT_EQ(std::vector<std::string>(sp.argv.begin() + 1, sp.argv.end()),
            (std::vector<std::string>{"--run-dir", dir.path().string(), "--rank", "1", "--spare"}));
  EXPECT_EQ(sp.log, layout::log_path(dir.path(), StageKind::TRAINER, 1));
  EXPECT_EQ(sp.env, spawner.spawned[0].env);
  const pid_t spare_pid = first + 1;
  // One spare per process: asking again starts none.
  on(StageKind::TRAINER, 1, [](NodeCommand::Builder c) { return c.initKeepSpare(); });
  EXPECT_EQ(spawner.spares.size(), 1u);
  EXPECT_EQ(read_go(spawner.spare_go[0]), "");

  // The job restart: the attempt ends, the process's next launch (same environment) is the spare.
  command([](NodeCommand::Builder c) { c.setEndAttempt(); });
  events.clear();
  command([&](NodeCommand::Builder c) {
    auto l = c.initLaunch();
    set_ref(l.getProcess(), StageKind::TRAINER, 1);
    l.setGeneration(7);
    l.setReason(ChildReason::RESTART);
    l.setTuneEnvironment(true);
    l.initExtraEnv(1).set(0, "GLOO_SOCKET_IFNAME=eth0");
  });
  EXPECT_EQ(spawner.spawned.size(), 1u) << "no process started: the spare became the launch";
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].process, "trainer-1");
  EXPECT_EQ(events[0].pid, spare_pid);
  EXPECT_EQ(events[0].generation, 7u);
  EXPECT_EQ(read_go(spawner.spare_go[0]), "7\n");
  // Used once: the launch after it starts a process.
  command([](NodeCommand::Builder c) { c.setEndAttempt(); });
  launch(StageKind::TRAINER, 1, 8);
  EXPECT_EQ(spawner.spawned.size(), 2u);
}

TEST_F(NodeAgentTest, ASpareOfAnotherEnvironmentIsKilledAndTheLaunchStartsAProcess) {
  const pid_t first = launch(StageKind::TRAINER, 0);
  on(StageKind::TRAINER, 0, [](NodeCommand::Builder c) { return c.initKeepSpare(); });
  ASSERT_EQ(spawner.spares.size(), 1u);
  const pid_t spare_pid = first + 1;
  command([](NodeCommand::Builder c) { c.setEndAttempt(); });
  command([&](NodeCommand::Builder c) {
    auto l = c.initLaunch();
    set_ref(l.getProcess(), StageKind::TRAINER, 0);
    l.setGeneration(1);
    l.setTuneEnvironment(true);  // not the environment the spare was started with
  });
  EXPECT_EQ(spawner.spawned.size(), 2u);
  EXPECT_NE(events.back().pid, spare_pid);
  EXPECT_EQ(spawner.signals.back(), std::make_pair(spare_pid, SIGKILL));
  EXPECT_EQ(read_go(spawner.spare_go[0]), "") << "a killed spare is told no generation";
}

TEST_F(NodeAgentTest, ASpareThatDiedIsForgottenAndTheEndKillsTheOnesLeft) {
  launch(StageKind::TRAINER, 0);
  launch(StageKind::TRAINER, 1);
  on(StageKind::TRAINER, 0, [](NodeCommand::Builder c) { return c.initKeepSpare(); });
  on(StageKind::TRAINER, 1, [](NodeCommand::Builder c) { return c.initKeepSpare(); });
  ASSERT_EQ(spawner.spares.size(), 2u);
  const pid_t spare0 = 1002, spare1 = 1003;
  // Spare 0 dies on its own: its reap names no process, and the next launch starts one.
  events.clear();
  spawner.exits = {{spare0, SIGKILL}};
  agent.reap();
  EXPECT_TRUE(events.empty());
  command([](NodeCommand::Builder c) { c.setEndAttempt(); });
  launch(StageKind::TRAINER, 0, 1);
  EXPECT_EQ(spawner.spawned.size(), 3u);
  // The end of the run: the spare left is killed and waited for with the processes.
  spawner.exits = {{spare1, SIGKILL}, {1004, SIGKILL}};
  agent.kill_remaining();
  EXPECT_NE(
      std::find(spawner.signals.begin(), spawner.signals.end(), std::make_pair(spare1, SIGKILL)),
      spawner.signals.end());
  EXPECT_TRUE(spawner.exits.empty()) << "both reaped";
}
