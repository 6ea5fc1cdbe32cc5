// megacpp::stage: failure dumps for every way a stage process goes down, and the
// MEGACPP_FAULT hook, on the real megacpp-collector process (next to this binary) talking to a
// real ROUTER, plus forked children running run_stage_main for the in-process paths.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <capnp/message.h>
#include <kj/debug.h>
#include <kj/exception.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/util.h"
#include "ipc/channel.h"
#include "ipc/journal.h"
#include "schemas/journal.capnp.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"
#include "stages/stage.h"
#include "tests/unit/test_support.h"

// Outside any anonymous namespace: external linkage puts them in the dynamic symbol table
// (-rdynamic), so backtraces can name them.
namespace megacpp::stage_test {
[[gnu::noinline]] void throw_from_here() {
  throw Error(ErrorKind::kInternal, "thrown on purpose", __FILE__, __LINE__);
}
[[gnu::noinline]] void check_from_here() {
  MEGACPP_CHECK(1 + 1 == 3, ErrorKind::kInternal, "arithmetic");
}
}  // namespace megacpp::stage_test

// Same JSON type name as LibTorch's error (this binary does not link torch): what() carries
// the message, then c10's own stack trace.
namespace c10 {
struct Error : std::exception {
  const char* what() const noexcept override {
    return "tensor shapes differ\nException raised from check at model.cpp:42 (most recent call "
           "first):\nframe #0: c10::detail::torchCheckFail + 0x1\nframe #1: forward + 0x2\n";
  }
};
}  // namespace c10

namespace megacpp::stage {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using schema::ControlMessage;
using schema::Phase;
using schema::StageKind;

std::string s(capnp::Text::Reader t) {
  return t.cStr();
}

using megacpp::test_support::TempDir;

// A minimal run directory: launch.json whose control endpoint is a socket in the directory.
class RunDir {
 public:
  RunDir() {
    capnp::MallocMessageBuilder message;
    auto l = message.initRoot<schema::LaunchContract>();
    l.setSchemaVersion(schema::SCHEMA_VERSION);
    l.setRunId("run-stage-test");
    l.setCreatedAt(rfc3339(wall_ns()));
    l.setRunDir(dir_.path().string());
    l.setWorld(1);
    l.setSteps(3);
    l.setControlEndpoint(endpoint());
    l.setHeartbeatIntervalMs(50);
    l.getRecipe().setName("tiny");
    l.getRecipe().setHash("0123456789abcdef");
    write_file_atomic(layout::launch_path(dir_.path()), schemas::to_json(l.asReader()));
    fs::create_directories(layout::logs_dir(dir_.path()));
  }
  const fs::path& dir() const { return dir_.path(); }
  std::string endpoint() const { return "ipc://" + (dir() / "control.sock").string(); }
  fs::path dump(StageKind stage = StageKind::COLLECTOR) const {
    return layout::failure_path(dir(), stage, 0);
  }
  fs::path log() const { return layout::log_path(dir(), StageKind::COLLECTOR, 0); }

 private:
  TempDir dir_;
};

// The real collector executable with MEGACPP_FAULT set; stderr goes to the run's log.
class Process {
 public:
  Process(const RunDir& run, const std::string& fault) {
    const fs::path exe = fs::read_symlink("/proc/self/exe").parent_path() / "megacpp-collector";
    MEGACPP_CHECK(fs::exists(exe), ErrorKind::kInvalidArgument, exe.string() + " is not built");
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (!std::string_view(*e).starts_with("MEGACPP_FAULT=")) env.emplace_back(*e);
    }
    env.push_back("MEGACPP_FAULT=" + fault);
    std::vector<std::string> args = {exe.string(), "--run-dir", run.dir().string()};
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 2, run.log().c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    const int rc = ::posix_spawn(&pid_, exe.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    MEGACPP_CHECK(rc == 0, ErrorKind::kSystem, "posix_spawn");
    spawned_ = pid_;
  }
  ~Process() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  pid_t pid() const { return spawned_; }

