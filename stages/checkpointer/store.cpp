// The commit protocol under RUN/checkpoints and the checkpoint verifier.
#include <capnp/message.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "core/error.h"
#include "core/util.h"
#include "schemas/checkpoint.capnp.h"
#include "schemas/common.capnp.h"
#include "schemas/json.h"
#include "schemas/run_layout.h"
#include "stages/checkpointer/checkpointer.h"

namespace megacpp::checkpointer {

namespace {

constexpr std::string_view kTmpSuffix = ".tmp";
// A committed checkpoint being pruned: renamed to this first, so a crash mid-removal leaves a
// name the next store removes, never a damaged step_NNNNNNNN.
constexpr std::string_view kDeletingSuffix = ".deleting";
constexpr std::string_view kManifestName = "checkpoint.json";

std::string rank_file_name(uint32_t rank) {
  return fmt::format("rank_{}.safetensors", rank);
}

void remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) {
    MEGACPP_FAIL_SYS(ec.value(), "cannot remove {}: {}", p.string(), ec.message());
  }
}

void make_dirs(const fs::path& p) {
  std::error_code ec;
  fs::create_directories(p, ec);
  if (ec) {
    MEGACPP_FAIL_SYS(ec.value(), "cannot create {}: {}", p.string(), ec.message());
  }
}

}  // namespace

bool is_out_of_space(int err) noexcept {
  return err == ENOSPC || err == EDQUOT || err == EFBIG;
}

namespace {
bool out_of_space(const Error& e) {
  return e.kind() == ErrorKind::kSystem && is_out_of_space(e.sys_errno());
}
}  // namespace

