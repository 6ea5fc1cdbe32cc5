// The lifecycle of one job on one node: prepare (validate, run directory, launch contract,
// rings, rendezvous), launch, watch, finish or tear down, fold, report.
//
// Blocking: the watch loop blocks only in zmq_poll with a 100 ms timeout over the control
// ROUTER and a signalfd (SIGCHLD, SIGINT, SIGTERM). Every wait for a child is bounded.
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include <capnp/message.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/ipc.h"
#include "recipes/recipe.h"
#include "schemas/enums.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"
#include "stages/collector/collector.h"
#include "supervisor/console.h"
#include "supervisor/failure_policy.h"
#include "supervisor/metrics.h"
#include "supervisor/process.h"
#include "supervisor/rendezvous.h"
#include "supervisor/supervisor.h"

namespace megacpp::supervisor {

namespace fs = std::filesystem;
using schema::Phase;
using schema::StageKind;

void RunOptions::validate() const {
  auto bad = [](std::string msg) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{}", std::move(msg));
  };
  if (ranks < 1 || ranks > layout::kMaxRanks)
    bad(fmt::format("--ranks {}: must be in [1, {}]", ranks, layout::kMaxRanks));
  if (steps < 1) bad("--steps must be >= 1");
  if (run_dir.empty()) bad("--run-dir is required");
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
  if (max_restarts > 100) bad("--max-restarts must be <= 100");
  if (!(metrics_linger_s >= 0) || metrics_linger_s > 3600)
    bad("--metrics-linger-s must be in [0, 3600]");
  if (metrics_addr.rfind(':') == std::string::npos) bad("--metrics-addr must be HOST:PORT");
  if (progress != "auto" && progress != "tty" && progress != "plain" && progress != "none") {
    bad("--progress must be auto, tty, plain or none");
  }
}

namespace {

struct Child {
  StageKind stage;
  uint32_t rank;
  std::string name;
  pid_t pid = -1;
  uint32_t generation = 0;
  uint32_t restarts = 0;
  bool alive = false;
  bool seen = false;  // a Hello or heartbeat of this generation arrived
  bool stop_sent = false;
  int exit_code = 0;
  int signal = 0;
  int64_t started_ns = 0;
  int64_t heartbeat_ns = 0;      // last heartbeat or hello (supervisor's receive time)
  int64_t phase_started_ns = 0;  // from the heartbeat (CLOCK_MONOTONIC is shared by the host)
  int64_t progress_ns = 0;       // last time the step advanced
  double last_step_wall = 0;
  uint32_t step = 0;
  Phase phase = Phase::STARTUP;
  double tokens = 0;
  float loss = NAN;
  double step_seconds = 0;
  double lag_seconds = 0;
  // As the working thread reported it (CLOCK_MONOTONIC of the stage; 0: not reported yet).
  int64_t work_ns = 0;
  uint64_t work_done = 0;
  int64_t pending_since_ns = 0;
  // A restart in progress: the previous generation was sent SIGKILL at dying_since_ns and
  // the next one is launched only once dying_pid is reaped, so two generations never share
  // a ring, a socket or the manifest.
  pid_t dying_pid = 0;
  int64_t dying_since_ns = 0;
  std::string restart_cause{};
};

using policy::Event;

struct Failure {
  schema::FailureKind kind = schema::FailureKind::NONE;
  StageKind stage = StageKind::SUPERVISOR;
  uint32_t rank = 0;
  std::string message;
};

std::string fs_type_name(long type) {
  switch (static_cast<unsigned long>(type)) {
    case 0xEF53:
      return "ext4";
    case 0x58465342:
      return "xfs";
    case 0x01021994:
      return "tmpfs";
    case 0x794c7630:
      return "overlay";
    case 0x9123683E:
      return "btrfs";
    case 0x6969:
      return "nfs";
    case 0x2fc12fc1:
      return "zfs";
    case 0x65735546:
      return "fuse";
    default:
      return fmt::format("0x{:x}", static_cast<unsigned long>(type));
  }
}

fs::path nearest_existing(fs::path p) {
  while (!p.empty() && !fs::exists(p)) p = p.parent_path();
  return p.empty() ? fs::path("/") : p;
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

// One observed failure, before roles are assigned.
// How long a SIGKILLed child may take to be reaped before the supervisor gives up on it: a
// process in uninterruptible sleep (stuck I/O) outlives SIGKILL until the I/O completes,
// which may be never. It is then named unkillable and not waited for.
constexpr double kKillWaitS = 1.0;

class Run {
 public:
  explicit Run(RunOptions o) : opt_(std::move(o)), budgets_(budgets_of(opt_)) {}
  ~Run() { cleanup(); }
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  int execute();

 private:
  void prepare();
  void write_launch_contract();
  void launch(StageKind stage, uint32_t rank, uint32_t generation, schema::ChildReason reason,
              const std::string& cause = {});
  void watch();
  void pump(int timeout_ms);
  void on_message(ipc::Received& m);
  void on_signals();
  void reap();
  void journal_child_exited(const Child& c, schema::ChildReason reason);
  void check_liveness();
  void restart_or_fail(Child& c, const std::string& why, Event ev);
  void record(Child& c, Event ev);
  void finish_ok();
  void teardown();
  void classify();
  void journal_graph(const std::string& reason);
  bool wait_for(const std::function<bool()>& done, double seconds);
  void stop_child(Child& c);
  void kill_child(const Child& c, int sig);
  void give_up_on(const Child& c, double waited_s = kKillWaitS);
  void journal_run_finished();
  void update_metrics();
  void release_ipc();
  int report();
  void cleanup();
  Child* by_name(const std::string& n);
  Child* by_pid(pid_t pid);
  Child* by_dying_pid(pid_t pid);
  // A generation killed for a restart was reaped: journal it and launch the next one
  // (unless the run is ending). reap_dying() is the bounded, non-blocking form for cleanup.
  void reaped_dying(Child& dying, int status);
  void reap_dying();
  bool all_trainers_done() const;
  double phase_budget(const Child& c) const;
  double stall_budget(StageKind s) const;
  const Child* waited_on(const Child& trainer);
  void check_stage_progress(Child& c, int64_t now);

  static policy::Budgets budgets_of(const RunOptions& o) {
    return policy::Budgets{o.startup_budget_s,
                           o.hang_budget_s,
                           o.hang_multiple,
                           o.heartbeat_timeout_s,
                           o.heartbeat_interval_ms / 1000.0,
                           o.collector_stall_s,
                           o.loader_stall_s,
                           o.checkpointer_stall_s};
  }

  RunOptions opt_;
  policy::Budgets budgets_;
  recipe::Recipe recipe_;
  fs::path run_;
  fs::path sock_dir_;
  bool sock_dir_private_ = false;
  std::string run_id_, shm_prefix_, control_ep_, checkpoint_ep_;
  std::string fs_type_, fs_device_;
  bool fs_root_ = false;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<MetricsServer> metrics_server_;
  std::string metrics_endpoint_;
  std::unique_ptr<StoreServer> store_;
  std::unique_ptr<ipc::ZmqContext> zmq_;
  std::unique_ptr<ipc::Channel> router_;
  std::unique_ptr<ipc::JournalWriter> journal_;
  std::unique_ptr<ipc::JournalReader> checkpoint_journal_;
  std::vector<std::unique_ptr<ipc::ShmRegion>> rings_;
  std::vector<std::unique_ptr<ipc::SlotRing>> ring_views_;
  std::vector<Child> children_;
  std::set<pid_t> unkillable_;  // outlived SIGKILL and kKillWaitS: never waited for again
  int sigfd_ = -1;
  std::map<std::string, Event> events_;  // by process name: the most telling event of each
  int64_t detected_ns_ = 0;              // first event; 0 while the run is healthy
  int64_t teardown_started_ns_ = 0;
  std::optional<Failure> failure_;    // the first failure, once classified
  std::vector<double> step_samples_;  // trainer step seconds (for the median)
  bool done_ = false;
  bool released_ = false;
  bool cleaned_ = false;
  std::unique_ptr<Console> console_;
  // MEGACPP_TEST_UNKILLABLE: the process name whose teardown signals are not sent.
  const std::string unkillable_for_test_ = knob_string(Knob::kTestUnkillable);
};

Child* Run::by_name(const std::string& n) {
  for (auto& c : children_) {
    if (c.name == n) return &c;
  }
  return nullptr;
}

void Run::prepare() {
  // Before any thread exists (TCPStore, ZeroMQ): threads inherit the mask, so SIGCHLD can
  // reach nothing but the signalfd. A thread that left it unblocked would swallow exits.
  sigfd_ = detail::block_signals_to_fd();
  opt_.validate();
  auto recipe_path = recipe::resolve(opt_.recipe, MEGACPP_RECIPE_DIR);
  recipe_ = recipe::load(recipe_path);

  run_ = fs::absolute(opt_.run_dir).lexically_normal();
  if (fs::exists(run_)) {
    if (!fs::is_directory(run_)) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "run directory {} exists and is not a directory",
                   run_.string());
    }
    if (fs::exists(layout::launch_path(run_))) {
      MEGACPP_FAIL(
          ErrorKind::kInvalidArgument,
          "run directory {} already holds a run (launch.json exists): choose a fresh --run-dir "
          "(resuming a run is not supported yet)",
          run_.string());
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
  fs_type_ = fs_type_name(sfs.f_type);
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

  // /metrics binds before anything is written: a port that cannot be bound is a start-up
  // error that leaves no half-made run directory behind.
  {
    auto colon = opt_.metrics_addr.rfind(':');
    std::string host = opt_.metrics_addr.substr(0, colon);
    int port = -1;
    try {
      port = std::stoi(opt_.metrics_addr.substr(colon + 1));
    } catch (const std::exception&) {
    }
    if (port < 0 || port > 65535) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "--metrics-addr {}: the port must be in [0, 65535]",
                   opt_.metrics_addr);
    }
    bool dirty = false;
    metrics_ = std::make_unique<Metrics>(MEGACPP_VERSION, git_revision(dirty), torch_version());
    metrics_server_ = std::make_unique<MetricsServer>(*metrics_, host, static_cast<uint16_t>(port));
    metrics_endpoint_ = fmt::format("http://{}:{}/metrics", host, metrics_server_->port());
  }

