"""cpp-tiny: `megacpp prepare` turns the C++ standard library headers into a dataset, `megacpp
run cpp-tiny` trains on it (staged to a local hot directory) and its loss falls well below the
byte-level entropy; the dataset manifest is held to (vocabulary, checksums, EOS).
"""
import glob
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import unittest

MEGACPP = os.environ["MEGACPP_BIN"]
RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes")
STEPS = 40


def run(args):
    return subprocess.run([MEGACPP] + args, capture_output=True, text=True, timeout=900)


class CppTiny(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-cpp-")
        cls.data = os.path.join(cls.tmp, "data")
        cls.hot = os.path.join(cls.tmp, "hot")
        headers = sorted(glob.glob("/usr/include/c++/*/"))
        assert headers, "no /usr/include/c++/<version>/: the C++ standard library headers are missing"
        p = run(["prepare", headers[-1], "--out", os.path.join(cls.data, "cpp"), "--progress", "plain"])
        assert p.returncode == 0, p.stderr[-2000:]
        cls.prepared = p.stdout + p.stderr

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def recipe(self, **changes):
        with open(os.path.join(RECIPES, "cpp-tiny.toml")) as f:
            text = f.read()
        for key, value in changes.items():
            text, n = re.subn(r"(?m)^%s = .*$" % key, "%s = %s" % (key, value), text)
            if n == 0:
                text = text.replace("[data]\n", "[data]\n%s = %s\n" % (key, value))
        path = os.path.join(self.tmp, "cpp-%d.toml" % len(os.listdir(self.tmp)))
        with open(path, "w") as f:
            f.write(text)
        return path

    def train(self, recipe, steps, name, extra=()):
        run_dir = os.path.join(self.tmp, name)
        p = run(["run", recipe, "--ranks", "2", "--steps", str(steps), "--run-dir", run_dir,
                 "--data-dir", self.data, "--progress", "plain"] + list(extra))
        return p, run_dir

    def test_1_trains_below_the_byte_entropy_from_a_staged_copy(self):
        self.assertIn("prepared", self.prepared)
        p, run_dir = self.train(os.path.join(RECIPES, "cpp-tiny.toml"), STEPS, "run",
                                ["--stage-data", self.hot])
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-3000:])
        self.assertRegex(p.stderr, r"staged .* \d+ files copied")
        with open(os.path.join(run_dir, "launch.json")) as f:
            d = json.load(f)["dataset"]
        self.assertEqual(d["stagedFrom"], os.path.join(self.data, "cpp"))
        self.assertEqual(d["tokenizer"], "byte")
        self.assertEqual(int(d["eosId"]), 256)
        self.assertTrue(all(f["path"].startswith(self.hot) for f in d["files"]), d["files"])
        with open(os.path.join(run_dir, "receipts", "bench_result.json")) as f:
            receipt = json.load(f)
        self.assertEqual(receipt["dataset"], d)  # the receipt names the data it measured
        # runtime_provenance names the same data, with its dataset.json's digest.
        self.assertRegex(d.get("manifestXxh3", ""), r"^[0-9a-f]{16}$", d)
        with open(os.path.join(run_dir, "receipts", "runtime_provenance.json")) as f:
            self.assertEqual(json.load(f)["dataset"], d)
        self.assertEqual({v["role"] for v in receipt["volumes"]}, {"data", "checkpoints", "logs"})
        with open(os.path.join(run_dir, "receipts", "bench_telemetry.json")) as f:
            steps = json.load(f)["steps"]
        last = [s["loss"] for s in steps[-5:]]
        entropy = math.log(256)  # nats per byte of uniformly random bytes
        self.assertLess(sum(last) / len(last), 0.6 * entropy, last)
        # The sampler state rides with every step: STEPS x 2 ranks x 16 rows taken.
        self.assertEqual(int(steps[-1]["dataEpoch"]) * int(d["windows"]) + int(steps[-1]["dataCursor"]),
                         STEPS * 2 * 16)
        # cpp-tiny evaluates on the prepared val split (from the staged copy too), below the
        # byte entropy as well: what it learned holds on held-out headers.
        with open(os.path.join(run_dir, "launch.json")) as f:
            v = json.load(f)["validation"]
        self.assertEqual(v.get("off", ""), "")
        self.assertTrue(all(f["path"].startswith(self.hot) and "val" in os.path.basename(f["path"])
                            for f in v["dataset"]["files"]), v)
        val = receipt["validation"]
        self.assertEqual(val["lastStep"], STEPS)
        self.assertLess(val["lastLoss"], 0.7 * entropy, val)

    def test_2_a_second_staging_reuses_every_file(self):
        shutil.rmtree(self.hot, ignore_errors=True)
        p, _ = self.train(os.path.join(RECIPES, "cpp-tiny.toml"), 1, "stage-a", ["--stage-data", self.hot])
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        p, _ = self.train(os.path.join(RECIPES, "cpp-tiny.toml"), 1, "stage-b", ["--stage-data", self.hot])
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertRegex(p.stderr, r"0 files copied \(0\.0 MB\), \d+ unchanged files reused")

    def test_3_unpacked_windows_take_the_manifests_eos(self):
        p, run_dir = self.train(self.recipe(pack="false"), 2, "unpacked")
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        with open(os.path.join(run_dir, "launch.json")) as f:
            d = json.load(f)["dataset"]
        self.assertEqual(int(d["eosId"]), 256)
        self.assertGreater(int(d["files"][0]["documents"]), 100)

    def refused(self, recipe, *needles):
        p, run_dir = self.train(recipe, 2, "refused")
        self.assertNotEqual(p.returncode, 0)
        errors = [l for l in p.stderr.splitlines() if "error" in l]
        self.assertEqual(len(errors), 1, p.stderr)
        for n in needles:
            self.assertIn(n, errors[0])
        self.assertFalse(os.path.exists(run_dir))

    def test_4_a_vocabulary_smaller_than_the_tokenizers_is_refused(self):
        self.refused(self.recipe(vocab_size="256"), "vocab_size 256", "has 257 ids", "dataset.json")

    def test_5_a_shard_changed_after_prepare_is_refused(self):
        copy = os.path.join(self.data, "changed")
        shutil.copytree(os.path.join(self.data, "cpp"), copy)
        shard = sorted(glob.glob(os.path.join(copy, "train_*.bin")))[0]
        with open(shard, "r+b") as f:
            f.seek(2000)
            b = f.read(1)
            f.seek(2000)
            f.write(bytes([b[0] ^ 1]))
        self.refused(self.recipe(path='"changed"'), shard, "does not match", "prepare it again")


if __name__ == "__main__":
    unittest.main(verbosity=2)
