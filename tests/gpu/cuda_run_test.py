"""`megacpp run --device cuda` end to end (label gpu): the default recipe trains through the
trainer's CUDA plugin with ProcessGroupNCCL (one rank per visible device, at most 2), and a GPU
rank killed with kill -9 or stopped with SIGSTOP ends the run in the same typed state as on
CPU, with the job torn down (no stage process left); snapshots staged on the device through
CUDA IPC survive a checkpointer crash.

Exits 77 (ctest: skipped) with the reason on stdout when this build has no CUDA plugin or the
machine has no CUDA device, as on every CPU machine and in CI.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import run_harness  # noqa: E402
from run_harness import MEGACPP, losses, manifest  # noqa: E402

PYTHON = os.environ["MEGACPP_VENV_PYTHON"]
PLUGIN = os.path.join(os.path.dirname(MEGACPP), "libmegacpp_trainer_cuda.so")


def visible_devices():
    p = subprocess.run([PYTHON, "-c", "import torch; print(torch.cuda.device_count())"],
                       capture_output=True, text=True, timeout=300)
    return int(p.stdout.strip() or 0) if p.returncode == 0 else 0


RANKS = 1


class CudaRun(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="megacpp-cuda-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_the_default_recipe_trains_on_cuda(self):
        run = run_harness.Run(self.tmp, steps=40, ranks=RANKS, extra=["--device", "cuda"])
        self.assertEqual(run.launch()["device"], "cuda")
        self.assertEqual(run.finish(timeout=600), 0, run.out[-3000:])
        m = manifest(run.dir)
        self.assertEqual(m["state"], "ok")
        got = losses(run.dir)
        self.assertEqual(len(got), 40)
        first = sum(l for _, l in got[:5]) / 5
        last = sum(l for _, l in got[-5:]) / 5
        self.assertLess(last, first - 0.5, got)
        with open(os.path.join(run.dir, "logs", "trainer-0.log")) as f:
            self.assertIn("training on cuda:0", f.read())
        v = run_harness.megacpp(["verify", run.dir])
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)

    def test_snapshots_staged_on_the_device_survive_a_checkpointer_crash(self):
        # The snapshot plane through CUDA IPC: every rank's share is copied device-to-device
        # into memory the checkpointer imports; the checkpointer crashes writing step 20 and its
        # restart imports the buffers again. The run ends ok and every checkpoint verifies.
        run = run_harness.Run(self.tmp, steps=30, ranks=RANKS, extra=["--device", "cuda"],
                              env={"MEGACPP_SNAPSHOT_STAGING": "device",
                                   "MEGACPP_FAULT": "checkpointer:0:write:20:segv"})
        self.assertEqual(run.launch()["snapshotStaging"], "device")
        self.assertEqual(run.finish(timeout=600), 0, run.out[-3000:])
        self.assertEqual(manifest(run.dir)["state"], "ok")
        for r in range(RANKS):
            with open(os.path.join(run.dir, "logs", "trainer-%d.log" % r)) as f:
                self.assertIn("staged in an exported cuda buffer", f.read())
        with open(os.path.join(run.dir, "logs", "checkpointer-0.log")) as f:
            log = f.read()
        for r in range(RANKS):
            self.assertGreaterEqual(log.count("imported rank %d's staging buffer (cuda" % r), 2,
                                    log[-3000:])
        v = run_harness.megacpp(["verify", run.dir])
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)

    def failure(self, sig, kinds):
        run = run_harness.Run(self.tmp, steps=100000, ranks=RANKS,
                              extra=["--device", "cuda", "--hang-budget-s", "5",
                                     "--heartbeat-timeout-s", "3"])
        run.launch()
        run.wait_steps(3, timeout=300)
        victim = RANKS - 1
        os.kill(run.pid("trainer", victim), sig)
        rc = run.finish(timeout=120)
        self.assertNotEqual(rc, 0)
        m = manifest(run.dir)
        self.assertEqual(m["state"], "error", m)
        first = m["error"]
        self.assertEqual((first["stage"], first["rank"]), ("trainer", victim), first)
        self.assertIn(first["kind"], kinds, first)
        self.assertEqual(run_harness.pids_of(run.dir), [])

    def test_kill_of_a_gpu_rank_is_typed(self):
        self.failure(signal.SIGKILL, ("signaled",))

    def test_a_stopped_gpu_rank_is_a_hang(self):
        self.failure(signal.SIGSTOP, ("heartbeat_lost", "hung"))


if __name__ == "__main__":
    if not os.path.exists(PLUGIN):
        print("SKIP: this build has no CUDA plugin (%s): torch without CUDA, or no CUDA/NCCL "
              "headers at configure time" % PLUGIN)
        sys.exit(77)
    n = visible_devices()
    if n == 0:
        print("SKIP: no CUDA device is visible on this machine (torch.cuda.device_count() == 0)")
        sys.exit(77)
    RANKS = min(n, 2)
    unittest.main(verbosity=2)
