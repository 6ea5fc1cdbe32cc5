"""megacpp across a real Slurm cluster of 2 namespace nodes (slurm_cluster.py): an `sbatch -N 2`
job whose `srun` step starts one `megacpp run` per node. Each node reads its place from Slurm's
own variables (SLURM_STEP_NUM_NODES, SLURM_NODEID, SLURM_STEP_NODELIST expanded to node0,node1;
node 0 = node0, the default port), joins node 0's store and trains its 2 ranks of the world of 4.
Checked: the job COMPLETED, each node's launch contract records source slurm with its ranks,
each node's part of the final checkpoint verifies, and every rank's tensors equal a one-node
run of 4 ranks. Then every process of node1 is killed in a second job: node0's megacpp ends
with `node_lost` naming node 1, the Slurm job ends, no process of it is left. And a job that
failed after a checkpoint, requeued (`scontrol requeue`), resumes on every node and COMPLETED.

Usage: megacpp_slurm_test.py MEGACPP [unittest args]. Root only (label multinode).
"""
import json
import os
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_hosts  # noqa: E402
import slurm_cluster  # noqa: E402
from megacpp_nodes_test import latest, steps_completed, tensors, tiny_every_4, trainer_pid  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402

MEGACPP = None
STEPS = 6


def is_megacpp(pid):
    """A process of megacpp's own (its supervisor or a stage), by executable."""
    try:
        return os.path.basename(os.readlink("/proc/%d/exe" % pid)).startswith("megacpp")
    except OSError:
        return False

JOB = """#!/bin/sh
#SBATCH -J megacpp
srun --ntasks-per-node 1 sh -c 'exec "$0" run {recipe} --ranks 2 --steps {steps} \\
    --run-dir {d}/$(hostname)/run --iface eth0 --job-keys {keys} --progress plain' {megacpp}
"""


def job_state(c, job_id):
    """The job's JobState as `scontrol show job` says it now."""
    p = c.run(["scontrol", "show", "job", "-o", job_id], timeout=10)
    return next((f.split("=", 1)[1] for f in p.stdout.split() if f.startswith("JobState=")), "")


