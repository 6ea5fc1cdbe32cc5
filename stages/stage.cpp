#include "stages/stage.h"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>

#include <capnp/message.h>
#include <kj/exception.h>
#include <CLI/CLI.hpp>

#include "core/error.h"
#include "core/util.h"
#include "schemas/journal.capnp.h"

namespace megacpp::stage {

namespace {

// Set from the SIGTERM/SIGINT handler; read by stop_requested(). A signal handler can only
// reach process-wide state, so this one flag is the exception to "no globals".
volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) {
  g_stop_signal = sig;
}

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  SYSCALL_CHECK(sigaction(SIGTERM, &sa, nullptr));
  SYSCALL_CHECK(sigaction(SIGINT, &sa, nullptr));
}

void write_failure_dump(StageContext* ctx, schema::StageKind kind, const StageArgs& args,
                        std::string_view failure_kind, std::string_view error_kind,
                        const std::string& message) {
  capnp::MallocMessageBuilder msg;
  auto d = msg.initRoot<schema::FailureDump>();
  d.setSchemaVersion(schema::SCHEMA_VERSION);
  d.setStage(kind);
  d.setRank(args.rank);
  d.setPid(::getpid());
  d.setKind(std::string(failure_kind));
  d.setErrorKind(std::string(error_kind));
  d.setMessage(message);
  if (ctx != nullptr) {
    d.setPhase(ctx->phase());
    d.setStep(ctx->step());
  }
  d.setMonoNs(mono_ns());
  d.setAt(rfc3339(wall_ns()));
  try {
    std::filesystem::create_directories(layout::failures_dir(args.run_dir));
    write_file_atomic(layout::failure_path(args.run_dir, kind, args.rank),
                      schemas::to_json(d.asReader()));
  } catch (const std::exception& e) {
    log_error("could not write the failure dump: {}", e.what());
  }
}

}  // namespace

StageContext::StageContext(schema::StageKind kind, const StageArgs& args)
    : kind_(kind),
      args_(args),
      launch_(layout::launch_path(args.run_dir)),
      journal_(layout::journal_path(args.run_dir, kind, args.rank)) {
  journal_.set_identity(kind, args.rank);
  auto l = launch_.get();
  control_ =
      std::make_unique<ipc::ControlClient>(l.getControlEndpoint(), kind, args.rank, args.generation,
                                           ipc::Millis(l.getHeartbeatIntervalMs()));
}

StageContext::~StageContext() = default;

void StageContext::set_phase(schema::Phase phase) {
  phase_.store(phase);
  control_->set_phase(phase);
}

void StageContext::set_step(uint32_t step) {
  step_.store(step);
  control_->set_step(step);
}

bool StageContext::stop_requested() const {
  return g_stop_signal != 0 || control_->stop_requested();
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
  app.footer(
      "Stage processes are launched by `megacpp run`; they are not meant to be started by hand.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  // Die with the supervisor: a stage never outlives the process that launched it.
  pid_t parent = ::getppid();
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) return 3;
  set_log_prefix(layout::process_name(kind, args.rank));

  std::unique_ptr<StageContext> ctx;
  try {
    install_signal_handlers();
    ctx = std::make_unique<StageContext>(kind, args);
    ctx->journal().append([](schema::JournalRecord::Builder r) { r.setProcessStarted(); });
    body(*ctx);
    ctx->set_phase(schema::Phase::SHUTDOWN);
    ctx->journal().append([](schema::JournalRecord::Builder r) { r.setProcessFinished(); });
    ctx->journal().sync();
    return 0;
  } catch (const Error& e) {
    log_error("{}", e.what());
    write_failure_dump(ctx.get(), kind, args, "exception", to_string(e.kind()), e.what());
    if (ctx) ctx->control().report_failure(std::string(to_string(e.kind())), e.what());
  } catch (const kj::Exception& e) {
    std::string what = e.getDescription().cStr();
    log_error("{}", what);
    write_failure_dump(ctx.get(), kind, args, "exception", "capnp", what);
    if (ctx) ctx->control().report_failure("capnp", what);
  } catch (const std::exception& e) {
    log_error("{}", e.what());
    write_failure_dump(ctx.get(), kind, args, "exception", "std", e.what());
    if (ctx) ctx->control().report_failure("exception", e.what());
  }
  return 1;
}

}  // namespace megacpp::stage

namespace megacpp::stage {
void fault_point(StageContext&, std::string_view, uint32_t) {}
}  // namespace megacpp::stage
