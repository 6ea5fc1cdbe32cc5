// The run directory and the launch contract: options validated, the directory, rings and
// rendezvous prepared, launch.json written.
#include "supervisor/detail/job_controller.h"

#include <dlfcn.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <random>
#include <thread>

#include <capnp/message.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint/reader.h"
#include "checkpoint/resume.h"
#include "checkpoint/verify.h"
#include "core/error.h"
#include "core/knobs.h"
#include "core/util.h"
#include "data/dataset_manifest.h"
#include "data/shards.h"
#include "gpu/staging.h"
#include "ipc/channel.h"
#include "ipc/job_keys.h"
#include "ipc/journal.h"
#include "ipc/shm.h"
#include "ipc/slot_ring.h"
#include "ops/ops.h"
#include "recipes/recipe.h"
#include "schemas/enums.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"
#include "supervisor/commands/commands.h"
#include "supervisor/metrics.h"
#include "supervisor/process.h"
#include "supervisor/rendezvous.h"
#include "supervisor/supervisor.h"

namespace megacpp::supervisor {
namespace {
// The memory a CPU run's ranks share: physical memory, or the cgroup's limit when lower. 0 when
// unknown.
double host_memory_gib() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  double bytes = pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0;
  try {
    const std::string limit = read_file("/sys/fs/cgroup/memory.max");
    if (!limit.empty() && std::isdigit(static_cast<unsigned char>(limit[0])))
      bytes = bytes > 0 ? std::min(bytes, std::stod(limit)) : std::stod(limit);
  } catch (const std::exception&) {
    // no cgroup v2 limit to read: physical memory stands
  }
  return bytes / static_cast<double>(1ull << 30);
}
}  // namespace

bool cuda_trainer_built() {
  return std::filesystem::exists(detail::self_exe_dir() / "libmegacpp_trainer_cuda.so");
}

namespace {
// The smallest visible CUDA device's memory in GiB; 0 when unknown.
double cuda_device_memory_gib() {
  if (!cuda_trainer_built()) return 0;
  const std::string path = (detail::self_exe_dir() / "libmegacpp_trainer_cuda.so").string();
  // Never closed: torch's CUDA backend, once registered, cannot be unregistered (cuda_plugin.h).
  void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (library == nullptr) return 0;
  using Query = int (*)(uint64_t*, int);
  const auto query = reinterpret_cast<Query>(::dlsym(library, "megacpp_cuda_device_memory"));
  if (query == nullptr) return 0;
  std::array<uint64_t, 64> bytes{};
  const int n = std::min(query(bytes.data(), static_cast<int>(bytes.size())), 64);
  if (n <= 0) return 0;
  const uint64_t smallest = *std::min_element(bytes.begin(), bytes.begin() + n);
  return static_cast<double>(smallest) / static_cast<double>(1ull << 30);
}
}  // namespace

void default_cuda_memory_budget(double& budget_gib, std::string& source) {
  if (budget_gib > 0) return;
  if (const double device = cuda_device_memory_gib(); device > 0) {
    budget_gib = device;
    source = fmt::format(
        "the smallest visible CUDA device's {:.1f} GiB; --memory-budget sets another", device);
  }
}

void set_snapshot_staging_options(recipe::PlanOptions& po) {
  const std::string v = knob_string(Knob::kSnapshotStaging);
  MEGACPP_CHECK(v == "auto" || v == "host" || v == "device" || v == "memfd",
                ErrorKind::kInvalidArgument,
                fmt::format("MEGACPP_SNAPSHOT_STAGING={}: use auto, host, device or memfd", v));
  po.snapshot_staging = v;
  if (po.device != "cuda") {
    MEGACPP_CHECK(
        v != "device", ErrorKind::kInvalidArgument,
        "MEGACPP_SNAPSHOT_STAGING=device needs --device cuda; use host or memfd on a CPU");
    return;
  }
  std::string why;
  po.cuda_staging_available = gpu::driver_available(&why);
  MEGACPP_CHECK(v != "device" || po.cuda_staging_available, ErrorKind::kInvalidArgument,
                fmt::format("MEGACPP_SNAPSHOT_STAGING=device: {}; use auto or host", why));
}

void RunOptions::validate() const {
  auto bad = [](std::string msg) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{}", std::move(msg));
  };
  // With --resume, ranks 0 means "the world the run had".
  if ((ranks < 1 && resume.empty()) || ranks > layout::kMaxRanks)
    bad(fmt::format("--ranks {}: must be in [1, {}]", ranks, layout::kMaxRanks));
  if (steps < 1) bad("--steps must be >= 1");
  if (device != "cpu" && device != "cuda")
    bad(fmt::format("--device {}: must be cpu or cuda", device));
  if (!resume.empty()) {
    if (!run_dir.empty() || !from.empty())
      bad("--resume RUN continues RUN: it takes no --run-dir or --from");
  } else if (run_dir.empty()) {
    bad("--run-dir is required (or --resume RUN to continue a run)");
  }
  if (heartbeat_interval_ms < 10 || heartbeat_interval_ms > 10000)
    bad("--heartbeat-ms must be in [10, 10000]");
  if (ring_slots < 2 || ring_slots > 1024) bad("--ring-slots must be in [2, 1024]");
  if (!(startup_budget_s > 0) || !(hang_budget_s > 0) || !(heartbeat_timeout_s > 0)) {
    bad("--startup-budget-s, --hang-budget-s and --heartbeat-timeout-s must be > 0");
  }
  if (!(hang_multiple >= 1)) bad("--hang-multiple must be >= 1");
  for (auto [flag, v] : {std::pair{"--collector-stall-s", collector_stall_s},
                         std::pair{"--loader-stall-s", loader_stall_s},
                         std::pair{"--checkpointer-stall-s", checkpointer_stall_s}}) {
    if (!(v > 0) || v > 86400) bad(fmt::format("{} must be in (0, 86400]", flag));
  }
  if (!(teardown_grace_s >= 0) || teardown_grace_s > 30)
    bad("--teardown-grace-s must be in [0, 30]");
  if (!(abort_wait_s > 0) || abort_wait_s > 60) bad("--abort-wait-s must be in (0, 60]");
  if (max_restarts > 100) bad("--max-restarts must be <= 100");
  if (max_job_restarts > 100) bad("--max-job-restarts must be <= 100");
  if (!(stop_grace_s > 0) || stop_grace_s > 86400) bad("--stop-grace-s must be in (0, 86400]");
  if (keep_checkpoints < 1) {
    bad(fmt::format("--keep-checkpoints {}: must be >= 1 (the newest checkpoint is always kept)",
                    keep_checkpoints));
  }
  if (!(metrics_linger_s >= 0) || metrics_linger_s > 3600)
    bad("--metrics-linger-s must be in [0, 3600]");
  if (metrics_addr.rfind(':') == std::string::npos) bad("--metrics-addr must be HOST:PORT");
  if (progress != "auto" && progress != "tty" && progress != "plain" && progress != "none") {
    bad("--progress must be auto, tty, plain or none");
  }
}

