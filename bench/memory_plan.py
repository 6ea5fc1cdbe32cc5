"""bench_memory_plan: memory per rank and tokens/s of each precision / recomputation / sharding
setting — megacpp's plan, megacpp measured, and the same model in PyTorch (DDP, + torch.autocast
for bf16-mixed, + torch.utils.checkpoint for full recomputation; FSDP2 fully_shard with
MixedPrecisionPolicy for the sharded layout; bench/peers/train_twin.py under torchrun) — side by
side in one invocation.

For each size (recipes/large.toml, 57 M parameters; `xl`, the same decoder at d_model 1024,
101 M parameters; `tiny-hybrid`, every block family at 2 M parameters, megacpp only) and each
setting (data parallel "dp": fp32; bf16-mixed; bf16-mixed +
selective; bf16-mixed + full — and "tp2", nemo_native's tensor-parallel group of the 2 ranks
holding weight shards: fp32; bf16-mixed + selective, against FSDP2 sharding the same model over
the 2 ranks) it prints:

  plan GiB        `megacpp plan`'s per-rank total (recipes/plan.h: an upper bound, everything
                  at once)
  megacpp GiB     the largest over the ranks of the trainer's peak resident size above its
                  resident size before the model was built, the pages of mapped files
                  (libtorch's code: shared, reclaimable) out of both (bench_result.json
                  memory.aboveBaseline), what the plan estimates; the rank's tensors come from
                  its host allocator (MEGACPP_HOST_ALLOCATOR, stages/trainer/host_allocator.h)
  measured/plan   their ratio
  less staging    megacpp's measurement less the plan's snapshot staging region, against the
                  twin's (which does not checkpoint)
  twin GiB        the same for the PyTorch twin (VmHWM above VmRSS before its model, RssFile
                  out of both), max over ranks; `selective` has no twin (torch has no per-op recomputation policy in
                  eager DDP): its row shows the twin's `none`
  tokens/s        steady-state tokens/s of each (megacpp: bench_result.json; twin: median step)

megacpp's runs checkpoint halfway (as a run does every checkpoint_every steps), so the snapshot
staging region (host shared memory, in the plan on --device cpu) is in their peak and the
snapshot's copy in their tokens/s; the twin does not checkpoint. Nothing is judged: the issue's goal (measured
within 15% of the plan) is printed beside the figures. CPU, Gloo, 2 ranks, 1 thread per rank.

    .venv/bin/python bench/memory_plan.py [--sizes large,xl,tiny-hybrid] [--layouts dp,tp2]
                                          [--steps 6]
                                          [--twin-steps 4] [--no-twin] [--json OUT]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from bench_host import cpu_name

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
# (precision, recompute, layout): "dp" data parallel over the 2 ranks (the twin: DDP); "tp2"
# nemo_native, one tensor-parallel group of 2 holding weight shards (the twin: FSDP2).
SETTINGS = [("fp32", "none", "dp"), ("bf16-mixed", "none", "dp"), ("bf16-mixed", "selective", "dp"),
            ("bf16-mixed", "full", "dp"), ("fp32", "none", "tp2"),
            ("bf16-mixed", "selective", "tp2")]
# size: (the recipe it starts from, the keys it changes). tiny-hybrid (every block family, 2 M
# parameters) has no twin: train_twin.py models the attention decoder only.
SIZES = {"large": ("large", {}), "xl": ("large", {"d_model": "1024", "n_heads": "8"}),
         "tiny-hybrid": ("tiny-hybrid", {})}


def megacpp_bin():
    for d in ("build", "build-release"):
        p = os.path.join(ROOT, d, "bin", "megacpp")
        if os.path.exists(p):
            return p
    sys.exit("bench_memory_plan: no build/bin/megacpp: run `make` first")


def write_recipe(tmp, size, precision, recompute, steps, for_twin):
    """The size's recipe, checkpointing halfway; megacpp's copy names the memory keys, the
    twin's does not (it refuses keys it does not model)."""
    base, keys = SIZES[size]
    with open(os.path.join(ROOT, "recipes", base + ".toml")) as f:
        text = f.read()
    for key, value in keys.items():
        text = re.sub(r"(?m)^%s = \S+" % key, "%s = %s" % (key, value), text)
    text = re.sub(r"(?m)^checkpoint_every = \S+", "checkpoint_every = %d" % max(1, steps // 2), text)
    name = "mem-%s-%s-%s%s" % (size, precision, recompute, "-twin" if for_twin else "")
    text = re.sub(r'(?m)^name = "\S+"', 'name = "%s"' % name, text)
    if not for_twin:
        text = text.replace("[train]\n", '[train]\nprecision = "%s"\nrecompute = "%s"\n'
                            % (precision, recompute), 1)
    path = os.path.join(tmp, name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def layout_args(layout):
    return ["--mode", "nemo_native"] if layout == "tp2" else []


def plan_gib(recipe, layout):
    out = subprocess.run([megacpp_bin(), "plan", recipe, "--ranks", "2"] + layout_args(layout),
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"memory per rank \(.*\): .*: ([0-9.]+) GiB", out)
    staging = re.search(r"snapshot staging ([0-9.]+) GiB", out)
    return (float(m.group(1)), float(staging.group(1)),
            re.search(r"memory per rank .*", out).group(0))


def run_megacpp(recipe, layout, steps, tmp):
    run = os.path.join(tmp, "run-" + os.path.basename(recipe)[:-5] + "-" + layout)
    subprocess.run([megacpp_bin(), "run", recipe, "--ranks", "2", "--steps", str(steps),
                    "--run-dir", run, "--data-dir", os.path.join(tmp, "data"), "--progress",
                    "none"] + layout_args(layout), check=True, capture_output=True)
    with open(os.path.join(run, "receipts", "bench_result.json")) as f:
        r = json.load(f)
    shutil.rmtree(run, ignore_errors=True)
    return r["memory"]["aboveBaseline"] / 2**30, r["tokensPerSecond"]


def run_twin(recipe, precision, recompute, layout, steps, tmp):
    out = os.path.join(tmp, "twin.json")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", "29591", os.path.join(HERE, "peers", "train_twin.py"),
                    "--recipe", recipe, "--steps", str(steps), "--precision", precision,
                    "--recompute", recompute, "--json", out, "--print-every", "1000"]
                   + (["--fsdp"] if layout == "tp2" else []),
                   check=True, capture_output=True, env=env)
    with open(out) as f:
        d = json.load(f)
    steady = [s["seconds"] for s in d["steps"][1:]] or [d["steps"][0]["seconds"]]
    steady.sort()
    median = steady[len(steady) // 2]
    return d["memory_above_baseline"] / 2**30, 2 * d["batch"] * d["seq"] / median


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="large,xl,tiny-hybrid")
    ap.add_argument("--layouts", default="dp,tp2", help="dp, tp2 or both")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--twin-steps", type=int, default=4)
    ap.add_argument("--no-twin", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    print("bench_memory_plan on %s, 2 ranks over Gloo, 1 thread each; goal: megacpp measured "
          "within 15%% of the plan" % cpu_name())
    rows = []
    tmp = tempfile.mkdtemp(prefix="megacpp-memory-plan-")
    try:
        for size in args.sizes.split(","):
            twin_none = None
            for precision, recompute, layout in SETTINGS:
                if layout not in args.layouts.split(","):
                    continue
                recipe = write_recipe(tmp, size, precision, recompute, args.steps, False)
                plan, staging, line = plan_gib(recipe, layout)
                measured, tps = run_megacpp(recipe, layout, args.steps, tmp)
                twin = (None, None)
                if not args.no_twin and size != "tiny-hybrid":
                    twin_recompute = "none" if recompute == "selective" else recompute
                    if recompute == "selective" and layout == "dp" and twin_none is not None:
                        twin = twin_none
                    else:
                        twin = run_twin(write_recipe(tmp, size, precision, recompute,
                                                     args.steps, True),
                                        precision, twin_recompute, layout, args.twin_steps, tmp)
                    if precision == "bf16-mixed" and recompute == "none":
                        twin_none = twin
                row = {"size": size, "precision": precision, "recompute": recompute,
                       "layout": layout,
                       "plan_gib": plan, "plan_staging_gib": staging, "megacpp_gib": measured,
                       "megacpp_tokens_s": tps,
                       "twin_gib": twin[0], "twin_tokens_s": twin[1], "plan": line}
                rows.append(row)
                twin_text = ("twin %.3f GiB %7.0f tok/s  megacpp/twin memory %.2fx (less the "
                             "planned staging %.2fx) tokens/s %.2fx"
                             % (twin[0], twin[1], measured / twin[0],
                                (measured - staging) / twin[0], tps / twin[1])
                             if twin[0] else "")
                print("%-5s %-10s %-9s %-3s plan %.3f GiB  megacpp %.3f GiB (measured/plan %.2f)  "
                      "%7.0f tok/s  %s" % (size, precision, recompute, layout, plan, measured,
                                           measured / plan, tps, twin_text), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