  std::error_code ec;
  fs::create_directories(run_, ec);
  if (ec) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "run directory {} is not writable: {}", run_.string(),
                 ec.message());
  }
  for (const auto& d :
       {layout::journal_dir(run_), layout::receipts_dir(run_), layout::failures_dir(run_),
        layout::checkpoints_dir(run_), layout::logs_dir(run_)}) {
    fs::create_directories(d);
  }
  run_id_ = fmt::format("{}-{}", rfc3339(wall_ns()).substr(0, 19), random_hex(6));
  for (auto& ch : run_id_) {
    if (ch == ':') ch = '-';
  }
  shm_prefix_ = layout::shm_prefix(run_id_, 0);
  ipc::unlink_shm(shm_prefix_);

  // A Unix socket path holds ~107 bytes; a deep run directory falls back to a short private dir.
  sock_dir_ = run_ / "sock";
  if (sock_dir_.string().size() + 16 > 100) {
    char tmpl[] = "/tmp/megacpp-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr)
      ::megacpp::detail::throw_syscall("mkdtemp", errno, __FILE__, __LINE__);
    sock_dir_ = tmpl;
    write_file_atomic(sock_dir_ / layout::kSockOwnerFile, run_id_);
  } else {
    fs::create_directory(sock_dir_);
  }
  sock_dir_private_ = true;
  ::chmod(sock_dir_.c_str(), 0700);
  control_ep_ = "ipc://" + (sock_dir_ / "control").string();
  checkpoint_ep_ = "ipc://" + (sock_dir_ / "checkpoint").string();

  if (opt_.data_dir.empty()) opt_.data_dir = run_.parent_path() / "data";
  opt_.data_dir = fs::absolute(opt_.data_dir).lexically_normal();
  fs::create_directories(opt_.data_dir);

  store_ = std::make_unique<StoreServer>("127.0.0.1", 0, opt_.ranks);

  static_assert(recipe::kMaxBatchSlotBytes <= ipc::SlotRing::kMaxSlotBytes);
  const uint64_t slot_bytes = recipe::batch_slot_bytes(recipe_);
  for (uint32_t r = 0; r < opt_.ranks; ++r) {
    auto name = layout::ring_shm_name(shm_prefix_, r);
    rings_.push_back(std::make_unique<ipc::ShmRegion>(
        ipc::ShmRegion::Create{}, name, ipc::SlotRing::region_bytes(opt_.ring_slots, slot_bytes)));
    ipc::SlotRing::format(*rings_.back(), opt_.ring_slots, slot_bytes);
    ring_views_.push_back(std::make_unique<ipc::SlotRing>(*rings_.back()));
  }
  write_launch_contract();

  zmq_ = std::make_unique<ipc::ZmqContext>();
  router_ = std::make_unique<ipc::Channel>(*zmq_, ipc::Channel::Kind::kRouter, control_ep_);
  journal_ =
      std::make_unique<ipc::JournalWriter>(layout::journal_path(run_, StageKind::SUPERVISOR, 0));
  journal_->set_identity(StageKind::SUPERVISOR, 0);
  journal_->append([](schema::JournalRecord::Builder r) { r.setProcessStarted(); });
  checkpoint_journal_ =
      std::make_unique<ipc::JournalReader>(layout::journal_path(run_, StageKind::CHECKPOINTER, 0));
}

