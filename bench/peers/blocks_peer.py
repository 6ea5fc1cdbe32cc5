"""The Python twin of megacpp's hybrid blocks (A, E, M, R), for bench_blocks.

Each block is built as the C++ one is, with the same parameter names, shapes, initialisation and
math: stages/trainer/model.cpp and model.h (AttentionImpl, BlockImpl: A = attention + relu^2
MLP, and the pre-norm residual wrapper of E, M and R), moe.h/moe.cpp (MoeImpl, dropless, E),
mamba.h/mamba.cpp and ssd.h/ssd.cpp (the Mamba-2 mixer around the chunked SSD scan, M) and
recurrent.h/recurrent.cpp (the gated linear recurrence through the scan's diagonal form,
ssd_diagonal, R). It times
forward + backward of one block in float32 on CPU with the shapes and thread count bench_blocks
passes, and prints one JSON line:
{"torch": version, "threads": n, "block": "A", "params": elements, "seconds": [...]}.

`--check` (no other arguments) verifies, in float64 on tiny shapes, the chunked scan (a ragged
tail included) against the sequential recurrence, the M and R blocks against their step-by-step
forms, and the dropless MoE against its dense reference; it prints "ok" or raises.
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from ssd_peer import segment_sums, ssd_sequential

RMS_EPS = 1e-6
ROPE_THETA = 10000.0  # ModelConfig's default rope_theta
RNN_C = 8.0  # recurrent.cpp kC


def rms_norm(x):
    return F.rms_norm(x, (x.size(-1),), eps=RMS_EPS)


# ---------------------------------------------------------------------------------------------
# The SSD scan (ssd.cpp). Unlike ssd_peer.ssd_chunked, a length that is not a multiple of
# `chunk` is padded with steps that neither decay (a = 0) nor add (x = 0), so the final state is
# the state after step L; the padded outputs are cut off.


def ssd_chunked(x, a, b, c, chunk, initial_state=None):
    bsz, length, heads, p = x.shape
    n = b.size(3)
    pad = (chunk - length % chunk) % chunk

    def padded(t):
        if pad == 0:
            return t
        return torch.cat([t, t.new_zeros(t.size(0), pad, *t.shape[2:])], 1)

    nc = (length + pad) // chunk
    x = padded(x).reshape(bsz, nc, chunk, heads, p)
    b = padded(b).reshape(bsz, nc, chunk, heads, n)
    c = padded(c).reshape(bsz, nc, chunk, heads, n)
    a = padded(a).reshape(bsz, nc, chunk, heads).permute(0, 3, 1, 2)  # b h c l
    a_cumsum = a.cumsum(-1)

    # 1. Within each chunk.
    decay = segment_sums(a).exp()  # b h c l s
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, decay, x)
    # 2. Each chunk's own final state, as if it began from zero.
    decay_to_end = (a_cumsum.narrow(-1, chunk - 1, 1) - a_cumsum).exp()
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay_to_end, x)
    # 3. Across chunks: the state entering each chunk, and the final state.
    start = (initial_state.unsqueeze(1) if initial_state is not None
             else x.new_zeros(bsz, 1, heads, p, n))
    states = torch.cat([start, states], 1)  # b (c+1) h p n
    chunk_totals = F.pad(a_cumsum.select(-1, chunk - 1), (1, 0))  # b h (c+1)
    chunk_decay = segment_sums(chunk_totals).exp()  # b h (c+1) (c+1)
    entering = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    # 4. What the entering state contributes to each step of its chunk.
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, entering.narrow(1, 0, nc), a_cumsum.exp())
    y = (y_diag + y_off).reshape(bsz, nc * chunk, heads, p)
    if pad != 0:
        y = y.narrow(1, 0, length)
    return y, entering.select(1, nc)


# ---------------------------------------------------------------------------------------------
# Blocks. Parameter names and shapes as the C++ modules register them. initialise() draws from
# `gen` in the C++ order with the C++ bounds; with the same seed and the same torch build (the
# trainer links the venv's), the values should equal the C++ ones (not checked here).


def ssd_diagonal(x, a, chunk):
    """ssd.cpp ssd_diagonal: h_t = exp(a_t) h_{t-1} + x_t per channel; x, a [B, L, W]."""
    bsz, length, width = x.shape
    pad = (chunk - length % chunk) % chunk
    nc = (length + pad) // chunk

    def chunked(t):
        return F.pad(t.transpose(1, 2), (0, pad)).reshape(bsz, width, nc, chunk)

    x, a = chunked(x), chunked(a)
    a_cumsum = a.cumsum(-1)
    y_diag = torch.matmul(segment_sums(a).exp(), x.unsqueeze(-1)).squeeze(-1)
    states = ((a_cumsum[..., -1:] - a_cumsum).exp() * x).sum(-1)
    chunk_totals = F.pad(a_cumsum[..., -1], (1, 0))
    entering = torch.matmul(segment_sums(chunk_totals).exp(),
                            F.pad(states, (1, 0)).unsqueeze(-1)).squeeze(-1)
    y = y_diag + a_cumsum.exp() * entering[..., :nc].unsqueeze(-1)
    return y.reshape(bsz, width, nc * chunk)[:, :, :length].transpose(1, 2)


def diagonal_chunk(length, cap):
    """recipes/recipe.cpp recurrence_scan_chunk: a power of two near (2T)^(1/3), in [4, cap]."""
    balanced = (2.0 * length) ** (1.0 / 3.0)
    chunk = 4
    while chunk * 2 <= balanced * 1.5 and chunk * 2 <= cap:
        chunk *= 2
    return max(1, min(chunk, cap))


def linear(fan_in, fan_out, bias=False):
    return nn.Linear(fan_in, fan_out, bias=bias)


def rope_tables(length, head_dim, dtype):
    """cos, sin [length, head_dim / 2], as TransformerImpl builds them (float64, then cast)."""
    half = head_dim // 2
    inv_freq = torch.pow(ROPE_THETA, -torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope(x, cos, sin):
    """Rotates pairs (x[..., i], x[..., i + half]) by the position's angle. x: [B, H, T, hd]."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], -1)


