// The commands that look after run directories with no live job of their own: `megacpp stop`,
// `megacpp status --watch`, `megacpp list` and `megacpp collect --all` (README.md "Detached
// runs").
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/journal.h"
#include "schemas/enums.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"
#include "stages/collector/collector.h"
#include "supervisor/commands/commands.h"
#include "supervisor/process.h"

namespace megacpp::supervisor {

namespace fs = std::filesystem;
using schema::StageKind;

namespace {

// The run directory's launch contract, or a one-line error in the user's terms.
void require_run(const fs::path& run_dir) {
  if (!fs::exists(layout::launch_path(run_dir)))
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{} holds no run (no launch.json)", run_dir.string());
}

// The supervisor of the run's current attempt, when it is alive (pid and start time match).
std::optional<pid_t> live_supervisor(const fs::path& run_dir) {
  schemas::JsonFile<schema::LaunchContract> launch(layout::launch_path(run_dir));
  auto l = launch.get();
  const pid_t pid = l.getSupervisorPid();
  if (!detail::process_alive(pid, l.getSupervisorStartTicks())) return std::nullopt;
  bool finished = false;
  ipc::JournalReader::read_all(layout::journal_path(run_dir, StageKind::SUPERVISOR, 0),
                               [&](schema::JournalRecord::Reader r) {
                                 if (r.getAttempt() == l.getAttempt())
                                   finished = finished || r.isRunFinished();
                               });
  if (finished) return std::nullopt;
  return pid;
}

// Live progress of a run's current attempt from its trainers' journals.
struct Progress {
  uint32_t step = 0;  // the step every rank has finished; the resume step before the first
  uint32_t ranks = 0;
  double loss = NAN;  // mean over ranks at `step`
  double tokens_per_second = NAN;
  double step_seconds = NAN;  // mean of the last steps
};

// Only the current attempt's step records (`l`, the run's launch.json, names it) count: an
// earlier attempt's run to a later step, its losses and its step times are history, not this
// attempt's progress.
Progress read_progress(const fs::path& run_dir, schema::LaunchContract::Reader l) {
  const uint32_t world = l.getWorld(), attempt = l.getAttempt();
  Progress p;
  p.step = l.getResume().getStep();
  struct Row {
    double loss_sum = 0;
    uint32_t ranks = 0;
    double tokens = 0;
    int64_t wall_ns = 0;
    double step_seconds = 0;
  };
  std::map<uint32_t, Row> rows;
  for (uint32_t r = 0; r < world; ++r) {
    const fs::path j = layout::journal_path(run_dir, StageKind::TRAINER, r);
    if (!fs::exists(j)) continue;
    ++p.ranks;
    ipc::JournalReader::read_all(j, [&](schema::JournalRecord::Reader rec) {
      if (!rec.isStep() || rec.getAttempt() != attempt) return;
      auto s = rec.getStep();
      Row& row = rows[s.getStep()];
      row.loss_sum += s.getLoss();
      row.ranks += 1;
      row.tokens += s.getTokens();
      row.wall_ns = std::max(row.wall_ns, rec.getWallNs());
      row.step_seconds = std::max(row.step_seconds, s.getStepSeconds());
    });
  }
  std::vector<uint32_t> complete;
  for (const auto& [step, row] : rows)
    if (row.ranks == world) complete.push_back(step);
  if (complete.empty()) return p;
  p.step = complete.back();
  p.loss = rows[p.step].loss_sum / world;
  // The last (up to) 20 complete steps: tokens over their wall span, and their mean time.
  const size_t n = std::min<size_t>(20, complete.size());
  double tokens = 0, seconds = 0;
  for (size_t i = complete.size() - n; i < complete.size(); ++i) {
    tokens += rows[complete[i]].tokens;
    seconds += rows[complete[i]].step_seconds;
  }
  p.step_seconds = seconds / static_cast<double>(n);
  if (seconds > 0) p.tokens_per_second = tokens / seconds;
  return p;
}

std::string duration_text(double s) {
  if (!std::isfinite(s) || s < 0) return "-";
  const auto t = static_cast<int64_t>(std::llround(s));
  if (t < 60) return fmt::format("{}s", t);
  if (t < 3600) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
}

// Seconds between two RFC 3339 times as the manifest writes them ("" = unknown).
double seconds_between(const std::string& a, const std::string& b) {
  auto parse = [](const std::string& t) -> std::optional<double> {
    std::tm tm{};
    double frac = 0;
    if (t.size() < 19) return std::nullopt;
    if (::strptime(t.substr(0, 19).c_str(), "%Y-%m-%dT%H:%M:%S", &tm) == nullptr)
      return std::nullopt;
    if (t.size() > 20 && t[19] == '.') frac = std::stod("0" + t.substr(19, t.find('Z') - 19));
    return static_cast<double>(::timegm(&tm)) + frac;
  };
  const auto x = parse(a), y = parse(b);
  return x && y ? *y - *x : NAN;
}

// Run directories directly under `dir` and one folder below, sorted.
std::vector<fs::path> find_runs(const fs::path& dir) {
  if (!fs::is_directory(dir))
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{} is not a directory", dir.string());
  std::vector<fs::path> runs;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_directory()) continue;
    if (fs::exists(layout::launch_path(e.path()))) {
      runs.push_back(e.path());
      continue;
    }
    std::error_code ec;
    for (const auto& f : fs::directory_iterator(e.path(), ec))
      if (f.is_directory() && fs::exists(layout::launch_path(f.path()))) runs.push_back(f.path());
  }
  std::sort(runs.begin(), runs.end());
  return runs;
}

