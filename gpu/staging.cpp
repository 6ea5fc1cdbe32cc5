// Device staging through the CUDA virtual-memory API and an IPC event (staging.h).
#include "gpu/staging.h"

#include <cstring>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "core/fd.h"

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
// The device's primary context, retained while this object lives; the CUDA runtime (torch)
// uses the same context, so pointers and streams are shared with it. Every driver call of an
// owner runs with it current on the calling thread (make_current), releases included: an owner
// may be destroyed on another thread than the one that made it.
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
  // For destructors: a failure leaves the releases that follow to report nothing either.
  void make_current_noexcept() const noexcept { d_.cuCtxSetCurrent(ctx_); }

 private:
  const Driver& d_;
  CUdevice dev_;
  CUcontext ctx_ = nullptr;
};

// Owns one driver object of type T (or none) and gives it back through `Release` when
// destroyed; movable, not copyable. The release's status is dropped: a destructor must not
// throw and the object is gone either way. The Driver outlives it (each owner's Impl holds the
// table's shared_ptr before its handles).
template <typename T, void (*Release)(const Driver&, T) noexcept>
class Owned {
 public:
  Owned() noexcept = default;
  Owned(const Driver& d, T handle) noexcept : d_(&d), h_(handle) {}
  ~Owned() { reset(); }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  Owned(Owned&& other) noexcept : d_(std::exchange(other.d_, nullptr)), h_(other.h_) {}
  Owned& operator=(Owned&& other) noexcept {
    if (this != &other) {
      reset();
      d_ = std::exchange(other.d_, nullptr);
      h_ = other.h_;
    }
    return *this;
  }
  T get() const noexcept { return h_; }
  explicit operator bool() const noexcept { return d_ != nullptr; }
  void reset() noexcept {
    if (d_ != nullptr) Release(*std::exchange(d_, nullptr), h_);
  }

 private:
  const Driver* d_ = nullptr;  // null: owns nothing
  T h_{};
};

// A stream's work is waited for before it goes: the memory its copies touch is released after
// it (declared before it in each Impl). Its work never waits on another process (copy_to_host
// polls the rank's event on the host first), so this wait ends.
void release_stream(const Driver& d, CUstream s) noexcept {
  d.cuStreamSynchronize(s);
  d.cuStreamDestroy(s);
}
void release_event(const Driver& d, CUevent e) noexcept {
  d.cuEventDestroy(e);
}
// The physical memory goes when the last handle (the exporter's, each importer's) is released
// and the last mapping of it is unmapped, whatever the order.
void release_allocation(const Driver& d, CUmemGenericAllocationHandle h) noexcept {
  d.cuMemRelease(h);
}
void release_host(const Driver& d, void* p) noexcept {
  d.cuMemFreeHost(p);
}
void release_device(const Driver& d, CUdeviceptr p) noexcept {
  d.cuMemFree(p);
}

using Stream = Owned<CUstream, release_stream>;
using Event = Owned<CUevent, release_event>;
using Allocation = Owned<CUmemGenericAllocationHandle, release_allocation>;
using HostMemory = Owned<void*, release_host>;
using DeviceMemory = Owned<CUdeviceptr, release_device>;

