#!/usr/bin/env bash
# `make device-rehearsal`: the device check rehearsed on a machine without a GPU, in a root that
# stands for the GPU machine: Debian 13 with GCC 13 (the GPU machine's compiler; Debian 12's is
# 12), none of the build's packages but what `make device-prep` carries there
# (build-device/prefix), and this clone's torch and CUDA toolkit. Inside it,
# scripts/device-check.sh configures and builds the device targets with warnings as errors and
# runs its `gpu_tests` and `cuda_plugin_test` parts (the GPU cases skip with their reasons); every
# tracked Python script is compiled by the root's Python; then the built megacpp trains the
# default recipe on 2 CPU ranks there. What that settles before a
# GPU is lent: the code compiles under GCC 13 and nvcc 13 with it, the carried prefix is all the
# build and its binaries need (each binary finds the prefix's libraries through its run path,
# nothing through LD_LIBRARY_PATH, so the machine's own programs keep the machine's libraries),
# and the device check's script runs to its report. What it cannot settle: anything on a device.
#
# Needs root, debootstrap and Debian's registry (as device-prep). The root (about 400 MiB) is kept
# outside the clone, under MEGACPP_REHEARSAL_ROOT (default ~/.cache/megacpp/rehearsal-trixie),
# and reused; the mounts live in a mount namespace of their own and end with the script. Exits
# non-zero when a step fails.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
FS="${MEGACPP_REHEARSAL_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/megacpp/rehearsal-trixie}"
# What a Debian 13 root needs to stand for the GPU machine: its compiler (the GPU machine's
# gcc is 13), CMake, git (the report names the commit) and a python3 for the check's scripts.
PACKAGES=g++-13,cmake,git,python3,procps

if [ "$(id -u)" != 0 ]; then
  echo "device-rehearsal: needs root (debootstrap, chroot, mounts)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python3 ]; then
  echo "device-rehearsal: no .venv here: run 'make build' first (the rehearsal uses its torch)" >&2
  exit 1
fi
[ -f build-device/env.sh ] || bash scripts/device-prep.sh

if [ "$(cat "$FS/.megacpp-rehearsal" 2>/dev/null)" != "$PACKAGES" ]; then
  command -v debootstrap > /dev/null || apt-get install -y -qq debootstrap > /dev/null
  rm -rf "$FS"
  mkdir -p "$(dirname "$FS")"
  echo "device-rehearsal: making a Debian 13 root at $FS"
  debootstrap --variant=minbase --include="$PACKAGES" trixie "$FS" http://deb.debian.org/debian \
    > "$FS.log" 2>&1 || { tail -20 "$FS.log" >&2; exit 1; }
  # The GPU machine's gcc and g++ are version 13 under their plain names (nvcc calls gcc).
  for t in gcc cc; do ln -sfn gcc-13 "$FS/usr/bin/$t"; done
  for t in g++ c++; do ln -sfn g++-13 "$FS/usr/bin/$t"; done
  echo "$PACKAGES" > "$FS/.megacpp-rehearsal"
fi

# Paths the root sees at the same place as here: the clone, the venv (a link, maybe) and the
# interpreter it was made from, and the CUDA toolkit.
venv="$(readlink -f .venv)"
base="$(.venv/bin/python3 -c 'import sys; print(sys.base_prefix)')"
cuda="$(readlink -f /usr/local/cuda 2>/dev/null || true)"
binds=("$ROOT" "$venv" "$base")
[ -n "$cuda" ] && [ -d "$cuda" ] && binds+=("$cuda")

# What runs in the root: the device check's build and its parts that need no device, then the
# built megacpp on 2 CPU ranks (its libraries from the prefix, through the binaries' run paths).
export ROOT RUN_DIR=/tmp/megacpp-rehearsal-run
# shellcheck disable=SC2016 # expanded by the shell inside the root
export INSIDE='
set -uo pipefail
cd "$ROOT"
export PATH=/usr/local/cuda/bin:$PATH
rc=0
# A 2-core machine builds the device targets from scratch in about 5 minutes (322 s measured);
# the bounds leave room for a slower one.
MEGACPP_WERROR=ON DEVICE_CHECK_PARTS="gpu_tests cuda_plugin_test" DEVICE_CHECK_BUILD_S=3600 \
  DEVICE_CHECK_BUDGET_S=4000 bash scripts/device-check.sh > /dev/null 2>&1 || rc=1
grep -v "^\[[0-9]*/" build-gpu/device-check.txt | tail -40
echo "device-rehearsal: gcc $(gcc -dumpfullversion), $(nvcc --version 2>/dev/null | tail -1)"
# The Python the check runs on the GPU machine is another than this venv (3.12 there): every
# tracked script compiles under the Python of the root, warnings as errors (an escape that 3.12
# warns of, say).
git ls-files "*.py" | python3 -W error -c "
import sys
for f in sys.stdin.read().split():
    with open(f, encoding=\"utf-8\") as source:
        compile(source.read(), f, \"exec\")
print(\"device-rehearsal: the Python scripts compile under\", sys.version.split()[0])
" || rc=1
rm -rf "$RUN_DIR"
build-gpu/bin/megacpp run tiny --ranks 2 --steps 6 --device cpu --run-dir "$RUN_DIR" \
  --progress plain 2>&1 | tail -4 || rc=1
exit $rc
'
# A mount namespace of its own: the binds end with the script, whatever stops it.
# shellcheck disable=SC2016 # expanded by the inner shell
exec unshare --mount --propagation private bash -c '
set -euo pipefail
fs=$1; cuda=$2; shift 2
for d in "$@" /proc /sys /dev /dev/shm; do
  mkdir -p "$fs$d"
  mount --bind "$d" "$fs$d"
done
# The names of this host (torchrun and c10d resolve the host name).
cp /etc/hosts "$fs/etc/hosts"
mkdir -p "$fs/usr/local"
[ -z "$cuda" ] || ln -sfn "$cuda" "$fs/usr/local/cuda"
exec chroot "$fs" bash -c "$INSIDE"
' rehearsal "$FS" "$cuda" "${binds[@]}"