namespace detail {

namespace {

fs::path nearest_existing(fs::path p) {
  while (!p.empty() && !fs::exists(p)) p = p.parent_path();
  return p.empty() ? fs::path("/") : p;
}

// The compiler as the launch contract's provenance records it.
std::string compiler_name() {
  return fmt::format("gcc {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__);
}

std::string random_hex(size_t n) {
  std::random_device rd;
  std::string out;
  while (out.size() < n) out += fmt::format("{:08x}", rd());
  return out.substr(0, n);
}

// Bounded like every wait for a child: a git stuck on a lock or a slow filesystem costs at
// most kGitTimeoutS per call and leaves the revision "unknown".
constexpr double kGitTimeoutS = 5.0;

std::string git_revision(bool& dirty) {
  std::string rev =
      detail::capture_output({"git", "-C", MEGACPP_SOURCE_DIR, "rev-parse", "HEAD"}, kGitTimeoutS)
          .value_or("");
  while (!rev.empty() && (rev.back() == '\n' || rev.back() == '\r')) rev.pop_back();
  auto status = detail::capture_output(
      {"git", "-C", MEGACPP_SOURCE_DIR, "status", "--porcelain", "--untracked-files=no"},
      kGitTimeoutS);
  dirty = status && !status->empty();
  return rev.empty() ? "unknown" : rev;
}

// The filesystem `path` lives on: type, device and whether it is the root volume's.
void describe_volume(const fs::path& path, schema::FilesystemInfo::Builder out) {
  struct statfs sfs {};
  struct stat st {
  }, root_st{};
  out.setPath(path.string());
  if (::statfs(path.c_str(), &sfs) != 0 || ::stat(path.c_str(), &st) != 0 ||
      ::stat("/", &root_st) != 0) {
    out.setType("unknown");
    return;
  }
  out.setType(filesystem_type_name(sfs.f_type));
  out.setDevice(fmt::format("{}:{}", major(st.st_dev), minor(st.st_dev)));
  out.setIsRootVolume(st.st_dev == root_st.st_dev);
}

}  // namespace

void JobController::adopt_previous_attempt() {
  run_ = fs::absolute(opt_.resume).lexically_normal();
  const fs::path launch_file = layout::launch_path(run_);
  if (!fs::exists(launch_file))
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--resume {}: no run there (no launch.json): pass the run directory of an "
                 "earlier `megacpp run`",
                 run_.string());
  // A previous attempt whose supervisor vanished is recorded as orphaned (and its shm and
  // sockets removed) before anything is decided.
  reconcile(run_);
  schemas::JsonFile<schema::LaunchContract> prev(launch_file);
  const auto l = prev.get();
  bool ended = false;
  ipc::JournalReader::read_all(
      layout::journal_path(run_, StageKind::SUPERVISOR, 0), [&](schema::JournalRecord::Reader r) {
        if (r.getAttempt() == l.getAttempt() && (r.isRunFinished() || r.isRunOrphaned()))
          ended = true;
      });
  if (!ended)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--resume {}: the run is still running (supervisor pid {}): let it end or stop "
                 "it (SIGINT) first",
                 run_.string(), l.getSupervisorPid());
  try {
    recipe_ = recipe::from_spec(l.getRecipe());
    // A resumed run keeps the precision it started with, chosen where it started.
    muon_precision_ = l.getMuonPrecision().size() > 0
                          ? std::string(l.getMuonPrecision())
                          : recipe::resolve_muon_precision(recipe_, opt_.device, "");
  } catch (const Error& e) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "--resume {}: launch.json's recipe: {}",
                 run_.string(), e.what());
  }
  run_id_ = l.getRunId();
  created_at_ = l.getCreatedAt();
  previous_attempt_ = l.getAttempt();
  attempt_ = previous_attempt_ + 1;
  // The global batch stays the run's whatever the world size (every attempt trains a step
  // on the same windows): the previous attempt's world times its batch per rank.
  global_batch_ = recipe::batch_geometry(l).rank_rows();
  if (l.hasResume() && l.getResume().getDataPosition() != 0) {
    data_base_step_ = l.getResume().getStep();
    data_base_position_ = l.getResume().getDataPosition();
  }
  opt_.steps = l.getSteps();
  // A node's part of a job across nodes holds its own ranks only: the job resumes with the
  // nodes and ranks per node it had, each node from its own part.
  const uint32_t local_ranks =
      l.getLocalRanks() != 0 ? l.getLocalRanks() : l.getWorld();  // before the field: every rank
  if (placement_.nodes > 1 || local_ranks != l.getWorld()) {
    if (opt_.ranks == 0) opt_.ranks = local_ranks;
    if (opt_.ranks != local_ranks || uint64_t{opt_.ranks} * placement_.nodes != l.getWorld() ||
        l.getFirstRank() != opt_.ranks * placement_.node_rank)
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "--resume {}: this node held ranks {}..{} of a job of {} ranks; placed now as "
                   "node {} of {} with {} ranks each, it would hold others: resume the job with "
                   "the nodes and ranks per node it had",
                   run_.string(), l.getFirstRank(), l.getFirstRank() + local_ranks - 1,
                   l.getWorld(), placement_.node_rank, placement_.nodes,
                   opt_.ranks == 0 ? local_ranks : opt_.ranks);
  }
  if (opt_.ranks == 0) opt_.ranks = l.getWorld();
  opt_.data_dir = std::string(l.getDataDir());
  previous_dataset_ = data::from_spec(l.getDataset());
  previous_validation_digest_ = l.getValidation().getDigest();
  parent_ = l.hasParent() && l.getParent().hasRunId()
                ? std::optional<ParentInfo>(
                      ParentInfo{l.getParent().getRunDir(), l.getParent().getRunId(),
                                 l.getParent().getStep(), l.getParent().getCheckpoint()})
                : std::nullopt;

  choose_checkpoint("--resume");
  if (!resume_ && !engine_restart_)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--resume {}: no checkpoint in {} verifies{}: nothing to resume from; start a "
                 "new run",
                 run_.string(), layout::checkpoints_dir(run_).string(),
                 skipped_.empty() ? "" : fmt::format(" ({} skipped)", skipped_.size()));
  if (resume_ && resume_->step >= opt_.steps)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--resume {}: its checkpoint of step {} is the last of the {} planned steps: "
                 "nothing to resume (branch from it with `megacpp run RECIPE --from {} --run-dir "
                 "NEW`)",
                 run_.string(), resume_->step, opt_.steps, resume_->dir.string());
  const uint32_t world = opt_.ranks * std::max<uint32_t>(placement_.nodes, 1);
  if (global_batch_ % world != 0)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--resume {} --ranks {}: rule resume.global_batch: the run's global batch of {} "
                 "sequences per step cannot be split evenly over {} ranks; pick a world size "
                 "that divides it",
                 run_.string(), opt_.ranks, global_batch_, world);
  const auto rank_batch = static_cast<uint32_t>(global_batch_ / world);
  if (rank_batch != recipe_.train.batch_size) rank_batch_ = rank_batch;
}

uint64_t JobController::data_position_after(uint32_t step) const {
  // Windows a step takes: the data-parallel ranks' batches (a tensor-parallel group shares one).
  return data_base_position_ + uint64_t{step - data_base_step_} * batch_.windows_per_step();
}

void JobController::choose_checkpoint(std::string_view why, std::optional<uint32_t> at_most) {
  auto choice = checkpoint::select_resume_checkpoint(run_, at_most);
  skipped_.clear();
  skipped_steps_.clear();
  for (const auto& sk : choice.skipped) {
    std::string problems;
    for (const auto& p : sk.problems) problems += (problems.empty() ? "" : "; ") + p;
    log_warn("{}: skipping {}: it does not verify ({})", why, sk.relative_path, problems);
    skipped_.push_back(fmt::format("{}: {}", sk.relative_path, problems));
    skipped_steps_.push_back(sk.step);
  }
  resume_.reset();
  if (choice.chosen) {
    const checkpoint::CheckpointReader ckpt(choice.chosen->dir);
    resume_ = ResumeInfo{choice.chosen->step, choice.chosen->dir, choice.chosen->relative_path,
                         ckpt.world()};
  }
}

recipe::Recipe JobController::command_line_recipe() const {
  recipe::Recipe r = recipe::load(recipe::resolve(opt_.recipe, MEGACPP_RECIPE_DIR));
  if (opt_.data_source.empty() && opt_.data_path.empty() && opt_.mode.empty()) return r;
  // The CLI composes over the recipe: the overrides pass the same rules, and the recipe's hash
  // covers what actually runs.
  if (!opt_.data_source.empty()) r.data.source = opt_.data_source;
  // Relative to the working directory, as every path on the command line.
  if (!opt_.data_path.empty()) r.data.path = data::command_line_data_path(opt_.data_path);
  if (!opt_.mode.empty()) r.model.mode = opt_.mode;
  return recipe::rehash(std::move(r));
}

