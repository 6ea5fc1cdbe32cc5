// The job controller driven by scripted node events through a NodeAgentLink of the test's own
// (no process, no socket, no torch): what it commands and what it concludes when a rank dies
// during a checkpoint, when a stage's restart is under way as another process dies, and when a
// stop comes during start-up.
#include <gtest/gtest.h>
#include <signal.h>

#include <capnp/message.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/util.h"
#include "ipc/journal.h"
#include "schemas/journal.capnp.h"
#include "schemas/json.h"
#include "schemas/run_layout.h"
#include "supervisor/detail/job_controller.h"
#include "tests/unit/supervisor_test_support.h"
#include "tests/unit/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using megacpp::mono_ns;
using megacpp::schema::ChildReason;
using megacpp::schema::FailureKind;
using megacpp::schema::NodeCommand;
using megacpp::schema::NodeEvent;
using megacpp::schema::Phase;
using megacpp::schema::StageKind;
using megacpp::supervisor::NodeAgentLink;
using megacpp::supervisor::RingLevel;
using megacpp::supervisor::RunOptions;
using megacpp::supervisor::detail::JobController;
using megacpp::supervisor::test::name_of;
using megacpp::supervisor::test::ref_of;
using megacpp::supervisor::test::set_ref;
using megacpp::supervisor::test::with_message;
namespace layout = megacpp::layout;
using megacpp::test_support::TempDir;

// A node as a script: every command is logged as one line ("launch trainer-0 g0", "stop
// data_loader-0 run complete", ...); a launch answers `started` at once; what a real node
// would do next (a stopped stage exits 0, a signalled one dies) is queued and said on the next
// poll, before the next step of the script. A stage can be reached on its control socket once
// it said hello.
class ScriptedLink final : public NodeAgentLink {
 public:
  std::vector<std::string> commands;
  std::deque<std::function<void()>> script;
  std::map<std::string, std::vector<std::string>> extra_env;  // by process, the last launch's

  bool command(NodeCommand::Reader c) override {
    switch (c.which()) {
      case NodeCommand::LAUNCH: {
        auto l = c.getLaunch();
        const std::string name = name_of(l.getProcess());
        commands.push_back(fmt::format("launch {} g{}", name, l.getGeneration()));
        extra_env[name].clear();
        for (auto kv : l.getExtraEnv()) extra_env[name].emplace_back(kv.cStr());
        const pid_t pid = next_pid_++;
        pids_[name] = pid;
        alive_.insert(name);
        say([&](NodeEvent::Builder e) {
          auto s = e.initStarted();
          s.setProcess(l.getProcess());
          s.setPid(pid);
          s.setGeneration(l.getGeneration());
          s.setReason(l.getReason());
          s.setCause(l.getCause());
        });
        return true;
      }
      case NodeCommand::STOP: {
        auto s = c.getStop();
        const std::string name = name_of(s.getProcess());
        const bool reached = connected_.contains(name) && alive_.contains(name);
        commands.push_back(fmt::format("stop {} {}{}", name, s.getReason().cStr(),
                                       reached ? "" : " (not reached)"));
        if (reached) {
          exit_later(name, 0, 0);
        } else if (s.getSigtermIfUnreachable() && alive_.contains(name)) {
          exit_later(name, -1, SIGTERM);
        }
        return reached;
      }
      case NodeCommand::ABORT_COLLECTIVES:
        commands.push_back("abort " + name_of(c.getAbortCollectives().getProcess()));
        return false;
      case NodeCommand::TEAR_DOWN:
        commands.push_back(c.getTearDown().getKill() ? "tear down (kill)" : "tear down");
        for (const auto& name : std::set<std::string>(alive_)) exit_later(name, -1, SIGTERM);
        return true;
      case NodeCommand::RESTART_STAGE: {
        const std::string name = name_of(c.getRestartStage().getProcess());
        commands.push_back("restart " + name);
        alive_.erase(name);
        dying_[name] = pids_[name];
        return true;
      }
      case NodeCommand::SIGNAL: {
        const std::string name = name_of(c.getSignal().getProcess());
        commands.push_back(fmt::format("signal {} {}", name, c.getSignal().getSignal()));
        if (alive_.contains(name)) exit_later(name, -1, c.getSignal().getSignal());
        return true;
      }
      default:
        return true;
    }
  }

