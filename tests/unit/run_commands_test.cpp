// The commands that read a run directory (supervisor.h: status, status --watch, list, and the
// reconcile they run first): on a run of several attempts they show the current attempt's step,
// loss and ETA only; reconciling an orphan writes nothing through a link or outside its run
// directory, removes all of its segments (exchange outboxes too) and none of a live run's.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <capnp/message.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <regex>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/journal.h"
#include "ipc/shm.h"
#include "schemas/journal.capnp.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"
#include "supervisor/commands/commands.h"
#include "supervisor/process.h"
#include "supervisor/supervisor.h"
#include "tests/unit/temp_dir.h"

namespace fs = std::filesystem;
namespace mc = megacpp;
namespace ms = megacpp::supervisor;
using mc::schema::StageKind;
using mc::test_support::TempDir;

namespace {

const fs::path kFixtures = fs::path(MEGACPP_SOURCE_DIR) / "tests/fixtures/runs/v1";

// A child that sleeps until killed: stands in for a live supervisor. Killed and reaped on
// destruction.
class FakeSupervisor {
 public:
  FakeSupervisor() : pid_(::fork()) {
    if (pid_ == 0) {
      ::pause();
      ::_exit(0);
    }
  }
  ~FakeSupervisor() { end(); }
  FakeSupervisor(const FakeSupervisor&) = delete;
  FakeSupervisor& operator=(const FakeSupervisor&) = delete;
  pid_t pid() const { return pid_; }
  void end() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_;
};

// Copies fixture `name` (not its expected/) to `to`.
void copy_fixture(const std::string& name, const fs::path& to) {
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(kFixtures / name)) {
    if (e.path().filename() == "expected") continue;
    fs::copy(e.path(), to / e.path().filename(), fs::copy_options::recursive);
  }
}

// Rewrites journal `path` keeping the records `keep` accepts (it may edit them first).
void rewrite_journal(const fs::path& path,
                     const std::function<bool(mc::schema::JournalRecord::Builder)>& keep) {
  std::vector<std::unique_ptr<capnp::MallocMessageBuilder>> kept;
  mc::ipc::JournalReader::read_all(path, [&](mc::schema::JournalRecord::Reader r) {
    auto m = std::make_unique<capnp::MallocMessageBuilder>();
    m->setRoot(r);
    if (keep(m->getRoot<mc::schema::JournalRecord>())) kept.push_back(std::move(m));
  });
  fs::remove(path);
  mc::ipc::JournalWriter w(path);
  for (auto& m : kept) w.append_raw(*m);
}

// Sets launch.json's supervisor to `pid` (a live process) with its start time.
void set_supervisor(const fs::path& run, pid_t pid) {
  mc::schemas::JsonFile<mc::schema::LaunchContract> launch(mc::layout::launch_path(run));
  launch.builder().setSupervisorPid(pid);
  launch.builder().setSupervisorStartTicks(ms::detail::process_start_ticks(pid));
  mc::write_file_atomic(mc::layout::launch_path(run), mc::schemas::to_json(launch.get()));
}

// Stdout of `f` (fmt::print goes to stdout).
std::string stdout_of(const std::function<void()>& f) {
  testing::internal::CaptureStdout();
  f();
  std::fflush(stdout);
  return testing::internal::GetCapturedStdout();
}

// Fixture `name` caught live in attempt 1 once it finished `last_step` (none yet when that is
// its resume step): its supervisor alive, attempt 1's later steps and its end not yet written.
// Attempt 1's step records get a loss of 100 + step and 10 s a step, so nothing of attempt 0
// can pass for them. `restarts`: attempt 0 trained steps 1..3 and failed, attempt 1 restarted
// from step 2's checkpoint. `resumed`: attempt 0 trained 1..4 and failed, attempt 1 resumed
// from step 4.
struct LiveSecondAttempt {
  TempDir tmp;
  fs::path run;
  FakeSupervisor supervisor;