void JobController::agree_checkpoint(std::string_view why) {
  if (placement_.nodes <= 1 || !joined_) return;
  // Each round every node offers its newest verified part no later than the round's bound
  // (0: none) and reads every node's offer; the lowest bounds the next round. Offers only go
  // down, and every node computes the same from the same offers, so all end on one step.
  SealedRecords& store = *job_records_;
  const auto wait = std::chrono::milliseconds(
      static_cast<int64_t>(std::max(60.0, knob_seconds(Knob::kStoreTimeoutS)) * 1e3));
  const std::string prefix = fmt::format("{}/resume/a{}", engine_prefix_, attempt_);
  for (uint32_t round = 0;; ++round) {
    const uint32_t mine = resume_ ? resume_->step : 0;
    store.set(fmt::format("{}/r{}/{}", prefix, round, placement_.node_rank), std::to_string(mine));
    uint32_t lowest = mine;
    bool same = true;
    for (uint32_t k = 0; k < placement_.nodes; ++k) {
      const auto v = store.get(fmt::format("{}/r{}/{}", prefix, round, k), wait);
      MEGACPP_CHECK(v.has_value(), ErrorKind::kTimeout,
                    fmt::format("{}: node {} did not say which checkpoint it has within {} s; "
                                "start every node of the job",
                                why, k, wait.count() / 1000));
      const auto step = static_cast<uint32_t>(std::stoul(*v));
      lowest = std::min(lowest, step);
      same = same && step == mine;
    }
    if (same) break;
    log_info("{}: another node's newest checkpoint is step {}; this node's part of it is used", why,
             lowest);
    choose_checkpoint(why, lowest);  // its part of `lowest` may not verify: the next round says
  }
  // This node's parts of later steps were not committed by every node: set aside with those
  // that do not verify, so the resumed attempt commits those steps anew.
  const uint32_t agreed = resume_ ? resume_->step : 0;
  const fs::path ckdir = layout::checkpoints_dir(run_);
  for (uint32_t step : checkpoint::committed_steps(run_)) {
    if (step <= agreed || std::ranges::find(skipped_steps_, step) != skipped_steps_.end()) continue;
    const std::string name = layout::checkpoint_dir_name(step);
    log_warn("{}: {} is not a step every node of the job committed; it is set aside", why, name);
    skipped_.push_back(fmt::format("checkpoints/{}: not committed by every node of the job", name));
    skipped_steps_.push_back(step);
  }
  if (!resume_) return;
  log_info("{}: every node resumes from step {}", why, resume_->step);
  // The job's LATEST is where it resumes: a later step it named is set aside on some node.
  write_file_atomic(ckdir / checkpoint::kJobLatestName,
                    layout::checkpoint_dir_name(resume_->step) + "\n");
  job_latest_ = resume_->step;
}

void JobController::agree_branch() {
  if (placement_.nodes <= 1 || !joined_) return;
  // Every node of a new job starts from the same place: no --from anywhere, or every node's
  // --from of the same step of the same recipe (each node may name its own copy or part).
  SealedRecords& store = *job_records_;
  const auto wait = std::chrono::milliseconds(
      static_cast<int64_t>(std::max(60.0, knob_seconds(Knob::kStoreTimeoutS)) * 1e3));
  // A new run has a checkpoint to start from only through --from (adopt_parent_checkpoint).
  const std::string mine =
      resume_ ? fmt::format("step {} of recipe hash {}", resume_->step,
                            checkpoint::CheckpointReader(resume_->dir).recipe_hash())
              : std::string("none");
  const std::string prefix = engine_prefix_ + "/branch";
  store.set(fmt::format("{}/{}", prefix, placement_.node_rank), mine);
  for (uint32_t k = 0; k < placement_.nodes; ++k) {
    if (k == placement_.node_rank) continue;
    const auto v = store.get(fmt::format("{}/{}", prefix, k), wait);
    MEGACPP_CHECK(v.has_value(), ErrorKind::kTimeout,
                  fmt::format("node {} did not say where it starts within {} s; start every "
                              "node of the job",
                              k, wait.count() / 1000));
    if (*v != mine)
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "node {} starts from {}, node {} (this one) from {}: give every node --from "
                   "the same step of the same job (each its own copy or part), or none",
                   k, *v == "none" ? "scratch (no --from)" : *v, placement_.node_rank,
                   mine == "none" ? "scratch (no --from)" : mine);
  }
  if (resume_) log_info("every node of the job branches from step {}", resume_->step);
}

std::optional<std::string> JobController::agree_job_restart(std::optional<std::string> mine) {
  if (placement_.nodes <= 1 || !joined_) return mine;
  SealedRecords& store = *job_records_;
  const std::string prefix = fmt::format("{}/restart/a{}", engine_prefix_, attempt_);
  store.set(fmt::format("{}/{}", prefix, placement_.node_rank), mine.value_or(""));
  if (mine) return mine;
  const auto wait = std::chrono::seconds(60);
  for (uint32_t k = 0; k < placement_.nodes; ++k) {
    if (k == placement_.node_rank) continue;
    const auto v = store.get(fmt::format("{}/{}", prefix, k), wait);
    if (!v)
      return fmt::format("node {} did not say within {} s whether it can restart", k, wait.count());
    if (!v->empty()) return fmt::format("node {} cannot restart: {}", k, *v);
  }
  return std::nullopt;
}

void JobController::journal_attempt_started(std::string_view reason) {
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto a = r.initAttemptStarted();
    a.setAttempt(attempt_);
    a.setFromStep(resume_ ? resume_->step : 0);
    if (resume_) a.setCheckpoint(resume_->relative_path);
    a.setReason(std::string(reason));
    a.setWorld(world_);
    auto sk = a.initSkipped(static_cast<unsigned>(skipped_.size()));
    for (size_t i = 0; i < skipped_.size(); ++i) sk.set(static_cast<unsigned>(i), skipped_[i]);
  });
  journal_->sync();
}

void JobController::create_rings() {
  static_assert(recipe::kMaxBatchSlotBytes <= ipc::SlotRing::kMaxSlotBytes);
  const uint64_t slot_bytes = batch_.slot.slot_bytes();
  command([&](schema::NodeCommand::Builder cmd) {
    auto a = cmd.initPrepareAttempt();
    a.setShmPrefix(shm_prefix_);
    a.setRanks(opt_.ranks);
    a.setFirstRank(first_rank_);
    a.setRingSlots(opt_.ring_slots);
    a.setRingSlotBytes(slot_bytes);
    if (validation_.dataset) a.setValidationSlots(kValidationRingSlots);
  });
}

