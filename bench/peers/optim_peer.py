#!/usr/bin/env python3
"""The PyTorch peer of bench/optimizer.cpp: what a DDP user gets for the same parameters.

One process per rank, launched by bench_optimizer, joined by Gloo over the TCPStore that the
bench hosts (--store-host/--store-port, keys under --prefix). For every shape set of --spec it
builds the same parameters as the bench and times, per step after a barrier:

  all-reduce  DDP-style flat buckets (bucket_cap_mb 25, gradient_as_bucket_view semantics:
              the gradients are views into the buckets), SUM then divide by the world size
              (Gloo has no AVG);
  AdamW       torch.optim.AdamW with its defaults for CPU tensors (the single-tensor loop;
              foreach and fused are off) over the embedding and the head;
  Muon        torch.optim.Muon over every 2-D block matrix: Nesterov momentum, 5 Newton-Schulz
              steps in bfloat16, replicated on every rank (no stacking, no sharding, no qkv
              split, no variance reduction, no cautious weight decay).

Gradients are deterministic random tensors (two sets per rank, alternating), written into the
buckets before the barrier, outside the timed region. Rank 0 prints one JSON object on stdout:
{"torch": version, "sets": {name: {"total": [ms...], "allreduce": [...], "adamw": [...],
"muon": [...], "buckets": n}}} with the per-step times of the measured steps.
"""

import argparse
import json
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import gloo_exit

BUCKET_CAP_BYTES = 25 * 1024 * 1024
ADAM_LR, ADAM_BETAS, ADAM_EPS = 0.004, (0.8, 0.95), 1e-10
MUON_LR, MUON_MOMENTUM = 0.02, 0.95


def buckets_for(params):
    """Groups params, in order, into flat float32 buckets of at most BUCKET_CAP_BYTES (a
    parameter larger than the cap gets a bucket of its own) and makes each .grad a view."""
    groups, cur, cur_bytes = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if cur and cur_bytes + nbytes > BUCKET_CAP_BYTES:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += nbytes
    if cur:
        groups.append(cur)
    buckets = []
    for group in groups:
        flat = torch.zeros(sum(p.numel() for p in group))
        off = 0
        for p in group:
            p.grad = flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        buckets.append(flat)
    return buckets


def run_set(spec, rank, world, steps, warmup):
    gen = torch.Generator().manual_seed(1000 + rank)
    adam = [(torch.randn(s, generator=gen) * 0.02).requires_grad_() for s in spec["adamw"]]
    muon = [(torch.randn(s, generator=gen) * 0.02).requires_grad_() for s in spec["muon"]]
    buckets = buckets_for(adam + muon)
    pools = [[torch.randn(b.numel(), generator=gen) for b in buckets] for _ in range(2)]
    adamw = torch.optim.AdamW(adam, lr=ADAM_LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0)
    muon_opt = torch.optim.Muon(muon, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=0.0)
    out = {"total": [], "allreduce": [], "adamw": [], "muon": [], "buckets": len(buckets)}
    for i in range(warmup + steps):
        for b, g in zip(buckets, pools[i % 2]):
            b.copy_(g)
        dist.barrier()
        t0 = time.perf_counter()
        for b in buckets:
            dist.all_reduce(b)
            b.div_(world)
        t1 = time.perf_counter()
        adamw.step()
        t2 = time.perf_counter()
        muon_opt.step()
        t3 = time.perf_counter()
        if i >= warmup:
            out["total"].append((t3 - t0) * 1e3)
            out["allreduce"].append((t1 - t0) * 1e3)
            out["adamw"].append((t2 - t1) * 1e3)
            out["muon"].append((t3 - t2) * 1e3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store-host", default="127.0.0.1")
    ap.add_argument("--store-port", type=int, required=True)
    ap.add_argument("--prefix", default="peer/")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spec", required=True,
                    help='JSON: {"sets": [{"name", "adamw": [shapes], "muon": [shapes], '
                         '"steps", "warmup"}]}')
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    spec = json.loads(args.spec)

    store = dist.TCPStore(args.store_host, args.store_port, args.world, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(args.prefix, store), rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=120))
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "sets": {}}
    for s in spec["sets"]:
        result["sets"][s["name"]] = run_set(s, args.rank, args.world, s["steps"], s["warmup"])
    dist.barrier()
    dist.destroy_process_group()
    if args.rank == 0:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
    gloo_exit.leave(0)