  // The wait status once it exits (or stops, with WUNTRACED); nullopt after `timeout`.
  std::optional<int> wait(std::chrono::milliseconds timeout, int flags = 0) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG | flags);
      if (r == pid_) {
        if (WIFEXITED(status) || WIFSIGNALED(status)) pid_ = -1;
        return status;
      }
      if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
      std::this_thread::sleep_for(10ms);
    }
  }
  int kill_and_reap() {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_ = -1;  // -1 once reaped
  pid_t spawned_ = -1;
};

// Core files from the deliberate crashes would only litter the machine.
void no_core_files() {
  rlimit rl{};
  ::getrlimit(RLIMIT_CORE, &rl);
  rl.rlim_cur = 0;
  ::setrlimit(RLIMIT_CORE, &rl);
}

bool any_contains(capnp::List<capnp::Text>::Reader lines, std::string_view needle) {
  for (auto l : lines) {
    if (std::string_view(l.cStr()).find(needle) != std::string_view::npos) return true;
  }
  return false;
}

// Receives until a heartbeat reports at least `step`; false after 15 s.
bool await_step(ipc::Channel& router, uint32_t step) {
  const auto deadline = std::chrono::steady_clock::now() + 15s;
  while (std::chrono::steady_clock::now() < deadline) {
    auto m = router.receive(100ms);
    if (m && m->root().which() == ControlMessage::HEARTBEAT &&
        m->root().getHeartbeat().getStep() >= step) {
      return true;
    }
  }
  return false;
}

// ---------------------------------------------------------------------------------------

TEST(ErrorBacktrace, NamesTheThrowingFunction) {
  try {
    stage_test::throw_from_here();
    FAIL() << "did not throw";
  } catch (const Error& e) {
    const auto& bt = e.backtrace();
    ASSERT_FALSE(bt.empty());
    EXPECT_LE(bt.size(), static_cast<size_t>(Error::kMaxBacktraceFrames));
    std::string all;
    for (const auto& f : bt) all += f + "\n";
    // The constructor's own frames are not part of the trace: it starts at the thrower.
    EXPECT_NE(bt.front().find("megacpp::stage_test::throw_from_here"), std::string::npos) << all;
    EXPECT_EQ(all.find("megacpp::Error::Error"), std::string::npos) << all;
    EXPECT_GT(e.mono_ns(), 0);
    // Copies share the trace.
    Error copy = e;
    EXPECT_EQ(&copy.backtrace(), &bt);
  }
}

TEST(ErrorBacktrace, CheckMacroStartsAtTheCaller) {
  try {
    stage_test::check_from_here();
    FAIL() << "did not throw";
  } catch (const Error& e) {
    const auto& bt = e.backtrace();
    ASSERT_FALSE(bt.empty());
    EXPECT_NE(bt.front().find("megacpp::stage_test::check_from_here"), std::string::npos)
        << bt.front();
  }
}

TEST(FaultSpec, ParsesAndKeepsOnlyThisProcess) {
  auto faults = detail::parse_faults(
      "trainer:1:backward:5:segv, collector:0:fold:2:hang,collector:1:fold:3:throw",
      StageKind::COLLECTOR, 0, 0);
  ASSERT_EQ(faults.size(), 1u);
  EXPECT_EQ(faults[0].point, "fold");
  EXPECT_EQ(faults[0].step, 2u);
  EXPECT_EQ(faults[0].action, detail::FaultAction::kHang);
  EXPECT_TRUE(detail::parse_faults("", StageKind::TRAINER, 0, 0).empty());
  EXPECT_EQ(detail::parse_faults("trainer:1:backward:5:segv", StageKind::TRAINER, 1, 0).size(), 1u);
  // Generation: the first launch only unless named; * for every launch.
  EXPECT_TRUE(
      detail::parse_faults("data_loader:0:produce:3:exit", StageKind::DATA_LOADER, 0, 1).empty());
  EXPECT_EQ(
      detail::parse_faults("data_loader:0:produce:3:exit:1", StageKind::DATA_LOADER, 0, 1).size(),
      1u);
  EXPECT_EQ(
      detail::parse_faults("data_loader:0:produce:3:exit:*", StageKind::DATA_LOADER, 0, 7).size(),
      1u);
}

