#!/usr/bin/env python3
"""The PyTorch peer of bench/data_loader.cpp: what a torch user gets for the same shards.

A torch.utils.data.Dataset over the llm.c shards bench_data_loader wrote (np.memmap of each
.bin after its 1024-byte header, uint16): item i is window i of T + 1 tokens, windows start
every T tokens of a shard (as megacpp's sampler cuts them), returned as an int64 tensor.
DataLoader(batch_size=B, sampler=RandomSampler(replacement=True), num_workers=w,
pin_memory=False) stacks them into int64 [B, T + 1] batches (default collate); the windows are
drawn at random, like megacpp's sampler (with replacement, so no epoch ends mid-measurement).

For every shape of --spec and every num_workers it times the loop `for batch in loader`: the
first batch (worker start-up included) separately, then up to `batches` batches or `seconds`
seconds, whichever comes first. Per-batch latency is the time next() took, as the training
loop sees it. Prints one JSON object on its last stdout line:
{"torch": version, "numpy": version, "results": [{"batch", "seq_len", "workers", "batches",
"seconds", "first_ms", "lat_us": [...]}]}
"""

import argparse
import json
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

HEADER_BYTES = 256 * 4


class LlmcWindows(Dataset):
    def __init__(self, paths, seq_len):
        self.seq_len = seq_len
        self.shards = []
        self.starts = []  # first window index of each shard
        total = 0
        for p in paths:
            header = np.fromfile(p, dtype=np.int32, count=256)
            if header[0] != 20240520 or header[1] != 1:
                raise SystemExit(f"{p}: not a uint16 llm.c shard")
            tokens = np.memmap(p, dtype=np.uint16, mode="r", offset=HEADER_BYTES,
                               shape=(int(header[2]),))
            windows = (len(tokens) - 1) // seq_len if len(tokens) > seq_len else 0
            self.shards.append(tokens)
            self.starts.append(total)
            total += windows
        self.windows = total

    def __len__(self):
        return self.windows

    def __getitem__(self, i):
        s = np.searchsorted(self.starts, i, side="right") - 1
        off = (i - self.starts[s]) * self.seq_len
        w = self.shards[s][off:off + self.seq_len + 1]
        return torch.from_numpy(w.astype(np.int64))


def run(paths, batch, seq_len, workers, max_batches, seconds, seed):
    ds = LlmcWindows(paths, seq_len)
    g = torch.Generator()
    g.manual_seed(seed)
    # Random windows without an epoch end inside the timed loop (a small shard set holds
    # fewer windows than the loop may take): drawn with replacement, one batch more than needed.
    sampler = RandomSampler(ds, replacement=True, num_samples=(max_batches + 2) * batch,
                            generator=g)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers,
                        pin_memory=False)
    it = iter(loader)
    t0 = time.perf_counter()
    first = next(it)
    first_ms = (time.perf_counter() - t0) * 1e3
    assert first.dtype == torch.int64 and tuple(first.shape) == (batch, seq_len + 1)
    lat = []
    start = time.perf_counter()
    deadline = start + seconds
    prev = start
    while len(lat) < max_batches:
        b = next(it)
        now = time.perf_counter()
        lat.append((now - prev) * 1e6)
        prev = now
        if now >= deadline:
            break
    total = time.perf_counter() - start
    del it
    return {"batch": batch, "seq_len": seq_len, "workers": workers, "batches": len(lat),
            "seconds": total, "first_ms": first_ms, "lat_us": lat, "check": int(b[0, 0])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True,
                    help='JSON: {"shards": [paths], "shapes": [[B, T], ...], "workers": [0, 1, 2],'
                         ' "batches": n, "seconds": s, "seed": n}')
    args = ap.parse_args()
    spec = json.loads(args.spec)
    torch.set_num_threads(1)
    results = []
    for batch, seq_len in spec["shapes"]:
        for w in spec["workers"]:
            r = run(spec["shards"], batch, seq_len, w, spec["batches"], spec["seconds"],
                    spec.get("seed", 0))
            print(f"peer: B={batch} T={seq_len} workers={w}: {r['batches']} batches in "
                  f"{r['seconds']:.2f} s", file=sys.stderr, flush=True)
            results.append(r)
    print(json.dumps({"torch": torch.__version__, "numpy": np.__version__, "results": results}),
          flush=True)


if __name__ == "__main__":
    main()
