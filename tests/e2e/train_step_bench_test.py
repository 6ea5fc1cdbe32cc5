"""bench/train_step.py end to end, one short trial of the `tiny` size: megacpp run and its Python
twin (bench/peers/train_twin.py under torchrun) both train, the twin's model has the parameter
count `megacpp plan` gives, and every figure the benchmark reports exists: tokens/s of each
side, megacpp's per-phase breakdown of a step (from bench_telemetry.json steps[].phases) and
the twin's. Times are never judged here (the machine is shared); only that each phase that must
take time was measured (> 0) and that the parts add up to no more than the step.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")


class TrainStepBench(unittest.TestCase):
    def test_tiny_trial_reports_every_figure(self):
        megacpp = os.environ.get("MEGACPP_BIN")
        self.assertTrue(megacpp and os.path.exists(megacpp), "MEGACPP_BIN must name the binary")
        with tempfile.TemporaryDirectory(prefix="megacpp-train-step-test-") as tmp:
            out = os.path.join(tmp, "bench.json")
            proc = subprocess.run(
                [PYTHON, os.path.join(ROOT, "bench", "train_step.py"), "--sizes", "tiny",
                 "--trials", "1", "--steps", "10", "--warmup", "3", "--megacpp", megacpp,
                 "--json", out], cwd=ROOT, capture_output=True, text=True, timeout=600)
            self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
            with open(out) as f:
                report = json.load(f)
        self.assertIn("ratio", proc.stdout)
        tiny = report["sizes"]["tiny"]
        self.assertEqual(tiny["params"], 458752)
        self.assertEqual(len(tiny["rates"]["megacpp"]), 1)
        self.assertEqual(len(tiny["rates"]["twin"]), 1)
        self.assertGreater(tiny["rates"]["megacpp"][0], 0)
        self.assertGreater(tiny["rates"]["twin"][0], 0)

        mine = tiny["phases_ms"]["megacpp"]
        for phase in ("forward", "backward", "reduce", "orthogonalize", "elementwise",
                      "all-gather", "clip", "handoff", "snapshot", "between"):
            self.assertIn(phase, mine)
        for phase in ("forward", "backward", "reduce", "orthogonalize", "elementwise",
                      "all-gather"):
            self.assertGreater(mine[phase], 0, phase)
        self.assertLessEqual(sum(mine.values()), tiny["step_ms"]["megacpp"] * 1.05)

        twin = tiny["phases_ms"]["twin"]
        for phase in ("forward", "backward", "optimizer_muon", "optimizer_adamw", "clip"):
            self.assertGreater(twin.get(phase, 0), 0, phase)
        self.assertGreater(tiny["optimizer_share"], 0)
        # Both sides evaluated (tiny: every 10 steps, so once in 10 steps) and were timed.
        evaluation = tiny["evaluation_tokens_per_second"]
        self.assertGreater(evaluation.get("megacpp", 0), 0)
        self.assertGreater(evaluation.get("twin", 0), 0)
        self.assertIn("evaluation (held-out, no gradients): megacpp", proc.stdout)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[1:])
