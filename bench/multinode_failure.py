#!/usr/bin/env python3
"""A node lost: megacpp across namespace hosts vs torchrun multi-node, side by side in one run.

Hosts are network namespaces on a bridge (tests/multinode/netns_hosts.py; root only). Each
trial trains on N hosts x 2 ranks, waits until training is under way on every host, then harms
the last host and measures, from the harm:

  detect  node 0 ended its part of the job: its `megacpp run`, or its torchrun agent, exited
          (megacpp: and its manifest names the lost node as the first failure)
  gone    no process of the job is left on any host still reachable (the harmed host's too
          for a kill; for a cut link, the others')

Harms: `kill` (SIGKILL to every process of the host: the node dies), `cut` (the host's link
down: the node lives, cut off), `restart` (the last host's first rank SIGKILLed, under
megacpp's --max-job-restarts 1 and torchrun's --max-restarts 3, after the first checkpoint at
step 20: seconds from the kill to the restarted job's first step — megacpp's every supervisor
agreeing through the store and resuming from the step every node committed; torchrun's agents
restarting every worker through a new rendezvous round, the peer resuming from its torch.save
checkpoint, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torchrun's default shared store
its restarted group read a previous round's Gloo addresses and never trained again here,
pytorch/pytorch#135712). Trials alternate the two systems.

megacpp   one `megacpp run tiny --ranks 2 --nodes N --node-rank R --master <node0>:PORT
          --iface eth0 --job-keys K` per host; node 0's job watch (supervisor/job_watch.h).
torchrun  one `python -m torch.distributed.run --nnodes N --nproc-per-node 2 --rdzv-backend c10d
          --rdzv-endpoint <node0>:29400 --max-restarts 0 bench/peers/gloo_train.py` per host,
          GLOO_SOCKET_IFNAME=eth0: the same model, batch and threads on Gloo at torchrun's and
          Gloo's defaults (the collective timeout is Gloo's 30 min).

Under Slurm (--slurm-reps, a 2-node namespace Slurm cluster, tests/multinode/slurm_cluster.py):
the same megacpp job started by `sbatch -N 2` + `srun`; every process of node1 killed, its
slurmd included. Printed: when node 0's megacpp ended (megacpp's detection) and when the Slurm
job left RUNNING (Slurm's own node-failure handling: its step waits for slurmctld to find the
node not responding).

Every measurement is capped (--cap-s); a system not done by then is printed "> cap" and killed.
Timings are printed, never asserted; the goal (>= 10x faster detection than the peer) is printed
beside the ratio. Usage: sudo .venv/bin/python bench/multinode_failure.py [--nodes 2] [--reps 2]
[--cap-s 60] [--harms kill,cut]
"""
import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "multinode"))
import netns_hosts  # noqa: E402
from megacpp_nodes_test import steps_completed, trainer_pid  # noqa: E402
from netns_hosts import Hosts  # noqa: E402
from bench_host import cpu_name  # noqa: E402

VENV_PY = os.path.join(ROOT, ".venv", "bin", "python")
PEER = os.path.join(ROOT, "bench", "peers", "gloo_train.py")
PORT = 29517


def harm(hosts, host, how):
    if how == "cut":
        hosts.cut(host)
        return
    hosts.signal(host, signal.SIGKILL)


def first_failure(run):
    """"kind: message" of the run's first failure, as its manifest says; "" without one."""
    try:
        with open(os.path.join(run, "manifest.json")) as f:
            e = json.load(f).get("error", {})
        return "%s: %s" % (e.get("kind"), e.get("message"))
    except (OSError, ValueError):
        return ""


def left(hosts, names):
    return [p for h in names for p in hosts.pids(h)]


def wait_until(pred, cap_s):
    t0 = time.monotonic()
    while time.monotonic() - t0 < cap_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def start_megacpp(megacpp, hosts, extra=()):
    """One `megacpp run tiny --ranks 2` per host, node 0's store on the first host, the job's
    keys made once; `extra` added to every command. Returns [(run directory, Popen)]."""
    keys = os.path.join(hosts.dir, "job.keys")
    subprocess.run([megacpp, "keys", keys], check=True, capture_output=True)
    procs = []
    for i, host in enumerate(hosts.names):
        run = os.path.join(hosts.dir, host, "run")
        with open(os.path.join(hosts.dir, host + ".log"), "w") as log:
            procs.append((run, hosts.popen(host, [
                megacpp, "run", "tiny", "--ranks", "2", "--steps", "100000", "--run-dir", run,
                "--nodes", str(len(hosts.names)), "--node-rank", str(i),
                "--master", "%s:%d" % (hosts.addr(hosts.names[0]), PORT),
                "--iface", "eth0", "--job-keys", keys, "--progress", "none"] + list(extra),
                stdout=log, stderr=subprocess.STDOUT)))
    return procs


