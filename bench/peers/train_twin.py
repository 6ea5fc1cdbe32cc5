#!/usr/bin/env python3
r"""The PyTorch twin of `megacpp run RECIPE` for the training-throughput benchmark: the recipe's
model, batch and LR schedule trained the way a stock PyTorch user would, one torchrun process
per rank, Gloo on CPU, DistributedDataParallel, torch.optim.Muon + torch.optim.AdamW.

  torchrun --nproc-per-node 2 bench/peers/train_twin.py --recipe recipes/tiny.toml --steps 60 \
      [--threads 1] [--json OUT.json] [--phases] [--print-every N] [--bucket-cap-mb MB] \
      [--data random|progressions] [--set model.d_model=512 --set train.batch_size=8 ...] \
      [--precision fp32|bf16-mixed] [--recompute none|full] [--device cpu|cuda]

Equal to megacpp (stages/trainer/model.cpp, train_step.cpp, recipes/recipe.h):
  recipe  parsed with tomllib; keys megacpp does not know are refused, absent keys take
          recipe.h's defaults; --set SECTION.KEY=VALUE (TOML value) overrides a [model],
          [train] or [optim] key, or a top-level one without a section.
  model   decoder of n_layers A blocks (the only block kind supported: a pattern with E, M or R,
          or mode nemo_native, is refused): embedding -> RMSNorm (no weight, eps 1e-6) ->
          blocks -> RMSNorm -> untied head, no biases. A block is x + attn(norm(x)), then
          x + mlp(norm(x)); attention has QK-norm, RoPE (rope_theta), causal SDPA, n_kv_heads
          key/value heads (grouped-query when fewer than n_heads); the MLP is relu^2 with
          ffn_hidden (or mlp_mult * d_model) hidden units.
  init    one torch.Generator seeded with train.seed, drawn in megacpp's registration order:
          embed N(0, 1); per block the fused qkv [(H + 2 KV) * hd, D] and mlp.fc
          U(+-sqrt(3 / fan_in)), attn.proj and mlp.proj zero; head N(0, 0.001). With
          optim.qkv_split the twin holds q, k and v as three nn.Linear whose weights are the
          row slices of that fused draw, so the weights are megacpp's, and the forward is the
          same maths as the fused projection (three GEMMs instead of one).
  batch   train.batch_size sequences of seq_len + 1 tokens per rank per step, from a
          torch.Generator seeded by (seed, rank, step): the data costs nothing and is not what
          is measured (megacpp reads its corpus from a prefetching ring). --data random (the
          default): uniform tokens in [0, vocab), whose entropy is ln(vocab) (5.545 for 256),
          so the loss cannot fall below its starting point; --data progressions: each row an
          arithmetic progression mod vocab with a random start and a random stride in [1, 8],
          learnable from context, for checking that the loop trains (same cost and shapes).
  loss    mean cross-entropy of the rank's batch; the reported loss is rank 0's own.
  groups  Muon: every 2-D matrix of the blocks (q, k, v or qkv, attn.proj, mlp.fc, mlp.proj);
          AdamW: embed.weight at embed_lr, head.weight at head_lr, anything else at adam_lr,
          betas (adam_beta1, adam_beta2), eps adam_eps, weight decay adam_weight_decay.
  LR      every group's peak LR times megacpp's lr_scale(): linear warmup over warmup_steps,
          then cosine down to min_lr_ratio at the last step (--steps).
  eval    every train.eval_every steps and at the last (0: never), eval_tokens // seq_len
          held-out windows over all ranks (rank r the r-th contiguous part, in batches of at
          most batch_size rows, tokens as --data draws them from a fixed seed) scored the way a
          PyTorch user does it: model.eval(), torch.no_grad() (under the same autocast), the
          summed cross-entropy and its token count all-reduced; its time is kept apart and
          is not in the step's.
  clip    global gradient norm clipped to train.grad_clip (0: off) with scale
          clip / (norm + 1e-6), as TrainStep::grad_norm_and_clip.
  threads torch.set_num_threads(--threads), default 1 (MEGACPP_TRAINER_THREADS' default).
  memory  train.precision and train.recompute from the recipe unless --precision / --recompute
          say otherwise (recompute none or full; grad_reduce fp32 only).
  device  --device cuda: rank r on cuda:LOCAL_RANK, NCCL, DDP with device_ids, autocast on
          cuda, the batch made on the host and copied without blocking (from page-locked
          memory); each step ends with torch.cuda.synchronize(), as a megacpp step ends with
          its one read of the device, so a step's seconds are the device's.

Semantic differences from megacpp (the benchmark compares systems, not bit-equal runs):
  1. Orthogonalization: megacpp's default is Polar Express (5 per-iteration coefficient
     triples, X / (1.02 ||X||_F + 1e-6), tall matrices iterated as X^T X); torch Muon only runs
     Newton-Schulz with one fixed triple (3.4445, -4.7750, 2.0315), X / max(||X||_F, 1e-7), on
     the wide orientation. With muon_orthogonalizer = "newton_schulz" the two agree (up to
     1e-7 added vs clamped).
  2. Precision: torch Muon always orthogonalizes in bfloat16; megacpp does when muon_bf16 is
     true, or "auto" (the shipped recipes) on a GPU or a CPU with bfloat16 matrix units, and
     keeps float32 otherwise.
  3. Variance reduction: megacpp's DistMuon is NorMuon (a factored second moment with
     muon_beta2 over the longer side, rescaled to keep the Frobenius norm); torch Muon has none,
     and muon_beta2 is unused.
  4. Weight decay: megacpp's Muon decay is cautious (applied only where update and parameter
     agree in sign) and scaled by the shape-adjusted LR, p -= lr_eff * (u + wd * p * mask);
     torch Muon decays every entry with the unadjusted LR, p *= 1 - lr * wd, then
     p -= lr_eff * u. Both are no-ops at the recipes' muon_weight_decay = 0.
  5. LR shape scale: both use lr_eff = lr * sqrt(max(1, rows / cols)) (torch's
     adjust_lr_fn="original"); megacpp computes it per q/k/v slice of the fused matrix, the
     twin per separate q/k/v matrix: the same numbers.
  6. Batching: megacpp stacks same-shape matrices and orthogonalizes each stack as one batched
     matmul chain; torch Muon loops over parameters one at a time (it has no foreach path).
  7. Sharding: megacpp's DistMuon is ZeRO-2 (one reduce-scatter of all stacked gradients, each
     rank updates its own share of the matrices and their state, one all-gather) and
     DistAdamW shards parameters of >= adamw_crossover elements the same way; here DDP
     all-reduces every gradient and every rank steps every parameter with a full copy of the
     optimizer state.
  8. Gradient reduction: megacpp reduces once per step inside the optimizers, after backward
     (on Gloo one point-to-point reduce-scatter round for both optimizers' gradients, then one
     all-gather round); DDP all-reduces 25 MB buckets (or --bucket-cap-mb) overlapped with
     backward. DDP also
     broadcasts parameters from rank 0 at construction, as megacpp does; buffer broadcast
     is off (the only buffers are the constant RoPE tables).
  9. Clipping: megacpp clips each rank's own gradient before reduction (the norm is the
     rank's); DDP has reduced during backward, so the twin clips the averaged gradient with
     clip_grad_norm_(foreach=True).
 10. Has-grad mask: megacpp's optimizers agree on a per-parameter has-gradient mask each step
     (on Gloo its flags travel inside the gradient exchange) and leave parameters no rank has a
     gradient for untouched; every parameter here always has a gradient, so the twin has none.
 11. AdamW step count: megacpp counts steps in which some rank had a gradient, torch every
     step; equal here. AdamW maths (decoupled decay, bias corrections) are otherwise the same.

Output. Rank 0 prints `step S loss L step_s X tokens/s Y` every --print-every steps, flushed,
then one `summary` line (medians over steps > 5), and with --json writes
  {"recipe", "params", "world", "threads", "batch", "seq",
   "steps": [{"step", "seconds", "loss", "phases"?}, ...]}
where seconds is rank 0's perf_counter wall time from the end of the previous step's optimizer
update (for the first step: the start of the loop, after a barrier) to the end of this one,
and tokens/s is world * batch * seq / seconds. With --phases each step also records, in
seconds on rank 0: batch (making the tokens), forward (zeroing grads, forward and loss),
backward (loss.backward(), DDP's overlapped all-reduce included), reduce_wait (the part of
backward after DDP launched its last bucket's all-reduce: the wait for the reductions to finish
and their copy back into .grad; measured by a comm hook that stamps the launch and otherwise
is DDP's default allreduce_hook, a Python hook instead of DDP's built-in C++ one), clip,
optimizer_adamw and optimizer_muon (each with its LR update). Phases take no extra
synchronisation: only perf_counter reads on the host (on cuda each is the time to issue its
work; the device's remainder lands in optimizer_muon, which ends with the step's synchronize).
With --device cuda the JSON also holds "device_name" and "device_memory_peak" (bytes, torch's
max_memory_allocated).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import tomllib

import torch
import torch.distributed as dist
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import gloo_exit

# The blocks' shared pieces, as bench_blocks' twin defines them from model_internal.h.
from blocks_peer import Mlp, linear, rms_norm, rope

# recipes/recipe.h's declared keys and defaults, per TOML section ("" is the top level).
# [moe], [ssm], [rnn] and [data] are accepted and ignored: they configure block kinds the twin
# refuses, or the corpus it replaces with random tokens.
DEFAULTS = {
    "": {"name": "", "pattern": "A", "mode": "author_dp"},
    "model": {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_layers": 2, "n_heads": 4,
              "mlp_mult": 4, "n_kv_heads": 0, "rope_theta": 10000.0, "ffn_hidden": 0},
    "train": {"batch_size": 16, "min_lr_ratio": 0.1, "warmup_steps": 5, "grad_clip": 1.0,
              "seed": 1234, "checkpoint_every": 20, "eval_every": 0, "eval_tokens": 65536,
              "precision": "fp32", "grad_reduce": "fp32", "recompute": "none"},
    "optim": {"embed_lr": 0.2, "head_lr": 0.004, "adam_lr": 0.004, "adam_beta1": 0.8,
              "adam_beta2": 0.95, "adam_eps": 1e-10, "adam_weight_decay": 0.0,
              "adamw_crossover": 262144, "muon_lr": 0.02, "muon_momentum": 0.95,
              "muon_beta2": 0.95, "muon_weight_decay": 0.0,
              "muon_orthogonalizer": "polar_express", "muon_ns_steps": 5, "muon_bf16": True,
              "qkv_split": True},
}
IGNORED_SECTIONS = ("moe", "ssm", "rnn", "data")
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # optim_internal.h kNewtonSchulz; torch Muon's default
WARM_STEP = 5  # the summary's medians are over steps after this one


class RecipeError(Exception):
    pass


def _typed(section, key, value, where):
    """`value` checked against the default's type (a float key takes an integer)."""
    default = DEFAULTS[section][key]
    name = f"{section}.{key}" if section else key
    if (section, key, value) == ("optim", "muon_bf16", "auto"):
        return value  # megacpp settles it per device; torch Muon is bfloat16 regardless
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        raise RecipeError(f"{where}: {name}: must be {type(default).__name__}, got {value!r}")
    return value


