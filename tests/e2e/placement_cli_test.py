"""`megacpp run` resolves this node's place in its job (supervisor/placement.h) before anything
else is read or written:

- a job across nodes (--nodes 2, or Slurm's SLURM_NNODES=2, torchrun's, Kubernetes') is refused
  in one line naming the source that asked for it (this build runs one node); nothing written;
- a bad flag or variable, and a flag contradicting the engine, are one line naming both;
- a one-node Slurm job runs: torch-free, it gets past the placement to the store plugin's
  refusal; in a full build it trains 2 steps and receipts/runtime_provenance.json records the
  placement with source "slurm" (and a run with no engine records "single").

The child's environment is built from scratch (no SLURM_*, PET_*, ... of the machine running
the test leaks in). MEGACPP_BIN names the binary (set by ctest).
"""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

MEGACPP = os.environ["MEGACPP_BIN"]
PLUGIN = os.path.join(os.path.dirname(MEGACPP), "libmegacpp_store.so")
# What a run needs of the test's environment; every scheduler variable is left out.
KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "LD_LIBRARY_PATH")


def megacpp(args, env=None, timeout=300):
    base = {k: v for k, v in os.environ.items() if k in KEEP}
    base.update(env or {})
    return subprocess.run([MEGACPP, *args], capture_output=True, text=True, timeout=timeout,
                          env=base)


def slurm(nnodes, nodeid, nodelist):
    return {"SLURM_JOB_ID": "4242", "SLURM_NNODES": str(nnodes), "SLURM_NODEID": str(nodeid),
            "SLURM_JOB_NODELIST": nodelist}


class Placement(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="megacpp-placement-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.run_dir = os.path.join(self.tmp, "run")
        self.data = os.path.join(self.tmp, "data")

    def run_args(self, *extra):
        return ["run", "tiny", "--run-dir", self.run_dir, "--data-dir", self.data, "--steps", "2",
                "--ranks", "1", "--progress", "none", *extra]

    def refused(self, p, *needles):
        """One line, exit 2, naming every needle; nothing written."""
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        lines = p.stderr.splitlines()
        self.assertEqual(len(lines), 1, p.stderr)
        self.assertTrue(lines[0].startswith("megacpp: error: "), lines[0])
        for n in needles:
            self.assertIn(n, lines[0])
        self.assertNotIn(".cpp:", lines[0])
        self.assertFalse(os.path.exists(self.run_dir))
        self.assertFalse(os.path.exists(self.data))
        return lines[0]

    def test_a_job_across_nodes_without_the_jobs_keys_is_refused_naming_its_source(self):
        cases = [
            ([ "--nodes", "2", "--node-rank", "1", "--master", "head:29600"], {},
             "flags (--nodes 2)"),
            ([], slurm(2, 1, "node[01-02]"), "slurm (SLURM_NNODES=2)"),
            ([], {"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1",
                  "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
                  "TORCHELASTIC_RUN_ID": "t"}, "torchrun (GROUP_WORLD_SIZE=4)"),
            ([], {"JOB_COMPLETION_INDEX": "1", "MEGACPP_NODES": "2",
                  "MEGACPP_HOST_PATTERN": "w-{index}.svc"}, "kubernetes (MEGACPP_NODES=2)"),
        ]
        for flags, env, source in cases:
            with self.subTest(source=source):
                self.refused(megacpp(self.run_args(*flags), env),
                             "a job across nodes needs the job's keys", "megacpp keys FILE", source)

    def test_bad_values_and_contradictions_are_one_line(self):
        cases = [
            (["--nodes", "0"], {}, "--nodes 0: a job has at least one node"),
            (["--nodes", "two"], {}, "--nodes two is not a whole number"),
            (["--nodes", "2", "--node-rank", "2", "--master", "h"], {},
             "--node-rank 2 is not below --nodes 2"),
            (["--nodes", "2", "--node-rank", "0", "--master", "h:70000"], {},
             "--master h:70000: 70000 is not a port"),
            ([], slurm(2, 0, "n[1-"), "SLURM_JOB_NODELIST=n[1- is not a Slurm host list"),
            ([], slurm(2, 5, "n[1-2]"), "SLURM_NODEID=5 is not below SLURM_NNODES=2"),
            (["--node-rank", "1"], slurm(2, 0, "n[1-2]"),
             "--node-rank 1 disagrees with SLURM_NODEID=0 (slurm)"),
            (["--iface", "eth1"], {"GLOO_SOCKET_IFNAME": "eth0"},
             "--iface eth1 disagrees with GLOO_SOCKET_IFNAME=eth0"),
        ]
        for flags, env, needle in cases:
            with self.subTest(needle=needle):
                self.refused(megacpp(self.run_args(*flags), env), needle)

    def provenance(self):
        with open(os.path.join(self.run_dir, "receipts", "runtime_provenance.json")) as f:
            return json.load(f)["placement"]

    def test_a_one_node_slurm_job_runs_and_records_slurm(self):
        p = megacpp(self.run_args(), slurm(1, 0, "gpu17"))
        self.assertNotIn("across nodes", p.stderr)
        self.assertNotIn("SLURM", p.stderr)
        if not os.path.exists(PLUGIN):
            # Torch-free: past the placement, to the store plugin's refusal.
            self.assertIn("libmegacpp_store.so", p.stderr)
            return
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        place = self.provenance()
        self.assertEqual(place["source"], "slurm")
        self.assertEqual(place["nodes"], 1)
        self.assertEqual(place["nodeRank"], 0)
        self.assertEqual(place["masterHost"], "gpu17")
        self.assertEqual(place["masterPort"], 29500)
        self.assertEqual(place["hosts"], ["gpu17"])
        self.assertEqual(place["jobId"], "4242")
        self.assertEqual(place["attempt"], 0)
        self.assertEqual(place["nodesFrom"], "SLURM_NNODES=1")

    def test_a_run_with_no_engine_records_single(self):
        p = megacpp(self.run_args("--iface", "lo"))
        if not os.path.exists(PLUGIN):
            self.assertIn("libmegacpp_store.so", p.stderr)
            return
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        place = self.provenance()
        self.assertEqual(place["source"], "single")
        self.assertEqual(place["nodes"], 1)
        self.assertEqual(place["masterHost"], "")
        self.assertEqual(place["iface"], "lo")


if __name__ == "__main__":
    unittest.main()
