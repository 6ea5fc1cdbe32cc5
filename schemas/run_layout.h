// Names of everything under a run directory and of a run's shm segments (README.md "What a run
// leaves behind"). The one place these conventions live; every stage and the collector use it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "schemas/common.capnp.h"

namespace megacpp::layout {

namespace fs = std::filesystem;

std::string_view stage_name(schema::StageKind stage);  // "data_loader", "trainer", ...
// Parses stage_name()'s output; throws Error{kInvalidArgument} otherwise.
schema::StageKind parse_stage(std::string_view name);
std::string process_name(schema::StageKind stage, uint32_t rank);  // "trainer-1"
std::string_view phase_name(schema::Phase phase);                  // "backward"

inline fs::path launch_path(const fs::path& run) {
  return run / "launch.json";
}
inline fs::path manifest_path(const fs::path& run) {
  return run / "manifest.json";
}
inline fs::path journal_dir(const fs::path& run) {
  return run / "journal";
}
// The ending of every journal file name (journal_path).
inline constexpr std::string_view kJournalSuffix = ".journal";
inline fs::path receipts_dir(const fs::path& run) {
  return run / "receipts";
}
// The receipts the collector writes for a run in a terminal state, by file name
// (receipt_path(run, kBenchResult) is RUN/receipts/bench_result.json).
inline constexpr std::string_view kBenchResult = "bench_result.json";
inline constexpr std::string_view kBenchTelemetry = "bench_telemetry.json";
inline constexpr std::string_view kBackendIdentity = "backend_identity.json";
inline constexpr std::string_view kRuntimeProvenance = "runtime_provenance.json";
inline constexpr std::string_view kFirstForward = "first_forward.json";
inline fs::path receipt_path(const fs::path& run, std::string_view receipt) {
  return receipts_dir(run) / receipt;
}
// Where a later attempt moves attempt `attempt`'s failure dumps: RUN/attempts/<attempt>/, the
// dumps keeping their path relative to the run (attempts/1/failures/trainer-0.json).
inline fs::path attempt_dir(const fs::path& run, uint32_t attempt) {
  return run / "attempts" / std::to_string(attempt);
}
inline fs::path failures_dir(const fs::path& run) {
  return run / "failures";
}
inline fs::path checkpoints_dir(const fs::path& run) {
  return run / "checkpoints";
}
inline fs::path logs_dir(const fs::path& run) {
  return run / "logs";
}
fs::path journal_path(const fs::path& run, schema::StageKind stage,
                      uint32_t rank);  // journal/trainer-1.journal
fs::path log_path(const fs::path& run, schema::StageKind stage,
                  uint32_t rank);  // logs/trainer-1.log
fs::path failure_path(const fs::path& run, schema::StageKind stage,
                      uint32_t rank);            // failures/trainer-1.json
std::string checkpoint_dir_name(uint32_t step);  // step_00000040
// The step a checkpoint_dir_name names; nullopt for any other name (tmp, .deleting, rejected).
std::optional<uint32_t> checkpoint_dir_step(std::string_view name);

// The most trainer ranks one run has (`megacpp run --ranks`).
inline constexpr uint32_t kMaxRanks = 256;

// A run id as the supervisor makes them: 1 to 64 of [A-Za-z0-9-]. Names are derived only from
// a valid one, so a run id read back from launch.json cannot name anything outside its run.
bool valid_run_id(std::string_view id);

// The shm prefix of a run: "/megacpp-<run id>-g<generation>-" (a function of the run id, so
// `megacpp status` recomputes it instead of trusting launch.json's copy). Throws
// Error{kInvalidArgument} for an invalid run id.
std::string shm_prefix(std::string_view run_id, uint32_t generation);

// shm names: "<prefix>ring-<rank>" (batch plane), "<prefix>val-<rank>" (its validation
// batches), "<prefix>stage-<rank>" (snapshot plane), "<prefix>xch-<group>-<rank>" (a group's
// exchange outboxes).
std::string ring_shm_name(std::string_view prefix, uint32_t rank);
std::string validation_ring_shm_name(std::string_view prefix, uint32_t rank);
std::string staging_shm_name(std::string_view prefix, uint32_t rank);
// The checkpointer's handle socket (ipc/handle_socket.h), where ranks send their exported
// staging buffers: "staging" beside the checkpoint endpoint's socket ("ipc://<dir>/checkpoint");
// empty for an endpoint that is not ipc://.
std::filesystem::path staged_handle_socket(std::string_view checkpoint_endpoint);
// Prefix of a process group's outboxes (ipc/peer_exchange.h): "<prefix>xch-<group>-", rank
// r's being that followed by r. `group` names the group among the run's ("dp", "tp0", ...).
std::string exchange_shm_prefix(std::string_view prefix, std::string_view group);

// Writes into a run directory. require_inside: throws Error{kInvalidArgument} (one line naming
// `p`) unless `p`, resolving symlinks, lies inside `root`, the run directory resolved
// (fs::weakly_canonical): a journal, receipts folder or manifest that is a symlink elsewhere
// must not make a command read or write outside the run. require_writable: the same for the
// parent of `path`, a file to be written in place under run directory `run`, and refuses a
// `path` that is itself a symlink (whatever it points at); the writer then opens it with
// O_NOFOLLOW, so a link put there after the check is refused too (ELOOP).
void require_inside(const fs::path& root, const fs::path& p);
void require_writable(const fs::path& run, const fs::path& path);

// The prefix of every shm segment of run `run_id`, of any generation: "/megacpp-<run id>-g".
// Throws Error{kInvalidArgument} for an invalid run id.
std::string run_shm_prefix(std::string_view run_id);

// A private socket directory (used when RUN/sock would make too long an ipc:// path) holds
// this file, whose content is the run id: the proof that the directory is the run's own.
inline constexpr std::string_view kSockOwnerFile = "run-id";
// The checkpointer's handle socket in the socket directory (staged_handle_socket).
inline constexpr std::string_view kStagingSocketFile = "staging";

}  // namespace megacpp::layout
