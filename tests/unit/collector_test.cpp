// megacpp::collector: the fold from synthesised run directories (real journals written with
// ipc::JournalWriter, a real launch.json) to manifest + receipts.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <capnp/message.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "core/util.h"
#include "ipc/channel.h"
#include "ipc/journal.h"
#include "schemas/enums.h"
#include "schemas/journal.capnp.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"
#include "stages/collector/collector.h"
#include "tests/unit/test_support.h"

namespace megacpp::collector {
namespace {

namespace fs = std::filesystem;
using schema::StageKind;

constexpr int64_t kWallBase = 1'700'000'000'000'000'000;  // 2023-11-14T22:13:20Z

using megacpp::test_support::TempDir;

// Synthesises a run: launch.json and journal records with chosen timestamps (t in ms).
class FakeRun {
 public:
  explicit FakeRun(uint32_t world = 2, uint32_t steps = 3) : world_(world) {
    capnp::MallocMessageBuilder message;
    auto l = message.initRoot<schema::LaunchContract>();
    l.setSchemaVersion(schema::SCHEMA_VERSION);
    l.setRunId("run-test");
    l.setCreatedAt(rfc3339(kWallBase));
    l.setRunDir(dir_.path().string());
    l.setWorld(world);
    l.setSteps(steps);
    l.setControlEndpoint(control_endpoint());
    l.setHeartbeatIntervalMs(100);
    l.getRecipe().setName("tiny");
    l.getRecipe().setHash("0123456789abcdef");
    write_file_atomic(layout::launch_path(dir_.path()), schemas::to_json(l.asReader()));
  }
  const fs::path& run() const { return dir_.path(); }
  uint32_t world() const { return world_; }
  std::string control_endpoint() const { return "ipc://" + (run() / "control.sock").string(); }

  using Fill = std::function<void(schema::JournalRecord::Builder)>;
  void rec(StageKind stage, uint32_t rank, int64_t t_ms, const Fill& fill) {
    const std::string name = layout::process_name(stage, rank);
    auto& w = writers_[name];
    if (!w) w = std::make_unique<ipc::JournalWriter>(layout::journal_path(run(), stage, rank));
    capnp::MallocMessageBuilder message;
    auto r = message.initRoot<schema::JournalRecord>();
    r.setSchemaVersion(schema::SCHEMA_VERSION);
    r.setMonoNs(t_ms * 1'000'000);
    r.setWallNs(kWallBase + t_ms * 1'000'000);
    r.setStage(stage);
    r.setRank(rank);
    r.setPid(pid(stage, rank));
    fill(r);
    w->append_raw(message);
  }
  static int32_t pid(StageKind stage, uint32_t rank) {
    return 1000 + 10 * static_cast<int32_t>(stage) + static_cast<int32_t>(rank);
  }

  // Pieces of a normal run.
  void supervisor_start() {
    rec(StageKind::SUPERVISOR, 0, 0, [](auto r) { r.setProcessStarted(); });
    for (auto [stage, rank] : children()) {
      rec(StageKind::SUPERVISOR, 0, 1, [&, stage = stage, rank = rank](auto r) {
        auto c = r.initChildStarted();
        c.setStage(stage);
        c.setRank(rank);
        c.setPid(pid(stage, rank));
      });
    }
  }
  void run_started() {
    rec(StageKind::SUPERVISOR, 0, 2, [&](auto r) { r.initRunStarted().setWorld(world_); });
  }
  void trainer_start(uint32_t rank) {
    rec(StageKind::TRAINER, rank, 3, [](auto r) { r.setProcessStarted(); });
    rec(StageKind::TRAINER, rank, 4,
        [&](auto r) { r.initFirstForward().setSeconds(0.5 + 0.25 * rank); });
  }
  // Rank r's step s ends at 1000*s + 100*r ms; loss 4 - 0.5 s + 0.25 r; 100 tokens.
  void step(uint32_t rank, uint32_t s) {
    rec(StageKind::TRAINER, rank, 1000 * s + 100 * rank, [&](auto r) {
      auto st = r.initStep();
      st.setStep(s);
      st.setLoss(static_cast<float>(4.0 - 0.5 * s + 0.25 * rank));
      st.setTokens(100);
      st.setStepSeconds(rank == 0 ? 1.0 : 0.75);
      st.setWaitSeconds(0.125 * (rank + 1));
    });
  }
  void checkpoint(uint32_t s, int64_t t_ms) {
    rec(StageKind::CHECKPOINTER, 0, t_ms, [&](auto r) {
      auto c = r.initCheckpointCommitted();
      c.setStep(s);
      c.setPath("checkpoints/" + layout::checkpoint_dir_name(s));
      c.setBytes(1234);
      c.setSeconds(0.01);
    });
  }
  void finished(StageKind stage, uint32_t rank, int64_t t_ms) {
    rec(stage, rank, t_ms, [](auto r) { r.setProcessFinished(); });
  }
  void child_exited(StageKind stage, uint32_t rank, int64_t t_ms, int32_t code, int32_t signal) {
    rec(StageKind::SUPERVISOR, 0, t_ms, [&](auto r) {
      auto c = r.initChildExited();
      c.setStage(stage);
      c.setRank(rank);
      c.setPid(pid(stage, rank));
      c.setExitCode(code);
      c.setSignal(signal);
    });
  }
  void run_finished(int64_t t_ms, bool ok, const std::string& kind = {}, StageKind stage = {},
                    uint32_t rank = 0, const std::string& reason = {}) {
    rec(StageKind::SUPERVISOR, 0, t_ms, [&](auto r) {
      auto f = r.initRunFinished();
      f.setOk(ok);
      f.setFailureKind(schemas::failure_kind_named(kind).value());
      f.setStage(stage);
      f.setRank(rank);
      f.setReason(reason);
    });
  }