TEST(FaultSpec, RejectsInvalidEntriesNamingThem) {
  for (const char* bad :
       {"collector:0:fold:2", "collector:0:fold:two:throw", "colector:0:fold:2:throw",
        "collector:x:fold:2:throw", "collector:0:fold:2:explode", "collector:0::2:throw",
        "trainer:0:forward:1:throw,,", "collector:0:fold:2:throw:first",
        "collector:0:fold:2:throw:0:extra"}) {
    try {
      detail::parse_faults(bad, StageKind::COLLECTOR, 0, 0);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("MEGACPP_FAULT"), std::string::npos) << e.what();
    }
  }
  try {
    detail::parse_faults("trainer:0:forward:1:throw,collector:0:fold:two:throw", StageKind::TRAINER,
                         0, 0);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'collector:0:fold:two:throw'"), std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------
// The real collector process.

TEST(StageFault, ThrowWritesDumpAndReportsFailure) {
  RunDir run;
  ipc::ZmqContext zmq;
  ipc::Channel router(zmq, ipc::Channel::Kind::kRouter, run.endpoint());
  Process p(run, "collector:0:fold:2:throw");
  auto status = p.wait(20s);
  ASSERT_TRUE(status) << read_file(run.log());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1) << read_file(run.log());

  ASSERT_TRUE(fs::exists(run.dump())) << read_file(run.log());
  schemas::JsonFile<schema::FailureDump> doc(run.dump());
  auto d = doc.get();
  EXPECT_EQ(d.getStage(), StageKind::COLLECTOR);
  EXPECT_EQ(d.getRank(), 0u);
  EXPECT_EQ(d.getPid(), p.pid());
  EXPECT_EQ(s(d.getKind()), "exception");
  EXPECT_EQ(s(d.getErrorKind()), "internal");
  EXPECT_NE(s(d.getMessage()).find("injected fault at fold step 2"), std::string::npos);
  EXPECT_EQ(d.getPhase(), Phase::WRITE);
  EXPECT_EQ(d.getStep(), 2u);
  EXPECT_GT(d.getMonoNs(), 0);
  EXPECT_FALSE(s(d.getAt()).empty());
  ASSERT_GT(d.getBacktrace().size(), 0u);
  EXPECT_TRUE(any_contains(d.getBacktrace(), "megacpp::stage::fault_point")) << schemas::to_json(d);

  // The supervisor's side: Hello, heartbeats, then the Failure with its evidence time.
  bool hello = false;
  std::optional<int64_t> failure_mono;
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!failure_mono && std::chrono::steady_clock::now() < deadline) {
    auto m = router.receive(100ms);
    if (!m) continue;
    EXPECT_EQ(m->peer(), "collector-0");
    if (m->root().which() == ControlMessage::HELLO) hello = true;
    if (m->root().which() == ControlMessage::FAILURE) {
      auto f = m->root().getFailure();
      EXPECT_EQ(f.getStage(), StageKind::COLLECTOR);
      EXPECT_EQ(s(f.getKind()), "exception");
      EXPECT_EQ(f.getErrorKind(), schema::ErrorKind::INTERNAL);
      EXPECT_NE(s(f.getMessage()).find("injected fault at fold step 2"), std::string::npos);
      EXPECT_EQ(f.getStep(), 2u);
      failure_mono = f.getMonoNs();
    }
  }
  EXPECT_TRUE(hello);
  ASSERT_TRUE(failure_mono);
  EXPECT_EQ(*failure_mono, d.getMonoNs());
}

