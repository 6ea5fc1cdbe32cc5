// megacpp-trainer: one trainer rank. Joins the process group (Gloo on CPU, NCCL on CUDA through
// the CUDA plugin), trains on the batches its data
// loader publishes into the rank's shm ring, journals every step, and hands snapshots to
// the checkpointer through a leased staging region (DESIGN.md "Decisions": snapshot ownership).
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <torch/version.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/shm.h"
#include "ipc/slot_ring.h"
#include "recipes/recipe.h"
#include "schemas/run_layout.h"
#include "stages/stage.h"
#include "stages/trainer/collective.h"
#include "stages/trainer/cuda_plugin.h"
#include "stages/trainer/host_allocator.h"
#include "stages/trainer/rendezvous.h"
#include "stages/trainer/snapshot_plane.h"
#include "stages/trainer/staged_snapshot.h"
#include "stages/trainer/step_profile.h"
#include "stages/trainer/train_step.h"

namespace megacpp::trainer {
namespace {

using Clock = std::chrono::steady_clock;
using schema::Phase;

constexpr ipc::Millis kPoll{100};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A seconds knob (core/knobs.h) as a positive duration; `fallback` for a computed default.
std::chrono::milliseconds knob_millis(Knob k, std::optional<double> fallback = std::nullopt) {
  const double s = fallback ? knob_seconds(k, *fallback) : knob_seconds(k);
  MEGACPP_CHECK(s > 0, ErrorKind::kInvalidArgument,
                fmt::format("{} must be > 0", knob_spec(k).name));
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0));
}

