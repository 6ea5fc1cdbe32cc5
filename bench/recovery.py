#!/usr/bin/env python3
"""Recovery time: megacpp --max-job-restarts 1 vs torchrun --max-restarts 1, side by side in
one invocation.

kill -9 of trainer rank 1 mid-training (after at least one checkpoint) -> the first step the
job completes after its automatic recovery from the newest checkpoint, on every rank.

megacpp   `megacpp run <tiny, checkpoint every --every steps> --ranks 2 --max-job-restarts 1`.
          The parts come from the run's own manifest (attempts[1].recovery, the processes'
          monotonic clocks): detect = the bench's kill -> the supervisor's detection
          (recovery.detectedAt); teardown; prepare (choose and verify the checkpoint, write
          the next launch contract) and relaunch (spawn every stage, rendezvous, parameter
          broadcast) -- together the "relaunch" row; restore (slowest rank); first step.
torchrun  `python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 --rdzv-backend
          c10d ... bench/peers/gloo_train.py --ckpt F --ckpt-every --every` with
          TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch's workaround for pytorch/pytorch#135712:
          with the store shared, or with the static rendezvous, the restarted group reads the
          old group's Gloo addresses from the store and never connects): the same model, batch and
          thread count on Gloo/CPU, rank 0 torch.save()s the model and AdamW state every
          --every steps and every rank loads it at start (what a torchrun user writes).
          detect = kill -> torchrun's first log line about the failure (its own wall-clock
          stamp, ms); teardown = -> the old workers gone (polled every 10 ms by this bench);
          relaunch = -> the slowest new worker begins loading (interpreter, import torch,
          process group, model, broadcast); restore (torch.load + load_state_dict, slowest
          rank); first step. The worker's milestones are its own wall-clock stamps (--events).

Total = kill -> the last rank's first completed step after recovery, for both. Every part
is contiguous with the next. torchrun's surviving worker dies by itself (Gloo's connection
error) while torchrun's monitor loop (0.1 s) has not yet noticed the failure, so its teardown
after detection is a reap: the teardown row is printed but judged only inside "detect +
teardown" (kill -> the old group gone). Both runs train --steps steps and must finish them
(state ok / exit 0). "First step" holds a whole training step; its row is split into a steady
step (the median of steps 2-7 after the first resumed one: the trainer's speed, which other
benchmarks compare) and what the recovery adds to it (first step - steady step), the part
judged. The megacpp
recipe is tiny with checkpoint_every = --every and muon_bf16 = false (bf16 orthogonalization
has no hardware path on most CPUs and would triple the step; the peer trains AdamW in fp32).
The goal (issue 10): megacpp faster in total and in every recovery part. Timings are
reported (medians over --reps interleaved pairs), never asserted.

Usage: .venv/bin/python bench/recovery.py [--reps 3] [--every 5] [--cap-s 120]
"""

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import failure_detection as fd  # noqa: E402  (the /proc helpers and cleanup of one trial)

REPO = fd.REPO
PEER = fd.PEER
PARTS = ("detect", "teardown", "down", "relaunch", "restore", "first_step", "steady_step",
         "first_step_overhead", "total")
LABELS = {"down": "  detect + teardown", "relaunch": "relaunch (prepare+relaunch)",
          "steady_step": "  of which a steady step",
          "first_step_overhead": "  first step - steady step"}
NO_GOAL = {"steady_step"}  # the trainer's speed, not recovery: bench_pipeline_overhead et al.
# torchrun's old group is gone by the time it detects the failure (its surviving worker dies on
# Gloo's connection error during the agent's 0.1 s monitor interval), so its teardown row is a
# reap of the already dead; megacpp detects the death at once (SIGCHLD) and then tears down.
# The two parts overlap in one system and follow each other in the other: they are judged
# together, as "detect + teardown" (kill -> the old group gone), and printed apart.
JUDGED_TOGETHER = {"teardown": "down"}
# The first step is a steady step (the trainer's speed: DistMuon against the peer's AdamW, not
# the same work; bench_optimizer and the step benchmarks compare it) plus what the recovery adds
# to it: the recovery part is judged as "first step - steady step".
JUDGED_AS = {"first_step": "first_step_overhead"}


