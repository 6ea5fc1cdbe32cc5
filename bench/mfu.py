"""bench_mfu: the model FLOPs utilisation of a finished `megacpp run` against its device's peak.

    .venv/bin/python bench/mfu.py RUN_DIR [--peak-tflops auto|T] [--warmup 10] [--megacpp BIN]
                                  [--twin [--twin-steps N]]

FLOPs per trained token (PaLM's accounting, the one MFU figures are quoted in): 6 x the
parameters that multiply (every parameter but the embedding's lookup table) for the forward and
backward matmuls, plus 12 x n_layers x d_model x seq_len for attention's scores and values
(causal attention not halved). The parameter count is `megacpp plan`'s total for the recipe the
run recorded; the embedding is vocab_size x d_model. Tokens per second are the steady state:
the job's tokens over the summed wall time of the steps after --warmup (receipts: steps[]
stepSeconds; evaluations are not in them). The peak is the card's dense bfloat16 rate:
--peak-tflops T, or `auto` (rank 0's device name from receipts/backend_identity.json, else
nvidia-smi's for device 0, looked up in PEAK_BF16_TFLOPS; a card not in the table is an error
naming it). Prints the card, the figures and the ratio;
`make device-check` runs it on `gpu-small` (goal: MFU >= 40%). Nothing is judged here.

--twin: then the peer a user would write instead, on the same device, world and recipe: the
recipe's PyTorch twin (bench/peers/train_twin.py under torchrun: eager PyTorch, DDP, autocast
for bf16-mixed, torch.optim.Muon + AdamW) trained --twin-steps steps (default: the run's), its
steady tokens/s (steps after --warmup) under the same FLOP accounting and peak, and megacpp's
tokens/s over the twin's: whether a gap to the goal is megacpp's or eager PyTorch's.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))

# Dense (no sparsity) bfloat16 tensor-core peaks, TFLOP/s, from the vendors' data sheets.
PEAK_BF16_TFLOPS = {
    "H100 SXM": 989.4,
    "H100 80GB HBM3": 989.4,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H200": 989.4,
    "A100": 312.0,
    "L40S": 362.1,
}


def card_peak(run_dir):
    """(card name, dense bf16 TFLOP/s) of the run's rank 0 device: the name its trainer recorded
    (receipts/backend_identity.json), else nvidia-smi's for device 0."""
    name = ""
    try:
        with open(os.path.join(run_dir, "receipts", "backend_identity.json")) as f:
            identity = json.load(f)["ranks"][0].get("identity", {})
        if identity.get("device", "").startswith("cuda"):
            name = identity.get("deviceName", "")
    except (OSError, ValueError, KeyError, IndexError):
        pass
    if not name:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                                 capture_output=True, text=True, timeout=30)
            name = out.stdout.strip() if out.returncode == 0 else ""
        except OSError:  # no nvidia-smi: no driver here
            name = ""
    if not name:
        raise SystemExit("bench_mfu: no CUDA device named by the run or nvidia-smi: pass --peak-tflops")
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return name, tflops
    raise SystemExit(f"bench_mfu: no dense bf16 peak known for '{name}': pass --peak-tflops")


