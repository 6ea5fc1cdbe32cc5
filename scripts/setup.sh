#!/usr/bin/env bash
# One-time, idempotent set-up: Debian packages and the LibTorch venv.
#
# Contract: safe to run any number of times; a second run with everything present
# touches nothing and takes well under a second. The venv lives outside the clone,
# keyed by the pinned torch version and the Python minor version, so a fresh clone on
# a machine that already has it never downloads the multi-GB torch wheel again.
# Writes .venv (a symlink to that venv) at the repository root.
set -euo pipefail

TORCH_VERSION="2.11.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libzmq3-dev libsodium-dev capnproto libcapnp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libfmt-dev libxxhash-dev
  libgloo-dev libcpp-httplib-dev prometheus clang-format python3-venv
  libsentencepiece-dev clang libclang-rt-14-dev chromium shellcheck patchelf
  # The multinode tests' hosts on one machine (tests/multinode): network namespaces, packet
  # loss through nftables, ping, and a real Slurm cluster (its daemons are never started by
  # the packages: the cluster runs its own, configured under a temp dir).
  iproute2 nftables iputils-ping util-linux slurmd slurmctld slurm-client munge
)

# One dpkg-query for every package (a second run stays well under a second); a package it does
# not list as installed is missing.
declare -A installed=()
while read -r name status; do
  [ "$status" = "installed" ] && installed[$name]=1
done < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${APT_PACKAGES[@]}" 2>/dev/null || true)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  [ -n "${installed[$p]:-}" ] || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY="${MEGACPP_PYTHON:-python3}"
PYVER="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
VENV_ROOT="${MEGACPP_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/megacpp}"
VENV="$VENV_ROOT/venv-torch-$TORCH_VERSION-py$PYVER"

if [ ! -f "$VENV/.megacpp-complete" ]; then
  echo "setup: creating $VENV (torch==$TORCH_VERSION; the first time this downloads several GB)"
  rm -rf "$VENV"
  mkdir -p "$VENV_ROOT"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" safetensors numpy
  "$VENV/bin/python" -c 'import torch, safetensors; print("setup: torch", torch.__version__)'
  touch "$VENV/.megacpp-complete"
fi

ln -sfn "$VENV" "$ROOT/.venv"
