"""End-to-end: held-out evaluation on the val split (README.md "Validation loss").

BitIdentical   tiny on 2 ranks for 12 steps, evaluating every 4 steps, trains exactly as with
               evaluation off: the same losses bit for bit and the same final checkpoint bytes.
               The evaluations (steps 4, 8, 12) are in bench_telemetry.json, bench_result.json
               (last, best, their seconds, the training seconds without them) and the manifest;
               the console's progress line and final summary name the validation loss,
               `megacpp status` prints it, and /metrics (scraped while the supervisor lingers
               after the run) has megacpp_validation_loss and megacpp_validation_step.
OneNumber      The same model state evaluated at world 1, 2 and 4 gives one validation loss:
               tiny with the global batch held at 32 rows (32, 16 and 8 rows per rank),
               float32 orthogonalization and no per-rank clipping, so the ranks' parameters
               after each step differ only by the gradient sums' reduction order; evaluated after
               steps 1 and 2, the losses agree within REL (float reduction order, measured on
               AMD EPYC: at most 1.3e-7 relative). A run that fails at step 6 and is resumed from
               its step-4 checkpoint evaluates after step 8 to the bit of the uninterrupted run.
NoValSplit     llm.c shards without a val split: the run says "evaluation is off: the data has
               no val split" once at launch and trains; the manifest carries why.
"""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import run_harness  # noqa: E402

REL = 1e-5