void JobController::adopt_parent_checkpoint() {
  const fs::path dir =
      fs::absolute(checkpoint::resolve_checkpoint_dir(opt_.from)).lexically_normal();
  const auto verdict = checkpoint::verify_checkpoint(dir);
  if (!verdict.ok)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--from {}: the checkpoint does not verify ({}): pick another checkpoint",
                 opt_.from.string(), verdict.problems.front());
  checkpoint::CheckpointReader ckpt(dir);
  if (ckpt.step() >= opt_.steps)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--from {}: the checkpoint is of step {}, and --steps {} leaves nothing to "
                 "train: steps continue from the checkpoint's, so pass --steps above {}",
                 opt_.from.string(), ckpt.step(), opt_.steps, ckpt.step());
  // A checkpoint's logical tensors do not depend on the layout (tensor-parallel weight shards
  // are reassembled by the reader), so a branch may change the mode, and with it the
  // tensor-parallel degree, as long as the model is the same: the modes expand a pattern's
  // R differently (author_dp: the recurrence; nemo_native: the Mamba block).
  const std::string ckpt_blocks = recipe::expand_blocks(recipe_.pattern, recipe_.model.n_layers,
                                                        ckpt.mode(), recipe_.model.moe.enabled);
  if (ckpt.mode() != recipe_.model.mode && ckpt_blocks != recipe_.model.blocks)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--from {}: gate mode-matches-checkpoint: the checkpoint was trained in mode {} "
                 "(tensor parallel {}), whose blocks {} are not this run's {} in mode {}: the "
                 "models differ (retires never: R is another block in each mode): pass --mode {}",
                 opt_.from.string(), ckpt.mode(), ckpt.tensor_parallel(), ckpt_blocks,
                 recipe_.model.blocks, recipe_.model.mode, ckpt.mode());
  // A node's part of a job across nodes holds its own ranks only: a branch reads its ranks from
  // it only when this node holds the same ranks of a job of the same world.
  if (ckpt.ranks() < ckpt.world()) {
    const uint64_t first = uint64_t{opt_.ranks} * placement_.node_rank;
    const uint64_t world = uint64_t{opt_.ranks} * placement_.nodes;
    if (ckpt.first_rank() != first || ckpt.ranks() != opt_.ranks || ckpt.world() != world)
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "--from {}: the checkpoint is a node's part, ranks {}..{} of a job of {} "
                   "ranks, and this node holds ranks {}..{} of {}: give each node its own part "
                   "of a job of the same nodes and ranks, or a checkpoint of every rank",
                   opt_.from.string(), ckpt.first_rank(), ckpt.first_rank() + ckpt.ranks() - 1,
                   ckpt.world(), first, first + opt_.ranks - 1, world);
  }
  resume_ = ResumeInfo{ckpt.step(), dir, dir.string(), ckpt.world()};
  const fs::path parent_run = dir.parent_path().parent_path();
  // The branch's data continue where the parent's stood after the checkpoint's step: the
  // parent's own data order (its base and global batch, from its launch contract), not this
  // run's world x batch, which may differ.
  if (!fs::exists(layout::launch_path(parent_run)))
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--from {}: no launch.json in {}, so where the parent's data order stood after "
                 "step {} is unknown: branch from a checkpoint inside its run directory",
                 opt_.from.string(), parent_run.string(), ckpt.step());
  {
    schemas::JsonFile<schema::LaunchContract> parent(layout::launch_path(parent_run));
    const auto pl = parent.get();
    const uint64_t parent_global = recipe::batch_geometry(pl).windows_per_step();
    uint32_t base_step = 0;
    uint64_t base_position = 0;
    if (pl.hasResume() && pl.getResume().getDataPosition() != 0) {
      base_step = pl.getResume().getStep();
      base_position = pl.getResume().getDataPosition();
    }
    MEGACPP_CHECK(ckpt.step() >= base_step, ErrorKind::kInvalidArgument,
                  fmt::format("--from {}: step {} is before where its run's current attempt "
                              "began (step {}): branch from a later checkpoint",
                              opt_.from.string(), ckpt.step(), base_step));
    data_base_step_ = ckpt.step();
    data_base_position_ = base_position + uint64_t{ckpt.step() - base_step} * parent_global;
  }
  parent_ = ParentInfo{parent_run.string(), ckpt.run_id(), ckpt.step(), dir.string()};
}

// After the gates: feature-built has refused a build without the CUDA trainer.
void JobController::check_cuda_devices() const {
  // With --resume, ranks 0 means the run's own world: checked once it is known, by the ranks.
  const int visible = ops::cuda_device_count();
  if (visible < 1 || static_cast<uint32_t>(visible) < opt_.ranks)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--device cuda: {} CUDA device(s) visible (CUDA_VISIBLE_DEVICES applies), {} "
                 "rank(s) need one each; run on a GPU machine, lower --ranks, or use --device cpu",
                 visible, std::max<uint32_t>(opt_.ranks, 1));
}

void JobController::plan_collectives() {
  CollectivePlan p;
  p.timeout_s = knob_seconds(Knob::kCollectiveTimeoutS);
  MEGACPP_CHECK(p.timeout_s > 0, ErrorKind::kInvalidArgument,
                "MEGACPP_COLLECTIVE_TIMEOUT_S must be > 0");
  if (opt_.device == "cuda") {
    p.backend = "nccl";
    // ProcessGroupNCCL reads these from the rank's environment. A value the user set is kept
    // (and recorded); otherwise: CleanUpOnly (2), so a collective that outlives the timeout
    // aborts its communicator and records the timeout in the group's error state, which the rank
    // reads after its next host read of the device and reports as a typed timeout
    // (trainer/collective.h check_async_error), instead of TearDown's std::abort (a signal death
    // with the watchdog's stack); the watchdog's own monitor on, given past the collective
    // timeout.
    auto integer = [&](const char* name, int fallback) {
      const auto v = foreign_env(name);
      if (!v) {
        p.env.push_back(fmt::format("{}={}", name, fallback));
        return fallback;
      }
      try {
        return std::stoi(*v);
      } catch (const std::exception&) {
        MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{}={} is not an integer", name, *v);
      }
    };
    p.nccl_async_error_handling = integer("TORCH_NCCL_ASYNC_ERROR_HANDLING", 2);
    p.nccl_enable_monitoring = integer("TORCH_NCCL_ENABLE_MONITORING", 1) != 0;
    p.nccl_heartbeat_timeout_s = integer("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
                                         std::max(480, static_cast<int>(p.timeout_s) + 60));
  }
  collectives_ = std::move(p);
}

