"""End-to-end: a stop reaches the run whenever it arrives, on real stage processes.

Start-up  SIGTERM as soon as launch.json exists (during staging and launch, before any trainer's
          control socket connected): the stop is sent to each rank on its hello, so the run
          ends `interrupted` within a few steps, exit 143, its checkpoint committed (it used to
          train on until --stop-grace-s and end torn down, without the checkpoint).
Twice     A second SIGINT during the graceful stop (rank 1 hung in a step, so the stop cannot
          finish): the job is torn down at once and the run ends `interrupted`, exit 130, not
          `error` with the supervisor as first failure; the newest committed checkpoint
          verifies; no process is left.
Detached  `megacpp run --detach` whose launching command is killed (kill -9) during the data
          pre-flight: the supervisor, in its own session, goes on (its next log line on the
          dead pipe used to end it) and the run ends `ok`, its output in logs/supervisor.log.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import run_harness  # noqa: E402
from run_harness import MEGACPP, manifest, pids_of  # noqa: E402


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out waiting for " + what)


class Stop(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="megacpp-stop-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_a_stop_during_start_up_reaches_every_rank(self):
        run = run_harness.Run(self.tmp, steps=3000)
        run.launch(timeout=60)
        run.proc.send_signal(signal.SIGTERM)
        rc = run.finish(timeout=90)
        self.assertEqual(rc, 143, run.out[-3000:])
        m = manifest(run.dir)
        self.assertEqual(m["state"], "interrupted", m)
        self.assertLessEqual(m["stepsCompleted"], 20, m)
        self.assertTrue(m.get("latestCheckpoint"), m)
        v = run_harness.megacpp(["verify", run.dir])
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertEqual(pids_of(run.dir), [])

    def test_a_second_interrupt_stops_at_once_as_interrupted(self):
        # Rank 1 hangs in step 25's forward (after step 20's checkpoint): the graceful stop
        # cannot finish, so the second SIGINT is what ends the run.
        run = run_harness.Run(self.tmp, steps=3000,
                              extra=["--hang-budget-s", "60", "--stop-grace-s", "60"],
                              env={"MEGACPP_FAULT": "trainer:1:forward:25:hang"})
        run.launch(timeout=60)
        wait_for(lambda: run_harness.steps_done(run.dir) >= 24, 120, "step 24")
        time.sleep(0.5)
        run.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        self.assertIsNone(run.proc.poll(), "the graceful stop ended although rank 1 hangs")
        run.proc.send_signal(signal.SIGINT)
        rc = run.finish(timeout=60)
        self.assertEqual(rc, 130, run.out[-3000:])
        m = manifest(run.dir)
        self.assertEqual(m["state"], "interrupted", m)
        self.assertFalse(m.get("error"), m)
        self.assertIn("second SIGINT", m.get("stopReason", ""), m)
        self.assertEqual(m.get("latestCheckpoint"), "checkpoints/step_00000020", m)
        v = run_harness.megacpp(["verify", run.dir])
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertEqual(pids_of(run.dir), [])

    def test_a_detached_run_outlives_its_killed_launcher(self):
        # Killed as soon as the data directory appears (the data pre-flight), so that the
        # supervisor's next log lines ("data: ...", then "is up") meet a pipe nobody reads.
        for attempt in range(5):
            base = os.path.join(self.tmp, "a%d" % attempt)
            run_dir, data = os.path.join(base, "run"), os.path.join(base, "data")
            launcher = subprocess.Popen(
                [MEGACPP, "run", "tiny", "--ranks", "2", "--steps", "40", "--run-dir", run_dir,
                 "--data-dir", data, "--detach"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(data) and time.monotonic() < deadline:
                time.sleep(0.001)
            launcher.kill()
            out, _ = launcher.communicate()
            if "data:" not in out and "is up" not in out:
                break
        else:
            self.fail("the launcher was never killed before the data pre-flight ended: " + out)
        launch = os.path.join(run_dir, "launch.json")
        wait_for(lambda: os.path.exists(launch), 60, "launch.json (the supervisor died?)")
        with open(launch) as f:
            supervisor = json.load(f)["supervisorPid"]
        wait_for(lambda: run_harness.steps_done(run_dir) >= 40 and
                 manifest(run_dir).get("state") != "running", 180, "the run's end")
        m = manifest(run_dir)
        self.assertEqual(m["state"], "ok", m)
        wait_for(lambda: not os.path.exists("/proc/%d" % supervisor) or
                 open("/proc/%d/stat" % supervisor).read().rsplit(")", 1)[1].split()[0] == "Z",
                 30, "the supervisor's exit")
        with open(os.path.join(run_dir, "logs", "supervisor.log")) as f:
            self.assertIn("run ok", f.read())


if __name__ == "__main__":
    unittest.main()
