#!/usr/bin/env bash
# Fails when a tracked C++ source differs from what .clang-format says it should be.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu')
if ((${#files[@]} == 0)); then exit 0; fi
if ! clang-format --dry-run --Werror "${files[@]}" 2> /tmp/megacpp-format.$$; then
  echo "format-check: these files need clang-format (run 'make format'):"
  grep 'code should be clang-formatted' /tmp/megacpp-format.$$ | cut -d: -f1 | sort -u | sed 's/^/  /'
  rm -f /tmp/megacpp-format.$$
  exit 1
fi
rm -f /tmp/megacpp-format.$$
echo "format-check: ${#files[@]} files clean"
