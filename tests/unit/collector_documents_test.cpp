// megacpp::collector's document functions (stages/collector/detail/documents.h) on a scripted
// fold state: records folded one by one from memory, journal counts set by hand, no run
// directory read. Each test asserts the fields its document owns; the first, that the run's
// identity reads the same in the manifest and in every receipt.
#include <gtest/gtest.h>

#include <capnp/message.h>
#include <fmt/format.h>

#include <functional>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "core/util.h"
#include "schemas/journal.capnp.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"
#include "stages/collector/detail/documents.h"
#include "stages/collector/detail/fold_state.h"

namespace megacpp::collector::detail {
namespace {

namespace fs = std::filesystem;
using schema::StageKind;

constexpr int64_t kWallBase = 1'700'000'000'000'000'000;  // 2023-11-14T22:13:20Z

std::string s(capnp::Text::Reader t) {
  return std::string(t.cStr(), t.size());
}

template <typename T>
struct Parsed {
  explicit Parsed(const std::string& text) : doc(text, "test"), r(doc.get()) {}
  schemas::JsonDocument<T> doc;
  typename T::Reader r;
};

struct LaunchFacts {
  uint32_t world = 2;
  uint32_t steps = 3;
  uint32_t attempt = 1;  // a job restart from scratch: the identity's attempt is not 0
  std::string device = "cuda";
  bool placed = false;         // the contract records a placement (Slurm's, one node)
  bool placed_single = false;  // ... a placement by nothing: empty host, no hosts
  bool evaluates = false;      // the contract has a validation set: every 2 steps, 8 windows of 16
};

// A fold state fed from memory: launch.json's contract, then records with chosen timestamps
// (t in ms), all of the launch's attempt.
class Script {
 public:
  explicit Script(const LaunchFacts& f = {}) : facts_(f) {
    capnp::MallocMessageBuilder message;
    auto l = message.initRoot<schema::LaunchContract>();
    l.setSchemaVersion(schema::SCHEMA_VERSION);
    l.setRunId("run-docs");
    l.setCreatedAt(rfc3339(kWallBase));
    l.setWorld(f.world);
    l.setSteps(f.steps);
    l.setAttempt(f.attempt);
    l.setDevice(f.device);
    l.getRecipe().setName("tiny");
    l.getRecipe().setHash("feedface01234567");
    l.getRecipe().setPattern("AA");
    l.getRecipe().initModel().setNLayers(2);
    auto argv = l.initArgv(2);
    argv.set(0, "megacpp");
    argv.set(1, "run");
    auto p = l.initProvenance();
    p.setGitRevision("0badc0de");
    p.setHostname("node-7");
    p.setKernel("Linux 6.1");
    p.setCpuModel("Test CPU");
    p.setCpuCount(16);
    l.initDataset().setFormat("llmc");
    if (f.evaluates) {
      l.getRecipe().getModel().setSeqLen(16);
      auto v = l.initValidation();
      v.setEvery(2);
      v.setWindows(8);
      v.setSplitWindows(100);
      v.initDataset().setFormat("llmc");
      v.setRingSlots(2);
      v.setDigest("0123456789abcdef");
    }
    if (f.placed_single) {
      auto place = l.initPlacement();
      place.setSource("single");
      place.setNodes(1);
      place.setMasterHost("");
      place.initHosts(0);
      place.setJobId("");
      place.setIface("");
      place.setNodesFrom("");
    }
    if (f.placed) {
      auto place = l.initPlacement();
      place.setSource("slurm");
      place.setNodes(1);
      place.setNodeRank(0);
      place.setMasterHost("gpu17");
      place.setMasterPort(29500);
      place.initHosts(1).set(0, "gpu17");
      place.setJobId("4242");
      place.setAttempt(2);
      place.setIface("ib0");
      place.setNodesFrom("SLURM_NNODES=1");
    }
    state.read_launch(l.asReader());
  }