def recipe(tmp, name, eval_every=4, eval_tokens=2048, batch=16, checkpoint_every=4, pinned=False):
    """recipes/tiny.toml with the given evaluation, batch and checkpoints; `pinned`: float32
    orthogonalization and no clipping (world-independent parameters up to reduction order)."""
    with open(os.path.join(run_harness.RECIPE_DIR, "tiny.toml")) as f:
        text = f.read()
    for old, new in (("eval_every = 10 ", "eval_every = %d " % eval_every),
                     ("eval_tokens = 8192 ", "eval_tokens = %d " % eval_tokens),
                     ("batch_size = 16 ", "batch_size = %d " % batch),
                     ("checkpoint_every = 20", "checkpoint_every = %d" % checkpoint_every)):
        assert old in text, old
        text = text.replace(old, new)
    if pinned:
        for old, new in (('muon_bf16 = "auto"', "muon_bf16 = false"), ("grad_clip = 1.0", "grad_clip = 0.0")):
            assert old in text, old
            text = text.replace(old, new)
    path = os.path.join(tmp, name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def run(tmp, name, recipe_path, ranks, steps, env=None, check=True, progress="plain"):
    d = os.path.join(tmp, name)
    p = run_harness.megacpp(["run", recipe_path, "--ranks", str(ranks), "--steps", str(steps), "--run-dir", d,
                             "--data-dir", os.path.join(tmp, "data"), "--progress", progress], env=env)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return d, p


def receipt(d, name):
    with open(os.path.join(d, "receipts", name)) as f:
        return json.load(f)


def evaluations(d):
    return {e["step"]: e["loss"] for e in receipt(d, "bench_telemetry.json").get("evaluations", [])}


class BitIdentical(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-validation-")
        cls.on, cls.on_p = run(cls.tmp, "on", recipe(cls.tmp, "on"), 2, 12)
        cls.off, _ = run(cls.tmp, "off", recipe(cls.tmp, "off", eval_every=0), 2, 12)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_training_is_bit_identical_with_and_without_evaluation(self):
        self.assertEqual(run_harness.losses(self.on), run_harness.losses(self.off))
        self.assertTrue(run_harness.final_bytes(self.on, 12, 2) == run_harness.final_bytes(self.off, 12, 2))
        # Without evaluation: no validation anywhere, and the same recipe hash.
        self.assertEqual(evaluations(self.off), {})
        self.assertNotIn("validation", receipt(self.off, "bench_result.json"))
        self.assertEqual(run_harness.manifest(self.on)["recipeHash"], run_harness.manifest(self.off)["recipeHash"])

    def test_every_document_carries_the_evaluations(self):
        evals = receipt(self.on, "bench_telemetry.json")["evaluations"]
        self.assertEqual([e["step"] for e in evals], [4, 8, 12])
        for e in evals:
            self.assertEqual(e["tokens"], 2048)  # 32 windows of 64
            self.assertGreater(e["seconds"], 0)
            self.assertTrue(1.0 < e["loss"] < 6.0, e)
        self.assertLess(evals[2]["loss"], evals[0]["loss"])  # the model learns what generalises
        result = receipt(self.on, "bench_result.json")
        for doc in (result["validation"], run_harness.manifest(self.on)["validation"]):
            self.assertEqual(doc["lastStep"], 12)
            self.assertEqual(doc["lastLoss"], evals[2]["loss"])
            self.assertEqual(doc["bestLoss"], min(e["loss"] for e in evals))
            self.assertEqual(doc["evaluations"], 3)
            self.assertEqual(doc["every"], 4)
            self.assertEqual(int(doc["windows"]), 32)
            self.assertEqual(len(doc["digest"]), 16)
            self.assertAlmostEqual(doc["seconds"], sum(e["seconds"] for e in evals), places=6)
        # The evaluations after steps 4 and 8 fall inside the training wall time and are out of
        # tokens/s; the last one comes after it.
        training = result["validation"]["trainingSeconds"]
        self.assertLess(training, result["wallSeconds"])
        self.assertAlmostEqual(result["tokensPerSecond"], result["tokens"] / training, delta=1e-6 * result["tokensPerSecond"])

    def test_console_summary_and_status_name_the_validation_loss(self):
        out = self.on_p.stdout
        self.assertRegex(out, r"\| val \d+\.\d{4} @(4|8|12) \|")
        self.assertRegex(out, r"validation  loss \d+\.\d{3} after step 12 \(best \d+\.\d{3} after step \d+\); "
                              r"3 evaluations of 2048 tokens took \d+\.\d+s, not in the tokens/s")
        self.assertIn("evaluation: every 4 steps and the last, 32 windows of the val split", out + self.on_p.stderr)
        s = run_harness.megacpp(["status", self.on])
        self.assertEqual(s.returncode, 0, s.stderr)
        self.assertRegex(s.stdout, r"validation loss \d+\.\d{4} after step 12, best \d+\.\d{4} after step \d+; "
                                   r"3 evaluations of 2048 tokens")


class Metrics(unittest.TestCase):
    def test_metrics_carry_the_newest_validation_loss(self):
        tmp = tempfile.mkdtemp(prefix="megacpp-validation-metrics-")
        try:
            d = os.path.join(tmp, "run")
            proc = subprocess.Popen(
                [run_harness.MEGACPP, "run", recipe(tmp, "m"), "--ranks", "2", "--steps", "12", "--run-dir", d,
                 "--data-dir", os.path.join(tmp, "data"), "--progress", "plain", "--metrics-linger-s", "30"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            out = ""
            try:
                for line in proc.stdout:
                    out += line
                    if "serving" in line:
                        break
                with open(os.path.join(d, "launch.json")) as f:
                    endpoint = json.load(f)["metricsEndpoint"]
                body = urllib.request.urlopen(endpoint, timeout=10).read().decode()
            finally:
                proc.send_signal(signal.SIGINT)
                out += proc.communicate(timeout=60)[0]
            self.assertEqual(proc.returncode, 0, out[-3000:])
            last = run_harness.manifest(d)["validation"]["lastLoss"]
            lines = {l.split(" ")[0]: l.split(" ")[1] for l in body.splitlines() if l.startswith("megacpp_validation_")}
            self.assertEqual(lines.get("megacpp_validation_step"), "12", body)
            # The heartbeat carries it as a float32.
            self.assertAlmostEqual(float(lines["megacpp_validation_loss"]), last, delta=1e-6 * last)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class OneNumber(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-validation-worlds-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_world_1_2_and_4_give_one_validation_loss(self):
        got = {}
        for world in (1, 2, 4):
            r = recipe(self.tmp, "w%d" % world, eval_every=1, batch=32 // world, pinned=True)
            d, _ = run(self.tmp, "w%d" % world, r, world, 2, progress="none")
            got[world] = evaluations(d)
            self.assertEqual(sorted(got[world]), [1, 2])
        worst = 0.0
        for world in (2, 4):
            for step in (1, 2):
                a, b = got[1][step], got[world][step]
                worst = max(worst, abs(a - b) / a)
                self.assertLessEqual(abs(a - b), REL * a, "world %d step %d: %r, world 1: %r" % (world, step, b, a))
        sys.stderr.write("validation: worst relative difference over worlds 1, 2, 4: %.3g\n" % worst)

    def test_a_resumed_run_evaluates_to_the_bit_of_an_uninterrupted_one(self):
        r = recipe(self.tmp, "resume", eval_every=4, checkpoint_every=4)
        whole, _ = run(self.tmp, "whole", r, 2, 8, progress="none")
        crashed, _ = run(self.tmp, "crashed", r, 2, 8, env={"MEGACPP_FAULT": "trainer:1:forward:6:segv"},
                         check=False, progress="none")
        self.assertEqual(run_harness.manifest(crashed)["state"], "error")
        p = run_harness.megacpp(["run", "--resume", crashed, "--progress", "none"])
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-3000:])
        self.assertEqual(evaluations(crashed), evaluations(whole))
        self.assertEqual(sorted(evaluations(whole)), [4, 8])


class NoValSplit(unittest.TestCase):
    def test_a_dataset_without_a_val_split_says_evaluation_is_off(self):
        tmp = tempfile.mkdtemp(prefix="megacpp-validation-none-")
        try:
            data = os.path.join(tmp, "data")
            os.makedirs(os.path.join(data, "shards"))
            tokens = [(i * 37 + i // 7) % 251 for i in range(40000)]
            header = [0] * 256
            header[0], header[1], header[2] = 20240520, 1, len(tokens)
            with open(os.path.join(data, "shards", "text_train_000000.bin"), "wb") as f:
                f.write(struct.pack("<256i", *header))
                f.write(struct.pack("<%dH" % len(tokens), *tokens))
            path = recipe(tmp, "llmc", eval_every=2)
            with open(path) as f:
                text = f.read()
            text = text.replace('source = "builtin"', 'source = "llmc"\npath = "shards"')
            text = text.replace("shard_tokens = 1048576\nshards = 2\n", "")
            with open(path, "w") as f:
                f.write(text)
            d, p = run(tmp, "run", path, 1, 4, progress="none")
            # One line at launch (the log), and the run's summary says it again.
            self.assertEqual(p.stderr.count("evaluation is off: the data has no val split"), 1, p.stderr[-3000:])
            self.assertIn("megacpp prepare --val-every K", p.stderr)
            self.assertIn("validation  evaluation is off: the data has no val split", p.stdout)
            v = run_harness.manifest(d)["validation"]
            self.assertTrue(v["off"].startswith("evaluation is off: the data has no val split"), v)
            self.assertNotIn("evaluations", receipt(d, "bench_telemetry.json"))
            self.assertEqual(run_harness.manifest(d)["stepsCompleted"], 4)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