void JobController::prepare() {
  // Before any thread exists (TCPStore, ZeroMQ): NodeAgent::block_signals.
  agent_->block_signals();
  opt_.validate();
  // This node's place in its job, before anything else is read or written: a bad flag or
  // variable, or what this build cannot run of a job across nodes, is refused first.
  placement_ = resolve_placement(opt_.placement, environment_of(environ));
  check_job_across_nodes();
  plan_collectives();
  // An engine's restart of the same command (torchrun --max-restarts, a requeued Slurm job, a
  // restarted pod): the run directory holds this job's run, which continues from its newest
  // checkpoint that every node has, as `--resume` would. Not judged by the engine's restart
  // count: torchrun counts a node's own failures only, so a node restarted for another's
  // failure still says 0.
  const bool engine = placement_.source == "torchrun" || placement_.source == "slurm" ||
                      placement_.source == "kubernetes";
  if (opt_.resume.empty() && engine && !opt_.run_dir.empty() &&
      fs::exists(layout::launch_path(opt_.run_dir))) {
    log_info("{} started the job again (its restart count: {}): resuming run {}", placement_.source,
             placement_.attempt, opt_.run_dir.string());
    opt_.resume = opt_.run_dir;
    engine_restart_ = true;
  }
  const bool resuming = !opt_.resume.empty();
  if (resuming) {
    adopt_previous_attempt();
    // The command the engine restarted names the run's recipe, or it is another job's command.
    // Its "auto" settings are the run's: the hash of the run's recipe covers the precision its
    // first launch settled (a CPU without bfloat16 units settled float32, not "auto"'s default).
    if (engine_restart_) {
      const recipe::Recipe given = recipe::settled_like(command_line_recipe(), recipe_);
      if (given.hash != recipe_.hash)
        MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                     "run directory {} holds run {} of recipe {} (hash {}), and this restarted "
                     "command runs {} (hash {}): give the job a fresh --run-dir",
                     run_.string(), run_id_, recipe_.name, recipe_.hash, given.name, given.hash);
    }
  } else {
    recipe_ = command_line_recipe();
    // muon_bf16 = "auto": what this device does fast (the hash then covers it).
    muon_precision_ = recipe::resolve_muon_precision(recipe_, opt_.device, cpu_bf16_units());
    run_ = fs::absolute(opt_.run_dir).lexically_normal();
    if (!opt_.from.empty()) adopt_parent_checkpoint();
  }
  // opt_.ranks is settled (a resume took the run's world): the job's world and this node's ranks.
  world_ = opt_.ranks * placement_.nodes;
  first_rank_ = opt_.ranks * placement_.node_rank;
  // The plan's gates, before anything is written: a refusal names its rule, the reason and
  // when the gate retires.
  {
    // Without --memory-budget, a CPU run's ranks get an equal part of this host's memory: a
    // plan beyond it cannot start (nam56r on a workstation), and says so before launching.
    recipe::PlanOptions po{.ranks = world_,
                           .ranks_per_node = opt_.ranks,
                           .memory_budget_gib = opt_.memory_budget_gib,
                           .device = opt_.device,
                           .cuda_trainer_built = cuda_trainer_built()};
    set_snapshot_staging_options(po);
    if (opt_.device == "cuda")
      default_cuda_memory_budget(po.memory_budget_gib, po.memory_budget_source);
    if (po.memory_budget_gib <= 0 && opt_.device == "cpu") {
      const double host = host_memory_gib();
      const uint32_t ranks = std::max<uint32_t>(opt_.ranks, 1);
      if (host > 0) {
        po.memory_budget_gib = host / ranks;
        po.memory_budget_source = fmt::format(
            "this host's {:.1f} GiB over {} rank(s); --memory-budget sets another", host, ranks);
      }
    }
    const recipe::Plan plan = recipe::make_plan(recipe_, po);
    if (const recipe::Gate* g = plan.refusal()) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "recipe {} refused by gate {}", recipe_.name,
                   recipe::refusal_line(*g));
    }
    gates_ = plan.gates;
    snapshot_staging_ = plan.memory.staging_on_device    ? "device"
                        : po.snapshot_staging == "memfd" ? "memfd"
                                                         : "host";
  }
  if (opt_.device == "cuda") {
    check_cuda_devices();
    log_info("snapshots staged {}", snapshot_staging_ == "device"
                                        ? "in device memory exported to the checkpointer"
                                        : "in host memory (" + snapshot_staging_ + ")");
  }
  // What this attempt's ranks train on: the recipe's batch geometry, with the per-rank batch a
  // resume at another world size needs. Resolved here once; everything after reads batch_.
  batch_ = recipe::resolve_batch(recipe_, world_, rank_batch_);

  if (opt_.data_dir.empty()) opt_.data_dir = run_.parent_path() / "data";
  opt_.data_dir = fs::absolute(opt_.data_dir).lexically_normal();
  // The user's shards in the data folder and the built-in corpus only by default: training on
  // generated text while the user believes it is their data is refused (an explicit
  // --data-source builtin keeps it). Before the store plugin is loaded, so a torch-free build
  // refuses the same way.
  if (!resuming && recipe_.data.source == "builtin" && opt_.data_source.empty()) {
    const auto found = data::find_known_shards(opt_.data_dir);
    if (!found.files.empty())
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "--data-dir {} holds {} {} shard file(s) ({}) but recipe {} trains on the "
                   "built-in corpus: pass --data-source {} to train on them, or --data-source "
                   "builtin to train on the built-in corpus anyway",
                   opt_.data_dir.string(), found.files.size(), data::format_name(found.format),
                   found.files.front().filename().string(), recipe_.name,
                   data::format_name(found.format));
  }
  // The plugin that hosts the ranks' store must load before anything is written (the
  // pre-flight below writes the built-in corpus).
  check_store_plugin();

  if (!resuming && fs::exists(run_)) {
    if (!fs::is_directory(run_)) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "run directory {} exists and is not a directory",
                   run_.string());
    }
    if (fs::exists(layout::launch_path(run_))) {
      MEGACPP_FAIL(
          ErrorKind::kInvalidArgument,
          "run directory {} already holds a run (launch.json exists): choose a fresh --run-dir, "
          "or continue it with `megacpp run --resume {}`",
          run_.string(), run_.string());
    }
    if (!fs::is_empty(run_)) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "run directory {} is not empty: choose a fresh --run-dir", run_.string());
    }
  }
  auto anchor = nearest_existing(run_);
  if (!fs::is_directory(anchor) || ::access(anchor.c_str(), W_OK) != 0) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "run directory {} is not writable ({} is {})",
                 run_.string(), anchor.string(),
                 fs::is_directory(anchor) ? "not writable" : "not a directory");
  }
  struct statfs sfs {};
  struct stat st {
  }, root_st{};
  SYSCALL_CHECK(::statfs(anchor.c_str(), &sfs));
  SYSCALL_CHECK(::stat(anchor.c_str(), &st));
  SYSCALL_CHECK(::stat("/", &root_st));
  fs_type_ = filesystem_type_name(sfs.f_type);
  fs_device_ = fmt::format("{}:{}", major(st.st_dev), minor(st.st_dev));
  fs_root_ = st.st_dev == root_st.st_dev;
  if (fs_root_) {
    if (opt_.require_data_volume) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "rule data-volume: run directory {} is on the root volume (device "
                   "{}, {}); put it on a "
                   "data volume or drop --require-data-volume",
                   run_.string(), fs_device_, fs_type_);
    }
    log_warn(
        "run directory {} is on the root volume ({}); production launches pass "
        "--require-data-volume",
        run_.string(), fs_type_);
  }

  // The data pre-flight: every file the run will read is found and validated now, so a bad
  // shard or an empty data folder ends the command before a run directory exists.
  if (recipe_.data.source == "builtin") {
    std::error_code ec;
    fs::create_directories(opt_.data_dir, ec);
    if (ec || ::access(opt_.data_dir.c_str(), W_OK) != 0)
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "data directory {} is not writable (the built-in corpus is written there): "
                   "pass a writable --data-dir",
                   opt_.data_dir.string());
  } else if (!fs::is_directory(opt_.data_dir)) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "--data-dir {} is not a directory: pass the folder that holds the {} shards",
                 opt_.data_dir.string(), recipe_.data.source);
  }
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  if (resuming) {
    // The same files as before, checked again: a file that changed since is refused.
    const auto& prev = previous_dataset_;
    recipe::Recipe local = recipe_;
    fs::path dir = opt_.data_dir;
    if (!prev.staged_from.empty() && !prev.files.empty()) {
      local.data.path.clear();
      dir = prev.files.front().path.parent_path();
    }
    dataset_ = data::resolve_dataset(local, batch_, dir, threads);
    validation_ = data::resolve_validation(local, batch_, dataset_, dir, threads);
    if (!previous_validation_digest_.empty() && validation_.digest != previous_validation_digest_)
      log_warn(
          "--resume {}: the val split changed since the run started (digest {}, recorded "
          "{}): validation losses before and after this attempt are not comparable",
          run_.string(), validation_.digest.empty() ? "none" : validation_.digest,
          previous_validation_digest_);
    dataset_.staged_from = prev.staged_from;
    bool same = dataset_.files.size() == prev.files.size();
    for (size_t i = 0; same && i < prev.files.size(); ++i) {
      if (dataset_.files[i].path != prev.files[i].path ||
          dataset_.files[i].xxh3 != prev.files[i].xxh3) {
        MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                     "--resume {}: the data changed since the run started ({}: xxh3 {}, recorded "
                     "{}): restore the files or start a new run",
                     run_.string(), prev.files[i].path.string(), dataset_.files[i].xxh3,
                     prev.files[i].xxh3);
      }
    }
    if (!same)
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "--resume {}: the data changed since the run started ({} files, recorded {}): "
                   "restore the files or start a new run",
                   run_.string(), dataset_.files.size(), prev.files.size());
  } else if (opt_.stage_data.empty()) {
    dataset_ = data::resolve_dataset(recipe_, batch_, opt_.data_dir, threads);
    validation_ = data::resolve_validation(recipe_, batch_, dataset_, opt_.data_dir, threads);
  } else {
    fs::path src = recipe_.data.path.empty() ? opt_.data_dir : fs::path(recipe_.data.path);
    if (src.is_relative()) src = opt_.data_dir / src;
    src = fs::absolute(src).lexically_normal();
    if (recipe_.data.source != "llmc" || !fs::exists(src / data::kDatasetManifestName))
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "--stage-data copies a `megacpp prepare` dataset (a directory with {}); {} "
                   "({} shards) has none: drop --stage-data or prepare the data",
                   data::kDatasetManifestName, src.string(), recipe_.data.source);
    const fs::path hot = fs::absolute(opt_.stage_data).lexically_normal();
    const auto report = data::stage_dataset(src, hot);
    log_info("staged {} to {}: {} files copied ({:.1f} MB), {} unchanged files reused",
             src.string(), hot.string(), report.copied, report.bytes_copied / 1e6, report.reused);
    recipe::Recipe local = recipe_;
    local.data.path.clear();
    dataset_ = data::resolve_dataset(local, batch_, hot, threads);
    validation_ = data::resolve_validation(local, batch_, dataset_, hot, threads);
    dataset_.staged_from = src.string();
  }

  // /metrics binds before anything is written: a port that cannot be bound is a start-up
  // error that leaves no half-made run directory behind.
  {
    auto colon = opt_.metrics_addr.rfind(':');
    std::string host = opt_.metrics_addr.substr(0, colon);
    // A job across nodes is scraped from elsewhere: by default /metrics binds the interface
    // the job names (node 0's file_sd lists it), not loopback.
    if (placement_.nodes > 1 && opt_.metrics_addr == RunOptions{}.metrics_addr &&
        !placement_.iface.empty()) {
      const auto address = interface_address(placement_.iface);
      MEGACPP_CHECK(address, ErrorKind::kInvalidArgument,
                    fmt::format("--iface {} has no IPv4 address on this node: name the interface "
                                "that reaches the other nodes",
                                placement_.iface));
      host = *address;
    }
    int port = -1;
    try {
      port = std::stoi(opt_.metrics_addr.substr(colon + 1));
    } catch (const std::exception&) {
    }
    if (port < 0 || port > 65535) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "--metrics-addr {}: the port must be in [0, 65535]",
                   opt_.metrics_addr);
    }
    metrics_ =
        std::make_unique<Metrics>(MEGACPP_VERSION, source_revision().revision, torch_version());
    metrics_server_ = std::make_unique<MetricsServer>(*metrics_, host, static_cast<uint16_t>(port));
    metrics_target_ = fmt::format("{}:{}", host, metrics_server_->port());
    metrics_endpoint_ = fmt::format("http://{}/metrics", metrics_target_);
  }

  std::error_code ec;
  fs::create_directories(run_, ec);
  if (ec) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "run directory {} is not writable: {}", run_.string(),
                 ec.message());
  }
  log_info("data: {} {} files, {} windows of {} tokens per epoch{}", dataset_.files.size(),
           data::format_name(dataset_.format), dataset_.windows, recipe_.model.seq_len + 1,
           dataset_.documents_without_window
               ? fmt::format(" ({} documents shorter than one window)",
                             dataset_.documents_without_window)
               : "");
  // Evaluation (the run is sure to start now): one line when the recipe asks and the data cannot
  // give it, none when it can.
  if (!validation_.off.empty()) log_warn("{}", validation_.off);
  if (!validation_.notice.empty()) log_warn("{}", validation_.notice);
  if (validation_.dataset)
    log_info(
        "evaluation: every {} steps and the last, {} windows of the val split ({} files, {} "
        "windows)",
        recipe_.train.eval_every, validation_.windows, validation_.dataset->files.size(),
        validation_.split_windows);
  for (const auto& d :
       {layout::journal_dir(run_), layout::receipts_dir(run_), layout::failures_dir(run_),
        layout::checkpoints_dir(run_), layout::logs_dir(run_)}) {
    fs::create_directories(d);
  }
  if (!resuming) {
    run_id_ = fmt::format("{}-{}", rfc3339(wall_ns()).substr(0, 19), random_hex(6));
    for (auto& ch : run_id_) {
      if (ch == ':') ch = '-';
    }
    created_at_ = rfc3339(wall_ns());
  }
  // Joined before the attempt begins: a job across nodes resumes from a step every node has.
  host_or_join_store();
  if (!resuming) agree_branch();
  if (resuming) {
    agree_checkpoint("--resume");
    if (!resume_ && !engine_restart_)
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "--resume {}: no step of the job has a part that verifies on every node: "
                   "nothing to resume from; start a new run",
                   run_.string());
    begin_attempt();
  }
  shm_prefix_ = layout::shm_prefix(run_id_, attempt_);

  agent_->set_run_dir(run_);
  const NodeAgent::Endpoints endpoints = agent_->make_socket_dir(run_id_, resuming);
  sock_dir_ = endpoints.sock_dir;
  control_ep_ = endpoints.control;
  checkpoint_ep_ = endpoints.checkpoint;

  create_rings();
  write_launch_contract();

  agent_->open_control(control_ep_);
  open_journals();
  if (resuming) journal_attempt_started("resume");
}

