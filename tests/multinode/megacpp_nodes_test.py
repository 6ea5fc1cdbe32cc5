"""megacpp's own job across namespace hosts (netns_hosts.py): one `megacpp run` per host with
`--nodes N --node-rank R --master <node0's address>:PORT --iface eth0 --job-keys K`, each node
training its 2 ranks of the job's world, node 0 hosting the job's store. Checked (more in each
test's comment: a killed, hung, cut-off node, a killed node supervisor, a failure on one node,
--resume, --max-job-restarts (its ranks relaunched as their spares) and torchrun --max-restarts
across nodes, before and after the first checkpoint, a peer without the keys, torchrun as the
launcher, an Indexed Job's pods placed by their environment alone):

- every node ends ok and commits its own ranks' part of the final checkpoint (its manifest names
  the ranks it holds), and the tensors of every rank are bit-identical to a one-node run of the
  same world (`--ranks 2N` on one host), metadata aside (it names the run);
- a node that runs another recipe is refused on every node in one line naming node 1 and the
  field (the membership through node 0's store);
- a node without the job's keys is refused before anything is written.

Usage: megacpp_nodes_test.py MEGACPP [MegacppNodesSample | MegacppNodes | MegacppNodes4 |
unittest args] (2 or 4 hosts; the sample is `make test`'s). Root only (label multinode).
"""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_hosts  # noqa: E402
from netns_hosts import Hosts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def steps_completed(run):
    """The steps the run's manifest (the collector's, folded as the run goes) says every rank of
    its node completed; 0 before there is one."""
    try:
        with open(os.path.join(run, "manifest.json")) as f:
            return json.load(f).get("stepsCompleted", 0)
    except (OSError, ValueError):
        return 0


def trainer_pid(run, rank):
    """The pid of the trainer of `rank` started for run directory `run`, or None."""
    p = subprocess.run(["pgrep", "-f", "megacpp-trainer --run-dir %s --rank %d" % (run, rank)],
                       capture_output=True, text=True)
    found = [int(x) for x in p.stdout.split()]
    return found[0] if found else None


def tiny_every_4(directory):
    """The tiny recipe with a checkpoint every 4 steps, written to DIRECTORY/tiny4.toml (where
    every host reads it); its path."""
    with open(os.path.join(ROOT, "recipes", "tiny.toml")) as f:
        text = f.read()
    if "checkpoint_every = 20" not in text:
        raise AssertionError("recipes/tiny.toml no longer checkpoints every 20 steps")
    recipe = os.path.join(directory, "tiny4.toml")
    with open(recipe, "w") as f:
        f.write(text.replace("checkpoint_every = 20", "checkpoint_every = 4"))
    return recipe


def latest(run):
    with open(os.path.join(run, "checkpoints", "LATEST")) as f:
        return os.path.join(run, "checkpoints", f.read().strip())