  using Fill = std::function<void(schema::JournalRecord::Builder)>;
  void rec(StageKind stage, uint32_t rank, int64_t t_ms, const Fill& fill) {
    capnp::MallocMessageBuilder message;
    auto r = message.initRoot<schema::JournalRecord>();
    r.setSchemaVersion(schema::SCHEMA_VERSION);
    r.setMonoNs(t_ms * 1'000'000);
    r.setWallNs(kWallBase + t_ms * 1'000'000);
    r.setStage(stage);
    r.setRank(rank);
    r.setPid(1000 + static_cast<int32_t>(rank));
    r.setAttempt(facts_.attempt);
    fill(r);
    state.fold(r.asReader());
  }

  // The supervisor starts both ranks at t = 1 ms (the attempt's launch); rank r joins its
  // groups at 1001 + 2000 r ms (its process started 500 ms before), does its first forward at
  // 2001 + 2000 r and first backward at 3001 + 2000 r; steps s end at 1000 s + 100 r + 5000
  // ms; step 2 is checkpointed; the run finishes at 20 s.
  void whole_run() {
    for (uint32_t r = 0; r < facts_.world; ++r) {
      rec(StageKind::SUPERVISOR, 0, 1, [&](auto x) {
        auto c = x.initChildStarted();
        c.setStage(StageKind::TRAINER);
        c.setRank(r);
        c.setPid(1000 + static_cast<int32_t>(r));
      });
    }
    rec(StageKind::SUPERVISOR, 0, 2, [&](auto x) { x.initRunStarted().setWorld(facts_.world); });
    for (uint32_t r = 0; r < facts_.world; ++r) {
      const int64_t lag = 2000 * r;
      rec(StageKind::TRAINER, r, 1001 + lag,
          [&](auto x) { x.initRendezvousDone().setSeconds(0.5); });
      rec(StageKind::TRAINER, r, 1002 + lag, [&](auto x) {
        auto b = x.initBackendIdentity();
        b.setBackend("gloo");
        b.setThreads(4 + r);
      });
      rec(StageKind::TRAINER, r, 2001 + lag,
          [&](auto x) { x.initFirstForward().setSeconds(1.5 + r); });
      rec(StageKind::TRAINER, r, 3001 + lag,
          [&](auto x) { x.initFirstBackward().setSeconds(2.5); });
    }
    for (uint32_t st = 1; st <= facts_.steps; ++st) {
      for (uint32_t r = 0; r < facts_.world; ++r) step(r, st);
      if (st == 2) {
        rec(StageKind::CHECKPOINTER, 0, 7600, [&](auto x) {
          auto c = x.initCheckpointCommitted();
          c.setStep(2);
          c.setPath("checkpoints/" + layout::checkpoint_dir_name(2));
        });
      }
    }
    rec(StageKind::SUPERVISOR, 0, 20000, [](auto x) { x.initRunFinished().setOk(true); });
    state.journals["supervisor-0.journal"] = {.records = 5, .torn_bytes = 0, .trainer = false};
    state.journals["trainer-0.journal"] = {.records = 7, .torn_bytes = 0, .trainer = true};
    state.journals["trainer-1.journal"] = {.records = 7, .torn_bytes = 0, .trainer = true};
  }
  // Rank r's step s: loss 4 - 0.5 s + 0.25 r, 100 tokens, 1 s (rank 0) or 0.75 s of work; host
  // memory peak 100 + 10 s + r MiB with 20 MiB of file pages over a 50 MiB baseline with 10;
  // device memory 1 + s + 2 r GiB held by tensors, 0.5 GiB more reserved.
  void step(uint32_t r, uint32_t st) {
    rec(StageKind::TRAINER, r, 5000 + 1000 * st + 100 * r, [&](auto x) {
      auto p = x.initStep();
      p.setStep(st);
      p.setLoss(static_cast<float>(4.0 - 0.5 * st + 0.25 * r));
      p.setTokens(100);
      p.setStepSeconds(r == 0 ? 1.0 : 0.75);
      p.setWaitSeconds(0.125 * (r + 1));
      p.setMemoryPeak(uint64_t{100 + 10 * st + r} << 20);
      p.setMemoryFile(uint64_t{20} << 20);
      p.setMemoryBaseline(uint64_t{50} << 20);
      p.setMemoryBaselineFile(uint64_t{10} << 20);
      p.setDeviceMemoryPeak(uint64_t{1 + st + 2 * r} << 30);
      p.setDeviceMemoryReserved((uint64_t{1 + st + 2 * r} << 30) + (uint64_t{1} << 29));
    });
  }

