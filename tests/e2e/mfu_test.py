"""bench/mfu.py on a CPU run: its FLOP accounting for tiny by hand (6 x the parameters that
multiply, plus attention's 12 x layers x d_model x seq_len per token) and its MFU as the steady
tokens/s times that over the given peak; with --twin, the PyTorch twin's under the same
accounting and the ratio of the two. Nothing is timed against a bound.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import run_harness  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")


class Mfu(unittest.TestCase):
    def test_flops_per_token_and_mfu_of_a_tiny_run(self):
        tmp = tempfile.mkdtemp(prefix="megacpp-mfu-")
        try:
            d = os.path.join(tmp, "run")
            p = run_harness.megacpp(["run", "tiny", "--ranks", "1", "--steps", "14", "--run-dir", d,
                                     "--data-dir", os.path.join(tmp, "data"), "--progress", "none"])
            self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-2000:])
            out = subprocess.run([PYTHON, os.path.join(ROOT, "bench", "mfu.py"), d, "--peak-tflops", "0.5",
                                  "--warmup", "4", "--megacpp", run_harness.MEGACPP],
                                 capture_output=True, text=True, timeout=120)
            self.assertEqual(out.returncode, 0, out.stderr)
            # tiny: 458752 parameters, of them the 256 x 128 embedding; 2 layers, d 128, seq 64.
            self.assertIn("458752 parameters, %d FLOP per token, 1 rank(s) on cpu" %
                          (6 * (458752 - 256 * 128) + 12 * 2 * 128 * 64), out.stdout)
            m = re.search(r"mfu: ([0-9.]+) tokens/s over 10 steady steps -> ([0-9.e+-]+) TFLOP/s, MFU ([0-9.e+-]+)%",
                          out.stdout)
            self.assertIsNotNone(m, out.stdout)
            tps, tflops, mfu = (float(x) for x in m.groups())
            self.assertAlmostEqual(tflops, tps * 2752512 / 1e12, delta=1e-3 * tflops)
            self.assertAlmostEqual(mfu, 100 * tflops / 0.5, delta=1e-2 * mfu)
            # The twin beside it (its own run of tiny on this CPU, 8 steps: 4 steady), under the
            # same accounting: the same model, so the same parameter count.
            out = subprocess.run([PYTHON, os.path.join(ROOT, "bench", "mfu.py"), d, "--peak-tflops", "0.5",
                                  "--warmup", "4", "--megacpp", run_harness.MEGACPP, "--twin",
                                  "--twin-steps", "8"],
                                 capture_output=True, text=True, timeout=300)
            self.assertEqual(out.returncode, 0, out.stdout[-2000:] + out.stderr[-2000:])
            m = re.search(r"mfu: twin \(PyTorch eager, DDP, fp32, torch.optim Muon \+ AdamW; 458752 "
                          r"parameters on cpu\): ([0-9.]+) tokens/s over 4 steady steps -> "
                          r"([0-9.e+-]+) TFLOP/s, MFU ([0-9.e+-]+)%", out.stdout)
            self.assertIsNotNone(m, out.stdout)
            twin_tps, twin_tflops, twin_mfu = (float(x) for x in m.groups())
            self.assertAlmostEqual(twin_tflops, twin_tps * 2752512 / 1e12, delta=1e-3 * twin_tflops)
            self.assertAlmostEqual(twin_mfu, 100 * twin_tflops / 0.5, delta=1e-2 * twin_mfu)
            m = re.search(r"mfu: ([0-9.]+) tokens/s over 10 steady steps", out.stdout)
            r = re.search(r"mfu: megacpp / twin tokens/s ([0-9.]+)", out.stdout)
            self.assertIsNotNone(r, out.stdout)
            self.assertAlmostEqual(float(r.group(1)), float(m.group(1)) / twin_tps, delta=0.01)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