void Run::write_launch_contract() {
  capnp::MallocMessageBuilder msg;
  auto l = msg.initRoot<schema::LaunchContract>();
  l.setSchemaVersion(schema::SCHEMA_VERSION);
  l.setRunId(run_id_);
  l.setGeneration(0);
  l.setCreatedAt(rfc3339(wall_ns()));
  l.setRunDir(run_.string());
  l.setDataDir(opt_.data_dir.string());
  l.setSockDir(sock_dir_.string());
  l.setShmPrefix(shm_prefix_);
  l.setControlEndpoint(control_ep_);
  l.setCheckpointEndpoint(checkpoint_ep_);
  l.setStoreHost("127.0.0.1");
  l.setStorePort(store_->port());
  l.setWorld(opt_.ranks);
  l.setSteps(opt_.steps);
  l.setRingSlots(opt_.ring_slots);
  // The recipe rules keep it within kMaxBatchSlotBytes, which fits 32 bits.
  l.setRingSlotBytes(static_cast<uint32_t>(recipe::batch_slot_bytes(recipe_)));
  l.setHeartbeatIntervalMs(opt_.heartbeat_interval_ms);
  recipe::to_spec(recipe_, l.initRecipe());
  auto f = l.initFilesystem();
  f.setPath(run_.string());
  f.setType(fs_type_);
  f.setDevice(fs_device_);
  f.setIsRootVolume(fs_root_);
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
    bool secret = k.find("TOKEN") != std::string::npos || k.find("SECRET") != std::string::npos ||
                  k.find("KEY") != std::string::npos || k.find("PASSWORD") != std::string::npos;
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
  bool dirty = false;
  p.setGitRevision(git_revision(dirty));
  p.setGitDirty(dirty);
  p.setBuildType(MEGACPP_BUILD_TYPE);
  p.setCompiler(fmt::format("gcc {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__));
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  p.setHostname(host);
  p.setTorchVersion(torch_version());
  l.setSupervisorPid(::getpid());
  l.setSupervisorStartTicks(detail::process_start_ticks(::getpid()));
  l.setMetricsEndpoint(metrics_endpoint_);
  l.setCollectorStallSeconds(opt_.collector_stall_s);
  l.setLoaderStallSeconds(opt_.loader_stall_s);
  l.setCheckpointerStallSeconds(opt_.checkpointer_stall_s);
  write_file_atomic(layout::launch_path(run_), schemas::to_json(l.asReader()));
}

Child* Run::by_dying_pid(pid_t pid) {
  for (auto& c : children_) {
    if (c.dying_pid == pid) return &c;
  }
  return nullptr;
}

Child* Run::by_pid(pid_t pid) {
  for (auto& c : children_) {
    if (c.pid == pid) return &c;
  }
  return nullptr;
}

void Run::launch(StageKind stage, uint32_t rank, uint32_t generation, schema::ChildReason reason,
                 const std::string& cause) {
  Child* c = by_name(layout::process_name(stage, rank));
  if (c == nullptr) {
    children_.push_back(Child{stage, rank, layout::process_name(stage, rank)});
    c = &children_.back();
    metrics_->declare_stage(stage, rank);
  }
  std::string exe_name = "megacpp-" + std::string(layout::stage_name(stage));
  std::replace(exe_name.begin(), exe_name.end(), '_', '-');
  auto exe = detail::self_exe_dir() / exe_name;
  std::vector<std::string> argv = {exe.string(),
                                   "--run-dir",
                                   run_.string(),
                                   "--rank",
                                   std::to_string(rank),
                                   "--generation",
                                   std::to_string(generation)};
  c->pid = detail::spawn(argv, layout::log_path(run_, stage, rank));
  c->generation = generation;
  c->alive = true;
  c->seen = false;
  c->stop_sent = false;
  c->exit_code = 0;
  c->signal = 0;
  c->started_ns = mono_ns();
  c->heartbeat_ns = c->started_ns;
  c->phase_started_ns = c->started_ns;
  c->progress_ns = c->started_ns;
  c->phase = Phase::STARTUP;
  c->work_ns = 0;
  c->work_done = 0;
  c->pending_since_ns = 0;
  metrics_->set_up(stage, rank, true);
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto e = r.initChildStarted();
    e.setStage(stage);
    e.setRank(rank);
    e.setPid(c->pid);
    e.setGeneration(generation);
    e.setChildReason(reason);
    if (!cause.empty()) e.setCause(cause);
  });
}

double Run::phase_budget(const Child& c) const {
  return policy::phase_budget(budgets_, c.stage, c.step, c.phase, step_samples_);
}

void Run::on_message(ipc::Received& m) {
  Child* c = by_name(m.peer());
  auto root = m.root();
  if (c == nullptr) {
    log_warn("control message from unknown peer '{}' ignored", m.peer());
    return;
  }
  const int64_t now = mono_ns();
  switch (root.which()) {
    case schema::ControlMessage::HELLO:
      if (root.getHello().getPid() == c->pid) {
        c->heartbeat_ns = now;
        c->seen = true;
      }
      break;
    case schema::ControlMessage::HEARTBEAT: {
      auto h = root.getHeartbeat();
      // A heartbeat queued by a previous generation (killed for a restart) proves nothing.
      if (!policy::heartbeat_counts(h.getGeneration(), c->generation)) break;
      c->heartbeat_ns = now;
      c->seen = true;
      if (h.getPhaseStartedMonoNs() > 0) c->phase_started_ns = h.getPhaseStartedMonoNs();
      if (h.getStep() != c->step) {
        c->progress_ns = now;
        c->last_step_wall = static_cast<double>(wall_ns()) / 1e9;
        if (c->stage == StageKind::TRAINER && h.getStep() > c->step && h.getStepSeconds() > 0) {
          step_samples_.push_back(h.getStepSeconds());
          if (step_samples_.size() > 512) step_samples_.erase(step_samples_.begin());
          metrics_->observe_step_seconds(c->rank, h.getStepSeconds());
        }
      }
      c->step = h.getStep();
      c->phase = h.getPhase();
      c->tokens = h.getTokens();
      c->loss = h.getLoss();
      c->step_seconds = h.getStepSeconds();
      c->lag_seconds = h.getLagSeconds();
      c->work_ns = h.getProgressMonoNs();
      c->work_done = h.getWorkDone();
      c->pending_since_ns = h.getPendingSinceMonoNs();
      break;
    }
    case schema::ControlMessage::FAILURE: {
      auto f = root.getFailure();
      const schema::ErrorKind error_kind = f.getErrorKind();
      const std::string said = error_kind == schema::ErrorKind::NONE
                                   ? std::string(f.getKind().cStr())
                                   : std::string(schemas::name(error_kind));
      log_warn("{} reports {} ({}): {}", c->name, f.getKind().cStr(), said, f.getMessage().cStr());
      // A restartable stage's failure is acted on when it exits (restart or fail).
      if (policy::restartable(c->stage)) break;
      // A rank that failed because a peer or a collective did is a victim, not a cause
      // (policy::evidence_of): the Failure names its error kind.
      Event ev{schema::FailureKind::EXCEPTION,
               fmt::format("{}: {}", said, f.getMessage().cStr()),
               f.getMonoNs() > 0 ? f.getMonoNs() : now,
               now,
               f.getPhase(),
               f.getStep()};
      ev.error_kind = error_kind;
      record(*c, std::move(ev));
      break;
    }
    default:
      break;
  }
}

void Run::record(Child& c, Event ev) {
  if (detected_ns_ == 0) {
    detected_ns_ = ev.detected_ns;
    log_error("failure detected: {} {}: {}", c.name, schemas::name(ev.kind), ev.message);
  }
  // Keep the most telling event per process (policy::more_telling).
  if (!policy::admitted(ev, teardown_started_ns_)) return;
  auto it = events_.find(c.name);
  if (it == events_.end() || policy::more_telling(ev, it->second)) {
    events_[c.name] = std::move(ev);
  }
}

