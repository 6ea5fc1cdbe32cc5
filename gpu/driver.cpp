// Loading the CUDA driver API from libcuda.so.1 (driver.h).
#include "gpu/driver.h"

#include <dlfcn.h>

#include <memory>

namespace megacpp::gpu::detail {

namespace {
#define MEGACPP_CU_STR2(x) #x
#define MEGACPP_CU_STR(x) MEGACPP_CU_STR2(x)

struct Loaded {
  Driver table;
  std::string why;  // empty when loaded
};

Loaded load() {
  Loaded out;
  // Never closed: contexts and mappings made through the table live until the process exits.
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    out.why = "no CUDA driver on this machine (libcuda.so.1 cannot be loaded)";
    return out;
  }
  // MEGACPP_CU_STR expands cuda.h's macro first: cuMemcpyDtoHAsync -> "cuMemcpyDtoHAsync_v2".
#define MEGACPP_CU_LOAD(name)                                                                      \
  out.table.name = reinterpret_cast<decltype(out.table.name)>(::dlsym(lib, MEGACPP_CU_STR(name))); \
  if (out.table.name == nullptr) {                                                                 \
    out.why = std::string("the CUDA driver lacks ") + MEGACPP_CU_STR(name) +                       \
              ": it is older than the CUDA " + std::to_string(CUDA_VERSION / 1000) +               \
              " headers megacpp was built with";                                                   \
    return out;                                                                                    \
  }
  MEGACPP_CU_FUNCTIONS(MEGACPP_CU_LOAD)
#undef MEGACPP_CU_LOAD
  if (const CUresult r = out.table.cuInit(0); r != CUDA_SUCCESS) {
    const char* text = nullptr;
    out.table.cuGetErrorString(r, &text);
    out.why = std::string("the CUDA driver did not initialise: ") + (text ? text : "unknown error");
  }
  return out;
}
}  // namespace

std::shared_ptr<const Driver> load_driver(std::string* why) {
  // dlopen of a loaded library and cuInit after the first are cheap and idempotent, so each
  // owner loads its own table rather than sharing a process-wide one.
  Loaded loaded = load();
  if (!loaded.why.empty()) {
    if (why != nullptr) *why = loaded.why;
    return nullptr;
  }
  return std::make_shared<const Driver>(loaded.table);
}

std::shared_ptr<const Driver> require_driver() {
  std::string why;
  auto d = load_driver(&why);
  if (!d) MEGACPP_FAIL(ErrorKind::kSystem, "{}", why);
  return d;
}

std::string cu_error_text(const Driver& d, CUresult status) {
  const char* text = nullptr;
  if (d.cuGetErrorString != nullptr) d.cuGetErrorString(status, &text);
  return text != nullptr ? fmt::format("{} ({})", text, static_cast<int>(status))
                         : fmt::format("CUDA error {}", static_cast<int>(status));
}

}  // namespace megacpp::gpu::detail
