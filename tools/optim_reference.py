#!/usr/bin/env python3
"""Independent single-process float64 reference for megacpp's distributed optimizer
(README.md "Distributed optimizer").

It replays a recorded schedule of per-rank gradients through AdamW and Muon exactly as
nanochat defines them (karpathy/nanochat, nanochat/adamw.py::adamw_step_fused and
nanochat/muon.py::muon_step_fused at commit 22a71aa, the last revision before they were merged
into nanochat/optim.py), but in float64 throughout -- the orthogonalisation included, where
nanochat uses bfloat16. The stress harness compares the C++ DistAdamW/DistMuon against it
(2e-5 Adam / 3e-4 Muon).

Usage:
  optim_reference.py --spec SPEC.json --grads GRADS.safetensors --out OUT.safetensors
                     [--sample-every N]

SPEC.json:
  {
    "world_size": 2,
    "steps": 1000,
    "hyperparameters": {
      "adamw": {"lr": 0.004, "betas": [0.8, 0.95], "eps": 1e-10, "weight_decay": 0.0},
      "muon":  {"lr": 0.02, "momentum": 0.95, "beta2": 0.95, "weight_decay": 0.0,
                "ns_method": "polar_express", "ns_steps": 5}
    },
    "params": [
      {"name": "wte", "shape": [64, 32], "optimizer": "adamw",
       "init": {"seed": 1, "std": 0.02}},
      {"name": "h0.qkv", "shape": [96, 32], "optimizer": "muon", "qkv_split_sizes": [32, 32, 32],
       "init": {"file": "init.safetensors", "key": "h0.qkv"}}
    ]
  }
  Optional per parameter (AdamW only, nanochat's p.lr_mul / p.wd_mul): "lr_mul", "wd_mul".
  "beta2" (muon) may be null: nanochat then fills 0.0. "ns_method" defaults to polar_express,
  "ns_steps" to 5. "init.file" is relative to the spec's folder; the tensor is cast to float64.
  "init.seed": torch.Generator().manual_seed(seed); torch.randn(shape, dtype=float64,
  generator=gen) * std (std defaults to 1.0).

A non-finite value is an error, never a result: a NaN/Inf gradient or initial value is refused
(ValueError naming the key and element), and so is a parameter or state tensor that becomes
non-finite during the replay (naming it, the element and the step).

GRADS.safetensors: "step{s}.rank{r}.{param}" for s in [0, steps), r in [0, world_size), any
  float dtype (upcast to float64), shape == param shape. A missing key means rank r had
  p.grad is None on step s. Any other key is an error.

OUT.safetensors (all float64 except ".step"):
  "initial.{param}"                 the initial values
  "{param}"                         final values
  "{param}.exp_avg", "{param}.exp_avg_sq"   AdamW state, param shape
  "{param}.step"                    AdamW per-parameter step count, int64, shape [1]
  "{param}.momentum_buffer"         Muon, param shape
  "{param}.second_momentum_buffer"  Muon, [rows, 1] if rows >= cols or the parameter has
                                    qkv_split_sizes, else [1, cols]
  with --sample-every N, after every N-th completed step k (k = N, 2N, ...): the same keys
  prefixed "sample{k}." (e.g. "sample100.h0.qkv.momentum_buffer"). State that was never
  created (a parameter that never had a gradient) is written as zeros (step 0), which is what a
  lazily-created buffer would hold.
"""

import argparse
import json
import os
import re
import sys

import torch
from safetensors.torch import load_file, save_file

DTYPE = torch.float64

# nanochat/muon.py: Polar Express coefficients for num_iters=5, safety_factor=2e-2, cushion=2
# (https://arxiv.org/pdf/2505.16932); identical to stages/trainer/optim.h.
POLAR_EXPRESS_COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
# Classic quintic Newton-Schulz (modded-nanogpt zeropower_via_newtonschulz5).
NEWTON_SCHULZ_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g, ns_method="polar_express", ns_steps=5):
    """Approximate U V^T of a 2-D matrix g (float64).

    polar_express: nanochat's loop; X / (||X||_F * 1.02 + 1e-6), coefficients[:ns_steps].
    newton_schulz: modded-nanogpt's loop; X / (||X||_F + 1e-7), the same triple ns_steps times.
    Both work on the wide orientation (transpose when rows > cols) and transpose back.
    """
    X = g
    tall = g.size(-2) > g.size(-1)
    if tall:
        X = X.mT
    if ns_method == "polar_express":
        X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
        coeffs = POLAR_EXPRESS_COEFFS[:ns_steps]
    elif ns_method == "newton_schulz":
        X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        coeffs = [NEWTON_SCHULZ_COEFFS] * ns_steps
    else:
        raise ValueError(f"unknown ns_method {ns_method!r}")
    for a, b, c in coeffs:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X