def megacpp_trial(megacpp, n, how, cap_s):
    with Hosts(n) as hosts:
        procs = start_megacpp(megacpp, hosts)

        def training():
            return all(steps_completed(run) >= 3 for run, _ in procs)

        try:
            if wait_until(training, 120) is None:
                raise RuntimeError("megacpp did not start training")
            victim = hosts.names[-1]
            t0 = time.monotonic()
            harm(hosts, victim, how)
            detect = wait_until(lambda: procs[0][1].poll() is not None, cap_s)
            reachable = hosts.names if how == "kill" else hosts.names[:-1]
            gone = wait_until(lambda: not left(hosts, reachable), max(0.0, cap_s - (time.monotonic() - t0)))
            if gone is not None:
                gone = time.monotonic() - t0
            return detect, gone, first_failure(procs[0][0])
        finally:
            for h in hosts.names:
                hosts.heal(h)
            for _, p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()


def torchrun_trial(n, how, cap_s):
    with Hosts(n) as hosts:
        procs = []
        for host in hosts.names:
            log = os.path.join(hosts.dir, host + ".log")
            with open(log, "w") as f:
                procs.append((log, hosts.popen(host, [
                    VENV_PY, "-m", "torch.distributed.run", "--nnodes", str(n), "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "%s:29400" % hosts.addr(hosts.names[0]),
                    "--rdzv-id", hosts.prefix, "--max-restarts", "0", PEER, "--tag", hosts.prefix],
                    env=dict(os.environ, GLOO_SOCKET_IFNAME="eth0"), stdout=f, stderr=subprocess.STDOUT)))

        def training():
            for log, _ in procs:
                with open(log) as f:
                    if f.read().count("step") < 3:
                        return False
            return True

        try:
            if wait_until(training, 180) is None:
                raise RuntimeError("torchrun did not start training: " + open(procs[0][0]).read()[-2000:])
            t0 = time.monotonic()
            harm(hosts, hosts.names[-1], how)
            detect = wait_until(lambda: procs[0][1].poll() is not None, cap_s)
            reachable = hosts.names if how == "kill" else hosts.names[:-1]
            gone = wait_until(lambda: not left(hosts, reachable), max(0.0, cap_s - (time.monotonic() - t0)))
            if gone is not None:
                gone = time.monotonic() - t0
            return detect, gone, ""
        finally:
            for h in hosts.names:
                hosts.heal(h)
                hosts.signal(h, signal.SIGKILL)


def first_step_after_restart(run):
    """When (epoch seconds) every rank of the node's restarted attempt finished its first step,
    as the manifest's recovery says (the ranks' own step records, not the fold's time); None
    before."""
    try:
        with open(os.path.join(run, "manifest.json")) as f:
            attempts = json.load(f).get("attempts", [])
    except (OSError, ValueError):
        return None
    at = attempts[-1].get("recovery", {}).get("firstStepAt") if len(attempts) >= 2 else None
    if not at:
        return None
    return datetime.datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()


def megacpp_restart_trial(megacpp, n, cap_s):
    """A rank of the last node killed under --max-job-restarts 1: seconds from the kill to the
    first step of the restarted attempt on every node (the manifest's recovery.firstStepAt: the
    wall time of the slowest rank's first step record)."""
    with Hosts(n) as hosts:
        procs = start_megacpp(megacpp, hosts, ["--max-job-restarts", "1"])
        try:
            if wait_until(lambda: all(steps_completed(run) >= 25 for run, _ in procs), 180) is None:
                raise RuntimeError("megacpp did not train past its first checkpoint")
            victim = 2 * (n - 1)
            pid = trainer_pid(procs[-1][0], victim)
            t_kill = time.time()
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            took = None
            if wait_until(lambda: all(first_step_after_restart(run) for run, _ in procs), cap_s) is not None:
                took = max(first_step_after_restart(run) for run, _ in procs) - t_kill
            with open(os.path.join(procs[0][0], "manifest.json")) as f:
                attempts = json.load(f)["attempts"]
            return took, "trainer-%d killed; attempt %d from step %s" % (
                victim, len(attempts) - 1, attempts[-1].get("fromStep")), t0
        finally:
            for h in hosts.names:
                hosts.signal(h, signal.SIGKILL)
            for _, p in procs:
                p.wait(timeout=20)


