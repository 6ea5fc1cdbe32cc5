// A fake CUDA driver (libcuda.so.1) on host memory, for running gpu/staging.h's real code on a
// machine without a GPU: gpu_staging_test runs against it in the unit tests (ctest
// gpu_staging_on_fake_driver puts this library first on LD_LIBRARY_PATH), and against the real
// driver, unchanged, on a GPU machine (label gpu).
//
// What it models of the driver, and only that: the entry points megacpp loads
// (gpu/driver.h MEGACPP_CU_FUNCTIONS), with their signatures checked against cuda.h. One device
// (ordinal 0, bus id 0000:00:00.0) with a 2 MiB granularity; allocations are memfds, exported
// as duplicates of their descriptor and mapped with MAP_FIXED into reserved ranges; "device"
// pointers are host addresses. Work is done when issued (every stream is synchronous), except
// what an interprocess event stands for: its record count and completion count live in a shared
// memory file named by the event's IPC handle, so another process sees whether the copy before
// a record is done; a stream made to wait on such an event before it completes is held (its
// later events stay incomplete and its synchronisation blocks) until it does, as on a device. Calls
// that need a context fail with CUDA_ERROR_INVALID_CONTEXT when the calling thread has none
// current, as the driver's do.
//
// Faults, for the failure paths (read at each call, so a test sets them around one step):
//   MEGACPP_FAKE_CUDA_HOLD=1       interprocess events recorded now never complete (a copy
//                                  that never ends: the rank died or hung with it queued)
//   MEGACPP_FAKE_CUDA_FAIL=<entry> that entry point fails (cuMemHostAlloc: out of memory; any
//                                  other: CUDA_ERROR_UNKNOWN)
//   MEGACPP_FAKE_CUDA_DROP=1       asynchronous copies and sets issued now never run while their
//                                  events complete (a context torn down with its work queued,
//                                  reported done: what the driver does then is undocumented)
//
// A driver is process-wide state: the tables below are this library's, behind one mutex.
#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

// What holds a stream back: an interprocess event's completion count reaching `target`.
struct Blocker {
  std::atomic<uint64_t>* counters = nullptr;  // null: nothing
  uint64_t target = 0;
  bool done() const { return counters == nullptr || counters[1].load() >= target; }
};

struct CUctx_st {};
struct CUstream_st {
  Blocker blocker;  // set by a wait on an interprocess event not yet complete
};
struct CUevent_st {
  unsigned flags = 0;
  // Interprocess: the counters in a shared file (`name`); owner: this process made it. Mapped
  // for the life of the process (a stream may still be held by them after the event goes).
  std::string name;
  bool owner = false;
  std::atomic<uint64_t>* counters = nullptr;  // [0] recorded, [1] completed
  Blocker blocker;                            // a local event recorded on a held stream
};