class MegacppSlurm(unittest.TestCase):
    def submit(self, c, steps, recipe="tiny", env=None):
        keys = os.path.join(c.dir, "job.keys")
        if not os.path.exists(keys):
            subprocess.run([MEGACPP, "keys", keys], check=True, capture_output=True)
        job = os.path.join(c.dir, "megacpp.sh")
        with open(job, "w") as f:
            f.write(JOB.format(recipe=recipe, steps=steps, d=c.dir, keys=keys, megacpp=MEGACPP))
        out = os.path.join(c.dir, "megacpp-%d.out" % steps)
        p = c.run(["sbatch", "--parsable", "-N", "2", "-o", out, job], env=env)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p.stdout.strip().split(";")[0], out

    def test_sbatch_srun_trains_across_nodes(self):
        with SlurmCluster(2) as c:
            t0 = time.monotonic()
            job_id, out = self.submit(c, STEPS)
            state = c.wait_job(job_id, bound_s=240)
            took = time.monotonic() - t0
            with open(out) as f:
                text = f.read()
            self.assertEqual(state, "COMPLETED", text[-4000:])
            one = os.path.join(c.dir, "one", "run")
            ref = subprocess.run([MEGACPP, "run", "--ranks", "4", "--steps", str(STEPS), "--run-dir", one,
                                  "--progress", "none"], capture_output=True, text=True, timeout=240)
            self.assertEqual(ref.returncode, 0, ref.stdout + ref.stderr)
            ref_ckpt = latest(one)
            compared = 0
            for i, node in enumerate(c.nodes):
                run = os.path.join(c.dir, node, "run")
                with open(os.path.join(run, "launch.json")) as f:
                    launch = json.load(f)
                place = launch["placement"]
                self.assertEqual((place["source"], place["nodes"], place.get("nodeRank", 0),
                                  place["masterHost"], place["hosts"]),
                                 ("slurm", 2, i, "node0", c.nodes), place)
                self.assertEqual((launch["world"], launch.get("firstRank", 0), launch["localRanks"]),
                                 (4, 2 * i, 2))
                ckpt = latest(run)
                v = subprocess.run([MEGACPP, "verify", ckpt], capture_output=True, text=True)
                self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
                for r in (2 * i, 2 * i + 1):
                    name = "rank_%d.safetensors" % r
                    got, want = tensors(os.path.join(ckpt, name)), tensors(os.path.join(ref_ckpt, name))
                    if r == 2 * i and i > 0:  # a node's first rank holds the replicated state too
                        rank0 = tensors(os.path.join(ref_ckpt, "rank_0.safetensors"))
                        want.update({t: v for t, v in rank0.items() if ".shard" not in t})
                    self.assertEqual(sorted(got), sorted(want))
                    for t in want:
                        self.assertTrue(got[t] == want[t], "%s %s differs from one node's" % (name, t))
                        compared += 1
            print("sbatch -N 2 + srun: job COMPLETED %.2f s after submission; %d tensors equal "
                  "one node of 4 ranks" % (took, compared))

    def test_a_killed_node_ends_the_slurm_job(self):
        with SlurmCluster(2) as c:
            job_id, out = self.submit(c, 100000)
            run0 = os.path.join(c.dir, "node0", "run")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if steps_completed(run0) >= 3:
                    break
                time.sleep(0.1)
            else:
                self.fail("the job did not train: " + open(out).read()[-3000:])
            # Every megacpp process of node1 (its slurmd and slurmstepd stay: the node's host
            # lives, its training dies).
            t0 = time.monotonic()
            c.hosts.signal("node1", signal.SIGKILL, only=is_megacpp)
            state = c.wait_job(job_id, bound_s=60)
            took = time.monotonic() - t0
            self.assertNotEqual(state, "COMPLETED")
            with open(os.path.join(run0, "manifest.json")) as f:
                error = json.load(f).get("error", {})
            self.assertEqual(error.get("kind"), "node_lost", error)
            self.assertIn("node 1 (node1) lost", error.get("message", ""), error)
            for node in c.nodes:
                left = [p for p in c.hosts.pids(node) if is_megacpp(p)]
                self.assertEqual(left, [], node)
            print("node1's megacpp killed: the Slurm job %s %.2f s later; node0: %s"
                  % (state, took, error.get("message")))

    def test_a_requeued_job_resumes_on_every_node(self):
        # Checkpoints every 4 steps; trainer-2 (node1) hangs in step 11 and is killed once step 8
        # is committed on both nodes: both megacpps fail, the job FAILED. `scontrol requeue`
        # starts the same script again (SLURM_RESTART_COUNT 1): each megacpp finds its run in its
        # run directory and resumes from step 8; the job COMPLETED, each node's part of the last
        # step equal to one node's.
        steps = 14
        with SlurmCluster(2) as c:
            recipe = tiny_every_4(c.dir)
            job_id, out = self.submit(c, steps, recipe=recipe,
                                      env={"MEGACPP_FAULT": "trainer:2:forward:11:hang"})
            runs = [os.path.join(c.dir, node, "run") for node in c.nodes]
            deadline = time.monotonic() + 120
            while not all(os.path.isdir(os.path.join(r, "checkpoints", "step_00000008")) for r in runs):
                if time.monotonic() > deadline:
                    self.fail("step 8 not committed on both nodes: " + open(out).read()[-3000:])
                time.sleep(0.05)
            pid = trainer_pid(runs[1], 2)
            self.assertTrue(pid, "trainer-2 not found")
            os.kill(pid, signal.SIGKILL)
            self.assertNotEqual(c.wait_job(job_id, bound_s=60), "COMPLETED")
            p = c.run(["scontrol", "requeue", job_id])
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            t0 = time.monotonic()
            # The requeue takes effect on slurmctld's next pass: until the job left FAILED, its
            # end is the first run's. slurmctld holds a requeued job back for its credential's
            # lifetime (120 s by default); started by hand it must be a second or more after the
            # previous run ended, or slurmd kills it ("Job credential revoked": revocations are
            # kept with a one-second resolution).
            deadline = time.monotonic() + 60
            while job_state(c, job_id) in ("FAILED", "COMPLETING"):
                self.assertLess(time.monotonic(), deadline, "the requeued job stayed FAILED")
                time.sleep(0.05)
            time.sleep(2.0)
            c.run(["scontrol", "update", "JobId=%s" % job_id, "StartTime=now"])
            state = c.wait_job(job_id, bound_s=180)
            with open(out) as f:
                log = f.read()
            if state != "COMPLETED":
                said = []
                for run in runs:
                    try:
                        with open(os.path.join(run, "manifest.json")) as f:
                            said.append(json.dumps(json.load(f).get("attempts"))[-1500:])
                    except (OSError, ValueError) as e:
                        said.append(str(e))
                with open(os.path.join(c.dir, "log", "slurmctld.log"), errors="replace") as f:
                    ctld = "".join(f.readlines()[-25:])
                self.fail("the requeued job ended %s:\n%s\n%s\nslurmctld:\n%s"
                          % (state, "\n".join(said), log[-1500:], ctld))
            for i, run in enumerate(runs):
                with open(os.path.join(run, "manifest.json")) as f:
                    m = json.load(f)
                self.assertEqual((m["state"], m["stepsCompleted"]), ("ok", steps), m.get("error"))
                self.assertEqual((m["attempts"][-1]["reason"], m["attempts"][-1]["fromStep"]),
                                 ("resume", 8), m["attempts"])
            self.assertIn("slurm started the job again", log)
            print("requeued: the Slurm job COMPLETED %.2f s after the requeue, every node resumed "
                  "from step 8" % (time.monotonic() - t0))


if __name__ == "__main__":
    netns_hosts.require_root()
    slurm_cluster.require_slurm()
    if len(sys.argv) < 2 or not os.access(sys.argv[1], os.X_OK):
        sys.exit("usage: megacpp_slurm_test.py MEGACPP: the megacpp executable of the build tree")
    MEGACPP = os.path.abspath(sys.argv.pop(1))
    unittest.main()