def torchrun_restart_trial(n, cap_s):
    """The same kill under torchrun --max-restarts 3 (the peer checkpoints every 20 steps, as
    tiny does, and resumes from it): seconds from the kill to the restarted group's first step
    (its rank 0's first_step event)."""
    with Hosts(n) as hosts:
        procs = []
        events = os.path.join(hosts.dir, "events.jsonl")
        ckpt = os.path.join(hosts.dir, "peer.pt")
        for host in hosts.names:
            log = os.path.join(hosts.dir, host + ".log")
            with open(log, "w") as f:
                procs.append((log, hosts.popen(host, [
                    VENV_PY, "-m", "torch.distributed.run", "--nnodes", str(n), "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "%s:29400" % hosts.addr(hosts.names[0]),
                    "--rdzv-id", hosts.prefix, "--max-restarts", "3", PEER, "--tag", hosts.prefix,
                    "--ckpt", ckpt, "--ckpt-every", "20", "--events", events],
                    # The workers' own store, not the rendezvous's: with it shared (torchrun's
                    # default) the restarted group reads a previous round's Gloo addresses and
                    # never connects (pytorch/pytorch#135712; seen here with torch 2.11).
                    env=dict(os.environ, GLOO_SOCKET_IFNAME="eth0", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                    stdout=f, stderr=subprocess.STDOUT)))

        def read_events():
            try:
                with open(events) as f:
                    return [json.loads(x) for x in f if x.strip()]
            except (OSError, ValueError):
                return []

        def victim_pid(rank):
            for pid in hosts.pids(hosts.names[-1]):
                try:
                    with open("/proc/%d/cmdline" % pid, "rb") as f:
                        cmd = f.read()
                    with open("/proc/%d/environ" % pid, "rb") as f:
                        env = f.read().split(b"\0")
                except OSError:
                    continue
                if PEER.encode() in cmd and b"torch.distributed.run" not in cmd and ("RANK=%d" % rank).encode() in env:
                    return pid
            return None

        try:
            if wait_until(lambda: any(e["event"] == "saved" for e in read_events()), 240) is None:
                raise RuntimeError("torchrun did not checkpoint: " + open(procs[0][0]).read()[-2000:])
            victim = 2 * (n - 1)
            pid = victim_pid(victim)
            if pid is None:
                raise RuntimeError("torchrun's rank %d not found" % victim)
            t_kill = time.time()
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)

            def restarted():
                return [e for e in read_events() if e["event"] == "first_step" and e["restart"] >= 1]

            if wait_until(lambda: restarted(), cap_s) is None:
                tails = []
                for log, _ in procs:
                    with open(log) as f:
                        tails.append(f.read()[-1500:])
                return None, "no restarted step; node logs end:\n" + "\n---\n".join(tails), t0
            first = min(restarted(), key=lambda e: e["t"])
            return first["t"] - t_kill, "rank %d killed; restart 1 from step %d" % (victim, first["step"]), t0
        finally:
            for h in hosts.names:
                hosts.signal(h, signal.SIGKILL)
            for _, p in procs:
                p.wait(timeout=20)


SLURM_JOB = """#!/bin/sh
srun --ntasks-per-node 1 sh -c 'exec "$0" run tiny --ranks 2 --steps 100000 \\
    --run-dir {d}/$(hostname)/run --iface eth0 --job-keys {keys} --progress none' {megacpp}
"""


def slurm_trial(megacpp, cap_s):
    """The megacpp job under sbatch + srun on a 2-node namespace Slurm cluster; every process of
    node1 killed, slurmd included (the node dies). Returns (megacpp: node 0's megacpp ended,
    Slurm: the job left RUNNING, node 0's first failure)."""
    import slurm_cluster
    with slurm_cluster.SlurmCluster(2) as c:
        keys = os.path.join(c.dir, "job.keys")
        subprocess.run([megacpp, "keys", keys], check=True, capture_output=True)
        job = os.path.join(c.dir, "job.sh")
        with open(job, "w") as f:
            f.write(SLURM_JOB.format(d=c.dir, keys=keys, megacpp=megacpp))
        p = c.run(["sbatch", "--parsable", "-N", "2", "-o", os.path.join(c.dir, "job.out"), job])
        job_id = p.stdout.strip().split(";")[0]
        run0 = os.path.join(c.dir, "node0", "run")

        def training():
            return steps_completed(run0) >= 3

        if wait_until(training, 120) is None:
            raise RuntimeError("the Slurm job did not start training")
        with open(os.path.join(run0, "launch.json")) as f:
            supervisor = json.load(f)["supervisorPid"]
        t0 = time.monotonic()
        harm(c.hosts, "node1", "kill")
        def ended(pid):
            """Exited, or a zombie: reaped by its parent or not, it is over."""
            try:
                with open("/proc/%d/stat" % pid) as f:
                    return f.read().split(") ")[1][0] == "Z"
            except OSError:  # gone, even between two reads
                return True

        mega = wait_until(lambda: ended(supervisor), cap_s)

        def job_over():
            q = c.run(["squeue", "-h", "-j", job_id, "-o", "%T"], timeout=10)
            return q.stdout.strip() not in ("RUNNING", "COMPLETING", "PENDING", "CONFIGURING")

        slurm = wait_until(job_over, max(0.0, cap_s - (time.monotonic() - t0)))
        if slurm is not None:
            slurm = time.monotonic() - t0
        c.run(["scancel", job_id], timeout=10)
        return mega, slurm, first_failure(run0)