  void poll(int timeout_ms) override {
    auto pending = std::move(pending_);
    pending_.clear();
    for (auto& f : pending) f();
    if (!pending.empty()) return;
    if (script.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(timeout_ms, 5)));
      return;
    }
    auto step = std::move(script.front());
    script.pop_front();
    step();
  }

  std::vector<RingLevel> ring_levels() const override { return {}; }

  // What a stage says.
  void hello(const std::string& name) {
    connected_.insert(name);
    message(name, [&](megacpp::schema::ControlMessage::Builder m) {
      m.initHello().setPid(pids_.at(name));
    });
  }
  void heartbeat(const std::string& name, uint32_t step, Phase phase,
                 int64_t progress_mono_ns = 0) {
    message(name, [&](megacpp::schema::ControlMessage::Builder m) {
      auto h = m.initHeartbeat();
      h.setStep(step);
      h.setPhase(phase);
      h.setPhaseStartedMonoNs(mono_ns());
      h.setProgressMonoNs(progress_mono_ns);
      h.setWorkDone(3);
    });
  }
  // What the node sees.
  void exit(const std::string& name, int exit_code, int signal) {
    alive_.erase(name);
    exited(name, pids_.at(name), exit_code, signal, false);
  }
  void dying_reaped(const std::string& name) {
    exited(name, dying_.at(name), -1, SIGKILL, true);
    dying_.erase(name);
  }
  void stop_requested(int signo) {
    say([&](NodeEvent::Builder e) { e.setStopRequested(signo); });
  }
  pid_t pid(const std::string& name) const { return pids_.at(name); }
  size_t count(const std::string& prefix) const {
    return static_cast<size_t>(std::ranges::count_if(
        commands, [&](const std::string& c) { return c.starts_with(prefix); }));
  }

 private:
  template <class F>
  void say(F&& build) {
    with_message<NodeEvent>(build, [&](NodeEvent::Reader e) { deliver(e); });
  }
  template <class F>
  void message(const std::string& name, F&& build) {
    say([&](NodeEvent::Builder e) {
      auto m = e.initMessage();
      m.setPeer(name);
      build(m.initMessage());
    });
  }
  void exited(const std::string& name, pid_t pid, int exit_code, int signal, bool restart) {
    // Not a structured binding: clang before 16 cannot capture one in the lambda below.
    const std::pair<StageKind, uint32_t> ref = ref_of(name);
    say([&](NodeEvent::Builder e) {
      auto x = e.initExited();
      set_ref(x.getProcess(), ref.first, ref.second);
      x.setPid(pid);
      x.setExitCode(exit_code);
      x.setSignal(signal);
      x.setRestart(restart);
    });
  }
  void exit_later(const std::string& name, int exit_code, int signal) {
    alive_.erase(name);
    const pid_t pid = pids_.at(name);
    pending_.push_back([=, this] { exited(name, pid, exit_code, signal, false); });
  }

  pid_t next_pid_ = 1000;
  std::map<std::string, pid_t> pids_, dying_;
  std::set<std::string> alive_, connected_;
  std::deque<std::function<void()>> pending_;
};

const std::vector<std::string> kStages = {"collector-0", "checkpointer-0", "data_loader-0",
                                          "trainer-0", "trainer-1"};

RunOptions options() {
  RunOptions o;
  o.ranks = 2;
  o.steps = 10;
  // A script that goes wrong ends in seconds, not in the default budgets' minutes.
  o.startup_budget_s = 20;
  o.heartbeat_timeout_s = 20;
  o.max_job_restarts = 0;
  return o;
}

// The supervisor journal's records of one kind, as the test reads them.
struct Journaled {
  std::vector<std::string> started, exited, failures;
};
Journaled read_journal(const fs::path& run) {
  Journaled j;
  megacpp::ipc::JournalReader::read_all(
      layout::journal_path(run, StageKind::SUPERVISOR, 0),
      [&](megacpp::schema::JournalRecord::Reader r) {
        if (r.isChildStarted()) {
          auto c = r.getChildStarted();
          j.started.push_back(fmt::format(
              "{} g{} {}{}", layout::process_name(c.getStage(), c.getRank()), c.getGeneration(),
              c.getChildReason() == ChildReason::RESTART ? "restart" : "launch",
              c.getCause().size() > 0 ? ": " + std::string(c.getCause().cStr()) : ""));
        } else if (r.isChildExited()) {
          auto c = r.getChildExited();
          const char* why = c.getChildReason() == ChildReason::RESTART    ? "restart"
                            : c.getChildReason() == ChildReason::TEARDOWN ? "teardown"
                            : c.getChildReason() == ChildReason::STOP     ? "stop"
                                                                          : "exit";
          j.exited.push_back(
              fmt::format("{} {}", layout::process_name(c.getStage(), c.getRank()), why));
        } else if (r.isFailureObserved()) {
          auto f = r.getFailureObserved();
          j.failures.push_back(fmt::format(
              "{} {}", layout::process_name(f.getStage(), f.getRank()),
              f.getFailureRole() == megacpp::schema::FailureRole::FIRST_FAILURE ? "first"
                                                                                : "other"));
        }
      });
  return j;
}

bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::ranges::find(v, s) != v.end();
}

TEST(JobController, ARankThatDiesDuringACheckpointIsTheFirstFailureAndTheJobIsTornDown) {
  TempDir dir;
  ScriptedLink link;
  link.script = {
      [&] {
        for (const auto& s : kStages) link.hello(s);
      },
      [&] {
        link.heartbeat("trainer-0", 4, Phase::SNAPSHOT);
        link.heartbeat("trainer-1", 4, Phase::SNAPSHOT);
      },
      [&] { link.exit("trainer-1", -1, SIGKILL); },
  };
  JobController controller(options(), link, dir.path());
  const auto failure = controller.supervise();

  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(failure->kind, FailureKind::SIGNALED);
  EXPECT_EQ(failure->stage, StageKind::TRAINER);
  EXPECT_EQ(failure->rank, 1u);
  EXPECT_EQ(failure->step, 4u);
  EXPECT_NE(failure->message.find("was killed by signal 9"), std::string::npos) << failure->message;
  EXPECT_NE(failure->message.find("last reported phase snapshot"), std::string::npos)
      << failure->message;
  // The other rank is asked to abort its collectives, then every live stage is torn down; the
  // dead rank is not relaunched (a trainer is not restartable) and no job restart is allowed.
  EXPECT_EQ(link.count("abort trainer-0"), 1u);
  EXPECT_EQ(link.count("abort trainer-1"), 0u);
  EXPECT_EQ(link.count("tear down"), 1u);
  EXPECT_EQ(link.count("launch"), kStages.size());
  const Journaled j = read_journal(dir.path());
  EXPECT_TRUE(has(j.failures, "trainer-1 first"));
  for (const char* torn : {"trainer-0 teardown", "collector-0 teardown", "data_loader-0 teardown",
                           "checkpointer-0 teardown"})
    EXPECT_TRUE(has(j.exited, torn)) << torn;
}

// A trainer's environment bounds oneDNN's two primitive caches (supervisor.h kTrainerLibraryEnv)
// unless the user's environment names them: then the user's value is the rank's.
TEST(JobController, TrainersGetBoundedOneDnnCachesUnlessTheUserSetThem) {
  ::unsetenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY");
  ::setenv("LRU_CACHE_CAPACITY", "512", 1);
  TempDir dir;
  ScriptedLink link;
  link.script = {
      [&] {
        for (const auto& s : kStages) link.hello(s);
      },
      [&] { link.exit("trainer-1", -1, SIGKILL); },
  };
  JobController controller(options(), link, dir.path());
  (void)controller.supervise();
  ::unsetenv("LRU_CACHE_CAPACITY");
  for (const char* rank : {"trainer-0", "trainer-1"}) {
    const auto& env = link.extra_env[rank];
    EXPECT_EQ(std::count(env.begin(), env.end(), "ONEDNN_PRIMITIVE_CACHE_CAPACITY=16"), 1) << rank;
    EXPECT_EQ(std::count_if(env.begin(), env.end(),
                            [](const std::string& kv) { return kv.starts_with("LRU_CACHE_"); }),
              0)
        << rank << ": the user's LRU_CACHE_CAPACITY reaches it through the agent's environment";
  }
  EXPECT_TRUE(link.extra_env["collector-0"].empty());
}