void Run::restart_or_fail(Child& c, const std::string& why, Event ev) {
  const policy::Restart decision =
      policy::decide_restart(c.stage, c.restarts, opt_.max_restarts, detected_ns_ != 0, done_);
  if (decision == policy::Restart::kRestart) {
    ++c.restarts;
    log_warn("{}: {}; restarting it ({} of at most {})", c.name, why, c.restarts,
             opt_.max_restarts);
    metrics_->add_restart(c.stage, c.rank);
    c.restart_cause = fmt::format("generation {}: {}", c.generation, why);
    if (c.alive) {
      // Relaunched from reap() once this pid is gone (bounded in check_liveness).
      ::kill(c.pid, SIGKILL);
      c.alive = false;
      c.dying_pid = c.pid;
      c.dying_since_ns = mono_ns();
      return;
    }
    journal_child_exited(c, schema::ChildReason::RESTART);
    launch(c.stage, c.rank, c.generation + 1, schema::ChildReason::RESTART, c.restart_cause);
    return;
  }
  if (decision == policy::Restart::kExhausted) {
    ev.message += fmt::format(" (after {} restarts)", c.restarts);
  }
  record(c, std::move(ev));
}

namespace {
void set_child_event(schema::ChildEvent::Builder e, const Child& c, schema::ChildReason reason) {
  e.setStage(c.stage);
  e.setRank(c.rank);
  e.setPid(c.pid);
  e.setExitCode(c.exit_code);
  e.setSignal(c.signal);
  e.setGeneration(c.generation);
  e.setChildReason(reason);
}
}  // namespace

void Run::journal_child_exited(const Child& c, schema::ChildReason reason) {
  journal_->append(
      [&](schema::JournalRecord::Builder r) { set_child_event(r.initChildExited(), c, reason); });
}

void Run::reaped_dying(Child& dying, int status) {
  const pid_t pid = dying.dying_pid;
  dying.dying_pid = 0;
  dying.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  dying.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  dying.restart_cause += fmt::format("; pid {} reaped {:.2f}s after SIGKILL", pid,
                                     static_cast<double>(mono_ns() - dying.dying_since_ns) / 1e9);
  journal_child_exited(dying, schema::ChildReason::RESTART);
  if (detected_ns_ == 0 && !done_) {
    launch(dying.stage, dying.rank, dying.generation + 1, schema::ChildReason::RESTART,
           dying.restart_cause);
  }
}

void Run::reap_dying() {
  for (auto& c : children_) {
    if (c.dying_pid == 0) continue;
    int status = 0;
    if (::waitpid(c.dying_pid, &status, WNOHANG) == c.dying_pid) reaped_dying(c, status);
  }
}

void Run::reap() {
  for (;;) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    if (Child* dying = by_dying_pid(pid)) {
      reaped_dying(*dying, status);
      continue;
    }
    Child* cp = by_pid(pid);
    if (cp == nullptr || !cp->alive) continue;
    Child& c = *cp;
    const int64_t now = mono_ns();
    c.alive = false;
    metrics_->set_up(c.stage, c.rank, false);
    if (WIFEXITED(status)) {
      c.exit_code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      c.exit_code = -1;
      c.signal = WTERMSIG(status);
    }
    const bool clean = c.exit_code == 0 && c.signal == 0;
    const bool expected = (c.stage == StageKind::TRAINER && clean) || (c.stop_sent && clean);
    const bool torn_down = teardown_started_ns_ != 0;
    const schema::ChildReason reason =
        expected    ? (c.stop_sent ? schema::ChildReason::STOP : schema::ChildReason::EXIT)
        : torn_down ? schema::ChildReason::TEARDOWN
                    : schema::ChildReason::EXIT;
    metrics_->add_exit(c.stage, clean       ? schema::FailureKind::NONE
                                : torn_down ? schema::FailureKind::TORN_DOWN
                                : c.signal  ? schema::FailureKind::SIGNALED
                                            : schema::FailureKind::EXITED);
    if (!done_) {
      journal_child_exited(c, reason);
    }
    if (expected || torn_down) continue;
    std::string what =
        c.signal != 0 ? fmt::format("was killed by signal {} ({})", c.signal, strsignal(c.signal))
                      : fmt::format("exited with code {}", c.exit_code);
    // The evidence of a death is its reap: neither SIGCHLD, waitid nor a pidfd says when the
    // process exited, so the detection delay of a death is not measured.
    Event ev{c.signal != 0 ? schema::FailureKind::SIGNALED : schema::FailureKind::EXITED,
             fmt::format("{} (pid {}) {} in phase {} at step {}", c.name, c.pid, what,
                         layout::phase_name(c.phase), c.step),
             now,
             now,
             c.phase,
             c.step,
             false};
    restart_or_fail(c, what, std::move(ev));
  }
}

