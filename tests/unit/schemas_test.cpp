// schemas: the JSON form of durable documents (launch contract, manifest) and the run layout.
#include <capnp/message.h>
#include <capnp/schema.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "schemas/common.capnp.h"
#include "schemas/enums.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"

namespace megacpp {
namespace {

void fill_launch(schema::LaunchContract::Builder c) {
  c.setSchemaVersion(schema::SCHEMA_VERSION);
  c.setRunId("20250101-120000-abcd");
  c.setGeneration(2);
  c.setCreatedAt("2025-01-01T12:00:00.000Z");
  c.setRunDir("/data/runs/r1");
  c.setDataDir("/data/shards");
  c.setSockDir("/tmp/megacpp-r1");
  c.setShmPrefix("/megacpp-r1-g2-");
  c.setControlEndpoint("ipc:///tmp/megacpp-r1/control");
  c.setCheckpointEndpoint("ipc:///tmp/megacpp-r1/checkpoint");
  c.setStoreHost("127.0.0.1");
  c.setStorePort(29500);
  c.setWorld(2);
  c.setSteps(40);
  c.setRingSlots(4);
  c.setRingSlotBytes(1 << 20);
  c.setHeartbeatIntervalMs(200);
  auto r = c.initRecipe();
  r.setName("tiny");
  r.setPath("recipes/tiny.toml");
  r.setHash("0123456789abcdef");
  r.setPattern("AA");
  auto layers = r.initLayers(2);
  layers.set(0, "A");
  layers.set(1, "A");
  auto m = r.initModel();
  m.setVocabSize(256);
  m.setSeqLen(64);
  m.setDModel(128);
  m.setNLayers(2);
  m.setNHeads(4);
  m.setMlpMult(4);
  auto t = r.initTrain();
  t.setBatchSize(8);
  t.setMinLrRatio(0.1);
  t.setWarmupSteps(5);
  t.initOptim().setMuonLr(3e-4);
  t.setGradClip(1.0);
  t.setSeed(1234);
  t.setCheckpointEvery(20);
  auto d = r.initData();
  d.setSource("builtin");
  d.setShardTokens(65536);
  d.setShards(4);
  auto fsinfo = c.initFilesystem();
  fsinfo.setPath("/data");
  fsinfo.setType("ext4");
  fsinfo.setDevice("259:1");
  fsinfo.setIsRootVolume(false);
  auto argv = c.initArgv(3);
  argv.set(0, "megacpp");
  argv.set(1, "run");
  argv.set(2, "--recipe=tiny \"quoted\"");
  auto env = c.initEnv(1);
  env[0].setName("MEGACPP_HEARTBEAT_MS");
  env[0].setValue("200");
  auto p = c.initProvenance();
  p.setVersion("0.1.0");
  p.setGitRevision("d1fd13f");
  p.setGitDirty(true);
  p.setBuildType("RelWithDebInfo");
  p.setCompiler("gcc 12");
  p.setHostname("node0");
  p.setTorchVersion("2.11.0");
  c.setSupervisorPid(4242);
  c.setSupervisorStartTicks(123456);
  c.setMetricsEndpoint("http://127.0.0.1:9464/metrics");
  auto ds = c.initDataset();
  ds.setFormat("llmc");
  ds.setTokenBytes(2);
  ds.setSlotTokenBytes(2);
  ds.setWindows(1000);
  auto file = ds.initFiles(1)[0];
  file.setPath("/data/shards/train_000000.bin");
  file.setTokens(65536);
  file.setBytes(132096);
  file.setMaxToken(255);
  file.setXxh3("0123456789abcdef");
  auto volume = c.initVolumes(1)[0];
  volume.setRole("data");
  volume.initFilesystem().setPath("/data");
  c.setAttempt(1);
  auto resume = c.initResume();
  resume.setStep(40);
  resume.setCheckpoint("/data/runs/r1/checkpoints/step_00000040");
  resume.setWorld(2);
  resume.setRankBatch(8);
  auto parent = c.initParent();
  parent.setRunDir("/data/runs/r0");
  parent.setRunId("r0");
  parent.setStep(20);
  parent.setCheckpoint("/data/runs/r0/checkpoints/step_00000020");
  auto policy = c.initCheckpointPolicy();
  policy.setKeep(3);
  policy.setKeepEvery(100);
  c.setDevice("cuda");
  auto coll = c.initCollectives();
  coll.setBackend("nccl");
  coll.setTimeoutSeconds(300);
  coll.setAbortOnTeardown(true);
  coll.setAbortWaitSeconds(2);
  coll.setNcclAsyncErrorHandling(2);
  coll.setNcclEnableMonitoring(true);
  coll.setNcclHeartbeatTimeoutSeconds(480);
  auto gate = c.initGates(1)[0];
  gate.setRule("tp-divides-world");
  gate.setPassed(true);
  gate.setChecked(true);
  gate.setDetail("2 rank(s) into tensor-parallel groups of 1 (author_dp)");
  gate.setReason("every rank belongs to exactly one whole tensor-parallel group");
  gate.setRetires("never: a partial tensor-parallel group cannot hold a layer");
  c.setMuonPrecision("bfloat16 (auto: cuda)");
  auto batch = c.initBatch();
  batch.setRankBatch(8);
  batch.setSeqLen(64);
  batch.setTokenBytes(2);
  batch.setSlotBytes(64 + 8 * 65 * 2);
  batch.setTensorParallel(1);
  batch.setDataRanks(2);
  batch.setWindowsPerStep(16);
  auto placement = c.initPlacement();
  placement.setSource("slurm");
  placement.setNodes(1);
  placement.setMasterHost("node01");
  placement.setMasterPort(29500);
  placement.initHosts(1).set(0, "node01");
  placement.setJobId("4242");
  placement.setNodesFrom("SLURM_NNODES=1");
  c.setFirstRank(0);
  c.setLocalRanks(2);
  c.setStorePrefix("megacpp/20250101-120000-abcd/");
  auto v = c.initValidation();
  v.setEvery(10);
  v.setWindows(128);
  v.setSplitWindows(16383);
  v.initDataset().setFormat("llmc");
  v.setRingSlots(2);
  v.setDigest("6032459ac13471df");
  c.setSnapshotStaging("device");
}

// Offsets of `"name":` for each top-level field, in schema order; -1 when absent. Top-level
// keys are the ones at the first indentation level of the pretty printer's output.
template <typename T>
std::vector<std::pair<std::string, size_t>> top_level_keys(const std::string& json) {
  std::vector<std::pair<std::string, size_t>> out;
  for (auto field : capnp::Schema::from<T>().getFields()) {
    std::string name = field.getProto().getName().cStr();
    // Top-level keys open the document or a line indented by two spaces (the codec's pretty
    // printer); nested keys of the same name sit deeper or inline.
    size_t at = json.rfind("{ \"" + name + "\":", 0) == 0 ? 2 : json.find("\n  \"" + name + "\":");
    out.emplace_back(name, at);
  }
  return out;
}

TEST(SchemasJsonTest, LaunchContractRoundTrip) {
  capnp::MallocMessageBuilder message;
  fill_launch(message.initRoot<schema::LaunchContract>());
  auto original = message.getRoot<schema::LaunchContract>().asReader();
  std::string json = schemas::to_json(original);
  ASSERT_FALSE(json.empty());
  EXPECT_EQ(json.back(), '\n');

  schemas::JsonDocument<schema::LaunchContract> doc(json, "launch.json");
  auto c = doc.get();
  EXPECT_EQ(c.getSchemaVersion(), schema::SCHEMA_VERSION);
  EXPECT_EQ(std::string(c.getRunId().cStr()), "20250101-120000-abcd");
  EXPECT_EQ(c.getGeneration(), 2u);
  EXPECT_EQ(c.getStorePort(), 29500u);
  EXPECT_EQ(c.getRingSlotBytes(), 1u << 20);
  EXPECT_EQ(std::string(c.getRecipe().getLayers()[1].cStr()), "A");
  EXPECT_EQ(c.getRecipe().getModel().getDModel(), 128u);
  EXPECT_DOUBLE_EQ(c.getRecipe().getTrain().getOptim().getMuonLr(), 3e-4);
  EXPECT_EQ(std::string(c.getRecipe().getData().getSource().cStr()), "builtin");
  EXPECT_EQ(std::string(c.getArgv()[2].cStr()), "--recipe=tiny \"quoted\"");
  EXPECT_EQ(std::string(c.getEnv()[0].getName().cStr()), "MEGACPP_HEARTBEAT_MS");
  EXPECT_TRUE(c.getProvenance().getGitDirty());
  EXPECT_FALSE(c.getFilesystem().getIsRootVolume());
  EXPECT_EQ(c.getCheckpointPolicy().getKeep(), 3u);
  EXPECT_EQ(c.getCheckpointPolicy().getKeepEvery(), 100u);
  EXPECT_EQ(std::string(c.getDevice().cStr()), "cuda");
  EXPECT_EQ(c.getBatch().getSlotBytes(), 64u + 8 * 65 * 2);
  EXPECT_EQ(c.getBatch().getWindowsPerStep(), 16u);
  EXPECT_EQ(std::string(c.getPlacement().getHosts()[0].cStr()), "node01");
  // Encoding the decoded document reproduces the text byte for byte.
  EXPECT_EQ(schemas::to_json(c), json);
}

TEST(SchemasJsonTest, KeysFollowSchemaOrder) {
  capnp::MallocMessageBuilder message;
  fill_launch(message.initRoot<schema::LaunchContract>());
  std::string json = schemas::to_json(message.getRoot<schema::LaunchContract>().asReader());
  size_t previous = 0;
  for (const auto& [name, at] : top_level_keys<schema::LaunchContract>(json)) {
    ASSERT_NE(at, std::string::npos) << name << " missing from\n" << json;
    EXPECT_GT(at, previous) << name << " is out of schema order in\n" << json;
    previous = at;
  }
  // Nested structs keep their order too.
  EXPECT_LT(json.find("\"vocabSize\""), json.find("\"mlpMult\""));
  EXPECT_LT(json.find("\"batchSize\""), json.find("\"checkpointEvery\""));
}

TEST(SchemasJsonTest, ManifestRoundTrip) {
  capnp::MallocMessageBuilder message;
  auto m = message.initRoot<schema::Manifest>();
  m.setSchemaVersion(schema::SCHEMA_VERSION);
  m.setRunId("r1");
  m.setRecipe("tiny");
  m.setRecipeHash("0123456789abcdef");
  m.setWorld(2);
  m.setStepsPlanned(40);
  m.setStepsCompleted(17);
  m.setState(schema::RunState::ERROR);
  m.setLaunchedAt("2025-01-01T12:00:00.000Z");
  m.setRunningAt("2025-01-01T12:00:01.000Z");
  m.setCompletedAt("2025-01-01T12:00:09.000Z");
  m.setLastPolledAt("2025-01-01T12:00:08.500Z");
  auto err = m.initError();
  err.setKind(schema::FailureKind::SIGNALED);
  err.setStage(schema::StageKind::TRAINER);
  err.setRank(1);
  err.setMessage("trainer-1 killed by signal 9 in phase backward at step 17");
  auto stages = m.initStages(2);
  stages[0].setStage(schema::StageKind::TRAINER);
  stages[0].setRank(0);
  stages[0].setPid(1234);
  stages[0].setState(schema::ProcessState::TORN_DOWN);
  stages[0].setExitCode(-1);
  stages[0].setSignal(15);
  stages[0].setLastStep(17);
  stages[1].setStage(schema::StageKind::TRAINER);
  stages[1].setRank(1);
  stages[1].setState(schema::ProcessState::SIGNALED);
  stages[1].setSignal(9);
  m.setLatestCheckpoint("checkpoints/step_00000010");
  m.setLatestCheckpointStep(10);
  auto receipts = m.initReceipts(1);
  receipts.set(0, "receipts/bench_result.json");
  auto journals = m.initJournals(1);
  journals[0].setName("trainer-1");
  journals[0].setRecords(40);
  journals[0].setTornBytes(12);
  auto graph = m.initStageGraph();
  graph.setReason("failure detected");
  graph.setAt("2025-01-01T12:00:05.000Z");
  auto entries = graph.initEntries(1);
  entries[0].setStage(schema::StageKind::TRAINER);
  entries[0].setRank(1);
  entries[0].setState("signaled");
  m.setRestarts(1);
  m.setAttempt(1);
  auto attempts = m.initAttempts(2);
  attempts[0].setAttempt(0);
  attempts[0].setReason("launch");
  attempts[0].setState(schema::RunState::ERROR);
  attempts[0].setLastStep(17);
  attempts[0].setStepsLost(7);
  attempts[0].initError().setKind(schema::FailureKind::SIGNALED);
  attempts[1].setAttempt(1);
  attempts[1].setReason("resume");
  attempts[1].setFromStep(10);
  attempts[1].setCheckpoint("checkpoints/step_00000010");
  attempts[1].setState(schema::RunState::INTERRUPTED);
  attempts[1].initSkippedCheckpoints(1).set(0,
                                            "checkpoints/step_00000015: rank_0.safetensors: xxh3");
  auto parent = m.initParent();
  parent.setRunId("r0");
  parent.setStep(20);
  m.setStopReason("stopped by SIGINT after step 12, its checkpoint committed");
  m.setMode("author_dp");
  m.setBlocks("AEMR");
  m.setPrecision("bf16-mixed");
  m.setGradReduce("fp32");
  m.setRecompute("selective");
  auto v = m.initValidation();
  v.setLastLoss(2.06);
  v.setLastStep(20);
  v.setBestLoss(2.06);
  v.setBestStep(20);
  v.setEvaluations(2);

  std::string json = schemas::to_json(m.asReader());
  EXPECT_NE(json.find("\"state\": \"error\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"stage\": \"trainer\""), std::string::npos) << json;

  schemas::JsonDocument<schema::Manifest> doc(json, "manifest.json");
  auto r = doc.get();
  EXPECT_EQ(r.getState(), schema::RunState::ERROR);
  EXPECT_EQ(r.getStepsCompleted(), 17u);
  EXPECT_EQ(r.getError().getStage(), schema::StageKind::TRAINER);
  EXPECT_EQ(r.getError().getRank(), 1u);
  ASSERT_EQ(r.getStages().size(), 2u);
  EXPECT_EQ(r.getStages()[0].getExitCode(), -1);
  EXPECT_EQ(r.getStages()[1].getSignal(), 9);
  EXPECT_EQ(r.getJournals()[0].getTornBytes(), 12u);
  EXPECT_EQ(std::string(r.getReceipts()[0].cStr()), "receipts/bench_result.json");
  EXPECT_EQ(schemas::to_json(r), json);

  size_t previous = 0;
  for (const auto& [name, at] : top_level_keys<schema::Manifest>(json)) {
    ASSERT_NE(at, std::string::npos) << name;
    EXPECT_GT(at, previous) << name << " is out of schema order";
    previous = at;
  }
}

TEST(SchemasJsonTest, UnknownKeysAreIgnored) {
  capnp::MallocMessageBuilder message;
  fill_launch(message.initRoot<schema::LaunchContract>());
  std::string json = schemas::to_json(message.getRoot<schema::LaunchContract>().asReader());
  // A newer writer's fields, at the top level and nested.
  std::string newer = json;
  newer.insert(newer.find('{') + 1, "\"fromTheFuture\": {\"a\": [1, 2, {\"b\": null}]}, ");
  newer.insert(newer.find("\"vocabSize\""), "\"moeExperts\": 16, ");
  schemas::JsonDocument<schema::LaunchContract> doc(newer, "launch.json");
  EXPECT_EQ(std::string(doc.get().getRunId().cStr()), "20250101-120000-abcd");
  EXPECT_EQ(doc.get().getRecipe().getModel().getVocabSize(), 256u);
  EXPECT_EQ(schemas::to_json(doc.get()), json);

  // Missing keys take their defaults (an older writer).
  schemas::JsonDocument<schema::Manifest> old(R"({"schemaVersion": 1, "runId": "r0"})", "m");
  EXPECT_EQ(std::string(old.get().getRunId().cStr()), "r0");
  EXPECT_EQ(old.get().getState(), schema::RunState::LAUNCHED);
  EXPECT_EQ(old.get().getStages().size(), 0u);
}

TEST(SchemasJsonTest, MalformedJsonThrowsCorruption) {
  for (std::string bad : {std::string("{ not json"), std::string(R"({"runId": "r1")"),
                          std::string(""), std::string(R"({"world": "two"})")}) {
    try {
      schemas::JsonDocument<schema::Manifest> doc(bad, "manifest.json");
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kCorruption) << bad;
      EXPECT_NE(std::string(e.what()).find("manifest.json"), std::string::npos) << e.what();
    }
  }
}

TEST(RunLayoutTest, StageNamesRoundTrip) {
  const schema::StageKind all[] = {schema::StageKind::SUPERVISOR, schema::StageKind::DATA_LOADER,
                                   schema::StageKind::TRAINER, schema::StageKind::COLLECTOR,
                                   schema::StageKind::CHECKPOINTER};
  std::vector<std::string> names;
  for (auto s : all) {
    std::string name(layout::stage_name(s));
    EXPECT_EQ(layout::parse_stage(name), s) << name;
    names.push_back(name);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"supervisor", "data_loader", "trainer", "collector",
                                             "checkpointer"}));
  try {
    layout::parse_stage("Trainer");
    FAIL() << "parsed an unknown stage name";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  }
  EXPECT_EQ(layout::process_name(schema::StageKind::TRAINER, 1), "trainer-1");
  EXPECT_EQ(layout::journal_path("/r", schema::StageKind::DATA_LOADER, 0),
            std::filesystem::path("/r/journal/data_loader-0.journal"));
  EXPECT_EQ(layout::checkpoint_dir_name(40), "step_00000040");
  EXPECT_EQ(layout::ring_shm_name("/megacpp-r1-g2-", 3), "/megacpp-r1-g2-ring-3");
  EXPECT_EQ(layout::staging_shm_name("/megacpp-r1-g2-", 0), "/megacpp-r1-g2-stage-0");
}

}  // namespace
}  // namespace megacpp

