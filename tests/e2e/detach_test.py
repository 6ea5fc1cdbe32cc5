"""End-to-end: detached runs and the commands that look after them.

Detach   `megacpp run tiny --detach` returns 0 once the stage graph is up, printing the run
         directory, the metrics URL and how to watch and stop it; the supervisor lives on in its
         own session (not the launching command's) and keeps training after it returned.
Watch    `megacpp status RUN --watch` prints progress lines (step, loss, tokens/s, stages up,
         ETA) while the run is live, then the run's status once it ended.
Stop     `megacpp stop RUN --wait` stops it gracefully: state `interrupted`, the agreed step's
         checkpoint committed; a second `stop` is refused in one line.
List     `megacpp list DIR` prints the run with its state, recipe and steps.
Refusals A refused recipe under --detach fails in one line with the refusal's exit code and
         leaves nothing running; `list` of a path that is not a folder and `status` of a folder
         that is not a run fail in one line.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import run_harness  # noqa: E402

STEPS = 400


def alive(pid):
    """The process exists and is not a zombie (a detached supervisor's adopter may not reap)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Detached(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-detach-")
        cls.runs = os.path.join(cls.tmp, "runs")
        os.makedirs(cls.runs)
        cls.run_dir = os.path.join(cls.runs, "d1")
        cls.data = os.path.join(cls.tmp, "data")
        cls.launch = run_harness.megacpp(
            ["run", "tiny", "--ranks", "2", "--steps", str(STEPS), "--run-dir", cls.run_dir,
             "--data-dir", cls.data, "--detach"])
        with open(os.path.join(cls.run_dir, "launch.json")) as f:
            cls.pid = json.load(f)["supervisorPid"]

    @classmethod
    def tearDownClass(cls):
        if alive(cls.pid):
            os.kill(cls.pid, 9)
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_detach_watch_stop_list(self):
        p = self.launch
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("run %s is up" % self.run_dir, p.stdout)
        self.assertIn("megacpp status %s --watch" % self.run_dir, p.stdout)
        self.assertIn("megacpp stop %s" % self.run_dir, p.stdout)
        self.assertRegex(p.stdout, r"metrics +http://")
        self.assertNotIn("megacpp: detached", p.stdout)
        # The supervisor outlived the command, in a session of its own.
        self.assertTrue(alive(self.pid))
        self.assertNotEqual(os.getsid(self.pid), os.getsid(0))
        self.assertEqual(os.getsid(self.pid), self.pid)

        watch = subprocess.Popen([run_harness.MEGACPP, "status", self.run_dir, "--watch",
                                  "--interval", "0.3"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while run_harness.steps_done(self.run_dir) < 5 and time.time() < deadline:
            time.sleep(0.2)
        self.assertGreaterEqual(run_harness.steps_done(self.run_dir), 5, "it never trained")
        time.sleep(1.0)  # a few watch lines with progress

        # collect --all leaves a live run alone and says so.
        live = run_harness.megacpp(["collect", "--all", self.runs])
        self.assertEqual(live.returncode, 1, live.stdout + live.stderr)
        self.assertIn("d1: still running (supervisor pid %d)" % self.pid, live.stderr)

        stop = run_harness.megacpp(["stop", self.run_dir, "--wait", "--timeout", "120"])
        self.assertEqual(stop.returncode, 0, stop.stdout + stop.stderr)
        self.assertIn("asked the supervisor (pid %d)" % self.pid, stop.stdout)
        self.assertRegex(stop.stdout, r"state +interrupted")
        self.assertFalse(alive(self.pid))
        out, err = watch.communicate(timeout=60)
        self.assertEqual(watch.returncode, 0, err)
        lines = re.findall(r"step (\d+)/%d +loss (\S+) +(\S+) tok/s +stages up (\d+)/(\d+) +eta (\S+)"
                           % STEPS, out)
        self.assertTrue(lines, out)
        self.assertTrue(any(int(s) > 0 and loss != "-" and tps != "-" and eta != "-"
                            for s, loss, tps, _, _, eta in lines), lines)
        self.assertRegex(out, r"state +interrupted")

        with open(os.path.join(self.run_dir, "manifest.json")) as f:
            m = json.load(f)
        self.assertEqual(m["state"], "interrupted")
        done = m["stepsCompleted"]
        self.assertTrue(0 < done < STEPS, done)
        self.assertTrue(os.path.isdir(os.path.join(self.run_dir, "checkpoints", "step_%08d" % done)))
        self.assertTrue(os.path.getsize(os.path.join(self.run_dir, "logs", "supervisor.log")) > 0)

        again = run_harness.megacpp(["stop", self.run_dir])
        self.assertEqual(again.returncode, 2, again.stdout + again.stderr)
        self.assertIn("is not running (state interrupted)", again.stderr)
        self.assertEqual(len(again.stderr.strip().splitlines()), 1, again.stderr)

        listing = run_harness.megacpp(["list", self.runs])
        self.assertEqual(listing.returncode, 0, listing.stderr)
        row = [l for l in listing.stdout.splitlines() if l.startswith("d1 ")]
        self.assertEqual(len(row), 1, listing.stdout)
        # The last loss, then the newest validation loss (tiny evaluates every 10 steps and at
        # a graceful stop's step).
        self.assertRegex(row[0], r"^d1 +interrupted +tiny +%d/%d +\d+\.\d{4} +\d+\.\d{4} +\d{4}-\d\d-\d\dT"
                         % (done, STEPS))

    def test_refusals_are_one_line(self):
        d = os.path.join(self.tmp, "nam")
        p = run_harness.megacpp(["run", "nam56r", "--ranks", "2", "--run-dir", d, "--data-dir",
                                 self.data, "--detach", "--memory-budget", "1"])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("memory-budget", p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertFalse(os.path.exists(d))
        for args in (["list", os.path.join(self.tmp, "nowhere")], ["status", self.tmp],
                     ["stop", self.tmp]):
            p = run_harness.megacpp(args)
            self.assertNotEqual(p.returncode, 0, args)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, (args, p.stderr))


if __name__ == "__main__":
    unittest.main()