void Run::on_signals() {
  signalfd_siginfo si{};
  while (::read(sigfd_, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    if (si.ssi_signo == SIGCHLD) {
      reap();
    } else if (detected_ns_ == 0) {
      int64_t now = mono_ns();
      detected_ns_ = now;
      events_["supervisor-0"] = Event{
          schema::FailureKind::INTERRUPTED,
          fmt::format("the supervisor received {}", strsignal(static_cast<int>(si.ssi_signo))),
          now,
          now,
          Phase::SHUTDOWN,
          0};
      log_error("interrupted by {}", strsignal(static_cast<int>(si.ssi_signo)));
    }
  }
  reap();
}

double Run::stall_budget(StageKind s) const {
  return policy::stall_budget(budgets_, s);
}

const Child* Run::waited_on(const Child& trainer) {
  const auto stage = policy::waited_on(trainer.phase);
  return stage ? by_name(layout::process_name(*stage, 0)) : nullptr;
}

// A restartable stage is judged by its working thread's progress stamp, never by its
// heartbeats alone (they come from the control client's thread and go on while the work is
// wedged). Until its first report the start-up budget applies (libraries, shm, a built-in
// corpus written on first use).
void Run::check_stage_progress(Child& c, int64_t now) {
  const bool reported = c.work_ns > 0;
  const int64_t since = reported ? c.work_ns : c.started_ns;
  const double limit = reported ? stall_budget(c.stage) : opt_.startup_budget_s;
  const double idle = static_cast<double>(now - since) / 1e9;
  if (idle <= limit) return;
  const char* unit = c.stage == StageKind::COLLECTOR     ? "folds"
                     : c.stage == StageKind::DATA_LOADER ? "batches"
                                                         : "commits";
  std::string what = fmt::format("made no progress for {:.1f}s in phase {} ({} {} done", idle,
                                 layout::phase_name(c.phase), c.work_done, unit);
  if (c.pending_since_ns > 0) {
    what += fmt::format("; oldest pending snapshot {:.1f}s old",
                        static_cast<double>(now - c.pending_since_ns) / 1e9);
  }
  what += fmt::format("; budget {:.0f}s{})", limit, reported ? "" : ", before its first report");
  Event ev{schema::FailureKind::HUNG,
           fmt::format("{} (pid {}) {}", c.name, c.pid, what),
           since,
           now,
           c.phase,
           c.step};
  ev.own_progress = true;
  restart_or_fail(c, "hung: " + what, std::move(ev));
}

void Run::check_liveness() {
  const int64_t now = mono_ns();
  for (auto& c : children_) {
    if (c.dying_pid != 0 &&
        policy::restart_reap_overdue(static_cast<double>(now - c.dying_since_ns) / 1e9)) {
      record(c, Event{schema::FailureKind::UNKILLABLE,
                      fmt::format("{} (pid {}) did not exit within {:.0f}s of SIGKILL; its restart "
                                  "is abandoned (two generations would share its resources)",
                                  c.name, c.dying_pid, policy::kRestartReapBoundSeconds),
                      c.dying_since_ns, now, c.phase, c.step});
      give_up_on(c, policy::kRestartReapBoundSeconds);
      continue;
    }
    if (!c.alive || c.stop_sent) continue;
    const double budget = phase_budget(c);
    const double silent = static_cast<double>(now - c.heartbeat_ns) / 1e9;
    if (silent > policy::silence_limit(budgets_, c.seen, budget)) {
      restart_or_fail(
          c, fmt::format("stalled: no heartbeat for {:.1f}s", silent),
          Event{schema::FailureKind::HEARTBEAT_LOST,
                fmt::format("{} (pid {}) sent no heartbeat for {:.1f}s (phase {}, step {})", c.name,
                            c.pid, silent, layout::phase_name(c.phase), c.step),
                c.heartbeat_ns, now, c.phase, c.step});
      continue;
    }
    if (policy::restartable(c.stage)) {
      check_stage_progress(c, now);
      continue;
    }
    if (c.stage != StageKind::TRAINER) continue;
    const Child* dep = waited_on(c);
    const auto clock = policy::rank_clock(budgets_, c.phase_started_ns, c.progress_ns, budget,
                                          dep ? std::optional(dep->stage) : std::nullopt,
                                          dep ? dep->started_ns : 0);
    const int64_t since = clock.since_ns;
    const double rank_budget = clock.budget_s;
    const double in_phase = static_cast<double>(now - since) / 1e9;
    if (c.rank < ring_views_.size()) {
      Child* loader = by_name(layout::process_name(StageKind::DATA_LOADER, 0));
      if (policy::loader_starves_rank(budgets_, c.phase, ring_views_[c.rank]->depth(), in_phase,
                                      loader != nullptr && loader->alive)) {
        loader->heartbeat_ns = now;  // one restart per stall, not one per starving rank
        c.phase_started_ns = now;
        restart_or_fail(
            *loader, fmt::format("stalled: {} waited {:.1f}s on an empty ring", c.name, in_phase),
            Event{schema::FailureKind::STALLED,
                  fmt::format("{} waited {:.1f}s on an empty ring", c.name, in_phase), now, now,
                  loader->phase, loader->step});
        continue;
      }
    }
    if (in_phase > rank_budget) {
      record(
          c,
          Event{
              schema::FailureKind::HUNG,
              fmt::format(
                  "{} (pid {}) made no progress for {:.1f}s in phase {} (step {}; budget {:.1f}s)",
                  c.name, c.pid, in_phase, layout::phase_name(c.phase), c.step, rank_budget),
              since, now, c.phase, c.step});
    }
  }
  // The hang sweep (policy::swept_as_silent).
  if (detected_ns_ != 0) {
    for (auto& c : children_) {
      const double silent = static_cast<double>(now - c.heartbeat_ns) / 1e9;
      if (policy::swept_as_silent(budgets_, detected_ns_ != 0, c.alive, c.seen, c.stop_sent,
                                  events_.contains(c.name), silent)) {
        record(c, Event{schema::FailureKind::HEARTBEAT_LOST,
                        fmt::format("{} (pid {}) sent no heartbeat for {:.1f}s (phase {}, step {}) "
                                    "while a peer hung",
                                    c.name, c.pid, silent, layout::phase_name(c.phase), c.step),
                        c.heartbeat_ns, now, c.phase, c.step});
      }
    }
  }
}

bool Run::all_trainers_done() const {
  for (const auto& c : children_) {
    if (c.stage == StageKind::TRAINER && (c.alive || c.exit_code != 0 || c.signal != 0))
      return false;
  }
  return true;
}

void Run::pump(int timeout_ms) {
  zmq_pollitem_t items[2] = {router_->pollitem(), zmq_pollitem_t{nullptr, sigfd_, ZMQ_POLLIN, 0}};
  int n = zmq_poll(items, 2, timeout_ms);
  if (n < 0 && zmq_errno() != EINTR) ZMQ_CHECK(n);
  if (n <= 0) return;
  if (items[1].revents & ZMQ_POLLIN) on_signals();
  if (items[0].revents & ZMQ_POLLIN) {
    while (auto m = router_->receive(ipc::Millis(0))) on_message(*m);
  }
}

void Run::watch() {
  for (;;) {
    pump(100);
    if (detected_ns_ != 0) return;
    check_liveness();
    if (detected_ns_ != 0) return;
    update_metrics();
    if (console_) {
      std::vector<ConsoleRank> ranks;
      uint32_t up = 0;
      for (const auto& c : children_) {
        if (c.alive) ++up;
        if (c.stage == StageKind::TRAINER) ranks.push_back({c.step, c.tokens, c.loss});
      }
      console_->update(ranks, up, static_cast<uint32_t>(children_.size()));
    }
    if (all_trainers_done()) return;
  }
}

void Run::update_metrics() {
  const double now_wall = static_cast<double>(wall_ns()) / 1e9;
  const int64_t now = mono_ns();
  for (const auto& c : children_) {
    metrics_->set_up(c.stage, c.rank, c.alive);
    metrics_->set_heartbeat(c.stage, c.rank,
                            now_wall - static_cast<double>(now - c.heartbeat_ns) / 1e9);
    if (c.work_ns > 0) {
      metrics_->set_progress(c.stage, c.rank,
                             now_wall - static_cast<double>(now - c.work_ns) / 1e9);
    }
    if (c.stage == StageKind::TRAINER) {
      if (c.last_step_wall > 0) metrics_->set_last_step(c.stage, c.rank, c.step, c.last_step_wall);
      metrics_->set_trainer_progress(c.rank, c.step, c.tokens);
    }
    if (c.stage == StageKind::COLLECTOR) metrics_->set_collector_lag(c.lag_seconds);
  }
  for (uint32_t r = 0; r < ring_views_.size(); ++r) {
    metrics_->set_queue(fmt::format("data_loader->trainer-{}", r), ring_views_[r]->depth(),
                        ring_views_[r]->slots());
  }
  checkpoint_journal_->poll([&](schema::JournalRecord::Reader rec) {
    if (rec.isCheckpointCommitted()) {
      auto c = rec.getCheckpointCommitted();
      metrics_->set_checkpoint(c.getStep(), c.getSeconds(),
                               static_cast<double>(rec.getWallNs()) / 1e9);
    }
  });
}

bool Run::wait_for(const std::function<bool()>& done, double seconds) {
  const int64_t deadline = mono_ns() + static_cast<int64_t>(seconds * 1e9);
  while (!done()) {
    const int64_t left_ms = (deadline - mono_ns()) / 1'000'000;
    if (left_ms <= 0) return false;
    pump(static_cast<int>(std::min<int64_t>(left_ms, 20)));
  }
  return true;
}

void Run::stop_child(Child& c) {
  if (!c.alive) return;
  c.stop_sent = true;
  ipc::ControlMessageBuilder b;
  b.root().initStop().setReason("run complete");
  if (!router_->send_to(c.name, b.message(), ipc::Millis(200))) ::kill(c.pid, SIGTERM);
}

// MEGACPP_TEST_UNKILLABLE=<process> makes this a no-op for that process: to the supervisor
// it is then what a process in uninterruptible sleep is, one that survives SIGKILL. The
// hook exists to test that no wait for such a process is unbounded.
void Run::kill_child(const Child& c, int sig) {
  if (c.name == unkillable_for_test_) return;
  ::kill(c.pid, sig);
}

void Run::give_up_on(const Child& c, double waited_s) {
  if (!unkillable_.insert(c.pid).second) return;
  log_error("{} (pid {}) survived SIGKILL for {:.1f}s; unkillable, not waiting for it", c.name,
            c.pid, waited_s);
  if (!journal_) return;
  journal_->append([&](schema::JournalRecord::Builder r) {
    set_child_event(r.initChildUnkillable(), c, schema::ChildReason::SURVIVED_KILL);
  });
}

void Run::finish_ok() {
  // Training is over; the loader and the checkpointer drain and exit, then the collector
  // folds the final state. A stage that does not stop within its bound is a failure.
  for (auto& c : children_) {
    if (c.stage == StageKind::DATA_LOADER || c.stage == StageKind::CHECKPOINTER) stop_child(c);
  }
  const double drain_s = static_cast<double>(knob_int(Knob::kDrainTimeoutS));
  bool drained = wait_for(
      [&] {
        if (detected_ns_ != 0) return true;
        for (const auto& c : children_) {
          if ((c.stage == StageKind::DATA_LOADER || c.stage == StageKind::CHECKPOINTER) && c.alive)
            return false;
        }
        return true;
      },
      drain_s);
  if (!drained) {
    for (auto& c : children_) {
      if ((c.stage == StageKind::DATA_LOADER || c.stage == StageKind::CHECKPOINTER) && c.alive) {
        const int64_t now = mono_ns();
        record(c, Event{schema::FailureKind::HUNG,
                        fmt::format("{} did not stop within {:.0f}s of the end of training", c.name,
                                    drain_s),
                        now, now, c.phase, c.step});
      }
    }
  }
}

void Run::journal_graph(const std::string& reason) {
  const int64_t now = mono_ns();
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto g = r.initStageGraph();
    g.setReason(reason);
    auto entries = g.initEntries(static_cast<unsigned>(children_.size()));
    for (size_t i = 0; i < children_.size(); ++i) {
      const Child& c = children_[i];
      auto e = entries[static_cast<unsigned>(i)];
      e.setStage(c.stage);
      e.setRank(c.rank);
      e.setPid(c.pid);
      e.setGeneration(c.generation);
      e.setState(std::string(schemas::name(c.alive    ? schema::ProcessState::RUNNING
                                           : c.signal ? schema::ProcessState::SIGNALED
                                                      : schema::ProcessState::EXITED)));
      e.setHeartbeatAgeSeconds(static_cast<double>(now - c.heartbeat_ns) / 1e9);
      e.setPhaseAgeSeconds(static_cast<double>(now - c.phase_started_ns) / 1e9);
      e.setStep(c.step);
      e.setPhase(c.phase);
      e.setRestarts(c.restarts);
      e.setProgressAgeSeconds(c.work_ns > 0 ? static_cast<double>(now - c.work_ns) / 1e9 : -1.0);
      e.setWorkDone(c.work_done);
      e.setPendingAgeSeconds(
          c.pending_since_ns > 0 ? static_cast<double>(now - c.pending_since_ns) / 1e9 : 0.0);
    }
  });
}

