// megacpp::supervisor commands over run directories that need no live job of their own:
// `megacpp stop`, `status` (and `status --watch`), `list`, `compare`, `report`, `collect --all`,
// and the reconcile of orphaned runs that `status`, `collect` and `run --resume` begin with. Each
// reads the run directory (launch.json, journals, manifest, receipts) and signals at most the
// run's supervisor; none starts a stage (DESIGN.md "Layout additions").
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "schemas/manifest.capnp.h"

namespace megacpp::supervisor {

// `megacpp stop RUN`: SIGTERM to the run's live supervisor (pid and start time from launch.json),
// the graceful stop of a terminal's Ctrl-C. With `wait`, returns once the supervisor is gone
// (Error{kTimeout} after timeout_s), printing the run's status. Error{kInvalidArgument} when the
// run is not running.
int stop(const std::filesystem::path& run_dir, bool wait, double timeout_s);

// `megacpp status RUN --watch`: while the supervisor lives, one line every interval_s (step,
// mean loss, tokens/s over the last 20 steps, stages up, ETA) from the trainers' journals and
// the live manifest, rewritten in place on a terminal; then the run's status.
int watch_status(const std::filesystem::path& run_dir, double interval_s);

// `megacpp compare RUN...`: the runs' comparison class (recipe and hash, mode, world, backend,
// device, build, data) must be one, else Error{kInvalidArgument} lists the fields that differ
// (`force` prints them anyway under a cross-class label); then a table of tokens/s, step time
// p50/p99, checkpoint stall, restarts and the loss at steps every run recorded. Each run must
// have its receipts (ended).
int compare_runs(const std::vector<std::filesystem::path>& runs, bool force);

// How a comparison class names a run's build ("<revision>[+dirty] <build type> <compiler> torch
// <version>") and its data (XXH3 over every file's XXH3 and token count, in order; "-" for
// none). A job's nodes compare the same texts when they join (membership.h), so what `compare`
// and a join call the same build cannot drift apart.
std::string build_name(std::string_view revision, bool dirty, std::string_view build_type,
                       std::string_view compiler, std::string_view torch_version);
struct DataFile {
  std::string xxh3;
  uint64_t tokens = 0;
};
std::string dataset_digest(const std::vector<DataFile>& files);

// `megacpp collect --all DIR`: reconciles and re-folds every run directly under DIR or one
// folder below on `jobs` threads, then prints one summary line (runs collected, changed,
// unchanged, time per run). A run still running, or one that cannot be folded (a newer format, a
// corrupt launch contract, a path leading outside it), is one line on stderr and makes the exit
// status 1; the others are collected.
int collect_all(const std::filesystem::path& dir, unsigned jobs);

// `megacpp report RUN... --out DIR`: writes DIR/index.html, one self-contained page (no network,
// no script): plots of loss and tokens/s per step (one line per run, later attempts' starts
// marked) as inline SVG, then each run's state, first failure, stages and attempts.
int write_report(const std::vector<std::filesystem::path>& runs, const std::filesystem::path& out);

// `megacpp list DIR`: every run directly under DIR or one folder below, with its state,
// recipe, steps, last loss, start and duration.
int list_runs(const std::filesystem::path& dir);

// If the run never finished and its supervisor is gone, records it as orphaned and removes
// what the supervisor would have removed (shm segments, the socket directory). Returns true
// when it changed anything. Used by `megacpp status` and `megacpp collect` before they fold.
bool reconcile(const std::filesystem::path& run_dir);

// `megacpp status RUN`: reconciles, folds, and prints the manifest readably; returns 0 if it
// could be read.
int status(const std::filesystem::path& run_dir);

namespace detail {
// How a first failure's detection delay reads ("detected 0.12s after the cause", or not
// measured): `megacpp status` and the run's own report say it the same way.
std::string detection_text(schema::RunError::Reader e);
}  // namespace detail

}  // namespace megacpp::supervisor
