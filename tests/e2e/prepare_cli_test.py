"""`megacpp prepare` end to end: libstdc++'s bits/ headers into byte-level and
SentencePiece-1024 datasets, the summary line, every shard's XXH3 against the manifest (hashed
here through libxxhash, not through megacpp), and bad inputs refused with one line and nothing
written. MEGACPP_BIN names the binary (set by ctest).
"""
import ctypes
import ctypes.util
import glob
import json
import os
import re
import subprocess
import tempfile
import unittest

MEGACPP = os.environ["MEGACPP_BIN"]
BITS = sorted(glob.glob("/usr/include/c++/*/bits"))[-1:]
SUMMARY = re.compile(
    r"^prepared (\d+) documents \((\d+) skipped files\), (\d+) tokens in (\d+) shards "
    r"\((\d+) train, (\d+) val\), vocab (\d+) \(([a-z-]+)\), [0-9.]+ MB of text in [0-9.]+ s "
    r"\([0-9.]+ MB/s\) -> ([^;]+)(; staged to .*)?$")

_xxh = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
_xxh.XXH3_64bits.restype = ctypes.c_uint64
_xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def xxh3_hex(path):
    with open(path, "rb") as f:
        data = f.read()
    return "%016x" % _xxh.XXH3_64bits(data, len(data))


def read_dir(path):
    out = {}
    for n in os.listdir(path):
        with open(os.path.join(path, n), "rb") as f:
            out[n] = f.read()
    return out


def prepare(*args, timeout=120):
    return subprocess.run([MEGACPP, "prepare", *args], capture_output=True, text=True,
                          timeout=timeout)