void Run::teardown() {
  // Bounded: SIGTERM, a grace period while still listening (a victim's own report of what it
  // met may yet arrive), SIGKILL, one more second. Nothing here waits without a deadline.
  teardown_started_ns_ = mono_ns();
  for (auto& c : children_) {
    if (!c.alive) continue;
    // A stopped or silent process cannot act on SIGTERM: waiting out the grace for it only
    // delays the teardown.
    auto ev = events_.find(c.name);
    bool silent = ev != events_.end() && ev->second.kind == schema::FailureKind::HEARTBEAT_LOST;
    kill_child(c, policy::teardown_signal(silent, detail::process_state(c.pid)));
  }
  auto none_alive = [&] {
    for (const auto& c : children_) {
      if (c.alive) return false;
    }
    return true;
  };
  if (wait_for(none_alive, opt_.teardown_grace_s)) return;
  for (auto& c : children_) {
    if (c.alive) {
      log_warn("{} (pid {}) still alive {:.1f}s after SIGTERM: SIGKILL", c.name, c.pid,
               opt_.teardown_grace_s);
      kill_child(c, SIGKILL);
    }
  }
  if (!wait_for(none_alive, kKillWaitS)) {
    for (const auto& c : children_) {
      if (c.alive) give_up_on(c);
    }
  }
}

std::string detection_text(schema::RunError::Reader e) {
  return e.getDetectionMeasured()
             ? fmt::format("detected {:.2f}s after the cause", e.getDetectionSeconds())
             : std::string("detection delay not measured (the kernel gives no exit time)");
}

std::vector<std::string> tail_lines(const fs::path& path, size_t n) {
  std::vector<std::string> out;
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error&) {
    return out;
  }
  if (text.size() > 16384) text = text.substr(text.size() - 16384);
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  if (out.size() > n) out.erase(out.begin(), out.end() - static_cast<long>(n));
  return out;
}

void Run::classify() {
  // Exactly one first failure (policy::assign_roles).
  std::vector<std::string> abnormal;
  for (const auto& c : children_) {
    if (c.exit_code != 0 || c.signal != 0) abnormal.push_back(c.name);
  }
  const policy::Roles roles = policy::assign_roles(events_, abnormal);
  if (roles.first_failure.empty()) return;
  const std::string& first_name = roles.first_failure;
  const Event* first = &events_.at(first_name);
  auto stage_rank = [&](const std::string& name) -> std::pair<StageKind, uint32_t> {
    if (name == "supervisor-0") return {StageKind::SUPERVISOR, 0};
    Child* c = by_name(name);
    return {c->stage, c->rank};
  };
  auto [fs_stage, fs_rank] = stage_rank(first_name);
  failure_ = Failure{first->kind, fs_stage, fs_rank, first->message};
  auto journal_event = [&](const std::string& name, const Event& ev, schema::FailureRole role) {
    auto [stage, rank] = stage_rank(name);
    Child* c = by_name(name);
    journal_->append([&](schema::JournalRecord::Builder r) {
      auto f = r.initFailureObserved();
      f.setStage(stage);
      f.setRank(rank);
      f.setFailureKind(ev.kind);
      f.setMessage(ev.message);
      f.setFailureRole(role);
      f.setEvidenceMonoNs(ev.evidence_ns);
      f.setDetectedMonoNs(ev.detected_ns);
      f.setEvidenceUnmeasured(!ev.evidence_measured);
      f.setPhase(ev.phase);
      f.setStep(ev.step);
      f.setPid(c ? c->pid : ::getpid());
      if (role == schema::FailureRole::FIRST_FAILURE && c != nullptr) {
        auto tail = tail_lines(layout::log_path(run_, stage, rank), 20);
        auto t = f.initStderrTail(static_cast<unsigned>(tail.size()));
        for (size_t i = 0; i < tail.size(); ++i) t.set(static_cast<unsigned>(i), tail[i]);
        auto dump_path = layout::failure_path(run_, stage, rank);
        if (fs::exists(dump_path)) {
          try {
            schemas::JsonFile<schema::FailureDump> dump(dump_path);
            auto bt = dump.get().getBacktrace();
            auto out = f.initBacktrace(bt.size());
            for (unsigned i = 0; i < bt.size(); ++i) out.set(i, bt[i]);
          } catch (const std::exception& e) {
            log_warn("unreadable failure dump {}: {}", dump_path.string(), e.what());
          }
        }
      }
    });
  };
  journal_event(first_name, *first, schema::FailureRole::FIRST_FAILURE);
  for (const auto& name : roles.victims) {
    journal_event(name, events_.at(name), schema::FailureRole::VICTIM);
  }
  for (const auto& name : roles.torn_down) {
    const Child& c = *by_name(name);
    journal_event(
        c.name,
        Event{schema::FailureKind::TORN_DOWN, fmt::format("{} was stopped by the teardown", c.name),
              teardown_started_ns_, teardown_started_ns_, c.phase, c.step},
        schema::FailureRole::TORN_DOWN);
  }
}

