#!/usr/bin/env bash
# relocate-prefix.sh PREFIX MULTIARCH: makes an unpacked Debian prefix (device-prep's
# build-device/prefix) find its own libraries wherever it lies, without LD_LIBRARY_PATH: every
# ELF file in PREFIX/usr/bin and in PREFIX/{usr/,}lib/MULTIARCH gets a run path relative to
# itself ($ORIGIN) to both library directories. Why: LD_LIBRARY_PATH would put the prefix's
# libraries (Debian 12's libssl3 among them) in front of a machine's own for every program
# started under it, and a machine with newer ones then fails its own tools (Debian 13's cmake:
# "OPENSSL_3.2.0 not found"). A run path ($ORIGIN) is the file's own: only the prefix's tools and
# libraries, and what the build links against them, see the prefix.
#
# Contract: idempotent; needs patchelf; symbolic links and non-ELF files are left alone; a
# library's run path covers only its own direct dependencies, which is why every library gets one.
set -euo pipefail
prefix=$1
multi=$2
command -v patchelf > /dev/null || { echo "relocate-prefix: needs patchelf" >&2; exit 1; }
for f in "$prefix"/usr/bin/* "$prefix"/usr/lib/"$multi"/*.so* "$prefix"/lib/"$multi"/*.so*; do
  [ -f "$f" ] && [ ! -L "$f" ] || continue
  [ "$(head -c 4 "$f" | tr -d '\0')" = $'\x7fELF' ] || continue
  case "$f" in
    "$prefix"/usr/bin/*) rpath="\$ORIGIN/../lib/$multi:\$ORIGIN/../../lib/$multi" ;;
    "$prefix"/usr/lib/*) rpath="\$ORIGIN:\$ORIGIN/../../../lib/$multi" ;;
    *) rpath="\$ORIGIN:\$ORIGIN/../../usr/lib/$multi" ;;
  esac
  patchelf --set-rpath "$rpath" "$f"
done
