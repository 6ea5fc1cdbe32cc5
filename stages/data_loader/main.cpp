// megacpp-data-loader: reads token shards and keeps one batch ring per rank full.
//
// The files are the launch contract's `dataset`, which the supervisor resolved and validated
// before any stage started; the loader maps them again (structure checked, tokens not
// rescanned) and cuts every rank's batches from the one global window sequence
// (data/sampler.h); the ranks of a tensor-parallel group get the same batches. Slots carry uint16
// or uint32 tokens (recipes/batch_spec.h).
//
// Blocking: never blocks on one rank's full ring while another rank's ring has room; waits
// are short sleeps that re-check for a stop (IdleNap: 10 us doubling to 200 us while no ring
// has room, so a fast trainer's freed slot is refilled soon and busy trainers cost almost no
// CPU; up to half the trainers' step interval, at most 20 ms, while every ring still holds two
// batches or more; the loader's timer slack is lowered to 1 us so those naps last what they
// ask). It
// produces exactly `steps` batches per rank (slot tag = step), then idles until the
// supervisor stops it.
#include <sys/prctl.h>

#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "data/dataset.h"
#include "data/sampler.h"
#include "ipc/shm.h"
#include "ipc/slot_ring.h"
#include "recipes/recipe.h"
#include "stages/data_loader/idle_nap.h"
#include "stages/stage.h"

namespace mc = megacpp;