// The bytes of what a fold writes, to tell a changed run from an unchanged one.
std::string folded_bytes(const fs::path& run) {
  std::string out;
  std::error_code ec;
  if (fs::exists(layout::manifest_path(run), ec)) out += read_file(layout::manifest_path(run));
  const fs::path receipts = layout::receipts_dir(run);
  if (fs::is_directory(receipts, ec)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(receipts, ec)) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) out += f.filename().string() + read_file(f);
  }
  return out;
}

}  // namespace

int collect_all(const fs::path& dir, unsigned jobs) {
  const std::vector<fs::path> runs = find_runs(dir);
  const auto t0 = std::chrono::steady_clock::now();
  struct Outcome {
    bool changed = false;
    std::string problem;
  };
  std::vector<Outcome> outcomes(runs.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < runs.size();) {
      const fs::path& run = runs[i];
      try {
        if (const auto pid = live_supervisor(run)) {
          outcomes[i].problem =
              fmt::format("still running (supervisor pid {}): collect it once it has ended", *pid);
          continue;
        }
        const std::string before = folded_bytes(run);
        reconcile(run);
        collector::collect_run(run);
        outcomes[i].changed = folded_bytes(run) != before;
      } catch (const std::exception& e) {
        outcomes[i].problem = e.what();
      }
    }
  };
  jobs = std::max(1u, std::min<unsigned>(jobs, static_cast<unsigned>(runs.size())));
  std::vector<std::thread> pool;
  for (unsigned j = 1; j < jobs; ++j) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  size_t changed = 0, problems = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (!outcomes[i].problem.empty()) {
      ++problems;
      fmt::print(stderr, "megacpp: {}: {}\n", fs::relative(runs[i], dir).string(),
                 outcomes[i].problem);
    }
    changed += outcomes[i].changed;
  }
  const size_t collected = runs.size() - problems;
  fmt::print(
      "collected {} of {} runs under {} in {:.3f}s ({:.2f} ms per run, {} threads): {} "
      "changed, {} unchanged{}\n",
      collected, runs.size(), dir.string(), seconds,
      runs.empty() ? 0.0 : 1e3 * seconds / static_cast<double>(runs.size()), jobs, changed,
      collected - changed, problems ? fmt::format(", {} not collected", problems) : "");
  return problems == 0 ? 0 : 1;
}

int stop(const fs::path& run_dir, bool wait, double timeout_s) {
  require_run(run_dir);
  auto not_running = [&]() -> int {
    reconcile(run_dir);
    collector::collect_run(run_dir);
    schemas::JsonFile<schema::Manifest> manifest(layout::manifest_path(run_dir));
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{} is not running (state {}): nothing to stop",
                 run_dir.string(), schemas::name(manifest.get().getState()));
  };
  const auto pid = live_supervisor(run_dir);
  if (!pid) return not_running();
  schemas::JsonFile<schema::LaunchContract> launch(layout::launch_path(run_dir));
  const uint64_t start_ticks = launch.get().getSupervisorStartTicks();
  // Through a pidfd checked against the recorded start time: the supervisor may exit, and its
  // pid be reused, between live_supervisor() and the signal.
  const auto signalled = detail::signal_process(*pid, start_ticks, SIGTERM);
  if (signalled.result == detail::SignalResult::kGone ||
      signalled.result == detail::SignalResult::kNotOurs)
    return not_running();
  if (signalled.result == detail::SignalResult::kRefused)
    MEGACPP_FAIL(ErrorKind::kSystem, "cannot signal the supervisor (pid {}) of {}: {}", *pid,
                 run_dir.string(), std::strerror(signalled.error));
  fmt::print(
      "asked the supervisor (pid {}) of {} to stop: the ranks finish the step in flight and "
      "commit its checkpoint\n",
      *pid, run_dir.string());
  if (!wait) return 0;
  std::fflush(stdout);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  // Gone means the process too: its journal says the run finished a moment before it exits.
  while (live_supervisor(run_dir) || detail::process_alive(*pid, start_ticks)) {
    if (std::chrono::steady_clock::now() > deadline)
      MEGACPP_FAIL(ErrorKind::kTimeout,
                   "{} is still running {:.0f}s after the stop request; `megacpp stop` again "
                   "tears it down at once",
                   run_dir.string(), timeout_s);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return supervisor::status(run_dir);
}

