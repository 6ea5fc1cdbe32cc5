#!/usr/bin/env python3
"""bench_checkpoint_stall: a run's checkpoint stall against the copy it cannot beat and against
torch DCP's async_save of the same tensors on the same device, in one invocation.

    bench/checkpoint_stall.py RUN [--repeats N] [--host-run RUN2]

RUN is a finished `megacpp run` that checkpointed (make device-check runs gpu-small on one GPU
with a checkpoint every 20 steps). From it:

  megacpp stall     per checkpoint, the time the snapshot blocked the training loop: the
                    trainers' journaled `snapshot` phase (starting the copy into staging and
                    the next step's wait for it) summed over the two steps a checkpoint touches,
                    and, as `megacpp compare` counts it, the step after the checkpoint beyond the
                    median step; the median over the run's checkpoints
  tensors           rank 0's share as its checkpoint file lists it (the safetensors header of
                    the latest checkpoint: names, dtypes, shapes), made on the run's device
  device copy       every tensor copied into a second set on the same device (device-to-device
                    on a GPU, memcpy on a CPU): what a snapshot through CUDA IPC stalls for
  pinned copy       every tensor copied into page-locked host memory (GPU only): what a host
                    staging region reached by DMA stalls for
  DCP async_save    torch.distributed.checkpoint.async_save of that state dict (a process group
                    of one): `blocking` until it returns (its staging: the stall a training loop
                    sees), `total` until its future completes
  DCP async staging the same with a DefaultStager staging in the background: on a GPU
                    StagingOptions(True, False, True, True), page-locked memory copied into
                    without blocking, as TorchTitan's async_with_pinned_mem does (its shared
                    memory is for a checkpointing process; this one is a thread, and /dev/shm
                    may be small where the GPU is); on a CPU (False, False, True, False), its
                    page-locked, non-blocking copies needing an accelerator. `blocking` until
                    async_save returns, `staged` until its staging completes (a loop waits for
                    that before its next update, so staging beyond the next step's forward and
                    backward is stall too), `total` until the upload completes. A new stager
                    for each save: torch 2.11's DefaultStager closes its StateDictStager after
                    one staging (its cache and its copy table cleared: a second staging fails
                    with KeyError: <class 'type'>; the clearing came with the leak fix of
                    pytorch/pytorch#170431), so nothing pinned is reused between saves

  staging           where the run's ranks staged their snapshots (their logs): an exported
                    device buffer the checkpointer imports (MEGACPP_SNAPSHOT_STAGING auto or
                    device on a GPU), its memfd stand-in, or the host region
  --host-run RUN2   the same recipe run with MEGACPP_SNAPSHOT_STAGING=host: its stall beside
                    this one's (what device staging saves)

  the stall         the larger of the two megacpp figures, what the ratios judge: on a GPU the
                    snapshot phase is only the host's issue of the copies (the device waits for
                    them, the host does not), so the training loop's loss there is the step after
                    the checkpoint, whose time ends at the step's one read of the device

DCP is timed alone, with nothing training beside it; megacpp's step after the checkpoint carries
whatever its checkpointer's copy and write take from training (on a CPU, cores): the comparison
leans against megacpp.

Issue 32's goals, on a GPU: the stall <= 1.2 x the device copy, and >= 5 x below DCP's blocking
time. Prints the figures and the ratios; asserts nothing about time.
"""
import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import gloo_exit  # noqa: E402

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "F64": torch.float64}


def safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def megacpp_stalls(run_dir):
    with open(os.path.join(run_dir, "launch.json")) as f:
        launch = json.load(f)
    with open(os.path.join(run_dir, "receipts", "bench_telemetry.json")) as f:
        steps = {s["step"]: s for s in json.load(f)["steps"]}
    every = int(launch["recipe"]["train"]["checkpointEvery"])
    last = max(steps)
    seconds = sorted(s["stepSeconds"] for k, s in steps.items() if k >= 2)
    p50 = seconds[len(seconds) // 2]
    phase, extra = [], []
    for c in range(every, last, every):
        if c + 1 not in steps:
            continue
        phase.append(sum((steps[k].get("phases") or {}).get("snapshotSeconds", 0.0)
                         for k in (c, c + 1) if k in steps))
        extra.append(steps[c + 1]["stepSeconds"] - p50)
    return launch, phase, extra, p50


def staging_of(run_dir):
    """How rank 0 staged its snapshots, from its log."""
    try:
        with open(os.path.join(run_dir, "logs", "trainer-0.log"), errors="replace") as f:
            log = f.read()
    except OSError:
        return "unknown (no trainer-0 log)"
    for kind in ("cuda", "memfd"):
        if "staged in an exported %s buffer" % kind in log:
            return "exported %s buffer" % kind
    return "host region"


def timed(repeats, sync, fn):
    out = []
    for i in range(repeats + 1):  # the first is a warm-up
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--host-run", help="the same recipe staged in the host region, for comparison")
    args = ap.parse_args()

    launch, phase, extra, p50 = megacpp_stalls(args.run_dir)
    if not phase:
        raise SystemExit("bench_checkpoint_stall: the run took no checkpoint before its last step "
                         "(train.checkpoint_every below its steps is needed)")
    latest = os.path.join(args.run_dir, "checkpoints", "LATEST")
    with open(latest) as f:
        ckpt = os.path.join(args.run_dir, "checkpoints", f.read().strip())
    header = safetensors_header(os.path.join(ckpt, "rank_0.safetensors"))

    on_gpu = (launch.get("device") or "cpu") == "cuda"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    torch.set_num_threads(1)
    state = {}
    for name, t in header.items():
        x = torch.empty(t["shape"], dtype=DTYPES[t["dtype"]], device=device)
        if x.is_floating_point():
            x.normal_()
        else:
            x.fill_(7)
        state[name] = x
    nbytes = sum(x.numel() * x.element_size() for x in state.values())
    name = torch.cuda.get_device_name(0) if on_gpu else "CPU"

    copies = {k: torch.empty_like(v) for k, v in state.items()}
    device_copy = timed(args.repeats, sync,
                        lambda: [copies[k].copy_(v, non_blocking=True) for k, v in state.items()])
    del copies
    pinned_copy = None
    if on_gpu:
        pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
        pinned_copy = timed(args.repeats, sync, lambda: [
            pinned[k].copy_(v, non_blocking=True) for k, v in state.items()])
        del pinned

    work = tempfile.mkdtemp(prefix="dcp-", dir=os.path.join(args.run_dir, "checkpoints"))
    try:
        store = dist.FileStore(os.path.join(work, "store"), 1)
        dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", store=store, rank=0,
                                world_size=1)
        dcp_blocking, _, dcp_total = time_dcp(state, work, "dcp", args.repeats, sync)
        try:
            background = time_dcp(state, work, "dcp-staged", args.repeats, sync, lambda:
                                  DefaultStager(StagingOptions(on_gpu, False, True, on_gpu)))
        except Exception as e:  # the peer's failure is reported, not the benchmark's
            background = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        dist.destroy_process_group()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    stall_phase, stall_extra = statistics.median(phase), statistics.median(extra)
    print(f"checkpoint_stall: recipe {launch['recipe']['name']} on {device.type} ({name}); rank 0's "
          f"share {len(state)} tensors, {nbytes / 2**30:.3f} GiB; {len(phase)} checkpoint(s), "
          f"median step {1e3 * p50:.1f} ms")
    print(f"  megacpp stall         snapshot phase {1e3 * stall_phase:9.2f} ms   step after the "
          f"checkpoint beyond the median {1e3 * stall_extra:9.2f} ms   (staging: "
          f"{staging_of(args.run_dir)})")
    if args.host_run:
        _, host_phase, host_extra, _ = megacpp_stalls(args.host_run)
        if host_phase:
            h_phase, h_extra = statistics.median(host_phase), statistics.median(host_extra)
            print(f"  megacpp stall, host   snapshot phase {1e3 * h_phase:9.2f} ms   step after the "
                  f"checkpoint beyond the median {1e3 * h_extra:9.2f} ms   (staging: "
                  f"{staging_of(args.host_run)}); host / this {h_phase / max(stall_phase, 1e-9):.2f}")
    print(f"  device copy           {1e3 * device_copy:9.2f} ms  ({nbytes / device_copy / 1e9:.1f} GB/s)")
    if pinned_copy is not None:
        print(f"  pinned host copy      {1e3 * pinned_copy:9.2f} ms  ({nbytes / pinned_copy / 1e9:.1f} GB/s)")
    print(f"  DCP async_save        blocking {1e3 * dcp_blocking:9.2f} ms   total "
          f"{1e3 * dcp_total:9.2f} ms")
    if isinstance(background, str):
        print(f"  DCP async staging     failed: {background}")
    else:
        b, st, t = background
        print(f"  DCP async staging     blocking {1e3 * b:9.2f} ms   staged {1e3 * st:9.2f} ms   "
              f"total {1e3 * t:9.2f} ms   (median step {1e3 * p50:.1f} ms)")
    stall = max(stall_phase, stall_extra)
    print(f"  the stall             {1e3 * stall:9.2f} ms  (the larger of the two megacpp figures)")
    print(f"  ratios: megacpp stall / device copy {stall / device_copy:.2f} (goal <= 1.2 on a "
          f"GPU); DCP blocking / megacpp stall {dcp_blocking / max(stall, 1e-9):.2f} "
          f"(goal >= 5)")
    if not isinstance(background, str):
        print(f"  ratios: DCP async staging blocking / megacpp stall "
              f"{background[0] / max(stall, 1e-9):.2f}, staged / megacpp stall "
              f"{background[1] / max(stall, 1e-9):.2f}")
    return 0


def time_dcp(state, work, name, repeats, sync, make_stager=None):
    """Medians of (blocking, staged, total) seconds of DCP's async_save of `state` over `repeats`
    saves after a warm-up: until it returns, until its staging completes (when it returns, without
    a stager staging in the background) and until its upload completes. `make_stager` makes each
    save's stager (see the top: torch 2.11's serves one save)."""
    blocking, staged, total = [], [], []
    for i in range(repeats + 1):  # the first is a warm-up
        d = os.path.join(work, "%s-%d" % (name, i))
        stager = make_stager() if make_stager else None
        try:
            sync()
            t0 = time.perf_counter()
            if stager is None:
                upload = dcp.async_save(state, checkpoint_id=d)
                t1 = t2 = time.perf_counter()
            else:
                response = dcp.async_save(state, checkpoint_id=d, async_stager=stager)
                t1 = time.perf_counter()
                response.staging_completion.result()
                t2 = time.perf_counter()
                upload = response.upload_completion
            upload.result()
            t3 = time.perf_counter()
        finally:
            if stager is not None:
                stager.close()
            shutil.rmtree(d, ignore_errors=True)
        if i:
            blocking.append(t1 - t0)
            staged.append(t2 - t0)
            total.append(t3 - t0)
    return statistics.median(blocking), statistics.median(staged), statistics.median(total)


if __name__ == "__main__":
    gloo_exit.leave(main())