int main(int argc, char** argv) {
  return mc::stage::run_stage_main(
      argc, argv, mc::schema::StageKind::DATA_LOADER,
      "megacpp data loader: token shards -> per-rank batch rings",
      [](mc::stage::StageContext& ctx) {
        auto launch = ctx.launch();
        auto recipe = launch.getRecipe();
        auto train = recipe.getTrain();
        auto data = recipe.getData();
        const uint32_t world = launch.getWorld();
        const uint32_t steps = launch.getSteps();
        // The rings of this node's ranks (a job across nodes: each node's loader fills its own).
        const mc::stage::LocalRanks local = mc::stage::local_ranks(launch);
        // The attempt's batch geometry, as the supervisor resolved it: rows per rank (a resume
        // at another world size keeps the global batch with its own), seq_len, slot width. The
        // ranks of a tensor-parallel group (consecutive ranks, recipes/recipe.h mode) train on
        // one batch: rank r's ring gets the batches of data rank r / tp of world / tp.
        const mc::recipe::BatchGeometry geometry = mc::recipe::batch_geometry(launch);
        const uint32_t tp = geometry.tensor_parallel;

        const bool pack = data.getPack();
        const auto dataset = mc::data::from_spec(launch.getDataset());
        const auto shards = mc::data::open_dataset(dataset, pack);
        std::vector<const mc::data::Shard*> views;
        for (const auto& s : shards) views.push_back(s.get());
        // A resumed attempt starts after its checkpoint's step.
        const auto resume = launch.getResume();
        mc::data::Sampler sampler(
            views, {.seq_len = geometry.slot.seq_len,
                    .batch = geometry.slot.batch,
                    .world = geometry.data_ranks(),
                    .token_bytes = geometry.slot.token_bytes,
                    .seed = train.getSeed(),
                    .pack = pack,
                    // Where this attempt's first step begins in the data
                    // order (0: step x the run's global batch, as
                    // contracts before the field meant).
                    .start = resume.getDataPosition(),
                    .start_step = resume.getDataPosition() != 0 ? resume.getStep() : 0u});
        const uint64_t slot_bytes = sampler.spec().slot_bytes();
        // The rings `name_of` names for this node's ranks, each checked to hold one batch.
        const auto attach_rings = [&](std::string (*name_of)(std::string_view, uint32_t),
                                      std::vector<std::unique_ptr<mc::ipc::ShmRegion>>& regions,
                                      std::vector<std::unique_ptr<mc::ipc::SlotRing>>& rings,
                                      std::string_view what) {
          for (uint32_t r = local.first; r < local.end(); ++r) {
            regions.push_back(std::make_unique<mc::ipc::ShmRegion>(
                mc::ipc::ShmRegion::Attach{}, name_of(launch.getShmPrefix().cStr(), r)));
            rings.push_back(std::make_unique<mc::ipc::SlotRing>(*regions.back()));
            MEGACPP_CHECK(rings.back()->slot_bytes() >= slot_bytes, mc::ErrorKind::kProtocol,
                          fmt::format("{} slots are smaller than one batch", what));
          }
        };

        // Held-out evaluation (README.md "Validation loss"): each rank's validation ring gets,
        // for every evaluation of this attempt in turn, the slots of its data rank's part of the
        // val split (recipes/batch_spec.h ValidationShare), tagged validation_tag(evaluation,
        // slot). Every evaluation reads the same windows; the ring's produced() count is the
        // cursor, as for the batch ring.
        const mc::recipe::ValidationShare share = mc::recipe::validation_share(launch);
        std::vector<std::unique_ptr<mc::data::Shard>> val_shards;
        std::optional<mc::data::ValidationSampler> validation;
        std::vector<std::unique_ptr<mc::ipc::ShmRegion>> val_regions;
        std::vector<std::unique_ptr<mc::ipc::SlotRing>> val_rings;
        const uint32_t evaluations = mc::recipe::evaluations_after(
            launch.getValidation().getEvery(), launch.getResume().getStep(), steps);
        if (share.windows > 0) {
          val_shards = mc::data::open_dataset(
              mc::data::from_spec(launch.getValidation().getDataset()), pack);
          std::vector<const mc::data::Shard*> val_views;
          for (const auto& s : val_shards) val_views.push_back(s.get());
          validation.emplace(val_views,
                             mc::data::ValidationConfig{.seq_len = geometry.slot.seq_len,
                                                        .batch = geometry.slot.batch,
                                                        .data_ranks = geometry.data_ranks(),
                                                        .token_bytes = geometry.slot.token_bytes,
                                                        .pack = pack,
                                                        .windows = share.windows});
          MEGACPP_CHECK(validation->share() == share, mc::ErrorKind::kProtocol,
                        "the val split's windows are not what the launch contract recorded");
          attach_rings(mc::layout::validation_ring_shm_name, val_regions, val_rings,
                       "validation ring");
        }
        // The next validation slot of rings[i]'s rank: (evaluation, slot), or nullopt when every
        // evaluation of the attempt has its slots.
        auto next_validation = [&](uint32_t i) -> std::optional<std::pair<uint32_t, uint32_t>> {
          if (val_rings.empty()) return std::nullopt;
          const uint32_t per = share.slots((local.first + i) / tp);
          if (per == 0) return std::nullopt;
          const uint64_t done = val_rings[i]->produced();
          if (done >= uint64_t{per} * evaluations) return std::nullopt;
          return std::make_pair(static_cast<uint32_t>(done / per),
                                static_cast<uint32_t>(done % per));
        };

        std::vector<std::unique_ptr<mc::ipc::ShmRegion>> regions;
        std::vector<std::unique_ptr<mc::ipc::SlotRing>> rings;
        attach_rings(mc::layout::ring_shm_name, regions, rings, "ring");
        mc::log_info(
            "{} {} files, {} windows of {} tokens per epoch; ranks {}..{} of {} x {} steps",
            shards.size(), mc::data::format_name(dataset.format), sampler.windows(),
            sampler.spec().row_tokens(), local.first, local.end() - 1, world, steps);
        uint64_t logged_epoch = 0;

        // A ring's produced() count is the cursor: the next step to produce is the attempt's
        // first step plus produced(). A restarted loader therefore resumes exactly where the
        // ranks' rings say it stopped.
        const uint32_t before = resume.getStep();
        // rings[i] is rank local.first + i.
        auto next_step = [&](uint32_t i) {
          return before + static_cast<uint32_t>(rings[i]->produced()) + 1;
        };
        // Progress is stamped at the end of each turn: every ring with room got its batch, or
        // none had room (nothing owed). A fill that never returns leaves the stamp to age, and
        // the supervisor restarts the loader on its stall budget.
        uint64_t batches = 0;
        mc::data_loader::IdleNap idle;
        // The time between turns that produced, smoothed: the pace the trainers consume at.
        using IdleClock = std::chrono::steady_clock;
        auto last_produced = IdleClock::now();
        std::chrono::microseconds interval{0};
        ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // best effort: naps of 10 us, not 60
        ctx.set_phase(mc::schema::Phase::PRODUCE);
        for (;;) {
          if (ctx.stop_requested()) return;
          bool produced = false, done = true;
          uint32_t min_next = UINT32_MAX;
          uint32_t queued = UINT32_MAX;  // the fewest batches a ring still owed any holds
          for (uint32_t i = 0; i < local.count; ++i) {
            const uint32_t r = local.first + i;
            uint32_t step = next_step(i);
            min_next = std::min(min_next, step);
            if (step > steps) continue;
            done = false;
            queued = std::min(queued, rings[i]->depth());
            auto slot = rings[i]->try_acquire();
            if (!slot) continue;
            mc::stage::fault_point(ctx, "produce", step);
            const auto bytes = sampler.fill(step, r / tp, *slot);
            rings[i]->publish(static_cast<uint32_t>(bytes), step);
            const uint64_t epoch = sampler.state_at(sampler.position(step, r / tp)).epoch;
            if (epoch > logged_epoch) {
              logged_epoch = epoch;
              mc::log_info("epoch {} begins at step {} (rank {}): windows reshuffled", epoch, step,
                           r);
            }
            produced = true;
            ++batches;
          }
          for (uint32_t i = 0; i < val_rings.size(); ++i) {
            const auto next = next_validation(i);
            if (!next) continue;
            done = false;
            auto slot = val_rings[i]->try_acquire();
            if (!slot) continue;
            const auto tag = mc::recipe::validation_tag(next->first, next->second);
            const auto bytes = validation->fill((local.first + i) / tp, next->second, tag, *slot);
            val_rings[i]->publish(static_cast<uint32_t>(bytes), tag);
            produced = true;
          }
          ctx.set_step(min_next - 1);
          ctx.control().report_progress(batches);
          if (done) break;
          if (produced) {
            const auto now = IdleClock::now();
            const auto since =
                std::chrono::duration_cast<std::chrono::microseconds>(now - last_produced);
            interval = interval.count() == 0 ? since : (interval * 3 + since) / 4;
            last_produced = now;
            idle.reset();
          } else {
            idle.wait(mc::data_loader::IdleNap::cap_for(queued, interval));
          }
        }
        ctx.set_phase(mc::schema::Phase::IDLE);
        while (!ctx.stop_requested()) {
          ctx.control().report_progress(batches);
          mc::stage::StageContext::nap(std::chrono::milliseconds(20));
        }
      });
}