def steady(step_seconds, from_step):
    """Median time of the steps 2-7 after the first resumed one: a step once warm. None when
    fewer than 3 of them were seen (the trial is then reported as failed, not guessed)."""
    xs = [step_seconds[s] for s in range(from_step + 2, from_step + 8) if s in step_seconds]
    return statistics.median(xs) if len(xs) >= 3 else None


def iso_wall(text):
    """RFC 3339 with a Z (the manifest's stamps) -> Unix seconds; None when empty."""
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def recipe_file(tmp, every):
    text = (REPO / "recipes" / "tiny.toml").read_text()
    for key, value in (("checkpoint_every", str(every)), ("muon_bf16", "false")):
        text, n = re.subn(rf"(?m)^{key} = \S+", f"{key} = {value}", text)
        if n != 1:
            raise RuntimeError(f"recipes/tiny.toml has no {key} line")
    path = tmp / "tiny_recovery.toml"
    path.write_text(text)
    return path


class MegacppRecovery(fd.MegacppTrial):
    def __init__(self, args, tmp, n, recipe):
        super().__init__(args, tmp, n, signal.SIGKILL, None)
        self.recipe = recipe

    def measure(self):
        cmd = [self.args.megacpp, "run", str(self.recipe), "--ranks", "2", "--steps",
               str(self.args.steps),
               "--max-job-restarts", "1", "--run-dir", str(self.run), "--data-dir",
               str(self.data), "--progress", "none"]
        pattern = re.escape(str(self.run)) + r"(\s|/|$)"
        res = {"system": "megacpp"}
        proc = victim = None
        manifest = self.run / "manifest.json"
        with open(self.log_path, "wb") as log:
            try:
                proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                victim, m = fd.megacpp_rank1(
                    proc, self.run, self.args, self.log_path,
                    lambda m: (m.get("latestCheckpointStep", 0) >= self.args.every
                               and m.get("stepsCompleted", 0) >= self.args.warm_steps))
                res["step_at_injection"] = m.get("stepsCompleted")
                t_kill = time.time()
                os.kill(victim, signal.SIGKILL)
                try:
                    rc = proc.wait(timeout=self.args.cap_s)
                except subprocess.TimeoutExpired:
                    rc = None
                m = fd.read_json(manifest) or {}
                attempts = m.get("attempts") or []
                rec = attempts[1] if len(attempts) > 1 else {}
                if rc != 0 or m.get("state") != "ok" or not (rec.get("recovery") or {}).get(
                        "firstStepAt"):
                    res["failed"] = (f"the run did not recover and finish within "
                                     f"{self.args.cap_s:g} s (rc {rc}, state {m.get('state')}); "
                                     f"see {self.log_path}")
                    return res
                telemetry = fd.read_json(self.run / "receipts" / "bench_telemetry.json") or {}
                secs = {s["step"]: s["stepSeconds"] for s in telemetry.get("steps", [])}
                res["steady_step"] = steady(secs, rec.get("fromStep", 0))
                if res["steady_step"] is None:
                    res["failed"] = "fewer than 3 steady steps in the telemetry (raise --steps)"
                    return res
                r = rec["recovery"]
                get = lambda k: r.get(k, 0.0)  # noqa: E731  (a 0 the JSON codec left out)
                res["from_step"] = rec.get("fromStep")
                res["detect"] = iso_wall(r.get("detectedAt")) - t_kill
                res["teardown"] = get("teardownSeconds")
                res["prepare"] = get("prepareSeconds")
                res["relaunch"] = get("prepareSeconds") + get("relaunchSeconds")
                res["restore"] = get("restoreSeconds")
                res["first_step"] = get("firstStepSeconds")
                res["first_step_overhead"] = res["first_step"] - res["steady_step"]
                res["down"] = res["detect"] + res["teardown"]
                res["total"] = iso_wall(r.get("firstStepAt")) - t_kill
                return res
            finally:
                survivors = fd.kill_everything([proc] if proc else [], [victim] if victim else [],
                                               pattern)
                if survivors:
                    res["unkillable"] = survivors
                self._remove_run_leftovers()
                if not self.args.keep:
                    shutil.rmtree(self.run, ignore_errors=True)


GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) +\d+ [^\]]*\] (.*)$", re.M)