void Run::journal_run_finished() {
  const double teardown_s =
      detected_ns_ != 0 ? static_cast<double>(mono_ns() - detected_ns_) / 1e9 : 0.0;
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto f = r.initRunFinished();
    f.setOk(!failure_);
    if (failure_) {
      f.setFailureKind(failure_->kind);
      f.setStage(failure_->stage);
      f.setRank(failure_->rank);
      f.setReason(failure_->message);
      f.setTeardownSeconds(teardown_s);
    } else {
      f.setReason("completed");
    }
  });
  journal_->append([](schema::JournalRecord::Builder r) { r.setProcessFinished(); });
  journal_->sync();
}

int Run::report() {
  schemas::JsonFile<schema::Manifest> manifest(layout::manifest_path(run_));
  auto m = manifest.get();
  bool ok = m.getState() == schema::RunState::OK;
  std::string out;
  if (ok) {
    double first = NAN, last = NAN, tps = NAN;
    auto br = layout::receipts_dir(run_) / "bench_result.json";
    if (fs::exists(br)) {
      schemas::JsonFile<schema::BenchResult> b(br);
      first = b.get().getFirstLoss();
      last = b.get().getLastLoss();
      tps = b.get().getTokensPerSecond();
    }
    out += fmt::format("run ok: {} steps on {} ranks, loss {:.3f} -> {:.3f}, {:.0f} tokens/s",
                       m.getStepsCompleted(), m.getWorld(), first, last, tps);
    if (m.getRestarts() > 0) out += fmt::format(" ({} stage restarts)", m.getRestarts());
    out += "\n";
  } else {
    auto e = m.getError();
    out += fmt::format("run error: first failure {} in {}-{}: {}\n", schemas::name(e.getKind()),
                       layout::stage_name(e.getStage()), e.getRank(), e.getMessage().cStr());
    out += fmt::format("  {}; every process gone and shm/sockets removed {:.2f}s later\n",
                       detection_text(e), e.getTeardownSeconds());
  }
  for (auto st : m.getStages()) {
    if (st.getState() == schema::ProcessState::UNKILLABLE) {
      out += fmt::format("  unkillable  {} (pid {}) outlived SIGKILL and was not waited for\n",
                         layout::process_name(st.getStage(), st.getRank()), st.getPid());
    }
  }
  out += fmt::format("  manifest    {}\n", layout::manifest_path(run_).string());
  std::string receipts;
  for (auto r : m.getReceipts()) receipts += (receipts.empty() ? "" : ", ") + std::string(r.cStr());
  out += fmt::format("  receipts    {}/ ({})\n", layout::receipts_dir(run_).string(),
                     receipts.empty() ? "none" : receipts);
  if (m.getLatestCheckpoint().size() > 0) {
    out += fmt::format("  checkpoint  {}\n", (run_ / m.getLatestCheckpoint().cStr()).string());
  }
  out += fmt::format("  logs        {}/\n", layout::logs_dir(run_).string());
  if (!ok) out += fmt::format("  details     megacpp status {}\n", run_.string());
  fmt::print("{}", out);
  std::fflush(stdout);
  return ok ? 0 : 1;
}

void Run::release_ipc() {
  if (released_) return;
  released_ = true;
  router_.reset();
  zmq_.reset();
  ring_views_.clear();
  rings_.clear();
  if (!shm_prefix_.empty()) ipc::unlink_shm(shm_prefix_);
  if (sock_dir_private_) {
    std::error_code ec;
    fs::remove_all(sock_dir_, ec);
  }
  store_.reset();
}

void Run::cleanup() {
  if (cleaned_) return;
  cleaned_ = true;
  // No blocking wait: a child that outlives SIGKILL would hang `megacpp run` forever. The
  // children still alive get SIGKILL and, together, kKillWaitS to be reaped; one already
  // given up on is not waited for again. A generation killed for a restart gets the same
  // bound to be reaped and journaled.
  std::vector<Child*> waiting;
  for (auto& c : children_) {
    if (!c.alive || unkillable_.contains(c.pid)) continue;
    kill_child(c, SIGKILL);
    waiting.push_back(&c);
  }
  const int64_t deadline = mono_ns() + static_cast<int64_t>(kKillWaitS * 1e9);
  for (;;) {
    std::erase_if(waiting, [](Child* c) {
      const pid_t r = ::waitpid(c->pid, nullptr, WNOHANG);
      if (r == 0) return false;
      c->alive = false;  // reaped, or not our child any more (ECHILD)
      return true;
    });
    reap_dying();
    const bool any_dying =
        std::ranges::any_of(children_, [](const Child& c) { return c.dying_pid != 0; });
    if ((waiting.empty() && !any_dying) || mono_ns() >= deadline) break;
    ::usleep(10'000);
  }
  for (const Child* c : waiting) give_up_on(*c);
  release_ipc();
  metrics_server_.reset();
  if (sigfd_ >= 0) ::close(sigfd_);
  sigfd_ = -1;
}

int Run::execute() {
  prepare();
  console_ = make_console(opt_.progress, opt_.steps, recipe_.name, run_.string());
  if (console_ && !metrics_endpoint_.empty())
    fmt::print("megacpp: metrics at {}\n", metrics_endpoint_);
  launch(StageKind::COLLECTOR, 0, 0, schema::ChildReason::LAUNCH);
  launch(StageKind::CHECKPOINTER, 0, 0, schema::ChildReason::LAUNCH);
  launch(StageKind::DATA_LOADER, 0, 0, schema::ChildReason::LAUNCH);
  for (uint32_t r = 0; r < opt_.ranks; ++r) {
    launch(StageKind::TRAINER, r, 0, schema::ChildReason::LAUNCH);
  }
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto s = r.initRunStarted();
    s.setWorld(opt_.ranks);
    s.setStepsPlanned(opt_.steps);
  });
  watch();
  if (detected_ns_ == 0) finish_ok();
  if (console_) console_->finish();
  if (detected_ns_ != 0) {
    journal_graph("failure detected");
    teardown();
    classify();
  }
  if (!failure_) {
    // The live collector folds the final state; the in-process fold below is the same pure
    // function, so it changes nothing when the collector finished.
    if (Child* col = by_name(layout::process_name(StageKind::COLLECTOR, 0)); col && col->alive) {
      stop_child(*col);
      if (!wait_for([&] { return !col->alive; }, 10.0)) {
        kill_child(*col, SIGKILL);
        if (!wait_for([&] { return !col->alive; }, kKillWaitS)) give_up_on(*col);
      }
    }
  }
  release_ipc();
  journal_run_finished();
  done_ = true;
  // Always fold in-process as well: when the collector was the failing process this is
  // what guarantees the manifest never stays `running`.
  collector::collect_run(run_);
  for (const auto& c : children_) metrics_->set_up(c.stage, c.rank, c.alive);
  int rc = report();
  if (opt_.metrics_linger_s > 0) {
    fmt::print("megacpp: serving {} for {:.0f}s more (--metrics-linger-s)\n", metrics_endpoint_,
               opt_.metrics_linger_s);
    std::fflush(stdout);
    // Interruptible: SIGINT/SIGTERM (blocked into the signalfd) end the linger early.
    pollfd pfd{sigfd_, POLLIN, 0};
    ::poll(&pfd, 1, static_cast<int>(opt_.metrics_linger_s * 1000));
  }
  cleanup();
  return rc;
}
}  // namespace

