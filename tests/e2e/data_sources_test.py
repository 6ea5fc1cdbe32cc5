"""Training on the user's data: shards written by each ecosystem's reference layout train
through `megacpp run`, every rank's first batch equals the tokens at the offsets the sampler
contract names, and every bad input is refused in one line before anything is written.

The llm.c layout is written the way llm.c's dev/data/data_common.py writes it (a 256 x int32
header: magic, version, token count; then uint16 or uint32 tokens); Megatron's indexed
dataset the way megatron/core/datasets/indexed_dataset.py does ("MMIDIDX\\0\\0", version,
dtype code, counts, int32 lengths, int64 byte pointers, int64 document indices).

The expected windows come from this file's own copy of the sampler contract (data/sampler.h):
position p of the one global sequence is window perm_e(p mod n) of epoch e = p div n, where
perm_e(x) = (a x + c) mod n with a, c drawn by splitmix64 from seed ^ (e * 0xd1b54a32d192ed03);
rank r of W takes positions ((step - 1) W + r) B + row.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

MEGACPP = os.environ["MEGACPP_BIN"]
M64 = (1 << 64) - 1


def splitmix64(s):
    s = (s + 0x9E3779B97F4A7C15) & M64
    z = s
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31), s


def permute(seed, epoch, x, n):
    s = seed ^ ((epoch * 0xD1B54A32D192ED03) & M64)
    r, s = splitmix64(s)
    a = (r % n) | 1
    while math.gcd(a, n) != 1:
        a += 2
    r, s = splitmix64(s)
    c = r % n
    return (a * x + c) % n


def write_llmc(path, tokens, wide=False):
    """llm.c's write_datafile: header[0] magic, [1] version, [2] token count."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1] = (20240801, 7) if wide else (20240520, 1)
    header[2] = len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint32 if wide else np.uint16).tobytes())


def write_megatron(prefix, documents, dtype=np.uint16):
    """Megatron's IndexedDatasetBuilder + finalize for text: one sequence per document."""
    codes = {np.uint16: 8, np.int32: 4}
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.zeros(len(documents), dtype=np.int64)
    pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize)
    with open(prefix + ".bin", "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(np.uint64(1).tobytes())
        f.write(np.uint8(codes[dtype]).tobytes())
        f.write(np.uint64(len(documents)).tobytes())
        f.write(np.uint64(len(documents) + 1).tobytes())
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(documents) + 1, dtype=np.int64).tobytes())


RECIPE = """name = "{name}"
pattern = "A"
[model]
vocab_size = {vocab}
seq_len = {seq}
d_model = 32
n_layers = 1
n_heads = 2
mlp_mult = 2
[train]
batch_size = {batch}
warmup_steps = 1
seed = {seed}
checkpoint_every = 100
[data]
source = "{source}"
path = "{path}"
{extra}
"""


def recipe(tmp, name, source, path, vocab, seq=16, batch=4, seed=99, extra=""):
    p = os.path.join(tmp, name + ".toml")
    with open(p, "w") as f:
        f.write(RECIPE.format(name=name, source=source, path=path, vocab=vocab, seq=seq, batch=batch,
                              seed=seed, extra=extra))
    return p