Stream make_stream(const Driver& d) {
  CUstream s = nullptr;
  CU_CHECK(d, cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  return {d, s};
}
Event make_event(const Driver& d, unsigned flags) {
  CUevent e = nullptr;
  CU_CHECK(d, cuEventCreate(&e, flags));
  return {d, e};
}

CUmemAllocationProp allocation_prop(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// A reserved address range with one allocation mapped into it, readable and writable from
// `dev`; unmapped and given back when destroyed (a range reserved whose map failed is given
// back too). Not movable: the owners hold it in place.
class Mapping {
 public:
  Mapping() noexcept = default;
  ~Mapping() {
    if (d_ == nullptr) return;
    if (mapped_) d_->cuMemUnmap(ptr_, size_);
    d_->cuMemAddressFree(ptr_, size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  // Once per object.
  void map(const Driver& d, CUmemGenericAllocationHandle handle, uint64_t bytes, CUdevice dev) {
    CU_CHECK(d, cuMemAddressReserve(&ptr_, bytes, 0, 0, 0));
    d_ = &d;
    size_ = bytes;
    CU_CHECK(d, cuMemMap(ptr_, bytes, 0, handle, 0));
    mapped_ = true;
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_CHECK(d, cuMemSetAccess(ptr_, bytes, &access, 1));
  }
  CUdeviceptr ptr() const noexcept { return ptr_; }
  uint64_t size() const noexcept { return size_; }

 private:
  const Driver* d_ = nullptr;  // set once the range is reserved
  CUdeviceptr ptr_ = 0;
  uint64_t size_ = 0;
  bool mapped_ = false;
};
}  // namespace

// Members are destroyed in reverse order: the stream (its copies waited for) and the events
// first, then the mapping, the allocation and its descriptor, the context last. The destructor's
// body makes the context current for all of them.
struct ExportedBuffer::Impl {
  std::shared_ptr<const Driver> d = detail::require_driver();
  CUdevice dev = 0;
  std::unique_ptr<PrimaryContext> ctx;
  Fd fd;  // the allocation exported
  Allocation handle;
  Mapping mapping;
  uint64_t bytes = 0;
  Event after_compute;  // recorded on the caller's stream before the copy
  Event done;           // interprocess: recorded after the copy
  Stream side;
  std::string bus_id;
  std::string event_handle;
  bool copied = false;

  ~Impl() {
    if (ctx) ctx->make_current_noexcept();
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
  const uint64_t sealed = seal_offset(bytes) + kSealBytes;
  const uint64_t size = (sealed + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle = 0;
  CU_CHECK(d, cuMemCreate(&handle, size, &prop, 0));
  s.handle = Allocation(d, handle);
  int fd = -1;
  CU_CHECK(d,
           cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  s.fd.reset(fd);
  s.mapping.map(d, handle, size, s.dev);
  s.bytes = bytes;
  s.side = make_stream(d);
  // Unsealed until a copy completes: the allocation's bytes are undefined.
  CU_CHECK(d, cuMemsetD32Async(s.mapping.ptr() + seal_offset(bytes), 0xffffffffu, kSealBytes / 4,
                               s.side.get()));
  s.after_compute = make_event(d, CU_EVENT_DISABLE_TIMING);
  s.done = make_event(d, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
  CUipcEventHandle h{};
  CU_CHECK(d, cuIpcGetEventHandle(&h, s.done.get()));
  s.event_handle.assign(h.reserved, sizeof h.reserved);
  char bus[32] = {};
  CU_CHECK(d, cuDeviceGetPCIBusId(bus, sizeof bus, s.dev));
  s.bus_id = bus;
}

ExportedBuffer::~ExportedBuffer() = default;

int ExportedBuffer::fd() const noexcept {
  return impl_->fd.get();
}
uint64_t ExportedBuffer::bytes() const noexcept {
  return impl_->bytes;
}
uint64_t ExportedBuffer::mapping_bytes() const noexcept {
  return impl_->mapping.size();
}
const std::string& ExportedBuffer::pci_bus_id() const noexcept {
  return impl_->bus_id;
}
const std::string& ExportedBuffer::event_handle() const noexcept {
  return impl_->event_handle;
}
void* ExportedBuffer::device_pointer() const noexcept {
  return reinterpret_cast<void*>(impl_->mapping.ptr());
}

void ExportedBuffer::copy_async(void* stream, std::span<const CopyPiece> pieces, uint64_t seal) {
  Impl& s = *impl_;
  const Driver& d = *s.d;
  MEGACPP_CHECK(seal != kNoSeal, ErrorKind::kInternal, "a staging copy sealed as no copy");
  s.ctx->make_current();
  auto* compute = static_cast<CUstream>(stream);
  for (const CopyPiece& p : pieces) {
    MEGACPP_CHECK(p.offset <= s.bytes && p.bytes <= s.bytes - p.offset, ErrorKind::kInternal,
                  fmt::format("a {}-byte piece at {} overruns the {}-byte device staging buffer",
                              p.bytes, p.offset, s.bytes));
  }
  CU_CHECK(d, cuEventRecord(s.after_compute.get(), compute));
  CU_CHECK(d, cuStreamWaitEvent(s.side.get(), s.after_compute.get(), 0));
  for (const CopyPiece& p : pieces) {
    if (p.bytes == 0) continue;
    CU_CHECK(d, cuMemcpyDtoDAsync(s.mapping.ptr() + p.offset, reinterpret_cast<CUdeviceptr>(p.src),
                                  p.bytes, s.side.get()));
  }
  // The seal after the copies on the same stream: written only if they ran.
  const CUdeviceptr at = s.mapping.ptr() + seal_offset(s.bytes);
  CU_CHECK(d, cuMemsetD32Async(at, static_cast<unsigned>(seal), 1, s.side.get()));
  CU_CHECK(d, cuMemsetD32Async(at + 4, static_cast<unsigned>(seal >> 32), 1, s.side.get()));
  CU_CHECK(d, cuEventRecord(s.done.get(), s.side.get()));
  s.copied = true;
}

void ExportedBuffer::order_after_copy(void* stream) {
  Impl& s = *impl_;
  if (!s.copied) return;
  s.ctx->make_current();
  CU_CHECK(*s.d, cuStreamWaitEvent(static_cast<CUstream>(stream), s.done.get(), 0));
}

void ExportedBuffer::synchronize() {
  Impl& s = *impl_;
  s.ctx->make_current();
  CU_CHECK(*s.d, cuStreamSynchronize(s.side.get()));
}

void ExportedBuffer::read(std::span<std::byte> dst) {
  Impl& s = *impl_;
  MEGACPP_CHECK(
      dst.size() <= s.bytes, ErrorKind::kInternal,
      fmt::format("reading {} bytes of a {}-byte device staging buffer", dst.size(), s.bytes));
  synchronize();
  if (!dst.empty()) CU_CHECK(*s.d, cuMemcpyDtoH(dst.data(), s.mapping.ptr(), dst.size()));
}

// Destroyed in reverse order: the stream (its copy waited for), the events, the host memory the
// copy wrote, the mapping, the imported handle, the context last.
struct ImportedBuffer::Impl {
  std::shared_ptr<const Driver> d = detail::require_driver();
  CUdevice dev = 0;
  std::unique_ptr<PrimaryContext> ctx;
  Allocation handle;
  Mapping mapping;
  uint64_t bytes = 0;  // usable, the seal after them
  HostMemory host;     // page-locked: host_bytes, then the seal's copy
  uint64_t host_bytes = 0;
  Event rank_done;  // the rank's event, opened here
  Event copied;
  bool in_flight = false;  // `copied` recorded and not yet seen complete
  Stream stream;

  ~Impl() {
    if (ctx) ctx->make_current_noexcept();
  }
};

ImportedBuffer::ImportedBuffer(int fd, uint64_t bytes, uint64_t mapping_bytes,
                               std::string_view pci_bus_id, std::string_view event_handle)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  const Driver& d = *s.d;
  MEGACPP_CHECK(bytes <= mapping_bytes && seal_offset(bytes) + kSealBytes <= mapping_bytes,
                ErrorKind::kProtocol,
                fmt::format("a {}-byte staging buffer and its seal in a {}-byte allocation", bytes,
                            mapping_bytes));
  s.bytes = bytes;
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
  CUmemGenericAllocationHandle handle = 0;
  CU_CHECK(d, cuMemImportFromShareableHandle(&handle,
                                             reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  s.handle = Allocation(d, handle);
  s.mapping.map(d, handle, mapping_bytes, s.dev);
  std::memcpy(h.reserved, event_handle.data(), sizeof h.reserved);
  CUevent rank_done = nullptr;
  CU_CHECK(d, cuIpcOpenEventHandle(&rank_done, h));
  s.rank_done = Event(d, rank_done);
  s.stream = make_stream(d);
  s.copied = make_event(d, CU_EVENT_DISABLE_TIMING);
}

ImportedBuffer::~ImportedBuffer() = default;

namespace {
// Polls `event` on the host until it completes (true), or `abandon()` turns true or `deadline`
// passes (false). Errors other than "not ready" throw.
bool poll_event(const Driver& d, CUevent event, std::chrono::steady_clock::time_point deadline,
                const std::function<bool()>& abandon) {
  for (auto nap = std::chrono::microseconds(20);;
       nap = std::min(nap * 2, std::chrono::microseconds(2000))) {
    const CUresult r = d.cuEventQuery(event);
    if (r == CUDA_SUCCESS) return true;
    if (r != CUDA_ERROR_NOT_READY) {
      // A dead rank may leave its event in error: that is its death, not this process's failure.
      if (abandon && abandon()) return false;
      CU_CHECK(d, cuEventQuery(event));
    }
    if ((abandon && abandon()) || std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(nap);
  }
}
}  // namespace

ImportedBuffer::HostCopy ImportedBuffer::copy_to_host(uint64_t bytes, uint64_t seal,
                                                      std::chrono::milliseconds timeout,
                                                      const std::function<bool()>& abandon) {
  using Status = HostCopy::Status;
  Impl& s = *impl_;
  const Driver& d = *s.d;
  MEGACPP_CHECK(
      bytes <= s.bytes, ErrorKind::kProtocol,
      fmt::format("a {}-byte snapshot in a {}-byte device staging buffer", bytes, s.bytes));
  s.ctx->make_current();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // The rank's copy is waited for on the host, not with cuStreamWaitEvent: a rank that dies with
  // its copy queued may leave its event never completing, and a stream of this process waiting
  // on it would hold this process (and the release of the stream) forever.
  if (!poll_event(d, s.rank_done.get(), deadline, abandon)) return {};
  // An earlier copy abandoned by its deadline may still be writing the host memory: it ends
  // (it waits for nothing else), and nothing reuses or frees that memory before.
  if (s.in_flight) {
    CU_CHECK(d, cuEventSynchronize(s.copied.get()));
    s.in_flight = false;
  }
  if (!s.host || s.host_bytes < bytes) {
    s.host.reset();
    s.host_bytes = 0;
    void* host = nullptr;
    CU_CHECK(d, cuMemHostAlloc(&host, seal_offset(bytes) + kSealBytes, 0));
    s.host = HostMemory(d, host);
    s.host_bytes = bytes;
  }
  auto* host = static_cast<std::byte*>(s.host.get());
  std::byte* host_seal = host + seal_offset(s.host_bytes);
  if (bytes > 0) CU_CHECK(d, cuMemcpyDtoHAsync(host, s.mapping.ptr(), bytes, s.stream.get()));
  CU_CHECK(d, cuMemcpyDtoHAsync(host_seal, s.mapping.ptr() + seal_offset(s.bytes), kSealBytes,
                                s.stream.get()));
  CU_CHECK(d, cuEventRecord(s.copied.get(), s.stream.get()));
  s.in_flight = true;
  // This process's own copy: it ends (the memory stays while imported, whatever the rank does);
  // polled so that `abandon` can still end the wait early.
  if (!poll_event(d, s.copied.get(), deadline, abandon)) return {};
  s.in_flight = false;
  uint64_t found = 0;
  std::memcpy(&found, host_seal, sizeof found);
  if (found != seal) return {Status::kUnsealed, {}, found};
  return {Status::kOk, {host, bytes}, found};
}

// The memory, then the context.
struct DeviceBlock::Impl {
  std::shared_ptr<const Driver> d = detail::require_driver();
  CUdevice dev = 0;
  std::unique_ptr<PrimaryContext> ctx;
  DeviceMemory memory;
  uint64_t bytes = 0;
  ~Impl() {
    if (ctx) ctx->make_current_noexcept();
  }
};

DeviceBlock::DeviceBlock(int ordinal, uint64_t bytes) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  CU_CHECK(*s.d, cuDeviceGet(&s.dev, ordinal));
  s.ctx = std::make_unique<PrimaryContext>(*s.d, s.dev);
  CUdeviceptr ptr = 0;
  CU_CHECK(*s.d, cuMemAlloc(&ptr, bytes));
  s.memory = DeviceMemory(*s.d, ptr);
  s.bytes = bytes;
}

DeviceBlock::~DeviceBlock() = default;

void* DeviceBlock::pointer() const noexcept {
  return reinterpret_cast<void*>(impl_->memory.get());
}

void DeviceBlock::upload(std::span<const std::byte> bytes) {
  Impl& s = *impl_;
  MEGACPP_CHECK(bytes.size() <= s.bytes, ErrorKind::kInvalidArgument,
                fmt::format("{} bytes for a {}-byte device block", bytes.size(), s.bytes));
  s.ctx->make_current();
  CU_CHECK(*s.d, cuMemcpyHtoD(s.memory.get(), bytes.data(), bytes.size()));
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
void ExportedBuffer::copy_async(void*, std::span<const CopyPiece>, uint64_t) {
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
ImportedBuffer::ImportedBuffer(int, uint64_t, uint64_t, std::string_view, std::string_view) {
  unbuilt();
}
ImportedBuffer::~ImportedBuffer() = default;
ImportedBuffer::HostCopy ImportedBuffer::copy_to_host(uint64_t, uint64_t, std::chrono::milliseconds,
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