class Mlp(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.fc = linear(d_model, hidden)
        self.proj = linear(hidden, d_model)

    def forward(self, x):
        return self.proj(torch.relu(self.fc(x)).square())


class Attention(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.qkv = linear(d_model, (n_heads + 2 * n_kv_heads) * self.head_dim)
        self.proj = linear(n_heads * self.head_dim, d_model)

    def forward(self, x, cos, sin):
        bsz, t = x.shape[:2]
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if kv == h:
            q, k, v = self.qkv(x).view(bsz, t, 3, h, hd).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = self.qkv(x).split([h * hd, kv * hd, kv * hd], -1)
            q = q.view(bsz, t, h, hd).transpose(1, 2)
            k = k.view(bsz, t, kv, hd).transpose(1, 2)
            v = v.view(bsz, t, kv, hd).transpose(1, 2)
        q = rope(rms_norm(q), cos, sin)
        k = rope(rms_norm(k), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
        return self.proj(y.transpose(1, 2).reshape(bsz, t, h * hd))


class Moe(nn.Module):
    def __init__(self, d_model, n_experts, top_k, expert_hidden, shared_hidden):
        super().__init__()
        if not (n_experts >= 1 and 1 <= top_k <= n_experts and expert_hidden >= 1):
            raise ValueError("moe: needs n_experts >= 1, top_k in [1, n_experts] and "
                             f"expert_hidden >= 1 (got {n_experts}, {top_k}, {expert_hidden})")
        self.n_experts, self.top_k = n_experts, top_k
        self.router = linear(d_model, n_experts)
        self.experts = nn.ModuleList(Mlp(d_model, expert_hidden) for _ in range(n_experts))
        self.shared = Mlp(d_model, shared_hidden) if shared_hidden > 0 else None
        self.aux_loss = None  # unweighted, as MoeImpl::aux_loss()
        self.tokens_per_expert = None

    def route(self, flat):
        probs = torch.softmax(self.router(flat), -1)
        top_w, top_e = probs.topk(self.top_k, -1)
        return probs, top_w / top_w.sum(-1, keepdim=True), top_e

    def forward(self, x):
        d, e_count, k = x.size(-1), self.n_experts, self.top_k
        flat = x.reshape(-1, d)
        n = flat.size(0)
        probs, weights, experts = self.route(flat)
        # Assignments sorted by expert (stable: token order within an expert), so each expert's
        # tokens are one contiguous run of counts[e] rows.
        assigned = experts.reshape(-1)  # [N * k]
        counts = torch.bincount(assigned, minlength=e_count)
        order = torch.sort(assigned, stable=True, dim=0).indices
        token_of = torch.div(order, k, rounding_mode="floor")
        weight_of = weights.reshape(-1).index_select(0, order)
        routed_in = flat.index_select(0, token_of)
        outs, offset = [], 0
        for e, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            outs.append(self.experts[e](routed_in.narrow(0, offset, count)))
            offset += count
        routed = torch.cat(outs, 0) * weight_of.unsqueeze(1)
        y = torch.zeros_like(flat).index_add(0, token_of, routed)
        if self.shared is not None:
            y = y + self.shared(flat)
        share = counts.to(probs.dtype) / float(n * k)
        self.aux_loss = float(e_count) * (share * probs.mean(0)).sum()
        self.tokens_per_expert = counts
        return y.view(x.shape)

    def reference(self, x):
        """moe_reference: every expert on every token, weighted by a zero-filled top-k matrix."""
        flat = x.reshape(-1, x.size(-1))
        _, weights, experts = self.route(flat)
        dense_w = flat.new_zeros(flat.size(0), self.n_experts).scatter(1, experts, weights)
        y = torch.zeros_like(flat)
        for e in range(self.n_experts):
            y = y + self.experts[e](flat) * dense_w[:, e].unsqueeze(1)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view(x.shape)


class Mamba(nn.Module):
    def __init__(self, d_model, d_state, head_dim, expand, conv_kernel, chunk):
        super().__init__()
        d_inner = expand * d_model
        if d_inner % head_dim != 0:
            raise ValueError(f"mamba: expand x dModel = {d_inner} must be a multiple of "
                             f"headDim {head_dim}")
        self.d_model, self.d_state, self.head_dim = d_model, d_state, head_dim
        self.d_inner, self.n_heads = d_inner, d_inner // head_dim
        self.conv_kernel, self.chunk = conv_kernel, chunk
        h, conv_dim = self.n_heads, d_inner + 2 * d_state
        self.in_proj = linear(d_model, 2 * d_inner + 2 * d_state + h)
        self.conv = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim,
                              padding=conv_kernel - 1, bias=True)
        self.out_proj = linear(d_inner, d_model)
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.D = nn.Parameter(torch.ones(h))
        self.norm_weight = nn.Parameter(torch.ones(d_inner))

    @torch.no_grad()
    def initialise(self, gen, zero_out):
        def uniform(p, bound):
            p.uniform_(-bound, bound, generator=gen)

        uniform(self.in_proj.weight, math.sqrt(1.0 / self.d_model))
        uniform(self.conv.weight, math.sqrt(1.0 / self.conv_kernel))
        uniform(self.conv.bias, math.sqrt(1.0 / self.conv_kernel))
        if zero_out:
            self.out_proj.weight.zero_()
        else:
            uniform(self.out_proj.weight, math.sqrt(1.0 / self.d_inner))
        # dt = exp(U(log 1e-3, log 1e-1)); dt_bias is softplus's inverse of it.
        dt = (torch.empty_like(self.dt_bias).uniform_(0, 1, generator=gen)
              * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16, generator=gen).log())
        self.D.fill_(1.0)
        self.norm_weight.fill_(1.0)

    def forward(self, x, sequential=False):
        bsz, t = x.shape[:2]
        h, p, n, i = self.n_heads, self.head_dim, self.d_state, self.d_inner
        z, xbc, dt = self.in_proj(x).split([i, i + 2 * n, h], -1)
        # Causal: padded K-1 on both sides, the first T outputs see only positions <= t.
        xbc = F.silu(self.conv(xbc.transpose(1, 2)).narrow(2, 0, t).transpose(1, 2))
        u, b, c = xbc.split([i, n, n], -1)
        u = u.reshape(bsz, t, h, p)
        dt = F.softplus(dt + self.dt_bias)  # [B, T, H]
        a_coef = -self.A_log.exp()  # [H]
        b = b.unsqueeze(2).expand(bsz, t, h, n)
        c = c.unsqueeze(2).expand(bsz, t, h, n)
        xs = u * dt.unsqueeze(-1)
        a = dt * a_coef
        if sequential:
            y, _ = ssd_sequential(xs, a, b, c)
        else:
            y, _ = ssd_chunked(xs, a, b, c, self.chunk)
        y = (y + u * self.D.view(1, 1, h, 1)).reshape(bsz, t, i)
        y = F.rms_norm(y * F.silu(z), (i,), self.norm_weight, RMS_EPS)
        return self.out_proj(y)


class Recurrent(nn.Module):
    def __init__(self, d_model, width, conv_kernel, chunk):
        super().__init__()
        self.d_model, self.width, self.conv_kernel, self.chunk = d_model, width, conv_kernel, chunk
        self.gate_proj = linear(d_model, width)
        self.in_proj = linear(d_model, width)
        self.conv = nn.Conv1d(width, width, conv_kernel, groups=width, padding=conv_kernel - 1,
                              bias=True)
        self.rec_gate = linear(width, width, bias=True)
        self.in_gate = linear(width, width, bias=True)
        # "lambda" is a Python keyword: registered by name so the parameter is rnn.lambda.
        self.register_parameter("lambda", nn.Parameter(torch.zeros(width)))
        self.out_proj = linear(width, d_model)

    @property
    def lam(self):
        return getattr(self, "lambda")

    @torch.no_grad()
    def initialise(self, gen, zero_out):
        def uniform(p, fan_in):
            bound = math.sqrt(1.0 / fan_in)
            p.uniform_(-bound, bound, generator=gen)

        uniform(self.gate_proj.weight, self.d_model)
        uniform(self.in_proj.weight, self.d_model)
        uniform(self.conv.weight, self.conv_kernel)
        uniform(self.conv.bias, self.conv_kernel)
        uniform(self.rec_gate.weight, self.width)
        uniform(self.in_gate.weight, self.width)
        self.rec_gate.bias.zero_()
        self.in_gate.bias.zero_()
        if zero_out:
            self.out_proj.weight.zero_()
        else:
            uniform(self.out_proj.weight, self.width)
        # a^c = sigmoid(lambda)^c uniform in [0.9, 0.999]: sigmoid(lambda) = a^(1/c).
        a = torch.empty_like(self.lam).uniform_(0.9, 0.999, generator=gen).pow(1.0 / RNN_C)
        self.lam.copy_(torch.log(a) - torch.log1p(-a))

    def forward(self, x, sequential=False):
        bsz, t, w = x.size(0), x.size(1), self.width
        gate = F.gelu(self.gate_proj(x), approximate="tanh")
        u = self.conv(self.in_proj(x).transpose(1, 2)).narrow(2, 0, t).transpose(1, 2)
        r = torch.sigmoid(self.rec_gate(u))
        i = torch.sigmoid(self.in_gate(u))
        log_a = -RNN_C * r * F.softplus(-self.lam)  # < 0
        # sqrt(1 - a^2) from expm1 (exact near a = 1), bounded below so its gradient stays
        # finite where a rounds to 1.
        scale = torch.sqrt(torch.clamp_min(-torch.expm1(2 * log_a), 1e-12))
        v = scale * i * u  # [B, T, W]
        if sequential:
            state, hs = x.new_zeros(bsz, w), []
            for step in range(t):
                state = log_a[:, step].exp() * state + v[:, step]
                hs.append(state)
            h = torch.stack(hs, 1)
        else:
            h = ssd_diagonal(v, log_a, diagonal_chunk(v.size(1), self.chunk))
        return self.out_proj(gate * h)


class Block(nn.Module):
    """BlockImpl for kinds A, E, M and R; forward(x, cos, sin) with x [B, T, D]."""

    def __init__(self, kind, a):
        super().__init__()
        self.kind = kind
        if kind == "A":
            if a.d_model % a.heads or (a.d_model // a.heads) % 2 or a.heads % a.kv_heads:
                raise ValueError("A: d_model % heads == 0, an even head dim and kv_heads | heads")
            self.attn = Attention(a.d_model, a.heads, a.kv_heads)
            self.mlp = Mlp(a.d_model, a.ffn)
        elif kind == "E":
            self.moe = Moe(a.d_model, a.experts, a.top_k, a.expert_hidden, a.shared_hidden)
        elif kind == "M":
            self.mamba = Mamba(a.d_model, a.ssm_state, a.ssm_head_dim, a.ssm_expand,
                               a.conv_kernel, a.chunk)
        elif kind == "R":
            self.rnn = Recurrent(a.d_model, a.rnn_width, a.conv_kernel, a.chunk)
        else:
            raise ValueError(f"unknown block kind {kind!r}")

    @torch.no_grad()
    def initialise(self, gen):
        """BlockImpl::initialise: residual outputs zero, the block starts as the identity."""
        if self.kind == "M":
            return self.mamba.initialise(gen, zero_out=True)
        if self.kind == "R":
            return self.rnn.initialise(gen, zero_out=True)
        # Input projections (qkv, fc, the router) U(+-sqrt(3 / fan_in)), in registration order.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                p.zero_()
            else:
                bound = math.sqrt(3.0 / p.size(1))
                p.uniform_(-bound, bound, generator=gen)

    def forward(self, x, cos=None, sin=None):
        if self.kind == "A":
            h = x + self.attn(rms_norm(x), cos, sin)
            return h + self.mlp(rms_norm(h))
        if self.kind == "E":
            return x + self.moe(rms_norm(x))
        if self.kind == "M":
            return x + self.mamba(rms_norm(x))
        return x + self.rnn(rms_norm(x))


# ---------------------------------------------------------------------------------------------


def check():
    """float64, tiny shapes: chunked scan vs sequential, blocks vs step-by-step, MoE vs dense."""
    dt = torch.float64
    g = torch.Generator().manual_seed(3)

    def close(got, want, what):
        if not torch.allclose(got, want, rtol=1e-9, atol=1e-10):
            err = (got - want).abs().max().item()
            raise AssertionError(f"{what}: max abs error {err:.3e}")

    # The scan, forward and every gradient, L a multiple of chunk and a ragged tail.
    for length, chunk in ((16, 4), (13, 4), (5, 8), (7, 1)):
        shape = (2, length, 3)
        x = torch.randn(*shape, 4, generator=g, dtype=dt)
        a = -F.softplus(torch.randn(*shape, generator=g, dtype=dt)) * 0.5
        b = torch.randn(*shape, 5, generator=g, dtype=dt)
        c = torch.randn(*shape, 5, generator=g, dtype=dt)
        w_y = torch.randn(*shape, 4, generator=g, dtype=dt)
        w_s = torch.randn(2, 3, 4, 5, generator=g, dtype=dt)
        results = []
        for fn in (lambda *t: ssd_chunked(*t, chunk), ssd_sequential):
            ins = [t.clone().requires_grad_() for t in (x, a, b, c)]
            y, s = fn(*ins)
            ((y * w_y).sum() + (s * w_s).sum()).backward()
            results.append([y, s] + [t.grad for t in ins])
        for name, got, want in zip(("y", "final state", "dx", "da", "db", "dc"), *results):
            close(got, want, f"ssd L={length} chunk={chunk} {name}")

    # The M and R blocks: chunked scan vs step-by-step recurrence, a ragged tail included.
    for length in (12, 10):
        x = torch.randn(2, length, 16, generator=g, dtype=dt)
        mamba = Mamba(16, d_state=4, head_dim=8, expand=2, conv_kernel=3, chunk=4).to(dt)
        mamba.initialise(g, zero_out=False)
        close(mamba(x), mamba(x, sequential=True), f"mamba L={length}")
        rnn = Recurrent(16, width=12, conv_kernel=3, chunk=4).to(dt)
        rnn.initialise(g, zero_out=False)
        close(rnn(x), rnn(x, sequential=True), f"recurrent L={length}")

    # Dropless MoE vs the dense reference, forward and every gradient, with and without a
    # shared expert; the router's and experts' weights random so routing is non-trivial.
    for shared_hidden in (6, 0):
        moe = Moe(8, n_experts=5, top_k=2, expert_hidden=7, shared_hidden=shared_hidden).to(dt)
        with torch.no_grad():
            for p in moe.parameters():
                p.uniform_(-1.0, 1.0, generator=g)
        x = torch.randn(3, 11, 8, generator=g, dtype=dt)
        w = torch.randn(3, 11, 8, generator=g, dtype=dt)
        grads = []
        for fn in (moe, moe.reference):
            moe.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            y = fn(xi)
            (y * w).sum().backward()
            grads.append([y, xi.grad] + [p.grad for p in moe.parameters()])
        for idx, (got, want) in enumerate(zip(*grads)):
            close(got if got is not None else torch.zeros_like(want),
                  want if want is not None else torch.zeros_like(got), f"moe tensor {idx}")
        counts = moe.tokens_per_expert
        if counts.sum().item() != 3 * 11 * 2 or (counts > 0).sum().item() < 2:
            raise AssertionError(f"moe: degenerate routing {counts.tolist()}")
    print("ok")


REQUIRED = ("block", "batch", "seq", "d_model", "heads", "kv_heads", "ffn", "experts", "top_k",
            "expert_hidden", "shared_hidden", "ssm_state", "ssm_head_dim", "ssm_expand",
            "conv_kernel", "chunk", "rnn_width", "repeats", "threads")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="self-check in float64 on tiny shapes (no other argument needed)")
    ap.add_argument("--block", choices=["A", "E", "M", "R"])
    for name in REQUIRED[1:]:
        ap.add_argument("--" + name.replace("_", "-"), type=int,
                        help="required unless --check")
    ap.add_argument("--seed", type=int, default=7, help="parameters and input (default 7)")
    args = ap.parse_args()
    if args.check:
        check()
        return
    missing = ["--" + n.replace("_", "-") for n in REQUIRED if getattr(args, n) is None]
    if missing:
        ap.error("the following arguments are required: " + ", ".join(missing))

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    block = Block(args.block, args)
    block.initialise(gen)
    x = torch.randn(args.batch, args.seq, args.d_model, generator=gen).requires_grad_()
    cos, sin = rope_tables(args.seq, args.d_model // args.heads, torch.float32)

    seconds = []
    for _ in range(args.repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        y = block(x, cos, sin)
        loss = y.sum()
        if args.block == "E":
            loss = loss + block.moe.aux_loss
        loss.backward()
        seconds.append(time.perf_counter() - t0)

    print(json.dumps({
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "block": args.block,
        "params": sum(p.numel() for p in block.parameters()),
        "seconds": seconds[1:],
    }))


if __name__ == "__main__":
    main()