  LiveSecondAttempt(const std::string& name, uint32_t last_step) : run(tmp.path() / "runs" / name) {
    copy_fixture(name, run);
    for (uint32_t rank = 0; rank < 2; ++rank)
      rewrite_journal(mc::layout::journal_path(run, StageKind::TRAINER, rank),
                      [&](mc::schema::JournalRecord::Builder r) {
                        if (r.getAttempt() != 1 || !r.isStep()) return true;
                        auto s = r.getStep();
                        if (s.getStep() > last_step) return false;
                        s.setLoss(100.0f + static_cast<float>(s.getStep()));
                        s.setStepSeconds(10.0);
                        return true;
                      });
    rewrite_journal(mc::layout::journal_path(run, StageKind::SUPERVISOR, 0),
                    [](mc::schema::JournalRecord::Builder r) {
                      return r.getAttempt() != 1 || !r.isRunFinished();
                    });
    set_supervisor(run, supervisor.pid());
  }
};

// `megacpp status --watch`'s line for a live run, until its supervisor ends after 300 ms.
std::string watch_lines(LiveSecondAttempt& live) {
  return stdout_of([&] {
    std::thread end([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      live.supervisor.end();
    });
    ms::watch_status(live.run, 0.05);
    end.join();
  });
}

const std::regex kWatchLine(R"((\w+)  step (\d+)/8  loss (\S+)  (\S+) tok/s  .*  eta (\S+))");

}  // namespace

TEST(RunCommands, ListShowsTheCurrentAttemptsLoss) {
  LiveSecondAttempt live("restarts", 3);
  const std::string out = stdout_of([&] { ms::list_runs(live.tmp.path() / "runs"); });
  std::smatch m;
  ASSERT_TRUE(
      std::regex_search(out, m, std::regex(R"(restarts\s+running\s+\S+\s+(\d+)/8\s+(\S+))")))
      << out;
  EXPECT_EQ(m[1].str(), "3") << out;
  EXPECT_EQ(m[2].str(), "103.0000") << "attempt 1's loss at its step 3\n" << out;
}

TEST(RunCommands, WatchShowsTheCurrentAttemptsStepLossAndEta) {
  LiveSecondAttempt live("restarts", 3);
  const std::string out = watch_lines(live);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, kWatchLine)) << out;
  EXPECT_EQ(m[2].str(), "3") << out;
  EXPECT_EQ(m[3].str(), "103.0000") << out;
  // 5 steps left at attempt 1's 10 s a step.
  EXPECT_EQ(m[5].str(), "50s") << out;
}

TEST(RunCommands, WatchOfAResumeBeforeItsFirstStepShowsTheResumeStepAlone) {
  LiveSecondAttempt live("resumed", 4);
  const std::string listed = stdout_of([&] { ms::list_runs(live.tmp.path() / "runs"); });
  EXPECT_TRUE(std::regex_search(listed, std::regex(R"(resumed\s+running\s+\S+\s+4/8\s+-\s)")))
      << listed;
  const std::string out = watch_lines(live);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, kWatchLine)) << out;
  EXPECT_EQ(m[2].str(), "4") << out;
  EXPECT_EQ(m[3].str(), "-") << "attempt 0's loss shown for attempt 1\n" << out;
  EXPECT_EQ(m[4].str(), "-") << out;
  EXPECT_EQ(m[5].str(), "-") << out;
}

TEST(RunCommands, StatusShowsTheCurrentAttemptsStep) {
  LiveSecondAttempt live("restarts", 3);
  const std::string out = stdout_of([&] { ms::status(live.run); });
  EXPECT_NE(out.find("steps      3/8 on 2 ranks"), std::string::npos) << out;
}

namespace {

// The `orphaned` fixture (its supervisor SIGKILLed mid-run) before any command recorded it:
// its runOrphaned record dropped, its run id `run_id` (unique to the test: shm names are
// host-wide).
struct UnrecordedOrphan {
  TempDir tmp;
  fs::path run = tmp.path() / "orphaned";
  std::string run_id;

