"""The Python twin of megacpp's chunked SSD scan (stages/trainer/ssd.cpp), for bench_ssd.

The same algorithm in PyTorch (the state-space-dual form as Mamba-2's reference code writes it:
segment sums, four einsums) and the same sequential recurrence, timed forward + backward on
the shapes bench_ssd passes, with the same thread count. Prints one JSON line:
{"torch": version, "threads": n, "chunked": [seconds...], "sequential": [seconds...]}.
"""
import argparse
import json
import time

import torch


def segment_sums(x):
    t = x.size(-1)
    strictly_below = torch.ones(t, t, dtype=torch.bool).tril(-1)
    on_or_below = torch.ones(t, t, dtype=torch.bool).tril(0)
    terms = x.unsqueeze(-1).expand(*x.shape, t).masked_fill(~strictly_below, 0)
    return terms.cumsum(-2).masked_fill(~on_or_below, float("-inf"))


def ssd_chunked(x, a, b, c, chunk):
    bsz, length, heads, p = x.shape
    n = b.size(3)
    nc = length // chunk
    x = x.reshape(bsz, nc, chunk, heads, p)
    b = b.reshape(bsz, nc, chunk, heads, n)
    c = c.reshape(bsz, nc, chunk, heads, n)
    a = a.reshape(bsz, nc, chunk, heads).permute(0, 3, 1, 2)
    a_cumsum = a.cumsum(-1)
    decay = segment_sums(a).exp()
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, decay, x)
    decay_to_end = (a_cumsum[..., -1:] - a_cumsum).exp()
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay_to_end, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], 1)
    chunk_decay = segment_sums(torch.nn.functional.pad(a_cumsum[..., -1], (1, 0))).exp()
    entering = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, entering[:, :-1], a_cumsum.exp())
    return (y_diag + y_off).reshape(bsz, length, heads, p), entering[:, -1]


def ssd_sequential(x, a, b, c):
    bsz, length, heads, p = x.shape
    state = x.new_zeros(bsz, heads, p, b.size(3))
    ys = []
    for t in range(length):
        state = a[:, t].exp()[:, :, None, None] * state + x[:, t, :, :, None] * b[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, c[:, t]))
    return torch.stack(ys, 1), state


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--state-dim", type=int, required=True)
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--repeats", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(7)
    shape = (args.batch, args.length, args.heads)
    x = torch.randn(*shape, args.head_dim, generator=g).requires_grad_()
    a = (-torch.nn.functional.softplus(torch.randn(*shape, generator=g)) * 0.5).requires_grad_()
    b = torch.randn(*shape, args.state_dim, generator=g).requires_grad_()
    c = torch.randn(*shape, args.state_dim, generator=g).requires_grad_()

    def timed(fn):
        out = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            y, s = fn()
            (y.sum() + s.sum()).backward()
            out.append(time.perf_counter() - t0)
        return out[1:]

    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "chunked": timed(lambda: ssd_chunked(x, a, b, c, args.chunk)),
        "sequential": timed(lambda: ssd_sequential(x, a, b, c)),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
