"""End-to-end: `megacpp compare` within and across comparison classes.

Two runs of `tiny` on 2 ranks are one class (same recipe hash, mode, world, backend, device,
build and data): the table prints tokens/s, step time p50/p99, checkpoint stall, restarts and the
loss at steps both recorded (equal: the runs are bit-identical), and the validation loss at
every step both evaluated after; the class names the validation set, so a run evaluating on
another one (other eval_tokens, the same recipe hash) is refused naming it. A run on 1 rank is another class:
refused in one line naming the field that differs (world), printed with --force under a
cross-class label. A run of the same recipe in bf16-mixed is another class too: its recipe hash
and its precision differ, and the manifest and bench_result.json name its precision. Fewer than two runs, or a folder that is not a run, is one line and exit 2.
"""
import json
import os
import re
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import run_harness  # noqa: E402

STEPS = 12


class Compare(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-compare-")
        cls.recipe = run_harness.tiny_recipe(cls.tmp, 4)
        data = os.path.join(cls.tmp, "data")
        cls.runs = {}
        for name, ranks in (("a", 2), ("b", 2), ("c", 1)):
            d = os.path.join(cls.tmp, name)
            p = run_harness.megacpp(["run", cls.recipe, "--ranks", str(ranks), "--steps", str(STEPS),
                                     "--run-dir", d, "--data-dir", data, "--progress", "none"])
            assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
            cls.runs[name] = d
        with open(cls.recipe) as f:
            text = f.read()
        cls.mixed_recipe = os.path.join(cls.tmp, "ck4-bf16.toml")
        with open(cls.mixed_recipe, "w") as f:
            f.write(text.replace("[train]\n", "[train]\nprecision = \"bf16-mixed\"\n", 1))
        d = os.path.join(cls.tmp, "m")
        p = run_harness.megacpp(["run", cls.mixed_recipe, "--ranks", "2", "--steps", str(STEPS),
                                 "--run-dir", d, "--data-dir", data, "--progress", "none"])
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        cls.runs["m"] = d
        # The same recipe evaluating on another validation set (half the tokens): the recipe
        # hash is the same (evaluation does not change what trains), the validation class is not.
        cls.val_recipe = os.path.join(cls.tmp, "ck4-val.toml")
        with open(cls.val_recipe, "w") as f:
            f.write(text.replace("eval_tokens = 8192 ", "eval_tokens = 4096 "))
        d = os.path.join(cls.tmp, "v")
        p = run_harness.megacpp(["run", cls.val_recipe, "--ranks", "2", "--steps", str(STEPS),
                                 "--run-dir", d, "--data-dir", data, "--progress", "none"])
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        cls.runs["v"] = d

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_one_class_side_by_side(self):
        p = run_harness.megacpp(["compare", self.runs["a"], self.runs["b"]])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        out = p.stdout
        self.assertRegex(out, r"^comparison class: recipe \S+ \([0-9a-f]+\); mode author_dp; world 2;")
        self.assertRegex(out, r"\nsteps +%d +%d\n" % (STEPS, STEPS))
        for label in ("tokens/s", "step s p50", "step s p99", "checkpoint stall s", "restarts"):
            self.assertRegex(out, r"\n%s +\S+ +\S+\n" % re.escape(label), label)
        losses = re.findall(r"\nloss @ step (\d+) +(\S+) +(\S+)", out)
        self.assertEqual(losses[0][0], "1")
        self.assertEqual(losses[-1][0], str(STEPS))
        for step, a, b in losses:
            self.assertEqual(a, b, "step %s" % step)  # bit-identical runs
        self.assertRegex(out, r"\ntokens/s vs a +1\.000x +\d+\.\d{3}x\n")
        # The held-out set is in the class, and each evaluated step has its row (tiny evaluates
        # every 10 steps and at the last).
        self.assertRegex(out, r"; validation [0-9a-f]{16};")
        val = re.findall(r"\nval loss @ step (\d+) +(\S+) +(\S+)", out)
        self.assertEqual([v[0] for v in val], ["10", str(STEPS)])
        for step, a, b in val:
            self.assertEqual(a, b, "step %s" % step)
        self.assertRegex(out, r"\nevaluation s +\d+\.\d{3} +\d+\.\d{3}\n")

    def test_another_validation_set_is_another_class(self):
        self.assertEqual(run_harness.manifest(self.runs["a"])["recipeHash"],
                         run_harness.manifest(self.runs["v"])["recipeHash"])
        p = run_harness.megacpp(["compare", self.runs["a"], self.runs["v"]])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertRegex(p.stderr, r"not one comparison class: validation [0-9a-f]{16} \(a\) vs [0-9a-f]{16} \(v\)")

    def test_another_class_is_refused_then_forced(self):
        p = run_harness.megacpp(["compare", self.runs["a"], self.runs["c"]])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        err = p.stderr.strip()
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("not one comparison class: world 2 (a) vs 1 (c)", err)
        self.assertNotIn("recipe", err.split("not one comparison class")[1])
        forced = run_harness.megacpp(["compare", self.runs["a"], self.runs["c"], "--force"])
        self.assertEqual(forced.returncode, 0, forced.stderr)
        self.assertTrue(forced.stdout.startswith("CROSS-CLASS COMPARISON (--force): world 2 (a) vs 1 (c)"),
                        forced.stdout)

    def test_a_mixed_precision_run_is_another_class(self):
        for name, want in (("a", "fp32"), ("m", "bf16-mixed")):
            # Named where the recipe names them; a recipe at the defaults leaves them out, as
            # its launch contract does.
            manifest = run_harness.manifest(self.runs[name])
            self.assertEqual((manifest.get("precision", "fp32"), manifest.get("gradReduce", "fp32"),
                              manifest.get("recompute", "none")), (want, "fp32", "none"))
            self.assertEqual("precision" in manifest, name == "m")
            # Each rank's host memory: the peak, and the peak above what the process held
            # before its model (what `megacpp plan` estimates), the largest over the ranks.
            with open(os.path.join(self.runs[name], "receipts", "bench_result.json")) as f:
                result = json.load(f)
            self.assertGreater(result["memory"]["aboveBaseline"], 0, name)
            self.assertGreater(result["memory"]["peak"], result["memory"]["aboveBaseline"], name)
        p = run_harness.megacpp(["compare", self.runs["a"], self.runs["m"]])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("precision fp32 (a) vs bf16-mixed (gradients summed in fp32) (m)", p.stderr)

    def test_bad_input_is_one_line(self):
        for args in (["compare", self.runs["a"]], ["compare", self.runs["a"], self.tmp]):
            p = run_harness.megacpp(args)
            self.assertEqual(p.returncode, 2, (args, p.stdout, p.stderr))
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, (args, p.stderr))


if __name__ == "__main__":
    unittest.main()