void expect_signal_dump(int sig, const char* name) {
  no_core_files();
  RunDir run;
  ipc::ZmqContext zmq;
  ipc::Channel router(zmq, ipc::Channel::Kind::kRouter, run.endpoint());
  Process p(run, std::string("collector:0:fold:2:") + (sig == SIGSEGV ? "segv" : "abort"));
  auto status = p.wait(20s);
  ASSERT_TRUE(status) << read_file(run.log());
  ASSERT_TRUE(WIFSIGNALED(*status)) << read_file(run.log());
  EXPECT_EQ(WTERMSIG(*status), sig);

  ASSERT_TRUE(fs::exists(run.dump())) << read_file(run.log());
  const std::string text = read_file(run.dump());
  schemas::JsonDocument<schema::FailureDump> doc(text, "dump");
  auto d = doc.get();
  EXPECT_EQ(d.getStage(), StageKind::COLLECTOR);
  EXPECT_EQ(d.getPid(), p.pid());
  EXPECT_EQ(s(d.getKind()), "signal");
  EXPECT_NE(s(d.getMessage()).find(name), std::string::npos) << text;
  EXPECT_EQ(d.getPhase(), Phase::WRITE) << text;
  EXPECT_EQ(d.getStep(), 2u);
  EXPECT_GT(d.getMonoNs(), 0);
  EXPECT_EQ(s(d.getAt()).size(), 24u) << text;  // 2024-01-02T03:04:05.678Z
  ASSERT_GT(d.getBacktrace().size(), 2u) << text;
  // The frames name the function that faulted (mangled: no demangler in a signal handler).
  EXPECT_TRUE(any_contains(d.getBacktrace(), "fault_point")) << text;
  // The symbolised frames also went to stderr.
  const std::string log = read_file(run.log());
  EXPECT_NE(log.find(std::string("fatal signal ") + name), std::string::npos) << log;
  EXPECT_NE(log.find("fault_point"), std::string::npos) << log;
  // No temporary left beside the dump.
  for (const auto& e : fs::directory_iterator(layout::failures_dir(run.dir()))) {
    EXPECT_EQ(e.path(), run.dump());
  }
}

TEST(StageFault, SegvWritesSignalDumpAndDiesSignaled) {
  expect_signal_dump(SIGSEGV, "SIGSEGV");
}

TEST(StageFault, AbortWritesSignalDumpAndDiesSignaled) {
  expect_signal_dump(SIGABRT, "SIGABRT");
}

TEST(StageFault, ExitLeavesWithCode3) {
  RunDir run;
  ipc::ZmqContext zmq;
  ipc::Channel router(zmq, ipc::Channel::Kind::kRouter, run.endpoint());
  Process p(run, "collector:0:fold:2:exit");
  auto status = p.wait(20s);
  ASSERT_TRUE(status) << read_file(run.log());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 3) << read_file(run.log());
  EXPECT_FALSE(fs::exists(run.dump()));
  // The journal was flushed: processStarted is in it, processFinished is not.
  bool started = false, finished = false;
  ipc::JournalReader::read_all(layout::journal_path(run.dir(), StageKind::COLLECTOR, 0),
                               [&](schema::JournalRecord::Reader r) {
                                 started |= r.isProcessStarted();
                                 finished |= r.isProcessFinished();
                               });
  EXPECT_TRUE(started);
  EXPECT_FALSE(finished);
}