TEST(RunLayoutTest, ShmPrefixIsAFunctionOfAValidRunId) {
  const std::string id = "2026-01-02T03-04-05-a1b2c3";
  EXPECT_TRUE(megacpp::layout::valid_run_id(id));
  EXPECT_EQ(megacpp::layout::shm_prefix(id, 0), "/megacpp-2026-01-02T03-04-05-a1b2c3-g0-");
  EXPECT_LE(megacpp::layout::staging_shm_name(megacpp::layout::shm_prefix(std::string(64, 'a'), 0),
                                              megacpp::layout::kMaxRanks)
                .size(),
            255u);
  for (const char* bad : {"", "/", "..", "a/b", "a b", "a.b", "a_b"})
    EXPECT_FALSE(megacpp::layout::valid_run_id(bad)) << bad;
  EXPECT_FALSE(megacpp::layout::valid_run_id(std::string(65, 'a')));
  EXPECT_THROW(megacpp::layout::shm_prefix("/", 0), megacpp::Error);
}

namespace megacpp {
namespace {

// Every enumerant of the typed-failure enums is named (in the JSON files and logs) by the
// snake_case word the Text fields carried before them.
TEST(SchemasEnums, EveryEnumerantHasItsSnakeCaseName) {
  const std::vector<std::pair<schema::FailureKind, std::string>> kinds = {
      {schema::FailureKind::NONE, ""},
      {schema::FailureKind::EXITED, "exited"},
      {schema::FailureKind::SIGNALED, "signaled"},
      {schema::FailureKind::HUNG, "hung"},
      {schema::FailureKind::HEARTBEAT_LOST, "heartbeat_lost"},
      {schema::FailureKind::EXCEPTION, "exception"},
      {schema::FailureKind::INTERRUPTED, "interrupted"},
      {schema::FailureKind::UNKILLABLE, "unkillable"},
      {schema::FailureKind::TORN_DOWN, "torn_down"},
      {schema::FailureKind::STALLED, "stalled"},
      {schema::FailureKind::INCOMPLETE, "incomplete"},
      {schema::FailureKind::ORPHANED, "orphaned"},
      {schema::FailureKind::DIVERGED, "diverged"},
      {schema::FailureKind::NODE_LOST, "node_lost"},
      {schema::FailureKind::NODE_FAILED, "node_failed"}};
  ASSERT_EQ(kinds.size(), capnp::Schema::from<schema::FailureKind>().getEnumerants().size());
  const std::vector<std::pair<schema::FailureRole, std::string>> roles = {
      {schema::FailureRole::NONE, ""},
      {schema::FailureRole::FIRST_FAILURE, "first_failure"},
      {schema::FailureRole::VICTIM, "victim"},
      {schema::FailureRole::TORN_DOWN, "torn_down"}};
  ASSERT_EQ(roles.size(), capnp::Schema::from<schema::FailureRole>().getEnumerants().size());
  const std::vector<std::pair<schema::ProcessState, std::string>> states = {
      {schema::ProcessState::STARTED, "started"},
      {schema::ProcessState::FINISHED, "finished"},
      {schema::ProcessState::EXITED, "exited"},
      {schema::ProcessState::SIGNALED, "signaled"},
      {schema::ProcessState::UNKILLABLE, "unkillable"},
      {schema::ProcessState::TORN_DOWN, "torn_down"},
      {schema::ProcessState::RUNNING, "running"}};
  ASSERT_EQ(states.size(), capnp::Schema::from<schema::ProcessState>().getEnumerants().size());
  const std::vector<std::pair<schema::ChildReason, std::string>> reasons = {
      {schema::ChildReason::NONE, ""},
      {schema::ChildReason::LAUNCH, "launch"},
      {schema::ChildReason::RESTART, "restart"},
      {schema::ChildReason::EXIT, "exit"},
      {schema::ChildReason::STOP, "stop"},
      {schema::ChildReason::TEARDOWN, "teardown"},
      {schema::ChildReason::SURVIVED_KILL, "survived_kill"}};
  ASSERT_EQ(reasons.size(), capnp::Schema::from<schema::ChildReason>().getEnumerants().size());
  for (const auto& [value, want] : reasons) {
    EXPECT_EQ(std::string(schemas::name(value)), want);
    EXPECT_EQ(schemas::child_reason_named(want), value);
  }

  // Through the JSON codec: a manifest whose error kind, stage state and role are each
  // enumerant carries the name as its JSON string, and reads back to the same enumerant.
  auto check = [](auto set, auto get, const auto& table) {
    for (const auto& [value, want] : table) {
      EXPECT_EQ(std::string(schemas::name(value)), want);
      capnp::MallocMessageBuilder message;
      auto m = message.initRoot<schema::Manifest>();
      set(m, value);
      const std::string json = schemas::to_json(m.asReader());
      EXPECT_NE(json.find(": \"" + want + "\""), std::string::npos) << json;
      schemas::JsonDocument<schema::Manifest> doc(json, "manifest.json");
      EXPECT_EQ(get(doc.get()), value) << json;
    }
  };
  check([](schema::Manifest::Builder m, schema::FailureKind k) { m.initError().setKind(k); },
        [](schema::Manifest::Reader m) { return m.getError().getKind(); }, kinds);
  check([](schema::Manifest::Builder m, schema::FailureRole r) { m.initStages(1)[0].setRole(r); },
        [](schema::Manifest::Reader m) { return m.getStages()[0].getRole(); }, roles);
  check(
      [](schema::Manifest::Builder m, schema::ProcessState st) { m.initStages(1)[0].setState(st); },
      [](schema::Manifest::Reader m) { return m.getStages()[0].getState(); }, states);
}

// core ErrorKind and schema::ErrorKind correspond one to one through to_schema/from_schema;
// the schema's foreign kinds (capnp, c10, std, unknown) and none (nothing was thrown) have no
// core counterpart.
TEST(SchemasEnums, ErrorKindConversionCoversEveryEnumerant) {
  const ErrorKind core[] = {
      ErrorKind::kInvalidArgument, ErrorKind::kSystem,      ErrorKind::kZmq,
      ErrorKind::kProtocol,        ErrorKind::kCorruption,  ErrorKind::kTimeout,
      ErrorKind::kPeerFailure,     ErrorKind::kInterrupted, ErrorKind::kInternal,
      ErrorKind::kDiverged};
  for (ErrorKind k : core) {
    EXPECT_EQ(schemas::from_schema(schemas::to_schema(k)), k) << to_string(k);
    EXPECT_EQ(schemas::name(schemas::to_schema(k)), to_string(k));
  }
  size_t mapped = 0;
  for (auto e : capnp::Schema::from<schema::ErrorKind>().getEnumerants()) {
    const auto value = static_cast<schema::ErrorKind>(e.getOrdinal());
    if (auto k = schemas::from_schema(value)) {
      ++mapped;
      EXPECT_EQ(schemas::to_schema(*k), value);
    } else {
      const std::string n(schemas::name(value));
      EXPECT_TRUE(n == "capnp" || n == "c10" || n == "std" || n == "unknown" || n.empty()) << n;
    }
  }
  EXPECT_EQ(mapped, std::size(core));
  EXPECT_EQ(schemas::name(schema::ErrorKind::PEER_FAILURE), "peer_failure");
}

}  // namespace
}  // namespace megacpp
