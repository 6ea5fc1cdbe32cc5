// Orphaned runs: a run whose supervisor is gone is recorded as orphaned, and what that
// supervisor would have removed (shm segments, its socket directory) is removed.
#include "supervisor/detail/run.h"

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
#include "schemas/enums.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"
#include "supervisor/process.h"

namespace megacpp::supervisor {

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
                                                 "checkpoint"};
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
  ipc::JournalWriter journal(layout::journal_path(run_dir, StageKind::SUPERVISOR, 0));
  journal.set_identity(StageKind::SUPERVISOR, 0);
  journal.set_attempt(l.getAttempt());
  journal.append([&](schema::JournalRecord::Builder r) {
    auto o = r.initRunOrphaned();
    o.setSupervisorPid(pid);
    o.setReason(fmt::format("the supervisor (pid {}) is gone and the run never finished", pid));
  });
  journal.sync();
  // What is removed is derived from the run id and the run directory, never read from
  // launch.json: a corrupt or hostile contract must not name another run's segments or an
  // arbitrary directory.
  const std::string run_id = l.getRunId();
  size_t segments = 0;
  if (layout::valid_run_id(run_id)) {
    const std::string prefix = layout::shm_prefix(run_id, l.getAttempt());
    for (uint32_t r = 0; r < layout::kMaxRanks; ++r) {
      for (const auto& name :
           {layout::ring_shm_name(prefix, r), layout::staging_shm_name(prefix, r)})
        segments += ::shm_unlink(name.c_str()) == 0 ? 1 : 0;
    }
  } else {
    log_warn("run {}: launch.json's runId '{}' is not a run id; no shm segment removed",
             run_dir.string(), run_id);
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