TEST(StageFault, HangKeepsHeartbeatingWithoutProgress) {
  RunDir run;
  ipc::ZmqContext zmq;
  ipc::Channel router(zmq, ipc::Channel::Kind::kRouter, run.endpoint());
  Process p(run, "collector:0:fold:2:hang");
  ASSERT_TRUE(await_step(router, 2)) << read_file(run.log());
  // The hang is entered right after step 2 is published; skip what was queued before it.
  std::this_thread::sleep_for(200ms);
  while (router.receive(0ms)) {
  }
  int heartbeats = 0;
  std::optional<int64_t> phase_started;
  const auto until = std::chrono::steady_clock::now() + 1s;
  while (std::chrono::steady_clock::now() < until || heartbeats < 3) {
    auto m = router.receive(5s);
    ASSERT_TRUE(m) << "heartbeats stopped\n" << read_file(run.log());
    if (m->root().which() != ControlMessage::HEARTBEAT) continue;
    auto h = m->root().getHeartbeat();
    ++heartbeats;
    EXPECT_EQ(h.getStep(), 2u);
    EXPECT_EQ(h.getPhase(), Phase::WRITE);
    if (!phase_started) phase_started = h.getPhaseStartedMonoNs();
    EXPECT_EQ(h.getPhaseStartedMonoNs(), *phase_started);
  }
  EXPECT_FALSE(p.wait(0ms)) << "exited while hanging";
  // A hung stage ignores SIGTERM's stop request; SIGKILL ends it.
  const int status = p.kill_and_reap();
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

TEST(StageFault, StopSilencesHeartbeats) {
  RunDir run;
  ipc::ZmqContext zmq;
  ipc::Channel router(zmq, ipc::Channel::Kind::kRouter, run.endpoint());
  Process p(run, "collector:0:fold:2:stop");
  auto status = p.wait(20s, WUNTRACED);
  ASSERT_TRUE(status) << read_file(run.log());
  ASSERT_TRUE(WIFSTOPPED(*status)) << read_file(run.log());
  EXPECT_EQ(WSTOPSIG(*status), SIGSTOP);
  // Drain whatever was already in flight, then nothing more comes.
  while (router.receive(300ms)) {
  }
  int heartbeats = 0;
  const auto until = std::chrono::steady_clock::now() + 500ms;
  while (std::chrono::steady_clock::now() < until) {
    if (auto m = router.receive(100ms); m && m->root().which() == ControlMessage::HEARTBEAT) {
      ++heartbeats;
    }
  }
  EXPECT_EQ(heartbeats, 0);
  const int killed = p.kill_and_reap();
  EXPECT_TRUE(WIFSIGNALED(killed) && WTERMSIG(killed) == SIGKILL);
}

TEST(StageFault, InvalidSpecFailsAtStart) {
  RunDir run;
  Process p(run, "collector:0:fold:two:throw");
  auto status = p.wait(20s);
  ASSERT_TRUE(status) << read_file(run.log());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1);
  const std::string log = read_file(run.log());
  EXPECT_NE(log.find("MEGACPP_FAULT: invalid entry 'collector:0:fold:two:throw'"),
            std::string::npos)
      << log;
  schemas::JsonFile<schema::FailureDump> doc(run.dump());
  EXPECT_EQ(s(doc.get().getErrorKind()), "invalid_argument");
  EXPECT_EQ(doc.get().getPhase(), Phase::STARTUP);
}

// ---------------------------------------------------------------------------------------
// run_stage_main in a forked child (no threads exist in this process when it forks).

int run_child(const RunDir& run, const std::function<void(StageContext&)>& body) {
  no_core_files();
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::string a0 = "megacpp-test", a1 = "--run-dir", a2 = run.dir().string();
    char* argv[] = {a0.data(), a1.data(), a2.data(), nullptr};
    ::_exit(run_stage_main(3, argv, StageKind::TRAINER, "test stage", body));
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

schema::FailureDump::Reader load(const RunDir& run,
                                 std::unique_ptr<schemas::JsonFile<schema::FailureDump>>& doc) {
  doc = std::make_unique<schemas::JsonFile<schema::FailureDump>>(run.dump(StageKind::TRAINER));
  return doc->get();
}

TEST(StageMain, StdExceptionNamesItsType) {
  RunDir run;
  const int status = run_child(run, [](StageContext& ctx) {
    ctx.set_phase(Phase::FORWARD);
    ctx.set_step(7);
    std::vector<int> v;
    (void)v.at(3);
  });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1);
  std::unique_ptr<schemas::JsonFile<schema::FailureDump>> doc;
  auto d = load(run, doc);
  EXPECT_EQ(s(d.getKind()), "exception");
  EXPECT_EQ(s(d.getErrorKind()), "std");
  EXPECT_NE(s(d.getMessage()).find("std::out_of_range"), std::string::npos);
  EXPECT_EQ(d.getPhase(), Phase::FORWARD);
  EXPECT_EQ(d.getStep(), 7u);
}