def load_recipe(path, overrides):
    """The recipe as {section: {key: value}} with every default filled in.

    `overrides`: "SECTION.KEY=VALUE" strings, VALUE a TOML value (a bare word is a string).
    Raises RecipeError naming the key for an unknown key, a wrong type or an unsupported model.
    """
    with open(path, "rb") as f:
        root = tomllib.load(f)
    recipe = {s: dict(d) for s, d in DEFAULTS.items()}
    for key, value in root.items():
        if key in IGNORED_SECTIONS:
            continue
        if key in DEFAULTS and key:
            if not isinstance(value, dict):
                raise RecipeError(f"{path}: {key}: must be a table")
            for k, v in value.items():
                if k not in DEFAULTS[key]:
                    raise RecipeError(f"{path}: {key}.{k}: unknown key")
                recipe[key][k] = _typed(key, k, v, path)
        elif key in DEFAULTS[""]:
            recipe[""][key] = _typed("", key, value, path)
        else:
            raise RecipeError(f"{path}: {key}: unknown key")
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        section, _, key = dotted.rpartition(".")
        if not sep or section not in DEFAULTS:
            raise RecipeError(f"--set {item}: expected SECTION.KEY=VALUE with SECTION one of "
                              f"model, train, optim (or KEY=VALUE for a top-level key)")
        if key not in DEFAULTS[section]:
            raise RecipeError(f"--set {item}: {dotted}: unknown key")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        recipe[section][key] = _typed(section, key, value, f"--set {item}")

    m, top = recipe["model"], recipe[""]
    if not top["name"]:
        raise RecipeError(f"{path}: name: is required")
    if not top["pattern"] or set(top["pattern"]) != {"A"}:
        raise RecipeError(f"{path}: pattern {top['pattern']!r}: the twin supports only "
                          f"A (attention) blocks")
    if top["mode"] != "author_dp":
        raise RecipeError(f"{path}: mode {top['mode']!r}: the twin supports only author_dp "
                          f"(no tensor parallelism)")
    for k in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_mult"):
        if m[k] < 1:
            raise RecipeError(f"{path}: model.{k}: must be >= 1")
    if m["d_model"] % m["n_heads"] or (m["d_model"] // m["n_heads"]) % 2:
        raise RecipeError(f"{path}: model.n_heads: must divide d_model into an even head "
                          f"dimension (RoPE rotates pairs)")
    kv = m["n_kv_heads"] or m["n_heads"]
    if kv > m["n_heads"] or m["n_heads"] % kv:
        raise RecipeError(f"{path}: model.n_kv_heads: must divide model.n_heads")
    if recipe["train"]["batch_size"] < 1:
        raise RecipeError(f"{path}: train.batch_size: must be >= 1")
    if recipe["train"]["precision"] not in ("fp32", "bf16-mixed"):
        raise RecipeError(f"{path}: train.precision: must be \"fp32\" or \"bf16-mixed\"")
    if recipe["train"]["grad_reduce"] != "fp32":
        raise RecipeError(f"{path}: train.grad_reduce: the twin reduces in float32 only")
    return recipe


# ----------------------------------------------------------------------------------------------
# The model (stages/trainer/model.cpp, model_internal.h).

class Attention(nn.Module):
    # split: q, k, v as separate parameters (Muon orthogonalizes each alone, as megacpp's
    # qkv_split does with the fused matrix's row slices); else one fused qkv.
    def __init__(self, d_model, n_heads, n_kv_heads, split):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.widths = (n_heads * self.head_dim, n_kv_heads * self.head_dim,
                       n_kv_heads * self.head_dim)
        self.split = split
        if split:
            self.q, self.k, self.v = (linear(d_model, w) for w in self.widths)
        else:
            self.qkv = linear(d_model, sum(self.widths))
        self.proj = linear(self.widths[0], d_model)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        if self.split:
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            q, k, v = self.qkv(x).split(self.widths, -1)
        hd = self.head_dim
        q = q.view(B, T, self.n_heads, hd).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, hd).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, hd).transpose(1, 2)
        q, k = rope(rms_norm(q), cos, sin), rope(rms_norm(k), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.widths[0]))


