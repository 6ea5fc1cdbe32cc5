"""`megacpp run`'s data decisions that are made before any stage starts (torch-free: they come
before the store plugin is loaded, so a build without torch refuses the same way).

- The user's shards in --data-dir while the recipe's source is the built-in corpus by default:
  refused in one line naming the folder and the --data-source to pass; nothing written (no run
  directory, no built-in corpus in the folder). An explicit --data-source builtin passes the
  check.
- Megatron-LM's weighted blend as --data-path: refused in one line naming what is supported.

MEGACPP_BIN names the binary (set by ctest).
"""
import os
import shutil
import struct
import subprocess
import tempfile
import unittest

MEGACPP = os.environ["MEGACPP_BIN"]
PLUGIN = os.path.join(os.path.dirname(MEGACPP), "libmegacpp_store.so")


def write_llmc(path, tokens):
    """An llm.c uint16 shard as llm.c's writer lays it out: 256 int32 header, then the tokens."""
    header = [0] * 256
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


def write_megatron(prefix, docs):
    """A Megatron-LM indexed dataset (uint16), one sequence per document, as its builder writes
    it: <prefix>.bin the tokens back to back, <prefix>.idx the MMIDIDX index."""
    lengths = [len(d) for d in docs]
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(struct.pack("<%dH" % len(d), *d))
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += 2 * n
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", 8))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(docs) + 1))
        f.write(struct.pack("<%di" % len(docs), *lengths))
        f.write(struct.pack("<%dq" % len(docs), *pointers))
        f.write(struct.pack("<%dq" % (len(docs) + 1), *range(len(docs) + 1)))


def megacpp(*args, cwd=None):
    return subprocess.run([MEGACPP, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


class UserShardsWithTheBuiltinCorpus(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="megacpp-data-cli-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.data = os.path.join(self.tmp, "data")
        self.run_dir = os.path.join(self.tmp, "run")
        os.makedirs(self.data)

    def assert_refused_naming(self, source):
        before = sorted(os.listdir(self.data))
        p = megacpp("run", "tiny", "--data-dir", self.data, "--run-dir", self.run_dir,
                    "--progress", "none")
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        lines = p.stderr.splitlines()
        self.assertEqual(len(lines), 1, p.stderr)
        self.assertIn(self.data, lines[0])
        self.assertIn("--data-source %s" % source, lines[0])
        self.assertIn("built-in corpus", lines[0])
        # Nothing written: no run directory, no built-in corpus beside the user's files.
        self.assertFalse(os.path.exists(self.run_dir))
        self.assertEqual(sorted(os.listdir(self.data)), before)

    def test_llmc_shards_are_refused_with_the_flag_to_pass(self):
        write_llmc(os.path.join(self.data, "train_000000.bin"), list(range(256)) * 40)
        self.assert_refused_naming("llmc")

    def test_a_megatron_dataset_is_refused_with_the_flag_to_pass(self):
        write_megatron(os.path.join(self.data, "corpus_text_document"), [list(range(200))] * 30)
        self.assert_refused_naming("megatron")

    def test_files_that_are_no_shards_are_not_taken_for_data(self):
        # A .bin without llm.c's magic is not a shard: the run goes on to its next check.
        with open(os.path.join(self.data, "weights.bin"), "wb") as f:
            f.write(b"\x00" * 4096)
        p = megacpp("run", "tiny", "--data-dir", self.data, "--run-dir", self.run_dir,
                    "--steps", "2", "--progress", "none")
        self.assertNotIn("--data-source", p.stderr)
        if not os.path.exists(PLUGIN):
            self.assertIn("libmegacpp_store.so", p.stderr)

    def test_an_explicit_builtin_source_keeps_the_builtin_corpus(self):
        write_llmc(os.path.join(self.data, "train_000000.bin"), list(range(256)) * 40)
        p = megacpp("run", "tiny", "--data-dir", self.data, "--run-dir", self.run_dir,
                    "--data-source", "builtin", "--steps", "2", "--progress", "none")
        self.assertNotIn("--data-source", p.stderr)
        if os.path.exists(PLUGIN):
            # A full build trains on the built-in corpus, written beside the user's files.
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertTrue(any(n.startswith("builtin-v1-") for n in os.listdir(self.data)))
        else:
            # A torch-free build gets past the data decision to the store plugin's refusal.
            self.assertIn("libmegacpp_store.so", p.stderr)


class MegatronBlend(unittest.TestCase):
    def test_a_weighted_blend_on_the_command_line_is_refused_in_one_line(self):
        # Megatron-LM's `--data-path 0.3 A 0.7 B`: refused naming what is supported, before
        # anything is written (torch-free: before the store plugin loads).
        tmp = tempfile.mkdtemp(prefix="megacpp-data-cli-")
        self.addCleanup(shutil.rmtree, tmp, True)
        for prefix in ("a_text_document", "b_text_document"):
            write_megatron(os.path.join(tmp, prefix), [list(range(1, 200))] * 30)
        run_dir = os.path.join(tmp, "run")
        p = megacpp("run", "tiny", "--data-source", "megatron", "--data-path",
                    "0.3 a_text_document 0.7 b_text_document", "--data-dir",
                    os.path.join(tmp, "data"), "--run-dir", run_dir, "--progress", "none", cwd=tmp)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        lines = p.stderr.splitlines()
        self.assertEqual(len(lines), 1, p.stderr)
        self.assertIn("weighted blend", lines[0])
        self.assertIn("pass one Megatron prefix, a directory or a glob", lines[0])
        self.assertFalse(os.path.exists(run_dir))
        self.assertFalse(os.path.exists(os.path.join(tmp, "data")))


if __name__ == "__main__":
    unittest.main(verbosity=2)