  // A complete successful run of `steps` steps for both ranks.
  void whole_run(uint32_t steps = 3) {
    supervisor_start();
    run_started();
    rec(StageKind::CHECKPOINTER, 0, 3, [](auto r) { r.setProcessStarted(); });
    for (uint32_t r = 0; r < world_; ++r) trainer_start(r);
    for (uint32_t s = 1; s <= steps; ++s) {
      for (uint32_t r = 0; r < world_; ++r) step(r, s);
      if (s == 2) checkpoint(2, 2500);
    }
    for (uint32_t r = 0; r < world_; ++r) {
      finished(StageKind::TRAINER, r, 5000);
      child_exited(StageKind::TRAINER, r, 5100, 0, 0);
    }
    finished(StageKind::CHECKPOINTER, 0, 5200);
    child_exited(StageKind::CHECKPOINTER, 0, 5300, 0, 0);
    run_finished(6000, true);
  }

 private:
  static std::vector<std::pair<StageKind, uint32_t>> children() {
    return {{StageKind::TRAINER, 0}, {StageKind::TRAINER, 1}, {StageKind::CHECKPOINTER, 0}};
  }
  TempDir dir_;
  uint32_t world_;
  std::map<std::string, std::unique_ptr<ipc::JournalWriter>> writers_;
};

// A rendered output decoded back through its schema.
template <typename T>
struct Parsed {
  explicit Parsed(const std::string& text) : doc(text, "test"), r(doc.get()) {}
  schemas::JsonDocument<T> doc;
  typename T::Reader r;
};

std::string s(capnp::Text::Reader t) {
  return std::string(t.cStr(), t.size());
}
// The manifest's typed fields, as the name the JSON carries.
std::string s(schema::FailureKind k) {
  return std::string(schemas::name(k));
}
std::string s(schema::ProcessState st) {
  return std::string(schemas::name(st));
}

// receipts/first_forward.json: seconds from the attempt's launch (the first stage started, at
// t = 1 ms) to each rank's process start, groups joined, first forward and first backward; the
// slowest rank by first backward and the spread. backend_identity.json: each rank's record.
TEST(Collector, StartUpReceiptsNameTheSlowestRank) {
  FakeRun run;
  run.supervisor_start();
  run.run_started();
  for (uint32_t r = 0; r < 2; ++r) {
    // Rank 1 joins, computes and finishes its first backward 2 s after rank 0.
    const int64_t lag = 2000 * r;
    run.rec(StageKind::TRAINER, r, 1001 + lag, [&](auto rec) {
      rec.initRendezvousDone().setSeconds(0.5);  // its process started at 501 ms + lag
    });
    run.rec(StageKind::TRAINER, r, 1002 + lag, [&](auto rec) {
      auto b = rec.initBackendIdentity();
      b.setBackend("gloo");
      b.setThreads(1 + r);
    });
    run.rec(StageKind::TRAINER, r, 2001 + lag,
            [&](auto rec) { rec.initFirstForward().setSeconds(1.5); });
    run.rec(StageKind::TRAINER, r, 3001 + lag,
            [&](auto rec) { rec.initFirstBackward().setSeconds(2.5); });
  }
  for (uint32_t st = 1; st <= 3; ++st)
    for (uint32_t r = 0; r < 2; ++r) run.step(r, st);
  run.run_finished(9000, true);
  Collector c(run.run());
  c.poll();
  Parsed<schema::FirstForwardReceipt> f(c.outputs().at("receipts/first_forward.json"));
  ASSERT_EQ(f.r.getRanks().size(), 2u);
  for (uint32_t r = 0; r < 2; ++r) {
    const auto rank = f.r.getRanks()[r];
    const double lag = 2.0 * r;
    EXPECT_EQ(rank.getRank(), r);
    EXPECT_NEAR(rank.getProcessStartSeconds(), 0.5 + lag, 1e-9);
    EXPECT_NEAR(rank.getRendezvousSeconds(), 1.0 + lag, 1e-9);
    EXPECT_NEAR(rank.getFirstForwardSeconds(), 2.0 + lag, 1e-9);
    EXPECT_NEAR(rank.getFirstBackwardSeconds(), 3.0 + lag, 1e-9);
  }
  EXPECT_EQ(f.r.getSlowestRank(), 1);
  EXPECT_NEAR(f.r.getSpreadSeconds(), 2.0, 1e-9);
  Parsed<schema::BackendIdentityReceipt> b(c.outputs().at("receipts/backend_identity.json"));
  ASSERT_EQ(b.r.getRanks().size(), 2u);
  EXPECT_EQ(s(b.r.getRanks()[1].getIdentity().getBackend()), "gloo");
  EXPECT_EQ(b.r.getRanks()[1].getIdentity().getThreads(), 2u);
  Parsed<schema::RuntimeProvenance> p(c.outputs().at("receipts/runtime_provenance.json"));
  EXPECT_EQ(s(p.r.getRecipe()), "tiny");
}

// Node 0 of a job across nodes journals the job's view; the collector folds the newest into
// RUN/job.json, and a run of one node has none.
TEST(Collector, TheNewestJobViewIsTheJobsManifest) {
  FakeRun run;
  run.supervisor_start();
  run.run_started();
  {
    Collector c(run.run());
    c.poll();
    EXPECT_FALSE(c.outputs().contains("job.json"));
  }
  run.rec(StageKind::SUPERVISOR, 0, 1500,
          [&](auto rec) { rec.setJobView("{\"state\": \"running\"}"); });
  run.rec(StageKind::TRAINER, 0, 1600,
          [&](auto rec) { rec.setJobView("{\"not\": \"a supervisor's\"}"); });
  run.rec(StageKind::SUPERVISOR, 0, 2500, [&](auto rec) { rec.setJobView("{\"state\": \"ok\"}"); });
  run.run_finished(9000, true);
  Collector c(run.run());
  c.poll();
  EXPECT_EQ(c.outputs().at("job.json"), "{\"state\": \"ok\"}");
}

// A rank that never got past its rendezvous reads -1 for what it did not reach, and is not the
// slowest (nothing to compare).
TEST(Collector, StartUpReceiptOfARankThatNeverComputed) {
  FakeRun run;
  run.supervisor_start();
  run.run_started();
  run.rec(StageKind::TRAINER, 0, 1001, [&](auto rec) { rec.initRendezvousDone().setSeconds(0.5); });
  run.run_finished(5000, false, "signaled", StageKind::TRAINER, 0, "killed");
  Collector c(run.run());
  c.poll();
  Parsed<schema::FirstForwardReceipt> f(c.outputs().at("receipts/first_forward.json"));
  ASSERT_EQ(f.r.getRanks().size(), 2u);
  EXPECT_NEAR(f.r.getRanks()[0].getRendezvousSeconds(), 1.0, 1e-9);
  EXPECT_EQ(f.r.getRanks()[0].getFirstForwardSeconds(), -1.0);
  EXPECT_EQ(f.r.getRanks()[1].getRendezvousSeconds(), -1.0);
  EXPECT_EQ(f.r.getSlowestRank(), -1);
  EXPECT_EQ(f.r.getSpreadSeconds(), 0.0);
}

// A run written in a newer format is refused by name, never folded.
TEST(Collector, ANewerRunFormatIsRefusedByName) {
  FakeRun run;
  {
    schemas::JsonFile<schema::LaunchContract> launch(layout::launch_path(run.run()));
    capnp::MallocMessageBuilder message;
    message.setRoot(launch.get());
    message.getRoot<schema::LaunchContract>().setSchemaVersion(schema::SCHEMA_VERSION + 1);
    write_file_atomic(layout::launch_path(run.run()),
                      schemas::to_json(message.getRoot<schema::LaunchContract>().asReader()));
  }
  try {
    Collector c(run.run());
    FAIL() << "a newer format was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(
                  fmt::format("run format version {}", schema::SCHEMA_VERSION + 1)),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(layout::manifest_path(run.run())));
}

TEST(Collector, StatesLaunchedRunningOkAndIncrementalPoll) {
  FakeRun run;
  Collector c(run.run());
  EXPECT_TRUE(c.poll());   // first render
  EXPECT_FALSE(c.poll());  // nothing new
  {
    Parsed<schema::Manifest> m(c.outputs().at("manifest.json"));
    EXPECT_EQ(m.r.getState(), schema::RunState::LAUNCHED);
    EXPECT_EQ(s(m.r.getRunId()), "run-test");
    EXPECT_EQ(s(m.r.getRecipe()), "tiny");
    EXPECT_EQ(s(m.r.getRecipeHash()), "0123456789abcdef");
    EXPECT_EQ(m.r.getWorld(), 2u);
    EXPECT_EQ(m.r.getStepsPlanned(), 3u);
    EXPECT_EQ(s(m.r.getLaunchedAt()), rfc3339(kWallBase));
    EXPECT_FALSE(m.r.hasRunningAt());
    EXPECT_FALSE(m.r.hasLastPolledAt());
    EXPECT_EQ(c.outputs().size(), 1u);
  }
  c.write();
  EXPECT_TRUE(fs::exists(layout::manifest_path(run.run())));
  EXPECT_FALSE(fs::exists(layout::receipts_dir(run.run()) / "bench_result.json"));

  run.supervisor_start();
  EXPECT_TRUE(c.poll());
  EXPECT_EQ(Parsed<schema::Manifest>(c.outputs().at("manifest.json")).r.getState(),
            schema::RunState::LAUNCHED);
  run.run_started();
  EXPECT_TRUE(c.poll());
  {
    Parsed<schema::Manifest> m(c.outputs().at("manifest.json"));
    EXPECT_EQ(m.r.getState(), schema::RunState::RUNNING);
    EXPECT_EQ(s(m.r.getRunningAt()), rfc3339(kWallBase + 2'000'000));
    EXPECT_EQ(s(m.r.getLastPolledAt()), rfc3339(kWallBase + 2'000'000));
    EXPECT_EQ(m.r.getStepsCompleted(), 0u);
    // supervisor + the three children it started, sorted by (stage, rank).
    auto stages = m.r.getStages();
    ASSERT_EQ(stages.size(), 4u);
    EXPECT_EQ(stages[0].getStage(), StageKind::SUPERVISOR);
    EXPECT_EQ(stages[1].getStage(), StageKind::TRAINER);
    EXPECT_EQ(stages[1].getRank(), 0u);
    EXPECT_EQ(stages[2].getStage(), StageKind::TRAINER);
    EXPECT_EQ(stages[2].getRank(), 1u);
    EXPECT_EQ(stages[3].getStage(), StageKind::CHECKPOINTER);
    EXPECT_EQ(s(stages[1].getState()), "started");
    EXPECT_EQ(stages[1].getPid(), FakeRun::pid(StageKind::TRAINER, 0));
    EXPECT_FALSE(stages[1].hasLastRecordAt());  // nothing from its own journal yet
  }
  run.trainer_start(0);
  run.trainer_start(1);
  run.step(0, 1);
  run.step(1, 1);
  run.step(0, 2);
  EXPECT_TRUE(c.poll());
  {
    Parsed<schema::Manifest> m(c.outputs().at("manifest.json"));
    EXPECT_EQ(m.r.getStepsCompleted(), 1u);  // min over ranks
    EXPECT_EQ(m.r.getStages()[1].getLastStep(), 2u);
    EXPECT_EQ(m.r.getStages()[2].getLastStep(), 1u);
    EXPECT_EQ(s(m.r.getStages()[1].getLastRecordAt()), rfc3339(kWallBase + 2000'000'000));
  }
  run.step(1, 2);
  run.step(0, 3);
  run.step(1, 3);
  run.checkpoint(2, 2500);
  run.finished(StageKind::TRAINER, 0, 5000);
  run.finished(StageKind::TRAINER, 1, 5000);
  run.child_exited(StageKind::TRAINER, 0, 5100, 0, 0);
  run.child_exited(StageKind::TRAINER, 1, 5100, 0, 0);
  run.run_finished(6000, true);
  EXPECT_TRUE(c.poll());
  c.write();
  {
    Parsed<schema::Manifest> m(c.outputs().at("manifest.json"));
    EXPECT_EQ(m.r.getState(), schema::RunState::OK);
    EXPECT_EQ(s(m.r.getCompletedAt()), rfc3339(kWallBase + 6000'000'000));
    EXPECT_EQ(s(m.r.getLastPolledAt()), rfc3339(kWallBase + 6000'000'000));
    EXPECT_FALSE(m.r.hasError());
    EXPECT_EQ(m.r.getStepsCompleted(), 3u);
    EXPECT_EQ(s(m.r.getLatestCheckpoint()), "checkpoints/step_00000002");
    EXPECT_EQ(m.r.getLatestCheckpointStep(), 2u);
    EXPECT_EQ(s(m.r.getStages()[1].getState()), "finished");
    EXPECT_EQ(s(m.r.getStages()[3].getState()), "started");  // checkpointer never reported back
    ASSERT_EQ(m.r.getReceipts().size(), 5u);
    EXPECT_EQ(s(m.r.getReceipts()[0]), "bench_result.json");
    EXPECT_EQ(s(m.r.getReceipts()[1]), "bench_telemetry.json");
    EXPECT_EQ(s(m.r.getReceipts()[2]), "backend_identity.json");
    EXPECT_EQ(s(m.r.getReceipts()[3]), "runtime_provenance.json");
    EXPECT_EQ(s(m.r.getReceipts()[4]), "first_forward.json");
    auto journals = m.r.getJournals();
    ASSERT_EQ(journals.size(), 4u);  // sorted file names
    EXPECT_EQ(s(journals[0].getName()), "checkpointer-0.journal");
    EXPECT_EQ(s(journals[1].getName()), "supervisor-0.journal");
    EXPECT_EQ(s(journals[2].getName()), "trainer-0.journal");
    EXPECT_EQ(journals[2].getRecords(), 6u);
    EXPECT_EQ(journals[2].getTornBytes(), 0u);
  }
  EXPECT_EQ(read_file(layout::manifest_path(run.run())), c.outputs().at("manifest.json"));
  EXPECT_TRUE(fs::exists(layout::receipts_dir(run.run()) / "bench_result.json"));
  EXPECT_TRUE(fs::exists(layout::receipts_dir(run.run()) / "bench_telemetry.json"));

  // The live fold and a one-shot re-collect of the same journals agree byte for byte.
  c.finish();
  auto live = c.outputs();
  Collector once(run.run());
  once.poll();
  once.finish();
  EXPECT_EQ(once.outputs(), live);
}

TEST(Collector, BenchResultAndTelemetryNumbers) {
  FakeRun run;
  run.whole_run();
  collect_run(run.run());
  schemas::JsonFile<schema::BenchResult> r(layout::receipts_dir(run.run()) / "bench_result.json");
  auto b = r.get();
  EXPECT_EQ(s(b.getRunId()), "run-test");
  EXPECT_EQ(s(b.getRecipe()), "tiny");
  EXPECT_EQ(b.getWorld(), 2u);
  EXPECT_EQ(b.getSteps(), 3u);
  EXPECT_DOUBLE_EQ(b.getTokens(), 600.0);
  EXPECT_DOUBLE_EQ(b.getFirstLoss(), (3.5 + 3.75) / 2);
  EXPECT_DOUBLE_EQ(b.getLastLoss(), (2.5 + 2.75) / 2);
  // Rank 0's step 1 ends at 1.0 s after 1.0 s of work: starts at 0; the last record (rank 1,
  // step 3) lands at 3.1 s.
  EXPECT_DOUBLE_EQ(b.getWallSeconds(), 3.1);
  EXPECT_DOUBLE_EQ(b.getTokensPerSecond(), 600.0 / 3.1);
  EXPECT_DOUBLE_EQ(b.getMeanStepSeconds(), 1.0);

  schemas::JsonFile<schema::BenchTelemetry> t(layout::receipts_dir(run.run()) /
                                              "bench_telemetry.json");
  auto bt = t.get();
  ASSERT_EQ(bt.getSteps().size(), 3u);
  for (uint32_t i = 0; i < 3; ++i) {
    auto p = bt.getSteps()[i];
    EXPECT_EQ(p.getStep(), i + 1);
    EXPECT_DOUBLE_EQ(p.getLoss(), 4.0 - 0.5 * (i + 1) + 0.125);
    EXPECT_DOUBLE_EQ(p.getStepSeconds(), 1.0);
    EXPECT_DOUBLE_EQ(p.getWaitSeconds(), 0.25);
  }
  ASSERT_EQ(bt.getFirstForwardSeconds().size(), 2u);
  EXPECT_DOUBLE_EQ(bt.getFirstForwardSeconds()[0], 0.5);
  EXPECT_DOUBLE_EQ(bt.getFirstForwardSeconds()[1], 0.75);
  EXPECT_FALSE(bt.getTelemetryTruncated());

  schemas::JsonFile<schema::Manifest> m(layout::manifest_path(run.run()));
  EXPECT_EQ(m.get().getState(), schema::RunState::OK);
  EXPECT_EQ(s(m.get().getStages()[3].getState()), "finished");
  EXPECT_EQ(m.get().getStages()[3].getExitCode(), 0);
}

TEST(Collector, ErrorPathWithTypedErrorAndMinStepRule) {
  FakeRun run;
  run.supervisor_start();
  run.run_started();
  for (uint32_t r = 0; r < 2; ++r) run.trainer_start(r);
  for (uint32_t st = 1; st <= 3; ++st) run.step(0, st);
  for (uint32_t st = 1; st <= 2; ++st) run.step(1, st);
  run.child_exited(StageKind::TRAINER, 1, 3500, -1, 9);
  run.run_finished(3600, false, "signaled", StageKind::TRAINER, 1, "trainer-1 killed by signal 9");
  collect_run(run.run());

  schemas::JsonFile<schema::Manifest> doc(layout::manifest_path(run.run()));
  auto m = doc.get();
  EXPECT_EQ(m.getState(), schema::RunState::ERROR);
  ASSERT_TRUE(m.hasError());
  EXPECT_EQ(s(m.getError().getKind()), "signaled");
  EXPECT_EQ(m.getError().getStage(), StageKind::TRAINER);
  EXPECT_EQ(m.getError().getRank(), 1u);
  EXPECT_EQ(s(m.getError().getMessage()), "trainer-1 killed by signal 9");
  EXPECT_EQ(m.getStepsCompleted(), 2u);
  auto t1 = m.getStages()[2];
  EXPECT_EQ(t1.getStage(), StageKind::TRAINER);
  EXPECT_EQ(t1.getRank(), 1u);
  EXPECT_EQ(s(t1.getState()), "signaled");
  EXPECT_EQ(t1.getSignal(), 9);
  EXPECT_EQ(t1.getExitCode(), -1);
  EXPECT_EQ(t1.getLastStep(), 2u);
  EXPECT_EQ(s(m.getStages()[1].getState()), "started");
  EXPECT_FALSE(m.hasLatestCheckpoint());
  EXPECT_EQ(m.getReceipts().size(), 5u);

  schemas::JsonFile<schema::BenchResult> r(layout::receipts_dir(run.run()) / "bench_result.json");
  EXPECT_EQ(r.get().getSteps(), 2u);
  EXPECT_DOUBLE_EQ(r.get().getTokens(), 500.0);  // every step record counts
  EXPECT_DOUBLE_EQ(r.get().getLastLoss(), (3.0 + 3.25) / 2);
  schemas::JsonFile<schema::BenchTelemetry> t(layout::receipts_dir(run.run()) /
                                              "bench_telemetry.json");
  EXPECT_TRUE(t.get().getTelemetryTruncated());  // rank 1 stops short of rank 0
  EXPECT_EQ(t.get().getSteps().size(), 3u);
}

// A rank that left early and still exited 0 (a stray SIGTERM) makes the supervisor's
// runFinished(ok) a lie; the fold compares completed with planned steps and says so.
TEST(Collector, OkRequiresEveryPlannedStep) {
  FakeRun run;
  run.supervisor_start();
  run.run_started();
  for (uint32_t r = 0; r < 2; ++r) run.trainer_start(r);
  for (uint32_t st = 1; st <= 3; ++st) run.step(0, st);
  for (uint32_t st = 1; st <= 2; ++st) run.step(1, st);
  for (uint32_t r = 0; r < 2; ++r) {
    run.finished(StageKind::TRAINER, r, 5000);
    run.child_exited(StageKind::TRAINER, r, 5100, 0, 0);
  }
  run.run_finished(6000, true);
  collect_run(run.run());

  schemas::JsonFile<schema::Manifest> doc(layout::manifest_path(run.run()));
  auto m = doc.get();
  EXPECT_EQ(m.getStepsCompleted(), 2u);
  EXPECT_EQ(m.getStepsPlanned(), 3u);
  EXPECT_EQ(m.getState(), schema::RunState::ERROR);
  ASSERT_TRUE(m.hasError());
  EXPECT_EQ(s(m.getError().getKind()), "incomplete");
  EXPECT_EQ(s(m.getError().getMessage()), "the run finished with 2 of 3 planned steps completed");

  // The same journals with every planned step are ok.
  FakeRun whole;
  whole.whole_run(3);
  collect_run(whole.run());
  schemas::JsonFile<schema::Manifest> ok(layout::manifest_path(whole.run()));
  EXPECT_EQ(ok.get().getState(), schema::RunState::OK);
  EXPECT_FALSE(ok.get().hasError() && s(ok.get().getError().getKind()).size() > 0);
}

// A child the supervisor gave up on after SIGKILL was never reaped: its state says so
// instead of "started", and a later exit of the same generation (a late reap) wins.
TEST(Collector, UnkillableChildIsNamed) {
  FakeRun run;
  run.supervisor_start();
  run.run_started();
  run.child_exited(StageKind::TRAINER, 1, 3500, -1, 9);
  auto unkillable = [&](StageKind stage, int64_t t_ms) {
    run.rec(StageKind::SUPERVISOR, 0, t_ms, [&](auto r) {
      auto c = r.initChildUnkillable();
      c.setStage(stage);
      c.setRank(0);
      c.setPid(FakeRun::pid(stage, 0));
      c.setChildReason(schema::ChildReason::SURVIVED_KILL);
    });
  };
  unkillable(StageKind::CHECKPOINTER, 3700);
  unkillable(StageKind::TRAINER, 3700);
  run.child_exited(StageKind::TRAINER, 0, 3800, -1, 9);
  run.run_finished(3900, false, "signaled", StageKind::TRAINER, 1, "trainer-1 killed");
  collect_run(run.run());
  schemas::JsonFile<schema::Manifest> doc(layout::manifest_path(run.run()));
  std::map<std::string, std::string> states;
  for (auto st : doc.get().getStages())
    states[layout::process_name(st.getStage(), st.getRank())] = s(st.getState());
  EXPECT_EQ(states["checkpointer-0"], "unkillable");
  EXPECT_EQ(states["trainer-0"], "signaled");
  EXPECT_EQ(states["trainer-1"], "signaled");
}

// A restart is a childStarted whose reason is restart: counted, with its cause, on the
// stage. A journal written before ChildReason existed says so in the text field `note`.
TEST(Collector, RestartsAreCountedByTheirReason) {
  for (bool old_journal : {false, true}) {
    FakeRun run;
    run.whole_run(3);
    run.rec(StageKind::SUPERVISOR, 0, 5500, [&](auto r) {
      auto c = r.initChildStarted();
      c.setStage(StageKind::COLLECTOR);
      c.setRank(0);
      c.setPid(FakeRun::pid(StageKind::COLLECTOR, 0) + 1);
      c.setGeneration(1);
      c.setCause("generation 0: hung");
      if (old_journal) {
        c.setNote("restart");
      } else {
        c.setChildReason(schema::ChildReason::RESTART);
      }
    });
    collect_run(run.run());
    schemas::JsonFile<schema::Manifest> doc(layout::manifest_path(run.run()));
    bool seen = false;
    for (auto st : doc.get().getStages()) {
      if (st.getStage() != StageKind::COLLECTOR) {
        EXPECT_EQ(st.getRestarts(), 0u);
        continue;
      }
      seen = true;
      EXPECT_EQ(st.getRestarts(), 1u) << (old_journal ? "note" : "childReason");
      ASSERT_EQ(st.getRestartCauses().size(), 1u);
      EXPECT_EQ(s(st.getRestartCauses()[0]), "generation 0: hung");
    }
    EXPECT_TRUE(seen);
  }
}

// detectionSeconds is a measurement only when the evidence time is the cause's: for a death
// the supervisor knows only the reap time, and the manifest says the delay is not measured.
TEST(Collector, DetectionOfADeathIsMarkedNotMeasured) {
  for (bool unmeasured : {false, true}) {
    FakeRun run;
    run.supervisor_start();
    run.run_started();
    run.rec(StageKind::SUPERVISOR, 0, 3600, [&](auto r) {
      auto f = r.initFailureObserved();
      f.setStage(StageKind::TRAINER);
      f.setRank(1);
      f.setFailureKind(unmeasured ? schema::FailureKind::SIGNALED
                                  : schema::FailureKind::HEARTBEAT_LOST);
      f.setFailureRole(schema::FailureRole::FIRST_FAILURE);
      f.setEvidenceMonoNs(3000'000'000);
      f.setDetectedMonoNs(3500'000'000);
      f.setEvidenceUnmeasured(unmeasured);
    });
    run.run_finished(3700, false, unmeasured ? "signaled" : "heartbeat_lost", StageKind::TRAINER, 1,
                     "trainer-1");
    collect_run(run.run());
    schemas::JsonFile<schema::Manifest> doc(layout::manifest_path(run.run()));
    auto e = doc.get().getError();
    EXPECT_EQ(e.getDetectionMeasured(), !unmeasured);
    EXPECT_DOUBLE_EQ(e.getDetectionSeconds(), unmeasured ? 0.0 : 0.5);
  }
}

TEST(Collector, RecollectIsByteIdenticalAndDoesNotRewrite) {
  FakeRun run;
  run.whole_run();
  collect_run(run.run());
  const std::vector<fs::path> files = {layout::manifest_path(run.run()),
                                       layout::receipts_dir(run.run()) / "bench_result.json",
                                       layout::receipts_dir(run.run()) / "bench_telemetry.json"};
  std::vector<std::string> first;
  std::vector<ino_t> inodes;
  for (const auto& f : files) {
    first.push_back(read_file(f));
    struct stat st {};
    ASSERT_EQ(::stat(f.c_str(), &st), 0);
    inodes.push_back(st.st_ino);
  }
  collect_run(run.run());
  for (size_t i = 0; i < files.size(); ++i) {
    EXPECT_EQ(read_file(files[i]), first[i]) << files[i];
    struct stat st {};
    ASSERT_EQ(::stat(files[i].c_str(), &st), 0);
    EXPECT_EQ(st.st_ino, inodes[i]) << files[i] << " was rewritten";
  }
  // A removed receipt is restored, identical.
  fs::remove(files[1]);
  collect_run(run.run());
  EXPECT_EQ(read_file(files[1]), first[1]);
  // No stray temporaries.
  for (const auto& e : fs::recursive_directory_iterator(run.run())) {
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  }
}

TEST(Collector, TornTrainerTailMarksTelemetryTruncated) {
  FakeRun run;
  run.whole_run();
  // A frame cut off mid-write at the end of trainer-1's journal.
  const fs::path j1 = layout::journal_path(run.run(), StageKind::TRAINER, 1);
  std::string bytes = read_file(j1);
  const size_t cut = 40;  // header (16) + part of a payload
  {
    std::ofstream out(j1, std::ios::app | std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(cut));
  }
  Collector live(run.run());
  live.poll();
  {
    // Before finish() the partial frame may still be completed by the writer: not torn yet.
    Parsed<schema::Manifest> m(live.outputs().at("manifest.json"));
    EXPECT_EQ(m.r.getJournals()[3].getTornBytes(), 0u);
  }
  live.finish();
  Parsed<schema::Manifest> m(live.outputs().at("manifest.json"));
  auto j = m.r.getJournals()[3];
  EXPECT_EQ(s(j.getName()), "trainer-1.journal");
  EXPECT_EQ(j.getTornBytes(), cut);
  EXPECT_EQ(j.getRecords(), 6u);
  EXPECT_EQ(m.r.getStepsCompleted(), 3u);
  Parsed<schema::BenchTelemetry> t(live.outputs().at("receipts/bench_telemetry.json"));
  EXPECT_TRUE(t.r.getTelemetryTruncated());

  collect_run(run.run());
  EXPECT_EQ(read_file(layout::manifest_path(run.run())), live.outputs().at("manifest.json"));
}

TEST(Collector, MissingLaunchContractThrows) {
  TempDir dir;
  EXPECT_THROW(collect_run(dir.path()), Error);
}

// The megacpp-collector process folds a finished run, and stops cleanly on SIGTERM.
TEST(CollectorProcess, FoldsLiveAndStopsOnSigterm) {
  using namespace std::chrono_literals;
  const fs::path exe = fs::read_symlink("/proc/self/exe").parent_path() / "megacpp-collector";
  if (!fs::exists(exe)) GTEST_SKIP() << exe << " is not built";
  FakeRun run;
  run.supervisor_start();
  run.run_started();
  ipc::ZmqContext zmq;
  ipc::Channel supervisor(zmq, ipc::Channel::Kind::kRouter, run.control_endpoint());

  fs::create_directories(layout::logs_dir(run.run()));
  const fs::path log = layout::log_path(run.run(), StageKind::COLLECTOR, 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> args = {exe.string(), "--run-dir", run.run().string()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  ASSERT_EQ(::posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);

  // Bounded waits for what the live collector writes (never a timing assertion).
  auto wait_for_state = [&](schema::RunState state) {
    const auto deadline = std::chrono::steady_clock::now() + 15s;
    while (std::chrono::steady_clock::now() < deadline) {
      try {
        schemas::JsonFile<schema::Manifest> m(layout::manifest_path(run.run()));
        if (m.get().getState() == state) return true;
      } catch (const Error&) {
        // not written yet
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  };
  EXPECT_TRUE(wait_for_state(schema::RunState::RUNNING)) << read_file(log);
  for (uint32_t r = 0; r < 2; ++r) run.trainer_start(r);
  for (uint32_t st = 1; st <= 3; ++st) {
    for (uint32_t r = 0; r < 2; ++r) run.step(r, st);
  }
  run.run_finished(6000, true);
  EXPECT_TRUE(wait_for_state(schema::RunState::OK)) << read_file(log);

  ::kill(pid, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ADD_FAILURE() << "collector did not stop";
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_file(log);

  // The receipts do not depend on the collector's own journal: a re-collect leaves them as
  // the live collector wrote them.
  const fs::path result = layout::receipts_dir(run.run()) / "bench_result.json";
  const std::string live = read_file(result);
  collect_run(run.run());
  EXPECT_EQ(read_file(result), live);
  schemas::JsonFile<schema::Manifest> m(layout::manifest_path(run.run()));
  bool saw_collector = false;
  for (auto st : m.get().getStages()) {
    if (st.getStage() == StageKind::COLLECTOR) {
      saw_collector = true;
      EXPECT_EQ(s(st.getState()), "finished");
    }
  }
  EXPECT_TRUE(saw_collector);
}

}  // namespace
}  // namespace megacpp::collector
