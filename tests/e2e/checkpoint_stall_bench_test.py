"""bench/checkpoint_stall.py end to end on the CPU: tiny trains 16 steps with a checkpoint every 5,
and the benchmark reads its stall (journaled snapshot phase, the step after each checkpoint), makes
rank 0's share from the latest checkpoint file's header and times a copy and DCP async_save of it,
blocking and staging in the background.
Every figure and both ratios must be printed, and the share must be the checkpoint's (tensor count
and bytes as the file lists them). Times are never judged here.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import run_harness  # noqa: E402

ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")


class CheckpointStallBench(unittest.TestCase):
    def test_tiny_run_gives_every_figure(self):
        self.assertTrue(os.path.exists(run_harness.MEGACPP), "MEGACPP_BIN must name the binary")
        with tempfile.TemporaryDirectory(prefix="megacpp-stall-test-") as tmp:
            recipe = run_harness.tiny_recipe(tmp, 5)
            with open(recipe) as f:
                self.assertEqual(f.read().count("checkpoint_every = 5"), 1)
            run = os.path.join(tmp, "run")
            proc = run_harness.megacpp(["run", recipe, "--ranks", "1", "--steps", "16",
                                        "--run-dir", run, "--progress", "none"], timeout=300)
            self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-2000:])
            with open(os.path.join(run, "checkpoints", "LATEST")) as f:
                latest = os.path.join(run, "checkpoints", f.read().strip(), "rank_0.safetensors")
            with open(latest, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            nbytes = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in header.values())
            proc = subprocess.run([PYTHON, os.path.join(ROOT, "bench", "checkpoint_stall.py"), run,
                                   "--repeats", "1"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=300)
            self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
            out = proc.stdout
            # Checkpoints at 5, 10 and 15 each have a step after them within the 16.
            self.assertIn(f"share {len(header)} tensors, {nbytes / 2**30:.3f} GiB; 3 checkpoint(s)",
                          out)
            number = r"-?[0-9.]+"
            self.assertRegex(out, rf"megacpp stall +snapshot phase +{number} ms +step after the "
                                  rf"checkpoint beyond the median +{number} ms")
            self.assertRegex(out, rf"device copy +{number} ms")
            self.assertRegex(out, rf"DCP async_save +blocking +{number} ms +total +{number} ms")
            # DCP staging in the background (a new DefaultStager each save: torch 2.11's is
            # single-use), beside the step it would have to fit in.
            self.assertRegex(out, rf"DCP async staging +blocking +{number} ms +staged +{number} ms "
                                  rf"+total +{number} ms +\(median step {number} ms\)")
            self.assertRegex(out, rf"ratios: DCP async staging blocking / megacpp stall {number}, "
                                  rf"staged / megacpp stall {number}")
            self.assertRegex(out, rf"the stall +{number} ms +\(the larger of the two")
            self.assertRegex(out, rf"megacpp stall / device copy {number} .*DCP blocking / megacpp "
                                  rf"stall {number}")
            self.assertNotIn("pinned host copy", out)  # a GPU's figure only
            # DCP's checkpoints went into the run's checkpoints folder and were removed.
            self.assertFalse([d for d in os.listdir(os.path.join(run, "checkpoints"))
                              if d.startswith("dcp-")])


if __name__ == "__main__":
    unittest.main()
