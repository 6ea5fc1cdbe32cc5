// The node agent: spawn (with their generation), reap (the dying generation of a restart too),
// signals, stop, kill, giving up on a process that outlives SIGKILL, the teardown's signals, the
// socket directory and the attempt's rings.
#include "supervisor/node_agent.h"

#include <signal.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <capnp/message.h>
#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "schemas/run_layout.h"
#include "supervisor/failure_policy.h"
#include "supervisor/process.h"

namespace megacpp::supervisor {

namespace fs = std::filesystem;
using schema::StageKind;

pid_t SystemSpawner::spawn(const std::vector<std::string>& argv, const fs::path& log,
                           const std::vector<std::string>& env) {
  return detail::spawn(argv, log, env);
}

pid_t SystemSpawner::spawn_spare(const std::vector<std::string>& argv, const fs::path& log,
                                 const std::vector<std::string>& env, int go_fd) {
  return detail::spawn(argv, log, env, go_fd);
}

namespace {
// The executable of a stage, beside this one: megacpp-<stage name, '_' as '-'>.
fs::path stage_executable(StageKind stage) {
  std::string name = "megacpp-" + std::string(layout::stage_name(stage));
  std::replace(name.begin(), name.end(), '_', '-');
  return detail::self_exe_dir() / name;
}
}  // namespace

void SystemSpawner::signal(pid_t pid, int sig) {
  ::kill(pid, sig);
}

pid_t SystemSpawner::wait(pid_t pid, int& status) {
  return ::waitpid(pid, &status, WNOHANG);
}

char SystemSpawner::state(pid_t pid) {
  return detail::process_state(pid);
}

std::vector<std::string> SystemSpawner::environment(const std::vector<std::string>& tunables) {
  return detail::environment_with_tunables(tunables);
}

template <class F>
void NodeAgent::emit(F&& build) {
  capnp::MallocMessageBuilder msg;
  build(msg.initRoot<schema::NodeEvent>());
  if (sink_) sink_(msg.getRoot<schema::NodeEvent>().asReader());
}

void NodeAgent::block_signals() {
  sigfd_.emplace(detail::block_signals_to_fd());
}

NodeAgent::Endpoints NodeAgent::make_socket_dir(const std::string& run_id, bool resuming) {
  // A Unix socket path holds ~107 bytes; a deep run directory falls back to a short private dir.
  sock_dir_ = run_ / "sock";
  if (resuming) fs::remove_all(sock_dir_);  // an earlier attempt's, its supervisor gone
  if (sock_dir_.string().size() + 16 > 100) {
    char tmpl[] = "/tmp/megacpp-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) SYSCALL_FAIL("mkdtemp", errno);
    sock_dir_ = tmpl;
    write_file_atomic(sock_dir_ / layout::kSockOwnerFile, run_id);
  } else {
    fs::create_directory(sock_dir_);
  }
  sock_dir_private_ = true;
  ::chmod(sock_dir_.c_str(), 0700);
  return Endpoints{sock_dir_, "ipc://" + (sock_dir_ / "control").string(),
                   "ipc://" + (sock_dir_ / "checkpoint").string()};
}

void NodeAgent::open_control(const std::string& endpoint) {
  zmq_ = std::make_unique<ipc::ZmqContext>();
  router_ = std::make_unique<ipc::Channel>(*zmq_, ipc::Channel::Kind::kRouter, endpoint);
}

NodeAgent::Process* NodeAgent::find(schema::StageRef::Reader ref) {
  const std::string name = layout::process_name(ref.getStage(), ref.getRank());
  for (auto& p : processes_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

bool NodeAgent::handle(schema::NodeCommand::Reader c) {
  switch (c.which()) {
    case schema::NodeCommand::LAUNCH:
      launch(c.getLaunch());
      return true;
    case schema::NodeCommand::STOP:
      return send_stop(c.getStop());
    case schema::NodeCommand::ABORT_COLLECTIVES:
      return abort_collectives(c.getAbortCollectives());
    case schema::NodeCommand::TEAR_DOWN:
      tear_down(c.getTearDown());
      return true;
    case schema::NodeCommand::RESTART_STAGE:
      restart(c.getRestartStage().getProcess());
      return true;
    case schema::NodeCommand::SIGNAL:
      if (const Process* p = find(c.getSignal().getProcess()))
        kill_child(*p, c.getSignal().getSignal());
      return true;
    case schema::NodeCommand::GIVE_UP:
      if (const Process* p = find(c.getGiveUp().getProcess()))
        give_up_on(*p, c.getGiveUp().getWaitedSeconds());
      return true;
    case schema::NodeCommand::PREPARE_ATTEMPT:
      create_rings(c.getPrepareAttempt());
      return true;
    case schema::NodeCommand::RELEASE_ATTEMPT:
      release_attempt();
      return true;
    case schema::NodeCommand::END_ATTEMPT:
      reap_dying();
      processes_.clear();
      return true;
    case schema::NodeCommand::KEEP_SPARE:
      keep_spare(c.getKeepSpare());
      return true;
  }
  return false;
}

void NodeAgent::launch(schema::LaunchStage::Reader l) {
  const StageKind stage = l.getProcess().getStage();
  const uint32_t rank = l.getProcess().getRank();
  Process* p = find(l.getProcess());
  if (p == nullptr) {
    processes_.push_back(Process{stage, rank, layout::process_name(stage, rank)});
    p = &processes_.back();
  }
  const uint32_t generation = l.getGeneration();
  std::vector<std::string> argv = {stage_executable(stage).string(),
                                   "--run-dir",
                                   run_.string(),
                                   "--rank",
                                   std::to_string(rank),
                                   "--generation",
                                   std::to_string(generation)};
  std::vector<std::string> env;
  if (l.getTuneEnvironment() || l.getExtraEnv().size() > 0) {
    std::vector<std::string> tunables;
    for (auto t : l.getTunables()) tunables.emplace_back(t.cStr());
    env = spawner_.environment(tunables);
    for (auto e : l.getExtraEnv()) env.emplace_back(e.cStr());
  }
  p->pid = take_spare(*p, generation, env);
  if (p->pid < 0) p->pid = spawner_.spawn(argv, layout::log_path(run_, stage, rank), env);
  p->env = std::move(env);
  p->generation = generation;
  p->alive = true;
  const pid_t pid = p->pid;
  emit([&](schema::NodeEvent::Builder e) {
    auto s = e.initStarted();
    s.setProcess(l.getProcess());
    s.setPid(pid);
    s.setGeneration(generation);
    s.setReason(l.getReason());
    s.setCause(l.getCause());
  });
}

void NodeAgent::keep_spare(schema::StageRef::Reader ref) {
  const Process* p = find(ref);
  if (p == nullptr) return;
  for (const auto& s : spares_)
    if (s.stage == p->stage && s.rank == p->rank) return;
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    log_warn("no spare of {}: socketpair: {}", p->name, std::strerror(errno));
    return;
  }
  Fd go(pair[0]);
  const Fd theirs(pair[1]);
  const std::vector<std::string> argv = {stage_executable(p->stage).string(),
                                         "--run-dir",
                                         run_.string(),
                                         "--rank",
                                         std::to_string(p->rank),
                                         "--spare"};
  const pid_t pid =
      spawner_.spawn_spare(argv, layout::log_path(run_, p->stage, p->rank), p->env, theirs.get());
  if (pid < 0) return;
  spares_.push_back(Spare{p->stage, p->rank, pid, std::move(go), p->env});
}

pid_t NodeAgent::take_spare(const Process& p, uint32_t generation,
                            const std::vector<std::string>& env) {
  const auto it = std::ranges::find_if(
      spares_, [&](const Spare& s) { return s.stage == p.stage && s.rank == p.rank; });
  if (it == spares_.end()) return -1;
  Spare spare = std::move(*it);
  spares_.erase(it);
  const std::string line = fmt::format("{}\n", generation);
  // MSG_NOSIGNAL: a spare that died is EPIPE here, not a SIGPIPE for the supervisor.
  if (spare.env == env && ::send(spare.go.get(), line.data(), line.size(), MSG_NOSIGNAL) ==
                              static_cast<ssize_t>(line.size())) {
    log_info("{} (generation {}) is its spare, pid {}, already loaded", p.name, generation,
             spare.pid);
    return spare.pid;
  }
  spawner_.signal(spare.pid, SIGKILL);  // reaped as a pid of no process (reap)
  return -1;
}

bool NodeAgent::send_stop(schema::StopStage::Reader s) {
  const Process* p = find(s.getProcess());
  if (p == nullptr || !p->alive) return false;
  ipc::ControlMessageBuilder b;
  auto stop = b.root().initStop();
  stop.setReason(s.getReason());
  if (s.getAfterCheckpoint()) stop.setAfterCheckpoint(true);
  const bool sent = router_ && router_->send_to(p->name, b.message(), ipc::Millis(200));
  if (!sent && s.getSigtermIfUnreachable()) spawner_.signal(p->pid, SIGTERM);
  return sent;
}

bool NodeAgent::abort_collectives(schema::AbortStageCollectives::Reader a) {
  const Process* p = find(a.getProcess());
  // A stopped rank cannot answer (its peers' abort is what frees them): not asked.
  if (p == nullptr || !p->alive || spawner_.state(p->pid) == 'T') return false;
  ipc::ControlMessageBuilder b;
  b.root().initAbortCollectives().setReason(a.getReason());
  return router_ && router_->send_to(p->name, b.message(), ipc::Millis(0));
}

void NodeAgent::tear_down(schema::TearDown::Reader t) {
  for (const auto& p : processes_) {
    if (!p.alive) continue;
    if (t.getKill()) {
      log_warn("{} (pid {}) still alive {:.1f}s after SIGTERM: SIGKILL", p.name, p.pid,
               t.getGraceSeconds());
      kill_child(p, SIGKILL);
      continue;
    }
    // A stopped or silent process cannot act on SIGTERM: waiting out the grace for it only
    // delays the teardown.
    bool silent = false;
    for (auto s : t.getSilent())
      silent = silent || layout::process_name(s.getStage(), s.getRank()) == p.name;
    kill_child(p, policy::teardown_signal(silent, spawner_.state(p.pid)));
  }
}

void NodeAgent::restart(schema::StageRef::Reader ref) {
  Process* p = find(ref);
  if (p == nullptr || !p->alive) return;
  // Relaunched (by the controller) once this pid is reaped, so two generations never share a
  // ring, a socket or the manifest.
  spawner_.signal(p->pid, SIGKILL);
  p->alive = false;
  p->dying_pid = p->pid;
}

// MEGACPP_TEST_UNKILLABLE=<process> makes this a no-op for that process: to the supervisor
// it is then what a process in uninterruptible sleep is, one that survives SIGKILL. The
// hook exists to test that no wait for such a process is unbounded.
void NodeAgent::kill_child(const Process& p, int sig) {
  if (p.name == unkillable_for_test_) return;
  spawner_.signal(p.pid, sig);
}

void NodeAgent::give_up_on(const Process& p, double waited_s) {
  if (!unkillable_.insert(p.pid).second) return;
  log_error("{} (pid {}) survived SIGKILL for {:.1f}s; unkillable, not waiting for it", p.name,
            p.pid, waited_s);
  emit([&](schema::NodeEvent::Builder e) {
    auto u = e.initUnkillable();
    u.getProcess().setStage(p.stage);
    u.getProcess().setRank(p.rank);
    u.setPid(p.pid);
    u.setWaitedSeconds(waited_s);
  });
}

void NodeAgent::exited(const Process& p, pid_t pid, int status, bool restart) {
  const int exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  const int signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  const StageKind stage = p.stage;
  const uint32_t rank = p.rank, generation = p.generation;
  emit([&](schema::NodeEvent::Builder e) {
    auto x = e.initExited();
    x.getProcess().setStage(stage);
    x.getProcess().setRank(rank);
    x.setPid(pid);
    x.setGeneration(generation);
    x.setExitCode(exit_code);
    x.setSignal(signal);
    x.setRestart(restart);
  });
}

void NodeAgent::reap() {
  for (;;) {
    int status = 0;
    const pid_t pid = spawner_.wait(-1, status);
    if (pid <= 0) return;
    if (std::erase_if(spares_, [&](const Spare& sp) { return sp.pid == pid; }) > 0) continue;
    // By index: the controller may launch (and so add a process) while an event is handled.
    for (size_t i = 0; i < processes_.size(); ++i) {
      Process& p = processes_[i];
      if (p.dying_pid == pid) {
        p.dying_pid = 0;
        exited(Process(p), pid, status, /*restart=*/true);
        break;
      }
      if (p.pid == pid && p.alive) {
        p.alive = false;
        exited(Process(p), pid, status, /*restart=*/false);
        break;
      }
    }
  }
}

void NodeAgent::reap_dying() {
  for (size_t i = 0; i < processes_.size(); ++i) {
    const pid_t dying = processes_[i].dying_pid;
    if (dying == 0) continue;
    int status = 0;
    if (spawner_.wait(dying, status) == dying) {
      processes_[i].dying_pid = 0;
      exited(Process(processes_[i]), dying, status, /*restart=*/true);
    }
  }
}

void NodeAgent::on_signals() {
  signalfd_siginfo si{};
  while (::read(sigfd_->get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    if (si.ssi_signo == SIGCHLD) {
      reap();
    } else {
      emit([&](schema::NodeEvent::Builder e) {
        e.setStopRequested(static_cast<int32_t>(si.ssi_signo));
      });
    }
  }
  reap();
}

void NodeAgent::pump(int timeout_ms) {
  ipc::Poller poller;
  const size_t router = poller.add(*router_);
  const size_t signals = poller.add(sigfd_->get());
  const size_t wake = wake_fd_ >= 0 ? poller.add(wake_fd_) : SIZE_MAX;
  if (poller.wait(ipc::Millis(timeout_ms)) == 0) return;
  if (wake != SIZE_MAX && poller.readable(wake)) {
    uint64_t n = 0;
    [[maybe_unused]] const auto r = ::read(wake_fd_, &n, sizeof n);  // EAGAIN: drained already
  }
  if (poller.readable(signals)) on_signals();
  if (poller.readable(router)) {
    while (auto m = router_->receive(ipc::Millis(0))) {
      emit([&](schema::NodeEvent::Builder e) {
        auto s = e.initMessage();
        s.setPeer(m->peer());
        s.setMessage(m->root());
      });
    }
  }
}

std::vector<RingLevel> NodeAgent::ring_levels() const {
  std::vector<RingLevel> out;
  for (const auto& r : ring_views_) out.push_back({r->depth(), r->slots()});
  return out;
}

void NodeAgent::create_rings(schema::PrepareAttempt::Reader a) {
  shm_prefix_ = a.getShmPrefix();
  ipc::unlink_shm(shm_prefix_);
  const uint64_t slot_bytes = a.getRingSlotBytes();
  for (uint32_t r = a.getFirstRank(); r < a.getFirstRank() + a.getRanks(); ++r) {
    auto name = layout::ring_shm_name(shm_prefix_, r);
    rings_.push_back(std::make_unique<ipc::ShmRegion>(
        ipc::ShmRegion::Create{}, name, ipc::SlotRing::region_bytes(a.getRingSlots(), slot_bytes)));
    ipc::SlotRing::format(*rings_.back(), a.getRingSlots(), slot_bytes);
    ring_views_.push_back(std::make_unique<ipc::SlotRing>(*rings_.back()));
    if (a.getValidationSlots() > 0) {
      validation_rings_.push_back(std::make_unique<ipc::ShmRegion>(
          ipc::ShmRegion::Create{}, layout::validation_ring_shm_name(shm_prefix_, r),
          ipc::SlotRing::region_bytes(a.getValidationSlots(), slot_bytes)));
      ipc::SlotRing::format(*validation_rings_.back(), a.getValidationSlots(), slot_bytes);
    }
  }
}

void NodeAgent::release_attempt() {
  ring_views_.clear();
  rings_.clear();
  validation_rings_.clear();
  if (!shm_prefix_.empty()) ipc::unlink_shm(shm_prefix_);
}

NodeAgent::~NodeAgent() {
  release();
  for (const auto& sp : spares_) spawner_.signal(sp.pid, SIGKILL);
}

void NodeAgent::release() {
  if (released_) return;
  released_ = true;
  router_.reset();
  zmq_.reset();
  release_attempt();
  if (sock_dir_private_) {
    std::error_code ec;
    fs::remove_all(sock_dir_, ec);
  }
}

void NodeAgent::kill_remaining() {
  // Spares first: closing `go` alone would end them too, SIGKILL does not wait for it.
  for (const auto& sp : spares_) spawner_.signal(sp.pid, SIGKILL);
  std::vector<size_t> waiting;
  for (size_t i = 0; i < processes_.size(); ++i) {
    const Process& p = processes_[i];
    if (!p.alive || unkillable_.contains(p.pid)) continue;
    kill_child(p, SIGKILL);
    waiting.push_back(i);
  }
  const int64_t deadline = mono_ns() + static_cast<int64_t>(kKillWaitS * 1e9);
  for (;;) {
    std::erase_if(waiting, [&](size_t i) {
      int status = 0;
      const pid_t r = spawner_.wait(processes_[i].pid, status);
      if (r == 0) return false;
      processes_[i].alive = false;  // reaped, or not our child any more (ECHILD)
      return true;
    });
    reap_dying();
    std::erase_if(spares_, [&](const Spare& sp) {
      int status = 0;
      return spawner_.wait(sp.pid, status) != 0;  // reaped, or not our child (ECHILD)
    });
    const bool any_dying =
        std::ranges::any_of(processes_, [](const Process& p) { return p.dying_pid != 0; });
    if ((waiting.empty() && !any_dying && spares_.empty()) || mono_ns() >= deadline) break;
    ::usleep(10'000);
  }
  for (size_t i : waiting) give_up_on(Process(processes_[i]), kKillWaitS);
}

}  // namespace megacpp::supervisor
