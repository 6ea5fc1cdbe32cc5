// megacpp-checkpointer: the snapshot plane's receiver (one per node).
#include <chrono>
#include <csignal>

#include "checkpoint/store.h"
#include "core/util.h"
#include "recipes/recipe.h"
#include "schemas/run_layout.h"
#include "stages/checkpointer/service.h"
#include "stages/stage.h"

namespace {

using megacpp::schema::Phase;

void run(megacpp::stage::StageContext& ctx) {
  namespace ck = megacpp::checkpoint;
  auto launch = ctx.launch();
  // A launch contract without a policy keeps every checkpoint (RetentionPolicy's default).
  ck::RetentionPolicy retention;
  if (launch.hasCheckpointPolicy()) {
    retention.keep = launch.getCheckpointPolicy().getKeep();
    retention.keep_every = launch.getCheckpointPolicy().getKeepEvery();
  }
  if (retention.keep == 0) {
    megacpp::log_info("retention: keeping every checkpoint");
  } else {
    megacpp::log_info("retention: keeping the newest {} checkpoint(s){}", retention.keep,
                      retention.keep_every
                          ? fmt::format(" and every multiple of step {}", retention.keep_every)
                          : std::string());
  }
  ck::CheckpointStore store(ctx.run_dir(), launch.getRunId(), launch.getRecipe().getHash(),
                            retention);
  const auto model = megacpp::recipe::model_config(launch.getRecipe());
  store.set_layout(model.mode, model.tensor_parallel());
  if (const auto local = megacpp::stage::local_ranks(launch); local.count != launch.getWorld())
    store.set_ranks(local.first, local.count);
  megacpp::ipc::Channel router(ctx.zmq(), megacpp::ipc::Channel::Kind::kRouter,
                               launch.getCheckpointEndpoint());
  // A relaunched checkpointer binds the same endpoint under the same identity; the ranks
  // re-send what they still need acknowledged (the Service is idempotent).
  megacpp::checkpointer::Service service(
      store, router, &ctx.journal(), [&ctx](Phase p) { ctx.set_phase(p); },
      [&ctx](uint32_t step) { megacpp::stage::fault_point(ctx, "write", step); });
  // Progress: every turn of this loop (a message handled or 200 ms of quiet), every chunk of a
  // rank file that reaches the disk, every turn of a bounded wait for a rank's staged copy. A
  // write blocked in the kernel or a wedged loop stops the stamps, and the supervisor restarts
  // the checkpointer on its stall budget.
  auto progress = [&ctx, &service] {
    ctx.control().report_progress(service.committed(), service.oldest_pending_ns());
  };
  store.set_progress(progress);
  // Ranks that stage their snapshots in exported buffers (device memory) send them here.
  std::unique_ptr<megacpp::checkpointer::StagingImports> imports;
  if (const auto socket =
          megacpp::layout::staged_handle_socket(launch.getCheckpointEndpoint().cStr());
      !socket.empty()) {
    megacpp::checkpointer::StagingImports::Options options;
    options.progress = progress;
    imports = std::make_unique<megacpp::checkpointer::StagingImports>(socket, options);
    service.set_staging_imports(imports.get());
  }
  ctx.set_phase(Phase::IDLE);
  // On stop, messages already queued are still handled; the loop ends at the first quiet
  // receive (or at once when no step is partially received).
  for (;;) {
    const bool handled = service.poll(std::chrono::milliseconds(200));
    progress();
    if (ctx.stop_requested() && (!handled || !service.has_pending())) break;
  }
  if (service.has_pending()) service.discard_pending();
  megacpp::log_info("stopping after {} committed checkpoint(s)", service.committed());
}

}  // namespace

int main(int argc, char** argv) {
  // A rank file that outgrows RLIMIT_FSIZE must fail its write with EFBIG (the out-of-space
  // path: the step is dropped, LATEST stays) rather than kill the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  return megacpp::stage::run_stage_main(
      argc, argv, megacpp::schema::StageKind::CHECKPOINTER,
      "receives rank snapshots and commits checkpoints atomically", run);
}
