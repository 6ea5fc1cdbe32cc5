#!/usr/bin/env python3
"""The PyTorch peer of bench_checkpoint: the same tensors (names, shapes, dtypes from --spec),
checkpointed the ways a PyTorch user would, timing what blocks the training loop.

  torch.save         the whole state dict to a file (blocks until written; no fsync)
  DCP async_save     torch.distributed.checkpoint.async_save (a gloo process group of one):
                     `blocking` is until async_save returns (the stall a training loop sees:
                     the staging copy), `total` until its future completes
Each is run --repeats times; the best and median are printed as one JSON object on stdout.
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import gloo_exit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True, help="JSON: {tensors: [[name, dtype, shape]], dir, repeats}")
    a = ap.parse_args()
    spec = json.loads(a.spec)
    torch.set_num_threads(1)
    dtypes = {"F32": torch.float32, "I64": torch.int64, "BF16": torch.bfloat16, "I32": torch.int32}
    state = {}
    gen = torch.Generator().manual_seed(0)
    for name, dtype, shape in spec["tensors"]:
        t = torch.empty(shape, dtype=dtypes[dtype])
        if t.is_floating_point():
            t.normal_(generator=gen)
        else:
            t.fill_(7)
        state[name] = t
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    work = tempfile.mkdtemp(prefix="ckpt-peer-", dir=spec["dir"])
    out = {"bytes": nbytes}
    try:
        saves = []
        for i in range(spec["repeats"]):
            path = os.path.join(work, "state.pt")
            t0 = time.perf_counter()
            torch.save(state, path)
            saves.append(time.perf_counter() - t0)
            os.remove(path)
        out["torch_save_s"] = {"best": min(saves), "median": statistics.median(saves)}

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        store = dist.FileStore(os.path.join(work, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        blocking, total = [], []
        for i in range(spec["repeats"]):
            d = os.path.join(work, "dcp-%d" % i)
            t0 = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=d)
            t1 = time.perf_counter()
            future.result()
            t2 = time.perf_counter()
            blocking.append(t1 - t0)
            total.append(t2 - t0)
            shutil.rmtree(d, ignore_errors=True)
        out["dcp_async_blocking_s"] = {"best": min(blocking), "median": statistics.median(blocking)}
        out["dcp_async_total_s"] = {"best": min(total), "median": statistics.median(total)}
        dist.destroy_process_group()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    gloo_exit.leave(0)
