"""megacpp's own job across namespace hosts (netns_hosts.py): one `megacpp run` per host with
`--nodes N --node-rank R --master <node0's address>:PORT --iface eth0 --job-keys K`, each node
training its 2 ranks of the job's world, node 0 hosting the job's store. Checked:

- every node ends ok and commits its own ranks' part of the final checkpoint (its manifest names
  the ranks it holds), and the tensors of every rank are bit-identical to a one-node run of the
  same world (`--ranks 2N` on one host), metadata aside (it names the run);
- a node that runs another recipe is refused on every node in one line naming node 1 and the
  field (the membership through node 0's store);
- a node without the job's keys is refused before anything is written.

Usage: megacpp_nodes_test.py MEGACPP [unittest args]. Root only (label multinode).
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_hosts  # noqa: E402
from netns_hosts import Hosts  # noqa: E402

MEGACPP = None
PORT = 29517
RANKS = 2
STEPS = 6


def tensors(path):
    """Every tensor of a safetensors file as (dtype, shape, bytes), by name; metadata left out."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        out[name] = (t["dtype"], tuple(t["shape"]), data[lo:hi])
    return out


def latest(run):
    with open(os.path.join(run, "checkpoints", "LATEST")) as f:
        return os.path.join(run, "checkpoints", f.read().strip())


class MegacppNodes(unittest.TestCase):
    N = 2

    def run_nodes(self, hosts, extra=None, keys=True, timeout=240):
        """Starts one megacpp run per host; returns [(host, rc, log text, run dir)]."""
        keyfile = os.path.join(hosts.dir, "job.keys")
        if keys and not os.path.exists(keyfile):
            subprocess.run([MEGACPP, "keys", keyfile], check=True, capture_output=True)
        procs = []
        for i, host in enumerate(hosts.names):
            run = os.path.join(hosts.dir, host, "run")
            argv = [MEGACPP, "run", "--ranks", str(RANKS), "--steps", str(STEPS), "--run-dir", run,
                    "--nodes", str(self.N), "--node-rank", str(i),
                    "--master", "%s:%d" % (hosts.addr(hosts.names[0]), PORT),
                    "--iface", "eth0", "--progress", "plain"]
            if keys:
                argv += ["--job-keys", keyfile]
            argv += (extra or {}).get(i, [])
            log = open(os.path.join(hosts.dir, "%s.log" % host), "w")
            env = dict(os.environ, MEGACPP_STORE_TIMEOUT_S="60")
            procs.append((host, run, log, hosts.popen(host, argv, env=env, stdout=log,
                                                      stderr=subprocess.STDOUT)))
        out = []
        for host, run, log, p in procs:
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = -9
            log.close()
            with open(log.name) as f:
                out.append((host, rc, f.read(), run))
        return out

    def test_a_job_across_nodes_trains_the_bits_of_one_node(self):
        n = self.N
        with Hosts(n) as hosts:
            t0 = time.monotonic()
            results = self.run_nodes(hosts)
            t_job = time.monotonic() - t0
            logs = "".join("--- %s (rc %d)\n%s" % (h, rc, text[-4000:]) for h, rc, text, _ in results)
            for host, rc, _, _ in results:
                self.assertEqual(rc, 0, logs)
            # The reference: the same world on one host.
            one = os.path.join(hosts.dir, "one", "run")
            t1 = time.monotonic()
            ref = subprocess.run([MEGACPP, "run", "--ranks", str(RANKS * n), "--steps", str(STEPS),
                                  "--run-dir", one, "--progress", "none"],
                                 capture_output=True, text=True, timeout=240)
            t_one = time.monotonic() - t1
            self.assertEqual(ref.returncode, 0, ref.stdout + ref.stderr)
            ref_ckpt = latest(one)
            compared = 0
            for i, (host, _, _, run) in enumerate(results):
                ckpt = latest(run)
                with open(os.path.join(ckpt, "checkpoint.json")) as f:
                    manifest = json.load(f)
                self.assertEqual(manifest["world"], RANKS * n, manifest)
                self.assertEqual(manifest["firstRank"], RANKS * i, manifest)
                self.assertEqual(manifest["ranks"], RANKS, manifest)
                self.assertEqual(os.path.basename(ckpt), os.path.basename(ref_ckpt))
                names = sorted(x for x in os.listdir(ckpt) if x.endswith(".safetensors"))
                self.assertEqual(names, ["rank_%d.safetensors" % r for r in range(RANKS * i, RANKS * (i + 1))])
                for name in names:
                    got, want = tensors(os.path.join(ckpt, name)), tensors(os.path.join(ref_ckpt, name))
                    self.assertEqual(sorted(got), sorted(want), name)
                    for t in want:
                        self.assertEqual(got[t][:2], want[t][:2], (name, t))
                        self.assertTrue(got[t][2] == want[t][2], "%s %s differs from the one-node run" % (name, t))
                        compared += 1
                # Every node's verify passes on its part.
                v = subprocess.run([MEGACPP, "verify", ckpt], capture_output=True, text=True)
                self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
                with open(os.path.join(run, "launch.json")) as f:
                    launch = json.load(f)
                self.assertEqual((launch["world"], launch["firstRank"], launch["localRanks"]),
                                 (RANKS * n, RANKS * i, RANKS), host)
                self.assertTrue(launch["storePrefix"].startswith("megacpp-job-"), launch["storePrefix"])
                self.assertEqual(launch["storeHost"], hosts.addr(hosts.names[0]))
            print("%d nodes x %d ranks, %d steps: %.2f s (one node of %d ranks: %.2f s); %d tensors "
                  "bit-identical" % (n, RANKS, STEPS, t_job, RANKS * n, t_one, compared))

    def test_a_node_with_another_recipe_is_refused_on_every_node(self):
        with Hosts(self.N) as hosts:
            results = self.run_nodes(hosts, extra={1: ["--mode", "nemo_native"]}, timeout=120)
            for host, rc, text, run in results:
                self.assertNotEqual(rc, 0, text)
                self.assertIn("node 1 runs recipe hash", text, "%s:\n%s" % (host, text[-3000:]))
                self.assertFalse(os.path.exists(os.path.join(run, "checkpoints", "LATEST")), host)

    def test_a_node_without_the_keys_is_refused_before_it_writes(self):
        with Hosts(1) as hosts:
            run = os.path.join(hosts.dir, "node0", "run")
            p = hosts.run(hosts.names[0], [MEGACPP, "run", "--ranks", "1", "--steps", "2", "--run-dir", run,
                                           "--nodes", "2", "--node-rank", "0", "--master",
                                           "%s:%d" % (hosts.addr(hosts.names[0]), PORT)],
                          capture_output=True, text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("needs the job's keys", p.stdout + p.stderr)
            self.assertFalse(os.path.exists(run))


if __name__ == "__main__":
    netns_hosts.require_root()
    if len(sys.argv) < 2 or not os.access(sys.argv[1], os.X_OK):
        sys.exit("usage: megacpp_nodes_test.py MEGACPP: the megacpp executable of the build tree")
    MEGACPP = os.path.abspath(sys.argv.pop(1))
    unittest.main()