void JobController::check_job_across_nodes() {
  if (placement_.nodes <= 1) return;
  const std::string where =
      fmt::format("{} ({}) placed this node as node {} of {}", placement_.source,
                  placement_.nodes_from, placement_.node_rank, placement_.nodes);
  auto refuse = [&](std::string_view why) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{}: {}", where, why);
  };
  if (opt_.job_keys.empty())
    refuse(
        "a job across nodes needs the job's keys: create them once with `megacpp keys FILE`, "
        "give every node that file (mode 0600) and pass --job-keys FILE");
  // Each line below is a part of a job across nodes this build does not run yet.
  if (static_cast<uint64_t>(opt_.ranks) * placement_.nodes > layout::kMaxRanks)
    refuse(fmt::format("{} nodes x --ranks {} exceeds the {} ranks of a job", placement_.nodes,
                       opt_.ranks, layout::kMaxRanks));
  // Read before anything is written: a missing or unprotected key file is refused here.
  const ipc::JobKeys keys = ipc::read_job_keys(opt_.job_keys);
  job_prefix_ = ipc::job_store_prefix(keys);
  job_seal_ = ipc::RecordSealer(keys);
}

const JobController::SourceRevision& JobController::source_revision() {
  if (!source_revision_) {
    SourceRevision r;
    r.revision = git_revision(r.dirty);
    source_revision_ = std::move(r);
  }
  return *source_revision_;
}