int run(RunOptions options) {
  Run r(std::move(options));
  return r.execute();
}

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

bool reconcile(const fs::path& run_dir) {
  // A run whose supervisor journal ends without runFinished, and whose supervisor process
  // (pid + start time from launch.json) no longer exists, was orphaned: record it and remove
  // what the supervisor would have removed. Stages cannot outlive it (PR_SET_PDEATHSIG).
  schemas::JsonFile<schema::LaunchContract> launch(layout::launch_path(run_dir));
  auto l = launch.get();
  bool finished = false, orphaned = false;
  ipc::JournalReader::read_all(layout::journal_path(run_dir, StageKind::SUPERVISOR, 0),
                               [&](schema::JournalRecord::Reader r) {
                                 finished = finished || r.isRunFinished();
                                 orphaned = orphaned || r.isRunOrphaned();
                               });
  if (finished || orphaned) return false;
  const pid_t pid = l.getSupervisorPid();
  if (pid > 0 && detail::process_start_ticks(pid) == l.getSupervisorStartTicks()) return false;
  ipc::JournalWriter journal(layout::journal_path(run_dir, StageKind::SUPERVISOR, 0));
  journal.set_identity(StageKind::SUPERVISOR, 0);
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
    const std::string prefix = layout::shm_prefix(run_id, 0);
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
    if (remove_private_sock_dir(sock, run_id)) {
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

int status(const fs::path& run_dir) {
  if (!fs::exists(layout::launch_path(run_dir))) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{} holds no run (no launch.json)", run_dir.string());
  }
  if (reconcile(run_dir) || !fs::exists(layout::manifest_path(run_dir)))
    collector::collect_run(run_dir);
  schemas::JsonFile<schema::Manifest> manifest(layout::manifest_path(run_dir));
  auto m = manifest.get();
  static const char* kStates[] = {"launched", "running", "ok", "error", "detached", "orphaned"};
  auto phase_name = [](schema::Phase p) { return layout::phase_name(p); };
  fmt::print("run {}  ({})\n", m.getRunId().cStr(), run_dir.string());
  fmt::print("  state      {}\n", kStates[static_cast<int>(m.getState())]);
  fmt::print("  recipe     {} ({})\n", m.getRecipe().cStr(), m.getRecipeHash().cStr());
  fmt::print("  steps      {}/{} on {} ranks\n", m.getStepsCompleted(), m.getStepsPlanned(),
             m.getWorld());
  fmt::print("  launched   {}\n  completed  {}\n  last seen  {}\n", m.getLaunchedAt().cStr(),
             m.getCompletedAt().cStr(), m.getLastPolledAt().cStr());
  if (m.hasError() && m.getError().getKind() != schema::FailureKind::NONE) {
    auto e = m.getError();
    fmt::print("  first failure\n");
    fmt::print("    {} in {}-{} (pid {}), phase {}, step {}, at {}\n", schemas::name(e.getKind()),
               layout::stage_name(e.getStage()), e.getRank(), e.getPid(), phase_name(e.getPhase()),
               e.getStep(), e.getAt().cStr());
    fmt::print("    {}\n", e.getMessage().cStr());
    fmt::print("    {}; teardown took {:.2f}s\n", detection_text(e), e.getTeardownSeconds());
    if (e.getFailureDump().size() > 0)
      fmt::print("    failure dump {}\n", (run_dir / e.getFailureDump().cStr()).string());
    if (e.getBacktrace().size() > 0) {
      fmt::print("    backtrace\n");
      for (auto l : e.getBacktrace()) fmt::print("      {}\n", l.cStr());
    }
    if (e.getStderrTail().size() > 0) {
      fmt::print("    stderr tail\n");
      for (auto l : e.getStderrTail()) fmt::print("      | {}\n", l.cStr());
    }
  }
  fmt::print("  stages\n");
  for (auto s : m.getStages()) {
    std::string how(schemas::name(s.getState()));
    if (s.getState() == schema::ProcessState::EXITED) how += fmt::format("({})", s.getExitCode());
    if (s.getState() == schema::ProcessState::SIGNALED) how += fmt::format("({})", s.getSignal());
    std::string role(schemas::name(s.getRole()));
    std::string restarts = s.getRestarts() > 0 ? fmt::format("restarts {}", s.getRestarts()) : "";
    fmt::print("    {:<16} pid {:<8} {:<13} step {:<6} {:<14} {:<11} last record {}\n",
               layout::process_name(s.getStage(), s.getRank()), s.getPid(), how, s.getLastStep(),
               role, restarts, s.getLastRecordAt().cStr());
    for (auto cause : s.getRestartCauses()) fmt::print("      restarted: {}\n", cause.cStr());
  }
  if (m.hasStageGraph() && m.getStageGraph().getEntries().size() > 0) {
    auto g = m.getStageGraph();
    fmt::print("  stage graph at {} ({})\n", g.getAt().cStr(), g.getReason().cStr());
    for (auto e : g.getEntries()) {
      fmt::print("    {:<16} {:<9} phase {:<10} for {:>6.1f}s  heartbeat {:>6.1f}s ago  step {}",
                 layout::process_name(e.getStage(), e.getRank()), e.getState().cStr(),
                 phase_name(e.getPhase()), e.getPhaseAgeSeconds(), e.getHeartbeatAgeSeconds(),
                 e.getStep());
      if (e.getStage() != StageKind::TRAINER && e.getProgressAgeSeconds() >= 0) {
        fmt::print("  progress {:.1f}s ago ({} done)", e.getProgressAgeSeconds(), e.getWorkDone());
      }
      fmt::print("\n");
    }
  }
  if (m.getLatestCheckpoint().size() > 0) {
    fmt::print("  checkpoint {} (step {})\n", m.getLatestCheckpoint().cStr(),
               m.getLatestCheckpointStep());
  }
  return 0;
}

}  // namespace megacpp::supervisor
