// The lifecycle of one job on one node: prepare (validate, run directory, launch contract,
// rings, rendezvous), launch, watch, finish or tear down, fold, report.
//
// Blocking: the watch loop blocks only in zmq_poll with a 100 ms timeout over the control
// ROUTER and a signalfd (SIGCHLD, SIGINT, SIGTERM). Every wait for a child is bounded.
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <map>
#include <optional>
#include <random>

#include <capnp/message.h>
#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "ipc/ipc.h"
#include "recipes/recipe.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"
#include "stages/collector/collector.h"
#include "supervisor/console.h"
#include "supervisor/process.h"
#include "supervisor/rendezvous.h"
#include "supervisor/supervisor.h"

namespace megacpp::supervisor {

namespace fs = std::filesystem;
using schema::Phase;
using schema::StageKind;

void RunOptions::validate() const {
  auto bad = [](std::string msg) { throw Error(ErrorKind::kInvalidArgument, std::move(msg)); };
  if (ranks < 1 || ranks > 256) bad(fmt::format("--ranks {}: must be in [1, 256]", ranks));
  if (steps < 1) bad("--steps must be >= 1");
  if (run_dir.empty()) bad("--run-dir is required");
  if (heartbeat_interval_ms < 10 || heartbeat_interval_ms > 10000)
    bad("--heartbeat-ms must be in [10, 10000]");
  if (ring_slots < 2 || ring_slots > 1024) bad("--ring-slots must be in [2, 1024]");
  if (!(startup_budget_s > 0) || !(hang_budget_s > 0)) bad("hang budgets must be > 0 seconds");
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
  bool alive = false;
  bool stop_sent = false;
  int exit_code = 0;
  int signal = 0;
  int64_t started_ns = 0;
  int64_t heartbeat_ns = 0;  // last heartbeat or hello
  int64_t progress_ns = 0;   // last time the step advanced
  uint32_t step = 0;
  Phase phase = Phase::STARTUP;
  double tokens = 0;
  float loss = NAN;
  double step_seconds = 0;
};

struct Failure {
  std::string kind;  // exited | signaled | hung | heartbeat_lost | exception | interrupted | launch
  StageKind stage = StageKind::SUPERVISOR;
  uint32_t rank = 0;
  std::string message;
  int64_t mono_ns = 0;
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

std::string git_revision(bool& dirty) {
  dirty = false;
  std::string rev;
  if (FILE* p = ::popen("git -C " MEGACPP_SOURCE_DIR " rev-parse HEAD 2>/dev/null", "r")) {
    char buf[128] = {};
    if (std::fgets(buf, sizeof buf, p)) rev = buf;
    ::pclose(p);
  }
  while (!rev.empty() && (rev.back() == '\n' || rev.back() == '\r')) rev.pop_back();
  if (FILE* p = ::popen("git -C " MEGACPP_SOURCE_DIR
                        " status --porcelain --untracked-files=no 2>/dev/null",
                        "r")) {
    char buf[8];
    dirty = std::fgets(buf, sizeof buf, p) != nullptr;
    ::pclose(p);
  }
  return rev.empty() ? "unknown" : rev;
}

class Run {
 public:
  explicit Run(RunOptions o) : opt_(std::move(o)) {}
  ~Run() { cleanup(); }
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  int execute();

 private:
  void prepare();
  void write_launch_contract();
  void launch(StageKind stage, uint32_t rank);
  void watch();
  void on_message(ipc::Received& m);
  void on_signals();
  void reap();
  void check_liveness();
  void fail(Failure f);
  void finish_ok();
  void teardown(double grace_s);
  bool wait_for(const std::function<bool()>& done, double seconds);
  void stop_child(Child& c);
  void journal_run_finished();
  int report();
  void cleanup();
  Child* by_name(const std::string& n);
  bool all_trainers_done() const;

