#!/usr/bin/env bash
# Hosts on one machine as network namespaces on a bridge (root): up N [--prefix P] | down |
# show | cut HOST | loss HOST PCT | heal HOST | exec HOST CMD...; the prefix (default mnsh) names
# the set. The implementation, and the Python context manager the tests use, is
# tests/multinode/netns_hosts.py; it needs only the standard library.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec python3 "$ROOT/tests/multinode/netns_hosts.py" "$@"
