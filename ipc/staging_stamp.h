// megacpp::ipc staging stamp — which step a rank's staging region holds (the snapshot plane:
// the rank writes it, the checkpointer reads it; DESIGN.md "Decisions": snapshot ownership).
//
// The last kStagingStampBytes of a rank's staging region say which step the region holds, so
// a SnapshotReady that outlived its lease (re-sent, queued, then delivered to a restarted
// checkpointer after the rank reused the region for a later step) is never written under the
// wrong step. A seqlock: the rank sets `step` to 0 before it copies a share and to the step
// after; the checkpointer writes a snapshot only if the stamp names the SnapshotReady's step
// before and after the write. `step` is accessed through std::atomic_ref (lock-free, so valid
// across processes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

namespace megacpp::ipc {

struct StagingStamp {
  uint64_t magic;
  uint32_t step;  // 0: being written
  uint32_t reserved;
};
inline constexpr uint64_t kStagingStampMagic = 0x504d415453434d4dULL;  // "MMCSTAMP"
inline constexpr uint64_t kStagingStampBytes = 64;
// The step a stamp names; nullopt when `p` holds no stamp (wrong magic).
std::optional<uint32_t> read_staging_stamp(const std::byte* p);
// The rank's side: clear before the copy (writes after it cannot be seen before the clear),
// set after it (the copy is visible before the step).
void clear_staging_stamp(std::byte* p);
void set_staging_stamp(std::byte* p, uint32_t step);

}  // namespace megacpp::ipc