def run(args, env=None, cwd=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([MEGACPP] + args, capture_output=True, text=True, timeout=600, env=e,
                          cwd=cwd)


def tree(path):
    out = []
    for root, dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out.append((os.path.relpath(p, path), os.path.getsize(p)))
    return sorted(out)


class FirstBatches(unittest.TestCase):
    """Reference-written shards train; rank r's first batch is the contract's windows."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="megacpp-data-")
        self.data = os.path.join(self.tmp, "data")
        os.makedirs(self.data)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def train(self, recipe_path, ranks=2, steps=2):
        run_dir = os.path.join(self.tmp, "run")
        p = run(["run", recipe_path, "--ranks", str(ranks), "--steps", str(steps), "--run-dir", run_dir,
                 "--data-dir", self.data, "--progress", "plain"], env={"MEGACPP_TRACE_BATCHES": "1"})
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-3000:])
        with open(os.path.join(run_dir, "launch.json")) as f:
            launch = json.load(f)
        with open(os.path.join(run_dir, "manifest.json")) as f:
            self.assertEqual(json.load(f)["state"], "ok")
        return run_dir, launch

    def check_first_batches(self, run_dir, launch, files, runs_of, ranks, batch, seq, seed):
        """files: token arrays in launch order; runs_of(i, tokens) -> [(start, windows)]."""
        runs = []
        for i, toks in enumerate(files):
            for start, w in runs_of(i, toks):
                runs.append((i, start, w))
        n = sum(w for _, _, w in runs)
        self.assertEqual(int(launch["dataset"]["windows"]), n)
        before = np.cumsum([0] + [w for _, _, w in runs])
        for r in range(ranks):
            got = np.fromfile(os.path.join(run_dir, "logs", "batches-%d.bin" % r), dtype=np.int64)
            got = got.reshape(batch, seq + 1)
            for row in range(batch):
                pos = r * batch + row
                w = permute(seed, pos // n, pos % n, n)
                k = int(np.searchsorted(before, w, side="right") - 1)
                i, start, _ = runs[k]
                off = start + (w - before[k]) * seq
                want = np.asarray(files[i][off:off + seq + 1], dtype=np.int64)
                np.testing.assert_array_equal(got[row], want, "rank %d row %d window %d" % (r, row, w))

    def test_llmc_uint16_shards(self):
        rng = np.random.default_rng(5)
        files = [rng.integers(0, 500, size=n) for n in (3001, 2500, 4100)]
        for i, t in enumerate(files):
            write_llmc(os.path.join(self.data, "web_train_%06d.bin" % i), t)
        write_llmc(os.path.join(self.data, "web_val_000000.bin"), rng.integers(0, 500, size=999))
        run_dir, launch = self.train(recipe(self.tmp, "llmc16", "llmc", "", vocab=512))
        self.assertEqual(launch["dataset"]["format"], "llmc")
        self.assertEqual(launch["dataset"]["slotTokenBytes"], 2)
        self.assertEqual([os.path.basename(f["path"]) for f in launch["dataset"]["files"]],
                         ["web_train_000000.bin", "web_train_000001.bin", "web_train_000002.bin"])
        self.check_first_batches(run_dir, launch, files, lambda i, t: [(0, (len(t) - 1) // 16)],
                                 2, 4, 16, 99)
        roles = {v["role"]: v["filesystem"] for v in launch["volumes"]}
        self.assertEqual(set(roles), {"data", "checkpoints", "logs"})
        self.assertEqual(roles["data"]["path"], self.data)

    def test_llmc_uint32_shards_with_a_wide_vocabulary(self):
        rng = np.random.default_rng(6)
        files = [rng.integers(65000, 70000, size=n) for n in (2000, 2600)]
        os.makedirs(os.path.join(self.data, "wide"))
        for i, t in enumerate(files):
            write_llmc(os.path.join(self.data, "wide", "shard_train_%d.bin" % i), t, wide=True)
        run_dir, launch = self.train(recipe(self.tmp, "llmc32", "llmc", "wide/shard_{split}_*.bin",
                                            vocab=70000, seed=3))
        self.assertEqual(launch["dataset"]["tokenBytes"], 4)
        self.assertEqual(launch["dataset"]["slotTokenBytes"], 4)
        self.check_first_batches(run_dir, launch, files, lambda i, t: [(0, (len(t) - 1) // 16)],
                                 2, 4, 16, 3)

    def test_megatron_indexed_dataset_unpacked(self):
        rng = np.random.default_rng(7)
        docs = [rng.integers(1, 300, size=int(n)) for n in rng.integers(5, 90, size=120)]
        write_megatron(os.path.join(self.data, "corpus_train_text_document"), docs)
        run_dir, launch = self.train(recipe(self.tmp, "mega", "megatron", "", vocab=300,
                                            extra="pack = false"))
        self.assertEqual(launch["dataset"]["format"], "megatron")
        flat = np.concatenate(docs)
        starts = np.cumsum([0] + [len(d) for d in docs])
        runs = [(int(starts[j]), (len(d) - 1) // 16) for j, d in enumerate(docs) if (len(d) - 1) // 16 > 0]
        self.assertEqual(int(launch["dataset"]["documentsWithoutWindow"]),
                         sum(1 for d in docs if (len(d) - 1) // 16 == 0))
        self.check_first_batches(run_dir, launch, [flat], lambda i, t: runs, 2, 4, 16, 99)

    def test_megatron_prefix_relative_to_the_working_directory(self):
        # Megatron-LM's naming: --data-path corpus_text_document is corpus_text_document.idx +
        # .bin (no split in the name), relative to where the command runs, not to --data-dir.
        rng = np.random.default_rng(9)
        docs = [rng.integers(1, 300, size=int(n)) for n in rng.integers(20, 120, size=60)]
        work = os.path.join(self.tmp, "work")
        os.makedirs(os.path.join(work, "megatron"))
        write_megatron(os.path.join(work, "megatron", "corpus_text_document"), docs)
        run_dir = os.path.join(self.tmp, "run")
        p = run(["run", recipe(self.tmp, "prefix", "megatron", "", vocab=300), "--ranks", "2",
                 "--steps", "2", "--run-dir", run_dir, "--data-dir", self.data,
                 "--data-source", "megatron", "--data-path", "megatron/corpus_text_document",
                 "--progress", "plain"], env={"MEGACPP_TRACE_BATCHES": "1"}, cwd=work)
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-3000:])
        with open(os.path.join(run_dir, "launch.json")) as f:
            launch = json.load(f)
        self.assertEqual([f["path"] for f in launch["dataset"]["files"]],
                         [os.path.join(work, "megatron", "corpus_text_document.bin")])
        flat = np.concatenate(docs)
        self.check_first_batches(run_dir, launch, [flat], lambda i, t: [(0, (len(t) - 1) // 16)],
                                 2, 4, 16, 99)

    def test_megatron_int32_packed(self):
        rng = np.random.default_rng(8)
        docs = [rng.integers(0, 90000, size=int(n)) for n in rng.integers(20, 200, size=40)]
        write_megatron(os.path.join(self.data, "big_train"), docs, dtype=np.int32)
        run_dir, launch = self.train(recipe(self.tmp, "mega32", "megatron", "big_{split}.idx",
                                            vocab=90000, seed=11))
        self.assertEqual(launch["dataset"]["tokenBytes"], 4)
        flat = np.concatenate(docs)
        self.check_first_batches(run_dir, launch, [flat], lambda i, t: [(0, (len(t) - 1) // 16)],
                                 2, 4, 16, 11)


class Refusals(unittest.TestCase):
    """Each bad input: exit non-zero, one line naming the file and rule, nothing written."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="megacpp-data-bad-")
        self.data = os.path.join(self.tmp, "data")
        os.makedirs(self.data)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def refuse(self, recipe_path, *needles, ranks=2):
        before = tree(self.data)  # [] for a directory that does not exist
        run_dir = os.path.join(self.tmp, "run")
        p = run(["run", recipe_path, "--ranks", str(ranks), "--steps", "2", "--run-dir", run_dir,
                 "--data-dir", self.data])
        self.assertNotEqual(p.returncode, 0)
        err = [l for l in p.stderr.splitlines() if "error" in l]
        self.assertEqual(len(err), 1, p.stderr)
        for n in needles:
            self.assertIn(n, err[0])
        self.assertFalse(os.path.exists(run_dir), "a refused run left " + run_dir)
        self.assertEqual(tree(self.data), before)
        return err[0]

    def llmc_recipe(self, vocab=512, **kw):
        return recipe(self.tmp, "r", "llmc", "", vocab=vocab, **kw)

    def test_bad_magic(self):
        p = os.path.join(self.data, "a_train.bin")
        write_llmc(p, np.arange(2000) % 500)
        with open(p, "r+b") as f:
            f.write(np.int32(777).tobytes())
        self.refuse(self.llmc_recipe(), p, "at byte 0", "magic 777")

    def test_truncated_file(self):
        p = os.path.join(self.data, "a_train.bin")
        write_llmc(p, np.arange(2000) % 500)
        os.truncate(p, 1024 + 3000)
        self.refuse(self.llmc_recipe(), p, "says 2000 tokens")

    def test_token_beyond_the_vocabulary(self):
        p = os.path.join(self.data, "a_train.bin")
        t = np.arange(2000) % 500
        t[1234] = 600
        write_llmc(p, t)
        self.refuse(self.llmc_recipe(), p, "at byte %d" % (1024 + 1234 * 2), "token 600 at index 1234",
                    "vocab_size 512")

    def test_megatron_float_dtype(self):
        write_megatron(os.path.join(self.data, "m_train"), [np.arange(100)])
        with open(os.path.join(self.data, "m_train.idx"), "r+b") as f:
            f.seek(17)
            f.write(bytes([7]))
        self.refuse(recipe(self.tmp, "r", "megatron", "", vocab=512), "m_train.idx", "at byte 17",
                    "float32")

    def test_megatron_missing_bin(self):
        write_megatron(os.path.join(self.data, "m_train"), [np.arange(100)])
        os.remove(os.path.join(self.data, "m_train.bin"))
        self.refuse(recipe(self.tmp, "r", "megatron", "", vocab=512), "m_train.bin")

    def test_megatron_weighted_blend(self):
        for prefix in ("a_text_document", "b_text_document"):
            write_megatron(os.path.join(self.data, prefix), [np.arange(1, 200)] * 20)
        self.refuse(recipe(self.tmp, "blend", "megatron", "0.3 a_text_document 0.7 b_text_document",
                           vocab=300), "weighted blend", "pass one Megatron prefix")

    def test_empty_data_folder(self):
        self.refuse(self.llmc_recipe(), "no llmc shards", self.data)

    def test_fewer_windows_than_one_global_batch(self):
        write_llmc(os.path.join(self.data, "a_train.bin"), np.arange(100) % 500)
        self.refuse(self.llmc_recipe(), "rule data.windows", "2 ranks x 4 rows")

    def test_unknown_data_key(self):
        write_llmc(os.path.join(self.data, "a_train.bin"), np.arange(2000) % 500)
        self.refuse(self.llmc_recipe(extra="shuffle = true"), "data.shuffle", "unknown key")

    def test_unwritable_data_dir_for_the_builtin_corpus(self):
        self.data = "/proc/megacpp-data"  # the built-in corpus is written to --data-dir
        self.refuse(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes",
                                 "tiny.toml"), "/proc/megacpp-data", "not writable")

    def test_unpacked_llmc_without_eos(self):
        write_llmc(os.path.join(self.data, "a_train.bin"), np.arange(2000) % 500)
        self.refuse(self.llmc_recipe(extra="pack = false"), "data.eos_id")


if __name__ == "__main__":
    unittest.main(verbosity=2)
