"""End-to-end: `megacpp run` on the default recipe with 2 CPU ranks, and the CLI's refusals.

Runs real processes (supervisor, loader, two Gloo trainer ranks, collector, checkpointer) and
reads what they leave behind the way a user would: jq-able JSON, and safetensors loaded by
the Python `safetensors` package.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

MEGACPP = os.environ["MEGACPP_BIN"]
STEPS = int(os.environ.get("MEGACPP_E2E_STEPS", "40"))


def run(args, **kw):
    return subprocess.run([MEGACPP] + args, capture_output=True, text=True, timeout=600, **kw)


class DefaultRun(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-e2e-")
        cls.run_dir = os.path.join(cls.tmp, "run")
        cls.proc = run(["run", "tiny", "--ranks", "2", "--steps", str(STEPS), "--run-dir", cls.run_dir,
                        "--data-dir", os.path.join(cls.tmp, "data"), "--progress", "plain"])
        sys.stderr.write(cls.proc.stdout[-3000:] + cls.proc.stderr[-3000:])
        with open(os.path.join(cls.run_dir, "launch.json")) as f:
            cls.launch = json.load(f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def manifest(self):
        with open(os.path.join(self.run_dir, "manifest.json")) as f:
            return json.load(f)

    def test_exit_code_and_console(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-2000:])
        self.assertIn("manifest.json", self.proc.stdout)
        self.assertIn("receipts", self.proc.stdout)
        self.assertIn("step ", self.proc.stdout)

    def test_manifest_ok_and_every_process_exited_zero(self):
        m = self.manifest()
        self.assertEqual(m["state"], "ok")
        self.assertEqual(m["stepsCompleted"], STEPS)
        names = {f'{s["stage"]}-{s["rank"]}': s for s in m["stages"]}
        expected = {"collector-0", "checkpointer-0", "dataLoader-0", "trainer-0", "trainer-1"}
        self.assertTrue(expected.issubset(names.keys()), names.keys())
        for name in expected:
            s = names[name]
            self.assertIn(s["state"], ("finished", "exited"), s)
            self.assertEqual(s.get("exitCode", 0), 0, s)
            self.assertEqual(s.get("signal", 0), 0, s)
        for proc in ("collector-0", "checkpointer-0", "data_loader-0", "trainer-0", "trainer-1"):
            self.assertTrue(os.path.exists(os.path.join(self.run_dir, "logs", proc + ".log")), proc)
            self.assertTrue(os.path.exists(os.path.join(self.run_dir, "journal", proc + ".journal")), proc)
        self.assertEqual(os.listdir(os.path.join(self.run_dir, "failures")), [])

    def test_loss_falls(self):
        with open(os.path.join(self.run_dir, "receipts", "bench_result.json")) as f:
            r = json.load(f)
        self.assertEqual(r["steps"], STEPS)
        self.assertGreater(r["tokensPerSecond"], 0)
        self.assertLess(r["lastLoss"], r["firstLoss"] - 1.0, r)

    def test_receipt_names_device_and_collectives(self):
        with open(os.path.join(self.run_dir, "receipts", "bench_result.json")) as f:
            r = json.load(f)
        self.assertEqual(r["device"], "cpu")
        c = r["collectives"]
        self.assertEqual(c, self.launch["collectives"])
        self.assertEqual(c["backend"], "gloo")
        self.assertGreater(c["timeoutSeconds"], 0)
        self.assertIs(c["abortOnTeardown"], True)
        self.assertEqual(c.get("ncclAsyncErrorHandling", 0), 0, "NCCL settings on a Gloo run")

    def test_receipts_listed(self):
        m = self.manifest()
        for name in m["receipts"]:
            self.assertTrue(os.path.exists(os.path.join(self.run_dir, "receipts", name)), name)
        self.assertIn("bench_result.json", m["receipts"])

    def test_checkpoint_loads_in_python(self):
        import torch
        from safetensors import safe_open
        from safetensors.torch import load_file

        ckdir = os.path.join(self.run_dir, "checkpoints")
        with open(os.path.join(ckdir, "LATEST")) as f:
            latest = f.read().strip()
        self.assertEqual(latest, "step_%08d" % STEPS)
        self.assertEqual(sorted(d for d in os.listdir(ckdir) if d.endswith(".tmp")), [])
        model = self.launch["recipe"]["model"]
        v, d, layers = model["vocabSize"], model["dModel"], model["nLayers"]
        tensors = {}
        for r in range(2):
            t = load_file(os.path.join(ckdir, latest, "rank_%d.safetensors" % r))
            self.assertFalse(set(t) & set(tensors), "ranks overlap")
            tensors.update(t)
        self.assertEqual(tuple(tensors["model.embed.weight"].shape), (v, d))
        self.assertEqual(tuple(tensors["model.head.weight"].shape), (v, d))
        for i in range(layers):
            self.assertEqual(tuple(tensors["model.blocks.%d.attn.qkv.weight" % i].shape), (3 * d, d))
            self.assertEqual(tuple(tensors["model.blocks.%d.mlp.fc.weight" % i].shape),
                             (model["mlpMult"] * d, d))
        # Optimizer state: replicated entries whole (rank 0), sharded ones as ".shard<r>" slices
        # that the "megacpp.layout" metadata of each rank file reassembles along dim 0.
        shards, stacks = {}, {}
        for r in range(2):
            with safe_open(os.path.join(ckdir, latest, "rank_%d.safetensors" % r), "pt") as f:
                layout = json.loads(f.metadata()["megacpp.layout"])
            self.assertEqual((layout["rank"], layout["world"]), (r, 2))
            for name, m in layout["shards"].items():
                shards.setdefault(m["logical"], []).append((m["offset"], name, m["full_shape"]))
            stacks.update(layout["muon_stacks"])
        logical = {k: t for k, t in tensors.items() if k.startswith("optim.")}
        for name, parts in shards.items():
            parts.sort()
            whole = torch.cat([tensors[n] for _, n, _ in parts])
            self.assertEqual(list(whole.shape), parts[0][2], name)
            logical[name] = whole
        params = [k[len("model."):] for k in tensors if k.startswith("model.")]
        for p in params:
            if ".attn." in p or ".mlp." in p:
                continue  # DistMuon: state lives in the stacks below
            for s in ("exp_avg", "exp_avg_sq"):
                self.assertEqual(logical["optim.adamw.%s.%s" % (p, s)].shape,
                                 tensors["model." + p].shape, p)
        muon_params = [p for p in params if ".attn." in p or ".mlp." in p]
        self.assertEqual(sorted(sum(stacks.values(), [])), sorted(muon_params))
        for stack, members in stacks.items():
            mom = logical[stack + ".momentum"]
            self.assertGreaterEqual(mom.shape[0], len(members))
            for i, p in enumerate(members):
                self.assertEqual(mom[i].shape, tensors["model." + p].shape, p)
        with open(os.path.join(ckdir, latest, "checkpoint.json")) as f:
            ck = json.load(f)
        self.assertEqual(ck["step"], STEPS)
        v = run(["verify", self.run_dir])
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)

    def test_retention_keeps_the_newest_three(self):
        # The default policy reaches the checkpointer through the launch contract: of the
        # checkpoints a run commits (every checkpoint_every steps, and the last step), the
        # newest 3 stay.
        self.assertEqual(self.launch["checkpointPolicy"], {"keep": 3, "keepEvery": 0})
        every = self.launch["recipe"]["train"]["checkpointEvery"]
        committed = sorted(set(range(every, STEPS + 1, every)) | {STEPS})
        ckdir = os.path.join(self.run_dir, "checkpoints")
        self.assertEqual(sorted(os.listdir(ckdir)),
                         ["LATEST"] + ["step_%08d" % s for s in committed[-3:]])

    def test_verify_accepts_the_latest_file(self):
        # RUN/checkpoints/LATEST is followed to the checkpoint it names.
        v = run(["verify", os.path.join(self.run_dir, "checkpoints", "LATEST")])
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertIn("step_%08d verifies" % STEPS, v.stdout)
        # Any other file is refused in one line that says what to pass.
        p = run(["verify", os.path.join(self.run_dir, "launch.json")])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        lines = p.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, p.stderr)
        self.assertIn("pass a checkpoint directory", lines[0])

    def test_nothing_left_behind(self):
        prefix = self.launch["shmPrefix"].lstrip("/")
        self.assertEqual(glob.glob("/dev/shm/" + prefix + "*"), [])
        self.assertFalse(os.path.exists(self.launch["sockDir"]), self.launch["sockDir"])
        ps = subprocess.run(["pgrep", "-f", self.run_dir], capture_output=True, text=True)
        self.assertEqual(ps.stdout.strip(), "", "stage processes still running")

    def test_recollect_is_byte_identical(self):
        paths = [os.path.join(self.run_dir, "manifest.json")] + sorted(
            glob.glob(os.path.join(self.run_dir, "receipts", "*.json")))
        before = {p: open(p, "rb").read() for p in paths}
        c = run(["collect", self.run_dir])
        self.assertEqual(c.returncode, 0, c.stderr)
        for p in paths:
            self.assertEqual(open(p, "rb").read(), before[p], p)

    def test_status_reads_the_manifest(self):
        s = run(["status", self.run_dir])
        self.assertEqual(s.returncode, 0, s.stderr)
        self.assertIn("state      ok", s.stdout)
        self.assertIn("trainer-1", s.stdout)

    def test_existing_run_is_refused_untouched(self):
        before = open(os.path.join(self.run_dir, "launch.json"), "rb").read()
        p = run(["run", "tiny", "--ranks", "2", "--steps", "2", "--run-dir", self.run_dir])
        self.assertEqual(p.returncode, 2)
        self.assertIn("already holds a run", p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertEqual(open(os.path.join(self.run_dir, "launch.json"), "rb").read(), before)


class Refusals(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="megacpp-e2e-bad-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def refused(self, args, needle, **kw):
        p = run(args, **kw)
        self.assertNotEqual(p.returncode, 0, p.stdout)
        lines = p.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, p.stderr)
        self.assertTrue(lines[0].startswith("megacpp: error: "), lines[0])
        self.assertIn(needle, lines[0])
        return p

    def test_unknown_recipe_path(self):
        rd = os.path.join(self.tmp, "run")
        self.refused(["run", "/no/such/recipe.toml", "--run-dir", rd], "no such file")
        self.refused(["run", "no-such-recipe", "--run-dir", rd], "no such recipe")
        self.assertFalse(os.path.exists(rd))

    def test_ranks_zero(self):
        rd = os.path.join(self.tmp, "run")
        self.refused(["run", "--ranks", "0", "--run-dir", rd], "--ranks 0")
        self.assertFalse(os.path.exists(rd))

    def test_keep_checkpoints_zero(self):
        rd = os.path.join(self.tmp, "run")
        self.refused(["run", "--keep-checkpoints", "0", "--run-dir", rd], "--keep-checkpoints 0")
        self.assertFalse(os.path.exists(rd))

    def test_unwritable_run_dir(self):
        blocker = os.path.join(self.tmp, "a-file")
        open(blocker, "w").close()
        self.refused(["run", "--run-dir", os.path.join(blocker, "run")], "not writable")
        self.refused(["run", "--run-dir", "/proc/megacpp-run", "--data-dir", os.path.join(self.tmp, "data")],
                     "not writable")

    def test_data_volume_rule(self):
        p = subprocess.run(["stat", "-c", "%d", self.tmp, "/"], capture_output=True, text=True).stdout.split()
        if p[0] != p[1]:
            self.skipTest("temporary directory is not on the root volume here")
        rd = os.path.join(self.tmp, "run")
        self.refused(["run", "--require-data-volume", "--run-dir", rd], "rule data-volume")
        self.assertFalse(os.path.exists(rd))

    def test_device_is_cpu_or_cuda(self):
        rd = os.path.join(self.tmp, "run")
        self.refused(["run", "--device", "tpu", "--run-dir", rd], "--device tpu: must be cpu or cuda")
        self.assertFalse(os.path.exists(rd))

    def test_device_cuda_without_a_visible_device(self):
        # CUDA_VISIBLE_DEVICES="" hides every device, on a GPU machine too: refused in one line
        # before anything is written (no plugin in this build is refused the same way).
        rd = os.path.join(self.tmp, "run")
        p = self.refused(["run", "--device", "cuda", "--run-dir", rd], "--device cuda: ",
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        self.assertEqual(p.returncode, 2)
        self.assertRegex(p.stderr, r"0 CUDA device\(s\) visible|has no CUDA trainer")
        self.assertFalse(os.path.exists(rd))

    def test_invalid_recipe_names_the_rule(self):
        bad = os.path.join(self.tmp, "bad.toml")
        with open(bad, "w") as f:
            f.write('name = "bad"\n[model]\nd_model = 130\nn_heads = 4\n')
        self.refused(["run", bad, "--run-dir", os.path.join(self.tmp, "run")], "model.n_heads")

    def test_help_describes_every_subcommand(self):
        top = run(["--help"])
        self.assertEqual(top.returncode, 0)
        for sub, opts in {"run": ["--ranks", "--steps", "--run-dir", "--require-data-volume",
                                  "--keep-checkpoints", "--keep-every"],
                          "status": ["run-dir"], "collect": ["run-dirs"], "plan": ["recipe"],
                          "verify": ["path"]}.items():
            self.assertIn(sub, top.stdout)
            h = run([sub, "--help"])
            self.assertEqual(h.returncode, 0, sub)
            for o in opts:
                self.assertIn(o, h.stdout, (sub, o))
        bindir = os.path.dirname(MEGACPP)
        for stage in ("data-loader", "trainer", "collector", "checkpointer"):
            h = subprocess.run([os.path.join(bindir, "megacpp-" + stage), "--help"], capture_output=True, text=True)
            self.assertEqual(h.returncode, 0, stage)
            self.assertIn("--run-dir", h.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