  RunOptions opt_;
  recipe::Recipe recipe_;
  fs::path run_;
  fs::path sock_dir_;
  bool sock_dir_private_ = false;
  std::string run_id_, shm_prefix_, control_ep_, checkpoint_ep_;
  schema::FilesystemInfo::Reader fsinfo_;
  std::string fs_type_, fs_device_;
  bool fs_root_ = false;
  std::unique_ptr<StoreServer> store_;
  std::unique_ptr<ipc::ZmqContext> zmq_;
  std::unique_ptr<ipc::Channel> router_;
  std::unique_ptr<ipc::JournalWriter> journal_;
  std::vector<std::unique_ptr<ipc::ShmRegion>> rings_;
  std::vector<Child> children_;
  int sigfd_ = -1;
  std::optional<Failure> failure_;
  bool done_ = false;
  bool cleaned_ = false;
  int64_t t0_ = 0;
  std::unique_ptr<Console> console_;
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
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("run directory {} exists and is not a directory", run_.string()));
    }
    if (fs::exists(layout::launch_path(run_))) {
      throw Error(
          ErrorKind::kInvalidArgument,
          fmt::format(
              "run directory {} already holds a run (launch.json exists): choose a fresh --run-dir "
              "(resuming a run is not supported yet)",
              run_.string()));
    }
    if (!fs::is_empty(run_)) {
      throw Error(
          ErrorKind::kInvalidArgument,
          fmt::format("run directory {} is not empty: choose a fresh --run-dir", run_.string()));
    }
  }
  auto anchor = nearest_existing(run_);
  if (!fs::is_directory(anchor) || ::access(anchor.c_str(), W_OK) != 0) {
    throw Error(
        ErrorKind::kInvalidArgument,
        fmt::format("run directory {} is not writable ({} is {})", run_.string(), anchor.string(),
                    fs::is_directory(anchor) ? "not writable" : "not a directory"));
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
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("rule data-volume: run directory {} is on the root volume (device "
                              "{}, {}); put it on a "
                              "data volume or drop --require-data-volume",
                              run_.string(), fs_device_, fs_type_));
    }
    log_warn(
        "run directory {} is on the root volume ({}); production launches pass "
        "--require-data-volume",
        run_.string(), fs_type_);
  }

  std::error_code ec;
  fs::create_directories(run_, ec);
  if (ec) {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("run directory {} is not writable: {}", run_.string(), ec.message()));
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
  shm_prefix_ = fmt::format("/megacpp-{}-g0-", random_hex(8));
  ipc::unlink_shm(shm_prefix_);

  // A Unix socket path holds ~107 bytes; a deep run directory falls back to a short private dir.
  sock_dir_ = run_ / "sock";
  if (sock_dir_.string().size() + 16 > 100) {
    char tmpl[] = "/tmp/megacpp-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr)
      ::megacpp::detail::throw_syscall("mkdtemp", errno, __FILE__, __LINE__);
    sock_dir_ = tmpl;
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

  const uint32_t slot_bytes =
      recipe_.train.batch_size * (recipe_.model.seq_len + 1) * sizeof(int64_t);
  for (uint32_t r = 0; r < opt_.ranks; ++r) {
    auto name = layout::ring_shm_name(shm_prefix_, r);
    rings_.push_back(std::make_unique<ipc::ShmRegion>(
        ipc::ShmRegion::Create{}, name, ipc::SlotRing::region_bytes(opt_.ring_slots, slot_bytes)));
    ipc::SlotRing::format(*rings_.back(), opt_.ring_slots, slot_bytes);
  }
  write_launch_contract();

  zmq_ = std::make_unique<ipc::ZmqContext>();
  router_ = std::make_unique<ipc::Channel>(*zmq_, ipc::Channel::Kind::kRouter, control_ep_);
  journal_ =
      std::make_unique<ipc::JournalWriter>(layout::journal_path(run_, StageKind::SUPERVISOR, 0));
  journal_->set_identity(StageKind::SUPERVISOR, 0);
  journal_->append([](schema::JournalRecord::Builder r) { r.setProcessStarted(); });
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
  l.setRingSlotBytes(recipe_.train.batch_size * (recipe_.model.seq_len + 1) * sizeof(int64_t));
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
  write_file_atomic(layout::launch_path(run_), schemas::to_json(l.asReader()));
}

void Run::launch(StageKind stage, uint32_t rank) {
  Child c;
  c.stage = stage;
  c.rank = rank;
  c.name = layout::process_name(stage, rank);
  std::string exe_name = "megacpp-" + std::string(layout::stage_name(stage));
  std::replace(exe_name.begin(), exe_name.end(), '_', '-');
  auto exe = detail::self_exe_dir() / exe_name;
  std::vector<std::string> argv = {exe.string(), "--run-dir",          run_.string(),
                                   "--rank",     std::to_string(rank), "--generation",
                                   "0"};
  c.pid = detail::spawn(argv, layout::log_path(run_, stage, rank));
  c.alive = true;
  c.started_ns = mono_ns();
  c.heartbeat_ns = c.started_ns;
  c.progress_ns = c.started_ns;
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto e = r.initChildStarted();
    e.setStage(stage);
    e.setRank(rank);
    e.setPid(c.pid);
  });
  children_.push_back(std::move(c));
}