void JobController::host_or_join_store() {
  if (placement_.nodes <= 1) {
    store_ = std::make_unique<StoreServer>("127.0.0.1", 0, world_);
    store_host_ = "127.0.0.1";
    store_port_ = store_->port();
    return;
  }
  NodeIdentity me;
  const auto& [revision, dirty] = source_revision();
  // As `megacpp compare` names them (commands.h), from what the launch contract records.
  me.build = build_name(revision, dirty, MEGACPP_BUILD_TYPE, compiler_name(), torch_version());
  me.recipe_hash = recipe_.hash;
  me.muon_precision = muon_precision_;
  std::vector<DataFile> data;
  for (const auto& f : dataset_.files) data.push_back({f.xxh3, f.tokens});
  me.dataset_xxh3 = dataset_digest(data);
  me.ranks_per_node = opt_.ranks;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  me.host = host;
  // One join per start of the job, under node 0's round (membership.h): an engine's restart
  // may find a store that outlived the previous start, and its restart count may differ
  // between nodes. The round this node joined last is kept in its run directory.
  const fs::path round_file = run_ / "job_round";
  std::string last_round;
  if (fs::exists(round_file)) last_round = read_file(round_file);
  log_info("joining the job as node {} of {} through {}:{} ({})", placement_.node_rank,
           placement_.nodes, placement_.master_host, placement_.master_port, placement_.source);
  joined_ = std::make_unique<JoinedJob>(join_job(
      placement_, me, job_prefix_,
      std::chrono::milliseconds(static_cast<int64_t>(knob_seconds(Knob::kStoreTimeoutS) * 1e3)),
      last_round));
  write_file_atomic(round_file, joined_->round());
  job_records_ = std::make_unique<SealedRecords>(joined_->store(), job_seal_);
  const std::string prefix = fmt::format("{}/r{}", job_prefix_, joined_->round());
  log_info("every node of the job runs the same build, recipe and data; ranks {}..{} of {} here",
           first_rank_, first_rank_ + opt_.ranks - 1, world_);
  store_host_ = placement_.master_host;
  store_port_ = static_cast<uint16_t>(placement_.master_port);
  // The ranks' keys under the round's prefix, apart from the membership's (join_job: claim,
  // identity, done); an attempt of the run names its own below it.
  store_prefix_ = prefix + "/ranks/";
  engine_prefix_ = prefix;
  start_job_watch();
  publish_metrics_targets(prefix);
}

void JobController::start_job_watch() {
  // An attempt's watch of its own: the previous attempt's failure is not this one's.
  if (agent_) agent_->set_wake_fd(-1);  // before its descriptor closes
  job_watch_.reset();
  job_watch_ =
      std::make_unique<JobWatch>(placement_, fmt::format("{}/watch/a{}", engine_prefix_, attempt_),
                                 JobWatch::Options{}, job_seal_);
  // Its verdict ends the loop's wait at once (watch()), not at the wait's timeout.
  if (agent_) agent_->set_wake_fd(job_watch_->wake_fd());
}

void JobController::publish_metrics_targets(const std::string& prefix) {
  // Every node's /metrics through the store; node 0 writes them as one Prometheus file_sd
  // target file for the job (RUN/metrics_sd.json), each with its run, node and ranks.
  SealedRecords& store = *job_records_;
  store.set(fmt::format("{}/metrics/{}", prefix, placement_.node_rank), metrics_target_);
  if (placement_.node_rank != 0) return;
  nlohmann::json sd = nlohmann::json::array();
  for (uint32_t k = 0; k < placement_.nodes; ++k) {
    const auto t = store.get(fmt::format("{}/metrics/{}", prefix, k), std::chrono::seconds(10));
    if (!t) {
      log_warn("node {} did not say where its /metrics is within 10 s; not in the file_sd", k);
      continue;
    }
    metrics_targets_.resize(placement_.nodes);
    metrics_targets_[k] = *t;
    sd.push_back({{"targets", {*t}},
                  {"labels",
                   {{"run", run_id_},
                    {"job", placement_.job_id},
                    {"node", std::to_string(k)},
                    {"ranks", fmt::format("{}-{}", k * opt_.ranks, (k + 1) * opt_.ranks - 1)}}}});
  }
  write_file_atomic(run_ / "metrics_sd.json", sd.dump(2) + "\n");
  log_info("Prometheus file_sd of the job's {} nodes: {}", sd.size(),
           (run_ / "metrics_sd.json").string());
}

void JobController::write_job_manifest(std::string_view state) {
  if (!job_watch_ || placement_.node_rank != 0) return;
  const int64_t now = mono_ns();
  // While running, once a second per ten nodes at most: each view is a journal record of about
  // 150 bytes per node (a 1,000-node job's view every 100 s: ~5 MB an hour).
  const int64_t every_ns = std::max<int64_t>(1, placement_.nodes / 10) * 1'000'000'000;
  if (state == "running" && now - job_manifest_ns_ < every_ns) return;
  job_manifest_ns_ = now;
  const auto view = job_watch_->nodes();
  capnp::MallocMessageBuilder msg;
  auto j = msg.initRoot<schema::JobManifest>();
  j.setSchemaVersion(schema::SCHEMA_VERSION);
  j.setRunId(run_id_);
  j.setJobId(placement_.job_id);
  j.setSource(placement_.source);
  j.setState(std::string(state));
  if (failure_)
    j.setFirstFailure(fmt::format("{}: {}", schemas::name(failure_->kind), failure_->message));
  j.setNodes(placement_.nodes);
  j.setRanksPerNode(opt_.ranks);
  j.setWorld(world_);
  j.setAttempt(attempt_);
  uint32_t slowest = view.empty() ? 0 : UINT32_MAX;
  for (const auto& n : view) slowest = std::min(slowest, n.step);
  j.setSlowestStep(slowest);
  j.setJobLatest(job_latest_);
  j.setUpdatedAt(rfc3339(wall_ns()));
  auto list = j.initNodeList(placement_.nodes);
  for (uint32_t k = 0; k < placement_.nodes; ++k) {
    auto n = list[k];
    n.setNode(k);
    if (k < placement_.hosts.size()) n.setHost(placement_.hosts[k]);
    n.setFirstRank(k * opt_.ranks);
    n.setRanks(opt_.ranks);
    if (k < view.size()) {
      n.setStep(view[k].step);
      n.setCommitted(view[k].committed);
      n.setState(view[k].lost ? "lost" : view[k].finished ? "finished" : "running");
    }
    if (k < metrics_targets_.size()) n.setMetrics(metrics_targets_[k]);
  }
  // Journaled; the collector folds the newest into RUN/job.json (the live collector as the job
  // runs, the in-process fold at its end, `megacpp collect` again from the journals).
  const std::string json = schemas::to_json(j.asReader());
  journal_->append([&](schema::JournalRecord::Builder r) { r.setJobView(json); });
}

void JobController::open_journals() {
  journal_ =
      std::make_unique<ipc::JournalWriter>(layout::journal_path(run_, StageKind::SUPERVISOR, 0));
  journal_->set_identity(StageKind::SUPERVISOR, 0);
  journal_->set_attempt(attempt_);
  journal_->append([](schema::JournalRecord::Builder r) { r.setProcessStarted(); });
  checkpoint_journal_ =
      std::make_unique<ipc::JournalReader>(layout::journal_path(run_, StageKind::CHECKPOINTER, 0));
}

void JobController::archive_attempt() {
  // The previous attempt's contract and failure dumps move to RUN/attempts/<n>/; journals
  // and logs stay where they are (every record carries its attempt; logs are appended).
  const fs::path keep = layout::attempt_dir(run_, previous_attempt_);
  fs::create_directories(keep / "failures");
  fs::copy_file(layout::launch_path(run_), keep / "launch.json",
                fs::copy_options::overwrite_existing);
  fsync_path(keep / "launch.json");
  for (const auto& entry : fs::directory_iterator(layout::failures_dir(run_))) {
    fs::rename(entry.path(), keep / "failures" / entry.path().filename());
  }
  fsync_path(keep / "failures");
  fsync_path(layout::failures_dir(run_));
  // Checkpoints newer than the chosen one that do not verify are set aside (kept for a
  // person to inspect, never loaded, never taken for a committed step by the checkpointer),
  // and LATEST names the chosen one.
  const fs::path ckdir = layout::checkpoints_dir(run_);
  for (uint32_t step : skipped_steps_) {
    const std::string name = layout::checkpoint_dir_name(step);
    const fs::path aside = ckdir / fmt::format("{}.rejected-attempt{}", name, attempt_);
    fs::rename(ckdir / name, aside);
    log_warn("set {} aside as {}", name, aside.filename().string());
  }
  fsync_path(ckdir);
  if (resume_)
    write_file_atomic(ckdir / "LATEST", layout::checkpoint_dir_name(resume_->step) + "\n");
}

