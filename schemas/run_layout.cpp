#include "schemas/run_layout.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"

namespace megacpp::layout {

std::string_view stage_name(schema::StageKind stage) {
  switch (stage) {
    case schema::StageKind::SUPERVISOR:
      return "supervisor";
    case schema::StageKind::DATA_LOADER:
      return "data_loader";
    case schema::StageKind::TRAINER:
      return "trainer";
    case schema::StageKind::COLLECTOR:
      return "collector";
    case schema::StageKind::CHECKPOINTER:
      return "checkpointer";
  }
  return "unknown";
}

schema::StageKind parse_stage(std::string_view name) {
  for (auto s :
       {schema::StageKind::SUPERVISOR, schema::StageKind::DATA_LOADER, schema::StageKind::TRAINER,
        schema::StageKind::COLLECTOR, schema::StageKind::CHECKPOINTER}) {
    if (stage_name(s) == name) return s;
  }
  MEGACPP_FAIL(ErrorKind::kInvalidArgument, "unknown stage '{}'", name);
}

std::string_view phase_name(schema::Phase phase) {
  switch (phase) {
    case schema::Phase::STARTUP:
      return "startup";
    case schema::Phase::WAIT_BATCH:
      return "wait_batch";
    case schema::Phase::FORWARD:
      return "forward";
    case schema::Phase::BACKWARD:
      return "backward";
    case schema::Phase::OPTIMIZER:
      return "optimizer";
    case schema::Phase::SNAPSHOT:
      return "snapshot";
    case schema::Phase::IDLE:
      return "idle";
    case schema::Phase::SHUTDOWN:
      return "shutdown";
    case schema::Phase::PRODUCE:
      return "produce";
    case schema::Phase::WRITE:
      return "write";
    case schema::Phase::EVALUATE:
      return "evaluate";
  }
  return "unknown";
}

std::string process_name(schema::StageKind stage, uint32_t rank) {
  return fmt::format("{}-{}", stage_name(stage), rank);
}

fs::path journal_path(const fs::path& run, schema::StageKind stage, uint32_t rank) {
  return journal_dir(run) / (process_name(stage, rank) + std::string(kJournalSuffix));
}
fs::path log_path(const fs::path& run, schema::StageKind stage, uint32_t rank) {
  return logs_dir(run) / (process_name(stage, rank) + ".log");
}
fs::path failure_path(const fs::path& run, schema::StageKind stage, uint32_t rank) {
  return failures_dir(run) / (process_name(stage, rank) + ".json");
}
std::string checkpoint_dir_name(uint32_t step) {
  return fmt::format("step_{:08d}", step);
}

std::optional<uint32_t> checkpoint_dir_step(std::string_view name) {
  if (name.size() != 13 || !name.starts_with("step_")) return std::nullopt;
  uint64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(name[i] - '0');
  }
  if (v > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(v);
}

bool valid_run_id(std::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
    if (!ok) return false;
  }
  return true;
}

std::string run_shm_prefix(std::string_view run_id) {
  MEGACPP_CHECK(valid_run_id(run_id), ErrorKind::kInvalidArgument,
                fmt::format("'{}' is not a run id (1 to 64 of A-Z a-z 0-9 -)", run_id));
  return fmt::format("/megacpp-{}-g", run_id);
}

std::string shm_prefix(std::string_view run_id, uint32_t generation) {
  return fmt::format("{}{}-", run_shm_prefix(run_id), generation);
}

void require_inside(const fs::path& root, const fs::path& p) {
  const fs::path resolved = fs::weakly_canonical(p);
  const auto [r, q] = std::mismatch(root.begin(), root.end(), resolved.begin(), resolved.end());
  if (r != root.end())
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "{} leads outside the run directory {} (to {}): refusing it", p.string(),
                 root.string(), resolved.string());
}

void require_writable(const fs::path& run, const fs::path& path) {
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(path, ec)))
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "{} is a symbolic link (to {}): refusing to write through it; a run directory's "
                 "files must be its own",
                 path.string(), fs::read_symlink(path, ec).string());
  require_inside(fs::weakly_canonical(run), path.parent_path());
}

std::string ring_shm_name(std::string_view prefix, uint32_t rank) {
  return fmt::format("{}ring-{}", prefix, rank);
}
std::string validation_ring_shm_name(std::string_view prefix, uint32_t rank) {
  return fmt::format("{}val-{}", prefix, rank);
}
std::string staging_shm_name(std::string_view prefix, uint32_t rank) {
  return fmt::format("{}stage-{}", prefix, rank);
}
std::filesystem::path staged_handle_socket(std::string_view checkpoint_endpoint) {
  constexpr std::string_view kIpc = "ipc://";
  if (!checkpoint_endpoint.starts_with(kIpc)) return {};
  return std::filesystem::path(checkpoint_endpoint.substr(kIpc.size())).parent_path() /
         kStagingSocketFile;
}
std::string exchange_shm_prefix(std::string_view prefix, std::string_view group) {
  return fmt::format("{}xch-{}-", prefix, group);
}

}  // namespace megacpp::layout