CheckpointStore::CheckpointStore(fs::path run_dir, std::string run_id, std::string recipe_hash,
                                 RetentionPolicy retention)
    : run_dir_(std::move(run_dir)),
      dir_(layout::checkpoints_dir(run_dir_)),
      run_id_(std::move(run_id)),
      recipe_hash_(std::move(recipe_hash)),
      retention_(retention) {
  make_dirs(dir_);
  bool removed = false;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.ends_with(kTmpSuffix)) {
      log_warn("discarding uncommitted checkpoint {}", entry.path().string());
      remove_tree(entry.path());
      removed = true;
    } else if (entry.is_directory() && name.ends_with(kDeletingSuffix)) {
      log_info("finishing the deletion of pruned checkpoint {}", entry.path().string());
      remove_tree(entry.path());
      removed = true;
    } else if (name.starts_with("LATEST.tmp.")) {  // write_file_atomic interrupted by a crash
      remove_tree(entry.path());
      removed = true;
    } else if (entry.is_directory()) {
      if (auto step = layout::checkpoint_dir_step(name); step && (!latest_ || *step > *latest_))
        latest_ = step;
    }
  }
  if (removed) fsync_path(dir_);
  if (latest_) {
    const std::string name = layout::checkpoint_dir_name(*latest_);
    const fs::path latest_file = dir_ / "LATEST";
    if (!fs::exists(latest_file) || read_file(latest_file) != name + "\n") {
      log_warn("LATEST lags the newest committed checkpoint; moving it to {}", name);
      write_file_atomic(latest_file, name + "\n");
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
  std::error_code ec;
  fs::remove_all(tmp_dir(step), ec);
  if (ec) log_warn("could not remove {}: {}", tmp_dir(step).string(), ec.message());
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
  const fs::path tmp = tmp_dir(step);
  auto it = pending_.find(step);
  if (it == pending_.end()) {
    if (fs::exists(tmp)) remove_tree(tmp);
    try {
      make_dirs(tmp);
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
    WrittenFile written = write_safetensors(tmp / file, tensors, metadata, progress);
    return p.files[rank] = std::move(written);
  } catch (const Error& e) {
    if (!out_of_space(e)) throw;
    fail_out_of_space(step, e, fmt::format("wrote {} of {} bytes of {}", done, total, file));
  }
}

bool CheckpointStore::complete(uint32_t step) const {
  auto it = pending_.find(step);
  return it != pending_.end() && it->second.files.size() == it->second.world;
}

bool CheckpointStore::committed(uint32_t step) const {
  return fs::is_directory(dir_ / layout::checkpoint_dir_name(step));
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
  const bool exists = fs::exists(final_dir);
  std::string_view doing = kManifestName;
  try {
    // write_file_atomic fsyncs the file and the tmp directory that holds it.
    write_file_atomic(tmp / kManifestName, json);
    if (!exists) {
      doing = "the rename into place";
      SYSCALL_CHECK(::rename(tmp.c_str(), final_dir.c_str()));
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
    for (const auto& entry : fs::directory_iterator(final_dir)) {
      if (entry.is_regular_file()) out.bytes += entry.file_size();
    }
  }
  fsync_path(dir_);
  pending_.erase(step);
  if (!latest_ || step >= *latest_) {
    try {
      write_file_atomic(dir_ / "LATEST", name + "\n");
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
  for (const auto& entry : fs::directory_iterator(dir_)) {
    if (!entry.is_directory()) continue;
    if (auto step = layout::checkpoint_dir_step(entry.path().filename().string()))
      steps.push_back(*step);
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
  for (size_t i = 0; i < newest_kept; ++i) {
    const uint32_t step = steps[i];
    if (retention_.keep_every != 0 && step % retention_.keep_every == 0) continue;
    if (latest_ && step == *latest_) continue;  // LATEST always names a committed checkpoint
    const std::string name = layout::checkpoint_dir_name(step);
    const fs::path from = dir_ / name;
    const fs::path to = dir_ / (name + std::string(kDeletingSuffix));
    if (fs::exists(to)) remove_tree(to);
    if (::rename(from.c_str(), to.c_str()) != 0) {
      const int err = errno;
      MEGACPP_FAIL_SYS(err, "cannot rename {} to {} to delete it: {}", from.string(), to.string(),
                       std::strerror(err));
    }
    fsync_path(dir_);
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

VerifyResult verify_checkpoint(const fs::path& dir) {
  VerifyResult result;
  auto problem = [&](std::string text) { result.problems.push_back(std::move(text)); };
  try {
    const std::string text = read_file(dir / kManifestName);
    schemas::JsonDocument<schema::CheckpointManifest> doc(text, (dir / kManifestName).string());
    auto manifest = doc.get();
    // The file must be exactly what its fields render to (a damaged key or value that still
    // parses renders differently), and hash, with selfXxh3 empty, to selfXxh3 (absent in
    // checkpoints written before it).
    if (schemas::to_json(manifest) != text)
      problem(fmt::format("{}: not as written (a damaged byte that still parses)", kManifestName));
    if (manifest.hasSelfXxh3() && manifest.getSelfXxh3().size() > 0) {
      const std::string recorded = manifest.getSelfXxh3();
      doc.builder().setSelfXxh3("");
      const std::string hash = xxh3_hex(schemas::to_json(doc.get()));
      if (hash != recorded)
        problem(fmt::format("{}: xxh3 {} expected {}", kManifestName, hash, recorded));
      doc.builder().setSelfXxh3(recorded);
      manifest = doc.get();
    }
    std::string dir_name = dir.filename().string();
    if (dir_name.ends_with(kTmpSuffix)) dir_name.resize(dir_name.size() - kTmpSuffix.size());
    if (layout::checkpoint_dir_step(dir_name) &&
        dir_name != layout::checkpoint_dir_name(manifest.getStep())) {
      problem(fmt::format("{} records step {}", dir_name, manifest.getStep()));
    }
    if (manifest.getFiles().size() != manifest.getWorld()) {
      problem(fmt::format("{} lists {} files for world {}", kManifestName,
                          manifest.getFiles().size(), manifest.getWorld()));
    }
    for (auto f : manifest.getFiles()) {
      const std::string name = f.getName();
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
        problem(fmt::format("bad file name '{}' in {}", name, kManifestName));
        continue;
      }
      const fs::path path = dir / name;
      std::error_code ec;
      const auto size = fs::file_size(path, ec);
      if (ec) {
        problem(fmt::format("{}: missing or unreadable ({})", name, ec.message()));
        continue;
      }
      if (size != f.getBytes()) {
        problem(fmt::format("{}: {} bytes, expected {}", name, size, f.getBytes()));
        continue;
      }
      try {
        if (auto hash = xxh3_file(path); hash != f.getXxh3().cStr()) {
          problem(fmt::format("{}: xxh3 {} expected {}", name, hash, f.getXxh3().cStr()));
        }
        if (name.ends_with(".safetensors")) {
          auto header = read_safetensors_header(path);
          if (header.tensors.size() != f.getTensors()) {
            problem(fmt::format("{}: {} tensors, expected {}", name, header.tensors.size(),
                                f.getTensors()));
          }
        }
      } catch (const std::exception& e) {
        problem(fmt::format("{}: {}", name, user_message(e)));
      }
    }
  } catch (const std::exception& e) {
    problem(std::string(user_message(e)));
  }
  result.ok = result.problems.empty();
  return result;
}

}  // namespace megacpp::checkpointer
