"""End-to-end: MEGACPP_PROFILE_STEPS runs torch's profiler over a range of steps on every
trainer rank (stages/trainer/step_profile.h).

Each rank writes RUN/logs/profile-<rank>.txt naming the range and the device, with torch's
operators by host time (on a CPU rank there is no device section), and the Chrome trace
profile-<rank>.json; the profiled run trains the same losses as the same run unprofiled (the
profiler observes, it changes nothing); a value that is not FIRST:LAST is refused in one line
naming the knob. The device section (kernels, busy share) runs in `make device-check`
(gpu_small_kernels).
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import run_harness  # noqa: E402

STEPS = 5


def run(tmp, name, env=None):
    d = os.path.join(tmp, name)
    p = run_harness.megacpp(["run", "tiny", "--ranks", "2", "--steps", str(STEPS), "--run-dir", d,
                             "--progress", "none"], env=env)
    return d, p


class Profile(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-profile-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_every_rank_profiles_the_range_and_trains_the_same_losses(self):
        profiled, p = run(self.tmp, "profiled", {"MEGACPP_PROFILE_STEPS": "2:4"})
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-2000:])
        plain, p = run(self.tmp, "plain")
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-2000:])
        self.assertEqual(run_harness.losses(profiled), run_harness.losses(plain))
        for rank in (0, 1):
            with open(os.path.join(profiled, "logs", "profile-%d.txt" % rank)) as f:
                text = f.read()
            lines = text.splitlines()
            self.assertTrue(lines[0].startswith("profile of steps 2..4 (3 steps) on cpu ("), lines[0])
            self.assertNotIn("device:", text)  # a CPU rank has no device section
            self.assertIn("host: torch's operators by total time", text)
            # The model's products are among the operators, each with its calls.
            products = [l for l in lines if l.split()[-1:] in (["aten::mm"], ["aten::addmm"],
                                                               ["aten::matmul"], ["aten::linear"])]
            self.assertTrue(products, text)
            for line in products:
                total_ms, calls = float(line.split()[0]), int(line.split()[1])
                self.assertGreater(total_ms, 0.0, line)
                self.assertGreater(calls, 0, line)
            with open(os.path.join(profiled, "logs", "profile-%d.json" % rank)) as f:
                trace = json.load(f)
            names = {e.get("name") for e in trace["traceEvents"]}
            self.assertTrue(names & {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear"})
        self.assertFalse(os.path.exists(os.path.join(plain, "logs", "profile-0.txt")))

    def test_a_range_that_is_not_first_colon_last_is_refused_naming_the_knob(self):
        d, p = run(self.tmp, "bad", {"MEGACPP_PROFILE_STEPS": "4:2"})
        self.assertNotEqual(p.returncode, 0)
        message = run_harness.manifest(d)["error"]["message"]
        self.assertIn("MEGACPP_PROFILE_STEPS=4:2: give FIRST:LAST", message)
        self.assertNotIn("\n", message)


if __name__ == "__main__":
    unittest.main()