def plan_total(megacpp, recipe):
    out = subprocess.run([megacpp, "plan", recipe], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    match = re.search(r"^\s*total (\d+) ", out.stdout, re.M)
    if not match:
        raise SystemExit(f"bench_mfu: `megacpp plan {recipe}` gave no parameter total")
    return int(match.group(1))


def flops_per_token(params, vocab, d_model, n_layers, seq_len):
    return 6 * (params - vocab * d_model) + 12 * n_layers * d_model * seq_len


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--peak-tflops", default="auto")
    ap.add_argument("--warmup", type=int, default=10, help="steps before the steady state")
    ap.add_argument("--megacpp", default=os.environ.get("MEGACPP_BIN") or
                    os.path.join(ROOT, "build", "bin", "megacpp"))
    ap.add_argument("--twin", action="store_true",
                    help="also train the recipe's PyTorch twin on the same device and world")
    ap.add_argument("--twin-steps", type=int, default=0,
                    help="the twin's steps (default: as many as the run's)")
    args = ap.parse_args()
    with open(os.path.join(args.run_dir, "launch.json")) as f:
        launch = json.load(f)
    with open(os.path.join(args.run_dir, "receipts", "bench_telemetry.json")) as f:
        steps = json.load(f)["steps"]
    model = launch["recipe"]["model"]
    vocab, d, layers, seq = (int(model[k]) for k in ("vocabSize", "dModel", "nLayers", "seqLen"))
    params = plan_total(args.megacpp, launch["recipe"]["path"])
    per_token = flops_per_token(params, vocab, d, layers, seq)
    batch = launch["batch"]
    tokens_per_step = int(batch["windowsPerStep"]) * int(batch["seqLen"])
    steady = [s for s in steps if s["step"] > args.warmup]
    if not steady:
        raise SystemExit(f"bench_mfu: no step after the {args.warmup} warm-up steps")
    tokens_per_second = tokens_per_step * len(steady) / sum(s["stepSeconds"] for s in steady)
    if args.peak_tflops == "auto":
        card, peak = card_peak(args.run_dir)
    else:
        card, peak = "given", float(args.peak_tflops)
    world = int(launch["world"])
    achieved = tokens_per_second * per_token / 1e12  # TFLOP/s over the job
    mfu = achieved / (peak * world)
    print(f"mfu: recipe {launch['recipe']['name']}, {params} parameters, {per_token} FLOP per "
          f"token, {world} rank(s) on {launch.get('device') or 'cpu'} ({card}, peak {peak:g} "
          f"TFLOP/s bf16 dense each)")
    print(f"mfu: {tokens_per_second:.1f} tokens/s over {len(steady)} steady steps -> "
          f"{achieved:.4g} TFLOP/s, MFU {100 * mfu:.3g}% (goal >= 40% for gpu-small on a GPU)")
    print_phases(steady)
    if args.twin:
        twin_steps = args.twin_steps or max(s["step"] for s in steps)
        twin = run_twin(launch, twin_steps, world)
        twin_steady = [s for s in twin["steps"] if s["step"] > args.warmup]
        if not twin_steady:
            raise SystemExit(f"bench_mfu: the twin trained no step after the {args.warmup} "
                             f"warm-up steps (--twin-steps)")
        twin_tokens = int(twin["world"]) * int(twin["batch"]) * int(twin["seq"])
        twin_tps = twin_tokens * len(twin_steady) / sum(s["seconds"] for s in twin_steady)
        twin_achieved = twin_tps * per_token / 1e12
        print(f"mfu: twin (PyTorch eager, DDP, {twin['precision']}, torch.optim Muon + AdamW; "
              f"{twin['params']} parameters on {twin.get('device', 'cpu')}): {twin_tps:.1f} "
              f"tokens/s over {len(twin_steady)} steady steps -> {twin_achieved:.4g} TFLOP/s, "
              f"MFU {100 * twin_achieved / (peak * world):.3g}%")
        print(f"mfu: megacpp / twin tokens/s {tokens_per_second / twin_tps:.2f}")
    return 0


def run_twin(launch, steps, world):
    """The twin's JSON (train_twin.py --json) for the run's recipe, device and world."""
    recipe = launch["recipe"]["path"]
    for candidate in (recipe, os.path.join(ROOT, recipe),
                      os.path.join(ROOT, "recipes", recipe + ".toml")):
        if os.path.isfile(candidate):
            recipe = candidate
            break
    else:
        raise SystemExit(f"bench_mfu: the run's recipe {recipe} is not a file the twin can read")
    device = launch.get("device") or "cpu"
    with tempfile.TemporaryDirectory(prefix="megacpp-mfu-twin-") as tmp:
        out = os.path.join(tmp, "twin.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), os.path.join(HERE, "peers", "train_twin.py"),
               "--recipe", recipe, "--steps", str(steps), "--device", device, "--json", out,
               "--print-every", str(steps)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            raise SystemExit("bench_mfu: the twin failed:\n" + "\n".join(tail))
        with open(out) as f:
            return json.load(f)


# Where the steady steps' time went: the median of each part the trainers journaled (StepPhases;
# the mean over ranks). On a GPU a part's clock is the host's: a step reads the device once, at
# its end (DESIGN.md "GPU lane (second part)"), so each part is the time to issue its work and
# the device's remainder lands in the optimizer's last part; the step's total is the device's.
PHASES = ("waitSeconds", "handoffSeconds", "forwardSeconds", "backwardSeconds", "clipSeconds",
          "reduceSeconds", "orthogonalizeSeconds", "updateSeconds", "gatherSeconds",
          "snapshotSeconds", "betweenSeconds")


def print_phases(steady):
    with_phases = [s for s in steady if s.get("phases")]
    if not with_phases:
        print("mfu: no step phases journaled")
        return
    median = statistics.median_high
    step = median([s["stepSeconds"] for s in with_phases])
    parts = []
    for key in PHASES:
        value = median([(s if key == "waitSeconds" else s["phases"]).get(key, 0.0)
                        for s in with_phases])
        if value > 0:
            parts.append(f"{key[:-len('Seconds')]} {1e3 * value:.1f}")
    print(f"mfu: median step {1e3 * step:.1f} ms: " + ", ".join(parts) + " (ms)")


if __name__ == "__main__":
    sys.exit(main())
