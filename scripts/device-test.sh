#!/usr/bin/env bash
# On the GPU machine (torch with CUDA, Python, nvcc; no package registry): configures megacpp
# against that machine's own torch and the packages `make device-prep` unpacked into
# build-device/prefix (carried here from a machine with the registry), builds it in build-gpu,
# and runs the tests labelled gpu. Nothing is downloaded.
#
# Contract: fails, naming what is missing, when build-device/env.sh or torch is absent. The
# tests run .venv/bin/python: here .venv is made offline over the machine's own site-packages
# (so its torch) unless it exists.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -f build-device/env.sh ]; then
  echo "device-test: no build-device/env.sh: run 'make device-prep' on a machine with Debian's" \
    "registry and carry build-device to this one" >&2
  exit 1
fi
# shellcheck source=/dev/null
source build-device/env.sh
PY="${MEGACPP_PYTHON:-python3}"
if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "device-test: $PY cannot import torch (set MEGACPP_PYTHON to the python that has it)" >&2
  exit 1
fi
# The machine's python may itself be a venv (torch in that venv's site-packages, which a new
# --system-site-packages venv would not see): .venv links to its prefix.
if [ ! -x .venv/bin/python3 ]; then
  rm -rf .venv
  ln -sfn "$("$PY" -c 'import sys; print(sys.prefix)')" .venv
fi
.venv/bin/python3 -c 'import torch; print("device-test: torch", torch.__version__, "cuda",
  torch.version.cuda, "devices", torch.cuda.device_count())'
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGACPP_WERROR=OFF \
  > build-gpu.configure.log 2>&1 || { tail -40 build-gpu.configure.log >&2; exit 1; }
grep -E "^-- (ops|trainer):" build-gpu.configure.log || true
cmake --build build-gpu -j "$(nproc)"
ctest --test-dir build-gpu -L gpu --output-on-failure ${CTEST_ARGS:-}