def orthogonalize_split(g, split_sizes, ns_method, ns_steps):
    """Orthogonalise each row-slice of a fused matrix alone (qkv_split_sizes), then re-concatenate."""
    if not split_sizes:
        return orthogonalize(g, ns_method, ns_steps)
    return torch.cat([orthogonalize(s, ns_method, ns_steps)
                      for s in torch.split(g, list(split_sizes), dim=0)], dim=0)


def muon_red_dim(shape, split_sizes=None):
    """The dimension the factored second moment averages over: per row (-1) when rows >= cols
    or the matrix is split into row slices (each row lies in one slice, so no statistic mixes
    slices), else per column (-2)."""
    return -1 if split_sizes or shape[-2] >= shape[-1] else -2


def muon_second_moment_shape(shape, split_sizes=None):
    return (shape[-2], 1) if muon_red_dim(shape, split_sizes) == -1 else (1, shape[-1])


def variance_reduce(g, second_momentum_buffer, beta2, red_dim):
    """NorMuon-style factored second moment of one matrix (or slice), Frobenius norm preserved.
    Updates second_momentum_buffer in place; returns the rescaled update."""
    v_mean = g.square().mean(dim=red_dim, keepdim=True)
    red_dim_size = g.size(red_dim)
    v_norm_sq = v_mean.sum(dim=(-2, -1), keepdim=True) * red_dim_size
    v_norm = v_norm_sq.sqrt()
    second_momentum_buffer.lerp_(v_mean, 1 - beta2)
    step_size = second_momentum_buffer.clamp_min(1e-10).rsqrt()
    scaled_sq_sum = (v_mean * red_dim_size) * step_size.square()
    v_norm_new = scaled_sq_sum.sum(dim=(-2, -1), keepdim=True).sqrt()
    final_scale = step_size * (v_norm / v_norm_new.clamp_min(1e-10))
    return g * final_scale


def muon_step(grad, param, momentum_buffer, second_momentum_buffer, *, lr, momentum, beta2,
              weight_decay, ns_method, ns_steps, qkv_split_sizes=None, variance_reduction=True):
    """nanochat muon_step_fused for one parameter, float64, in place on param and both buffers.

    lr is the group lr; the shape scaling lr * max(1, rows/cols)**0.5 is applied here (nanochat
    Muon.step). beta2 None -> 0.0 (nanochat). With qkv_split_sizes, every row slice is a matrix
    of its own after the (elementwise) momentum: it is orthogonalised alone, its variance
    reduction preserves its own Frobenius norm, and its lr scale is that of its own shape, so
    the fused parameter moves exactly as its slices would as separate parameters (the second
    moment is per row, which is what a separate slice with rows >= cols keeps).
    variance_reduction=False skips the second moment (for comparisons with plain Muon).
    """
    beta2 = 0.0 if beta2 is None else beta2
    split = list(qkv_split_sizes) if qkv_split_sizes else [param.shape[-2]]
    red_dim = muon_red_dim(param.shape, qkv_split_sizes)

    # Nesterov momentum: buf = lerp(buf, g, 1 - mu); g = lerp(g, buf, mu).
    momentum_buffer.lerp_(grad, 1 - momentum)
    g = grad.lerp(momentum_buffer, momentum)

    sm_slices = (torch.split(second_momentum_buffer, split, dim=0) if red_dim == -1
                 else [second_momentum_buffer])
    for g_s, p_s, sm_s in zip(torch.split(g, split, dim=0), torch.split(param, split, dim=0),
                              sm_slices):
        lr_s = lr * max(1.0, g_s.size(-2) / g_s.size(-1)) ** 0.5
        # Orthogonalisation (float64; nanochat runs this in bfloat16).
        u = orthogonalize(g_s, ns_method, ns_steps)
        if variance_reduction:
            u = variance_reduce(u, sm_s, beta2, red_dim)
        # Cautious weight decay: decay only where the update agrees in sign with the parameter
        # ((u * p) >= 0, evaluated on the pre-update parameter); the update itself is never
        # gated (see DESIGN.md "Decisions": the cautious gate).
        mask = (u * p_s) >= 0
        p_s.sub_(lr_s * u + lr_s * weight_decay * p_s * mask)


