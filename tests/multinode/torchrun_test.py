"""torchrun from the venv across N namespace hosts (netns_hosts.py; Torchrun2: N = 2, Torchrun4:
N = 4, chosen on the command line): one agent per host, `--nnodes N --nproc-per-node 1
--rdzv-backend c10d --rdzv-endpoint <node0's address>:PORT`, the worker /bin/sh under --no-python
(as megacpp will be started). Every rank appears, each on a host of its own, with the
environment torchrun gives a worker: RANK 0..N-1, WORLD_SIZE N, GROUP_RANK equal to RANK, one
MASTER_ADDR/MASTER_PORT naming node0. Root only (label multinode)."""
import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_hosts  # noqa: E402
from netns_hosts import Hosts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_PY = os.path.join(ROOT, ".venv", "bin", "python")
RDZV_PORT = 29400
WORKER = ('echo "host=$(hostname) RANK=$RANK WORLD_SIZE=$WORLD_SIZE GROUP_RANK=$GROUP_RANK LOCAL_RANK=$LOCAL_RANK '
          'MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT RESTART=$TORCHELASTIC_RESTART_COUNT" > "$OUT/rank-$RANK"')


class TorchrunN:
    N = 0

    def test_c10d_rendezvous(self):
        n = self.N
        if not os.path.exists(VENV_PY):
            self.fail("no venv at %s: run `bash scripts/setup.sh`" % VENV_PY)
        t0 = time.monotonic()
        with Hosts(n) as hosts:
            out = os.path.join(hosts.dir, "out")
            os.makedirs(out)
            env = dict(os.environ, OUT=out)
            agents = []
            for host in hosts.names:
                log = open(os.path.join(hosts.dir, "torchrun-%s.log" % host), "w")
                agents.append((host, log, hosts.popen(host, [
                    VENV_PY, "-m", "torch.distributed.run", "--nnodes", str(n), "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "%s:%d" % (hosts.addr("node0"), RDZV_PORT),
                    "--rdzv-id", hosts.prefix, "--max-restarts", "0", "--no-python", "sh", "-c", WORKER],
                    env=env, stdout=log, stderr=subprocess.STDOUT)))
            logs = ""
            for host, log, p in agents:
                try:
                    rc = p.wait(timeout=120)
                finally:
                    log.close()
                with open(log.name) as f:
                    logs += "--- %s\n%s" % (host, f.read())
                self.assertEqual(rc, 0, logs)
            t_run = time.monotonic() - t0
            ranks = {}
            for name in sorted(os.listdir(out)):
                with open(os.path.join(out, name)) as f:
                    ranks[name] = dict(kv.split("=", 1) for kv in f.read().split())
            self.assertEqual(sorted(ranks), ["rank-%d" % i for i in range(n)], logs)
            self.assertEqual(sorted(r["host"] for r in ranks.values()), hosts.names, ranks)
            for name, r in ranks.items():
                self.assertEqual((r["WORLD_SIZE"], r["GROUP_RANK"], r["LOCAL_RANK"], r["RESTART"]),
                                 (str(n), r["RANK"], "0", "0"), r)
            # The worker group's master is node0, whose agent hosts the store, by name or address.
            self.assertEqual(len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks.values()}), 1, ranks)
            self.assertIn(ranks["rank-0"]["MASTER_ADDR"], ("node0", hosts.addr("node0")), ranks)
            self.assertEqual(ranks["rank-0"]["host"], "node0", ranks)
        print("%d torchrun agents, start to exit: %.2f s (with hosts up and down: %.2f s)"
              % (n, t_run, time.monotonic() - t0))


class Torchrun2(TorchrunN, unittest.TestCase):
    N = 2


class Torchrun4(TorchrunN, unittest.TestCase):
    N = 4


if __name__ == "__main__":
    netns_hosts.require_root()
    unittest.main()
