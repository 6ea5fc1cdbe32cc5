"""End-to-end: the hybrid recipes through the `megacpp` command.

Run      `megacpp run tiny-hybrid` on 2 CPU ranks: the loss falls; the manifest and the receipts
         name the mode and the expanded pattern; every step's telemetry carries the MoE's
         auxiliary loss and the tokens each expert received (summed over ranks: every token's
         top_k assignments are counted); launch.json records the gates it passed; the
         checkpoint records the mode; `megacpp export` writes a safetensors file that PyTorch
         loads, holding exactly the model's parameters with the shapes `megacpp plan` prints.
Refusals `--from` that checkpoint in the other mode (whose R is another block) is refused by
         `mode-matches-checkpoint`;
         nam56r on this CPU host, and a `--memory-budget` below the plan, by `memory-budget` —
         each in one line, before anything is written.
Plan     `megacpp plan nam56r --ranks 8` prints 52 layers in the pattern's order, in both modes.
Nemo     `megacpp run tiny-hybrid --mode nemo_native` on 2 CPU ranks (one tensor-parallel group
         with sequence parallelism; R runs the Mamba block, so the layers are AEMMAEMM) trains
         the same model as `author_dp` with the pattern AEMM on 1 rank: per-step losses within
         TP_TOLERANCE and identical tokens per expert. Its checkpoint records tensor parallel 2
         and holds each rank's weight shards; a rank's crash then `--resume` is bit-identical
         to the straight run; a branch of its checkpoint in author_dp on 1 rank (the same model,
         unsharded) continues its losses within TP_TOLERANCE.
"""
import json
import os
import re
import shutil
import sys
import tempfile
import unittest

from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import run_harness  # noqa: E402

STEPS, EVERY, RANKS = 20, 10, 2
PATTERN = "AEMEAEMEAEMR"
# nemo_native against one rank: the same batches and parameters, with float32 sums taken in
# another order (the loss summed per sequence shard, the gradients all-reduced across the
# group, the gated norm's squares summed across it). 2e-7 relative measured over 20 steps;
# 1e-5 is 50x that, far below what a wrong slice or a missing reduction does (the first step's
# loss alone moves by more than 1e-3).
TP_TOLERANCE = 1e-5


def megacpp(args, env=None):
    p = run_harness.megacpp(args, env=env)
    if p.returncode != 0:
        raise AssertionError("megacpp %s exited %d:\n%s%s" % (" ".join(args), p.returncode,
                                                             p.stdout[-3000:], p.stderr[-3000:]))
    return p


def plan_shapes(text):
    """{block kind: {parameter name: shape}} from `megacpp plan`'s shapes section."""
    shapes = {}
    for line in text.splitlines():
        m = re.match(r"^    (attention|moe|mlp|mamba2|recurrent) +(\S.*)$", line)
        if m and "[" in line:  # not the parameters-per-family lines
            shapes[m.group(1)] = dict(
                (name, [int(d) for d in dims.split("x")])
                for name, dims in re.findall(r"(\S+)\[([0-9x]+)\]", m.group(2)))
    return shapes


def write_recipe(tmp, name, pattern=None):
    """recipes/tiny-hybrid.toml checkpointing every EVERY steps (its pattern replaced when
    given), written to tmp/name; returns its path."""
    with open(os.path.join(run_harness.RECIPE_DIR, "tiny-hybrid.toml")) as f:
        text = f.read().replace("checkpoint_every = 20", "checkpoint_every = %d" % EVERY)
    if pattern is not None:
        text = re.sub(r'^pattern = "AEMR".*$', 'pattern = "%s"' % pattern, text, flags=re.M)
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(text)
    return path