def fmt(x, cap_s):
    return "> %.0f s (cap)" % cap_s if x is None else "%.2f s" % x


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cap-s", type=float, default=60.0)
    ap.add_argument("--harms", default="kill,cut,restart",
                    help="comma-separated: kill, cut, restart (a rank killed under "
                         "--max-job-restarts 1 / torchrun --max-restarts 1)")
    ap.add_argument("--slurm-reps", type=int, default=1,
                    help="trials under Slurm (a killed node: megacpp against Slurm's own handling)")
    ap.add_argument("--megacpp", default=os.path.join(ROOT, "build", "bin", "megacpp"))
    a = ap.parse_args()
    netns_hosts.require_root()
    print("node lost, %d namespace hosts x 2 ranks, tiny recipe, on %s" % (a.nodes, cpu_name()))
    results = {}
    harms = [h for h in a.harms.split(",") if h]
    for how in harms:
        for rep in range(a.reps):
            for system in ("megacpp", "torchrun"):
                if how == "restart":
                    trial = megacpp_restart_trial if system == "megacpp" else torchrun_restart_trial
                    d, what, _ = (trial(a.megacpp, a.nodes, a.cap_s) if system == "megacpp"
                                  else trial(a.nodes, a.cap_s))
                    results.setdefault((how, system), []).append(d)
                    print("  %-4s trial %d  %-8s  first step after the restart %-14s %s"
                          % (how, rep + 1, system, fmt(d, a.cap_s), what), flush=True)
                    continue
                if system == "megacpp":
                    d, g, first = megacpp_trial(a.megacpp, a.nodes, how, a.cap_s)
                else:
                    d, g, first = torchrun_trial(a.nodes, how, a.cap_s)
                results.setdefault((how, system), []).append(d)
                print("  %-4s trial %d  %-8s  detect %-14s gone %-14s %s"
                      % (how, rep + 1, system, fmt(d, a.cap_s), fmt(g, a.cap_s), first), flush=True)
    slurm_ratios, slurm_capped = [], False
    for rep in range(a.slurm_reps):
        mega, slurm, first = slurm_trial(a.megacpp, a.cap_s)
        print("  kill trial %d  slurm     megacpp's node 0 ended %-10s the Slurm job ended %-14s %s"
              % (rep + 1, fmt(mega, a.cap_s), fmt(slurm, a.cap_s), first), flush=True)
        if mega:
            slurm_ratios.append((a.cap_s if slurm is None else slurm) / mega)
            slurm_capped = slurm_capped or slurm is None
    print("median detect (node 0 ended; restart: the first step after the restart), "
          "peer / megacpp (goal >= 10x):")
    for how in [h for h in harms if (h, "megacpp") in results]:
        m = [x for x in results[(how, "megacpp")] if x is not None]
        t = results[(how, "torchrun")]
        mm = statistics.median(m) if m else None
        capped = any(x is None for x in t)
        tm = statistics.median([a.cap_s if x is None else x for x in t])
        ratio = ("%s%.1fx" % (">= " if capped else "", tm / mm)) if mm else "n/a"
        print("  %-4s megacpp %s  torchrun %s%s  ratio %s"
              % (how, fmt(mm, a.cap_s), ">= " if capped else "", "%.2f s" % tm, ratio))
    if slurm_ratios:
        print("  kill under Slurm: the Slurm job's end / megacpp's node 0 end: %s%.1fx (median)"
              % (">= " if slurm_capped else "", statistics.median(slurm_ratios)))


if __name__ == "__main__":
    main()
