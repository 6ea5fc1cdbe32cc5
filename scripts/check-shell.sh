#!/usr/bin/env bash
# Fails when a tracked shell script has a shellcheck warning or error (the device check and the
# set-up run where nobody watches them: once on a lent GPU machine, once on a fresh one).
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.sh' .ci/run)
if ((${#files[@]} == 0)); then exit 0; fi
if ! command -v shellcheck > /dev/null; then
  echo "shell-check: shellcheck is missing (make setup installs it)" >&2
  exit 1
fi
shellcheck -x -S warning "${files[@]}"
echo "shell-check: ${#files[@]} scripts clean"
