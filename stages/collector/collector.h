// megacpp::collector — the fold: journals + launch contract -> manifest + receipts (DESIGN.md
// "Decisions": the final fold).
//
// Contract: the outputs are a pure function of the run directory. Every field derives from
// journal content or launch.json (never from the clock at fold time); journals are read in
// sorted file-name order and every merge rule is independent of how the records were split
// across polls, so the live collector, a restarted one and `megacpp collect RUN` agree, and
// re-collecting an unchanged run produces byte-identical files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>

namespace megacpp::collector {

// Folds a whole run directory once (every journal read to its end, partial tails counted as
// torn) and writes RUN/manifest.json and, in a terminal state, RUN/receipts/*.json. Files
// whose bytes would not change are not rewritten. Throws Error{kSystem}/{kCorruption} when
// launch.json is missing or malformed.
void collect_run(const std::filesystem::path& run_dir);

// Incremental fold for the live collector. Not thread-safe.
class Collector {
 public:
  // Reads RUN/launch.json (throws as collect_run). Reads no journal yet.
  explicit Collector(std::filesystem::path run_dir);
  ~Collector();
  Collector(const Collector&) = delete;
  Collector& operator=(const Collector&) = delete;

  // Folds every record appended since the last call (new journal files are picked up);
  // a trailing partial frame waits for the next poll. Returns true if the rendered outputs
  // differ from those of the previous poll (always true on the first). `after_journal`, if
  // given, is called after each journal file is folded: the live collector stamps its
  // progress there, so a first fold of a long run's journals is not taken for a wedged one.
  bool poll(const std::function<void()>& after_journal = {});
  // No more records will come: remaining partial tails are counted as torn.
  void finish();
  // Writes manifest.json and the receipts (terminal states only) with write_file_atomic,
  // skipping every file whose current bytes on disk are already identical.
  void write();

  // The rendered outputs as of the last poll()/finish(): relative path -> bytes
  // ("manifest.json", "receipts/bench_result.json", ...).
  const std::map<std::string, std::string>& outputs() const noexcept { return outputs_; }
  // wallNs of the newest record folded so far (0 before any): the live collector reports
  // its lag as the age of the newest record at the moment it was folded.
  int64_t newest_record_wall_ns() const;

 private:
  struct State;
  void render();
  std::filesystem::path run_dir_;
  std::unique_ptr<State> state_;
  std::map<std::string, std::string> outputs_;
  std::map<std::string, std::string> on_disk_;  // bytes known to be on disk, by relative path
};

}  // namespace megacpp::collector