class Block(nn.Module):
    def __init__(self, m, split):
        super().__init__()
        self.attn = Attention(m["d_model"], m["n_heads"], m["n_kv_heads"] or m["n_heads"], split)
        self.mlp = Mlp(m["d_model"], m["ffn_hidden"] or m["mlp_mult"] * m["d_model"])

    def forward(self, x, cos, sin):
        h = x + self.attn(rms_norm(x), cos, sin)
        return h + self.mlp(rms_norm(h))


class Transformer(nn.Module):
    def __init__(self, m, seed, split):
        super().__init__()
        D = m["d_model"]
        self.vocab = m["vocab_size"]
        self.embed = nn.Embedding(self.vocab, D)
        self.blocks = nn.ModuleList(Block(m, split) for _ in range(m["n_layers"]))
        self.head = linear(D, self.vocab)
        half = D // m["n_heads"] // 2
        inv_freq = torch.pow(float(m["rope_theta"]),
                             -torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(m["seq_len"], dtype=torch.float64), inv_freq)
        self.register_buffer("rope_cos", angles.cos().float())
        self.register_buffer("rope_sin", angles.sin().float())
        self._initialise(seed)

    @torch.no_grad()
    def _initialise(self, seed):
        # TransformerImpl's draw order from one private generator; BlockImpl::initialise draws
        # the fused qkv as one [rows, D] tensor, so the split twin takes its row slices.
        gen = torch.Generator().manual_seed(seed)
        D = self.embed.embedding_dim
        self.embed.weight.normal_(0.0, 1.0, generator=gen)
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            qkv = torch.empty(sum(attn.widths), D)
            qkv.uniform_(-math.sqrt(3.0 / D), math.sqrt(3.0 / D), generator=gen)
            if attn.split:
                for lin, rows in zip((attn.q, attn.k, attn.v), qkv.split(attn.widths, 0)):
                    lin.weight.copy_(rows)
            else:
                attn.qkv.weight.copy_(qkv)
            attn.proj.weight.zero_()
            bound = math.sqrt(3.0 / mlp.fc.weight.size(1))
            mlp.fc.weight.uniform_(-bound, bound, generator=gen)
            mlp.proj.weight.zero_()
        self.head.weight.normal_(0.0, 0.001, generator=gen)

    def forward(self, tokens):
        T = tokens.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = rms_norm(self.embed(tokens))
        for block in self.blocks:
            if getattr(self, "recompute", False) and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.head(rms_norm(x))


