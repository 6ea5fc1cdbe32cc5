# LibTorch from the PyPI wheel, imported by hand rather than through TorchConfig.cmake:
# the x86_64 wheel is a CUDA build whose config insists on locating a matching CUDA
# toolkit, while the CPU trainer needs only libtorch_cpu + libc10 (c10d Gloo lives there).
# Gloo's headers are not shipped in the wheel; Debian's libgloo-dev provides declarations,
# and every gloo symbol we reach resolves inside libtorch_cpu.
if(NOT MEGACPP_TORCH_DIR)
  find_program(MEGACPP_VENV_PYTHON NAMES python3 PATHS ${CMAKE_SOURCE_DIR}/.venv/bin NO_DEFAULT_PATH)
  if(NOT MEGACPP_VENV_PYTHON)
    message(FATAL_ERROR "no .venv/bin/python3: run scripts/setup.sh (make does it for you)")
  endif()
  execute_process(
    COMMAND ${MEGACPP_VENV_PYTHON} -c "import torch.utils, os; print(os.path.dirname(os.path.dirname(torch.utils.cmake_prefix_path)))"
    OUTPUT_VARIABLE _torch_dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "could not import torch from ${MEGACPP_VENV_PYTHON}")
  endif()
  set(MEGACPP_TORCH_DIR ${_torch_dir} CACHE PATH "" FORCE)
endif()
find_library(MEGACPP_TORCH_CPU_LIB torch_cpu PATHS ${MEGACPP_TORCH_DIR}/lib NO_DEFAULT_PATH REQUIRED)
find_library(MEGACPP_C10_LIB c10 PATHS ${MEGACPP_TORCH_DIR}/lib NO_DEFAULT_PATH REQUIRED)
find_path(MEGACPP_GLOO_INCLUDE gloo/algorithm.h REQUIRED)
execute_process(
  COMMAND ${MEGACPP_VENV_PYTHON} -c "import torch; print(torch.__version__)"
  OUTPUT_VARIABLE MEGACPP_TORCH_VERSION OUTPUT_STRIP_TRAILING_WHITESPACE)
message(STATUS "torch ${MEGACPP_TORCH_VERSION} at ${MEGACPP_TORCH_DIR}")

add_library(megacpp_torch INTERFACE)
add_library(megacpp::torch ALIAS megacpp_torch)
target_include_directories(megacpp_torch SYSTEM INTERFACE
  ${MEGACPP_TORCH_DIR}/include
  ${MEGACPP_TORCH_DIR}/include/torch/csrc/api/include
  ${MEGACPP_GLOO_INCLUDE})
target_compile_definitions(megacpp_torch INTERFACE
  USE_C10D_GLOO USE_DISTRIBUTED _GLIBCXX_USE_CXX11_ABI=1
  # torch's include tree carries its own fmt (newer than Debian's) and libtorch exports no fmt
  # symbols: a TU that sees torch's headers uses fmt header-only.
  FMT_HEADER_ONLY
  MEGACPP_TORCH_VERSION="${MEGACPP_TORCH_VERSION}")
target_link_libraries(megacpp_torch INTERFACE ${MEGACPP_TORCH_CPU_LIB} ${MEGACPP_C10_LIB} Threads::Threads)
target_link_options(megacpp_torch INTERFACE "LINKER:-rpath,${MEGACPP_TORCH_DIR}/lib")