class MegacppNodesN:
    N = 0

    def run_nodes(self, hosts, extra=None, keys=True, timeout=240):
        """Runs one megacpp per host to its end; returns [(host, rc, log text, run dir)]."""
        out = []
        for host, run, log, p in self.start_nodes(hosts, STEPS, extra=extra, keys=keys):
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = -9
            with open(log) as f:
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
            ref_ckpt, t_one = self.one_node(hosts, STEPS)
            compared = 0
            for i, (host, _, _, run) in enumerate(results):
                ckpt = latest(run)
                compared += self.assert_part_matches(ckpt, ref_ckpt, i)
                # The job's LATEST: the final step, committed by every node.
                with open(os.path.join(run, "checkpoints", "JOB_LATEST")) as f:
                    self.assertEqual(f.read(), os.path.basename(ckpt) + "\n")
                # Every node's verify passes on its part.
                v = subprocess.run([MEGACPP, "verify", ckpt], capture_output=True, text=True)
                self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
                with open(os.path.join(run, "launch.json")) as f:
                    launch = json.load(f)
                self.assertEqual((launch["world"], launch["firstRank"], launch["localRanks"]),
                                 (RANKS * n, RANKS * i, RANKS), host)
                self.assertTrue(launch["storePrefix"].startswith("megacpp-job-"), launch["storePrefix"])
                self.assertEqual(launch["storeHost"], hosts.addr(hosts.names[0]))
            # Node 0's job-wide manifest: every node finished the last step and committed it.
            with open(os.path.join(results[0][3], "job.json")) as f:
                job = json.load(f)
            self.assertEqual((job["state"], job["nodes"], job["slowestStep"], job["jobLatest"]),
                             ("ok", n, STEPS, STEPS), job)
            for k, node in enumerate(job["nodeList"]):
                self.assertEqual((node["node"], node["step"], node["committed"], node["state"]),
                                 (k, STEPS, STEPS, "finished"), job)
            # Folded by the collector from node 0's journal: `megacpp collect` makes it again.
            job_file = os.path.join(results[0][3], "job.json")
            with open(job_file) as f:
                before = f.read()
            os.remove(job_file)
            c = subprocess.run([MEGACPP, "collect", results[0][3]], capture_output=True, text=True)
            self.assertEqual(c.returncode, 0, c.stdout + c.stderr)
            with open(job_file) as f:
                self.assertEqual(f.read(), before)
            status = subprocess.run([MEGACPP, "status", results[0][3]], capture_output=True, text=True)
            self.assertEqual(status.returncode, 0, status.stderr)
            self.assertIn("%d nodes x %d ranks" % (n, RANKS), status.stdout)
            for k in range(n):
                self.assertIn("node %-3d" % k, status.stdout)
            # Node 0's Prometheus file_sd: every node's /metrics on its own address.
            with open(os.path.join(results[0][3], "metrics_sd.json")) as f:
                sd = json.load(f)
            self.assertEqual(len(sd), n, sd)
            for i, entry in enumerate(sd):
                self.assertEqual(len(entry["targets"]), 1, entry)
                self.assertTrue(entry["targets"][0].startswith(hosts.addr(hosts.names[i]) + ":"), entry)
                self.assertEqual((entry["labels"]["node"], entry["labels"]["ranks"]),
                                 (str(i), "%d-%d" % (RANKS * i, RANKS * i + RANKS - 1)), entry)
            print("%d nodes x %d ranks, %d steps: %.2f s (one node of %d ranks: %.2f s); %d tensors "
                  "bit-identical" % (n, RANKS, STEPS, t_job, RANKS * n, t_one, compared))

    def kill_hung_rank_once_committed(self, procs, rank, step):
        """Rank `rank` hangs (MEGACPP_FAULT ...:hang); once every node committed its part of
        `step`, it is killed (SIGKILL): the failure comes after that step, whatever the load."""
        deadline = time.monotonic() + 120
        name = "step_%08d" % step
        while time.monotonic() < deadline:
            for host, run, log, p in procs:
                if p.poll() is not None:
                    with open(log) as f:
                        self.fail("%s ended before the kill:\n%s" % (host, f.read()[-3000:]))
            if all(os.path.isdir(os.path.join(run, "checkpoints", name)) for _, run, _, _ in procs):
                break
            time.sleep(0.05)
        else:
            self.fail("step %d not committed on every node" % step)
        run = procs[rank // RANKS][1]
        pid = trainer_pid(run, rank)
        self.assertTrue(pid, "trainer-%d not found" % rank)
        os.kill(pid, signal.SIGKILL)

    def one_node(self, hosts, steps, recipe=None):
        """The reference: the job's world on one host (`--ranks` all of them), `steps` steps of
        `recipe` (tiny by default). Returns its final checkpoint and how long it ran."""
        one = os.path.join(hosts.dir, "one", "run")
        t0 = time.monotonic()
        ref = subprocess.run([MEGACPP, "run"] + ([recipe] if recipe else []) +
                             ["--ranks", str(RANKS * self.N), "--steps", str(steps),
                              "--run-dir", one, "--progress", "none"],
                             capture_output=True, text=True, timeout=240)
        took = time.monotonic() - t0
        self.assertEqual(ref.returncode, 0, ref.stdout + ref.stderr)
        return latest(one), took

    def assert_bits_of_one_node(self, hosts, runs, steps, recipe=None):
        """Every node's part of the final checkpoint (runs[i]: node i's run directory) against
        one node's (one_node); returns the tensors compared."""
        ref_ckpt, _ = self.one_node(hosts, steps, recipe)
        return sum(self.assert_part_matches(latest(run), ref_ckpt, i) for i, run in enumerate(runs))

    def assert_part_matches(self, ckpt, ref_ckpt, i):
        """Node i's part of a checkpoint against a one-node checkpoint of the same world and
        step: its manifest names its ranks, its rank files are those ranks', every tensor is
        bit-identical (the node's first rank also holds the replicated state, rank 0's of the
        one-node run). Returns the tensors compared."""
        with open(os.path.join(ckpt, "checkpoint.json")) as f:
            manifest = json.load(f)
        self.assertEqual(manifest["world"], RANKS * self.N, manifest)
        self.assertEqual(manifest["firstRank"], RANKS * i, manifest)
        self.assertEqual(manifest["ranks"], RANKS, manifest)
        self.assertEqual(os.path.basename(ckpt), os.path.basename(ref_ckpt))
        names = sorted(x for x in os.listdir(ckpt) if x.endswith(".safetensors"))
        self.assertEqual(names, ["rank_%d.safetensors" % r for r in range(RANKS * i, RANKS * (i + 1))])
        compared = 0
        for name in names:
            got, want = tensors(os.path.join(ckpt, name)), tensors(os.path.join(ref_ckpt, name))
            if name == "rank_%d.safetensors" % (RANKS * i) and i > 0:
                rank0 = tensors(os.path.join(ref_ckpt, "rank_0.safetensors"))
                want.update({t: v for t, v in rank0.items() if ".shard" not in t})
            self.assertEqual(sorted(got), sorted(want), name)
            for t in want:
                self.assertEqual(got[t][:2], want[t][:2], (name, t))
                self.assertTrue(got[t][2] == want[t][2], "%s %s differs from the one-node run" % (name, t))
                compared += 1
        return compared

    def start_nodes(self, hosts, steps, env=None, extra=None, keys=True, run_name="run"):
        """Starts one megacpp run per host (node i with env[i] added to its environment and
        extra[i] to its arguments; without `keys`, no --job-keys; its run directory
        <host>/<run_name>); returns [(host, run, log path, Popen)]."""
        keyfile = os.path.join(hosts.dir, "job.keys")
        if keys and not os.path.exists(keyfile):
            subprocess.run([MEGACPP, "keys", keyfile], check=True, capture_output=True)
        procs = []
        for i, host in enumerate(hosts.names[:self.N]):
            run = os.path.join(hosts.dir, host, run_name)
            log = os.path.join(hosts.dir, "%s.log" % host)
            argv = [MEGACPP, "run", "--ranks", str(RANKS), "--steps", str(steps), "--run-dir", run,
                    "--nodes", str(self.N), "--node-rank", str(i),
                    "--master", "%s:%d" % (hosts.addr(hosts.names[0]), PORT),
                    "--iface", "eth0", "--progress", "plain"]
            if keys:
                argv += ["--job-keys", keyfile]
            argv += (extra or {}).get(i, [])
            with open(log, "w") as f:
                procs.append((host, run, log, hosts.popen(host, argv, stdout=f, stderr=subprocess.STDOUT,
                                                          env=dict(os.environ, **(env or {}).get(i, {})))))
        return procs

    def wait_training(self, procs, step=3, timeout=120):
        """Until every node's manifest (the collector's, folded as the run goes) has `step` steps."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, run, log, p in procs:
                if p.poll() is not None:
                    with open(log) as f:
                        self.fail("a node ended before the harm:\n" + f.read()[-3000:])
            if all(steps_completed(run) >= step for _, run, _, _ in procs):
                return
            time.sleep(0.1)
        self.fail("the job did not reach step %d" % step)

    def failure_case(self, hurt, expect_kind, bound_s):
        """A 2-node job training; `hurt(hosts, procs)` harms node1; node0 must end within bound_s with
        its manifest's first failure of kind expect_kind (a set) naming node 1, and no
        process of the job may be left on any host."""
        with Hosts(self.N) as hosts:
            procs = self.start_nodes(hosts, steps=100000)
            try:
                self.wait_training(procs)
                # Node 0's /metrics, scraped from outside its host: the job's series.
                with open(os.path.join(procs[0][1], "launch.json")) as f:
                    url = json.load(f)["metricsEndpoint"]
                self.assertIn(hosts.addr(hosts.names[0]), url)
                text = urllib.request.urlopen(url, timeout=5).read().decode()
                self.assertIn('megacpp_job_nodes{node="0"} %d' % self.N, text)
                self.assertIn('megacpp_job_nodes_up{node="0"} %d' % self.N, text)
                # The fleet's steps as node 0's job watch reads them: every node, the slowest.
                for k in range(self.N):
                    self.assertIn('megacpp_job_node_step{node="%d"}' % k, text)
                self.assertIn("megacpp_job_slowest_step ", text)
                t0 = time.monotonic()
                hurt(hosts, procs)
                _, run0, log0, p0 = procs[0]
                try:
                    rc = p0.wait(timeout=bound_s + 20)
                except subprocess.TimeoutExpired:
                    self.fail("node0 still running %d s after node1 was hurt:\n%s"
                              % (bound_s + 20, open(log0).read()[-3000:]))
                took = time.monotonic() - t0
                with open(log0) as f:
                    text = f.read()
                self.assertNotEqual(rc, 0, text[-3000:])
                with open(os.path.join(run0, "manifest.json")) as f:
                    error = json.load(f).get("error", {})
                self.assertIn(error.get("kind"), expect_kind, (error, text[-3000:]))
                self.assertIn("node 1", error.get("message", ""), error)
                self.assertLessEqual(took, bound_s, "node0 ended %.2f s after the harm" % took)
                # The job-wide manifest on node 0 names the failure and the node.
                with open(os.path.join(run0, "job.json")) as f:
                    job = json.load(f)
                self.assertEqual(job["state"], "error", job)
                self.assertIn("node 1", job["firstFailure"], job)
                if expect_kind == {"node_lost"}:
                    self.assertEqual(job["nodeList"][1]["state"], "lost", job)
                print("%s: node0 ended %.2f s after the harm; first failure %s: %s"
                      % (self._testMethodName, took, error.get("kind"), error.get("message")))
            finally:
                for host in hosts.names:
                    hosts.heal(host)
                    hosts.signal(host, signal.SIGCONT)  # a stopped node resumes and ends itself
                for _, _, _, p in procs:
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
            for host in hosts.names:
                self.assertEqual(hosts.pids(host), [], "%s: processes left" % host)

    def test_a_killed_node_ends_the_job(self):
        # Its peers' collectives fail at once (their sockets close); the node is silent after 1 s.
        self.failure_case(lambda hosts, _: hosts.signal("node1", signal.SIGKILL), {"node_lost"}, bound_s=8)

    def test_a_hung_node_is_lost_within_the_budget(self):
        self.failure_case(lambda hosts, _: hosts.signal("node1", signal.SIGSTOP), {"node_lost"}, bound_s=10)

    def test_a_cut_link_is_a_lost_node(self):
        self.failure_case(lambda hosts, _: hosts.cut("node1"), {"node_lost"}, bound_s=10)

    def test_a_killed_node_supervisor_takes_its_stages_and_is_a_lost_node(self):
        # Only node 1's `megacpp run` is killed: its stages die with it (they ask for SIGKILL
        # when their parent dies), its beats stop, and node 0 names node 1 lost; failure_case
        # checks that no process is left on either host.
        self.failure_case(lambda hosts, procs: os.kill(procs[1][3].pid, signal.SIGKILL), {"node_lost"},
                          bound_s=8)

    def test_a_failure_on_one_node_is_the_jobs_first_failure_on_every_node(self):
        # Rank 2 (node 1's first) exits at step 5; node 0 names it, through the job's store.
        with Hosts(self.N) as hosts:
            procs = self.start_nodes(hosts, steps=100000,
                                     env={1: {"MEGACPP_FAULT": "trainer:2:backward:5:exit"}})
            t0 = time.monotonic()
            errors = {}
            for host, run, log, p in procs:
                try:
                    rc = p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    self.fail("%s did not end" % host)
                self.assertNotEqual(rc, 0)
                with open(os.path.join(run, "manifest.json")) as f:
                    errors[host] = json.load(f).get("error", {})
            took = time.monotonic() - t0
            self.assertEqual((errors["node1"].get("kind"), errors["node1"].get("stage"),
                              errors["node1"].get("rank")), ("exited", "trainer", 2), errors)
            self.assertEqual(errors["node0"].get("kind"), "node_failed", errors)
            self.assertIn("node 1", errors["node0"].get("message", ""), errors)
            self.assertIn("trainer-2", errors["node0"].get("message", ""), errors)
            for host in hosts.names:
                self.assertEqual(hosts.pids(host), [], "%s: processes left" % host)
            print("node 1's trainer-2 failed; both nodes ended within %.2f s of start; node 0: %s"
                  % (took, errors["node0"].get("message")))

    def test_a_job_across_nodes_resumes_from_the_step_every_node_committed(self):
        # Checkpoints every 4 steps; rank 2 (node 1) hangs in step 11 and is killed once steps 4
        # and 8 are committed on both nodes. Node 1's part of step 8 is then removed: node 0 offers 8,
        # node 1 offers 4, and both resume from 4 (node 0's step 8 set aside). The final
        # checkpoint is bit-identical to one node's of the same world.
        n, steps = self.N, 14
        with Hosts(n) as hosts:
            recipe = tiny_every_4(hosts.dir)
            procs = self.start_nodes(hosts, steps, extra={i: [recipe] for i in range(n)},
                                     env={1: {"MEGACPP_FAULT": "trainer:%d:forward:11:hang" % RANKS}})
            self.kill_hung_rank_once_committed(procs, RANKS, 8)
            for host, run, log, p in procs:
                self.assertNotEqual(p.wait(timeout=180), 0, host)
            runs = [run for _, run, _, _ in procs]
            ck1 = os.path.join(runs[1], "checkpoints")
            # Steps 4 and 8 committed on both nodes; the job's LATEST had reached one of them.
            for run in runs:
                with open(os.path.join(run, "checkpoints", "JOB_LATEST")) as f:
                    self.assertIn(f.read(), ("step_00000004\n", "step_00000008\n"))
            self.assertTrue(os.path.isdir(os.path.join(ck1, "step_00000008")), os.listdir(ck1))
            shutil.rmtree(os.path.join(ck1, "step_00000008"))
            with open(os.path.join(ck1, "LATEST"), "w") as f:
                f.write("step_00000004\n")
            keyfile = os.path.join(hosts.dir, "job.keys")
            resumed = []
            for i, host in enumerate(hosts.names):
                log = os.path.join(hosts.dir, "%s.resume.log" % host)
                argv = [MEGACPP, "run", "--resume", runs[i], "--nodes", str(n), "--node-rank", str(i),
                        "--master", "%s:%d" % (hosts.addr(hosts.names[0]), PORT), "--iface", "eth0",
                        "--job-keys", keyfile, "--progress", "plain"]
                with open(log, "w") as f:
                    resumed.append((host, log, hosts.popen(host, argv, stdout=f, stderr=subprocess.STDOUT)))
            for host, log, p in resumed:
                rc = p.wait(timeout=180)
                with open(log) as f:
                    self.assertEqual(rc, 0, "%s:\n%s" % (host, f.read()[-4000:]))
            for i, run in enumerate(runs):
                with open(os.path.join(run, "manifest.json")) as f:
                    m = json.load(f)
                self.assertEqual((m["state"], m["stepsCompleted"]), ("ok", steps), m.get("error"))
                self.assertEqual(m["attempts"][1]["fromStep"], 4, m["attempts"][1])
            self.assertTrue(os.path.isdir(os.path.join(runs[0], "checkpoints",
                                                       "step_00000008.rejected-attempt1")))
            compared = self.assert_bits_of_one_node(hosts, runs, steps, recipe)
            print("resumed from step 4 on every node (node 0's step 8 set aside); %d tensors of step "
                  "%d bit-identical to one node of %d ranks" % (compared, steps, RANKS * n))

    def test_a_job_restart_restarts_every_node_from_the_step_every_node_committed(self):
        # --max-job-restarts 1: rank 2 (node 1) hangs in step 11 of the first attempt and is
        # killed once step 8 is committed on both nodes; both
        # supervisors agree to restart, both resume from step 8 (the newest step both
        # committed), and the job ends ok with one node's bits of the same world.
        n, steps = self.N, 14
        with Hosts(n) as hosts:
            recipe = tiny_every_4(hosts.dir)
            procs = self.start_nodes(hosts, steps,
                                     extra={i: [recipe, "--max-job-restarts", "1"] for i in range(n)},
                                     env={1: {"MEGACPP_FAULT": "trainer:%d:forward:11:hang" % RANKS}})
            self.kill_hung_rank_once_committed(procs, RANKS, 8)
            for i, (host, run, log, p) in enumerate(procs):
                rc = p.wait(timeout=240)
                with open(log) as f:
                    text = f.read()
                self.assertEqual(rc, 0, "%s:\n%s" % (host, text[-4000:]))
                # Every rank of the restart was its spare (started after the first attempt's
                # first step, loaded and waiting), not a process started after the failure.
                for r in range(RANKS):
                    self.assertIn("trainer-%d (generation 0) is its spare" % (i * RANKS + r), text,
                                  host)
            runs = [run for _, run, _, _ in procs]
            for i, run in enumerate(runs):
                with open(os.path.join(run, "manifest.json")) as f:
                    m = json.load(f)
                self.assertEqual((m["state"], m["stepsCompleted"]), ("ok", steps), m.get("error"))
                first, second = m["attempts"][0], m["attempts"][1]
                self.assertEqual(first["error"]["kind"], "signaled" if i == 1 else "node_failed", first)
                self.assertEqual((second["reason"], second["fromStep"]), ("job_restart", 8), second)
            compared = self.assert_bits_of_one_node(hosts, runs, steps, recipe)
            print("job restart on every node from step 8; %d tensors of step %d bit-identical to one "
                  "node of %d ranks" % (compared, steps, RANKS * n))

    def test_a_job_across_nodes_branches_from_a_checkpoint(self):
        # --from on every node: first a one-node run's checkpoint of every rank (step 4), then
        # each node's own part of the branch's step 8. Each branch's final checkpoint is
        # bit-identical to one node's branch from the same checkpoint; a job whose nodes start
        # from different places is refused on every node.
        with Hosts(self.N) as hosts:
            recipe = tiny_every_4(hosts.dir)
            self.one_node(hosts, 8, recipe)
            one = os.path.join(hosts.dir, "one", "run")

            def one_node_branch(name, parent, steps):
                run = os.path.join(hosts.dir, name, "run")
                p = subprocess.run([MEGACPP, "run", recipe, "--ranks", str(RANKS * self.N), "--steps",
                                    str(steps), "--run-dir", run, "--from", parent, "--progress",
                                    "none"], capture_output=True, text=True, timeout=240)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                return latest(run)

            def nodes_branch(parents, steps, tag):
                procs = self.start_nodes(hosts, steps, run_name=tag, extra={
                    i: [recipe, "--from", parents[i]] for i in range(self.N)})
                for host, _, log, p in procs:
                    rc = p.wait(timeout=240)
                    with open(log) as f:
                        text = f.read()
                    self.assertEqual(rc, 0, "%s:\n%s" % (host, text[-3000:]))
                    self.assertIn("every node of the job branches from step", text)
                return [run for _, run, _, _ in procs]

            step4 = os.path.join(one, "checkpoints", "step_00000004")
            ref = one_node_branch("oneb", step4, 12)
            runs = nodes_branch([step4] * self.N, 12, "branch")
            compared = sum(self.assert_part_matches(latest(run), ref, i) for i, run in enumerate(runs))
            # Each node from its own part of the branch's step 8.
            ref2 = one_node_branch("onec", os.path.join(os.path.dirname(ref), "step_00000008"), 12)
            parts = [os.path.join(run, "checkpoints", "step_00000008") for run in runs]
            runs2 = nodes_branch(parts, 12, "branch2")
            compared += sum(self.assert_part_matches(latest(run), ref2, i) for i, run in enumerate(runs2))
            # Node 0 with --from, the others without: refused on every node, naming both.
            procs = self.start_nodes(hosts, 12, run_name="mixed", extra={
                i: [recipe] + (["--from", step4] if i == 0 else []) for i in range(self.N)})
            for host, _, log, p in procs:
                rc = p.wait(timeout=120)
                with open(log) as f:
                    text = f.read()
                self.assertNotEqual(rc, 0, text[-2000:])
                self.assertIn("give every node --from the same step of the same job", text)
            # Each node given another node's part: refused before it joins, naming both ranges.
            procs = self.start_nodes(hosts, 12, run_name="swapped", extra={
                i: [recipe, "--from", parts[(i + 1) % self.N]] for i in range(self.N)})
            for host, _, log, p in procs:
                rc = p.wait(timeout=120)
                with open(log) as f:
                    text = f.read()
                self.assertNotEqual(rc, 0, text[-2000:])
                self.assertIn("the checkpoint is a node's part", text)
            print("a job across nodes branched from a one-node checkpoint and from its own parts; "
                  "%d tensors bit-identical to one node's branches; a mixed start refused" % compared)

    def test_a_lost_node_is_not_restarted_in_place(self):
        # Node 1 killed whole: its supervisor is gone, so node 0 does not restart the job in
        # place (the engine does that); it ends with node_lost and says why.
        with Hosts(self.N) as hosts:
            procs = self.start_nodes(hosts, 100000,
                                     extra={i: ["--max-job-restarts", "2"] for i in range(self.N)})
            self.wait_training(procs)
            hosts.signal("node1", signal.SIGKILL)
            procs[1][3].wait(timeout=10)
            _, run0, log0, p0 = procs[0]
            rc = p0.wait(timeout=60)
            with open(log0) as f:
                text = f.read()
            self.assertNotEqual(rc, 0, text[-3000:])
            with open(os.path.join(run0, "manifest.json")) as f:
                m = json.load(f)
            self.assertEqual(m["error"]["kind"], "node_lost", m["error"])
            self.assertEqual(len(m["attempts"]), 1, m["attempts"])
            self.assertIn("no job restart: a node was lost", text)
            for _, _, _, p in procs[2:]:
                p.wait(timeout=30)

    def test_a_peer_without_the_jobs_keys_is_refused_and_the_job_goes_on(self):
        # On a host of its own, beside a running job: a megacpp that claims node 1 with other
        # keys joins another prefix, finds no node 0 there and gives up; a raw c10d client
        # writes the job's key names without the secret prefix. The job ends ok, untouched.
        n = self.N
        with Hosts(n + 1) as hosts:
            intruder = hosts.names[n]
            other = os.path.join(hosts.dir, "other.keys")
            subprocess.run([MEGACPP, "keys", other], check=True, capture_output=True)
            procs = self.start_nodes(hosts, 150)
            self.wait_training(procs, step=2)
            venv_py = os.path.join(ROOT, ".venv", "bin", "python")
            raw = hosts.run(intruder, [venv_py, "-c", (
                "import datetime, torch.distributed as d\n"
                "s = d.TCPStore('%s', %d, is_master=False, wait_for_workers=False,"
                " timeout=datetime.timedelta(seconds=5))\n"
                "for k in ('claim/1', 'identity/1', 'watch/failure', 'watch/a0/failure', 'done/0'):\n"
                "    s.set(k, 'lost 1\\nforged')\n"
                "s.add('watch/failures', 1)\n"
                "print('wrote')\n") % (hosts.addr(hosts.names[0]), PORT)],
                capture_output=True, text=True, timeout=60)
            self.assertIn("wrote", raw.stdout, raw.stderr[-2000:])
            master = "%s:%d" % (hosts.addr(hosts.names[0]), PORT)
            p = hosts.run(intruder, [MEGACPP, "run", "--ranks", str(RANKS), "--steps", "150", "--run-dir",
                                     os.path.join(hosts.dir, intruder, "run"), "--nodes", str(n),
                                     "--node-rank", "1", "--master", master, "--iface", "eth0",
                                     "--job-keys", other, "--progress", "none"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, MEGACPP_STORE_TIMEOUT_S="3"))
            self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("node 0", p.stderr.strip().splitlines()[-1], p.stderr)
            for host, run, log, proc in procs:
                rc = proc.wait(timeout=180)
                with open(log) as f:
                    self.assertEqual(rc, 0, "%s:\n%s" % (host, f.read()[-3000:]))
                with open(os.path.join(run, "manifest.json")) as f:
                    m = json.load(f)
                self.assertEqual((m["state"], m["stepsCompleted"]), ("ok", 150), m.get("error"))
            print("another key file's node: %s; a raw store client's writes: no effect; the job "
                  "ended ok" % p.stderr.strip().splitlines()[-1])

    def test_torchrun_starts_one_megacpp_per_node(self):
        # torchrun's c10d rendezvous across the hosts, megacpp as its worker (--no-python); the
        # job's keys live in torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE).
        venv_py = os.path.join(ROOT, ".venv", "bin", "python")
        with Hosts(self.N) as hosts:
            keyfile = os.path.join(hosts.dir, "job.keys")
            subprocess.run([MEGACPP, "keys", keyfile], check=True, capture_output=True)
            worker = ('exec "$0" run tiny --ranks %d --steps %d --run-dir %s/$(hostname)/run '
                      '--iface eth0 --job-keys %s --progress plain' % (RANKS, STEPS, hosts.dir, keyfile))
            procs = []
            t0 = time.monotonic()
            for host in hosts.names:
                log = open(os.path.join(hosts.dir, "torchrun-%s.log" % host), "w")
                procs.append((host, log, hosts.popen(host, [
                    venv_py, "-m", "torch.distributed.run", "--nnodes", str(self.N), "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "%s:%d" % (hosts.addr(hosts.names[0]), 29400),
                    "--rdzv-id", hosts.prefix, "--max-restarts", "0", "--no-python", "sh", "-c", worker, MEGACPP],
                    stdout=log, stderr=subprocess.STDOUT)))
            logs = ""
            for host, log, p in procs:
                try:
                    rc = p.wait(timeout=240)
                except subprocess.TimeoutExpired:
                    p.kill()
                    rc = -9
                log.close()
                with open(log.name) as f:
                    logs += "--- %s (rc %d)\n%s" % (host, rc, f.read()[-3000:])
            took = time.monotonic() - t0
            for host, _, p in procs:
                self.assertEqual(p.returncode, 0, logs)
            ranks = set()
            for host in hosts.names:
                run = os.path.join(hosts.dir, host, "run")
                with open(os.path.join(run, "launch.json")) as f:
                    launch = json.load(f)
                place = launch["placement"]
                self.assertEqual((place["source"], place["nodes"], place.get("engineStore")),
                                 ("torchrun", self.N, True), place)
                self.assertEqual(launch["storePort"], place["masterPort"])
                ranks.add((launch.get("firstRank", 0), launch["localRanks"]))
                v = subprocess.run([MEGACPP, "verify", latest(run)], capture_output=True, text=True)
                self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
            # torchrun's rendezvous chose the node ranks: every node got its own.
            self.assertEqual(sorted(ranks), [(RANKS * i, RANKS) for i in range(self.N)])
            print("torchrun, %d agents, one megacpp each: %.2f s" % (self.N, took))

    def test_an_indexed_jobs_pods_place_themselves_from_their_environment(self):
        # A Kubernetes Indexed Job's pods as each sees its environment (no Kubernetes here: the
        # variables and names the Job and its headless service give a pod): the index in
        # JOB_COMPLETION_INDEX, the node count in MEGACPP_NODES, node 0 from
        # MEGACPP_HOST_PATTERN through the pods' name resolution (each namespace's /etc/hosts
        # plays the headless service), the port in MEGACPP_MASTER_PORT, the interface in
        # GLOO_SOCKET_IFNAME; no placement flag. The job trains the bits of one node.
        with Hosts(self.N) as hosts:
            keyfile = os.path.join(hosts.dir, "job.keys")
            subprocess.run([MEGACPP, "keys", keyfile], check=True, capture_output=True)
            pattern = hosts.names[0][:-1] + "{index}"
            self.assertEqual(pattern.replace("{index}", "0"), hosts.names[0])
            procs = []
            for i, host in enumerate(hosts.names[:self.N]):
                run = os.path.join(hosts.dir, host, "run")
                log = os.path.join(hosts.dir, "%s.log" % host)
                env = dict(os.environ, JOB_COMPLETION_INDEX=str(i), MEGACPP_NODES=str(self.N),
                           MEGACPP_HOST_PATTERN=pattern, MEGACPP_MASTER_PORT=str(PORT),
                           GLOO_SOCKET_IFNAME="eth0")
                with open(log, "w") as f:
                    procs.append((host, run, log, hosts.popen(host, [
                        MEGACPP, "run", "--ranks", str(RANKS), "--steps", str(STEPS), "--run-dir", run,
                        "--job-keys", keyfile, "--progress", "plain"],
                        stdout=f, stderr=subprocess.STDOUT, env=env)))
            for host, run, log, p in procs:
                rc = p.wait(timeout=240)
                with open(log) as f:
                    self.assertEqual(rc, 0, "%s:\n%s" % (host, f.read()[-3000:]))
                with open(os.path.join(run, "launch.json")) as f:
                    place = json.load(f)["placement"]
                self.assertEqual((place["source"], place["nodes"], place["masterHost"],
                                  place["masterPort"]),
                                 ("kubernetes", self.N, hosts.names[0], PORT), place)
            runs = [run for _, run, _, _ in procs]
            compared = self.assert_bits_of_one_node(hosts, runs, STEPS)
            print("an Indexed Job's %d pods placed by their environment; %d tensors bit-identical "
                  "to one node" % (self.N, compared))

    def start_under_torchrun(self, hosts, recipe, steps, node1_env):
        """One torchrun agent per host (c10d rendezvous on node 0, --max-restarts 1), each
        starting one megacpp of `recipe` for `steps` steps; node 1's environment gets
        `node1_env`. Returns [(host, run, log, Popen)]."""
        venv_py = os.path.join(ROOT, ".venv", "bin", "python")
        keyfile = os.path.join(hosts.dir, "job.keys")
        subprocess.run([MEGACPP, "keys", keyfile], check=True, capture_output=True)
        worker = ('exec "$0" run %s --ranks %d --steps %d --run-dir %s/$(hostname)/run '
                  '--iface eth0 --job-keys %s --progress plain' % (recipe, RANKS, steps, hosts.dir, keyfile))
        procs = []
        for i, host in enumerate(hosts.names):
            log = os.path.join(hosts.dir, "torchrun-%s.log" % host)
            env = dict(os.environ, **(node1_env if i == 1 else {}))
            with open(log, "w") as f:
                procs.append((host, os.path.join(hosts.dir, host, "run"), log, hosts.popen(host, [
                    venv_py, "-m", "torch.distributed.run", "--nnodes", str(self.N), "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "%s:%d" % (hosts.addr(hosts.names[0]), 29400),
                    "--rdzv-id", hosts.prefix, "--max-restarts", "1", "--no-python", "sh", "-c", worker,
                    MEGACPP], stdout=f, stderr=subprocess.STDOUT, env=env)))
        return procs

    def wait_ok_under_torchrun(self, procs, steps):
        """Every torchrun agent ends 0 and every node's manifest says ok after `steps` steps;
        returns each node's manifest."""
        for host, run, log, p in procs:
            try:
                rc = p.wait(timeout=240)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = -9
            with open(log) as f:
                self.assertEqual(rc, 0, "%s:\n%s" % (host, f.read()[-4000:]))
        manifests = []
        for _, run, _, _ in procs:
            with open(os.path.join(run, "manifest.json")) as f:
                m = json.load(f)
            self.assertEqual((m["state"], m["stepsCompleted"]), ("ok", steps), m.get("error"))
            manifests.append(m)
        return manifests

    def test_torchrun_restarts_every_megacpp_which_resumes_the_job(self):
        # torchrun --max-restarts 1 as the engine: rank 2 hangs in step 11 and is killed once
        # step 8 is committed on every node; every megacpp ends (the job's first failure), every
        # agent restarts its worker, and each megacpp, finding its run in its run directory,
        # resumes from step 8 (TORCHELASTIC_RESTART_COUNT > 0). The job ends ok, with one node's
        # bits of the same world.
        n, steps = self.N, 14
        with Hosts(self.N) as hosts:
            recipe = tiny_every_4(hosts.dir)
            procs = self.start_under_torchrun(hosts, recipe, steps,
                                              {"MEGACPP_FAULT": "trainer:%d:forward:11:hang" % RANKS})
            self.kill_hung_rank_once_committed(procs, RANKS, 8)
            for m in self.wait_ok_under_torchrun(procs, steps):
                self.assertEqual((m["attempts"][-1]["reason"], m["attempts"][-1]["fromStep"]),
                                 ("resume", 8), m["attempts"])
            runs = [run for _, run, _, _ in procs]
            compared = self.assert_bits_of_one_node(hosts, runs, steps, recipe)
            print("torchrun restarted every megacpp; each resumed from step 8; %d tensors of step %d "
                  "bit-identical to one node of %d ranks" % (compared, steps, RANKS * n))

    def test_torchrun_restarting_a_job_before_its_first_checkpoint_trains_from_step_0(self):
        # Rank 2 exits in step 2 of the first attempt, before the first checkpoint (step 4):
        # torchrun restarts every megacpp, each finds its run and no checkpoint, and the job
        # trains again from step 0 as the run's next attempt, ending ok with one node's bits.
        n, steps = self.N, 8
        with Hosts(self.N) as hosts:
            recipe = tiny_every_4(hosts.dir)
            procs = self.start_under_torchrun(hosts, recipe, steps,
                                              {"MEGACPP_FAULT": "trainer:%d:forward:2:exit" % RANKS})
            for m in self.wait_ok_under_torchrun(procs, steps):
                self.assertEqual(len(m["attempts"]), 2, m["attempts"])
                self.assertEqual(m["attempts"][-1]["reason"], "resume", m["attempts"])
                self.assertFalse(m["attempts"][-1].get("fromStep"), m["attempts"])
            for _, _, log, _ in procs:
                with open(log) as f:
                    self.assertIn("before any checkpoint every node has: attempt 1 trains from step 0",
                                  f.read())
            runs = [run for _, run, _, _ in procs]
            compared = self.assert_bits_of_one_node(hosts, runs, steps, recipe)
            print("torchrun restarted every megacpp before the first checkpoint; each trained from "
                  "step 0; %d tensors of step %d bit-identical to one node of %d ranks"
                  % (compared, steps, RANKS * n))

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


SAMPLE = [
    "test_a_job_across_nodes_trains_the_bits_of_one_node",
    "test_a_killed_node_ends_the_job",
    "test_a_cut_link_is_a_lost_node",
    "test_a_failure_on_one_node_is_the_jobs_first_failure_on_every_node",
    "test_a_job_restart_restarts_every_node_from_the_step_every_node_committed",
    "test_torchrun_restarts_every_megacpp_which_resumes_the_job",
]


class MegacppNodes(MegacppNodesN, unittest.TestCase):
    N = 2


class MegacppNodes4(MegacppNodesN, unittest.TestCase):
    N = 4


if __name__ == "__main__":
    netns_hosts.require_root()
    if len(sys.argv) < 2 or not os.access(sys.argv[1], os.X_OK):
        sys.exit("usage: megacpp_nodes_test.py MEGACPP: the megacpp executable of the build tree")
    MEGACPP = os.path.abspath(sys.argv.pop(1))
    # `make test`'s bounded sample (ctest multinode_megacpp); MegacppNodes and MegacppNodes4
    # run every case (label full: `make multinode`, `make chaos`).
    if sys.argv[1:] == ["MegacppNodesSample"]:
        sys.argv[1:] = ["MegacppNodes." + name for name in SAMPLE]
    result = unittest.main(exit=False).result
    # A failure's message holds node logs thousands of characters long; a CI log keeps only its
    # tail. One short summary per failure after unittest's own: the assertion's first line and
    # the nodes' error and warning lines it quotes.
    for test, trace in result.failures + result.errors:
        lines = trace.splitlines()
        said = [l for l in lines if l.startswith(("AssertionError", "subprocess.", "Exception"))]
        print("FAILED %s: %s" % (test.id().split(".")[-1], (said or lines[-1:])[0][:300]))
        for l in [l for l in lines if "] error:" in l or "] warn:" in l][:8]:
            print("  " + l[:240])
    sys.exit(0 if result.wasSuccessful() else 1)