void Run::on_message(ipc::Received& m) {
  Child* c = by_name(m.peer());
  auto root = m.root();
  if (c == nullptr) {
    log_warn("control message from unknown peer '{}' ignored", m.peer());
    return;
  }
  int64_t now = mono_ns();
  switch (root.which()) {
    case schema::ControlMessage::HELLO:
      c->heartbeat_ns = now;
      break;
    case schema::ControlMessage::HEARTBEAT: {
      auto h = root.getHeartbeat();
      c->heartbeat_ns = now;
      if (h.getStep() != c->step) c->progress_ns = now;
      c->step = h.getStep();
      c->phase = h.getPhase();
      c->tokens = h.getTokens();
      c->loss = h.getLoss();
      c->step_seconds = h.getStepSeconds();
      break;
    }
    case schema::ControlMessage::FAILURE: {
      auto f = root.getFailure();
      fail(Failure{"exception", c->stage, c->rank,
                   fmt::format("{}: {} (phase {}, step {})", f.getKind().cStr(),
                               f.getMessage().cStr(), static_cast<int>(f.getPhase()), f.getStep()),
                   now});
      break;
    }
    default:
      break;
  }
}

void Run::reap() {
  for (;;) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    for (auto& c : children_) {
      if (c.pid != pid || !c.alive) continue;
      c.alive = false;
      if (WIFEXITED(status)) {
        c.exit_code = WEXITSTATUS(status);
      } else if (WIFSIGNALED(status)) {
        c.exit_code = -1;
        c.signal = WTERMSIG(status);
      }
      if (!done_) {
        journal_->append([&](schema::JournalRecord::Builder r) {
          auto e = r.initChildExited();
          e.setStage(c.stage);
          e.setRank(c.rank);
          e.setPid(c.pid);
          e.setExitCode(c.exit_code);
          e.setSignal(c.signal);
        });
      }
      bool expected = (c.stage == StageKind::TRAINER && c.exit_code == 0 && c.signal == 0) ||
                      (c.stop_sent && c.exit_code == 0 && c.signal == 0);
      if (!expected && !failure_) {
        if (c.signal != 0) {
          fail(Failure{
              "signaled", c.stage, c.rank,
              fmt::format("{} (pid {}) was killed by signal {} ({}) in phase {} at step {}", c.name,
                          c.pid, c.signal, strsignal(c.signal), static_cast<int>(c.phase), c.step),
              mono_ns()});
        } else {
          fail(Failure{"exited", c.stage, c.rank,
                       fmt::format("{} (pid {}) exited with code {} in phase {} at step {}", c.name,
                                   c.pid, c.exit_code, static_cast<int>(c.phase), c.step),
                       mono_ns()});
        }
      }
    }
  }
}

