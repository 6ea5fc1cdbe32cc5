"""End-to-end: a run whose training goes non-finite fails as `diverged`, and commits nothing of it.

Rank 1's gradients are made NaN at step 7 (MEGACPP_FAULT action nan; checkpoints every 5
steps, 2 ranks): the ranks agree on it in the step's own gradient exchange, so neither commits
step 7 or anything after it. The manifest's first failure is `diverged` on trainer 1, naming the
step and what was non-finite; rank 0 is its victim. The newest checkpoint is step 5, it verifies
and holds only finite tensors, and `--resume` continues from it to an `ok` end (the fault fires
in the first attempt only).
"""
import os
import shutil
import struct
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import run_harness  # noqa: E402
from run_harness import manifest, pids_of  # noqa: E402


def finite_float32(path):
    """Whether every F32 tensor of a safetensors file is finite (NaN/inf have exponent 0xff)."""
    import json
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    for name, t in header.items():
        if name == "__metadata__" or t["dtype"] != "F32":
            continue
        a, b = t["data_offsets"]
        for (word,) in struct.iter_unpack("<I", data[a:b]):
            if (word >> 23) & 0xff == 0xff:
                return False
    return True


class Diverged(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="megacpp-diverged-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_a_nan_gradient_fails_the_run_as_diverged_and_commits_nothing_of_it(self):
        recipe = run_harness.tiny_recipe(self.tmp, 5)
        run_dir = os.path.join(self.tmp, "run")
        data = os.path.join(self.tmp, "data")
        r = run_harness.megacpp(
            ["run", recipe, "--ranks", "2", "--steps", "20", "--run-dir", run_dir,
             "--data-dir", data, "--progress", "none"],
            env={"MEGACPP_FAULT": "trainer:1:optimizer:7:nan"})
        self.assertNotEqual(r.returncode, 0, r.stdout[-2000:])
        self.assertIn("diverged", r.stdout)
        m = manifest(run_dir)
        self.assertEqual(m["state"], "error", m)
        e = m["error"]
        self.assertEqual((e["kind"], e["stage"], e["rank"]), ("diverged", "trainer", 1), e)
        self.assertIn("step 7", e["message"])
        self.assertIn("nan", e["message"])
        self.assertEqual(m["latestCheckpoint"], "checkpoints/step_00000005", m)
        steps = sorted(d for d in os.listdir(os.path.join(run_dir, "checkpoints"))
                       if d.startswith("step_"))
        self.assertEqual(steps, ["step_00000005"], steps)
        for f in os.listdir(os.path.join(run_dir, "checkpoints", "step_00000005")):
            if f.endswith(".safetensors"):
                self.assertTrue(finite_float32(
                    os.path.join(run_dir, "checkpoints", "step_00000005", f)), f)
        v = run_harness.megacpp(["verify", run_dir])
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertEqual(pids_of(run_dir), [])

        resumed = run_harness.megacpp(["run", "--resume", run_dir, "--progress", "none"])
        self.assertEqual(resumed.returncode, 0, resumed.stdout[-3000:])
        m = manifest(run_dir)
        self.assertEqual(m["state"], "ok", m)
        self.assertEqual(m["stepsCompleted"], 20, m)

    def test_a_diverged_rank_whose_report_is_lost_is_still_the_first_failure(self):
        """Every rank reads the same agreement: rank 0's victim claim may reach the supervisor
        first, and the diverged rank may exit before its own Failure message is read (the
        teardown stops reading once every process is reaped). MEGACPP_TEST_MUTE_FAILURE makes
        that loss certain: the supervisor reads what rank 1 met from its failure dump."""
        recipe = run_harness.tiny_recipe(self.tmp, 5)
        run_dir = os.path.join(self.tmp, "muted")
        r = run_harness.megacpp(
            ["run", recipe, "--ranks", "2", "--steps", "12", "--run-dir", run_dir,
             "--data-dir", os.path.join(self.tmp, "data"), "--progress", "none"],
            env={"MEGACPP_FAULT": "trainer:1:optimizer:7:nan",
                 "MEGACPP_TEST_MUTE_FAILURE": "trainer-1"})
        self.assertNotEqual(r.returncode, 0, r.stdout[-2000:])
        self.assertNotIn("trainer-1 reports", r.stdout + r.stderr)  # the message was not sent
        e = manifest(run_dir)["error"]
        self.assertEqual((e["kind"], e["stage"], e["rank"]), ("diverged", "trainer", 1), e)
        self.assertIn("step 7", e["message"])
        self.assertIn("nan", e["message"])
        self.assertEqual(pids_of(run_dir), [])


if __name__ == "__main__":
    unittest.main()