TEST(JobController, AStageRestartUnderWayWhenAnotherProcessDiesIsNotCompleted) {
  TempDir dir;
  ScriptedLink link;
  RunOptions o = options();
  o.checkpointer_stall_s = 0.5;
  link.script = {
      [&] {
        for (const auto& s : kStages) link.hello(s);
      },
      // The loader dies: restartable, so it is relaunched as generation 1 at once.
      [&] { link.exit("data_loader-0", 1, 0); },
      // The checkpointer's work has not moved for 2 s (budget 0.5 s): hung, so its generation
      // is killed for a restart ...
      [&] { link.heartbeat("checkpointer-0", 0, Phase::WRITE, mono_ns() - 2'000'000'000); },
      // ... and before that generation is reaped, a rank dies. The reap comes after.
      [&] {
        link.exit("trainer-0", -1, SIGSEGV);
        link.dying_reaped("checkpointer-0");
      },
  };
  JobController controller(o, link, dir.path());
  const auto failure = controller.supervise();

  EXPECT_EQ(link.count("launch data_loader-0 g1"), 1u);
  EXPECT_EQ(link.count("restart checkpointer-0"), 1u);
  // The run failed before the killed generation was reaped: it is journaled, not relaunched.
  EXPECT_EQ(link.count("launch checkpointer-0 g1"), 0u);
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(failure->kind, FailureKind::SIGNALED);
  EXPECT_EQ(failure->stage, StageKind::TRAINER);
  EXPECT_EQ(failure->rank, 0u);
  const Journaled j = read_journal(dir.path());
  EXPECT_TRUE(has(j.exited, "data_loader-0 restart"));
  EXPECT_TRUE(has(j.exited, "checkpointer-0 restart"));
  ASSERT_GE(j.started.size(), kStages.size() + 1);
  EXPECT_TRUE(
      j.started.back().starts_with("data_loader-0 g1 restart: generation 0: exited "
                                   "with code 1"))
      << j.started.back();
  EXPECT_TRUE(has(j.failures, "trainer-0 first"));
}

// A rank that only lost a peer writes its failure dump and exits 1; its Failure message is
// not read before the exit is reaped. Its claim (peer_failure) is what the job records, not
// an exit of its own: across nodes an exit would outrank the node whose death caused it.
TEST(JobController, ARankThatExitsAfterLosingAPeerIsAVictimsClaimNotAnExitOfItsOwn) {
  TempDir dir;
  ScriptedLink link;
  link.script = {
      [&] {
        for (const auto& s : kStages) link.hello(s);
      },
      [&] { link.heartbeat("trainer-0", 3, Phase::OPTIMIZER); },
      [&] {
        capnp::MallocMessageBuilder msg;
        auto d = msg.initRoot<megacpp::schema::FailureDump>();
        d.setStage(StageKind::TRAINER);
        d.setRank(0);
        d.setPid(link.pid("trainer-0"));
        d.setKind("exception");
        d.setErrorKind("peer_failure");
        d.setMessage("Connection closed by peer");
        d.setPhase(Phase::OPTIMIZER);
        d.setStep(3);
        d.setMonoNs(mono_ns());
        const fs::path path = layout::failure_path(dir.path(), StageKind::TRAINER, 0);
        fs::create_directories(path.parent_path());
        megacpp::write_file_atomic(path, megacpp::schemas::to_json(d.asReader()));
        link.exit("trainer-0", 1, 0);
      },
  };
  JobController controller(options(), link, dir.path());
  const auto failure = controller.supervise();

  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(failure->kind, FailureKind::EXCEPTION);
  EXPECT_EQ(failure->rank, 0u);
  EXPECT_NE(failure->message.find("peer_failure: Connection closed by peer"), std::string::npos)
      << failure->message;
}

TEST(JobController, AStopDuringStartUpReachesTheRankThatConnectsLateOnItsHello) {
  TempDir dir;
  ScriptedLink link;
  link.script = {
      [&] {
        for (const auto& s : kStages)
          if (s != "trainer-1") link.hello(s);
      },
      [&] { link.stop_requested(SIGTERM); },
      [&] { link.hello("trainer-1"); },
  };
  JobController controller(options(), link, dir.path());
  const auto failure = controller.supervise();

  // A graceful stop is no failure: the ranks finish, the loader and the checkpointer are
  // stopped, nothing is torn down.
  EXPECT_FALSE(failure.has_value()) << failure->message;
  EXPECT_EQ(link.count("stop trainer-0 graceful stop on Terminated"), 1u);
  // trainer-1 had not connected when the stop came: asked once in vain, then on its hello.
  EXPECT_EQ(link.count("stop trainer-1 graceful stop on Terminated (not reached)"), 1u);
  EXPECT_EQ(link.count("stop trainer-1 graceful stop on Terminated"), 2u);
  EXPECT_EQ(link.count("stop data_loader-0 run complete"), 1u);
  EXPECT_EQ(link.count("stop checkpointer-0 run complete"), 1u);
  EXPECT_EQ(link.count("tear down"), 0u);
  const Journaled j = read_journal(dir.path());
  EXPECT_TRUE(j.failures.empty());
  EXPECT_TRUE(has(j.exited, "trainer-0 exit"));
  EXPECT_TRUE(has(j.exited, "trainer-1 exit"));
  EXPECT_TRUE(has(j.exited, "data_loader-0 stop"));
}

}  // namespace
