"""A real Slurm cluster of N namespace nodes (slurm_cluster.py; Slurm2: N = 2, Slurm4: N = 4,
chosen on the command line): `srun -N N` runs one task on each node, in that node's network
namespace, with the real SLURM_* variables; an `sbatch` job's SLURM_JOB_NODELIST expands with
`scontrol show hostnames` to the N nodes and its `srun` step reaches each; `down` leaves no
daemon, namespace or file. Root only (label multinode)."""
import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_hosts  # noqa: E402
import slurm_cluster  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402

JOB = """#!/bin/sh
#SBATCH -J megacpp-multinode
echo "nodelist $SLURM_JOB_NODELIST nnodes $SLURM_NNODES"
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed 's/^/expanded /'
srun sh -c 'echo "step $(hostname) $SLURM_NODEID"'
"""


def daemons_of(d):
    return [int(x) for x in os.listdir("/proc") if x.isdigit() and netns_hosts._mentions(int(x), d)]


class SlurmN:
    N = 0

    def test_srun_and_sbatch(self):
        n = self.N
        t0 = time.monotonic()
        with SlurmCluster(n) as c:
            t_up = time.monotonic() - t0
            t = time.monotonic()
            p = c.run(["srun", "-N", str(n), "sh", "-c",
                       'echo "$(hostname) $SLURM_NODEID $SLURM_NNODES $SLURM_JOB_NODELIST '
                       '$(ip -4 -o addr show eth0 | awk \'{print $4}\')"'])
            t_srun = time.monotonic() - t
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            rows = sorted(line.split() for line in p.stdout.splitlines())
            nodelist = "node[0-%d]" % (n - 1)
            self.assertEqual(rows, [["node%d" % i, str(i), str(n), nodelist, c.hosts.addr("node%d" % i) + "/24"]
                                    for i in range(n)], p.stdout + p.stderr)

            job = os.path.join(c.dir, "job.sh")
            out = os.path.join(c.dir, "job.out")
            with open(job, "w") as f:
                f.write(JOB)
            t = time.monotonic()
            # Polled here: `sbatch --wait` checks at 2, 6, 14 ... s.
            p = c.run(["sbatch", "--parsable", "-N", str(n), "-o", out, job])
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            job_id = p.stdout.strip().split(";")[0]
            state = c.wait_job(job_id)
            t_sbatch = time.monotonic() - t
            with open(out) as f:
                text = f.read()
            self.assertEqual(state, "COMPLETED", text)
            lines = text.splitlines()
            self.assertIn("nodelist %s nnodes %d" % (nodelist, n), lines, text)
            self.assertEqual([ln.split()[1] for ln in lines if ln.startswith("expanded ")], c.nodes, text)
            self.assertEqual(sorted(ln for ln in lines if ln.startswith("step ")),
                             ["step node%d %d" % (i, i) for i in range(n)], text)
            d, prefix = c.hosts.dir, c.hosts.prefix
            t = time.monotonic()
        t_down = time.monotonic() - t
        self.assertEqual(daemons_of(d), [], "a daemon outlived the cluster")
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        self.assertNotIn(prefix + "-", ns)
        self.assertFalse(os.path.exists(d))
        print("%d nodes: up %.2f s, srun %.2f s, sbatch to COMPLETED %.2f s, down %.2f s" % (n, t_up, t_srun, t_sbatch, t_down))


class Slurm2(SlurmN, unittest.TestCase):
    N = 2


class Slurm4(SlurmN, unittest.TestCase):
    N = 4


if __name__ == "__main__":
    netns_hosts.require_root()
    slurm_cluster.require_slurm()
    unittest.main()
