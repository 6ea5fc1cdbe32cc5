// The stage runtime: argument parsing, the stop signals, the StageContext every stage body
// runs in, and run_stage_main (crash dumps in crash_dump.cpp, fault injection in
// fault_injection.cpp).
#include "stages/stage.h"

#include <signal.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <exception>

#include <CLI/CLI.hpp>

#include "core/error.h"
#include "core/knobs.h"
#include "core/util.h"
#include "schemas/journal.capnp.h"

#include "stages/detail/stage_internal.h"

namespace megacpp::stage {

namespace fs = std::filesystem;

namespace {

// Set from the SIGTERM/SIGINT handler; read by stop_requested(). A signal handler can only
// reach process-wide state, so this flag and crash_dump.cpp's CrashState are the exceptions
// to "no globals".
volatile std::sig_atomic_t g_stop_signal = 0;
// Set while the process computes a training step (phases forward, backward, optimizer):
// a stop request then ends the process at once, since a step cut short is thrown away anyway
// and finishing it only delays a teardown by up to a step time.
volatile std::sig_atomic_t g_in_step_compute = 0;

void on_stop_signal(int sig) {
  g_stop_signal = sig;
  if (g_in_step_compute != 0) ::_exit(128 + sig);
}

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  SYSCALL_CHECK(sigaction(SIGTERM, &sa, nullptr));
  SYSCALL_CHECK(sigaction(SIGINT, &sa, nullptr));
  // A write to a socket whose peer died (a Gloo peer on a node that was killed, a closed ZeroMQ
  // or store connection) must be an error the stage reports (EPIPE: Gloo throws, naming the
  // peer), not a SIGPIPE that kills it without a word.
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  SYSCALL_CHECK(sigaction(SIGPIPE, &ignore, nullptr));
}

}  // namespace

StageContext::StageContext(schema::StageKind kind, const StageArgs& args)
    : kind_(kind),
      args_(args),
      launch_(layout::launch_path(args.run_dir)),
      journal_(layout::journal_path(args.run_dir, kind, args.rank)) {
  faults_ = detail::parse_faults(knob_string(Knob::kFault), kind, args.rank, args.generation,
                                 launch_.get().getAttempt());
  for (const auto& f : faults_) {
    log_warn("fault injection armed: {} at {} step {}", detail::action_name(f.action), f.point,
             f.step);
  }
  journal_.set_identity(kind, args.rank);
  auto l = launch_.get();
  journal_.set_attempt(l.getAttempt());
  control_ = std::make_unique<ipc::ControlClient>(l.getControlEndpoint(),
                                                  ipc::Identity{kind, args.rank, args.generation},
                                                  ipc::Millis(l.getHeartbeatIntervalMs()));
  detail::publish_context(this);
}

StageContext::~StageContext() {
  detail::retract_context(this);
}

void StageContext::set_phase(schema::Phase phase) {
  g_in_step_compute = phase == schema::Phase::FORWARD || phase == schema::Phase::BACKWARD ||
                      phase == schema::Phase::OPTIMIZER;
  phase_.store(phase);
  control_->set_phase(phase);
}

void StageContext::set_step(uint32_t step) {
  step_.store(step);
  control_->set_step(step);
}

bool StageContext::graceful_stop_requested() const {
  return control_->graceful_stop_requested();
}

void StageContext::nap(std::chrono::milliseconds d) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  ::nanosleep(&ts, nullptr);  // EINTR is the point: the caller re-checks for a stop
}

bool StageContext::stop_requested() const {
  return g_stop_signal != 0 || control_->stop_requested();
}

std::optional<uint32_t> detail::read_spare_generation(int fd) {
  std::string line;
  char c = 0;
  for (;;) {
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    if (c == '\n') break;
    if (c < '0' || c > '9' || line.size() >= 10) return std::nullopt;
    line += c;
  }
  if (line.empty()) return std::nullopt;
  const uint64_t g = std::stoull(line);
  if (g > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(g);
}

int run_stage_main(int argc, char** argv, schema::StageKind kind, std::string_view description,
                   const std::function<void(StageContext&)>& body) {
  StageArgs args;
  CLI::App app{std::string(description),
               std::string("megacpp-") + std::string(layout::stage_name(kind))};
  app.add_option("--run-dir", args.run_dir, "Run directory holding launch.json")->required();
  app.add_option("--rank", args.rank, "Rank of this process within its stage kind")->default_val(0);
  app.add_option("--generation", args.generation, "Launch generation (restarts bump it)")
      ->default_val(0);
  bool spare = false;
  app.add_flag(
      "--spare", spare,
      "Start loaded and wait on stdin for the generation to run as (a supervisor's spare)");
  app.footer(
      "Stage processes are launched by `megacpp run`; they are not meant to be started by hand.\n"
      "MEGACPP_FAULT=<stage>:<rank>:<point>:<step>:<action>[,...] injects a fault (chaos tests).");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  // Die with the supervisor: a stage never outlives the process that launched it.
  pid_t parent = ::getppid();
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) return 3;
  if (spare) {
    const auto generation = detail::read_spare_generation(STDIN_FILENO);
    if (!generation) return 0;  // the supervisor let it go unused
    args.generation = *generation;
    args.activated = std::chrono::steady_clock::now();
  }
  set_log_prefix(layout::process_name(kind, args.rank));
  const fs::path dump_path = layout::failure_path(args.run_dir, kind, args.rank);

  std::unique_ptr<StageContext> ctx;
  detail::DumpFields failure;
  try {
    install_signal_handlers();
    detail::arm_crash_handlers(kind, args);
    ctx = std::make_unique<StageContext>(kind, args);
    ctx->journal().append([](schema::JournalRecord::Builder r) { r.setProcessStarted(); });
    body(*ctx);
    ctx->set_phase(schema::Phase::SHUTDOWN);
    ctx->journal().append([](schema::JournalRecord::Builder r) { r.setProcessFinished(); });
    ctx->journal().sync();
    return 0;
  } catch (...) {
    failure = detail::classify(std::current_exception(), schema::FailureReport::EXCEPTION);
  }
  detail::log_failure(failure);
  detail::write_failure_dump(ctx.get(), kind, args.rank, dump_path, failure);
  // MEGACPP_TEST_MUTE_FAILURE: the report lost at the exit, which the supervisor must survive
  // by reading the dump just written.
  if (ctx && knob_string(Knob::kTestMuteFailure) != layout::process_name(kind, args.rank)) {
    ctx->control().report_failure(failure.kind, failure.message,
                                  failure.error_kind.value_or(schema::ErrorKind::NONE),
                                  failure.mono_ns);
  }
  return 1;
}

}  // namespace megacpp::stage
