"""End-to-end: `megacpp export` writes one consolidated safetensors file that PyTorch loads.

The model parameters land under the names the equivalent PyTorch module uses: the test loads
them with `safetensors.torch.load_file` into the Python peer model (bench/peers/gloo_train.py,
the `tiny` recipe's decoder in plain PyTorch), computes its loss on the batch the run trained
on next (MEGACPP_TRACE_BATCHES) and checks it against the loss the C++ trainer journaled for
that step. With --optimizer, the sharded optimizer state of a 2-rank run is reassembled: every
exported moment equals the concatenation of the rank files' shards.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "peers"))
import gloo_train  # noqa: E402  (the peer model; importing it starts nothing)

sys.path.insert(0, os.path.join(HERE, ".."))
import run_harness  # noqa: E402
from run_harness import MEGACPP  # noqa: E402

STEPS, EVERY, AT = 12, 4, 8


def megacpp(args, env=None):
    p = run_harness.megacpp(args, env=env)
    if p.returncode != 0:
        raise AssertionError(p.stdout[-2000:] + p.stderr[-2000:])
    return p


class Export(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-export-")
        cls.recipe = run_harness.tiny_recipe(cls.tmp, EVERY)
        cls.runs = {}
        for world in (1, 2):
            d = os.path.join(cls.tmp, "w%d" % world)
            megacpp(["run", cls.recipe, "--ranks", str(world), "--steps", str(STEPS), "--run-dir", d,
                     "--data-dir", os.path.join(cls.tmp, "data"), "--progress", "none"],
                    env={"MEGACPP_TRACE_BATCHES": str(STEPS)})
            cls.runs[world] = d

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_the_peer_pytorch_model_loads_it_and_computes_the_same_loss(self):
        run = self.runs[1]
        out = os.path.join(self.tmp, "model.safetensors")
        p = megacpp(["export", os.path.join(run, "checkpoints", "step_%08d" % AT), "--out", out])
        self.assertIn("exported step %d" % AT, p.stdout)
        state = load_file(out)
        model = gloo_train.Transformer()
        missing, unexpected = model.load_state_dict(state, strict=False)
        self.assertEqual(unexpected, [])
        self.assertEqual(sorted(missing), ["rope_cos", "rope_sin"], "parameters missing from the export")
        # The batch of step AT + 1, as the rank widened it (int64 [B, T + 1]).
        raw = np.fromfile(os.path.join(run, "logs", "batches-0.bin"), dtype=np.int64)
        rows = gloo_train.BATCH
        per_step = rows * (gloo_train.SEQ + 1)
        tokens = torch.from_numpy(raw[AT * per_step:(AT + 1) * per_step].reshape(rows, -1).copy())
        torch.set_num_threads(1)
        with torch.no_grad():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, gloo_train.VOCAB), tokens[:, 1:].reshape(-1)).item()
        with open(os.path.join(run, "receipts", "bench_telemetry.json")) as f:
            journaled = {s["step"]: s["loss"] for s in json.load(f)["steps"]}[AT + 1]
        # Two implementations of one function (LibTorch C++ and PyTorch, the same kernels):
        # equal up to float32 summation order.
        self.assertAlmostEqual(loss, journaled, delta=1e-4, msg="%r vs %r" % (loss, journaled))

    def test_optimizer_state_is_reassembled_from_the_shards(self):
        run = self.runs[2]
        out = os.path.join(self.tmp, "full.safetensors")
        megacpp(["export", run, "--out", out, "--optimizer"])
        exported = load_numpy(out)
        step_dir = os.path.join(run, "checkpoints", "step_%08d" % STEPS)
        shards = {}
        for r in range(2):
            path = os.path.join(step_dir, "rank_%d.safetensors" % r)
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                meta = json.loads(f.read(n))["__metadata__"]
            layout = json.loads(meta["megacpp.layout"])
            tensors = load_numpy(path)
            for name, info in layout["shards"].items():
                shards.setdefault(info["logical"], []).append((info["offset"], tensors[name]))
            stacks = layout["muon_stacks"]
        # The recipe shards DistMuon's stacks (DistAdamW's parameters are all below its
        # crossover at this size); a stack's rows go out one per member parameter.
        self.assertTrue(shards, "no sharded state in a 2-rank checkpoint")
        checked = 0
        for logical, parts in shards.items():
            whole = np.concatenate([t for _, t in sorted(parts, key=lambda x: x[0])])
            if logical in exported:
                self.assertTrue(np.array_equal(exported[logical], whole), logical)
                checked += 1
                continue
            stack, field = logical.rsplit(".", 1)
            for i, member in enumerate(stacks[stack]):
                name = "optim.muon.%s.%s" % (member, field)
                self.assertTrue(np.array_equal(exported[name], whole[i]), name)
                checked += 1
        self.assertGreater(checked, 4)
        for name in ("embed.weight", "head.weight", "blocks.0.attn.qkv.weight"):
            self.assertIn(name, exported)

    def test_a_corrupt_checkpoint_is_not_exported(self):
        src = os.path.join(self.runs[1], "checkpoints", "step_%08d" % EVERY)
        bad = os.path.join(self.tmp, "bad")
        shutil.copytree(src, bad)
        path = os.path.join(bad, "rank_0.safetensors")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 5)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
        out = os.path.join(self.tmp, "never.safetensors")
        p = subprocess.run([MEGACPP, "export", bad, "--out", out], capture_output=True, text=True)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("does not verify", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_an_out_that_cannot_be_written_is_one_line_naming_it(self):
        # The checkpoint verifies; --out lies where no file can be created: one line naming
        # it and what to do, no failed call or source location (tests/e2e/cli_errors_test.py
        # holds the other commands to the same rule).
        out = "/proc/megacpp-export.safetensors"
        p = subprocess.run([MEGACPP, "export", self.runs[1], "--out", out], capture_output=True,
                           text=True)
        self.assertEqual(p.returncode, 1, p.stderr)
        lines = p.stderr.splitlines()
        self.assertEqual(len(lines), 1, p.stderr)
        self.assertIn(out, lines[0])
        self.assertIn("--out", lines[0])
        self.assertNotIn(".cpp:", lines[0])
        self.assertNotIn("failed:", lines[0])
        self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    unittest.main(verbosity=2)
