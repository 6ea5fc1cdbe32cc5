"""bench_train_step: `megacpp run` against its Python twin (bench/peers/train_twin.py under
torchrun) on the same model, batch, schedule, world and thread count, at three sizes.

For each size (recipes/tiny.toml, recipes/medium.toml, recipes/large.toml) it runs megacpp and
the twin alternately, --trials times each, in this one invocation, and prints for every trial
the steady-state tokens/s (the job's tokens over the summed wall time of the steps after
--warmup, so periodic snapshots count), the 1-minute load average before and after it, then the
median of each and their ratio. Then the per-phase breakdown of a step (mean over the steady
steps of every trial, milliseconds) for both:

  megacpp  batch handoff, forward, backward, clip, gradient reduction, orthogonalization,
           element-wise optimizer math, all-gather, snapshot, between steps (journal, publish)
           -- from receipts/bench_telemetry.json (steps[].phases)
  twin     batch, forward, backward (DDP's bucketed all-reduce overlapped with it), clip, Muon
           step, AdamW step -- from the twin's --json

and the optimizer's share of a step (clip + reduction + orthogonalization + element-wise math +
all-gather, over the step). Both sides evaluate on held-out windows as the recipe says
(train.eval_every, eval_tokens; megacpp from its val split's rings, the twin a PyTorch
no_grad loop on DDP): the evaluation tokens/s of each (tokens scored over the evaluations'
time, which neither side counts in its step time) and their ratio. Every trial is reported, not only the best; the machine is shared,
so compare ratios, not absolute times. Nothing is judged: the goals are printed beside the
figures.

    .venv/bin/python bench/train_step.py [--sizes tiny,medium,large] [--trials 3] [--ranks 2]
                                         [--threads 1] [--json OUT]

`make bench-train-step` runs it with the defaults.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))

# (size, recipe, steps per trial, goal ratio megacpp / twin)
SIZES = {
    "tiny": ("recipes/tiny.toml", 60, 1.2),
    "medium": ("recipes/medium.toml", 25, 1.05),
    "large": ("recipes/large.toml", 15, 1.05),
}
PHASES_OF_MEGACPP = [
    ("handoff", "handoffSeconds"),
    ("forward", "forwardSeconds"),
    ("backward", "backwardSeconds"),
    ("clip", "clipSeconds"),
    ("reduce", "reduceSeconds"),
    ("orthogonalize", "orthogonalizeSeconds"),
    ("elementwise", "updateSeconds"),
    ("all-gather", "gatherSeconds"),
    ("snapshot", "snapshotSeconds"),
    ("between", "betweenSeconds"),
]
OPTIMIZER_PARTS = ("clip", "reduce", "orthogonalize", "elementwise", "all-gather")


def load_avg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def recipe_geometry(path):
    with open(path, "rb") as f:
        r = tomllib.load(f)
    m, t = r.get("model", {}), r.get("train", {})
    return int(t.get("batch_size", 16)), int(m.get("seq_len", 64))


def plan_parameters(args, recipe):
    """The parameter count `megacpp plan` gives the recipe (its line 'total N (...)')."""
    out = subprocess.run([args.megacpp, "plan", recipe], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    match = re.search(r"^\s*total (\d+) ", out.stdout, re.M)
    if out.returncode != 0 or not match:
        raise SystemExit(f"bench_train_step: `megacpp plan {recipe}` gave no parameter total")
    return int(match.group(1))


def steady(steps, warmup):
    out = [s for s in steps if s["step"] > warmup]
    if not out:
        raise SystemExit(f"bench_train_step: no steps after the {warmup} warm-up steps")
    return out


def run_megacpp(args, recipe, steps, workdir, tag):
    run_dir = os.path.join(workdir, tag)
    env = dict(os.environ, MEGACPP_TRAINER_THREADS=str(args.threads))
    cmd = [args.megacpp, "run", recipe, "--ranks", str(args.ranks), "--steps", str(steps),
           "--run-dir", run_dir]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"bench_train_step: {' '.join(cmd)} exited {proc.returncode}")
    with open(os.path.join(run_dir, "receipts", "bench_telemetry.json")) as f:
        telemetry = json.load(f)
    evals = telemetry.get("evaluations", [])
    args.last_eval = {"count": len(evals), "tokens": sum(e["tokens"] for e in evals),
                      "seconds": sum(e["seconds"] for e in evals)}
    out = []
    for s in telemetry["steps"]:
        ph = s.get("phases")
        if ph is None:
            raise SystemExit("bench_train_step: bench_telemetry.json has no phases: "
                             "this megacpp predates the per-phase journal")
        out.append({"step": s["step"], "seconds": s["stepSeconds"],
                    "phases": {name: ph.get(key, 0.0) for name, key in PHASES_OF_MEGACPP}})
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def run_twin(args, recipe, steps, workdir, tag):
    out_json = os.path.join(workdir, tag + ".json")
    cmd = [args.python, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(args.ranks), os.path.join(HERE, "peers", "train_twin.py"),
           "--recipe", recipe, "--steps", str(steps), "--threads", str(args.threads),
           "--json", out_json, "--phases", "--print-every", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"bench_train_step: the twin exited {proc.returncode}")
    with open(out_json) as f:
        result = json.load(f)
    os.unlink(out_json)
    evals = result.get("evaluations", [])
    args.last_eval = {"count": len(evals), "tokens": sum(e["tokens"] for e in evals),
                      "seconds": sum(e["seconds"] for e in evals)}
    if result["params"] != args.expected_params:
        raise SystemExit(f"bench_train_step: the twin's model has {result['params']} parameters, "
                         f"megacpp's {args.expected_params}: they are not the same model")
    return [{"step": s["step"], "seconds": s["seconds"], "phases": s.get("phases", {})}
            for s in result["steps"]]


def tokens_per_second(steps, tokens_per_step):
    return tokens_per_step * len(steps) / sum(s["seconds"] for s in steps)


def mean_phases(trials):
    sums, n = {}, 0
    for steps in trials:
        for s in steps:
            n += 1
            for k, v in s["phases"].items():
                sums[k] = sums.get(k, 0.0) + v
    return {k: v / n for k, v in sums.items()}, statistics.fmean(
        s["seconds"] for steps in trials for s in steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,medium,large")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank, both sides")
    ap.add_argument("--warmup", type=int, default=5, help="steps before the steady state")
    ap.add_argument("--steps", type=int, default=0, help="steps per trial (0: the size's own)")
    ap.add_argument("--megacpp", default=os.environ.get("MEGACPP_BIN") or
                    os.path.join(ROOT, "build", "bin", "megacpp"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", help="write every trial's figures here")
    args = ap.parse_args()
    for path, what in ((args.megacpp, "megacpp binary"), (args.python, "venv python")):
        if not os.path.exists(path):
            raise SystemExit(f"bench_train_step: no {what} at {path}: run `make build` first")

    report = {"ranks": args.ranks, "threads": args.threads, "warmup": args.warmup, "sizes": {}}
    workdir = tempfile.mkdtemp(prefix="megacpp-bench-train-step-")
    summary = []
    try:
        for size in args.sizes.split(","):
            if size not in SIZES:
                raise SystemExit(f"bench_train_step: unknown size '{size}' (one of {list(SIZES)})")
            recipe, steps, goal = SIZES[size]
            steps = args.steps or steps
            batch, seq = recipe_geometry(os.path.join(ROOT, recipe))
            tokens_per_step = args.ranks * batch * seq
            args.expected_params = plan_parameters(args, recipe)
            print(f"== {size}: {recipe}, {args.expected_params / 1e6:.1f} M parameters, "
                  f"{args.ranks} ranks x {batch} x {seq} tokens, "
                  f"{args.threads} thread(s) per rank, {steps} steps, steady after "
                  f"{args.warmup}", flush=True)
            rates = {"megacpp": [], "twin": []}
            kept = {"megacpp": [], "twin": []}
            eval_rates = {"megacpp": [], "twin": []}
            for trial in range(1, args.trials + 1):
                for side, runner in (("megacpp", run_megacpp), ("twin", run_twin)):
                    before = load_avg()
                    t0 = time.monotonic()
                    all_steps = runner(args, recipe, steps, workdir, f"{side}-{size}-{trial}")
                    wall = time.monotonic() - t0
                    ss = steady(all_steps, args.warmup)
                    rate = tokens_per_second(ss, tokens_per_step)
                    rates[side].append(rate)
                    kept[side].append(ss)
                    ev = args.last_eval
                    if ev["count"] > 0 and ev["seconds"] > 0:
                        eval_rates[side].append(ev["tokens"] / ev["seconds"])
                    print(f"  trial {trial} {side:8s} {rate:10.0f} tokens/s  "
                          f"(median step {1e3 * statistics.median(s['seconds'] for s in ss):7.1f}"
                          f" ms, whole run {wall:5.1f} s)  load {before:.2f} -> "
                          f"{load_avg():.2f}", flush=True)
            med = {k: statistics.median(v) for k, v in rates.items()}
            ratio = med["megacpp"] / med["twin"]
            print(f"  median   megacpp {med['megacpp']:.0f}  twin {med['twin']:.0f}  "
                  f"ratio {ratio:.2f}x (goal >= {goal}x)")

            if eval_rates["megacpp"] and eval_rates["twin"]:
                em = {k: statistics.median(v) for k, v in eval_rates.items()}
                print(f"  evaluation (held-out, no gradients): megacpp {em['megacpp']:.0f} "
                      f"tokens/s, twin {em['twin']:.0f} tokens/s, ratio "
                      f"{em['megacpp'] / em['twin']:.2f}x ({ev['count']} evaluations of "
                      f"{ev['tokens'] / ev['count']:.0f} tokens a trial)", flush=True)
            else:
                em = {}
                print("  evaluation: the recipe does not evaluate (train.eval_every = 0)")

            m_phases, m_step = mean_phases(kept["megacpp"])
            t_phases, t_step = mean_phases(kept["twin"])
            print(f"  phases, ms per step (mean of the steady steps of {args.trials} trials):")
            print(f"    megacpp  step {1e3 * m_step:8.2f}: " + ", ".join(
                f"{k} {1e3 * v:.2f}" for k, v in m_phases.items()))
            other = m_step - sum(m_phases.values())
            print(f"             unaccounted {1e3 * other:.2f}")
            print(f"    twin     step {1e3 * t_step:8.2f}: " + ", ".join(
                f"{k} {1e3 * v:.2f}" for k, v in t_phases.items()))
            m_opt = sum(m_phases.get(k, 0.0) for k in OPTIMIZER_PARTS)
            t_opt = sum(v for k, v in t_phases.items() if k in ("clip", "optimizer_muon", "optimizer_adamw"))
            print(f"  optimizer share of a step: megacpp {100 * m_opt / m_step:.1f}% "
                  f"(goal <= 15% at tiny), twin {100 * t_opt / t_step:.1f}% (its all-reduce is "
                  f"inside backward)", flush=True)
            summary.append((size, med["megacpp"], med["twin"], ratio, goal,
                            100 * m_opt / m_step))
            report["sizes"][size] = {
                "recipe": recipe, "params": args.expected_params, "steps": steps,
                "tokens_per_step": tokens_per_step,
                "rates": rates, "median": med, "ratio": ratio, "goal": goal,
                "phases_ms": {"megacpp": {k: 1e3 * v for k, v in m_phases.items()},
                              "twin": {k: 1e3 * v for k, v in t_phases.items()}},
                "step_ms": {"megacpp": 1e3 * m_step, "twin": 1e3 * t_step},
                "optimizer_share": 100 * m_opt / m_step,
                "evaluation_tokens_per_second": em}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("== summary: size, megacpp tokens/s, twin tokens/s, ratio (goal), megacpp optimizer share")
    for size, m, t, ratio, goal, share in summary:
        print(f"  {size:7s} {m:10.0f} {t:10.0f}  {ratio:.2f}x (>= {goal}x)  {share:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