void JobController::begin_attempt() {
  archive_attempt();
  if (!resume_) {
    // An engine's restart of a job that failed before any step was committed on every node:
    // training starts again from step 0, as this run's next attempt.
    log_warn(
        "{} restarted run {} before any checkpoint every node has: attempt {} trains from "
        "step 0",
        placement_.source, run_id_, attempt_);
    return;
  }
  log_info("resuming run {} as attempt {} from {} (step {} of {}) on {} ranks{}", run_id_, attempt_,
           resume_->relative_path, resume_->step, opt_.steps, opt_.ranks,
           rank_batch_ ? fmt::format(", {} sequences per rank (global batch {})", rank_batch_,
                                     global_batch_)
                       : "");
}

void JobController::write_launch_contract() {
  capnp::MallocMessageBuilder msg;
  auto l = msg.initRoot<schema::LaunchContract>();
  l.setSchemaVersion(schema::SCHEMA_VERSION);
  l.setRunId(run_id_);
  l.setGeneration(0);
  l.setCreatedAt(created_at_);
  l.setRunDir(run_.string());
  l.setDataDir(opt_.data_dir.string());
  l.setSockDir(sock_dir_.string());
  l.setShmPrefix(shm_prefix_);
  l.setControlEndpoint(control_ep_);
  l.setCheckpointEndpoint(checkpoint_ep_);
  l.setStoreHost(store_host_);
  l.setStorePort(store_port_);
  l.setStorePrefix(store_prefix_);
  l.setWorld(world_);
  l.setFirstRank(first_rank_);
  l.setLocalRanks(opt_.ranks);
  l.setSteps(opt_.steps);
  l.setDevice(opt_.device);
  l.setMuonPrecision(muon_precision_);
  l.setSnapshotStaging(snapshot_staging_);
  l.setRingSlots(opt_.ring_slots);
  // The recipe rules keep it within kMaxBatchSlotBytes, which fits 32 bits.
  l.setRingSlotBytes(static_cast<uint32_t>(batch_.slot.slot_bytes()));
  recipe::to_spec(batch_, l.initBatch());
  l.setHeartbeatIntervalMs(opt_.heartbeat_interval_ms);
  recipe::to_spec(recipe_, l.initRecipe());
  auto gates = l.initGates(static_cast<unsigned>(gates_.size()));
  for (unsigned i = 0; i < gates.size(); ++i) {
    const recipe::Gate& g = gates_[i];
    gates[i].setRule(g.rule);
    gates[i].setPassed(g.passed);
    gates[i].setChecked(g.checked);
    gates[i].setDetail(g.detail);
    gates[i].setReason(g.reason);
    gates[i].setRetires(g.retires);
  }
  auto f = l.initFilesystem();
  f.setPath(run_.string());
  f.setType(fs_type_);
  f.setDevice(fs_device_);
  f.setIsRootVolume(fs_root_);
  data::to_spec(dataset_, l.initDataset());
  if (recipe_.train.eval_every > 0)
    data::to_spec(validation_, recipe_.train.eval_every,
                  validation_.dataset ? kValidationRingSlots : 0, l.initValidation());
  const std::pair<const char*, fs::path> volumes[] = {
      {"data", dataset_.files.front().path.parent_path()},
      {"checkpoints", layout::checkpoints_dir(run_)},
      {"logs", layout::logs_dir(run_)}};
  auto vols = l.initVolumes(3);
  for (unsigned i = 0; i < 3; ++i) {
    vols[i].setRole(volumes[i].first);
    describe_volume(volumes[i].second, vols[i].initFilesystem());
  }
  auto argv = l.initArgv(static_cast<unsigned>(opt_.argv.size()));
  for (size_t i = 0; i < opt_.argv.size(); ++i) argv.set(static_cast<unsigned>(i), opt_.argv[i]);
  // The environment overlay: only the families that change numerics or transport, and never
  // anything whose name suggests a secret.
  std::vector<std::pair<std::string, std::string>> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    std::string k = kv.substr(0, eq);
    bool family = k.starts_with("TORCH") || k.starts_with("NCCL") || k.starts_with("CUDA") ||
                  k.starts_with("OMP_") || k.starts_with("MEGACPP_") || k.starts_with("GLOO");
    bool secret = false;
    for (const char* word : {"TOKEN", "SECRET", "KEY", "PASS", "CREDENTIAL", "AUTH", "PRIVATE"})
      secret = secret || k.find(word) != std::string::npos;
    if (family && !secret) env.emplace_back(k, kv.substr(eq + 1));
  }
  std::sort(env.begin(), env.end());
  auto ev = l.initEnv(static_cast<unsigned>(env.size()));
  for (size_t i = 0; i < env.size(); ++i) {
    ev[static_cast<unsigned>(i)].setName(env[i].first);
    ev[static_cast<unsigned>(i)].setValue(env[i].second);
  }
  auto p = l.initProvenance();
  p.setVersion(MEGACPP_VERSION);
  p.setGitRevision(source_revision().revision);
  p.setGitDirty(source_revision().dirty);
  p.setBuildType(MEGACPP_BUILD_TYPE);
  p.setCompiler(compiler_name());
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  p.setHostname(host);
  p.setTorchVersion(torch_version());
  p.setKernel(kernel_description());
  p.setCpuModel(cpu_model());
  p.setCpuCount(static_cast<uint32_t>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN))));
  p.setBuildFlags(MEGACPP_BUILD_FLAGS);
  l.setSupervisorPid(::getpid());
  l.setSupervisorStartTicks(detail::process_start_ticks(::getpid()));
  l.setMetricsEndpoint(metrics_endpoint_);
  l.setCollectorStallSeconds(opt_.collector_stall_s);
  l.setLoaderStallSeconds(opt_.loader_stall_s);
  l.setCheckpointerStallSeconds(opt_.checkpointer_stall_s);
  l.setAttempt(attempt_);
  if (resume_) {
    auto r = l.initResume();
    r.setStep(resume_->step);
    r.setCheckpoint(resume_->dir.string());
    r.setWorld(resume_->world);
    r.setRankBatch(rank_batch_);
    r.setDataPosition(data_position_after(resume_->step));
  }
  if (parent_) {
    auto p = l.initParent();
    p.setRunDir(parent_->run_dir);
    p.setRunId(parent_->run_id);
    p.setStep(parent_->step);
    p.setCheckpoint(parent_->checkpoint);
  }
  auto coll = l.initCollectives();
  coll.setBackend(collectives_.backend);
  coll.setTimeoutSeconds(collectives_.timeout_s);
  coll.setAbortOnTeardown(opt_.abort_collectives);
  coll.setAbortWaitSeconds(opt_.abort_wait_s);
  coll.setNcclAsyncErrorHandling(collectives_.nccl_async_error_handling);
  coll.setNcclEnableMonitoring(collectives_.nccl_enable_monitoring);
  coll.setNcclHeartbeatTimeoutSeconds(collectives_.nccl_heartbeat_timeout_s);
  auto policy = l.initCheckpointPolicy();
  policy.setKeep(opt_.keep_checkpoints);
  policy.setKeepEvery(opt_.keep_every);
  auto place = l.initPlacement();
  place.setSource(placement_.source);
  place.setNodes(placement_.nodes);
  place.setNodeRank(placement_.node_rank);
  place.setMasterHost(placement_.master_host);
  place.setMasterPort(placement_.master_port);
  auto hosts = place.initHosts(static_cast<unsigned>(placement_.hosts.size()));
  for (unsigned i = 0; i < hosts.size(); ++i) hosts.set(i, placement_.hosts[i]);
  place.setJobId(placement_.job_id);
  place.setAttempt(placement_.attempt);
  place.setIface(placement_.iface);
  place.setNodesFrom(placement_.nodes_from);
  place.setEngineStore(placement_.engine_store);
  write_file_atomic(layout::launch_path(run_), schemas::to_json(l.asReader()));
}

}  // namespace detail

}  // namespace megacpp::supervisor
