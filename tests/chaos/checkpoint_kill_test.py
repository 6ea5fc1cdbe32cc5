"""Chaos at checkpoint time: kill -9 of the checkpointer, a rank or the supervisor at random
points of a run that checkpoints every 2 steps, then check that nothing committed was lost.

After every kill: `megacpp verify RUN` passes (LATEST names a whole checkpoint), and the run
completes — by itself when the killed process was the checkpointer (restarted: a run that then
ends anything but `ok` fails the test), else with `megacpp run --resume RUN` — with a manifest
`ok` and the planned steps, and its final checkpoint verifies.

MEGACPP_KILL_POINTS=N runs N kill points (default 200: `make chaos`, label `full`); the
bounded sample in `make test` runs a few. MEGACPP_KILL_SEED replays a sequence (printed).
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from run_harness import MEGACPP, pids_of, steps_done, tiny_recipe  # noqa: E402

STEPS = 16
TARGETS = ("checkpointer", "trainer", "supervisor")


def pid_of(pattern):
    found = pids_of(pattern)
    return found[0] if found else None


class CheckpointKills(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-ckpt-chaos-")
        cls.recipe = tiny_recipe(cls.tmp, 2)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def one(self, i, rng):
        target = rng.choice(TARGETS)
        at_step = rng.randint(1, STEPS - 2)
        delay = rng.uniform(0.0, 0.25)
        rank = rng.randint(0, 1)
        run_dir = os.path.join(self.tmp, "run-%d" % i)
        what = "%s%s after step %d + %.0f ms" % (target, "-%d" % rank if target == "trainer" else "",
                                               at_step, delay * 1000)
        proc = subprocess.Popen(
            [MEGACPP, "run", self.recipe, "--ranks", "2", "--steps", str(STEPS), "--run-dir", run_dir,
             "--data-dir", os.path.join(self.tmp, "data"), "--progress", "none", "--keep-checkpoints", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while steps_done(run_dir) < at_step and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        if target == "supervisor":
            pid = proc.pid
        elif target == "checkpointer":
            pid = pid_of("megacpp-checkpointer --run-dir %s " % run_dir)
        else:
            pid = pid_of("megacpp-trainer --run-dir %s --rank %d" % (run_dir, rank))
        killed = pid is not None and proc.poll() is None
        if killed:
            os.kill(pid, signal.SIGKILL)
        else:
            what += " (the run had ended: no kill)"
        out, _ = proc.communicate(timeout=180)
        if target == "supervisor":
            # Its stages die with it (PDEATHSIG); `status` records the orphan.
            time.sleep(0.5)
            subprocess.run([MEGACPP, "status", run_dir], capture_output=True, text=True, timeout=60)
        v = subprocess.run([MEGACPP, "verify", run_dir], capture_output=True, text=True, timeout=120)
        has_checkpoint = os.path.exists(os.path.join(run_dir, "checkpoints", "LATEST"))
        if has_checkpoint:
            self.assertEqual(v.returncode, 0, "%s: LATEST does not verify:\n%s" % (what, v.stdout))
        with open(os.path.join(run_dir, "manifest.json")) as f:
            state = json.load(f)["state"]
        if target == "checkpointer" and killed:
            # The checkpointer is restartable: the run recovers by itself, it is never a
            # resume's job.
            self.assertEqual(state, "ok", "%s: the run ended %s, not recovered by the "
                             "checkpointer's restart:\n%s" % (what, state, out[-2000:]))
        if state != "ok":
            if not has_checkpoint:
                shutil.rmtree(run_dir, ignore_errors=True)
                return what + ": failed before the first checkpoint"
            with open(os.path.join(run_dir, "checkpoints", "LATEST")) as f:
                latest = f.read().strip()
            if latest == "step_%08d" % STEPS:
                # The kill landed after the final checkpoint committed (a step is ~40 ms, the
                # delay up to 250 ms): every step is saved and `--resume` rightly has nothing
                # to do; LATEST verified above.
                p = subprocess.run([MEGACPP, "run", "--resume", run_dir, "--progress", "none"],
                                   capture_output=True, text=True, timeout=300)
                self.assertNotEqual(p.returncode, 0, what)
                self.assertIn("nothing to resume", p.stderr + p.stdout, what)
                shutil.rmtree(run_dir, ignore_errors=True)
                return what + ": killed after the final checkpoint, nothing to resume"
            p = subprocess.run([MEGACPP, "run", "--resume", run_dir, "--progress", "none"],
                               capture_output=True, text=True, timeout=300)
            self.assertEqual(p.returncode, 0, "%s: resume failed:\n%s%s" % (what, p.stdout[-2000:],
                                                                             p.stderr[-2000:]))
        with open(os.path.join(run_dir, "manifest.json")) as f:
            m = json.load(f)
        self.assertEqual((m["state"], m["stepsCompleted"]), ("ok", STEPS), what)
        v = subprocess.run([MEGACPP, "verify", run_dir], capture_output=True, text=True, timeout=120)
        self.assertEqual(v.returncode, 0, "%s: final checkpoint:\n%s" % (what, v.stdout))
        shutil.rmtree(run_dir, ignore_errors=True)
        return what + (": resumed" if state != "ok" else ": the run recovered by itself")

    def test_kill_points(self):
        n = int(os.environ.get("MEGACPP_KILL_POINTS", "200"))
        seed = int(os.environ.get("MEGACPP_KILL_SEED", str(int(time.time()))))
        sys.stderr.write("%d kill points (MEGACPP_KILL_SEED=%d)\n" % (n, seed))
        rng = random.Random(seed)
        for i in range(n):
            sys.stderr.write("  %d: %s\n" % (i, self.one(i, rng)))
            sys.stderr.flush()


if __name__ == "__main__":
    unittest.main(verbosity=2)
