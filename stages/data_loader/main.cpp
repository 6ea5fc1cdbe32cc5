// megacpp-data-loader: reads token shards and keeps one batch ring per rank full.
//
// Blocking: never blocks on one rank's full ring while another rank's ring has room; waits
// are short sleeps that re-check for a stop. It produces exactly `steps` batches per rank
// (slot tag = step), then idles until the supervisor stops it.
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/util.h"
#include "ipc/shm.h"
#include "ipc/slot_ring.h"
#include "stages/data_loader/data_loader.h"
#include "stages/stage.h"

namespace mc = megacpp;

int main(int argc, char** argv) {
  return mc::stage::run_stage_main(
      argc, argv, mc::schema::StageKind::DATA_LOADER,
      "megacpp data loader: token shards -> per-rank batch rings",
      [](mc::stage::StageContext& ctx) {
        auto launch = ctx.launch();
        auto recipe = launch.getRecipe();
        auto model = recipe.getModel();
        auto train = recipe.getTrain();
        auto data = recipe.getData();
        const uint32_t world = launch.getWorld();
        const uint32_t steps = launch.getSteps();

        auto paths = mc::data_loader::ensure_builtin_corpus(
            launch.getDataDir().cStr(), data.getShards(), data.getShardTokens());
        std::vector<std::unique_ptr<mc::data_loader::Shard>> shards;
        std::vector<std::span<const uint16_t>> spans;
        for (const auto& p : paths) {
          shards.push_back(std::make_unique<mc::data_loader::Shard>(p));
          spans.push_back(shards.back()->tokens());
        }
        mc::data_loader::Sampler sampler(spans, model.getSeqLen(), train.getBatchSize(), world,
                                         train.getSeed());

        std::vector<std::unique_ptr<mc::ipc::ShmRegion>> regions;
        std::vector<std::unique_ptr<mc::ipc::SlotRing>> rings;
        for (uint32_t r = 0; r < world; ++r) {
          regions.push_back(std::make_unique<mc::ipc::ShmRegion>(
              mc::ipc::ShmRegion::Attach{},
              mc::layout::ring_shm_name(launch.getShmPrefix().cStr(), r)));
          rings.push_back(std::make_unique<mc::ipc::SlotRing>(*regions.back()));
          MEGACPP_CHECK(rings.back()->slot_bytes() >= sampler.batch_bytes(),
                        mc::ErrorKind::kProtocol, "ring slots are smaller than one batch");
        }
        mc::log_info("{} shards, {} windows of {} tokens; {} ranks x {} steps", paths.size(),
                     sampler.windows(), sampler.spec().row_tokens(), world, steps);

        // A ring's produced() count is the cursor: the next step to produce is produced() + 1.
        // A restarted loader therefore resumes exactly where the ranks' rings say it stopped.
        auto next_step = [&](uint32_t r) {
          return static_cast<uint32_t>(rings[r]->produced()) + 1;
        };
        // Progress is stamped at the end of each turn: every ring with room got its batch, or
        // none had room (nothing owed). A fill that never returns leaves the stamp to age, and
        // the supervisor restarts the loader on its stall budget.
        uint64_t batches = 0;
        ctx.set_phase(mc::schema::Phase::PRODUCE);
        for (;;) {
          if (ctx.stop_requested()) return;
          bool produced = false, done = true;
          uint32_t min_next = UINT32_MAX;
          for (uint32_t r = 0; r < world; ++r) {
            uint32_t step = next_step(r);
            min_next = std::min(min_next, step);
            if (step > steps) continue;
            done = false;
            auto slot = rings[r]->try_acquire();
            if (!slot) continue;
            mc::stage::fault_point(ctx, "produce", step);
            sampler.fill(step, r, reinterpret_cast<int64_t*>(slot->data()));
            rings[r]->publish(static_cast<uint32_t>(sampler.batch_bytes()), step);
            produced = true;
            ++batches;
          }
          ctx.set_step(min_next - 1);
          ctx.control().report_progress(batches);
          if (done) break;
          if (!produced) std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        ctx.set_phase(mc::schema::Phase::IDLE);
        while (!ctx.stop_requested()) {
          ctx.control().report_progress(batches);
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      });
}
