// The live fold's driver: finds the run's journals, feeds their records to the fold state
// (detail/fold_state.h), renders the documents (detail/documents.h) and writes what changed.
#include "stages/collector/collector.h"

#include <system_error>
#include <utility>

#include "core/error.h"
#include "core/util.h"
#include "ipc/journal.h"
#include "schemas/common.capnp.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"
#include "stages/collector/detail/documents.h"
#include "stages/collector/detail/fold_state.h"

namespace megacpp::collector {

namespace fs = std::filesystem;
using schema::StageKind;

struct Collector::State {
  detail::FoldState fold;
  std::map<std::string, std::unique_ptr<ipc::JournalReader>> journals;  // by file name

  // Copies each journal's counts into the fold state, which the manifest reports.
  void count_journals() {
    for (const auto& [name, reader] : journals) {
      detail::JournalCount& c = fold.journals[name];
      c.records = reader->stats().records;
      c.torn_bytes = reader->stats().torn_bytes;
      c.trainer = name.starts_with(std::string(layout::stage_name(StageKind::TRAINER)) + "-");
    }
  }
};

Collector::Collector(fs::path run_dir)
    : run_dir_(std::move(run_dir)), state_(std::make_unique<State>()) {
  schemas::JsonFile<schema::LaunchContract> launch(layout::launch_path(run_dir_));
  auto l = launch.get();
  // A newer format may mean what this build cannot know (tests/schema_snapshots): refused by
  // name, never folded into a manifest that would look complete.
  MEGACPP_CHECK(l.getSchemaVersion() <= schema::SCHEMA_VERSION, ErrorKind::kInvalidArgument,
                fmt::format("run {} was written in run format version {}; this megacpp reads "
                            "versions up to {}: collect it with a newer megacpp",
                            run_dir_.string(), l.getSchemaVersion(), schema::SCHEMA_VERSION));
  state_->fold.read_launch(l);
}

Collector::~Collector() = default;

bool Collector::poll(const std::function<void()>& after_journal) {
  const fs::path dir = layout::journal_dir(run_dir_);
  const fs::path root = fs::weakly_canonical(run_dir_);
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir, ec))) layout::require_inside(root, dir);
  if (fs::is_directory(dir, ec)) {
    fs::directory_iterator it(dir, ec);
    if (ec) {
      MEGACPP_FAIL_SYS(ec.value(), "cannot list {}: {}", dir.string(), ec.message());
    }
    for (const auto& entry : it) {
      const std::string name = entry.path().filename().string();
      if (!name.ends_with(layout::kJournalSuffix) || !entry.is_regular_file() ||
          state_->journals.contains(name)) {
        continue;
      }
      layout::require_inside(root, entry.path());
      state_->journals.emplace(name, std::make_unique<ipc::JournalReader>(entry.path()));
    }
  }
  for (auto& [name, reader] : state_->journals) {
    reader->poll([this](schema::JournalRecord::Reader rec) { state_->fold.fold(rec); });
    if (after_journal) after_journal();
  }
  auto before = std::move(outputs_);
  render();
  return before != outputs_;
}

int64_t Collector::newest_record_wall_ns() const {
  return state_->fold.newest_wall.value_or(0);
}

void Collector::finish() {
  for (auto& [name, reader] : state_->journals) {
    reader->finish([this](schema::JournalRecord::Reader rec) { state_->fold.fold(rec); });
  }
  render();
}

void Collector::render() {
  state_->count_journals();
  outputs_ = detail::render_documents(state_->fold, run_dir_);
}

void Collector::write() {
  const fs::path root = fs::weakly_canonical(run_dir_);
  for (const auto& [rel, bytes] : outputs_) {
    auto known = on_disk_.find(rel);
    if (known != on_disk_.end() && known->second == bytes) continue;
    const fs::path path = run_dir_ / rel;
    layout::require_inside(root, path);
    std::error_code ec;
    bool same = false;
    if (fs::exists(path, ec)) {
      try {
        same = read_file(path) == bytes;
      } catch (const Error&) {
        same = false;  // unreadable: replace it
      }
    }
    if (!same) {
      fs::create_directories(path.parent_path(), ec);
      if (ec) {
        MEGACPP_FAIL_SYS(ec.value(), "cannot create {}: {}", path.parent_path().string(),
                         ec.message());
      }
      write_file_atomic(path, bytes);
    }
    on_disk_[rel] = bytes;
  }
}

void collect_run(const fs::path& run_dir) {
  Collector c(run_dir);
  c.poll();
  c.finish();
  c.write();
}

}  // namespace megacpp::collector
