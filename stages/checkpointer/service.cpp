// The checkpointer's message loop: SnapshotReady in, SnapshotAck out, commits journaled.
#include <sys/stat.h>
#include <atomic>

#include "checkpoint/safetensors.h"
#include "checkpoint/store.h"
#include "core/error.h"
#include "core/util.h"
#include "ipc/shm.h"
#include "ipc/staging_stamp.h"
#include "schemas/run_layout.h"
#include "stages/checkpointer/service.h"

namespace megacpp::checkpointer {

// A rank's staging region, attached once and reused for every snapshot of that rank
// (attaching per checkpoint would cost a mapping each time; DESIGN.md "Decisions": snapshot
// ownership).
struct Service::Attached {
  std::string name;
  uint64_t bytes = 0;
  ino_t inode = 0;  // of /dev/shm/<name> when attached: a re-created segment is re-attached
  std::unique_ptr<ipc::ShmRegion> region;
};

namespace {
// Inode of a live shm segment, 0 if it does not exist (then attaching reports the error).
ino_t shm_inode(const std::string& name) {
  struct stat st {};
  return ::stat(("/dev/shm" + name).c_str(), &st) == 0 ? st.st_ino : 0;
}
}  // namespace

Service::Service(checkpoint::CheckpointStore& store, ipc::Channel& router,
                 ipc::JournalWriter* journal, PhaseFn on_phase, WriteFn before_write)
    : store_(store),
      router_(router),
      journal_(journal),
      on_phase_(std::move(on_phase)),
      before_write_(std::move(before_write)) {}

Service::~Service() = default;

void Service::set_phase(schema::Phase phase) {
  if (on_phase_) on_phase_(phase);
}

bool Service::poll(std::chrono::milliseconds timeout) {
  if (imports_ != nullptr) imports_->poll();
  auto msg = router_.receive(timeout);
  if (!msg) return false;
  auto root = msg->root();
  if (root.isSnapshotReady()) {
    handle_snapshot(msg->peer(), root.getSnapshotReady());
  } else {
    log_warn("ignoring an unexpected control message (union tag {}) from '{}'",
             static_cast<int>(root.which()), msg->peer());
  }
  return true;
}

const std::byte* Service::region_for(uint32_t rank, const std::string& name, uint64_t bytes) {
  auto& slot = regions_[rank];
  const ino_t inode = shm_inode(name);
  if (!slot || slot->name != name || slot->bytes != bytes || slot->inode != inode) {
    slot.reset();
    auto attached = std::make_unique<Attached>();
    attached->name = name;
    attached->bytes = bytes;
    attached->inode = inode;
    attached->region = std::make_unique<ipc::ShmRegion>(ipc::ShmRegion::Attach{}, name);
    MEGACPP_CHECK(attached->region->size() >= bytes, ErrorKind::kProtocol,
                  fmt::format("staging region {} holds {} bytes, snapshot claims {}", name,
                              attached->region->size(), bytes));
    log_info("attached staging region {} of rank {} ({} bytes)", name, rank, bytes);
    slot = std::move(attached);
  }
  return slot->region->data();
}

void Service::ack(const std::string& peer, uint32_t rank, uint32_t step, bool ok, bool committed,
                  const std::string& error, bool staging_refused) {
  ipc::ControlMessageBuilder b;
  auto a = b.root().initSnapshotAck();
  a.setRank(rank);
  a.setStep(step);
  a.setOk(ok);
  a.setCommitted(committed);
  if (!error.empty()) a.setError(error);
  a.setStagingRefused(staging_refused);
  if (!router_.send_to(peer, b.message())) {
    log_warn("could not deliver the ack of step {} to '{}' (peer gone?)", step, peer);
  }
}

void Service::handle_snapshot(const std::string& peer, schema::SnapshotReady::Reader ready) {
  const uint32_t rank = ready.getRank();
  const uint32_t world = ready.getWorld();
  const uint32_t step = ready.getStep();
  // What this snapshot is to us; decided before the staging region is touched, because a
  // duplicate may arrive after its rank has moved on and reused the region.
  enum class Seen { kNew, kWritten, kCommitted, kSuperseded };
  Seen seen = Seen::kNew;
  try {
    MEGACPP_CHECK(world > 0 && rank < world, ErrorKind::kProtocol,
                  fmt::format("SnapshotReady from '{}': rank {} of world {}", peer, rank, world));
    if (peer != layout::process_name(schema::StageKind::TRAINER, rank)) {
      log_warn("SnapshotReady for rank {} arrived from '{}'", rank, peer);
    }
    if (store_.committed(step)) {
      seen = Seen::kCommitted;
    } else if (auto it = steps_.find(step); it != steps_.end() && it->second.peers.contains(rank)) {
      MEGACPP_CHECK(it->second.world == world, ErrorKind::kProtocol,
                    fmt::format("step {}: rank {} re-sent its snapshot with world {}, was {}", step,
                                rank, world, it->second.world));
      it->second.peers[rank] = peer;
      seen = Seen::kWritten;
    } else if (store_.latest() && step < *store_.latest()) {
      seen = Seen::kSuperseded;
    }
  } catch (const std::exception& e) {
    log_error("snapshot of step {} from rank {} failed: {}", step, rank, e.what());
    ack(peer, rank, step, false, false, e.what());
    throw;
  }
  switch (seen) {
    case Seen::kCommitted:
      log_info("step {} is already committed; acking rank {}'s re-sent snapshot", step, rank);
      ack(peer, rank, step, true, true, {});
      return;
    case Seen::kWritten:
      log_info("rank {}'s snapshot of step {} is already written; acking it again", rank, step);
      ack(peer, rank, step, true, false, {});
      return;
    case Seen::kSuperseded:
      log_warn("not writing rank {}'s snapshot of step {}: step {} is already committed", rank,
               step, *store_.latest());
      ack(peer, rank, step, true, false, {});
      return;
    case Seen::kNew:
      break;
  }

  set_phase(schema::Phase::WRITE);
  const std::byte* stamp = nullptr;
  try {
    const uint64_t region_bytes = ready.getRegionBytes();
    const std::byte* base = region_for(rank, ready.getRegion(), region_bytes);
    if (const uint64_t at = ready.getStampOffset(); at != 0) {
      MEGACPP_CHECK(
          at <= region_bytes && ipc::kStagingStampBytes <= region_bytes - at && at % 8 == 0,
          ErrorKind::kProtocol,
          fmt::format("step stamp at {} lies outside the {}-byte staging region", at,
                      region_bytes));
      stamp = base + at;
      // A SnapshotReady whose region has moved on (its lease was released to an earlier
      // incarnation of this process) describes bytes that are no longer its step's.
      if (const auto held = ipc::read_staging_stamp(stamp); held != step) {
        log_warn("not writing rank {}'s snapshot of step {}: its staging region now holds {}", rank,
                 step, held ? fmt::format("step {}", *held) : std::string("no stamp"));
        return;
      }
    }
    // Where the tensors lie: the region itself, or the rank's exported staging buffer.
    const std::byte* data = base;
    uint64_t data_bytes = region_bytes;
    if (const uint64_t generation = ready.getStagedGeneration(); generation != 0) {
      MEGACPP_CHECK(imports_ != nullptr, ErrorKind::kProtocol,
                    fmt::format("rank {} staged its snapshot in an exported buffer, but this "
                                "checkpointer has no handle socket",
                                rank));
      uint64_t needed = 0;
      for (auto t : ready.getTensors()) {
        MEGACPP_CHECK(t.getBytes() <= UINT64_MAX - t.getOffset(), ErrorKind::kProtocol,
                      fmt::format("tensor '{}' [{}, +{}) overflows", t.getName().cStr(),
                                  t.getOffset(), t.getBytes()));
        needed = std::max(needed, t.getOffset() + t.getBytes());
      }
      const auto got = imports_->read(rank, generation, needed, step);
      using Status = StagingImports::Status;
      if (got.status == Status::kRankGone) {
        // Nobody to ack: the supervisor sees the rank's death and names it.
        log_error(
            "rank {} is gone (its staging connection closed): its snapshot of step {} "
            "cannot be read and is not written",
            rank, step);
        set_phase(schema::Phase::IDLE);
        return;
      }
      if (got.status == Status::kRefused) {
        const std::string why = fmt::format(
            "the checkpointer cannot import rank {}'s staging buffer: {}", rank, got.why);
        log_warn("not writing rank {}'s snapshot of step {}: {}", rank, step, why);
        ack(peer, rank, step, false, false, why, /*staging_refused=*/true);
        set_phase(schema::Phase::IDLE);
        return;
      }
      if (got.status != Status::kOk) {
        const std::string why =
            got.status == Status::kNoBuffer
                ? fmt::format(
                      "no staging buffer of generation {:#x} from rank {} on {} within {} s",
                      generation, rank, imports_->path().string(),
                      imports_->options().buffer_wait.count() / 1000.0)
            : !got.why.empty()
                ? got.why
                : fmt::format("rank {}'s copy into its staging buffer did not finish within {} s",
                              rank, imports_->options().copy_wait.count() / 1000.0);
        log_warn("not writing rank {}'s snapshot of step {} yet: {}", rank, step, why);
        ack(peer, rank, step, false, false, why);
        set_phase(schema::Phase::IDLE);
        return;
      }
      data = got.bytes.data();
      data_bytes = got.bytes.size();
    }
    std::vector<checkpoint::TensorView> views;
    views.reserve(ready.getTensors().size());
    for (auto t : ready.getTensors()) {
      const uint64_t offset = t.getOffset();
      const uint64_t bytes = t.getBytes();
      MEGACPP_CHECK(offset <= data_bytes && bytes <= data_bytes - offset, ErrorKind::kProtocol,
                    fmt::format("tensor '{}' [{}, +{}) lies outside the {}-byte staging region",
                                t.getName().cStr(), offset, bytes, data_bytes));
      checkpoint::TensorView v;
      v.name = t.getName();
      v.dtype = t.getDtype();
      for (uint64_t d : t.getShape()) v.shape.push_back(d);
      v.data = data + offset;
      v.bytes = bytes;
      views.push_back(std::move(v));
    }
    if (before_write_) before_write_(step);
    auto [it, fresh] = steps_.try_emplace(step);
    if (fresh) {
      it->second.first_mono_ns = mono_ns();
      it->second.world = world;
    }
    store_.write_rank(step, world, rank, views, ready.getLayout().cStr());
    std::atomic_thread_fence(std::memory_order_acquire);
    if (stamp != nullptr && ipc::read_staging_stamp(stamp) != step) {
      // The rank reused the region while the file was written: what was written is a mix.
      // The step cannot commit (the rank will not send it again), so it is dropped.
      log_warn("rank {}'s staging region changed while step {} was written; dropping the step",
               rank, step);
      store_.discard(step);
      steps_.erase(step);
      return;
    }
    it->second.peers[rank] = peer;
  } catch (const std::exception& e) {
    log_error("snapshot of step {} from rank {} failed: {}", step, rank, e.what());
    ack(peer, rank, step, false, false, e.what());
    throw;
  }
  // The rank's file is durable: its staging lease is released.
  ack(peer, rank, step, true, false, {});
  if (store_.complete(step)) commit(step, ready.getFinal());
  set_phase(schema::Phase::IDLE);
}

void Service::commit(uint32_t step, bool final) {
  StepState state = std::move(steps_.at(step));
  steps_.erase(step);
  checkpoint::CommittedCheckpoint done;
  try {
    done = store_.commit(step);
  } catch (const std::exception& e) {
    log_error("commit of step {} failed: {}", step, e.what());
    for (const auto& [r, p] : state.peers) ack(p, r, step, false, false, e.what());
    throw;
  }
  const double seconds = static_cast<double>(mono_ns() - state.first_mono_ns) / 1e9;
  if (journal_ != nullptr) {
    journal_->append([&](schema::JournalRecord::Builder rec) {
      auto c = rec.initCheckpointCommitted();
      c.setStep(step);
      c.setPath(done.relative_path);
      c.setBytes(done.bytes);
      c.setSeconds(seconds);
    });
  }
  ++committed_;
  log_info("committed {} ({} bytes, world {}, {:.3f} s{})", done.relative_path, done.bytes,
           state.world, seconds, final ? ", final" : "");
  for (const auto& [r, p] : state.peers) ack(p, r, step, true, true, {});
  // Every rank has snapshotted `step`, so none will send an older step again (its lease
  // was released or it was lost in a restart): what is left of older steps is dead.
  for (auto it = steps_.begin(); it != steps_.end() && it->first < step;) {
    log_warn("discarding step {} ({} rank(s) received): superseded by step {}", it->first,
             it->second.peers.size(), step);
    store_.discard(it->first);
    it = steps_.erase(it);
  }
  // After the acks: a failed deletion fails this stage, never the commit just made.
  store_.prune();
}

void Service::discard_pending() {
  for (const auto& [step, state] : steps_) {
    log_warn("discarding step {}: {} rank(s) of the snapshot received", step, state.peers.size());
  }
  steps_.clear();
  store_.discard_all();
}

}  // namespace megacpp::checkpointer