def lr_scale(train, step, total_steps):
    """train_step.cpp lr_scale(): linear warmup to 1, then cosine down to min_lr_ratio."""
    warmup = train["warmup_steps"]
    if warmup > 0 and step <= warmup:
        return step / warmup
    progress = 1.0
    if total_steps > warmup:
        progress = (step - min(step, warmup)) / (total_steps - warmup)
    progress = min(max(progress, 0.0), 1.0)
    return train["min_lr_ratio"] + (1.0 - train["min_lr_ratio"]) * 0.5 * (
        1.0 + math.cos(math.pi * progress))


def build_optimizers(model, optim):
    """(muon, adamw, base LRs per AdamW group) with train_step.cpp's parameter assignment."""
    muon_params, groups = [], {"embed": [], "head": [], "other": []}
    for name, p in model.named_parameters():
        if name == "embed.weight":
            groups["embed"].append(p)
        elif name == "head.weight":
            groups["head"].append(p)
        elif name.startswith("blocks.") and p.dim() == 2:
            muon_params.append(p)
        else:
            groups["other"].append(p)
    peak = {"embed": optim["embed_lr"], "head": optim["head_lr"], "other": optim["adam_lr"]}
    adam_groups = [{"params": ps, "lr": peak[label]} for label, ps in groups.items() if ps]
    adamw = torch.optim.AdamW(adam_groups, betas=(optim["adam_beta1"], optim["adam_beta2"]),
                              eps=optim["adam_eps"], weight_decay=optim["adam_weight_decay"])
    muon = torch.optim.Muon(muon_params, lr=optim["muon_lr"], momentum=optim["muon_momentum"],
                            nesterov=True, weight_decay=optim["muon_weight_decay"],
                            ns_coefficients=NEWTON_SCHULZ, ns_steps=optim["muon_ns_steps"],
                            adjust_lr_fn="original")
    return muon, adamw, [g["lr"] for g in adam_groups]


