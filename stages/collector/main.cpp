// megacpp-collector: the live fold (one per run). Training never waits on it; if it dies it
// is restarted and re-folds the journals from the start.
#include <chrono>
#include <thread>

#include "stages/collector/collector.h"
#include "stages/stage.h"

namespace {

using megacpp::schema::Phase;

void run(megacpp::stage::StageContext& ctx) {
  megacpp::collector::Collector collector(ctx.run_dir());
  for (;;) {
    ctx.set_phase(Phase::WRITE);
    if (collector.poll()) collector.write();
    ctx.set_phase(Phase::IDLE);
    // ~250 ms between polls, in slices so a stop is seen promptly.
    for (int i = 0; i < 10 && !ctx.stop_requested(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
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
