// The staging targets of a rank's snapshot: the memfd stand-in and device memory
// (staged_snapshot.h).
#include "stages/trainer/staged_snapshot.h"

#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "ops/ops.h"
#include "stages/trainer/cuda_plugin.h"

namespace megacpp::trainer {

namespace {

class MemfdStaging final : public StagingTarget {
 public:
  MemfdStaging(uint32_t rank, uint64_t bytes) : buffer_(bytes) {
    info_.rank = rank;
    info_.generation = ipc::new_staged_generation();
    info_.kind = std::string(ipc::kStagedMemfd);
    info_.bytes = buffer_.bytes();
    info_.mapping_bytes = buffer_.mapping_bytes();
  }
  ~MemfdStaging() override { join(); }

  uint64_t bytes() const override { return buffer_.bytes(); }
  bool device() const override { return false; }
  void copy_async(std::span<const StagingPiece> pieces, uint64_t /*step*/) override {
    join();
    for (const StagingPiece& p : pieces) {
      MEGACPP_CHECK(p.offset <= bytes() && p.bytes <= bytes() - p.offset, ErrorKind::kInternal,
                    fmt::format("a {}-byte piece at {} overruns the {}-byte staging buffer",
                                p.bytes, p.offset, bytes()));
    }
    pieces_.assign(pieces.begin(), pieces.end());
    // Announced before the bytes: the checkpointer waits for end_copy().
    buffer_.begin_copy();
    auto run = [this] {
      for (const StagingPiece& p : pieces_)
        ops::stream_copy(buffer_.data() + p.offset, static_cast<const std::byte*>(p.src), p.bytes);
      buffer_.end_copy();
    };
    try {
      thread_ = std::thread(run);
    } catch (const std::system_error&) {
      run();  // no thread to be had: the copy blocks instead
    }
  }
  void order_after_copy() override { join(); }
  void read_back(std::span<std::byte> dst) override {
    join();
    MEGACPP_CHECK(dst.size() <= bytes(), ErrorKind::kInternal,
                  fmt::format("reading {} bytes of a {}-byte staging buffer", dst.size(), bytes()));
    if (!dst.empty()) std::memcpy(dst.data(), buffer_.data(), dst.size());
  }
  const ipc::StagedBufferInfo& info() const override { return info_; }
  int fd() const override { return buffer_.fd(); }

 private:
  void join() {
    if (thread_.joinable()) thread_.join();
  }
  ipc::MemfdBuffer buffer_;
  ipc::StagedBufferInfo info_;
  std::vector<StagingPiece> pieces_;
  std::thread thread_;
};

class CudaStaging final : public StagingTarget {
 public:
  CudaStaging(const CudaPlugin& plugin, int index, uint32_t rank, uint64_t bytes)
      : plugin_(plugin), index_(index), buffer_(index, bytes) {
    info_.rank = rank;
    info_.generation = ipc::new_staged_generation();
    info_.kind = std::string(ipc::kStagedCuda);
    info_.bytes = buffer_.bytes();
    info_.mapping_bytes = buffer_.mapping_bytes();
    info_.device = buffer_.pci_bus_id();
    info_.event = buffer_.event_handle();
  }
  ~CudaStaging() override = default;  // the buffer waits for its copy

  uint64_t bytes() const override { return buffer_.bytes(); }
  bool device() const override { return true; }
  void copy_async(std::span<const StagingPiece> pieces, uint64_t step) override {
    buffer_.copy_async(plugin_.api().current_stream(index_), pieces, step);
  }
  void order_after_copy() override {
    buffer_.order_after_copy(plugin_.api().current_stream(index_));
  }
  void read_back(std::span<std::byte> dst) override { buffer_.read(dst); }
  const ipc::StagedBufferInfo& info() const override { return info_; }
  int fd() const override { return buffer_.fd(); }

 private:
  const CudaPlugin& plugin_;
  int index_;
  gpu::ExportedBuffer buffer_;
  ipc::StagedBufferInfo info_;
};

}  // namespace

std::unique_ptr<StagingTarget> make_memfd_staging(uint32_t rank, uint64_t bytes) {
  return std::make_unique<MemfdStaging>(rank, bytes);
}

std::unique_ptr<StagingTarget> make_cuda_staging(const CudaPlugin& plugin, int index, uint32_t rank,
                                                 uint64_t bytes) {
  return std::make_unique<CudaStaging>(plugin, index, rank, bytes);
}

}  // namespace megacpp::trainer