def make_batch(kind, gen, B, T, V):
    """int64 [B, T + 1] tokens in [0, V) (see the module docstring's batch)."""
    if kind == "random":
        return torch.randint(0, V, (B, T + 1), generator=gen)
    start = torch.randint(0, V, (B, 1), generator=gen)
    stride = torch.randint(1, 9, (B, 1), generator=gen)
    return (start + stride * torch.arange(T + 1)).remainder_(V)


class LaunchClock:
    """A DDP comm hook: DDP's default allreduce_hook, stamping when each bucket is launched."""

    def __init__(self):
        self.last_launch = 0.0

    @staticmethod
    def hook(clock, bucket):
        clock.last_launch = time.perf_counter()
        return default_hooks.allreduce_hook(None, bucket)


def process_memory():
    """(VmRSS, VmHWM) of this process in bytes without the pages of mapped files (RssFile:
    libtorch's code, shared and reclaimable), as megacpp's collector counts them."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    file = fields.get("RssFile", 0)
    return fields.get("VmRSS", 0) - file, fields.get("VmHWM", 0) - file


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True, help="recipe .toml file")
    ap.add_argument("--steps", type=int, default=60, help="steps (the LR schedule's length)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--json", help="rank 0 writes the per-step timings here")
    ap.add_argument("--phases", action="store_true", help="time each phase of every step")
    ap.add_argument("--print-every", type=int, default=10)
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="DDP's bucket size (default: DDP's own, 25)")
    ap.add_argument("--data", choices=("random", "progressions"), default="random",
                    help="token content (the cost is the same)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a recipe key (repeatable)")
    ap.add_argument("--precision", choices=("fp32", "bf16-mixed"), default=None,
                    help="bf16-mixed: the forward and the loss under torch.autocast(bfloat16), "
                         "float32 parameters, gradients and optimizer state (DDP + autocast); "
                         "default: the recipe's train.precision")
    ap.add_argument("--recompute", choices=("none", "full"), default=None,
                    help="full: every block under torch.utils.checkpoint (use_reentrant=False); "
                         "default: the recipe's train.recompute")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: each rank on cuda:LOCAL_RANK over NCCL")
    ap.add_argument("--fsdp", action="store_true",
                    help="FSDP2 instead of DDP: fully_shard on every block and the root over the "
                         "ranks (parameters, gradients and optimizer state sharded; the optimizers "
                         "step DTensors), bf16-mixed as MixedPrecisionPolicy(bfloat16 parameters, "
                         "float32 reduction) instead of autocast")
    args = ap.parse_args()
    if args.steps < 1 or args.threads < 1 or args.print_every < 1:
        ap.error("--steps, --threads and --print-every must be >= 1")
    try:
        recipe = load_recipe(args.recipe, args.set)
    except (RecipeError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"train_twin: {e}", file=sys.stderr)
        return 2
    m, train, optim = recipe["model"], recipe["train"], recipe["optim"]
    B, T, V = train["batch_size"], m["seq_len"], m["vocab_size"]
    args.precision = args.precision or train["precision"]
    args.recompute = args.recompute or train["recompute"]
    if args.recompute not in ("none", "full"):
        print(f"train_twin: {args.recipe}: train.recompute {args.recompute!r}: the twin supports "
              f"\"none\" or \"full\" (pass --recompute)", file=sys.stderr)
        return 2
    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        print("train_twin: --device cuda: no CUDA device here", file=sys.stderr)
        return 2

    torch.set_num_threads(args.threads)
    if on_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # A step ends when its work is done on the device (a megacpp step's one read of it).
    done = torch.cuda.synchronize if on_cuda else (lambda: None)

    memory_baseline = process_memory()[0]  # before the model, as megacpp's trainer records it
    model = Transformer(m, train["seed"], split=optim["qkv_split"]).to(device)
    model.recompute = args.recompute == "full"
    n_params = sum(p.numel() for p in model.parameters())
    autocast = args.precision == "bf16-mixed"
    clock = LaunchClock()
    if args.fsdp:
        # Every rank initialised the same weights from train.seed; fully_shard keeps its shard.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (world,))
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if autocast else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        ddp = fully_shard(model, mesh=mesh, mp_policy=policy)
        autocast = False
    else:
        # Parameters are broadcast from rank 0 here; the RoPE buffers are constant, so DDP's
        # per-forward buffer broadcast (a collective megacpp does not have) is off.
        ddp = DistributedDataParallel(model, broadcast_buffers=False,
                                      bucket_cap_mb=args.bucket_cap_mb,
                                      device_ids=[device.index] if on_cuda else None)
        if args.phases:
            ddp.register_comm_hook(clock, LaunchClock.hook)
    muon, adamw, adam_peak = build_optimizers(model, optim)
    params = list(model.parameters())
    data_gen = torch.Generator()
    tokens_per_step = world * B * T

    def on_device(batch):
        return batch.pin_memory().to(device, non_blocking=True) if on_cuda else batch

    def evaluate():
        # The held-out windows of this rank's part, the same at every evaluation.
        windows = train["eval_tokens"] // T
        first, end = windows * rank // world, windows * (rank + 1) // world
        val_gen = torch.Generator()
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        ddp.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            for at in range(first, end, B):
                rows = min(B, end - at)
                val_gen.manual_seed(train["seed"] + 15485863 + at)
                x = on_device(make_batch(args.data, val_gen, rows, T, V))
                logits = ddp(x[:, :-1])
                sums[0] += F.cross_entropy(logits.reshape(-1, V).float(), x[:, 1:].reshape(-1),
                                           reduction="sum")
                sums[1] += rows * T
        ddp.train()
        dist.all_reduce(sums)
        return sums[0].item() / sums[1].item(), sums[1].item()

    records, evaluations = [], []
    dist.barrier()
    t_end = time.perf_counter()
    for step in range(1, args.steps + 1):
        t_prev = t_end
        t0 = time.perf_counter()
        data_gen.manual_seed(train["seed"] + 7919 * (rank + 1) + 104729 * step)
        tokens = on_device(make_batch(args.data, data_gen, B, T, V))
        t1 = time.perf_counter()
        muon.zero_grad(set_to_none=True)
        adamw.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = ddp(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, V).float(), tokens[:, 1:].reshape(-1))
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        if train["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, train["grad_clip"], foreach=True)
        t4 = time.perf_counter()
        scale = lr_scale(train, step, args.steps)
        for group, peak in zip(adamw.param_groups, adam_peak):
            group["lr"] = peak * scale
        adamw.step()
        t5 = time.perf_counter()
        for group in muon.param_groups:
            group["lr"] = optim["muon_lr"] * scale
        muon.step()
        done()
        t_end = time.perf_counter()
        every = train["eval_every"]
        if every > 0 and (step % every == 0 or step == args.steps):
            val_loss, val_tokens = evaluate()
            t_eval = time.perf_counter()
            evaluations.append({"step": step, "loss": val_loss, "tokens": val_tokens,
                                "seconds": t_eval - t_end})
            t_step_end, t_end = t_end, t_eval  # the next step's time starts after it
        else:
            t_step_end = t_end

        if rank != 0:
            continue
        record = {"step": step, "seconds": t_step_end - t_prev, "loss": loss.item()}
        if args.phases:
            record["phases"] = {"batch": t1 - t0, "forward": t2 - t1, "backward": t3 - t2,
                                "reduce_wait": max(t3 - clock.last_launch, 0.0),
                                "clip": t4 - t3, "optimizer_adamw": t5 - t4,
                                "optimizer_muon": t_step_end - t5}
        records.append(record)
        if step % args.print_every == 0:
            print(f"step {step} loss {record['loss']:.4f} step_s {record['seconds']:.5f} "
                  f"tokens/s {tokens_per_step / record['seconds']:.0f}", flush=True)

    # The largest over the ranks of the peak resident size above the baseline.
    rss_now, rss_peak = process_memory()
    above = torch.tensor([float(rss_peak - memory_baseline)], dtype=torch.float64, device=device)
    dist.all_reduce(above, op=dist.ReduceOp.MAX)
    if rank == 0:
        steady = [r for r in records if r["step"] > WARM_STEP] or records
        median_s = statistics.median(r["seconds"] for r in steady)
        line = (f"summary params {n_params} world {world} threads {args.threads} "
                f"median_step_s {median_s:.5f} tokens/s {tokens_per_step / median_s:.0f}")
        if args.phases:
            line += "".join(f" {k} {statistics.median(r['phases'][k] for r in steady):.5f}"
                            for k in steady[0]["phases"])
        print(line, flush=True)
        if args.json:
            out = {"recipe": recipe[""]["name"], "params": n_params, "world": world,
                   "threads": args.threads, "batch": B, "seq": T, "steps": records,
                   "precision": args.precision, "recompute": args.recompute,
                   "wrapper": "fsdp2" if args.fsdp else "ddp",
                   "memory_above_baseline": above.item(), "evaluations": evaluations,
                   "device": str(device)}
            if on_cuda:
                out["device_memory_peak"] = torch.cuda.max_memory_allocated(device)
                out["device_name"] = torch.cuda.get_device_name(device)
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f, indent=1)
            os.replace(tmp, args.json)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    gloo_exit.leave(main())
