// Device staging through the CUDA virtual-memory API and an IPC event (staging.h).
#include "gpu/staging.h"

#include <unistd.h>

#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"

#if MEGACPP_HAVE_CUDA_H
#include "gpu/driver.h"
#endif

namespace megacpp::gpu {

#if MEGACPP_HAVE_CUDA_H

using detail::Driver;

bool built() noexcept {
  return true;
}

bool driver_available(std::string* why) {
  return detail::load_driver(why) != nullptr;
}

namespace {
// The device's primary context, current on the calling thread while this object lives; the
// CUDA runtime (torch) uses the same context, so pointers and streams are shared with it.
class PrimaryContext {
 public:
  PrimaryContext(const Driver& d, CUdevice dev) : d_(d), dev_(dev) {
    CU_CHECK(d_, cuDevicePrimaryCtxRetain(&ctx_, dev_));
    make_current();
  }
  ~PrimaryContext() { d_.cuDevicePrimaryCtxRelease(dev_); }
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  void make_current() const { CU_CHECK(d_, cuCtxSetCurrent(ctx_)); }

 private:
  const Driver& d_;
  CUdevice dev_;
  CUcontext ctx_ = nullptr;
};

CUmemAllocationProp allocation_prop(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// A reserved and mapped range of one allocation handle, readable and writable from `dev`.
struct Mapping {
  const Driver* d = nullptr;
  CUdeviceptr ptr = 0;
  uint64_t size = 0;
  bool mapped = false;

  void map(const Driver& drv, CUmemGenericAllocationHandle handle, uint64_t bytes, CUdevice dev) {
    d = &drv;
    size = bytes;
    CU_CHECK(drv, cuMemAddressReserve(&ptr, bytes, 0, 0, 0));
    CU_CHECK(drv, cuMemMap(ptr, bytes, 0, handle, 0));
    mapped = true;
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_CHECK(drv, cuMemSetAccess(ptr, bytes, &access, 1));
  }
  ~Mapping() {
    if (d == nullptr || ptr == 0) return;
    if (mapped) d->cuMemUnmap(ptr, size);
    d->cuMemAddressFree(ptr, size);
  }
};
}  // namespace

struct ExportedBuffer::Impl {
  std::shared_ptr<const Driver> d = detail::require_driver();
  CUdevice dev = 0;
  std::unique_ptr<PrimaryContext> ctx;
  CUmemGenericAllocationHandle handle = 0;
  bool have_handle = false;
  int fd = -1;
  uint64_t bytes = 0;
  Mapping mapping;
  CUstream side = nullptr;
  CUevent after_compute = nullptr;  // recorded on the caller's stream before the copy
  CUevent done = nullptr;           // interprocess: recorded after the copy
  std::string bus_id;
  std::string event_handle;
  bool copied = false;

