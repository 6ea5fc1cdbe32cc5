// The documents of a run (internal to megacpp::collector): one function per document, each a
// pure function of the fold state (and, for the manifest, of which failure dumps exist in the
// run directory), returning the document's JSON bytes.
//
// Every document starts with stamp_identity: the fields of the state's RunIdentity that its
// schema has, so the run id, recipe, world, attempt, device and build read the same in the
// manifest and in every receipt.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "schemas/run_layout.h"
#include "stages/collector/detail/fold_state.h"

namespace megacpp::collector::detail {

// Sets on `doc` (a document's root builder) the schema version and each RunIdentity field its
// schema declares: runId always; recipe, recipeHash, world, attempt, mode, blocks, the memory
// settings (precision, gradReduce, recompute), device and build where the document has them.
template <typename Builder>
void stamp_identity(Builder doc, const RunIdentity& id) {
  doc.setSchemaVersion(schema::SCHEMA_VERSION);
  doc.setRunId(id.run_id);
  if constexpr (requires { doc.setRecipe(capnp::Text::Reader()); }) doc.setRecipe(id.recipe);
  if constexpr (requires { doc.setRecipeHash(capnp::Text::Reader()); })
    doc.setRecipeHash(id.recipe_hash);
  if constexpr (requires { doc.setWorld(uint32_t{}); }) doc.setWorld(id.world);
  if constexpr (requires { doc.setAttempt(uint32_t{}); }) doc.setAttempt(id.attempt);
  if constexpr (requires { doc.setMode(capnp::Text::Reader()); }) doc.setMode(id.mode);
  if constexpr (requires { doc.setBlocks(capnp::Text::Reader()); }) doc.setBlocks(id.blocks);
  if constexpr (requires { doc.setPrecision(capnp::Text::Reader()); }) {
    if (id.memory_declared) {  // else the defaults, unwritten as in the launch contract
      doc.setPrecision(id.precision);
      doc.setGradReduce(id.grad_reduce);
      doc.setRecompute(id.recompute);
    }
  }
  if constexpr (requires { doc.setDevice(capnp::Text::Reader()); }) doc.setDevice(id.device);
  if constexpr (requires { doc.setBuild(schema::Provenance::Reader()); }) doc.setBuild(id.build());
}

// One step of the run's series, summed over the ranks that recorded it.
struct StepPoint {
  double loss_sum = 0;
  uint32_t ranks = 0;
  double step_max = 0;
  double wait_max = 0;
  double data_epoch = 0, data_cursor = 0;  // every rank reports the same global state
  double aux_sum = 0;
  std::vector<uint32_t> expert_tokens;  // summed over ranks
  std::array<double, kStepPhaseParts> phase_sum{};
  uint32_t phase_ranks = 0;
};

// What the fold state says as of now, derived once per render and read by every document.
struct RunView {
  FoldState::Series effective;  // the steps that still stand
  uint32_t completed = 0;       // the newest step every rank of the world completed
  bool terminal = false;        // finished or orphaned: the receipts are written
  // `ok` is earned, not reported: a run that finished without error but short of its
  // planned steps (a rank that left early and still exited 0) is an error.
  bool short_of_plan = false;
  // The per-step series over every step any rank recorded (terminal runs only; empty before).
  std::map<uint32_t, StepPoint> points;
  double tokens = 0;
  double wall_seconds = 0;      // rank 0's first step start (else the earliest) -> last end
  double step_seconds_sum = 0;  // slowest rank's seconds, summed over steps 1..completed
  // Bytes, the largest over the ranks: peak resident size, and peak above the rank's baseline.
  double memory_peak = 0, memory_above_baseline = 0;
  double device_memory_peak = 0, device_memory_reserved = 0;
  // Held-out evaluations that still stand, by step (live runs too): the lowest rank's loss,
  // the slowest rank's seconds; and the evaluation seconds inside wall_seconds.
  struct Evaluation {
    double loss = 0, tokens = 0, seconds = 0, wait_seconds = 0;
    int64_t first_wall_ns = 0;  // when the first rank journaled it
  };
  std::map<uint32_t, Evaluation> evaluations;
  double eval_seconds_inside = 0;
};
RunView view_of(const FoldState& s);

std::string manifest_document(const FoldState& s, const RunView& v,
                              const std::filesystem::path& run_dir);
std::string bench_result_document(const FoldState& s, const RunView& v);
std::string bench_telemetry_document(const FoldState& s, const RunView& v);
std::string backend_identity_document(const FoldState& s, const RunView& v);
std::string runtime_provenance_document(const FoldState& s, const RunView& v);
std::string first_forward_document(const FoldState& s, const RunView& v);

// The receipts of a terminal run, in the order the manifest lists them.
struct Receipt {
  std::string_view name;  // a layout:: receipt file name
  std::string (*render)(const FoldState&, const RunView&);
};
inline constexpr std::array<Receipt, 5> kReceipts{{
    {layout::kBenchResult, bench_result_document},
    {layout::kBenchTelemetry, bench_telemetry_document},
    {layout::kBackendIdentity, backend_identity_document},
    {layout::kRuntimeProvenance, runtime_provenance_document},
    {layout::kFirstForward, first_forward_document},
}};

// Every document of the run, by path relative to the run directory ("manifest.json",
// "receipts/bench_result.json", ...): the manifest always, the receipts in a terminal state.
std::map<std::string, std::string> render_documents(const FoldState& s,
                                                    const std::filesystem::path& run_dir);

}  // namespace megacpp::collector::detail
