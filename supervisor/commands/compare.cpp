// `megacpp compare RUN...`: runs of one comparison class side by side (README.md "Comparing
// runs").
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"
#include "supervisor/commands/commands.h"

namespace megacpp::supervisor {

namespace fs = std::filesystem;

namespace {

// What a run was, for comparisons: its class fields and its figures.
struct RunFacts {
  std::string name;  // the directory's last component (its path when names collide)
  std::vector<std::pair<std::string, std::string>> cls;  // comparison class, in a fixed order
  double tokens_per_second = 0;
  double p50 = NAN, p99 = NAN;  // step seconds, steps >= 2
  double stall = NAN;           // mean extra seconds of the step after a checkpoint
  uint32_t restarts = 0;        // stage restarts + job restarts / resumes
  uint32_t steps = 0;
  std::map<uint32_t, double> loss;      // step -> mean loss over ranks
  std::map<uint32_t, double> val_loss;  // evaluated step -> held-out loss
  double eval_seconds = NAN;            // every evaluation's, summed
};

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const double at = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(at));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (at - static_cast<double>(lo));
}

// The recipe's memory settings (recipes/recipe.h TrainConfig; a contract without them holds
// the defaults): "fp32", or "bf16-mixed (gradients summed in fp32)"; ", recompute full" when
// recomputing.
std::string memory_class(schema::TrainSpec::Reader t) {
  if (!t.hasMemory()) return "fp32";
  const auto m = t.getMemory();
  std::string out = m.getPrecision().cStr();
  if (out == "bf16-mixed")
    out += fmt::format(" (gradients summed in {})", m.getGradReduce().cStr());
  if (std::string_view(m.getRecompute().cStr()) != "none")
    out += fmt::format(", recompute {}", m.getRecompute().cStr());
  return out;
}

RunFacts read_run(const fs::path& run) {
  if (!fs::exists(layout::launch_path(run)))
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{} holds no run (no launch.json)", run.string());
  const fs::path result_path = layout::receipt_path(run, layout::kBenchResult);
  const fs::path telemetry_path = layout::receipt_path(run, layout::kBenchTelemetry);
  if (!fs::exists(result_path) || !fs::exists(telemetry_path))
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "{} has no receipts yet (still running, or never collected): compare it once it "
                 "has ended (`megacpp collect {}` re-folds a finished one)",
                 run.string(), run.string());
  schemas::JsonFile<schema::LaunchContract> launch(layout::launch_path(run));
  schemas::JsonFile<schema::Manifest> manifest(layout::manifest_path(run));
  schemas::JsonFile<schema::BenchResult> result(result_path);
  schemas::JsonFile<schema::BenchTelemetry> telemetry(telemetry_path);
  auto l = launch.get();
  auto m = manifest.get();
  auto r = result.get();
  RunFacts f;
  f.name = run.filename().string();
  const auto p = l.getProvenance();
  std::vector<DataFile> data;
  for (auto file : l.getDataset().getFiles())
    data.push_back({file.getXxh3().cStr(), static_cast<uint64_t>(file.getTokens())});
  const std::string mode = m.getMode().size() > 0 ? std::string(m.getMode()) : "author_dp";
  f.cls = {{"recipe",
            fmt::format("{} ({})", l.getRecipe().getName().cStr(), l.getRecipe().getHash().cStr())},
           {"mode", mode},
           {"world", std::to_string(l.getWorld())},
           {"backend", l.hasCollectives() ? std::string(l.getCollectives().getBackend()) : "gloo"},
           {"device", l.getDevice().size() > 0 ? std::string(l.getDevice()) : "cpu"},
           // In the recipe's hash too; named here so a refusal says what differs.
           {"orthogonalization",
            l.getRecipe().getTrain().getOptim().getMuonBf16() ? "bfloat16" : "float32"},
           {"precision", memory_class(l.getRecipe().getTrain())},
           {"build", build_name(p.getGitRevision().cStr(), p.getGitDirty(), p.getBuildType().cStr(),
                                p.getCompiler().cStr(), p.getTorchVersion().cStr())},
           {"data", dataset_digest(data)},
           // The held-out set: its files, windows and sequence length (launch Validation.digest).
           {"validation", l.hasValidation() && l.getValidation().getDigest().size() > 0
                              ? std::string(l.getValidation().getDigest())
                              : std::string("none")}};
  f.tokens_per_second = r.getTokensPerSecond();
  f.steps = m.getStepsCompleted();
  f.restarts = m.getRestarts() + (m.getAttempts().size() > 0 ? m.getAttempts().size() - 1 : 0);
  std::vector<double> seconds;
  std::map<uint32_t, double> step_seconds;
  for (auto s : telemetry.get().getSteps()) {
    f.loss[s.getStep()] = s.getLoss();
    step_seconds[s.getStep()] = s.getStepSeconds();
    if (s.getStep() >= 2) seconds.push_back(s.getStepSeconds());
  }
  for (auto e : telemetry.get().getEvaluations()) f.val_loss[e.getStep()] = e.getLoss();
  if (r.hasValidation()) f.eval_seconds = r.getValidation().getSeconds();
  f.p50 = percentile(seconds, 0.5);
  f.p99 = percentile(seconds, 0.99);
  // A step's wall time includes the snapshot copy of the checkpoint before it: the stall is
  // what the step after each checkpoint took beyond the median step.
  const uint32_t every = l.getRecipe().getTrain().getCheckpointEvery();
  std::vector<double> extra;
  for (uint32_t c = every; every > 0 && c < f.steps; c += every)
    if (auto it = step_seconds.find(c + 1); it != step_seconds.end())
      extra.push_back(it->second - f.p50);
  if (!extra.empty()) {
    double sum = 0;
    for (double e : extra) sum += e;
    f.stall = sum / static_cast<double>(extra.size());
  }
  return f;
}

