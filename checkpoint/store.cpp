// The commit protocol under RUN/checkpoints.
#include <capnp/message.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "checkpoint/detail/names.h"
#include "checkpoint/store.h"
#include "core/error.h"
#include "core/util.h"
#include "schemas/checkpoint.capnp.h"
#include "schemas/common.capnp.h"
#include "schemas/json.h"
#include "schemas/run_layout.h"

namespace megacpp::checkpoint {

using detail::kDeletingSuffix;
using detail::kManifestName;
using detail::kTmpSuffix;
using detail::rank_file_name;

namespace {

void make_dirs(Storage& storage, const fs::path& p) {
  if (const std::error_code ec = storage.make_dirs(p)) {
    MEGACPP_FAIL_SYS(ec.value(), "cannot create {}: {}", p.string(), ec.message());
  }
}

}  // namespace

void CheckpointStore::remove_tree(const fs::path& p) {
  if (const std::error_code ec = storage_->remove_all(p)) {
    MEGACPP_FAIL_SYS(ec.value(), "cannot remove {}: {}", p.string(), ec.message());
  }
}

bool is_out_of_space(int err) noexcept {
  return err == ENOSPC || err == EDQUOT || err == EFBIG;
}

namespace {
bool out_of_space(const Error& e) {
  return e.kind() == ErrorKind::kSystem && is_out_of_space(e.sys_errno());
}
}  // namespace

CheckpointStore::CheckpointStore(fs::path run_dir, std::string run_id, std::string recipe_hash,
                                 RetentionPolicy retention, std::unique_ptr<Storage> storage)
    : storage_(std::move(storage)),
      run_dir_(std::move(run_dir)),
      dir_(layout::checkpoints_dir(run_dir_)),
      run_id_(std::move(run_id)),
      recipe_hash_(std::move(recipe_hash)),
      retention_(retention) {
  make_dirs(*storage_, dir_);
  bool removed = false;
  for (const Storage::Entry& entry : storage_->list(dir_)) {
    const std::string& name = entry.name;
    const fs::path path = dir_ / name;
    if (entry.directory && name.ends_with(kTmpSuffix)) {
      log_warn("discarding uncommitted checkpoint {}", path.string());
      remove_tree(path);
      removed = true;
    } else if (entry.directory && name.ends_with(kDeletingSuffix)) {
      log_info("finishing the deletion of pruned checkpoint {}", path.string());
      remove_tree(path);
      removed = true;
    } else if (name.starts_with("LATEST.tmp.")) {  // write_file_atomic interrupted by a crash
      remove_tree(path);
      removed = true;
    } else if (entry.directory) {
      if (auto step = layout::checkpoint_dir_step(name); step && (!latest_ || *step > *latest_))
        latest_ = step;
    }
  }
  if (removed) storage_->sync_dir(dir_);
  if (latest_) {
    const std::string name = layout::checkpoint_dir_name(*latest_);
    const fs::path latest_file = dir_ / "LATEST";
    if (!storage_->exists(latest_file) || storage_->read(latest_file) != name + "\n") {
      log_warn("LATEST lags the newest committed checkpoint; moving it to {}", name);
      storage_->write_atomic(latest_file, name + "\n");
    }
  }
  prune();
}

fs::path CheckpointStore::tmp_dir(uint32_t step) const {
  return dir_ / (layout::checkpoint_dir_name(step) + std::string(kTmpSuffix));
}

void CheckpointStore::fail_out_of_space(uint32_t step, const Error& e, std::string_view detail) {
  // Best effort: what is missing is space, not the right to remove; a leftover tmp directory
  // is discarded by the next store anyway.
  if (const std::error_code ec = storage_->remove_all(tmp_dir(step)))
    log_warn("could not remove {}: {}", tmp_dir(step).string(), ec.message());
  pending_.erase(step);
  MEGACPP_FAIL_LIKE(e,
                    "checkpoint step {}: no space left on {} ({}: {}); free space there or lower "
                    "--keep-checkpoints",
                    step, dir_.string(), detail, std::strerror(e.sys_errno()));
}

const WrittenFile& CheckpointStore::write_rank(uint32_t step, uint32_t world, uint32_t rank,
                                               std::span<const TensorView> tensors,
                                               std::string_view layout) {
  MEGACPP_CHECK(world > 0 && rank < world, ErrorKind::kProtocol,
                fmt::format("snapshot of step {} from rank {} of world {}", step, rank, world));
  MEGACPP_CHECK(ranks_ == 0 || (rank >= first_rank_ && rank - first_rank_ < ranks_ &&
                                first_rank_ + ranks_ <= world),
                ErrorKind::kProtocol,
                fmt::format("snapshot of step {} from rank {}: this node commits ranks {}..{} "
                            "of world {}",
                            step, rank, first_rank_, first_rank_ + ranks_ - 1, world));
  const fs::path tmp = tmp_dir(step);
  auto it = pending_.find(step);
  if (it == pending_.end()) {
    if (storage_->exists(tmp)) remove_tree(tmp);
    try {
      make_dirs(*storage_, tmp);
    } catch (const Error& e) {
      if (!out_of_space(e)) throw;
      fail_out_of_space(step, e, fmt::format("creating {}", tmp.filename().string()));
    }
    it = pending_.emplace(step, Pending{world, {}}).first;
  }
  Pending& p = it->second;
  MEGACPP_CHECK(p.world == world, ErrorKind::kProtocol,
                fmt::format("step {}: rank {} reports world {} but an earlier rank reported {}",
                            step, rank, world, p.world));
  std::map<std::string, std::string> metadata{
      {"run_id", run_id_},
      {"recipe_hash", recipe_hash_},
      {"step", std::to_string(step)},
      {"rank", std::to_string(rank)},
      {"world", std::to_string(world)},
  };
  if (!layout.empty()) metadata.emplace("megacpp.layout", std::string(layout));
  p.files.erase(rank);
  const std::string file = rank_file_name(rank);
  uint64_t done = 0;
  uint64_t total = 0;
  auto progress = [&](uint64_t written, uint64_t size) {
    done = written;
    total = size;
    if (on_chunk_) on_chunk_();
  };
  try {
    WrittenFile written = write_safetensors(*storage_, tmp / file, tensors, metadata, progress);
    return p.files[rank] = std::move(written);
  } catch (const Error& e) {
    if (!out_of_space(e)) throw;
    fail_out_of_space(step, e, fmt::format("wrote {} of {} bytes of {}", done, total, file));
  }
}

bool CheckpointStore::complete(uint32_t step) const {
  auto it = pending_.find(step);
  return it != pending_.end() &&
         it->second.files.size() == (ranks_ != 0 ? ranks_ : it->second.world);
}

bool CheckpointStore::committed(uint32_t step) const {
  return storage_->is_directory(dir_ / layout::checkpoint_dir_name(step));
}

CommittedCheckpoint CheckpointStore::commit(uint32_t step) {
  MEGACPP_CHECK(complete(step), ErrorKind::kInternal,
                fmt::format("commit of step {} before every rank was written", step));
  const Pending& p = pending_.at(step);
  const std::string name = layout::checkpoint_dir_name(step);
  const fs::path tmp = tmp_dir(step);
  const fs::path final_dir = dir_ / name;

  capnp::MallocMessageBuilder message;
  auto manifest = message.initRoot<schema::CheckpointManifest>();
  manifest.setSchemaVersion(schema::SCHEMA_VERSION);
  manifest.setRunId(run_id_);
  manifest.setStep(step);
  manifest.setWorld(p.world);
  manifest.setCreatedAt(rfc3339(wall_ns()));
  manifest.setRecipeHash(recipe_hash_);
  manifest.setMode(mode_);
  manifest.setTensorParallel(tensor_parallel_);
  if (ranks_ != 0 && ranks_ != p.world) {
    manifest.setFirstRank(first_rank_);
    manifest.setRanks(ranks_);
  }
  auto files = manifest.initFiles(static_cast<unsigned>(p.files.size()));
  uint64_t bytes = 0;
  unsigned i = 0;
  for (const auto& [rank, written] : p.files) {
    auto f = files[i++];
    f.setName(rank_file_name(rank));
    f.setBytes(written.bytes);
    f.setXxh3(written.xxh3);
    f.setTensors(written.tensors);
    bytes += written.bytes;
  }
  manifest.setSelfXxh3("");  // hashed as verify_checkpoint renders it
  manifest.setSelfXxh3(xxh3_hex(schemas::to_json(manifest.asReader())));
  const std::string json = schemas::to_json(manifest.asReader());
  const uint64_t rank_bytes = bytes;
  bytes += json.size();

  CommittedCheckpoint out{step, final_dir, (fs::path("checkpoints") / name).string(), bytes};
  const bool exists = storage_->exists(final_dir);
  std::string_view doing = kManifestName;
  try {
    // write_atomic makes the file and its entry in the tmp directory durable.
    storage_->write_atomic(tmp / kManifestName, json);
    if (!exists) {
      doing = "the rename into place";
      if (const std::error_code ec = storage_->rename(tmp, final_dir)) {
        // The message of the SYSCALL_CHECK this rename was once called under.
        ::megacpp::detail::throw_syscall("::rename(tmp.c_str(), final_dir.c_str())", ec.value(),
                                         __FILE__, __LINE__);
      }
    }
  } catch (const Error& e) {
    if (!out_of_space(e)) throw;
    fail_out_of_space(step, e,
                      fmt::format("wrote {} of {} bytes; {} failed", rank_bytes, bytes, doing));
  }
  if (exists) {
    log_warn("checkpoint {} is already committed; keeping it and discarding the new copy", name);
    remove_tree(tmp);
    out.bytes = 0;
    for (const Storage::Entry& entry : storage_->list(final_dir)) {
      if (entry.regular_file) out.bytes += storage_->file_size(final_dir / entry.name);
    }
  }
  storage_->sync_dir(dir_);
  pending_.erase(step);
  if (!latest_ || step >= *latest_) {
    try {
      storage_->write_atomic(dir_ / "LATEST", name + "\n");
    } catch (const Error& e) {
      if (!out_of_space(e)) throw;
      // The step is committed; LATEST still names the previous one (a restarted store moves
      // it forward, as after a crash between the rename and LATEST).
      MEGACPP_FAIL_LIKE(e,
                        "checkpoint step {}: no space left on {} (LATEST could not be replaced: "
                        "{}; it still names {}); free space there or lower --keep-checkpoints",
                        step, dir_.string(), std::strerror(e.sys_errno()),
                        latest_ ? layout::checkpoint_dir_name(*latest_) : "nothing");
    }
    latest_ = step;
  }
  return out;
}

std::vector<uint32_t> CheckpointStore::committed_steps() const {
  std::vector<uint32_t> steps;
  for (const Storage::Entry& entry : storage_->list(dir_)) {
    if (!entry.directory) continue;
    if (auto step = layout::checkpoint_dir_step(entry.name)) steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::vector<uint32_t> CheckpointStore::prune() {
  std::vector<uint32_t> deleted;
  if (retention_.keep == 0) return deleted;
  const std::vector<uint32_t> steps = committed_steps();
  if (steps.size() <= retention_.keep) return deleted;
  const size_t newest_kept = steps.size() - retention_.keep;  // steps[newest_kept..] stay
  // A job across nodes: the job's newest step (JOB_LATEST) and later ones stay, and every step
  // stays until the job named one.
  std::optional<uint32_t> job_latest;
  if (const fs::path f = dir_ / kJobLatestName; storage_->exists(f)) {
    std::string name = storage_->read(f);
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    job_latest = layout::checkpoint_dir_step(name);
  }
  if (ranks_ != 0 && !job_latest) return deleted;
  for (size_t i = 0; i < newest_kept; ++i) {
    const uint32_t step = steps[i];
    if (job_latest && step >= *job_latest) continue;
    if (retention_.keep_every != 0 && step % retention_.keep_every == 0) continue;
    if (latest_ && step == *latest_) continue;  // LATEST always names a committed checkpoint
    const std::string name = layout::checkpoint_dir_name(step);
    const fs::path from = dir_ / name;
    const fs::path to = dir_ / (name + std::string(kDeletingSuffix));
    if (storage_->exists(to)) remove_tree(to);
    if (const std::error_code ec = storage_->rename(from, to)) {
      const int err = ec.value();
      MEGACPP_FAIL_SYS(err, "cannot rename {} to {} to delete it: {}", from.string(), to.string(),
                       std::strerror(err));
    }
    storage_->sync_dir(dir_);
    remove_tree(to);
    deleted.push_back(step);
    log_info("deleted checkpoint {} (keeping the newest {}{})", name, retention_.keep,
             retention_.keep_every ? fmt::format(" and every multiple of {}", retention_.keep_every)
                                   : std::string());
  }
  return deleted;
}

void CheckpointStore::discard(uint32_t step) {
  remove_tree(tmp_dir(step));
  pending_.erase(step);
}

void CheckpointStore::discard_all() {
  while (!pending_.empty()) discard(pending_.begin()->first);
}

std::vector<uint32_t> CheckpointStore::pending() const {
  std::vector<uint32_t> out;
  for (const auto& [step, p] : pending_) out.push_back(step);
  return out;
}

}  // namespace megacpp::checkpoint
