# shellcheck shell=bash
# The device check's bookkeeping (sourced by scripts/device-check.sh; tests/unit/
# device_check_lib_test.py drives it with stand-in parts): the report, each part bounded by its
# own limit and by what is left of the check's budget, and the goals gathered at the end.
#
# Contract: the caller sets REPORT (the report file, truncated by the caller) before sourcing.
# DEVICE_CHECK_BUDGET_S (default 540) bounds the whole check from the moment this file is
# sourced: a part's bound is its own limit or the budget left less DEVICE_CHECK_RESERVE_S (the
# goals' and the summary's few seconds), whichever is smaller, and a part that would get less
# than DEVICE_CHECK_MIN_PART_S is skipped and named. So the report always ends with its goals
# and its verdict, within the device tool's one-command limit (600 s), even when parts hang.
# DEVICE_CHECK_PARTS (names, space-separated) runs only those parts besides configure and build.

T0=$(date +%s)
FAILED=()
OUT_OF_TIME=()
BUDGET_S=${DEVICE_CHECK_BUDGET_S:-540}
RESERVE_S=${DEVICE_CHECK_RESERVE_S:-10}
MIN_PART_S=${DEVICE_CHECK_MIN_PART_S:-15}

say() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$REPORT"; }

# part NAME LIMIT_S CMD...: runs CMD with its output into the report, bounded; PASS/FAIL with
# its seconds. Returns CMD's status (124 when bounded), 0 for a part not asked for.
part() {
  local name=$1 limit=$2; shift 2
  if [ -n "${DEVICE_CHECK_PARTS:-}" ] && [[ " configure build $DEVICE_CHECK_PARTS " != *" $name "* ]]; then
    say "SKIP $name (not in DEVICE_CHECK_PARTS)"
    return 0
  fi
  local left=$((BUDGET_S - RESERVE_S - ($(date +%s) - T0)))
  if ((left < MIN_PART_S)); then
    say "SKIP $name: the check's budget is spent (${BUDGET_S}s, DEVICE_CHECK_BUDGET_S)"
    OUT_OF_TIME+=("$name")
    return 124
  fi
  ((limit > left)) && limit=$left
  local t
  t=$(date +%s)
  say "== $name (bound ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$REPORT"
  local rc=${PIPESTATUS[0]}
  local dt=$(($(date +%s) - t))
  if [ "$rc" = 0 ]; then say "PASS $name (${dt}s)"; else say "FAIL $name rc=$rc (${dt}s)"; FAILED+=("$name"); fi
  return "$rc"
}

# goal WHAT PATTERN: the newest report line a part printed that matches PATTERN (an extended
# regular expression), under WHAT; says so when none did.
goal() {
  local what=$1 pattern=$2 line
  line=$(grep -E -- "$pattern" "$REPORT" | grep -v '^\[' | tail -1)
  say "  $what: ${line:-not measured (its part failed or did not run)}"
}

# The verdict, last in the report; the check's exit status.
finish() {
  local rc=0
  if ((${#FAILED[@]})); then
    say "device-check: FAILED: ${FAILED[*]}"
    rc=1
  fi
  if ((${#OUT_OF_TIME[@]})); then
    say "device-check: NOT RUN (budget spent): ${OUT_OF_TIME[*]}"
    rc=1
  fi
  ((rc)) || say "device-check: every part passed"
  return $rc
}