std::string num(double v, const char* spec) {
  return std::isfinite(v) ? fmt::format(fmt::runtime(spec), v) : std::string("-");
}

}  // namespace

std::string build_name(std::string_view revision, bool dirty, std::string_view build_type,
                       std::string_view compiler, std::string_view torch_version) {
  return fmt::format("{}{} {} {} torch {}", revision, dirty ? "+dirty" : "", build_type, compiler,
                     torch_version);
}

std::string dataset_digest(const std::vector<DataFile>& files) {
  std::string text;
  for (const auto& f : files) text += fmt::format("{}:{};", f.xxh3, f.tokens);
  return text.empty() ? "-" : xxh3_hex(text);
}

int compare_runs(const std::vector<fs::path>& runs, bool force) {
  if (runs.size() < 2)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "compare needs at least two run directories");
  std::vector<RunFacts> facts;
  for (const auto& r : runs) facts.push_back(read_run(r));
  std::map<std::string, int> seen;
  for (const auto& f : facts) ++seen[f.name];
  for (size_t i = 0; i < facts.size(); ++i)
    if (seen[facts[i].name] > 1) facts[i].name = runs[i].string();

  // Which class fields differ, and how.
  std::vector<std::string> differ;
  for (size_t k = 0; k < facts[0].cls.size(); ++k) {
    std::vector<std::string> values;
    for (const auto& f : facts) values.push_back(f.cls[k].second);
    if (std::all_of(values.begin(), values.end(), [&](const auto& v) { return v == values[0]; }))
      continue;
    std::string text = facts[0].cls[k].first + " ";
    for (size_t i = 0; i < facts.size(); ++i)
      text += fmt::format("{}{} ({})", i ? " vs " : "", values[i], facts[i].name);
    differ.push_back(text);
  }
  if (!differ.empty() && !force)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "these runs are not one comparison class: {}; --force prints them anyway, "
                 "labelled as a cross-class comparison",
                 fmt::join(differ, "; "));
  if (differ.empty()) {
    fmt::print("comparison class:");
    for (const auto& [k, v] : facts[0].cls) fmt::print(" {} {};", k, v);
    fmt::print("\n\n");
  } else {
    fmt::print("CROSS-CLASS COMPARISON (--force): {}\n\n", fmt::join(differ, "; "));
  }

  size_t width = 24;
  for (const auto& f : facts) width = std::max(width, f.name.size() + 2);
  auto row = [&](const std::string& label, auto cell) {
    fmt::print("{:<26}", label);
    for (const auto& f : facts) fmt::print("{:>{}}", cell(f), width);
    fmt::print("\n");
  };
  row("", [](const RunFacts& f) { return f.name; });
  row("steps", [](const RunFacts& f) { return std::to_string(f.steps); });
  row("tokens/s", [](const RunFacts& f) { return num(f.tokens_per_second, "{:.0f}"); });
  row("step s p50", [](const RunFacts& f) { return num(f.p50, "{:.4f}"); });
  row("step s p99", [](const RunFacts& f) { return num(f.p99, "{:.4f}"); });
  row("checkpoint stall s", [](const RunFacts& f) { return num(f.stall, "{:.4f}"); });
  row("restarts", [](const RunFacts& f) { return std::to_string(f.restarts); });
  // Loss at up to 6 steps every run recorded, spread over them (first and last included).
  std::vector<uint32_t> common;
  for (const auto& [step, loss] : facts[0].loss) {
    if (std::all_of(facts.begin(), facts.end(),
                    [&, step = step](const RunFacts& f) { return f.loss.contains(step); }))
      common.push_back(step);
  }
  const size_t shown = std::min<size_t>(6, common.size());
  for (size_t i = 0; i < shown; ++i) {
    const size_t at = shown == 1 ? 0 : i * (common.size() - 1) / (shown - 1);
    const uint32_t step = common[at];
    row(fmt::format("loss @ step {}", step),
        [&](const RunFacts& f) { return num(f.loss.at(step), "{:.4f}"); });
  }
  if (common.empty()) fmt::print("(no step that every run recorded: no losses to compare)\n");
  // The held-out loss at every step each run evaluated after.
  std::vector<uint32_t> evaluated;
  for (const auto& [step, loss] : facts[0].val_loss) {
    if (std::all_of(facts.begin(), facts.end(),
                    [&, step = step](const RunFacts& f) { return f.val_loss.contains(step); }))
      evaluated.push_back(step);
  }
  for (uint32_t step : evaluated)
    row(fmt::format("val loss @ step {}", step),
        [&](const RunFacts& f) { return num(f.val_loss.at(step), "{:.4f}"); });
  if (std::any_of(facts.begin(), facts.end(),
                  [](const RunFacts& f) { return std::isfinite(f.eval_seconds); }))
    row("evaluation s", [](const RunFacts& f) { return num(f.eval_seconds, "{:.3f}"); });
  if (facts.size() >= 2) {
    const double base = facts[0].tokens_per_second;
    row(fmt::format("tokens/s vs {}", facts[0].name).substr(0, 25), [&](const RunFacts& f) {
      return base > 0 ? fmt::format("{:.3f}x", f.tokens_per_second / base) : std::string("-");
    });
  }
  return 0;
}

}  // namespace megacpp::supervisor
