// megacpp-collector: the live fold (one per run). Training never waits on it; if it dies it
// is restarted and re-folds the journals from the start.
#include <chrono>

#include "core/util.h"
#include "stages/collector/collector.h"
#include "stages/stage.h"

namespace {

using megacpp::schema::Phase;

void run(megacpp::stage::StageContext& ctx) {
  megacpp::collector::Collector collector(ctx.run_dir());
  for (uint32_t polls = 1;; ++polls) {
    // The step of a collector is its poll count: a stuck fold shows as a step that stays.
    ctx.set_step(polls);
    ctx.set_phase(Phase::WRITE);
    megacpp::stage::fault_point(ctx, "fold", polls);
    const int64_t before = collector.newest_record_wall_ns();
    if (collector.poll([&] { ctx.control().report_progress(polls - 1); })) collector.write();
    const int64_t newest = collector.newest_record_wall_ns();
    ctx.control().publish(
        {.step = polls,
         .lag_seconds =
             newest > before ? static_cast<double>(megacpp::wall_ns() - newest) / 1e9 : 0.0});
    // Stamped only by the fold itself (after each journal, and here once it is written): a
    // fold that never returns stops the stamps while the heartbeats go on, and the
    // supervisor restarts the collector on its stall budget.
    ctx.control().report_progress(polls);
    ctx.set_phase(Phase::IDLE);
    // ~250 ms between polls, in slices so a stop is seen promptly.
    for (int i = 0; i < 10 && !ctx.stop_requested(); ++i) {
      megacpp::stage::StageContext::nap(std::chrono::milliseconds(25));
    }
    if (ctx.stop_requested()) break;
  }
  ctx.set_phase(Phase::WRITE);
  collector.poll();
  collector.finish();
  collector.write();
}

}  // namespace

int main(int argc, char** argv) {
  return megacpp::stage::run_stage_main(argc, argv, megacpp::schema::StageKind::COLLECTOR,
                                        "folds the run's journals into manifest.json and receipts",
                                        run);
}
