"""scripts/device-check-lib.sh (the device check's bookkeeping) with stand-in parts, on any
machine: a part's PASS/FAIL and output in the report, a part bounded by the budget left and the
parts after it named as not run, the goals gathered from the parts' lines whatever happened, the
verdict and the exit status. The device check runs on a lent GPU for minutes, once: its
scaffolding must not be what fails there."""
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "scripts" / "device-check-lib.sh"


def check(body: str, env: dict[str, str]) -> tuple[int, str, float]:
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "report.txt"
        script = f'set -uo pipefail\nREPORT="{report}"\n: > "$REPORT"\nsource "{LIB}"\n{body}\n'
        t = time.monotonic()
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                           env={"PATH": "/usr/bin:/bin", **env})
        return r.returncode, report.read_text(), time.monotonic() - t


GOALS = """
goal "the figure" "figure [0-9]+"
goal "the missing figure" "absent [0-9]+"
finish
"""

# Every part passes: their output and PASS lines in the report, the goal found, the missing one
# said to be unmeasured, exit 0.
rc, report, _ = check('part one 30 echo "figure 7"\npart two 30 true' + GOALS, {})
assert rc == 0, report
assert "== one (bound 30s): echo figure 7" in report, report
assert "\nfigure 7\n" in report and "PASS one (" in report and "PASS two (" in report, report
assert "the figure: figure 7" in report, report
assert "the missing figure: not measured (its part failed or did not run)" in report, report
assert report.rstrip().endswith("device-check: every part passed"), report

# A failing part is named in the verdict; the parts after it still run; exit 1.
rc, report, _ = check('part bad 30 false\npart after 30 echo "figure 3"' + GOALS, {})
assert rc == 1, report
assert "FAIL bad rc=1" in report and "PASS after (" in report, report
assert "the figure: figure 3" in report, report
assert report.rstrip().endswith("device-check: FAILED: bad"), report

# A hanging part gets only the budget left (8 s less the reserve of 2), the part after it is
# named as not run, and the goals and the verdict still come, well before the hang's own limit.
rc, report, seconds = check(
    'part early 30 echo "figure 5"\npart hang 300 sleep 300\npart late 30 echo "figure 9"' + GOALS,
    {"DEVICE_CHECK_BUDGET_S": "8", "DEVICE_CHECK_RESERVE_S": "2", "DEVICE_CHECK_MIN_PART_S": "2"})
assert rc == 1, report
assert seconds < 60, (seconds, report)
assert "== hang (bound " in report and "== hang (bound 300s)" not in report, report
assert "FAIL hang rc=124" in report, report
assert "SKIP late: the check's budget is spent (8s, DEVICE_CHECK_BUDGET_S)" in report, report
assert "figure 9" not in report, report
assert "the figure: figure 5" in report, report
assert "device-check: FAILED: hang" in report, report
assert report.rstrip().endswith("device-check: NOT RUN (budget spent): late"), report

# DEVICE_CHECK_PARTS runs only the parts it names (configure and build always).
rc, report, _ = check('part build 30 true\npart one 30 echo "figure 1"\npart two 30 false' + GOALS,
                      {"DEVICE_CHECK_PARTS": "one"})
assert rc == 0, report
assert "PASS build (" in report and "PASS one (" in report, report
assert "SKIP two (not in DEVICE_CHECK_PARTS)" in report and "FAIL" not in report, report

print("device-check-lib: every case held")