int watch_status(const fs::path& run_dir, double interval_s) {
  require_run(run_dir);
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  for (;;) {
    if (!live_supervisor(run_dir)) return supervisor::status(run_dir);
    schemas::JsonFile<schema::LaunchContract> launch(layout::launch_path(run_dir));
    auto l = launch.get();
    const uint32_t planned = l.getSteps();
    const Progress p = read_progress(run_dir, l);
    uint32_t up = 0, total = 0;
    if (fs::exists(layout::manifest_path(run_dir))) {
      schemas::JsonFile<schema::Manifest> manifest(layout::manifest_path(run_dir));
      for (auto st : manifest.get().getStages()) {
        if (st.getStage() == StageKind::SUPERVISOR) continue;
        ++total;
        up += st.getState() == schema::ProcessState::STARTED;
      }
    }
    const double eta = p.step < planned && std::isfinite(p.step_seconds)
                           ? (planned - p.step) * p.step_seconds
                           : NAN;
    const std::string line = fmt::format(
        "{}  step {}/{}  loss {}  {} tok/s  stages up {}/{}  eta {}", run_dir.filename().string(),
        p.step, planned, std::isfinite(p.loss) ? fmt::format("{:.4f}", p.loss) : "-",
        std::isfinite(p.tokens_per_second) ? fmt::format("{:.0f}", p.tokens_per_second) : "-", up,
        total, duration_text(eta));
    if (tty) {
      fmt::print("\r\033[K{}", line);
    } else {
      fmt::print("{}\n", line);
    }
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(interval_s * 1000)));
    if (tty && !live_supervisor(run_dir)) fmt::print("\n");
  }
}

int list_runs(const fs::path& dir) {
  const std::vector<fs::path> runs = find_runs(dir);
  fmt::print("{:<40} {:<11} {:<16} {:>11} {:>9} {:>9} {:<20} {:>9}\n", "run", "state", "recipe",
             "steps", "last loss", "val loss", "started", "duration");
  for (const fs::path& run : runs) {
    const std::string name = fs::relative(run, dir).string();
    try {
      reconcile(run);
      if (!fs::exists(layout::manifest_path(run))) collector::collect_run(run);
      schemas::JsonFile<schema::Manifest> manifest(layout::manifest_path(run));
      auto m = manifest.get();
      const bool live = live_supervisor(run).has_value();
      double last_loss = NAN;
      const fs::path br = layout::receipt_path(run, layout::kBenchResult);
      if (live) {
        schemas::JsonFile<schema::LaunchContract> launch(layout::launch_path(run));
        last_loss = read_progress(run, launch.get()).loss;
      } else if (fs::exists(br)) {
        last_loss = schemas::JsonFile<schema::BenchResult>(br).get().getLastLoss();
      }
      // The newest held-out evaluation (the manifest is folded while the run goes on).
      const bool evaluated = m.hasValidation() && m.getValidation().getEvaluations() > 0;
      const std::string started = m.getLaunchedAt();
      const std::string ended = live ? rfc3339(wall_ns()) : std::string(m.getCompletedAt());
      fmt::print("{:<40} {:<11} {:<16} {:>11} {:>9} {:>9} {:<20} {:>9}\n", name,
                 live ? std::string_view("running") : schemas::name(m.getState()),
                 m.getRecipe().cStr(),
                 fmt::format("{}/{}", m.getStepsCompleted(), m.getStepsPlanned()),
                 std::isfinite(last_loss) ? fmt::format("{:.4f}", last_loss) : "-",
                 evaluated ? fmt::format("{:.4f}", m.getValidation().getLastLoss()) : "-",
                 started.substr(0, 19), duration_text(seconds_between(started, ended)));
    } catch (const std::exception& e) {
      fmt::print("{:<40} unreadable: {}\n", name, e.what());
    }
  }
  if (runs.empty()) fmt::print("(no runs under {})\n", dir.string());
  return 0;
}

}  // namespace megacpp::supervisor