  FoldState state;

 private:
  LaunchFacts facts_;
};

// The identity each document carries, field by field, where its schema has the field.
TEST(CollectorDocuments, RunIdentityIsTheSameInEveryDocument) {
  Script run;
  run.whole_run();
  const RunIdentity& id = run.state.run;
  EXPECT_EQ(id.run_id, "run-docs");
  EXPECT_EQ(id.recipe, "tiny");
  EXPECT_EQ(id.recipe_hash, "feedface01234567");
  EXPECT_EQ(id.world, 2u);
  EXPECT_EQ(id.attempt, 1u);
  EXPECT_EQ(id.device, "cuda");
  EXPECT_FALSE(id.mode.empty());
  EXPECT_FALSE(id.blocks.empty());
  EXPECT_EQ(s(id.build().getGitRevision()), "0badc0de");

  const RunView v = view_of(run.state);
  Parsed<schema::Manifest> m(manifest_document(run.state, v, fs::path("/nonexistent")));
  Parsed<schema::BenchResult> br(bench_result_document(run.state, v));
  Parsed<schema::BenchTelemetry> bt(bench_telemetry_document(run.state, v));
  Parsed<schema::BackendIdentityReceipt> bi(backend_identity_document(run.state, v));
  Parsed<schema::RuntimeProvenance> rp(runtime_provenance_document(run.state, v));
  Parsed<schema::FirstForwardReceipt> ff(first_forward_document(run.state, v));

  for (const auto& [name, version, run_id] :
       {std::tuple{"manifest", m.r.getSchemaVersion(), s(m.r.getRunId())},
        std::tuple{"bench_result", br.r.getSchemaVersion(), s(br.r.getRunId())},
        std::tuple{"bench_telemetry", bt.r.getSchemaVersion(), s(bt.r.getRunId())},
        std::tuple{"backend_identity", bi.r.getSchemaVersion(), s(bi.r.getRunId())},
        std::tuple{"runtime_provenance", rp.r.getSchemaVersion(), s(rp.r.getRunId())},
        std::tuple{"first_forward", ff.r.getSchemaVersion(), s(ff.r.getRunId())}}) {
    EXPECT_EQ(version, schema::SCHEMA_VERSION) << name;
    EXPECT_EQ(run_id, id.run_id) << name;
  }
  // Recipe and hash.
  for (const auto& [recipe, hash] : {std::pair{s(m.r.getRecipe()), s(m.r.getRecipeHash())},
                                     std::pair{s(br.r.getRecipe()), s(br.r.getRecipeHash())},
                                     std::pair{s(rp.r.getRecipe()), s(rp.r.getRecipeHash())}}) {
    EXPECT_EQ(recipe, id.recipe);
    EXPECT_EQ(hash, id.recipe_hash);
  }
  // World, mode and blocks: the comparison class of the figures.
  EXPECT_EQ(m.r.getWorld(), id.world);
  EXPECT_EQ(br.r.getWorld(), id.world);
  EXPECT_EQ(s(m.r.getMode()), id.mode);
  EXPECT_EQ(s(br.r.getMode()), id.mode);
  EXPECT_EQ(s(m.r.getBlocks()), id.blocks);
  EXPECT_EQ(s(br.r.getBlocks()), id.blocks);
  // The attempt.
  EXPECT_EQ(m.r.getAttempt(), id.attempt);
  EXPECT_EQ(rp.r.getAttempt(), id.attempt);
  EXPECT_EQ(ff.r.getAttempt(), id.attempt);
  ASSERT_EQ(bi.r.getRanks().size(), id.world);
  for (auto rank : bi.r.getRanks()) EXPECT_EQ(rank.getAttempt(), id.attempt);
  // The device and the build.
  EXPECT_EQ(s(br.r.getDevice()), id.device);
  EXPECT_EQ(s(rp.r.getDevice()), id.device);
  EXPECT_EQ(s(bi.r.getBuild().getGitRevision()), "0badc0de");
}

// launch.json without a device: every document that names one says "cpu".
TEST(CollectorDocuments, DeviceDefaultsToCpu) {
  Script run({.device = ""});
  run.whole_run();
  EXPECT_EQ(run.state.run.device, "cpu");
  const RunView v = view_of(run.state);
  EXPECT_EQ(s(Parsed<schema::BenchResult>(bench_result_document(run.state, v)).r.getDevice()),
            "cpu");
  EXPECT_EQ(
      s(Parsed<schema::RuntimeProvenance>(runtime_provenance_document(run.state, v)).r.getDevice()),
      "cpu");
}

TEST(CollectorDocuments, ManifestOwnsStateProgressCheckpointAndJournals) {
  Script run;
  run.whole_run();
  const RunView v = view_of(run.state);
  EXPECT_TRUE(v.terminal);
  EXPECT_FALSE(v.short_of_plan);
  Parsed<schema::Manifest> m(manifest_document(run.state, v, fs::path("/nonexistent")));
  EXPECT_EQ(m.r.getState(), schema::RunState::OK);
  EXPECT_EQ(m.r.getStepsPlanned(), 3u);
  EXPECT_EQ(m.r.getStepsCompleted(), 3u);
  EXPECT_EQ(s(m.r.getLaunchedAt()), rfc3339(kWallBase));
  EXPECT_EQ(s(m.r.getRunningAt()), rfc3339(kWallBase + 2'000'000));
  EXPECT_EQ(s(m.r.getCompletedAt()), rfc3339(kWallBase + 20'000'000'000));
  EXPECT_EQ(s(m.r.getLatestCheckpoint()), "checkpoints/" + layout::checkpoint_dir_name(2));
  EXPECT_EQ(m.r.getLatestCheckpointStep(), 2u);
  // Attempt 0 (never journaled here) and the current attempt 1.
  ASSERT_EQ(m.r.getAttempts().size(), 2u);
  EXPECT_EQ(m.r.getAttempts()[1].getState(), schema::RunState::OK);
  EXPECT_EQ(m.r.getAttempts()[1].getLastStep(), 3u);
  // The journals as the Collector counted them, sorted by name.
  ASSERT_EQ(m.r.getJournals().size(), 3u);
  EXPECT_EQ(s(m.r.getJournals()[0].getName()), "supervisor-0.journal");
  EXPECT_EQ(m.r.getJournals()[0].getRecords(), 5u);
  EXPECT_EQ(s(m.r.getJournals()[2].getName()), "trainer-1.journal");
  EXPECT_EQ(m.r.getJournals()[2].getRecords(), 7u);
  // Every process that spoke, sorted by (stage, rank).
  std::set<std::pair<StageKind, uint32_t>> stages;
  for (auto st : m.r.getStages()) stages.emplace(st.getStage(), st.getRank());
  EXPECT_EQ(stages, (std::set<std::pair<StageKind, uint32_t>>{{StageKind::SUPERVISOR, 0},
                                                              {StageKind::TRAINER, 0},
                                                              {StageKind::TRAINER, 1},
                                                              {StageKind::CHECKPOINTER, 0}}));
}

// A run that finished "ok" short of its planned steps is an error the manifest names.
TEST(CollectorDocuments, ManifestEarnsOkOnlyWithEveryPlannedStep) {
  Script run;
  run.state.steps_planned = 4;  // the plan says 4; every rank trains 3 and the run ends ok
  run.whole_run();
  const RunView v = view_of(run.state);
  EXPECT_EQ(v.completed, 3u);
  EXPECT_TRUE(v.short_of_plan);
  Parsed<schema::Manifest> m(manifest_document(run.state, v, fs::path("/nonexistent")));
  EXPECT_EQ(m.r.getState(), schema::RunState::ERROR);
  EXPECT_EQ(m.r.getError().getKind(), schema::FailureKind::INCOMPLETE);
  EXPECT_EQ(s(m.r.getError().getMessage()), "the run finished with 3 of 4 planned steps completed");
}

// The manifest lists exactly the receipts render_documents writes, and only once terminal.
TEST(CollectorDocuments, ManifestListsTheReceiptsThatAreWritten) {
  Script running;
  running.rec(StageKind::SUPERVISOR, 0, 2, [](auto x) { x.initRunStarted().setWorld(2); });
  {
    const auto docs = render_documents(running.state, fs::path("/nonexistent"));
    ASSERT_EQ(docs.size(), 1u);
    Parsed<schema::Manifest> m(docs.at("manifest.json"));
    EXPECT_EQ(m.r.getState(), schema::RunState::RUNNING);
    EXPECT_EQ(m.r.getReceipts().size(), 0u);
  }
  Script done;
  done.whole_run();
  const auto docs = render_documents(done.state, fs::path("/nonexistent"));
  Parsed<schema::Manifest> m(docs.at("manifest.json"));
  std::set<std::string> listed{"manifest.json"};
  for (auto name : m.r.getReceipts()) listed.insert("receipts/" + s(name));
  std::set<std::string> written;
  for (const auto& [path, bytes] : docs) written.insert(path);
  EXPECT_EQ(listed, written);
  EXPECT_EQ(written, (std::set<std::string>{
                         "manifest.json", "receipts/bench_result.json",
                         "receipts/bench_telemetry.json", "receipts/backend_identity.json",
                         "receipts/runtime_provenance.json", "receipts/first_forward.json"}));
}

TEST(CollectorDocuments, BenchResultOwnsTheRunFigures) {
  Script run;
  run.whole_run();
  Parsed<schema::BenchResult> b(bench_result_document(run.state, view_of(run.state)));
  EXPECT_EQ(b.r.getSteps(), 3u);
  EXPECT_DOUBLE_EQ(b.r.getTokens(), 600.0);
  EXPECT_DOUBLE_EQ(b.r.getFirstLoss(), (3.5 + 3.75) / 2);
  EXPECT_DOUBLE_EQ(b.r.getLastLoss(), (2.5 + 2.75) / 2);
  // Rank 0's step 1 ends at 6.0 s after 1 s of work (starts at 5.0 s); the last end is rank
  // 1's step 3 at 8.1 s.
  EXPECT_DOUBLE_EQ(b.r.getWallSeconds(), 3.1);
  EXPECT_DOUBLE_EQ(b.r.getTokensPerSecond(), 600.0 / 3.1);
  EXPECT_DOUBLE_EQ(b.r.getMeanStepSeconds(), 1.0);
  EXPECT_EQ(s(b.r.getDataset().getFormat()), "llmc");
  // Memory, the largest over the ranks: rank 1's step 3 — 131 MiB resident, (131 - 20) - (50 -
  // 10) above the baseline without file pages; 6 GiB of device memory in tensors, 6.5 reserved.
  ASSERT_TRUE(b.r.hasMemory());
  EXPECT_DOUBLE_EQ(b.r.getMemory().getPeak(), 131.0 * (1 << 20));
  EXPECT_DOUBLE_EQ(b.r.getMemory().getAboveBaseline(), 71.0 * (1 << 20));
  EXPECT_DOUBLE_EQ(b.r.getMemory().getDevicePeak(), 6.0 * (1 << 30));
  EXPECT_DOUBLE_EQ(b.r.getMemory().getDeviceReserved(), 6.5 * (1 << 30));
}

TEST(CollectorDocuments, BenchTelemetryOwnsTheSeriesAndTruncation) {
  Script run;
  run.whole_run();
  {
    Parsed<schema::BenchTelemetry> t(bench_telemetry_document(run.state, view_of(run.state)));
    ASSERT_EQ(t.r.getSteps().size(), 3u);
    for (uint32_t i = 0; i < 3; ++i) {
      auto p = t.r.getSteps()[i];
      EXPECT_EQ(p.getStep(), i + 1);
      EXPECT_DOUBLE_EQ(p.getLoss(), 4.0 - 0.5 * (i + 1) + 0.125);
      EXPECT_DOUBLE_EQ(p.getStepSeconds(), 1.0);
      EXPECT_DOUBLE_EQ(p.getWaitSeconds(), 0.25);
    }
    ASSERT_EQ(t.r.getFirstForwardSeconds().size(), 2u);
    EXPECT_DOUBLE_EQ(t.r.getFirstForwardSeconds()[0], 1.5);
    EXPECT_DOUBLE_EQ(t.r.getFirstForwardSeconds()[1], 2.5);
    EXPECT_FALSE(t.r.getTelemetryTruncated());
  }
  // A torn tail in a non-trainer journal leaves the series whole; in a trainer's it does not.
  run.state.journals["supervisor-0.journal"].torn_bytes = 12;
  EXPECT_FALSE(
      Parsed<schema::BenchTelemetry>(bench_telemetry_document(run.state, view_of(run.state)))
          .r.getTelemetryTruncated());
  run.state.journals["trainer-1.journal"].torn_bytes = 12;
  EXPECT_TRUE(
      Parsed<schema::BenchTelemetry>(bench_telemetry_document(run.state, view_of(run.state)))
          .r.getTelemetryTruncated());
}

// Held-out evaluations (journal Evaluation, every rank the same loss) fold into the telemetry's
// series, bench_result's and the manifest's last and best, and their time inside the training
// wall time is taken out of tokens/s: step 2's evaluation (slowest rank 0.3 s) ends before the
// last step; step 3's (the last) after it.
TEST(CollectorDocuments, HeldOutEvaluationsFoldIntoEveryDocument) {
  Script run(LaunchFacts{.evaluates = true});
  run.whole_run();
  const auto evaluation = [&](uint32_t rank, int64_t t_ms, uint32_t step, double loss,
                              double seconds) {
    run.rec(StageKind::TRAINER, rank, t_ms, [&](auto x) {
      auto e = x.initEvaluation();
      e.setStep(step);
      e.setLoss(loss);
      e.setTokens(128);
      e.setRankTokens(64);
      e.setSeconds(seconds);
      e.setWaitSeconds(0.01 * (rank + 1));
    });
  };
  for (uint32_t r = 0; r < 2; ++r) {
    evaluation(r, 7300 + r, 2, 2.9, r == 0 ? 0.2 : 0.3);
    evaluation(r, 8500 + r, 3, 3.1, 0.25);
  }
  const RunView v = view_of(run.state);
  Parsed<schema::BenchTelemetry> t(bench_telemetry_document(run.state, v));
  ASSERT_EQ(t.r.getEvaluations().size(), 2u);
  EXPECT_EQ(t.r.getEvaluations()[0].getStep(), 2u);
  EXPECT_DOUBLE_EQ(t.r.getEvaluations()[0].getLoss(), 2.9);
  EXPECT_DOUBLE_EQ(t.r.getEvaluations()[0].getTokens(), 128.0);
  EXPECT_DOUBLE_EQ(t.r.getEvaluations()[0].getSeconds(), 0.3);
  EXPECT_DOUBLE_EQ(t.r.getEvaluations()[0].getWaitSeconds(), 0.02);
  EXPECT_DOUBLE_EQ(t.r.getEvaluations()[1].getLoss(), 3.1);
  Parsed<schema::BenchResult> b(bench_result_document(run.state, v));
  EXPECT_DOUBLE_EQ(b.r.getWallSeconds(), 3.1);
  EXPECT_DOUBLE_EQ(b.r.getValidation().getTrainingSeconds(), 3.1 - 0.3);
  EXPECT_DOUBLE_EQ(b.r.getTokensPerSecond(), 600.0 / (3.1 - 0.3));
  Parsed<schema::Manifest> m(manifest_document(run.state, v, "/nonexistent"));
  for (const auto val : {b.r.getValidation(), m.r.getValidation()}) {
    EXPECT_DOUBLE_EQ(val.getLastLoss(), 3.1);
    EXPECT_EQ(val.getLastStep(), 3u);
    EXPECT_DOUBLE_EQ(val.getBestLoss(), 2.9);
    EXPECT_EQ(val.getBestStep(), 2u);
    EXPECT_EQ(val.getEvaluations(), 2u);
    EXPECT_DOUBLE_EQ(val.getTokens(), 128.0);
    EXPECT_DOUBLE_EQ(val.getSeconds(), 0.3 + 0.25);
    EXPECT_EQ(val.getEvery(), 2u);
    EXPECT_EQ(val.getWindows(), 8u);
    EXPECT_EQ(s(val.getDigest()), "0123456789abcdef");
    EXPECT_EQ(s(val.getOff()), "");
  }
  // Without a validation set the documents have none, and tokens/s is over the wall time.
  Script plain;
  plain.whole_run();
  Parsed<schema::BenchResult> pb(bench_result_document(plain.state, view_of(plain.state)));
  EXPECT_FALSE(pb.r.hasValidation());
  EXPECT_DOUBLE_EQ(pb.r.getTokensPerSecond(), 600.0 / 3.1);
}

TEST(CollectorDocuments, BackendIdentityOwnsEachRanksRecord) {
  Script run;
  run.whole_run();
  Parsed<schema::BackendIdentityReceipt> b(
      backend_identity_document(run.state, view_of(run.state)));
  ASSERT_EQ(b.r.getRanks().size(), 2u);
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(b.r.getRanks()[r].getRank(), r);
    EXPECT_EQ(s(b.r.getRanks()[r].getIdentity().getBackend()), "gloo");
    EXPECT_EQ(b.r.getRanks()[r].getIdentity().getThreads(), 4 + r);
  }
  EXPECT_EQ(s(b.r.getBuild().getHostname()), "node-7");
}

TEST(CollectorDocuments, RuntimeProvenanceCopiesTheLaunchContract) {
  Script run;
  run.whole_run();
  Parsed<schema::RuntimeProvenance> p(runtime_provenance_document(run.state, view_of(run.state)));
  ASSERT_EQ(p.r.getArgv().size(), 2u);
  EXPECT_EQ(s(p.r.getArgv()[1]), "run");
  EXPECT_EQ(s(p.r.getHostname()), "node-7");
  EXPECT_EQ(s(p.r.getKernel()), "Linux 6.1");
  EXPECT_EQ(s(p.r.getCpuModel()), "Test CPU");
  EXPECT_EQ(p.r.getCpuCount(), 16u);
  EXPECT_EQ(s(p.r.getDataset().getFormat()), "llmc");
}

// The node's place in its job (supervisor/placement.h) reaches the receipt as the launch
// contract recorded it; a contract from before the field gives a receipt without one.
TEST(CollectorDocuments, RuntimeProvenanceCarriesThePlacement) {
  Script run({.placed = true});
  run.whole_run();
  const std::string text = runtime_provenance_document(run.state, view_of(run.state));
  Parsed<schema::RuntimeProvenance> p(text);
  ASSERT_TRUE(p.r.hasPlacement()) << text;
  const auto place = p.r.getPlacement();
  EXPECT_EQ(s(place.getSource()), "slurm");
  EXPECT_EQ(place.getNodes(), 1u);
  EXPECT_EQ(place.getNodeRank(), 0u);
  EXPECT_EQ(s(place.getMasterHost()), "gpu17");
  EXPECT_EQ(place.getMasterPort(), 29500u);
  ASSERT_EQ(place.getHosts().size(), 1u);
  EXPECT_EQ(s(place.getHosts()[0]), "gpu17");
  EXPECT_EQ(s(place.getJobId()), "4242");
  EXPECT_EQ(place.getAttempt(), 2u);
  EXPECT_EQ(s(place.getIface()), "ib0");
  EXPECT_EQ(s(place.getNodesFrom()), "SLURM_NNODES=1");

  Script old;
  old.whole_run();
  const std::string before = runtime_provenance_document(old.state, view_of(old.state));
  EXPECT_FALSE(Parsed<schema::RuntimeProvenance>(before).r.hasPlacement());
  EXPECT_EQ(before.find("placement"), std::string::npos) << before;

  // Every key is written for a single node too (empty values, an empty list): the receipt's
  // key paths do not depend on the source (tests/golden/tiny_keys.json pins them).
  Script single({.placed_single = true});
  single.whole_run();
  const std::string one = runtime_provenance_document(single.state, view_of(single.state));
  for (const char* key : {"source", "nodes", "nodeRank", "masterHost", "masterPort", "hosts",
                          "jobId", "attempt", "iface", "nodesFrom"})
    EXPECT_NE(one.find(fmt::format("\"{}\"", key)), std::string::npos) << key << ": " << one;
}

// Seconds from the attempt's launch (its first childStarted, t = 1 ms) to each milestone.
TEST(CollectorDocuments, FirstForwardCountsFromTheLaunch) {
  Script run;
  run.whole_run();
  Parsed<schema::FirstForwardReceipt> f(first_forward_document(run.state, view_of(run.state)));
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
}

}  // namespace
}  // namespace megacpp::collector::detail
