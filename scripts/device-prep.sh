#!/usr/bin/env bash
# Prepares, on a machine that reaches Debian's package registry, what the GPU machine needs to
# build megacpp there: it has torch 2.11 (+cu130), Python, nvcc and no registry. The Debian
# packages of the build's libraries and headers, with their library dependencies, are fetched
# with `apt-get download` and unpacked into build-device/prefix; build-device/env.sh points
# CMake and pkg-config at them. `make device-test` on the GPU machine uses that prefix (carry
# build-device to it). The GPU machine's own libc, libstdc++, CUDA toolkit and torch are used.
#
# Contract: idempotent (the .debs stay in build-device/debs); fails if build-device would exceed
# the 64 MiB a carried path may hold, naming the biggest packages. Needs apt-get, dpkg-deb and
# patchelf (installed when missing).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/build-device"
LIMIT_MB=64

# What CMake finds (CMakeLists.txt, cmake/, */CMakeLists.txt) and the tools the build runs.
WANT=(
  libzmq3-dev capnproto libcapnp-dev libgtest-dev libgmock-dev
  nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libfmt-dev libxxhash-dev libsodium-dev
  libsodium23
  libgloo-dev libcpp-httplib-dev libsentencepiece-dev ninja-build
  # CapnProtoConfig.cmake asks for OpenSSL (capnp's kj-tls) and pkg_check_modules for
  # pkg-config; neither is known to be on the GPU machine.
  pkgconf libssl-dev libssl3
  # cpp-httplib.pc asks for brotli and zlib support (its Cflags define them).
  libbrotli-dev libbrotli1 zlib1g-dev
)
# Not fetched: the base system every machine has; other packages' headers (-dev: only those in
# WANT are read, and dynamic links need no Requires.private, which is stripped below); gloo's
# runtime (torch carries its own gloo; only the headers are used) and what it pulls in.
SKIP='^(libc6|libgcc-s1|libstdc\+\+6|gcc-[0-9]+-base|libcrypt1|zlib1g|debconf|dpkg|perl-base|tzdata|adduser|passwd|liblzma5|libgloo0|libibverbs1|ibverbs-providers|libhiredis.*|libnl-.*|libicu.*|icu-devtools|libxml2|.*-dev)$'

deps() {
  apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
    --no-enhances "$@" 2>/dev/null | awk '/^  (Pre)?Depends: [^<]/ {print $2}' | sort -u
}

if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "device-prep: needs apt-get and dpkg-deb (a Debian machine with its registry)" >&2
  exit 1
fi
mkdir -p "$OUT/debs"
# The download is kept while the wanted list is the same (the stamp holds it).
if [ "$(cat "$OUT/debs/.complete" 2>/dev/null)" != "${WANT[*]}" ]; then
  rm -f "$OUT"/debs/*.deb
  [ "$(id -u)" = 0 ] && apt-get update -qq || true
  all=("${WANT[@]}")
  frontier=("${WANT[@]}")
  for _ in 1 2 3 4; do
    mapfile -t next < <(deps "${frontier[@]}" | grep -Ev "$SKIP" || true)
    frontier=()
    for p in "${next[@]}"; do
      if [[ ! " ${all[*]} " == *" $p "* ]]; then all+=("$p"); frontier+=("$p"); fi
    done
    ((${#frontier[@]})) || break
  done
  echo "device-prep: downloading ${#all[@]} packages"
  (cd "$OUT/debs" && apt-get download -qq "${all[@]}")
  echo "${WANT[*]}" > "$OUT/debs/.complete"
fi

rm -rf "$OUT/prefix"
mkdir -p "$OUT/prefix"
for deb in "$OUT"/debs/*.deb; do dpkg-deb -x "$deb" "$OUT/prefix"; done
# Nothing the build does not read: documentation, manuals, locales.
rm -rf "$OUT/prefix/usr/share/doc" "$OUT/prefix/usr/share/man" "$OUT/prefix/usr/share/locale" \
  "$OUT/prefix/usr/share/lintian" "$OUT/prefix/usr/share/info"
# Dynamic links only: a .pc file's Requires.private would send pkg-config after headers of
# packages not fetched.
find "$OUT/prefix" -name '*.pc' -exec sed -i '/^Requires.private:/d' {} +
# capnp 0.9.2's blob.h compares `const char* == StringPtr`, which GCC 13 (the GPU machine's
# compiler) rejects in C++20 (P2468's rewritten candidates); GCC 12 accepts it. The operands
# swapped call StringPtr's own operator, as later capnp releases do.
sed -i 's/return a == b.asString();/return b.asString() == a;/; s/return a != b.asString();/return b.asString() != a;/' \
  "$OUT/prefix/usr/include/capnp/blob.h"
# Static archives are not linked (every dependency is a shared library).
find "$OUT/prefix" -name '*.a' ! -name 'libgtest*.a' ! -name 'libgmock*.a' -delete

MULTI="$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)"
# The prefix's tools (capnp, pkgconf) and libraries find the prefix's libraries through run paths
# of their own, not LD_LIBRARY_PATH (scripts/relocate-prefix.sh says why); the build's binaries
# find the prefix through CMake's build run path.
if ! command -v patchelf > /dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "device-prep: needs patchelf (apt-get install patchelf)" >&2
    exit 1
  fi
  apt-get install -y -qq patchelf > /dev/null
fi
bash "$ROOT/scripts/relocate-prefix.sh" "$OUT/prefix" "$MULTI"
cat > "$OUT/env.sh" <<ENV
# Sourced by scripts/device-test.sh: the unpacked packages of build-device/prefix.
P="\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)/prefix"
export PATH="\$P/usr/bin:\$PATH"
export CMAKE_PREFIX_PATH="\$P/usr\${CMAKE_PREFIX_PATH:+:\$CMAKE_PREFIX_PATH}"
export PKG_CONFIG_SYSROOT_DIR="\$P"
export PKG_CONFIG_LIBDIR="\$P/usr/lib/$MULTI/pkgconfig:\$P/usr/share/pkgconfig"
# The multiarch directory too (openssl/opensslconf.h is there), which the compiler searches
# only under its own /usr/include.
export CPATH="\$P/usr/include:\$P/usr/include/$MULTI\${CPATH:+:\$CPATH}"
ENV

# What is carried is the whole of build-device: the prefix and the downloaded packages beside it.
mb=$(du -sm "$OUT/prefix" | cut -f1)
carried=$(du -sm "$OUT" | cut -f1)
echo "device-prep: build-device/prefix holds ${mb} MiB from $(ls "$OUT"/debs/*.deb | wc -l)" \
  "packages; build-device ${carried} MiB"
if ((carried > LIMIT_MB)); then
  echo "device-prep: over the ${LIMIT_MB} MiB a carried path may hold; the biggest:" >&2
  du -sk "$OUT"/debs/*.deb | sort -rn | head -8 >&2
  exit 1
fi