class Hybrid(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-hybrid-")
        cls.recipe = write_recipe(cls.tmp, "tiny-hybrid.toml")
        cls.data = os.path.join(cls.tmp, "data")
        cls.run_dir = os.path.join(cls.tmp, "run")
        megacpp(["run", cls.recipe, "--ranks", str(RANKS), "--steps", str(STEPS), "--run-dir", cls.run_dir,
                 "--data-dir", cls.data, "--progress", "none"])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def read(self, rel):
        with open(os.path.join(self.run_dir, rel)) as f:
            return json.load(f)

    def test_the_loss_falls_and_the_records_name_mode_and_pattern(self):
        m = self.read("manifest.json")
        self.assertEqual(m["state"], "ok")
        self.assertEqual(m["stepsCompleted"], STEPS)
        self.assertEqual(m["mode"], "author_dp")
        self.assertEqual(m["blocks"], "AEMRAEMR")
        result = self.read("receipts/bench_result.json")
        self.assertEqual((result["mode"], result["blocks"]), ("author_dp", "AEMRAEMR"))
        steps = self.read("receipts/bench_telemetry.json")["steps"]
        self.assertEqual(len(steps), STEPS)
        first = sum(s["loss"] for s in steps[:3]) / 3
        last = sum(s["loss"] for s in steps[-3:]) / 3
        self.assertLess(last, first - 0.5, "loss %.3f -> %.3f" % (first, last))
        tokens_per_step = RANKS * 16 * 64  # ranks x batch x seq_len
        for s in steps:
            moe = s["moe"]
            self.assertGreater(moe["auxLoss"], 0)
            counts = moe["expertTokens"]
            self.assertEqual(len(counts), 2 * 4)  # 2 MoE layers x 4 experts
            for layer in (counts[:4], counts[4:]):
                self.assertEqual(sum(layer), tokens_per_step * 2)  # top_k = 2
        launch = self.read("launch.json")
        self.assertEqual(launch["recipe"]["model"]["arch"]["mode"], "author_dp")
        gates = {g["rule"]: g for g in launch["gates"]}
        for rule in ("tp-divides-world", "tp-divides-heads", "sp-divides-seq", "experts-divide-tp",
                     "memory-budget", "feature-built"):
            self.assertIn(rule, gates)
            self.assertTrue(gates[rule]["passed"], gates[rule])
        ck = os.path.join(self.run_dir, "checkpoints", "step_%08d" % STEPS, "checkpoint.json")
        with open(ck) as f:
            ckpt = json.load(f)
        self.assertEqual((ckpt["mode"], ckpt["tensorParallel"]), ("author_dp", 1))

    def test_the_exported_checkpoint_loads_in_pytorch_with_the_planned_shapes(self):
        out = os.path.join(self.tmp, "export.safetensors")
        megacpp(["export", self.run_dir, "--out", out])
        tensors = load_file(out)
        plan = megacpp(["plan", self.recipe, "--ranks", str(RANKS)]).stdout
        shapes = plan_shapes(plan)
        blocks = "AEMRAEMR"
        kinds = {"A": "attention", "E": "moe", "M": "mamba2", "R": "recurrent"}
        want = {"embed.weight": [256, 128], "head.weight": [256, 128]}
        for i, b in enumerate(blocks):
            for name, shape in shapes[kinds[b]].items():
                want["blocks.%d.%s" % (i, name)] = shape
            if b == "E":  # the plan prints expert 0; experts 1..3 have its shapes
                for e in range(1, 4):
                    for part in ("fc", "proj"):
                        want["blocks.%d.moe.experts.%d.%s.weight" % (i, e, part)] = \
                            shapes["moe"]["moe.experts.0.%s.weight" % part]
        self.assertEqual({k: list(v.shape) for k, v in tensors.items()}, want)
        total = int(re.search(r"total (\d+)", plan).group(1))
        self.assertEqual(sum(t.numel() for t in tensors.values()), total)
        for k, t in tensors.items():
            self.assertTrue(bool(t.isfinite().all()), k)

    def test_from_across_modes_is_refused_by_name(self):
        d = os.path.join(self.tmp, "branch")
        p = run_harness.megacpp(["run", self.recipe, "--mode", "nemo_native", "--from", self.run_dir,
                                 "--steps", str(STEPS + 5), "--run-dir", d, "--data-dir", self.data,
                                 "--progress", "none"])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        err = p.stderr.strip()
        self.assertIn("mode-matches-checkpoint", err)
        self.assertIn("author_dp", err)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertFalse(os.path.exists(d))

    def test_gates_refuse_in_one_line_before_anything_is_written(self):
        # nam56r needs ~100 GiB per rank on 2 ranks: beyond this host (the default CPU budget).
        d = os.path.join(self.tmp, "nam")
        p = run_harness.megacpp(["run", "nam56r", "--ranks", "2", "--run-dir", d, "--data-dir",
                                 self.data, "--progress", "none"])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("memory-budget", p.stderr)
        self.assertIn("this host's", p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertFalse(os.path.exists(d))
        p = run_harness.megacpp(["run", self.recipe, "--memory-budget", "0.001", "--run-dir", d,
                                 "--data-dir", self.data, "--progress", "none"])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("memory-budget", p.stderr)
        self.assertFalse(os.path.exists(d))


class Plan(unittest.TestCase):
    def test_nam56r_prints_52_layers_in_the_patterns_order_in_both_modes(self):
        for mode, r_block in (("nemo_native", "mamba2"), ("author_dp", "recurrent")):
            out = megacpp(["plan", "nam56r", "--ranks", "8", "--mode", mode]).stdout
            rows = re.findall(r"^ +(\d+)  ([AEMR])   (\w+)", out, re.M)
            self.assertEqual([int(i) for i, _, _ in rows], list(range(52)), out)
            self.assertEqual("".join(s for _, s, _ in rows), (PATTERN * 5)[:52])
            names = {"A": "attention", "E": "moe", "M": "mamba2", "R": r_block}
            self.assertEqual([b for _, _, b in rows], [names[s] for _, s, _ in rows])
            self.assertIn("mode %s" % mode, out)
            self.assertRegex(out, r"total \d+ \(")
            self.assertIn("gates:", out)
        self.assertIn("verdict: runnable by this build",
                      megacpp(["plan", "nam56r", "--ranks", "8"]).stdout)
        # A refused plan prints the plan and exits 1, so a script can gate a launch on it.
        refused = run_harness.megacpp(["plan", "nam56r", "--ranks", "8", "--memory-budget", "8"])
        self.assertEqual(refused.returncode, 1, refused.stdout[-2000:] + refused.stderr)
        self.assertIn("verdict: refused by memory-budget", refused.stdout)


class NemoNative(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-nemo-")
        cls.recipe = write_recipe(cls.tmp, "tiny-hybrid.toml")
        cls.aemm = write_recipe(cls.tmp, "tiny-aemm.toml", pattern="AEMM")
        cls.data = os.path.join(cls.tmp, "data")
        cls.nemo = cls.train("nemo", cls.recipe, RANKS, "--mode", "nemo_native")
        cls.one = cls.train("one", cls.aemm, 1)

    @classmethod
    def train(cls, name, recipe, ranks, *extra, env=None, check=True):
        d = os.path.join(cls.tmp, name)
        p = run_harness.megacpp(["run", recipe, "--ranks", str(ranks), "--steps", str(STEPS),
                                 "--run-dir", d, "--data-dir", cls.data, "--progress", "none"]
                                + list(extra), env=env)
        if check and p.returncode != 0:
            raise AssertionError("run %s exited %d:\n%s%s" % (name, p.returncode, p.stdout[-3000:],
                                                              p.stderr[-3000:]))
        return d

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def telemetry(self, d):
        with open(os.path.join(d, "receipts", "bench_telemetry.json")) as f:
            return json.load(f)["steps"]

    def test_two_ranks_as_one_tensor_parallel_group_train_as_one_rank(self):
        with open(os.path.join(self.nemo, "manifest.json")) as f:
            m = json.load(f)
        self.assertEqual((m["state"], m["mode"], m["blocks"]), ("ok", "nemo_native", "AEMMAEMM"))
        nemo, one = self.telemetry(self.nemo), self.telemetry(self.one)
        self.assertEqual(len(nemo), STEPS)
        self.assertLess(nemo[-1]["loss"], nemo[0]["loss"] - 0.5)
        for a, b in zip(nemo, one):
            self.assertLessEqual(abs(a["loss"] - b["loss"]), TP_TOLERANCE * b["loss"],
                                 "step %d: %r against %r" % (a["step"], a["loss"], b["loss"]))
            # Each rank counts the tokens its own experts received: they add up to one rank's.
            self.assertEqual(a["moe"]["expertTokens"], b["moe"]["expertTokens"], a["step"])
        with open(os.path.join(self.nemo, "receipts", "bench_result.json")) as f:
            nemo_result = json.load(f)
        with open(os.path.join(self.one, "receipts", "bench_result.json")) as f:
            one_result = json.load(f)
        self.assertEqual(nemo_result["tokens"], one_result["tokens"])  # one batch per step
        ck = os.path.join(self.nemo, "checkpoints", "step_%08d" % STEPS)
        with open(os.path.join(ck, "checkpoint.json")) as f:
            ckpt = json.load(f)
        self.assertEqual((ckpt["mode"], ckpt["tensorParallel"], ckpt["world"]), ("nemo_native", 2, 2))
        # Tensor-parallel weight shards: each rank of the group writes its parts of the split
        # matrices (and rank 1 its routed experts); export reassembles them whole.
        self.assertGreater([f["tensors"] for f in ckpt["files"]][1], 0)
        out = os.path.join(self.tmp, "nemo.safetensors")
        megacpp(["export", self.nemo, "--out", out])
        out1 = os.path.join(self.tmp, "one.safetensors")
        megacpp(["export", self.one, "--out", out1])
        a, b = load_file(out), load_file(out1)
        self.assertEqual({k: list(v.shape) for k, v in a.items()},
                         {k: list(v.shape) for k, v in b.items()})
        # The start-up receipts: both ranks computed in a tensor-parallel group of 2 over Gloo,
        # and reached their milestones in order after the launch.
        with open(os.path.join(self.nemo, "receipts", "backend_identity.json")) as f:
            ranks = json.load(f)["ranks"]
        self.assertEqual([(r["rank"], r["identity"]["tensorParallel"], r["identity"]["backend"])
                          for r in ranks], [(0, 2, "gloo"), (1, 2, "gloo")])
        with open(os.path.join(self.nemo, "receipts", "first_forward.json")) as f:
            first = json.load(f)
        for r in first["ranks"]:
            times = [r["processStartSeconds"], r["rendezvousSeconds"], r["firstForwardSeconds"],
                     r["firstBackwardSeconds"]]
            self.assertEqual(times, sorted(times), r)
            # The process start is known to a clock tick (/proc's starttime, 1/100 s), rounded
            # down: a rank started within a tick of the launch reads up to a tick before it.
            self.assertGreaterEqual(times[0], -0.01, r)
        self.assertIn(first["slowestRank"], (0, 1))
        with open(os.path.join(self.nemo, "receipts", "runtime_provenance.json")) as f:
            prov = json.load(f)
        self.assertIn("nemo_native", prov["argv"])
        self.assertGreaterEqual(prov["cpuCount"], 1)
        self.assertTrue(prov["kernel"].startswith("Linux"), prov["kernel"])

    def test_a_branch_at_another_tensor_parallel_degree_continues_the_training(self):
        # The nemo run's step-EVERY checkpoint (tensor parallel 2, each rank's weight shards)
        # branched in author_dp on 1 rank with the pattern AEMM — the same model, unsharded:
        # its steps continue the nemo run's within TP_TOLERANCE (the state is read whole, the
        # batches continue where the parent's stood).
        ck = os.path.join(self.nemo, "checkpoints", "step_%08d" % EVERY)
        d = os.path.join(self.tmp, "branch-tp1")
        p = run_harness.megacpp(["run", self.aemm, "--ranks", "1", "--from", ck, "--steps",
                                 str(STEPS), "--run-dir", d, "--data-dir", self.data,
                                 "--progress", "none"])
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-3000:])
        nemo = {s["step"]: s["loss"] for s in self.telemetry(self.nemo)}
        branch = self.telemetry(d)
        self.assertEqual([s["step"] for s in branch], list(range(EVERY + 1, STEPS + 1)))
        for s in branch:
            self.assertLessEqual(abs(s["loss"] - nemo[s["step"]]), TP_TOLERANCE * nemo[s["step"]],
                                 "step %d: %r against %r" % (s["step"], s["loss"], nemo[s["step"]]))

    def test_a_rank_crash_then_resume_is_bit_identical(self):
        d = self.train("crash", self.recipe, RANKS, "--mode", "nemo_native",
                     env={"MEGACPP_FAULT": "trainer:1:forward:14:segv"}, check=False)
        with open(os.path.join(d, "manifest.json")) as f:
            self.assertEqual(json.load(f)["state"], "error")
        p = run_harness.megacpp(["run", "--resume", d, "--progress", "none"])
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-3000:])
        self.assertEqual(run_harness.losses(d), run_harness.losses(self.nemo))
        self.assertTrue(run_harness.final_bytes(d, STEPS, RANKS)
                        == run_harness.final_bytes(self.nemo, STEPS, RANKS))


if __name__ == "__main__":
    unittest.main()