  ~Impl() {
    if (side != nullptr) {
      d->cuStreamSynchronize(side);
      d->cuStreamDestroy(side);
    }
    if (done != nullptr) d->cuEventDestroy(done);
    if (after_compute != nullptr) d->cuEventDestroy(after_compute);
    // Released while still mapped: the memory goes when `mapping` (destroyed after this body)
    // unmaps it and every importer has released its own handle.
    if (have_handle) d->cuMemRelease(handle);
    if (fd >= 0) ::close(fd);
  }
};

ExportedBuffer::ExportedBuffer(int ordinal, uint64_t bytes) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  const Driver& d = *s.d;
  MEGACPP_CHECK(bytes > 0, ErrorKind::kInvalidArgument, "a device staging buffer needs bytes");
  CU_CHECK(d, cuDeviceGet(&s.dev, ordinal));
  s.ctx = std::make_unique<PrimaryContext>(d, s.dev);
  const CUmemAllocationProp prop = allocation_prop(s.dev);
  size_t granularity = 0;
  CU_CHECK(
      d, cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  const uint64_t size = (bytes + granularity - 1) / granularity * granularity;
  CU_CHECK(d, cuMemCreate(&s.handle, size, &prop, 0));
  s.have_handle = true;
  CU_CHECK(d, cuMemExportToShareableHandle(&s.fd, s.handle,
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  s.mapping.map(d, s.handle, size, s.dev);
  s.bytes = bytes;
  CU_CHECK(d, cuStreamCreate(&s.side, CU_STREAM_NON_BLOCKING));
  CU_CHECK(d, cuEventCreate(&s.after_compute, CU_EVENT_DISABLE_TIMING));
  CU_CHECK(d, cuEventCreate(&s.done, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS));
  CUipcEventHandle h{};
  CU_CHECK(d, cuIpcGetEventHandle(&h, s.done));
  s.event_handle.assign(h.reserved, sizeof h.reserved);
  char bus[32] = {};
  CU_CHECK(d, cuDeviceGetPCIBusId(bus, sizeof bus, s.dev));
  s.bus_id = bus;
}

ExportedBuffer::~ExportedBuffer() = default;

int ExportedBuffer::fd() const noexcept {
  return impl_->fd;
}
uint64_t ExportedBuffer::bytes() const noexcept {
  return impl_->bytes;
}
uint64_t ExportedBuffer::mapping_bytes() const noexcept {
  return impl_->mapping.size;
}
const std::string& ExportedBuffer::pci_bus_id() const noexcept {
  return impl_->bus_id;
}
const std::string& ExportedBuffer::event_handle() const noexcept {
  return impl_->event_handle;
}
void* ExportedBuffer::device_pointer() const noexcept {
  return reinterpret_cast<void*>(impl_->mapping.ptr);
}

void ExportedBuffer::copy_async(void* stream, std::span<const CopyPiece> pieces) {
  Impl& s = *impl_;
  const Driver& d = *s.d;
  s.ctx->make_current();
  auto* compute = static_cast<CUstream>(stream);
  for (const CopyPiece& p : pieces) {
    MEGACPP_CHECK(p.offset <= s.bytes && p.bytes <= s.bytes - p.offset, ErrorKind::kInternal,
                  fmt::format("a {}-byte piece at {} overruns the {}-byte device staging buffer",
                              p.bytes, p.offset, s.bytes));
  }
  CU_CHECK(d, cuEventRecord(s.after_compute, compute));
  CU_CHECK(d, cuStreamWaitEvent(s.side, s.after_compute, 0));
  for (const CopyPiece& p : pieces) {
    if (p.bytes == 0) continue;
    CU_CHECK(d, cuMemcpyDtoDAsync(s.mapping.ptr + p.offset, reinterpret_cast<CUdeviceptr>(p.src),
                                  p.bytes, s.side));
  }
  CU_CHECK(d, cuEventRecord(s.done, s.side));
  s.copied = true;
}

void ExportedBuffer::order_after_copy(void* stream) {
  Impl& s = *impl_;
  if (!s.copied) return;
  s.ctx->make_current();
  CU_CHECK(*s.d, cuStreamWaitEvent(static_cast<CUstream>(stream), s.done, 0));
}

void ExportedBuffer::synchronize() {
  Impl& s = *impl_;
  s.ctx->make_current();
  CU_CHECK(*s.d, cuStreamSynchronize(s.side));
}

void ExportedBuffer::read(std::span<std::byte> dst) {
  Impl& s = *impl_;
  MEGACPP_CHECK(
      dst.size() <= s.bytes, ErrorKind::kInternal,
      fmt::format("reading {} bytes of a {}-byte device staging buffer", dst.size(), s.bytes));
  synchronize();
  if (!dst.empty()) CU_CHECK(*s.d, cuMemcpyDtoH(dst.data(), s.mapping.ptr, dst.size()));
}

struct ImportedBuffer::Impl {
  std::shared_ptr<const Driver> d = detail::require_driver();
  CUdevice dev = 0;
  std::unique_ptr<PrimaryContext> ctx;
  CUmemGenericAllocationHandle handle = 0;
  bool have_handle = false;
  Mapping mapping;
  CUevent rank_done = nullptr;  // the rank's event, opened here
  CUstream stream = nullptr;
  CUevent copied = nullptr;
  void* host = nullptr;  // page-locked, host_bytes long
  uint64_t host_bytes = 0;

  ~Impl() {
    if (stream != nullptr) {
      d->cuStreamSynchronize(stream);
      d->cuStreamDestroy(stream);
    }
    if (copied != nullptr) d->cuEventDestroy(copied);
    if (rank_done != nullptr) d->cuEventDestroy(rank_done);
    if (host != nullptr) d->cuMemFreeHost(host);
    if (have_handle) d->cuMemRelease(handle);
  }
};

ImportedBuffer::ImportedBuffer(int fd, uint64_t mapping_bytes, std::string_view pci_bus_id,
                               std::string_view event_handle)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  const Driver& d = *s.d;
  CUipcEventHandle h{};
  MEGACPP_CHECK(event_handle.size() == sizeof h.reserved, ErrorKind::kProtocol,
                fmt::format("an IPC event handle of {} bytes (the driver's are {})",
                            event_handle.size(), sizeof h.reserved));
  const std::string bus(pci_bus_id);
  if (const CUresult r = d.cuDeviceGetByPCIBusId(&s.dev, bus.c_str()); r != CUDA_SUCCESS) {
    MEGACPP_FAIL(ErrorKind::kSystem,
                 "the rank's staging buffer lies on device {}, which this process cannot see ({}): "
                 "give the checkpointer every device of its node (CUDA_VISIBLE_DEVICES)",
                 bus, detail::cu_error_text(d, r));
  }
  s.ctx = std::make_unique<PrimaryContext>(d, s.dev);
  CU_CHECK(d, cuMemImportFromShareableHandle(&s.handle,
                                             reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  s.have_handle = true;
  s.mapping.map(d, s.handle, mapping_bytes, s.dev);
  std::memcpy(h.reserved, event_handle.data(), sizeof h.reserved);
  CU_CHECK(d, cuIpcOpenEventHandle(&s.rank_done, h));
  CU_CHECK(d, cuStreamCreate(&s.stream, CU_STREAM_NON_BLOCKING));
  CU_CHECK(d, cuEventCreate(&s.copied, CU_EVENT_DISABLE_TIMING));
}

ImportedBuffer::~ImportedBuffer() = default;

std::span<const std::byte> ImportedBuffer::copy_to_host(uint64_t bytes,
                                                        std::chrono::milliseconds timeout,
                                                        const std::function<bool()>& abandon) {
  Impl& s = *impl_;
  const Driver& d = *s.d;
  if (bytes == 0) return {};  // an empty share: nothing to wait for or copy
  MEGACPP_CHECK(
      bytes <= s.mapping.size, ErrorKind::kProtocol,
      fmt::format("a {}-byte snapshot in a {}-byte device staging buffer", bytes, s.mapping.size));
  s.ctx->make_current();
  if (s.host_bytes < bytes) {
    if (s.host != nullptr) d.cuMemFreeHost(s.host);
    s.host = nullptr;
    s.host_bytes = 0;
    CU_CHECK(d, cuMemHostAlloc(&s.host, bytes, 0));
    s.host_bytes = bytes;
  }
  CU_CHECK(d, cuStreamWaitEvent(s.stream, s.rank_done, 0));
  CU_CHECK(d, cuMemcpyDtoHAsync(s.host, s.mapping.ptr, bytes, s.stream));
  CU_CHECK(d, cuEventRecord(s.copied, s.stream));
  // Polled rather than synchronised: a rank that died with its copy queued must not hold this
  // process forever.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto nap = std::chrono::microseconds(20);;
       nap = std::min(nap * 2, std::chrono::microseconds(2000))) {
    const CUresult r = d.cuEventQuery(s.copied);
    if (r == CUDA_SUCCESS) break;
    if (r != CUDA_ERROR_NOT_READY) CU_CHECK(d, cuEventQuery(s.copied));
    if ((abandon && abandon()) || std::chrono::steady_clock::now() >= deadline) return {};
    std::this_thread::sleep_for(nap);
  }
  return {static_cast<const std::byte*>(s.host), bytes};
}

struct DeviceBlock::Impl {
  std::shared_ptr<const Driver> d = detail::require_driver();
  CUdevice dev = 0;
  std::unique_ptr<PrimaryContext> ctx;
  CUdeviceptr ptr = 0;
  uint64_t bytes = 0;
  ~Impl() {
    if (ptr != 0) d->cuMemFree(ptr);
  }
};

DeviceBlock::DeviceBlock(int ordinal, uint64_t bytes) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  CU_CHECK(*s.d, cuDeviceGet(&s.dev, ordinal));
  s.ctx = std::make_unique<PrimaryContext>(*s.d, s.dev);
  CU_CHECK(*s.d, cuMemAlloc(&s.ptr, bytes));
  s.bytes = bytes;
}

DeviceBlock::~DeviceBlock() = default;

void* DeviceBlock::pointer() const noexcept {
  return reinterpret_cast<void*>(impl_->ptr);
}

void DeviceBlock::upload(std::span<const std::byte> bytes) {
  Impl& s = *impl_;
  MEGACPP_CHECK(bytes.size() <= s.bytes, ErrorKind::kInvalidArgument,
                fmt::format("{} bytes for a {}-byte device block", bytes.size(), s.bytes));
  s.ctx->make_current();
  CU_CHECK(*s.d, cuMemcpyHtoD(s.ptr, bytes.data(), bytes.size()));
}

#else  // !MEGACPP_HAVE_CUDA_H

namespace {
[[noreturn]] void unbuilt() {
  MEGACPP_FAIL(ErrorKind::kInvalidArgument,
               "this build of megacpp has no CUDA headers (cuda.h): snapshots cannot be staged on "
               "a device; rebuild where the CUDA toolkit or the torch wheel's headers are found");
}
}  // namespace

struct ExportedBuffer::Impl {};
struct ImportedBuffer::Impl {};
struct DeviceBlock::Impl {};

bool built() noexcept {
  return false;
}
bool driver_available(std::string* why) {
  if (why != nullptr) *why = "this build has no CUDA headers";
  return false;
}
ExportedBuffer::ExportedBuffer(int, uint64_t) {
  unbuilt();
}
ExportedBuffer::~ExportedBuffer() = default;
int ExportedBuffer::fd() const noexcept {
  return -1;
}
uint64_t ExportedBuffer::bytes() const noexcept {
  return 0;
}
uint64_t ExportedBuffer::mapping_bytes() const noexcept {
  return 0;
}
const std::string& ExportedBuffer::pci_bus_id() const noexcept {
  static const std::string none;
  return none;
}
const std::string& ExportedBuffer::event_handle() const noexcept {
  return pci_bus_id();
}
void* ExportedBuffer::device_pointer() const noexcept {
  return nullptr;
}
void ExportedBuffer::copy_async(void*, std::span<const CopyPiece>) {
  unbuilt();
}
void ExportedBuffer::order_after_copy(void*) {
  unbuilt();
}
void ExportedBuffer::synchronize() {
  unbuilt();
}
void ExportedBuffer::read(std::span<std::byte>) {
  unbuilt();
}
ImportedBuffer::ImportedBuffer(int, uint64_t, std::string_view, std::string_view) {
  unbuilt();
}
ImportedBuffer::~ImportedBuffer() = default;
std::span<const std::byte> ImportedBuffer::copy_to_host(uint64_t, std::chrono::milliseconds,
                                                        const std::function<bool()>&) {
  unbuilt();
}

DeviceBlock::DeviceBlock(int, uint64_t) {
  unbuilt();
}
DeviceBlock::~DeviceBlock() = default;
void* DeviceBlock::pointer() const noexcept {
  return nullptr;
}
void DeviceBlock::upload(std::span<const std::byte>) {
  unbuilt();
}

#endif

}  // namespace megacpp::gpu