void Run::on_signals() {
  signalfd_siginfo si{};
  while (::read(sigfd_, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    if (si.ssi_signo == SIGCHLD) {
      reap();
    } else if (!failure_) {
      fail(Failure{
          "interrupted", StageKind::SUPERVISOR, 0,
          fmt::format("the supervisor received {}", strsignal(static_cast<int>(si.ssi_signo))),
          mono_ns()});
    }
  }
  reap();
}

void Run::check_liveness() {
  int64_t now = mono_ns();
  for (auto& c : children_) {
    if (!c.alive || c.stop_sent) continue;
    bool started = c.stage != StageKind::TRAINER || c.step >= 1;
    double budget = started ? opt_.hang_budget_s : opt_.startup_budget_s;
    double silent = static_cast<double>(now - c.heartbeat_ns) / 1e9;
    if (silent > std::max(budget, 10.0 * opt_.heartbeat_interval_ms / 1000.0)) {
      fail(Failure{"heartbeat_lost", c.stage, c.rank,
                   fmt::format("{} (pid {}) sent no heartbeat for {:.1f}s (phase {}, step {})",
                               c.name, c.pid, silent, static_cast<int>(c.phase), c.step),
                   now});
      return;
    }
    if (c.stage == StageKind::TRAINER) {
      double stalled = static_cast<double>(now - c.progress_ns) / 1e9;
      if (stalled > budget) {
        fail(Failure{"hung", c.stage, c.rank,
                     fmt::format("{} (pid {}) made no progress for {:.1f}s in phase {} (step {})",
                                 c.name, c.pid, stalled, static_cast<int>(c.phase), c.step),
                     now});
        return;
      }
    }
  }
}

void Run::fail(Failure f) {
  if (failure_) return;  // the first failure wins; later ones are consequences
  log_error("first failure: {} {}-{}: {}", f.kind, layout::stage_name(f.stage), f.rank, f.message);
  failure_ = std::move(f);
}

bool Run::all_trainers_done() const {
  for (const auto& c : children_) {
    if (c.stage == StageKind::TRAINER && (c.alive || c.exit_code != 0 || c.signal != 0))
      return false;
  }
  return true;
}

void Run::watch() {
  for (;;) {
    zmq_pollitem_t items[2] = {router_->pollitem(), zmq_pollitem_t{nullptr, sigfd_, ZMQ_POLLIN, 0}};
    int n = zmq_poll(items, 2, 100);
    if (n < 0 && zmq_errno() != EINTR) ZMQ_CHECK(n);
    if (items[1].revents & ZMQ_POLLIN) on_signals();
    if (items[0].revents & ZMQ_POLLIN) {
      while (auto m = router_->receive(ipc::Millis(0))) on_message(*m);
    }
    if (failure_) return;
    check_liveness();
    if (failure_) return;
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

bool Run::wait_for(const std::function<bool()>& done, double seconds) {
  int64_t deadline = mono_ns() + static_cast<int64_t>(seconds * 1e9);
  while (!done()) {
    int64_t left_ms = (deadline - mono_ns()) / 1'000'000;
    if (left_ms <= 0) return false;
    zmq_pollitem_t items[2] = {router_->pollitem(), zmq_pollitem_t{nullptr, sigfd_, ZMQ_POLLIN, 0}};
    zmq_poll(items, 2, static_cast<long>(std::min<int64_t>(left_ms, 50)));
    if (items[1].revents & ZMQ_POLLIN) on_signals();
    if (items[0].revents & ZMQ_POLLIN) {
      while (auto m = router_->receive(ipc::Millis(0))) on_message(*m);
    }
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

void Run::finish_ok() {
  // Training is over; the loader and the checkpointer drain and exit, then the collector
  // folds the final state. A stage that does not stop within its bound is a failure.
  for (auto& c : children_) {
    if (c.stage == StageKind::DATA_LOADER || c.stage == StageKind::CHECKPOINTER) stop_child(c);
  }
  double drain_s = static_cast<double>(env_knob_int("MEGACPP_DRAIN_TIMEOUT_S", 60));
  bool drained = wait_for(
      [&] {
        for (const auto& c : children_) {
          if ((c.stage == StageKind::DATA_LOADER || c.stage == StageKind::CHECKPOINTER) && c.alive)
            return false;
        }
        return true;
      },
      drain_s);
  if (!drained && !failure_) {
    fail(Failure{"hung", StageKind::CHECKPOINTER, 0,
                 fmt::format("stages did not stop within {:.0f}s", drain_s), mono_ns()});
  }
}

void Run::teardown(double grace_s) {
  for (auto& c : children_) {
    if (c.alive) ::kill(c.pid, SIGTERM);
  }
  auto none_alive = [&] {
    for (const auto& c : children_) {
      if (c.alive) return false;
    }
    return true;
  };
  if (wait_for(none_alive, grace_s)) return;
  for (auto& c : children_) {
    if (c.alive) {
      log_warn("{} (pid {}) ignored SIGTERM for {:.1f}s: SIGKILL", c.name, c.pid, grace_s);
      ::kill(c.pid, SIGKILL);
    }
  }
  if (!wait_for(none_alive, 2.0)) {
    for (const auto& c : children_) {
      if (c.alive) log_error("{} (pid {}) survived SIGKILL; not waiting for it", c.name, c.pid);
    }
  }
}

void Run::journal_run_finished() {
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto f = r.initRunFinished();
    f.setOk(!failure_);
    if (failure_) {
      f.setKind(failure_->kind);
      f.setStage(failure_->stage);
      f.setRank(failure_->rank);
      f.setReason(failure_->message);
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
    out += fmt::format("run ok: {} steps on {} ranks, loss {:.3f} -> {:.3f}, {:.0f} tokens/s\n",
                       m.getStepsCompleted(), m.getWorld(), first, last, tps);
  } else {
    auto e = m.getError();
    out += fmt::format("run error: {} in {}-{}: {}\n", e.getKind().cStr(),
                       layout::stage_name(e.getStage()), e.getRank(), e.getMessage().cStr());
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

void Run::cleanup() {
  if (cleaned_) return;
  cleaned_ = true;
  for (auto& c : children_) {
    if (c.alive) ::kill(c.pid, SIGKILL);
  }
  for (auto& c : children_) {
    if (c.alive) ::waitpid(c.pid, nullptr, 0);
  }
  router_.reset();
  zmq_.reset();
  rings_.clear();
  if (!shm_prefix_.empty()) ipc::unlink_shm(shm_prefix_);
  if (sock_dir_private_) {
    std::error_code ec;
    fs::remove_all(sock_dir_, ec);
  }
  store_.reset();
  if (sigfd_ >= 0) ::close(sigfd_);
  sigfd_ = -1;
}

int Run::execute() {
  prepare();
  t0_ = mono_ns();
  console_ = make_console(opt_.progress, opt_.steps, recipe_.name, run_.string());
  launch(StageKind::COLLECTOR, 0);
  launch(StageKind::CHECKPOINTER, 0);
  launch(StageKind::DATA_LOADER, 0);
  for (uint32_t r = 0; r < opt_.ranks; ++r) launch(StageKind::TRAINER, r);
  journal_->append([&](schema::JournalRecord::Builder r) {
    auto s = r.initRunStarted();
    s.setWorld(opt_.ranks);
    s.setStepsPlanned(opt_.steps);
  });
  watch();
  if (!failure_) finish_ok();
  if (console_) console_->finish();
  if (failure_) teardown(opt_.teardown_grace_s);
  journal_run_finished();
  done_ = true;
  // The live collector folds the final state; the in-process fold afterwards is the same
  // pure function, so it is a no-op when the collector finished and the guarantee when the
  // collector was the one that failed: the manifest never stays `running`.
  if (Child* col = by_name(layout::process_name(StageKind::COLLECTOR, 0)); col && col->alive) {
    stop_child(*col);
    if (!wait_for([&] { return !col->alive; }, 10.0)) teardown(0.5);
  }
  collector::collect_run(run_);
  cleanup();
  return report();
}

}  // namespace

int run(RunOptions options) {
  Run r(std::move(options));
  return r.execute();
}

int status(const fs::path& run_dir) {
  schemas::JsonFile<schema::Manifest> manifest(layout::manifest_path(run_dir));
  auto m = manifest.get();
  static const char* kStates[] = {"launched", "running", "ok", "error", "detached", "orphaned"};
  fmt::print("run {}  ({})\n", m.getRunId().cStr(), run_dir.string());
  fmt::print("  state      {}\n", kStates[static_cast<int>(m.getState())]);
  fmt::print("  recipe     {} ({})\n", m.getRecipe().cStr(), m.getRecipeHash().cStr());
  fmt::print("  steps      {}/{} on {} ranks\n", m.getStepsCompleted(), m.getStepsPlanned(),
             m.getWorld());
  fmt::print("  launched   {}\n  completed  {}\n  last seen  {}\n", m.getLaunchedAt().cStr(),
             m.getCompletedAt().cStr(), m.getLastPolledAt().cStr());
  if (m.hasError() && m.getError().getKind().size() > 0) {
    auto e = m.getError();
    fmt::print("  first failure  {} in {}-{}: {}\n", e.getKind().cStr(),
               layout::stage_name(e.getStage()), e.getRank(), e.getMessage().cStr());
  }
  fmt::print("  stages\n");
  for (auto s : m.getStages()) {
    std::string how = s.getState().cStr();
    if (how == "exited") how += fmt::format("({})", s.getExitCode());
    if (how == "signaled") how += fmt::format("({})", s.getSignal());
    fmt::print("    {:<16} pid {:<8} {:<14} last step {:<6} last record {}\n",
               layout::process_name(s.getStage(), s.getRank()), s.getPid(), how, s.getLastStep(),
               s.getLastRecordAt().cStr());
  }
  if (m.getLatestCheckpoint().size() > 0) {
    fmt::print("  checkpoint {} (step {})\n", m.getLatestCheckpoint().cStr(),
               m.getLatestCheckpointStep());
  }
  return 0;
}

}  // namespace megacpp::supervisor