@unittest.skipUnless(BITS, "no /usr/include/c++/*/bits")
class PrepareCli(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="megacpp-prepare-e2e-")
        self.addCleanup(self.tmp.cleanup)
        self.bits = BITS[0]
        self.files = sorted(os.path.join(d, f) for d, _, fs in os.walk(self.bits) for f in fs)

    def out(self, name):
        return os.path.join(self.tmp.name, name)

    def check_dataset(self, p, out, kind, vocab):
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.strip().splitlines()
        self.assertEqual(len(lines), 1, p.stdout)
        m = SUMMARY.match(lines[0])
        self.assertIsNotNone(m, lines[0])
        docs, skipped, tokens, shards, train, val, v, k, path, _ = m.groups()
        self.assertEqual(path, os.path.join(out, "dataset.json"))
        with open(path) as f:
            manifest = json.load(f)
        self.assertEqual(manifest["format"], "llmc")
        self.assertEqual(manifest["tokenWidth"], 2)
        self.assertEqual(manifest["vocabSize"], vocab)
        self.assertEqual(int(v), vocab)
        self.assertEqual(k, kind)
        self.assertEqual(manifest["tokenizer"]["kind"], kind)
        self.assertEqual(manifest["documents"], int(docs))
        self.assertEqual(manifest["skippedFiles"], int(skipped))
        self.assertEqual(int(docs) + int(skipped), len(self.files))
        self.assertEqual(len(manifest["inputs"]), len(self.files))
        self.assertEqual(len(manifest["shards"]), int(shards))
        self.assertEqual(sum(s["split"] == "train" for s in manifest["shards"]), int(train))
        self.assertEqual(sum(s["split"] == "val" for s in manifest["shards"]), int(val))
        self.assertEqual(sum(s["tokens"] for s in manifest["shards"]), int(tokens))
        self.assertEqual(sum(s["documents"] for s in manifest["shards"]), int(docs))
        for s in manifest["shards"]:
            f = os.path.join(out, s["file"])
            self.assertEqual(os.path.getsize(f), int(s["bytes"]), s["file"])
            self.assertEqual(xxh3_hex(f), s["xxh3"], s["file"])
        if manifest["tokenizer"]["file"]:
            self.assertEqual(xxh3_hex(os.path.join(out, manifest["tokenizer"]["file"])),
                             manifest["tokenizer"]["xxh3"])
        self.assertFalse([n for n in os.listdir(out) if ".tmp." in n])
        return manifest

    def test_byte_level_any_thread_count(self):
        outs = []
        for threads in ("1", "2"):
            out = self.out("bytes" + threads)
            p = prepare(self.bits, "--out", out, "--threads", threads, "--shard-tokens",
                        "1000000", "--progress", "plain")
            self.check_dataset(p, out, "byte", 257)
            outs.append(read_dir(out))
        self.assertEqual(outs[0], outs[1])
        self.assertGreater(len(outs[0]), 3)

    def test_sentencepiece_1024_and_stage(self):
        out, hot = self.out("sp"), self.out("hot")
        p = prepare(self.bits, "--out", out, "--vocab-size", "1024", "--threads", "2",
                    "--stage-to", hot, "--progress", "none")
        manifest = self.check_dataset(p, out, "sentencepiece-bpe", 1024)
        self.assertIn("; staged to %s: %d copied, 0 reused" % (hot, len(manifest["shards"]) + 1),
                      p.stdout)
        self.assertEqual(sorted(os.listdir(hot)), sorted(os.listdir(out)))
        self.assertEqual(read_dir(hot), read_dir(out))
        # The trained model loaded through --tokenizer cuts the same shards.
        again = self.out("sp-loaded")
        p = prepare(self.bits, "--out", again, "--tokenizer", os.path.join(out, "tokenizer.model"),
                    "--progress", "none")
        loaded = self.check_dataset(p, again, "sentencepiece-bpe", 1024)
        self.assertEqual(loaded["shards"], manifest["shards"])

    def assert_refused(self, p, out, code, *words):
        self.assertEqual(p.returncode, code, p.stdout + p.stderr)
        # One error line, the last (progress log lines may come before it).
        err = p.stderr.strip().splitlines()
        self.assertEqual(sum(e.startswith("megacpp: error: ") for e in err), 1, p.stderr)
        self.assertTrue(err[-1].startswith("megacpp: error: "), p.stderr)
        for w in words:
            self.assertIn(w, err[-1])
        self.assertFalse(os.path.exists(out), "refused prepare wrote %s" % out)

    def test_bad_inputs_write_nothing(self):
        out = self.out("never")
        self.assert_refused(prepare(self.out("missing"), "--out", out), out, 2, "missing",
                            "cannot be read")
        os.mkdir(self.out("empty"))
        self.assert_refused(prepare(self.out("empty"), "--out", out), out, 2, "holds no files")
        not_a_model = self.files[0]
        self.assert_refused(prepare(self.bits, "--out", out, "--tokenizer", not_a_model), out, 2,
                            not_a_model, "is not a SentencePiece model")
        with open(self.out("bin"), "wb") as f:
            f.write(b"\xff\xfe\x00")
        self.assert_refused(prepare(self.out("bin"), "--out", out), out, 2,
                            "no input file is a document")
        self.assert_refused(prepare(self.bits, "--out", out, "--val-every", "1"), out, 2,
                            "--val-every 1")
        # Usage errors caught by the option parser: exit 2 too.
        self.assert_refused(prepare(self.bits, "--out", out, "--vocab-size", "1024",
                                    "--byte-level"), out, 2, "--vocab-size excludes --byte-level")
        self.assert_refused(prepare("--out", out), out, 2, "inputs is required")
        # A directory that already holds a dataset is refused and left as it was.
        done = self.out("done")
        self.assertEqual(prepare(self.files[0], "--out", done).returncode, 0)
        before = sorted(os.listdir(done))
        p = prepare(self.bits, "--out", done)
        self.assertEqual(p.returncode, 2)
        self.assertIn("is not empty (it holds a prepared dataset)", p.stderr)
        self.assertEqual(sorted(os.listdir(done)), before)


if __name__ == "__main__":
    unittest.main(verbosity=2)
