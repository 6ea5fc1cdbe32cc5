// megacpp::gpu driver — the CUDA driver API, loaded at run time from libcuda.so.1.
//
// Why loaded and not linked: the processes that use it (the checkpointer, which imports a rank's
// device staging; the rank, through its CUDA plugin) must start on machines without a driver, and
// a CPU process must not map the CUDA libraries. The driver ships with the kernel module, not the
// toolkit, so only its header is needed to build: cuda.h from a toolkit or the torch wheel.
//
// Internal to gpu/ (staging.cpp); compiled only where cuda.h was found (MEGACPP_HAVE_CUDA_H).
// Lifetime: the library is never unloaded (contexts and mappings made through it live until
// the process exits); a Driver is a table of its entry points. Failure: CU_CHECK throws
// Error{kSystem} naming the call and the driver's error text.
#pragma once

#include <cuda.h>

#include <memory>
#include <string>

#include <fmt/format.h>

#include "core/error.h"

namespace megacpp::gpu::detail {

// Each entry point under its name in cuda.h, whose macros select the versioned symbol (cuMemcpy*
// -> *_v2): the member and the symbol looked up go through the same macro.
#define MEGACPP_CU_FUNCTIONS(X)     \
  X(cuInit)                         \
  X(cuDriverGetVersion)             \
  X(cuGetErrorString)               \
  X(cuDeviceGet)                    \
  X(cuDeviceGetByPCIBusId)          \
  X(cuDeviceGetPCIBusId)            \
  X(cuDevicePrimaryCtxRetain)       \
  X(cuDevicePrimaryCtxRelease)      \
  X(cuCtxSetCurrent)                \
  X(cuMemGetAllocationGranularity)  \
  X(cuMemCreate)                    \
  X(cuMemRelease)                   \
  X(cuMemExportToShareableHandle)   \
  X(cuMemImportFromShareableHandle) \
  X(cuMemAddressReserve)            \
  X(cuMemAddressFree)               \
  X(cuMemMap)                       \
  X(cuMemUnmap)                     \
  X(cuMemSetAccess)                 \
  X(cuMemAlloc)                     \
  X(cuMemFree)                      \
  X(cuMemHostAlloc)                 \
  X(cuMemFreeHost)                  \
  X(cuMemcpyHtoD)                   \
  X(cuMemcpyDtoH)                   \
  X(cuMemcpyDtoDAsync)              \
  X(cuMemcpyDtoHAsync)              \
  X(cuMemsetD32Async)               \
  X(cuStreamCreate)                 \
  X(cuStreamDestroy)                \
  X(cuStreamWaitEvent)              \
  X(cuStreamSynchronize)            \
  X(cuEventCreate)                  \
  X(cuEventDestroy)                 \
  X(cuEventRecord)                  \
  X(cuEventQuery)                   \
  X(cuEventSynchronize)             \
  X(cuIpcGetEventHandle)            \
  X(cuIpcOpenEventHandle)

struct Driver {
#define MEGACPP_CU_MEMBER(name) decltype(&::name) name = nullptr;
  MEGACPP_CU_FUNCTIONS(MEGACPP_CU_MEMBER)
#undef MEGACPP_CU_MEMBER
};

// The driver's table (dlopen and cuInit; cheap after the first in a process). nullptr when
// libcuda.so.1 cannot be loaded or initialised; `why` then says so in one line.
std::shared_ptr<const Driver> load_driver(std::string* why);
// load_driver(), or Error{kSystem} with the reason.
std::shared_ptr<const Driver> require_driver();

// The driver's text for `status`.
std::string cu_error_text(const Driver& d, CUresult status);

}  // namespace megacpp::gpu::detail

// One check macro for the driver API: a failed call throws Error{kSystem} naming it.
#define CU_CHECK(d, call)                                                              \
  do {                                                                                 \
    const CUresult megacpp_cu_status_ = (d).call;                                      \
    if (megacpp_cu_status_ != CUDA_SUCCESS)                                            \
      MEGACPP_FAIL(::megacpp::ErrorKind::kSystem, "CUDA driver: {} failed: {}", #call, \
                   ::megacpp::gpu::detail::cu_error_text((d), megacpp_cu_status_));    \
  } while (0)
