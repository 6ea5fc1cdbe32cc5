// Orphaned runs: a run whose supervisor is gone is recorded as orphaned, and what that
// supervisor would have removed (shm segments, its socket directory) is removed, and nothing
// else: see reconcile().
#include "supervisor/commands/commands.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/journal.h"
#include "ipc/shm.h"
#include "schemas/enums.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"
#include "supervisor/process.h"

namespace megacpp::supervisor {

namespace fs = std::filesystem;
using schema::StageKind;

namespace detail {

namespace {

// Removes `dir` when it is provably the private socket directory of run `run_id`: exactly
// /tmp/megacpp-XXXXXX as prepare() makes it, a real directory owned by this user, its owner
// file naming the run, and nothing in it but that file and the run's endpoints. Removes only
// those entries, then the directory; never recurses.
bool remove_private_sock_dir(const fs::path& dir, const std::string& run_id) {
  const std::string name = dir.filename().string();
  if (!layout::valid_run_id(run_id) || dir != dir.lexically_normal() ||
      dir.parent_path() != "/tmp" || !name.starts_with("megacpp-") || name.size() != 14) {
    return false;
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid())
    return false;
  const fs::path owner = dir / layout::kSockOwnerFile;
  if (::lstat(owner.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  try {
    if (read_file(owner) != run_id) return false;
  } catch (const Error&) {
    return false;
  }
  static const std::set<std::string> kEntries = {std::string(layout::kSockOwnerFile), "control",
                                                 "checkpoint",
                                                 std::string(layout::kStagingSocketFile)};
  std::error_code ec;
  std::vector<fs::path> entries;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (!kEntries.contains(it->path().filename().string())) return false;
    entries.push_back(it->path());
  }
  if (ec) return false;
  for (const auto& e : entries) ::unlink(e.c_str());
  return ::rmdir(dir.c_str()) == 0;
}

}  // namespace

}  // namespace detail

bool reconcile(const fs::path& run_dir) {
  // A run whose supervisor journal ends without runFinished, and whose supervisor process
  // (pid + start time from launch.json) no longer exists, was orphaned: record it and remove
  // what the supervisor would have removed. Stages cannot outlive it (PR_SET_PDEATHSIG).
  schemas::JsonFile<schema::LaunchContract> launch(layout::launch_path(run_dir));
  auto l = launch.get();
  // Only the current attempt's end counts: an earlier attempt finished before this one began.
  bool finished = false, orphaned = false;
  ipc::JournalReader::read_all(layout::journal_path(run_dir, StageKind::SUPERVISOR, 0),
                               [&](schema::JournalRecord::Reader r) {
                                 if (r.getAttempt() != l.getAttempt()) return;
                                 finished = finished || r.isRunFinished();
                                 orphaned = orphaned || r.isRunOrphaned();
                               });
  if (finished || orphaned) return false;
  const pid_t pid = l.getSupervisorPid();
  if (detail::process_alive(pid, l.getSupervisorStartTicks())) return false;
  // Written in place, so never through a link nor outside the run directory (a refusal is one
  // line, and nothing is removed).
  const fs::path journal_file = layout::journal_path(run_dir, StageKind::SUPERVISOR, 0);
  layout::require_writable(run_dir, journal_file);
  ipc::JournalWriter journal(journal_file);
  journal.set_identity(StageKind::SUPERVISOR, 0);
  journal.set_attempt(l.getAttempt());
  journal.append([&](schema::JournalRecord::Builder r) {
    auto o = r.initRunOrphaned();
    o.setSupervisorPid(pid);
    o.setReason(fmt::format("the supervisor (pid {}) is gone and the run never finished", pid));
  });
  journal.sync();
  // The segments removed are the ones the run created under its prefix (rings, staging,
  // exchange outboxes), derived from the validated run id, never a name read from launch.json.
  // launch.json's run id can still name another run: if a live process maps or holds any
  // segment of that run id (of any attempt), the run is alive and nothing of it is removed.
  const std::string run_id = l.getRunId();
  size_t segments = 0;
  if (!layout::valid_run_id(run_id)) {
    log_warn("run {}: launch.json's runId '{}' is not a run id; no shm segment removed",
             run_dir.string(), run_id);
  } else if (const auto users = ipc::shm_users(layout::run_shm_prefix(run_id)); !users.empty()) {
    log_warn(
        "run {}: shm segment {} of run id {} is in use by the live process {}; no shm "
        "segment removed",
        run_dir.string(), users.begin()->first, run_id, users.begin()->second);
  } else {
    segments = ipc::unlink_shm(layout::shm_prefix(run_id, l.getAttempt()));
  }
  std::vector<std::string> removed;
  std::error_code ec;
  const fs::path own_sock = run_dir / "sock";
  if (fs::is_directory(fs::symlink_status(own_sock, ec))) {
    fs::remove_all(own_sock, ec);
    removed.push_back(own_sock.string());
  }
  const fs::path sock = fs::path(l.getSockDir().cStr());
  if (!sock.empty() && sock != own_sock && fs::exists(fs::symlink_status(sock, ec))) {
    if (detail::remove_private_sock_dir(sock, run_id)) {
      removed.push_back(sock.string());
    } else {
      log_warn("run {}: socket directory {} is not provably this run's; left in place",
               run_dir.string(), sock.string());
    }
  }
  log_warn("run {} was orphaned (supervisor pid {} is gone); removed {} shm segment(s){}{}",
           run_dir.string(), pid, segments, removed.empty() ? "" : " and ",
           fmt::join(removed, ", "));
  return true;
}

}  // namespace megacpp::supervisor