double boottime_seconds() {
  timespec ts{};
  SYSCALL_CHECK(clock_gettime(CLOCK_BOOTTIME, &ts));
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Seconds since the kernel started this process (/proc/self/stat starttime, clock ticks
// since boot), so the dynamic loading of libtorch before main() is counted. Falls back to
// the time since `main_entry` when /proc is unreadable.
double seconds_since_process_start(Clock::time_point main_entry) {
  try {
    const std::string stat = read_file("/proc/self/stat");
    const auto close = stat.rfind(')');
    if (close != std::string::npos) {
      std::istringstream fields(stat.substr(close + 1));
      std::string field;
      // Fields after the command name start at field 3 (state); starttime is field 22.
      for (int i = 3; i <= 22 && fields >> field; ++i) {
        if (i == 22) {
          const long ticks = SYSCALL_CHECK(sysconf(_SC_CLK_TCK));
          return boottime_seconds() - std::stod(field) / static_cast<double>(ticks);
        }
      }
    }
  } catch (const std::exception& e) {
    log_warn("process start time unavailable ({}); timing from main()", e.what());
  }
  return seconds_since(main_entry);
}

// Seconds of this rank's start-up so far: from the process's start, or for a spare from when
// it became this launch (its wait before that is no start-up of the launch).
double startup_seconds(const stage::StageContext& ctx, Clock::time_point main_entry) {
  if (const auto activated = ctx.activated()) return seconds_since(*activated);
  return seconds_since_process_start(main_entry);
}

// Runs `fn`, turning a foreign exception (a c10::Error from torch, std::bad_alloc, ...) into
// a typed megacpp::Error of the rank's own, in one line: kInternal, whatever the world size,
// except a device out of memory (kInvalidArgument: the recipe does not fit). Failures
// inside a collective or the rendezvous arrive here already typed as a peer failure or a
// timeout (collective.h), and pass through.
template <typename F>
auto typed_errors(std::string_view what, F&& fn) {
  try {
    return fn();
  } catch (const Error&) {
    throw;
  } catch (const c10::OutOfMemoryError& e) {
    // The recipe's, not a bug: the same step runs out again after a restart.
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "{}: the device ran out of memory ({}); lower train.batch_size, set "
                 "train.recompute to selective or full, or add ranks (`megacpp plan RECIPE "
                 "--device cuda` prints what a rank needs)",
                 what, exception_text(e));
  } catch (const std::exception& e) {
    MEGACPP_FAIL(ErrorKind::kInternal, "{}: {}", what, exception_text(e));
  }
}

// The batch ring is created by the loader side; a rank that starts first waits for it,
// bounded by `timeout`.
struct Ring {
  std::unique_ptr<ipc::ShmRegion> region;
  std::unique_ptr<ipc::SlotRing> ring;
};

std::optional<Ring> attach_ring(stage::StageContext& ctx, const std::string& name,
                                std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    try {
      Ring r;
      r.region = std::make_unique<ipc::ShmRegion>(ipc::ShmRegion::Attach{}, name);
      r.ring = std::make_unique<ipc::SlotRing>(*r.region);
      return r;
    } catch (const Error& e) {
      const bool absent = e.kind() == ErrorKind::kSystem && e.sys_errno() == ENOENT;
      const bool unformatted = e.kind() == ErrorKind::kCorruption;
      if (!(absent || unformatted) || Clock::now() >= deadline) {
        MEGACPP_FAIL_LIKE(e, "batch ring {}: {}", name, e.what());
      }
    }
    if (ctx.stop_requested()) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// The rank's snapshot plane, configured from the launch contract and the knobs.
SnapshotPlaneOptions snapshot_options(stage::StageContext& ctx) {
  auto launch = ctx.launch();
  SnapshotPlaneOptions o;
  o.endpoint = launch.getCheckpointEndpoint();
  o.identity = layout::process_name(schema::StageKind::TRAINER, ctx.rank());
  o.peer_name = layout::process_name(schema::StageKind::CHECKPOINTER, 0);
  o.region_name = layout::staging_shm_name(std::string(launch.getShmPrefix()), ctx.rank());
  // The rank gives up on the checkpointer only well after the supervisor would have replaced
  // a wedged one (its stall budget) and the re-sent snapshot was written: otherwise the
  // waiting rank, not the checkpointer, would be the failure.
  const double stall =
      launch.getCheckpointerStallSeconds() > 0 ? launch.getCheckpointerStallSeconds() : 60.0;
  o.lease_timeout = knob_millis(Knob::kSnapshotLeaseTimeoutS, std::max(60.0, 2 * stall + 30));
  o.commit_timeout = knob_millis(Knob::kFinalCommitTimeoutS, std::max(120.0, 2 * stall + 60));
  o.resend_interval = knob_millis(Knob::kSnapshotResendS);
  o.stop_requested = [&ctx] { return ctx.stop_requested(); };
  return o;
}

// Where the rank stages its snapshots, as the supervisor settled it (launch snapshotStaging,
// from MEGACPP_SNAPSHOT_STAGING and the plan): an exported buffer the checkpointer imports —
// device memory (device) or the memfd stand-in (memfd) — or the named host region (host, or
// empty in an older contract).
void configure_staging(SnapshotPlaneOptions& o, schema::LaunchContract::Reader launch,
                       const CudaPlugin* cuda, int index, uint32_t rank) {
  const std::string mode = launch.getSnapshotStaging().cStr();
  if (mode.empty() || mode == "host") return;
  MEGACPP_CHECK(
      mode == "device" || mode == "memfd", ErrorKind::kInvalidArgument,
      fmt::format("launch contract: snapshotStaging '{}' is not host, device or memfd", mode));
  o.handle_socket = layout::staged_handle_socket(launch.getCheckpointEndpoint().cStr());
  MEGACPP_CHECK(!o.handle_socket.empty(), ErrorKind::kInvalidArgument,
                fmt::format("snapshots staged in {} need the checkpointer on this node (an ipc:// "
                            "checkpoint endpoint, not {})",
                            mode, launch.getCheckpointEndpoint().cStr()));
  if (mode == "memfd") {
    o.make_staging = [rank](uint64_t bytes) { return make_memfd_staging(rank, bytes); };
    return;
  }
  MEGACPP_CHECK(cuda != nullptr, ErrorKind::kInvalidArgument,
                "launch contract: snapshots staged on the device of a rank without --device cuda");
  o.make_staging = [cuda, index, rank](uint64_t bytes) {
    return make_cuda_staging(*cuda, index, rank, bytes);
  };
  // Chosen by auto (not forced with MEGACPP_SNAPSHOT_STAGING=device): a driver that refuses to
  // export the buffer, or a checkpointer that cannot import it, leaves the rank on host staging
  // rather than failing the run.
  o.staging_fallback = knob_string(Knob::kSnapshotStaging) != "device";
}

// Fault-injection point names of the step's parts (stage::fault_point).
const char* fault_point_of(Phase phase) {
  switch (phase) {
    case Phase::FORWARD:
      return "forward";
    case Phase::BACKWARD:
      return "backward";
    case Phase::OPTIMIZER:
      return "optimizer";
    default:
      return nullptr;
  }
}

// A step whose loss or gradient norm was non-finite on any rank ends the run as `diverged`
// before anything of it is committed; every rank calls this at the same point. The rank that
// saw the non-finite value is the first failure; the others fail as its victims (peer failure).
void check_finite(TrainStep& ts, const StepTiming& timing, uint32_t step, uint32_t rank) {
  std::vector<uint32_t> ranks;
  if (timing.nonfinite_ranks) {
    ranks = *timing.nonfinite_ranks;
  } else if (ts.any_rank(timing.nonfinite)) {
    ranks.push_back(timing.nonfinite ? rank : UINT32_MAX);
  }
  if (ranks.empty()) return;
  if (timing.nonfinite) {
    MEGACPP_FAIL(ErrorKind::kDiverged,
                 "step {}: loss {} and gradient norm {} on rank {} (a NaN or an infinity); no "
                 "checkpoint of this step is committed (continue from the newest checkpoint, "
                 "e.g. with a lower learning rate)",
                 step, timing.loss, timing.grad_norm, rank);
  }
  std::string who;
  for (uint32_t r : ranks)
    who += (who.empty() ? "" : ", ") +
           (r == UINT32_MAX ? std::string("another rank") : fmt::format("rank {}", r));
  MEGACPP_FAIL(ErrorKind::kPeerFailure, "step {}: training diverged on {}; stopping with it", step,
               who);
}

enum class Outcome {
  kTrained,  // every planned step, the final checkpoint committed
  kStopped,  // a graceful stop: the agreed step's checkpoint committed
  kLeft,     // a stop request (SIGTERM/SIGINT, a Stop) ended it early
};

// Trains every planned step (or up to a graceful stop) and waits for the final commit.
Outcome run_rank(stage::StageContext& ctx, Clock::time_point main_entry,
                 const HostAllocator* host_allocator) {
  auto launch = ctx.launch();
  const uint32_t rank = ctx.rank();
  const uint32_t world = launch.getWorld();
  const uint32_t steps = launch.getSteps();
  const ModelConfig model = model_config(launch.getRecipe());
  TrainConfig train = train_config(launch.getRecipe().getTrain());
  // The attempt's batch geometry, as the supervisor resolved it: a resume at another world size
  // keeps the global batch with its own batch per rank.
  const recipe::BatchGeometry geometry = recipe::batch_geometry(launch);
  train.batch_size = geometry.slot.batch;
  const auto resume = launch.getResume();
  validate(model);
  MEGACPP_CHECK(world > 0 && rank < world, ErrorKind::kInvalidArgument,
                fmt::format("rank {} outside world {}", rank, world));
  MEGACPP_CHECK(steps > 0 && train.batch_size > 0, ErrorKind::kInvalidArgument,
                "launch: steps and batchSize must be > 0");

  const int64_t threads = knob_int(Knob::kTrainerThreads);
  MEGACPP_CHECK(threads > 0, ErrorKind::kInvalidArgument, "MEGACPP_TRAINER_THREADS must be > 0");
  torch::set_num_threads(static_cast<int>(threads));
  const auto store_timeout = knob_millis(Knob::kStoreTimeoutS);

  // --device cuda: this node's rank i (global rank first + i) on CUDA device i of those
  // visible. The plugin is loaded before any tensor exists and lives as long as this
  // function's tensors and group.
  const bool on_cuda = launch.getDevice() == "cuda";
  std::optional<CudaPlugin> cuda;
  at::Device device = at::kCPU;
  const stage::LocalRanks local = stage::local_ranks(launch);
  MEGACPP_CHECK(local.contains(rank), ErrorKind::kInvalidArgument,
                fmt::format("rank {} is not one of this node's ranks {}..{}", rank, local.first,
                            local.end() - 1));
  const uint32_t local_rank = rank - local.first;
  if (on_cuda) {
    cuda.emplace(CudaPlugin::beside_executable());
    const int visible = cuda->api().device_count();
    MEGACPP_CHECK(static_cast<int64_t>(local_rank) < visible, ErrorKind::kInvalidArgument,
                  fmt::format("--device cuda: rank {} needs CUDA device {}, {} visible", rank,
                              local_rank, visible));
    cuda->api().set_device(static_cast<int>(local_rank));
    device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
    log_info("training on cuda:{} ({})", local_rank, cuda->api().versions());
  }

  // The layout (recipes/recipe.h mode): tensor-parallel groups of `tp` consecutive ranks that
  // share a batch, and data-parallel groups of the ranks at one position in their groups.
  const uint32_t tp = model.tensor_parallel();
  MEGACPP_CHECK(
      world % tp == 0, ErrorKind::kInvalidArgument,
      fmt::format("mode {} needs the world ({}) to be a multiple of {}", model.mode, world, tp));
  const uint32_t dp_world = world / tp, dp_rank = rank / tp, tp_rank = rank % tp;
  // job_pg: every rank, under tensor parallelism across replicas (DistMuon's split matrices).
  c10::intrusive_ptr<c10d::Backend> pg, tp_pg, job_pg;
  if (world > 1) {
    GlooOptions go;
    go.store_host = std::string(launch.getStoreHost());
    go.store_port = static_cast<uint16_t>(launch.getStorePort());
    go.store_timeout = store_timeout;
    // The contract's timeout (it also configures NCCL's watchdog); a contract written before
    // it existed leaves it to the knob.
    const double collective_s = launch.getCollectives().getTimeoutSeconds();
    go.collective_timeout =
        collective_s > 0 ? std::chrono::milliseconds(static_cast<int64_t>(collective_s * 1e3))
                         : knob_millis(Knob::kCollectiveTimeoutS);
    go.device_hostname = knob_string(Knob::kGlooHostname);
    // A job across nodes: Gloo's transport on the interface the job names (else the hostname
    // knob's address, loopback by default).
    go.device_iface = std::string(launch.getPlacement().getIface());
    // Ranks of different nodes never exchange through shared memory, even where namespaces as
    // nodes share one /dev/shm (a contract written before placement: one node).
    go.peer_exchange_host = fmt::format("node{}", launch.getPlacement().getNodeRank());
    // Every node of a job across nodes names the same prefix (the job's, from its key file);
    // one node keys its ranks by its run id.
    const std::string store_prefix = launch.hasStorePrefix() && launch.getStorePrefix().size() > 0
                                         ? std::string(launch.getStorePrefix())
                                         : fmt::format("megacpp/{}/", launch.getRunId().cStr());
    const std::string prefix =
        fmt::format("{}a{}/g{}/", store_prefix, launch.getAttempt(), launch.getGeneration());
    // One group per call; without tensor parallelism the data-parallel group is the world,
    // under the prefix it always had.
    auto join = [&](uint32_t group_rank, uint32_t group_world, std::string group_prefix,
                    std::string_view group_name) {
      go.rank = group_rank;
      go.world = group_world;
      go.store_prefix = std::move(group_prefix);
      go.peer_exchange_prefix =
          knob_int(Knob::kPeerExchange) != 0
              ? layout::exchange_shm_prefix(std::string(launch.getShmPrefix()), group_name)
              : std::string();
      c10::intrusive_ptr<c10d::Backend> group;
      with_peers(fmt::format("rendezvous at {}:{}", go.store_host, go.store_port),
                 std::min(go.store_timeout, go.collective_timeout), [&] {
                   group = on_cuda ? connect_nccl(go, *cuda, static_cast<int>(local_rank))
                                   : connect_gloo(go);
                 });
      return group;
    };
    const char* backend = on_cuda ? "NCCL" : "Gloo";
    if (tp == 1) {
      pg = join(rank, world, prefix, "dp");
      log_info("joined the {} group as rank {} of {}", backend, rank, world);
    } else {
      tp_pg =
          join(tp_rank, tp, fmt::format("{}tp{}/", prefix, dp_rank), fmt::format("tp{}", dp_rank));
      if (dp_world > 1) {
        pg = join(dp_rank, dp_world, fmt::format("{}dp{}/", prefix, tp_rank),
                  fmt::format("dp{}", tp_rank));
        job_pg = join(rank, world, fmt::format("{}job/", prefix), "job");
      }
      log_info(
          "joined {} tensor-parallel group {} as rank {} of {} and data-parallel group {} "
          "as rank {} of {}",
          backend, dp_rank, tp_rank, tp, tp_rank, dp_rank, dp_world);
    }
  }
  // The supervisor's AbortCollectives (a failed job's teardown, before its signals) aborts the
  // group from the control client's abort thread (heartbeats go on): NCCL's communicators (no
  // kernel left spinning), or every wait of this thread in a Gloo collective. Removed before
  // the group and plugin go.
  // `aborted` tells the training loop: an aborted NCCL group leaves the step in flight to finish
  // on bytes nobody reduced (its waits do not block the host), so nothing of it is journaled or
  // snapshotted once the flag is up.
  const auto aborted = std::make_shared<std::atomic<bool>>(false);
  if (pg || tp_pg || job_pg) {
    const CudaPlugin* plugin = cuda ? &*cuda : nullptr;
    ctx.control().set_abort_handler([pg, tp_pg, job_pg, plugin, aborted] {
      aborted->store(true);
      try {
        for (const auto& group : {pg, tp_pg, job_pg}) {
          if (!group) continue;
          if (plugin != nullptr) {
            plugin->api().abort(group);
          } else {
            group->abort();
          }
        }
      } catch (const Error&) {
        throw;
      } catch (const std::exception& e) {
        // The reply's error goes to the journal and the supervisor's log: one line.
        MEGACPP_FAIL(ErrorKind::kSystem, "aborting the collectives: {}", exception_text(e));
      }
    });
  }
  // Start-up receipts (receipts/first_forward.json, receipts/backend_identity.json): when the
  // groups were joined, and what this rank computes with.
  ctx.journal().append([&](schema::JournalRecord::Builder r) {
    r.initRendezvousDone().setSeconds(startup_seconds(ctx, main_entry));
  });
  ctx.journal().append([&](schema::JournalRecord::Builder r) {
    auto b = r.initBackendIdentity();
    b.setTorchVersion(TORCH_VERSION);
    b.setBackend(world == 1 ? "none" : on_cuda ? "nccl" : "gloo");
    b.setBackendVersion(on_cuda ? std::string(cuda->api().versions())
                                : fmt::format("gloo (torch {})", TORCH_VERSION));
    b.setDevice(on_cuda ? fmt::format("cuda:{}", local_rank) : std::string("cpu"));
    b.setDeviceName(on_cuda ? std::string(cuda->api().device_name(static_cast<int>(local_rank)))
                            : cpu_model());
    b.setThreads(static_cast<uint32_t>(threads));
    b.setTensorParallel(tp);
    b.setOrthogonalization(train.optim.muon_bf16 ? "bfloat16" : "float32");
    b.setCpuBf16Units(cpu_bf16_units());
    b.setHostAllocator(host_allocator != nullptr
                           ? fmt::format("cache >= {} bytes", host_allocator->config().min_bytes)
                           : std::string("system"));
    b.setCompiler(fmt::format("gcc {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__));
#ifdef NDEBUG
    b.setBuildType("release (NDEBUG)");
#else
    b.setBuildType("debug (assertions on)");
#endif
  });
  struct AbortHandlerGuard {
    ipc::ControlClient& control;
    ~AbortHandlerGuard() { control.set_abort_handler({}); }
  } abort_guard{ctx.control()};

  // What the process holds before its model (libtorch, its groups, the mapped rings): step
  // records carry it beside the peak, so the model's own memory is their difference — with the
  // pages of mapped files (libtorch's code, paged in as it first runs) out of both.
  const ProcessMemory memory_baseline = process_memory();
  OptimKernels kernels;
  if (cuda) {
    const bool fused = knob_int(Knob::kFusedOptim) != 0;
    if (fused) kernels = cuda->optim_kernels(device.index());
    log_info("DistAdamW's update and Muon's tail through {}",
             kernels.adamw_step && kernels.muon_tail
                 ? "the fused kernels (adamw_step_cuda, muon_tail_cuda)"
             : !fused ? "torch's operations (MEGACPP_FUSED_OPTIM=0)"
                      : "torch's operations (the CUDA plugin was built without the ops' kernels: "
                        "no nvcc)");
  }
  const auto ts = typed_errors("model set-up and parameter broadcast", [&] {
    return std::make_unique<TrainStep>(
        model, train, steps, pg, device,
        TensorParallel{.group = tp_pg, .rank = tp_rank, .size = tp, .job = job_pg},
        std::move(kernels));
  });
  // Each node's part of a checkpoint holds the replicated state its ranks resume from.
  ts->set_replicated_rank(local.first);
  // Resume: parameters and optimizer state from the checkpoint (every rank reads the files
  // itself; the data sequence and the LR schedule are functions of the step).
  const uint32_t first_step = resume.getStep() + 1;
  if (resume.getStep() > 0) {
    const std::string dir = resume.getCheckpoint();
    typed_errors(fmt::format("restoring checkpoint {}", dir), [&] {
      const auto begin = Clock::now();
      const checkpoint::CheckpointReader ckpt(dir);
      MEGACPP_CHECK(ckpt.step() == resume.getStep(), ErrorKind::kCorruption,
                    fmt::format("checkpoint {} holds step {}, the launch contract says {}", dir,
                                ckpt.step(), resume.getStep()));
      ts->restore(ckpt);
      const double seconds = seconds_since(begin);
      ctx.journal().append([&](schema::JournalRecord::Builder r) {
        auto c = r.initCheckpointRestored();
        c.setStep(ckpt.step());
        c.setCheckpoint(dir);
        c.setWorld(ckpt.world());
        c.setSeconds(seconds);
      });
      log_info("restored step {} from {} (written by {} ranks) in {:.3f}s", ckpt.step(), dir,
               ckpt.world(), seconds);
    });
  }

  const std::string ring_name = layout::ring_shm_name(std::string(launch.getShmPrefix()), rank);
  auto ring = attach_ring(ctx, ring_name, store_timeout);
  if (!ring) return Outcome::kLeft;
  const recipe::BatchSpec& batch = geometry.slot;
  const int64_t B = batch.batch;
  const int64_t T = batch.seq_len;  // tokens trained on per row
  MEGACPP_CHECK(
      ring->ring->slot_bytes() >= batch.slot_bytes(), ErrorKind::kInvalidArgument,
      fmt::format("ring slots of {} bytes cannot hold a [{}, {}] batch of {}-byte tokens",
                  ring->ring->slot_bytes(), batch.shape()[0], batch.shape()[1], batch.token_bytes));

  // Held-out evaluation (README.md "Validation loss"): the slots of this rank's data rank's
  // part of the val split, from its validation ring, after every eval_every-th step, the last
  // one and a graceful stop's.
  const recipe::ValidationShare share = recipe::validation_share(launch);
  const uint32_t eval_every = launch.getValidation().getEvery();
  std::optional<Ring> val_ring;
  if (share.windows > 0) {
    val_ring =
        attach_ring(ctx, layout::validation_ring_shm_name(std::string(launch.getShmPrefix()), rank),
                    store_timeout);
    if (!val_ring) return Outcome::kLeft;
    MEGACPP_CHECK(val_ring->ring->slot_bytes() >= batch.slot_bytes(), ErrorKind::kInvalidArgument,
                  "validation ring slots cannot hold a batch");
  }
  uint32_t evaluation = 0;    // this attempt's evaluations so far (the ring's tags)
  float last_val_loss = NAN;  // the newest evaluation's, published with every step
  uint32_t last_val_step = 0;

  // MEGACPP_TRACE_BATCHES: what this rank trained on, for tests and for a person asking
  // which tokens a step saw.
  const auto trace_batches =
      static_cast<uint64_t>(std::max<int64_t>(0, knob_int(Knob::kTraceBatches)));
  std::ofstream trace;
  if (trace_batches > 0)
    trace.open(layout::logs_dir(launch.getRunDir().cStr()) / fmt::format("batches-{}.bin", rank),
               std::ios::binary | std::ios::app);
  // MEGACPP_PROFILE_STEPS: torch's profiler over a range of steps (step_profile.h).
  std::optional<StepProfile> profile;
  if (const auto range = parse_profile_steps(knob_string(Knob::kProfileSteps)))
    profile.emplace(*range, on_cuda,
                    layout::logs_dir(launch.getRunDir().cStr()) / fmt::format("profile-{}", rank),
                    on_cuda ? fmt::format("cuda:{} ({})", local_rank,
                                          cuda->api().device_name(static_cast<int>(local_rank)))
                            : fmt::format("cpu ({})", cpu_model()));

  // The ring's wait naps 20-50 us; Linux's default timer slack would add 50 us to each, and
  // the batch's handoff is the time this rank is idle. Best effort.
  ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);

  SnapshotPlaneOptions plane = snapshot_options(ctx);
  configure_staging(plane, launch, cuda ? &*cuda : nullptr, static_cast<int>(local_rank), rank);
  SnapshotPlane snapshots(ctx.zmq(), *ts, std::move(plane));
  // The oldest slot of `r` (batch or validation ring), in WAIT_BATCH: short peeks so a stop
  // request is seen promptly (nullopt: asked to stop, leave), the snapshot plane served between.
  const auto await_slot = [&](Ring& r, const std::string& what) {
    ctx.set_phase(Phase::WAIT_BATCH);
    std::optional<ipc::SlotRing::Slot> slot;
    while (!(slot = r.ring->peek(kPoll))) {
      if (ctx.stop_requested()) {
        log_info("stop requested while waiting for {}; leaving", what);
        return slot;
      }
      snapshots.poll();
    }
    return slot;
  };
  bool first_forward_done = false, first_backward_done = false;
  double tokens_total = 0;
  auto step_start = Clock::now();
  // The previous step's tail, journaled with this step (its time is in this stepSeconds); the
  // snapshot's also counts this step's wait for the copy to finish before its update.
  double snapshot_seconds = 0, between_seconds = 0;
  at::Tensor pinned_batch;  // --device cuda: the page-locked batch buffer (below)
  for (uint32_t step = first_step; step <= steps; ++step) {
    if (profile) profile->before(step);
    const auto wait_start = Clock::now();
    const auto slot = await_slot(*ring, fmt::format("batch {}", step));
    if (!slot) return Outcome::kLeft;
    const double wait_seconds = seconds_since(wait_start);
    MEGACPP_CHECK(slot->tag == step, ErrorKind::kProtocol,
                  fmt::format("ring {}: expected the batch of step {}, got tag {} (seq {})",
                              ring_name, step, slot->tag, slot->seq));
    // The slot's narrow tokens are widened into a tensor of our own, so the slot goes back to
    // the loader at once (it refills while this step computes). On a device that tensor is a
    // page-locked buffer kept from step to step, copied to the device without blocking the
    // host (a pageable one is a synchronising copy): the step's one read of the host at its end
    // has the copy done before the next batch overwrites the buffer.
    recipe::BatchHeader header;
    if (device.is_cuda() && !pinned_batch.defined())
      pinned_batch =
          at::empty(batch.shape(), at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    const at::Tensor host_tokens = widen_batch(slot->data, batch, step, &header, pinned_batch);
    ring->ring->release();
    const at::Tensor tokens =
        device.is_cuda() ? host_tokens.to(device, /*non_blocking=*/true) : host_tokens;
    const double handoff_seconds = seconds_since(wait_start);
    if (step <= trace_batches) {
      const auto* p = static_cast<const char*>(host_tokens.data_ptr());
      trace.write(p, static_cast<std::streamsize>(host_tokens.nbytes()));
      trace.flush();
    }

    StepHooks hooks;
    hooks.stop_requested = [&] { return ctx.graceful_stop_requested(); };
    bool poison = false;
    hooks.poison_gradients = [&] { return poison; };
    // The previous step's snapshot is copied while this step's forward and backward run.
    hooks.before_update = [&] { snapshot_seconds += snapshots.settle(); };
    hooks.on_phase = [&](Phase p) {
      ctx.set_phase(p);
      if (const char* point = fault_point_of(p)) poison = stage::fault_point(ctx, point, step);
      if (p == Phase::OPTIMIZER && !first_backward_done) {
        first_backward_done = true;
        const double s = startup_seconds(ctx, main_entry);
        ctx.journal().append(
            [&](schema::JournalRecord::Builder r) { r.initFirstBackward().setSeconds(s); });
      }
      if (p == Phase::BACKWARD && !first_forward_done) {
        first_forward_done = true;
        const double s = startup_seconds(ctx, main_entry);
        ctx.journal().append(
            [&](schema::JournalRecord::Builder r) { r.initFirstForward().setSeconds(s); });
      }
    };
    const StepTiming timing =
        typed_errors(fmt::format("step {}", step), [&] { return ts->step(tokens, step, hooks); });
    const auto check_not_aborted = [&](std::string_view what) {
      MEGACPP_CHECK(!aborted->load(), ErrorKind::kPeerFailure,
                    fmt::format("{} {}: the supervisor aborted the collectives (the failed job's "
                                "teardown); its result is not used",
                                what, step));
    };
    check_not_aborted("step");
    if (profile) profile->after(step);
    // Wall time since the previous step ended (so it includes the previous snapshot copy):
    // the step times of a run add up to its training time.
    const double step_seconds = seconds_since(step_start);
    step_start = Clock::now();
    // Under sequence parallelism a rank trains on T / tp positions of its group's batch: the
    // ranks' tokens add up to the job's.
    const int64_t rank_tokens = B * T / tp;
    tokens_total += static_cast<double>(rank_tokens);

    ctx.journal().append([&](schema::JournalRecord::Builder r) {
      auto s = r.initStep();
      s.setStep(step);
      s.setLoss(timing.loss);
      s.setTokens(static_cast<uint32_t>(rank_tokens));
      s.setStepSeconds(step_seconds);
      s.setWaitSeconds(wait_seconds);
      s.setForwardSeconds(timing.forward_seconds);
      s.setBackwardSeconds(timing.backward_seconds);
      s.setOptimizerSeconds(timing.optimizer_seconds);
      s.setMemoryBaseline(memory_baseline.resident);
      s.setMemoryBaselineFile(memory_baseline.file);
      const ProcessMemory memory = process_memory();
      s.setMemoryPeak(memory.peak);
      s.setMemoryFile(memory.file);
      if (on_cuda) {
        uint64_t allocated = 0, reserved = 0;
        cuda->api().memory_peaks(static_cast<int>(local_rank), &allocated, &reserved);
        // The snapshot staging buffer staged on the device is the driver's, outside torch's
        // allocator: device memory all the same, and in the plan's total.
        const uint64_t staged = snapshots.staged_device_bytes();
        s.setDeviceMemoryPeak(allocated + staged);
        s.setDeviceMemoryReserved(reserved + staged);
      }
      s.setDataSeed(static_cast<uint32_t>(header.seed));
      s.setDataEpoch(static_cast<double>(header.next_position / header.windows));
      s.setDataCursor(static_cast<double>(header.next_position % header.windows));
      auto ph = s.initPhases();
      ph.setHandoffSeconds(handoff_seconds);
      ph.setClipSeconds(timing.clip_seconds);
      ph.setReduceSeconds(timing.optimizer_phases.reduce);
      ph.setOrthogonalizeSeconds(timing.optimizer_phases.orthogonalize);
      ph.setUpdateSeconds(timing.optimizer_phases.update);
      ph.setGatherSeconds(timing.optimizer_phases.gather);
      ph.setSnapshotSeconds(snapshot_seconds);
      ph.setBetweenSeconds(between_seconds);
      if (!timing.tokens_per_expert.empty()) {
        s.setAuxLoss(timing.aux_loss);
        size_t n = 0;
        for (const auto& layer : timing.tokens_per_expert) n += layer.size();
        auto tokens = s.initExpertTokens(static_cast<unsigned>(n));
        unsigned i = 0;
        for (const auto& layer : timing.tokens_per_expert)
          for (int64_t count : layer) tokens.set(i++, static_cast<uint32_t>(count));
      }
    });
    ctx.set_step(step);
    // The heartbeat's record: this step, and the newest evaluation so far.
    const auto publish = [&] {
      ctx.control().publish({.step = step,
                             .tokens = tokens_total,
                             .loss = timing.loss,
                             .step_seconds = step_seconds,
                             .val_loss = last_val_loss,
                             .val_step = last_val_step});
    };
    publish();

    snapshots.poll();
    check_finite(*ts, timing, step, ts->rank());
    // Graceful stop: every step the ranks agree whether any of them was asked to stop (in the
    // step's own gradient exchange, or by any_rank under tensor parallelism); if so this step
    // is the last, and its checkpoint is committed before they exit.
    const bool stopping =
        timing.stop_agreed ? *timing.stop_agreed : ts->any_rank(ctx.graceful_stop_requested());
    const bool final = step == steps || stopping;
    if (val_ring && (recipe::evaluates_at(eval_every, step, steps) || stopping)) {
      // Its time is its own: the next step's wall time starts after it.
      const auto eval_start = Clock::now();
      double eval_wait = 0;
      TrainStep::EvalSum mine;
      const uint32_t slots = share.slots(dp_rank);
      for (uint32_t k = 0; k < slots; ++k) {
        const auto wait_start = Clock::now();
        const auto slot =
            await_slot(*val_ring, fmt::format("validation slot {} after step {}", k, step));
        if (!slot) return Outcome::kLeft;
        eval_wait += seconds_since(wait_start);
        const uint64_t tag = recipe::validation_tag(evaluation, k);
        MEGACPP_CHECK(slot->tag == tag, ErrorKind::kProtocol,
                      fmt::format("validation ring of rank {}: expected slot {} of evaluation {}, "
                                  "got tag {:#x} (seq {})",
                                  rank, k, evaluation, slot->tag, slot->seq));
        recipe::BatchSpec rows = batch;
        rows.batch = share.rows(dp_rank, k);
        const at::Tensor val_tokens = widen_batch(slot->data, rows, tag);
        val_ring->ring->release();
        ctx.set_phase(Phase::EVALUATE);
        stage::fault_point(ctx, "evaluate", step);
        const auto part = typed_errors(fmt::format("evaluation after step {}", step),
                                       [&] { return ts->evaluate(val_tokens); });
        mine.loss_sum += part.loss_sum;
        mine.tokens += part.tokens;
      }
      const auto job = typed_errors(fmt::format("evaluation after step {}", step),
                                    [&] { return ts->sum_over_data_ranks(mine); });
      ++evaluation;
      const double val_loss = job.tokens > 0 ? job.loss_sum / job.tokens : NAN;
      const double eval_seconds = seconds_since(eval_start);
      ctx.journal().append([&](schema::JournalRecord::Builder r) {
        auto e = r.initEvaluation();
        e.setStep(step);
        e.setLoss(val_loss);
        e.setTokens(static_cast<uint64_t>(job.tokens));
        e.setRankTokens(static_cast<uint64_t>(mine.tokens));
        e.setSeconds(eval_seconds);
        e.setWaitSeconds(eval_wait);
      });
      last_val_loss = static_cast<float>(val_loss);
      last_val_step = step;
      publish();
      step_start += Clock::now() - eval_start;
    }
    between_seconds = seconds_since(step_start);
    snapshot_seconds = 0;
    if (final || (train.checkpoint_every > 0 && step % train.checkpoint_every == 0)) {
      if (ctx.stop_requested()) {
        log_info("stop requested after step {}; leaving without a snapshot", step);
        return Outcome::kLeft;
      }
      // Parameters and optimizer state are replicated or sharded alike on every rank, so every
      // rank that holds a non-finite entry fails here and none snapshots this step.
      if (auto bad = ts->first_nonfinite_state()) {
        MEGACPP_FAIL(ErrorKind::kDiverged,
                     "step {}: {} holds a NaN or an infinity; this step's checkpoint is not "
                     "committed (continue from the newest checkpoint, e.g. with a lower learning "
                     "rate)",
                     step, *bad);
      }
      check_not_aborted("the snapshot of step");
      // Waiting for the lease is waiting on the checkpointer.
      ctx.set_phase(Phase::SNAPSHOT);
      const auto snapshot_start = Clock::now();
      if (!snapshots.take(step, final)) return Outcome::kLeft;
      snapshot_seconds = seconds_since(snapshot_start);
    }
    if (stopping) {
      ctx.set_phase(Phase::SNAPSHOT);
      if (!snapshots.wait_committed(step)) return Outcome::kLeft;
      log_info("stopped on request after step {} of {}; its checkpoint is committed", step, steps);
      return Outcome::kStopped;
    }
  }
  ctx.set_phase(Phase::SNAPSHOT);
  if (!snapshots.wait_committed(steps)) {
    log_info("stop requested while waiting for the final commit; leaving");
    return Outcome::kLeft;
  }
  log_info("trained {} steps; final checkpoint committed", steps);
  return Outcome::kTrained;
}

}  // namespace
}  // namespace megacpp::trainer

int main(int argc, char** argv) {
  const auto main_entry = std::chrono::steady_clock::now();
  return megacpp::stage::run_stage_main(
      argc, argv, megacpp::schema::StageKind::TRAINER,
      "megacpp trainer rank: trains on its data loader's ring, snapshots to the checkpointer",
      [main_entry](megacpp::stage::StageContext& ctx) {
        // A rank that leaves early does not exit 0: only a finished rank is a clean exit, so a
        // stray SIGTERM is reported (kind "interrupted") instead of ending the run `ok`.
        // A graceful stop exits 0 too: its step is committed, which is all it owes.
        // Torch's CPU allocator for everything the rank computes, before its first tensor.
        const megacpp::trainer::HostAllocator* host_allocator =
            megacpp::trainer::install_host_allocator(
                megacpp::trainer::HostAllocatorConfig::from_knobs());
        const auto outcome = megacpp::trainer::run_rank(ctx, main_entry, host_allocator);
        if (host_allocator != nullptr) {
          const auto s = host_allocator->stats();
          megacpp::log_info(
              "host allocator: {} requests from idle mappings, {} mapped, {} unmapped; peak "
              "mapped {:.1f} MiB, live {:.1f} MiB",
              s.hits, s.misses, s.unmapped, static_cast<double>(s.peak_mapped_bytes) / (1 << 20),
              static_cast<double>(s.peak_live_bytes) / (1 << 20));
        }
        if (outcome == megacpp::trainer::Outcome::kLeft) {
          MEGACPP_FAIL(megacpp::ErrorKind::kInterrupted,
                       "asked to stop after step {} of {}, before training finished", ctx.step(),
                       ctx.launch().getSteps());
        }
      });
}