def adamw_step(grad, param, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    """nanochat adamw_step_fused, float64, in place. step is the 1-based count after increment."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2)
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    denom = (exp_avg_sq / bias2).sqrt() + eps
    step_size = lr / bias1
    param.add_(exp_avg / denom, alpha=-step_size)


def average_gradients(rank_grads, world_size, shape):
    """The gradient the distributed optimizer applies, given {rank: grad} for present ranks.

    Every rank enters the same collective; a rank whose p.grad is None contributes a zero tensor
    (the has-grad mask, README.md "Distributed optimizer"). The collective is a SUM (Gloo has no
    AVG) divided by world_size -- NOT by the number of ranks that had a gradient. So {0: g, 1: None} at W=2
    applies g / 2. Summation is in ascending rank order.
    Returns None when no rank had a gradient (the all-reduce MAX of the mask is 0).
    """
    if not rank_grads:
        return None
    total = torch.zeros(shape, dtype=DTYPE)
    for r in sorted(rank_grads):
        total += rank_grads[r]
    return total / world_size


class Reference:
    """Parameters + optimizer state, stepped one schedule step at a time.

    A parameter with no gradient on any rank in a step is skipped entirely: no weight decay,
    no state change, and (AdamW) no step-count increment. This is nanochat's rule for AdamW
    (MuonAdamW._step_adamw: `if p.grad is None: continue`, as torch.optim does); nanochat's Muon
    cannot express a missing gradient (it stacks p.grad and DistMuon asserts all are present), so
    the same skip rule is used for Muon, per parameter: its momentum does not decay and its
    second moment does not move. A gradient present on at least one rank is a real (averaged)
    gradient, even if it is numerically zero, and gets the full update.
    State is created lazily (zeros) on a parameter's first update, as in nanochat.
    """

    def __init__(self, spec, spec_dir="."):
        self.world_size = int(spec["world_size"])
        if self.world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.steps = int(spec["steps"])
        hp = spec.get("hyperparameters", {})
        self.adamw_hp = dict(hp.get("adamw", {}))
        self.muon_hp = dict(hp.get("muon", {}))
        self.params = []  # ordered list of per-parameter dicts
        names = set()
        for p in spec["params"]:
            name = p["name"]
            if name in names:
                raise ValueError(f"duplicate parameter {name!r}")
            names.add(name)
            shape = tuple(int(d) for d in p["shape"])
            opt = p["optimizer"]
            if opt not in ("adamw", "muon"):
                raise ValueError(f"{name}: optimizer must be adamw or muon, got {opt!r}")
            split = p.get("qkv_split_sizes")
            if opt == "muon":
                if len(shape) != 2:
                    raise ValueError(f"{name}: Muon expects 2-D parameters only, got {shape}")
                if split is not None:
                    split = [int(s) for s in split]
                    if sum(split) != shape[0] or any(s <= 0 for s in split):
                        raise ValueError(f"{name}: qkv_split_sizes {split} must sum to rows "
                                         f"{shape[0]}")
            elif split is not None:
                raise ValueError(f"{name}: qkv_split_sizes only applies to muon parameters")
            value = self._init_value(name, shape, p.get("init", {}), spec_dir)
            entry = dict(name=name, shape=shape, optimizer=opt, split=split, value=value,
                         initial=value.clone(), lr_mul=float(p.get("lr_mul", 1.0)),
                         wd_mul=float(p.get("wd_mul", 1.0)), state={})
            self.params.append(entry)
        if self.muon_hp.get("ns_method", "polar_express") not in ("polar_express",
                                                                  "newton_schulz"):
            raise ValueError(f"unknown ns_method {self.muon_hp.get('ns_method')!r}")

    @staticmethod
    def _init_value(name, shape, init, spec_dir):
        if "file" in init:
            path = init["file"]
            if not os.path.isabs(path):
                path = os.path.join(spec_dir, path)
            t = load_file(path)[init.get("key", name)].to(DTYPE)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: init tensor shape {tuple(t.shape)} != {shape}")
            check_finite(f"{name}: init tensor", t)
            return t.clone()
        gen = torch.Generator().manual_seed(int(init.get("seed", 0)))
        return torch.randn(shape, dtype=DTYPE, generator=gen) * float(init.get("std", 1.0))

    def step(self, grads_by_param):
        """One optimizer step. grads_by_param: {name: {rank: float64 tensor}} (present only)."""
        for p in self.params:
            g = average_gradients(grads_by_param.get(p["name"], {}), self.world_size, p["shape"])
            if g is None:
                continue
            st = p["state"]
            if p["optimizer"] == "adamw":
                hp = self.adamw_hp
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros(p["shape"], dtype=DTYPE)
                    st["exp_avg_sq"] = torch.zeros(p["shape"], dtype=DTYPE)
                st["step"] += 1
                beta1, beta2 = hp.get("betas", (0.9, 0.999))
                adamw_step(g, p["value"], st["exp_avg"], st["exp_avg_sq"], st["step"],
                           lr=hp.get("lr", 1e-3) * p["lr_mul"], beta1=beta1, beta2=beta2,
                           eps=hp.get("eps", 1e-8),
                           weight_decay=hp.get("weight_decay", 0.01) * p["wd_mul"])
            else:
                hp = self.muon_hp
                if not st:
                    st["momentum_buffer"] = torch.zeros(p["shape"], dtype=DTYPE)
                    st["second_momentum_buffer"] = torch.zeros(
                        muon_second_moment_shape(p["shape"], p["split"]), dtype=DTYPE)
                muon_step(g, p["value"], st["momentum_buffer"], st["second_momentum_buffer"],
                          lr=hp.get("lr", 0.02), momentum=hp.get("momentum", 0.95),
                          beta2=hp.get("beta2", 0.95),
                          weight_decay=hp.get("weight_decay", 0.0),
                          ns_method=hp.get("ns_method", "polar_express"),
                          ns_steps=int(hp.get("ns_steps", 5)), qkv_split_sizes=p["split"])

    def snapshot(self, prefix=""):
        out = {}
        for p in self.params:
            n, st = p["name"], p["state"]
            out[prefix + n] = p["value"].clone()
            zeros = torch.zeros(p["shape"], dtype=DTYPE)
            if p["optimizer"] == "adamw":
                out[f"{prefix}{n}.exp_avg"] = st.get("exp_avg", zeros).clone()
                out[f"{prefix}{n}.exp_avg_sq"] = st.get("exp_avg_sq", zeros).clone()
                out[f"{prefix}{n}.step"] = torch.tensor([st.get("step", 0)], dtype=torch.int64)
            else:
                out[f"{prefix}{n}.momentum_buffer"] = st.get("momentum_buffer", zeros).clone()
                out[f"{prefix}{n}.second_momentum_buffer"] = st.get(
                    "second_momentum_buffer",
                    torch.zeros(muon_second_moment_shape(p["shape"], p["split"]),
                                dtype=DTYPE)).clone()
        return out


_GRAD_KEY = re.compile(r"^step(\d+)\.rank(\d+)\.(.+)$")


def first_nonfinite(t):
    """None when every element of t is finite, else 'index (value)' of the first one that is not."""
    bad = (~torch.isfinite(t)).nonzero()
    if bad.numel() == 0:
        return None
    idx = tuple(int(i) for i in bad[0])
    return f"{list(idx)} ({t[idx].item()})"


def check_finite(what, t):
    where = first_nonfinite(t)
    if where is not None:
        raise ValueError(f"{what}: non-finite element {where}")


def index_gradients(grads, ref):
    """{step: {param: {rank: float64 tensor}}} from the flat GRADS dict; rejects stray keys."""
    shapes = {p["name"]: p["shape"] for p in ref.params}
    by_step = {}
    for key, t in grads.items():
        m = _GRAD_KEY.match(key)
        if not m:
            raise ValueError(f"gradient key {key!r} is not step{{s}}.rank{{r}}.{{param}}")
        s, r, name = int(m.group(1)), int(m.group(2)), m.group(3)
        if name not in shapes:
            raise ValueError(f"gradient key {key!r}: unknown parameter")
        if not 0 <= s < ref.steps or not 0 <= r < ref.world_size:
            raise ValueError(f"gradient key {key!r}: step/rank out of range")
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"gradient key {key!r}: shape {tuple(t.shape)} != {shapes[name]}")
        check_finite(f"gradient {key!r}", t)
        by_step.setdefault(s, {}).setdefault(name, {})[r] = t.to(DTYPE)
    return by_step


def run(spec, grads, spec_dir=".", sample_every=0):
    """Replay the whole schedule; returns the OUT dict (see module docstring)."""
    ref = Reference(spec, spec_dir)
    by_step = index_gradients(grads, ref)
    out = {f"initial.{p['name']}": p["initial"] for p in ref.params}
    for s in range(ref.steps):
        ref.step(by_step.get(s, {}))
        for k, v in ref.snapshot().items():
            check_finite(f"step {s}: {k}", v)
        if sample_every and (s + 1) % sample_every == 0:
            out.update(ref.snapshot(prefix=f"sample{s + 1}."))
    out.update(ref.snapshot())
    return {k: v.contiguous() for k, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--grads", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sample-every", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # keeps reductions in a fixed order: byte-identical reruns
    with open(args.spec) as f:
        spec = json.load(f)
    grads = load_file(args.grads)
    out = run(spec, grads, os.path.dirname(os.path.abspath(args.spec)), args.sample_every)
    tmp = args.out + ".tmp"
    save_file(out, tmp)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