TEST(StageMain, C10ErrorTraceIsSplitIntoLines) {
  RunDir run;
  const int status = run_child(run, [](StageContext&) { throw c10::Error(); });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1);
  std::unique_ptr<schemas::JsonFile<schema::FailureDump>> doc;
  auto d = load(run, doc);
  EXPECT_EQ(s(d.getErrorKind()), "c10");
  EXPECT_EQ(s(d.getMessage()), "tensor shapes differ");
  ASSERT_EQ(d.getBacktrace().size(), 3u);
  EXPECT_EQ(s(d.getBacktrace()[1]), "frame #0: c10::detail::torchCheckFail + 0x1");
}

TEST(StageMain, KjExceptionCarriesItsStack) {
  RunDir run;
  const int status = run_child(run, [](StageContext&) { KJ_FAIL_REQUIRE("bad capnp input"); });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1);
  std::unique_ptr<schemas::JsonFile<schema::FailureDump>> doc;
  auto d = load(run, doc);
  EXPECT_EQ(s(d.getErrorKind()), "capnp");
  EXPECT_NE(s(d.getMessage()).find("bad capnp input"), std::string::npos);
  EXPECT_GT(d.getBacktrace().size(), 0u);
}

TEST(StageMain, UncaughtExceptionInAThreadDumpsAndAborts) {
  RunDir run;
  const int status = run_child(run, [](StageContext& ctx) {
    ctx.set_phase(Phase::BACKWARD);
    ctx.set_step(4);
    std::thread t([] { stage_test::throw_from_here(); });
    t.join();
  });
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGABRT);
  std::unique_ptr<schemas::JsonFile<schema::FailureDump>> doc;
  auto d = load(run, doc);
  EXPECT_EQ(s(d.getKind()), "terminate");
  EXPECT_EQ(s(d.getErrorKind()), "internal");
  EXPECT_NE(s(d.getMessage()).find("uncaught exception: thrown on purpose"), std::string::npos);
  EXPECT_EQ(d.getPhase(), Phase::BACKWARD);
  EXPECT_EQ(d.getStep(), 4u);
  EXPECT_TRUE(any_contains(d.getBacktrace(), "megacpp::stage_test::throw_from_here"));
}

TEST(SpareGeneration, OneLineIsTheGenerationAndAnythingElseLetsTheSpareGo) {
  auto read_from = [](const std::string& text) {
    int p[2];
    EXPECT_EQ(::pipe(p), 0);
    EXPECT_EQ(::write(p[1], text.data(), text.size()), static_cast<ssize_t>(text.size()));
    ::close(p[1]);
    const auto g = detail::read_spare_generation(p[0]);
    ::close(p[0]);
    return g;
  };
  EXPECT_EQ(read_from("7\n"), std::optional<uint32_t>(7));
  EXPECT_EQ(read_from("4294967295\n"), std::optional<uint32_t>(UINT32_MAX));
  EXPECT_EQ(read_from(""), std::nullopt) << "the supervisor closed it: never needed";
  EXPECT_EQ(read_from("7"), std::nullopt) << "no whole line";
  EXPECT_EQ(read_from("\n"), std::nullopt);
  EXPECT_EQ(read_from("-1\n"), std::nullopt);
  EXPECT_EQ(read_from("4294967296\n"), std::nullopt);
  EXPECT_EQ(read_from("99999999999\n"), std::nullopt);
}

}  // namespace
}  // namespace megacpp::stage
