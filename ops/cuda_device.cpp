// Device discovery through the CUDA runtime. Compiled as host C++ (not by nvcc) so it may use
// the fmt-based logging.
#include <cuda_runtime_api.h>

#include "core/util.h"
#include "ops/ops.h"

namespace megacpp::ops {

int cuda_device_count() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess) return count;
  // Clear the error so that it is not reported by the next unrelated cudaGetLastError().
  (void)cudaGetLastError();
  // No driver or no device is an expected condition (CI, CPU hosts). Anything else (a driver
  // and runtime mismatch, a broken install) also leaves no usable device, but deserves a line.
  if (err != cudaErrorNoDevice && err != cudaErrorInsufficientDriver) {
    log_warn("cudaGetDeviceCount failed: {} ({}); treating as no CUDA device",
             cudaGetErrorString(err), cudaGetErrorName(err));
  }
  return 0;
}

}  // namespace megacpp::ops