namespace {

constexpr size_t kGranularity = size_t{2} << 20;
constexpr const char* kBusId = "0000:00:00.0";

struct Allocation {
  int fd = -1;
  size_t size = 0;
};

struct State {
  std::mutex mu;
  CUctx_st context;
  int retained = 0;
  uint64_t next_handle = 1;
  uint64_t next_event = 1;
  std::map<CUmemGenericAllocationHandle, Allocation> allocations;
  std::map<CUstream, std::unique_ptr<CUstream_st>> streams;
  std::map<CUevent, std::unique_ptr<CUevent_st>> events;
};

State& state() {
  static State s;
  return s;
}

thread_local CUcontext current = nullptr;

// Files `object` in its table (which owns it) and returns the handle the caller gets.
template <typename T>
T* keep(std::map<T*, std::unique_ptr<T>>& table, std::unique_ptr<T> object) {
  T* handle = object.get();
  std::lock_guard lock(state().mu);
  table[handle] = std::move(object);
  return handle;
}

bool failing(const char* entry) {
  const char* f = std::getenv("MEGACPP_FAKE_CUDA_FAIL");
  return f != nullptr && std::strcmp(f, entry) == 0;
}

bool dropping() {
  const char* h = std::getenv("MEGACPP_FAKE_CUDA_DROP");
  return h != nullptr && std::strcmp(h, "1") == 0;
}

bool holding() {
  const char* h = std::getenv("MEGACPP_FAKE_CUDA_HOLD");
  return h != nullptr && std::strcmp(h, "1") == 0;
}

// The checks every entry point that needs a context makes first.
#define FAKE_ENTRY(name)                                                          \
  do {                                                                            \
    if (failing(#name))                                                           \
      return std::strcmp(#name, "cuMemHostAlloc") == 0 ? CUDA_ERROR_OUT_OF_MEMORY \
                                                       : CUDA_ERROR_UNKNOWN;      \
    if (current == nullptr) return CUDA_ERROR_INVALID_CONTEXT;                    \
  } while (0)

std::atomic<uint64_t>* map_counters(int fd) {
  void* p = ::mmap(nullptr, 2 * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<std::atomic<uint64_t>*>(p);
}

}  // namespace

extern "C" {

CUresult CUDAAPI cuInit(unsigned int) {
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int* version) {
  *version = CUDA_VERSION;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char** text) {
  switch (error) {
    case CUDA_SUCCESS:
      *text = "no error";
      break;
    case CUDA_ERROR_INVALID_VALUE:
      *text = "invalid argument";
      break;
    case CUDA_ERROR_OUT_OF_MEMORY:
      *text = "out of memory";
      break;
    case CUDA_ERROR_INVALID_CONTEXT:
      *text = "invalid device context";
      break;
    case CUDA_ERROR_INVALID_DEVICE:
      *text = "invalid device ordinal";
      break;
    case CUDA_ERROR_NOT_READY:
      *text = "device not ready";
      break;
    default:
      *text = "unknown error (fake driver)";
      break;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *device = 0;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetByPCIBusId(CUdevice* device, const char* bus) {
  if (std::strcmp(bus, kBusId) != 0) return CUDA_ERROR_INVALID_VALUE;
  *device = 0;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetPCIBusId(char* bus, int len, CUdevice device) {
  if (device != 0 || len < 13) return CUDA_ERROR_INVALID_VALUE;
  std::snprintf(bus, static_cast<size_t>(len), "%s", kBusId);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice device) {
  if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard lock(state().mu);
  ++state().retained;
  *ctx = &state().context;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice device) {
  if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard lock(state().mu);
  if (state().retained == 0) return CUDA_ERROR_INVALID_CONTEXT;
  --state().retained;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
  current = ctx;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp*,
                                               CUmemAllocationGranularity_flags) {
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                             const CUmemAllocationProp* prop, unsigned long long) {
  FAKE_ENTRY(cuMemCreate);
  if (size == 0 || size % kGranularity != 0 || prop->location.id != 0)
    return CUDA_ERROR_INVALID_VALUE;
  const int fd = ::memfd_create("fake-cuda-allocation", MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    ::close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  std::lock_guard lock(state().mu);
  *handle = state().next_handle++;
  state().allocations[*handle] = {fd, size};
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  std::lock_guard lock(state().mu);
  auto it = state().allocations.find(handle);
  if (it == state().allocations.end()) return CUDA_ERROR_INVALID_VALUE;
  ::close(it->second.fd);
  state().allocations.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemExportToShareableHandle(void* shareable, CUmemGenericAllocationHandle handle,
                                              CUmemAllocationHandleType type, unsigned long long) {
  FAKE_ENTRY(cuMemExportToShareableHandle);
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(state().mu);
  auto it = state().allocations.find(handle);
  if (it == state().allocations.end()) return CUDA_ERROR_INVALID_VALUE;
  const int fd = ::fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(shareable) = fd;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* os,
                                                CUmemAllocationHandleType type) {
  FAKE_ENTRY(cuMemImportFromShareableHandle);
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
  const int given = static_cast<int>(reinterpret_cast<uintptr_t>(os));
  struct stat st {};
  // Only what cuMemCreate made: a memfd whose size is a granularity multiple.
  if (::fstat(given, &st) != 0 || st.st_size <= 0 ||
      static_cast<size_t>(st.st_size) % kGranularity != 0)
    return CUDA_ERROR_INVALID_VALUE;
  const int fd = ::fcntl(given, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard lock(state().mu);
  *handle = state().next_handle++;
  state().allocations[*handle] = {fd, static_cast<size_t>(st.st_size)};
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t, CUdeviceptr,
                                     unsigned long long) {
  FAKE_ENTRY(cuMemAddressReserve);
  if (size == 0 || size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  void* p = ::mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  return ::munmap(reinterpret_cast<void*>(ptr), size) == 0 ? CUDA_SUCCESS
                                                           : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                          CUmemGenericAllocationHandle handle, unsigned long long) {
  FAKE_ENTRY(cuMemMap);
  std::lock_guard lock(state().mu);
  auto it = state().allocations.find(handle);
  if (it == state().allocations.end() || size % kGranularity != 0 ||
      offset + size > it->second.size)
    return CUDA_ERROR_INVALID_VALUE;
  void* p = ::mmap(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED, it->second.fd, static_cast<off_t>(offset));
  return p == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  // Back to a reserved range, as the driver leaves it.
  void* p = ::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  return p == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc* desc, size_t count) {
  FAKE_ENTRY(cuMemSetAccess);
  if (count != 1 || desc->location.id != 0) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr* ptr, size_t bytes) {
  FAKE_ENTRY(cuMemAlloc);
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFree(CUdeviceptr ptr) {
  FAKE_ENTRY(cuMemFree);
  std::free(reinterpret_cast<void*>(ptr));
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostAlloc(void** p, size_t bytes, unsigned int) {
  FAKE_ENTRY(cuMemHostAlloc);
  *p = std::malloc(bytes == 0 ? 1 : bytes);
  return *p != nullptr ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult CUDAAPI cuMemFreeHost(void* p) {
  FAKE_ENTRY(cuMemFreeHost);
  std::free(p);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t bytes) {
  FAKE_ENTRY(cuMemcpyHtoD);
  std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t bytes) {
  FAKE_ENTRY(cuMemcpyDtoH);
  std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream) {
  FAKE_ENTRY(cuMemcpyDtoDAsync);
  if (dropping()) return CUDA_SUCCESS;
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t bytes, CUstream) {
  FAKE_ENTRY(cuMemcpyDtoHAsync);
  if (dropping()) return CUDA_SUCCESS;
  std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t count, CUstream) {
  FAKE_ENTRY(cuMemsetD32Async);
  if (dst % 4 != 0) return CUDA_ERROR_INVALID_VALUE;
  if (dropping()) return CUDA_SUCCESS;
  auto* p = reinterpret_cast<uint32_t*>(dst);
  for (size_t i = 0; i < count; ++i) p[i] = value;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreate(CUstream* stream, unsigned int) {
  FAKE_ENTRY(cuStreamCreate);
  *stream = keep(state().streams, std::make_unique<CUstream_st>());
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamDestroy(CUstream stream) {
  FAKE_ENTRY(cuStreamDestroy);
  std::lock_guard lock(state().mu);
  return state().streams.erase(stream) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult CUDAAPI cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int) {
  FAKE_ENTRY(cuStreamWaitEvent);
  // Local work is done when issued; only an interprocess event not yet complete holds the
  // stream (the copies issued meanwhile are done at once all the same: what is modelled is
  // completion, not the bytes).
  if (stream == nullptr || event->counters == nullptr) return CUDA_SUCCESS;
  const Blocker b{event->counters, event->counters[0].load()};
  if (!b.done()) stream->blocker = b;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamSynchronize(CUstream stream) {
  FAKE_ENTRY(cuStreamSynchronize);
  // As a device: waits for as long as the stream is held, forever if it always is.
  while (stream != nullptr && !stream->blocker.done()) ::usleep(1000);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventCreate(CUevent* event, unsigned int flags) {
  FAKE_ENTRY(cuEventCreate);
  // As the driver: an interprocess event must not take timings.
  if ((flags & CU_EVENT_INTERPROCESS) != 0 && (flags & CU_EVENT_DISABLE_TIMING) == 0)
    return CUDA_ERROR_INVALID_VALUE;
  auto e = std::make_unique<CUevent_st>();
  e->flags = flags;
  if ((flags & CU_EVENT_INTERPROCESS) != 0) {
    uint64_t n = 0;
    {
      std::lock_guard lock(state().mu);
      n = state().next_event++;
    }
    e->name = "/megacpp-fake-cuda-" + std::to_string(::getpid()) + "-" + std::to_string(n);
    const int fd = ::shm_open(e->name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    const bool sized = ::ftruncate(fd, 2 * sizeof(uint64_t)) == 0;
    e->counters = sized ? map_counters(fd) : nullptr;
    ::close(fd);
    if (e->counters == nullptr) {
      ::shm_unlink(e->name.c_str());
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    e->owner = true;
  }
  *event = keep(state().events, std::move(e));
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventDestroy(CUevent event) {
  FAKE_ENTRY(cuEventDestroy);
  std::lock_guard lock(state().mu);
  auto it = state().events.find(event);
  if (it == state().events.end()) return CUDA_ERROR_INVALID_HANDLE;
  CUevent_st& e = *it->second;
  if (e.owner) ::shm_unlink(e.name.c_str());
  state().events.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventRecord(CUevent event, CUstream stream) {
  FAKE_ENTRY(cuEventRecord);
  if (event->counters == nullptr) {
    event->blocker = stream != nullptr ? stream->blocker : Blocker{};
    return CUDA_SUCCESS;
  }
  if (!event->owner) return CUDA_ERROR_INVALID_HANDLE;  // an opened IPC event is only waited on
  const uint64_t n = event->counters[0].fetch_add(1) + 1;
  if (!holding()) event->counters[1].store(n);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventQuery(CUevent event) {
  FAKE_ENTRY(cuEventQuery);
  if (event->counters == nullptr)
    return event->blocker.done() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
  return event->counters[1].load() == event->counters[0].load() ? CUDA_SUCCESS
                                                                : CUDA_ERROR_NOT_READY;
}

CUresult CUDAAPI cuEventSynchronize(CUevent event) {
  FAKE_ENTRY(cuEventSynchronize);
  if (event->counters != nullptr) {
    while (event->counters[1].load() < event->counters[0].load()) ::usleep(1000);
    return CUDA_SUCCESS;
  }
  while (!event->blocker.done()) ::usleep(1000);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcGetEventHandle(CUipcEventHandle* handle, CUevent event) {
  FAKE_ENTRY(cuIpcGetEventHandle);
  if (event->counters == nullptr || !event->owner || event->name.size() >= sizeof handle->reserved)
    return CUDA_ERROR_INVALID_VALUE;
  std::memset(handle->reserved, 0, sizeof handle->reserved);
  std::memcpy(handle->reserved, event->name.data(), event->name.size());
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcOpenEventHandle(CUevent* event, CUipcEventHandle handle) {
  FAKE_ENTRY(cuIpcOpenEventHandle);
  const std::string name(handle.reserved, strnlen(handle.reserved, sizeof handle.reserved));
  // As the driver: the process that made an event cannot open its handle.
  if (name.rfind("/megacpp-fake-cuda-" + std::to_string(::getpid()) + "-", 0) == 0)
    return CUDA_ERROR_INVALID_CONTEXT;
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
  auto e = std::make_unique<CUevent_st>();
  e->flags = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
  e->name = name;
  e->counters = map_counters(fd);
  ::close(fd);
  if (e->counters == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  *event = keep(state().events, std::move(e));
  return CUDA_SUCCESS;
}

}  // extern "C"