def glog_lines(text, year):
    """torchrun's (glog-style) log lines as (Unix seconds, message); local time, no year."""
    out = []
    for m in GLOG.finditer(text):
        mo, d, h, mi, s, frac, msg = m.groups()
        t = datetime.datetime(year, int(mo), int(d), int(h), int(mi), int(s),
                              int(frac[:6].ljust(6, "0")))
        out.append((t.timestamp(), msg))
    return out


def read_events(path):
    out = []
    for line in (fd.read_bytes(path) or b"").decode(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a kill
    return out


class TorchrunRecovery:
    def __init__(self, args, tmp, n):
        self.args = args
        self.tag = str(tmp / f"tr{n}")
        self.log_path = tmp / f"tr{n}.log"
        self.ckpt = tmp / f"tr{n}.pt"
        self.events = tmp / f"tr{n}.events"

    def measure(self):
        port = fd.free_port()
        cmd = [self.args.python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "recovery",
               str(PEER), "--steps", str(self.args.steps), "--print-every", "1", "--ckpt",
               str(self.ckpt),
               "--ckpt-every", str(self.args.every), "--events", str(self.events),
               "--tag", self.tag]
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        pattern = re.escape(self.tag) + r"(\s|$)"
        res = {"system": "torchrun"}
        proc = None
        workers = []
        with open(self.log_path, "wb") as log:
            try:
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                # At least one checkpoint saved before the kill.
                victim, workers, res["step_at_injection"] = fd.torchrun_rank1(
                    proc, self.args, self.log_path,
                    lambda: any(e["event"] == "saved" for e in read_events(self.events)))
                old = list(workers)
                t_kill = time.time()
                os.kill(victim, signal.SIGKILL)
                t_gone = None
                deadline = time.monotonic() + self.args.cap_s
                while time.monotonic() < deadline and proc.poll() is None:
                    if t_gone is None and not any(fd.alive(p) for p in old):
                        t_gone = time.time()
                    time.sleep(fd.POLL_S)
                ev = [e for e in read_events(self.events) if e["restart"] == 1]
                firsts = {e["rank"]: e for e in ev if e["event"] == "first_step"}
                if proc.poll() != 0 or t_gone is None or len(firsts) < 2:
                    res["failed"] = (f"torchrun did not recover and finish within "
                                     f"{self.args.cap_s:g} s (rc {proc.poll()}); see "
                                     f"{self.log_path}")
                    return res
                loaded = [e for e in ev if e["event"] == "loaded"]
                if len(loaded) < 2:
                    res["failed"] = "the restarted workers did not load the checkpoint"
                    return res
                year = datetime.datetime.fromtimestamp(t_kill).year
                text = (fd.read_bytes(self.log_path) or b"").decode(errors="replace")
                # glog stamps are cut to ms: a line in the kill's millisecond counts.
                after = [t for t, _ in glog_lines(text, year) if t >= t_kill - 0.001]
                if not after:
                    res["failed"] = "torchrun logged nothing about the failure"
                    return res
                t_detect = min(after)
                restore_begin = max(e["t"] - e["seconds"] for e in loaded)
                restore_end = max(e["t"] for e in loaded)
                t_first = max(e["t"] for e in firsts.values())
                res["from_step"] = loaded[0]["step"]
                # rank 0's step events after the restart: consecutive differences are step times.
                t_at = {e["step"]: e["t"] for e in ev if e["event"] == "step" and e["rank"] == 0}
                res["steady_step"] = steady(
                    {s: t_at[s] - t_at[s - 1] for s in t_at if s - 1 in t_at}, res["from_step"])
                if res["steady_step"] is None:
                    res["failed"] = "fewer than 3 steady steps in rank 0's events (raise --steps)"
                    return res
                res["detect"] = t_detect - t_kill
                res["teardown"] = t_gone - t_detect
                res["relaunch"] = restore_begin - t_gone
                res["restore"] = restore_end - restore_begin
                res["first_step"] = t_first - restore_end
                res["first_step_overhead"] = res["first_step"] - res["steady_step"]
                res["down"] = res["detect"] + res["teardown"]
                res["total"] = t_first - t_kill
                return res
            finally:
                survivors = fd.kill_everything([proc] if proc else [], workers, pattern)
                if survivors:
                    res["unkillable"] = survivors


def describe(r):
    if r.get("failed"):
        return f"    {r['system']:8s} FAILED: {r['failed']}"
    parts = "  ".join(f"{p} {r[p]:.3f}" for p in PARTS if p not in ("first_step_overhead", "down"))
    extra = f" (prepare {r['prepare']:.3f})" if "prepare" in r else ""
    return (f"    {r['system']:8s} killed after step {r.get('step_at_injection')}, resumed from "
            f"step {r.get('from_step')}: {parts}{extra} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="interleaved pairs of trials")
    ap.add_argument("--every", type=int, default=5, help="steps between checkpoints (both)")
    ap.add_argument("--steps", type=int, default=30,
                    help="steps of each run (both finish them after the recovery)")
    ap.add_argument("--warm-steps", type=int, default=12,
                    help="steps trained before the kill (and at least one checkpoint)")
    ap.add_argument("--cap-s", type=float, default=120.0, help="bound on one recovery")
    ap.add_argument("--startup-s", type=float, default=120.0, help="bound on start-up")
    ap.add_argument("--megacpp", default=str(REPO / "build" / "bin" / "megacpp"))
    ap.add_argument("--python", default=sys.executable, help="python with torch (torchrun)")
    ap.add_argument("--json", help="also write every sample to this file")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs) for debugging")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, fd._on_sigterm)
    torch_version = subprocess.run(
        [args.python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        capture_output=True, text=True, timeout=60).stdout.strip()
    print("recovery after kill -9 of a rank: megacpp --max-job-restarts 1 vs torchrun "
          "--max-restarts 1 (2 ranks, tiny model, Gloo/CPU)")
    print(f"  host: {os.cpu_count()} cores; torch {torch_version}; checkpoint every "
          f"{args.every} steps; kill after >= {args.warm_steps} steps; {args.reps} pairs")
    sys.stdout.flush()

    tmp = Path(tempfile.mkdtemp(prefix="mcrec-"))
    results = {"megacpp": [], "torchrun": []}
    try:
        recipe = recipe_file(tmp, args.every)
        for n in range(args.reps):  # interleaved: load drift hits both systems alike
            for system in ("megacpp", "torchrun"):
                trial = (MegacppRecovery(args, tmp, n, recipe) if system == "megacpp"
                         else TorchrunRecovery(args, tmp, n))
                r = trial.measure()
                results[system].append(r)
                print(describe(r), flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        raise
    finally:
        if args.keep:
            print(f"\nkept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    med = {}
    for system, rs in results.items():
        ok = [r for r in rs if not r.get("failed")]
        med[system] = {p: statistics.median(r[p] for r in ok) for p in PARTS} if ok else None
    mc, tr = med["megacpp"], med["torchrun"]
    print(f"\nmedian seconds{'':16s}{'megacpp':>10s}{'torchrun':>10s}{'torchrun/megacpp':>18s}"
          f"  goal: megacpp faster")
    verdicts = []
    for p in PARTS:
        m = mc[p] if mc else None
        t = tr[p] if tr else None
        ratio = f"{t / m:.1f}x" if m and t and m > 0 else "-"
        verdict = ("-" if m is None or t is None or p in NO_GOAL
                   else f"(in {LABELS[JUDGED_TOGETHER[p]].strip()})" if p in JUDGED_TOGETHER
                   else f"(as {LABELS[JUDGED_AS[p]].strip()})" if p in JUDGED_AS
                   else ("PASS" if m < t else "FAIL"))
        verdicts.append(verdict)
        label = LABELS.get(p, p.replace("_", " "))
        print(f"  {label:28s}{'-' if m is None else f'{m:.3f}':>10s}"
              f"{'-' if t is None else f'{t:.3f}':>10s}{ratio:>18s}  {verdict}")
    judged = [v for v in verdicts if v in ("PASS", "FAIL")]
    if judged:
        print(f"goal (megacpp faster in total and in every recovery part): "
              f"{'PASS' if all(v == 'PASS' for v in judged) else 'FAIL'}")
    failed = sum(bool(r.get("failed")) for rs in results.values() for r in rs)
    if failed:
        print(f"\n{failed} trial(s) failed to recover within the cap (see above)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch_version, "every": args.every, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, fd.Interrupted):
        sys.exit(130)
    except RuntimeError as e:
        print(f"recovery: {e} (rerun with --keep to keep the logs)", file=sys.stderr)
        sys.exit(2)
