#!/usr/bin/env python3
"""The torchrun peer of bench/failure_detection.py and bench/recovery.py: the `tiny` recipe's
training loop in plain PyTorch, one process per rank, gradients all-reduced over Gloo on CPU.

Kept equal to what `megacpp run tiny` trains so that the two runs differ only in who
supervises them:
  model   2-layer decoder, d_model 128, 4 heads (head dim 32), seq 64, vocab 256, MLP 4x
          with relu^2, RMSNorm (no weight), QK-norm, RoPE, no biases (stages/trainer/model.cpp)
  batch   16 sequences of 64+1 tokens per rank per step
  step    forward, backward, flat SUM all-reduce of every gradient / world (one Gloo
          collective per step, like TrainStep::allreduce_gradients), grad-norm clip 1.0,
          AdamW lr 3e-3 betas (0.9, 0.95) weight decay 0 with the recipe's warmup + cosine
  threads torch.set_num_threads(1) (the trainer's MEGACPP_TRAINER_THREADS default)
  data    byte-level tokens drawn from a generator seeded by (seed, rank, step) (the data
          is not what the benchmark measures; it only has to cost nothing, and be the same
          after a restart)

Checkpoints (--ckpt FILE --ckpt-every N), as a torchrun user writes them: after every N-th
step rank 0 torch.save()s {step, model, optimizer} to FILE.tmp and renames it over FILE; at
start every rank loads FILE when it exists (the state is replicated) and trains from the step
after it. With torchrun --max-restarts this is the standard way a job survives a rank failure.
--events FILE appends one JSON line per milestone of this process (wall-clock seconds): exec
(the interpreter reached this script, before importing torch), ready (process group joined,
model built and broadcast), loaded (checkpoint restored; absent without one), first_step,
step (rank 0, after each step's optimizer update), saved (a checkpoint written).
bench/recovery.py reads them.

Launched by torchrun, it reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the
environment (env:// rendezvous). It prints one line every --print-every steps, flushed, so
the benchmark can see that training is under way. --tag is ignored: it only puts a marker
into the command line so that every process of one trial can be found (and cleaned up)
by it.
"""

import time

T_EXEC = time.time()  # before the imports: a relaunch's interpreter and torch import count

import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gloo_exit

VOCAB, SEQ, D_MODEL, N_LAYERS, N_HEADS, MLP_MULT = 256, 64, 128, 2, 4, 4
BATCH, LR, MIN_LR_RATIO, WARMUP, BETAS, WEIGHT_DECAY, GRAD_CLIP, SEED = (
    16, 3e-3, 0.1, 5, (0.9, 0.95), 0.0, 1.0, 1234)


def rms_norm(x):
    return F.rms_norm(x, (x.size(-1),), eps=1e-6)


def rope(x, cos, sin):
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), -1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL, bias=False)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, N_HEADS, D // N_HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = rope(rms_norm(q), cos, sin), rope(rms_norm(k), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_MODEL, MLP_MULT * D_MODEL, bias=False)
        self.proj = nn.Linear(MLP_MULT * D_MODEL, D_MODEL, bias=False)

    def forward(self, x):
        return self.proj(torch.relu(self.fc(x)).square())


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.mlp = Mlp()

    def forward(self, x, cos, sin):
        h = x + self.attn(rms_norm(x), cos, sin)
        return h + self.mlp(rms_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        half = D_MODEL // N_HEADS // 2
        inv_freq = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(SEQ, dtype=torch.float64), inv_freq)
        self.register_buffer("rope_cos", angles.cos().float())
        self.register_buffer("rope_sin", angles.sin().float())
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name == "embed.weight":
                    p.normal_(0.0, 1.0, generator=gen)
                elif name == "head.weight":
                    p.normal_(0.0, 0.001, generator=gen)
                elif name.endswith(".proj.weight"):
                    p.zero_()
                else:
                    bound = math.sqrt(3.0 / p.size(1))
                    p.uniform_(-bound, bound, generator=gen)

    def forward(self, tokens):
        T = tokens.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = rms_norm(self.embed(tokens))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(rms_norm(x))


def lr_at(step, total):
    if WARMUP > 0 and step <= WARMUP:
        return LR * step / WARMUP
    progress = min(max((step - WARMUP) / max(total - WARMUP, 1), 0.0), 1.0)
    return LR * (MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--print-every", type=int, default=1)
    ap.add_argument("--tag", default="")
    ap.add_argument("--ckpt", help="checkpoint file: saved by rank 0, loaded at start")
    ap.add_argument("--ckpt-every", type=int, default=0, help="steps between checkpoints")
    ap.add_argument("--events", help="append this process's milestones here (JSON lines)")
    args = ap.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def event(name, t=None, **extra):
        if args.events:
            line = json.dumps(dict(event=name, rank=int(os.environ.get("RANK", "0")),
                                   restart=restart, t=time.time() if t is None else t, **extra))
            with open(args.events, "a") as f:  # one short O_APPEND write per line
                f.write(line + "\n")

    event("exec", T_EXEC)

    torch.set_num_threads(1)
    # Gloo's own default collective timeout (30 min) is what a stock torchrun job runs with;
    # it is left as is on purpose: the benchmark compares defaults.
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = Transformer()
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    with torch.no_grad():
        torch.cat([p.reshape(-1) for p in params], out=flat)
        dist.broadcast(flat, src=0)
        off = 0
        for p in params:
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    data_gen = torch.Generator()
    event("ready")

    first = 1
    if args.ckpt and os.path.exists(args.ckpt):
        t0 = time.time()
        state = torch.load(args.ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        first = state["step"] + 1
        event("loaded", step=state["step"], seconds=time.time() - t0)

    t_start = time.monotonic()
    for step in range(first, args.steps + 1):
        data_gen.manual_seed(SEED + 7919 * (rank + 1) + 104729 * step)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=data_gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps)
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # a rank without a gradient contributes zeros
            torch.cat([p.grad.reshape(-1) for p in params], out=flat)
            dist.all_reduce(flat)  # SUM, as megacpp does (Gloo has no AVG)
            flat.div_(world)
            off = 0
            for p in params:
                p.grad.view(-1).copy_(flat[off:off + p.numel()])
                off += p.numel()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP, foreach=True)
        opt.step()
        if step == first:
            event("first_step", step=step)
        if rank == 0:
            event("step", step=step)
        if rank == 0 and args.ckpt and args.ckpt_every > 0 and step % args.ckpt_every == 0:
            tmp = args.ckpt + ".tmp"
            torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, tmp)
            os.replace(tmp, args.ckpt)
            event("saved", step=step)
        if step % args.print_every == 0:
            print(f"rank {rank} step {step} loss {loss.item():.4f} "
                  f"t {time.monotonic() - t_start:.2f}", flush=True)

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    gloo_exit.leave(main())