  explicit UnrecordedOrphan(std::string id) : run_id(std::move(id)) {
    copy_fixture("orphaned", run);
    rewrite_journal(mc::layout::journal_path(run, StageKind::SUPERVISOR, 0),
                    [](mc::schema::JournalRecord::Builder r) { return !r.isRunOrphaned(); });
    mc::schemas::JsonFile<mc::schema::LaunchContract> launch(mc::layout::launch_path(run));
    launch.builder().setRunId(run_id);
    mc::write_file_atomic(mc::layout::launch_path(run), mc::schemas::to_json(launch.get()));
  }
  std::string prefix() const { return mc::layout::shm_prefix(run_id, 0); }
};

// A segment nobody maps or holds open, as a dead run leaves it.
void leave_segment(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0) << name;
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  ::close(fd);
}

std::string unique_id(const char* what) {
  return fmt::format("{}-{}-{}", what, ::getpid(), mc::wall_ns() % 1'000'000'000);
}

}  // namespace

TEST(Reconcile, RemovesAllOfAnOrphansSegmentsItsExchangeOutboxesToo) {
  UnrecordedOrphan orphan(unique_id("orphan"));
  const std::string p = orphan.prefix();
  for (const auto& name : {mc::layout::ring_shm_name(p, 0), mc::layout::staging_shm_name(p, 1),
                           mc::layout::exchange_shm_prefix(p, "dp") + "0",
                           mc::layout::exchange_shm_prefix(p, "dp") + "1"})
    leave_segment(name);
  ASSERT_EQ(mc::ipc::list_shm(p).size(), 4u);
  EXPECT_TRUE(ms::reconcile(orphan.run));
  const auto left = mc::ipc::list_shm(p);
  EXPECT_TRUE(left.empty()) << fmt::format("{}", fmt::join(left, ", "));
  mc::ipc::unlink_shm(p);
}

TEST(Reconcile, NeverRemovesTheSegmentsOfALiveRunItsRunIdNames) {
  // launch.json names the run id of a live run: its ring (mapped by its supervisor, here this
  // process) and a staging segment nobody maps this instant stay.
  UnrecordedOrphan orphan(unique_id("victim"));
  const std::string p = orphan.prefix();
  mc::ipc::ShmRegion ring(mc::ipc::ShmRegion::Create{}, mc::layout::ring_shm_name(p, 0), 4096);
  leave_segment(mc::layout::staging_shm_name(p, 0));
  EXPECT_TRUE(ms::reconcile(orphan.run)) << "the orphan itself is still recorded";
  EXPECT_EQ(mc::ipc::list_shm(p).size(), 2u);
  ::shm_unlink(mc::layout::staging_shm_name(p, 0).c_str());
}

TEST(Reconcile, WritesNothingThroughALinkedJournal) {
  UnrecordedOrphan orphan(unique_id("linked"));
  const fs::path journal = mc::layout::journal_path(orphan.run, StageKind::SUPERVISOR, 0);
  const fs::path outside = orphan.tmp.path() / "elsewhere.journal";
  fs::rename(journal, outside);
  fs::create_symlink(outside, journal);
  const std::string before = mc::read_file(outside);
  std::string what;
  try {
    ms::status(orphan.run);
  } catch (const mc::Error& e) {
    what = e.what();
  }
  EXPECT_TRUE(mc::read_file(outside) == before) << "the link's target was written";
  EXPECT_NE(what.find(journal.string() + " is a symbolic link"), std::string::npos) << what;
  EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  // A journal directory that leads outside the run: refused the same way.
  fs::remove(journal);
  fs::rename(outside, journal);
  const fs::path dir = mc::layout::journal_dir(orphan.run);
  fs::rename(dir, orphan.tmp.path() / "journals-elsewhere");
  fs::create_symlink(orphan.tmp.path() / "journals-elsewhere", dir);
  const std::string before_dir = mc::read_file(journal);
  what.clear();
  try {
    ms::reconcile(orphan.run);
  } catch (const mc::Error& e) {
    what = e.what();
  }
  EXPECT_TRUE(mc::read_file(journal) == before_dir) << "written through the linked folder";
  EXPECT_NE(what.find("leads outside the run directory"), std::string::npos) << what;
}
