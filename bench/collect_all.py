"""bench_collect: `megacpp collect --all` over 1,000 small run directories against the floor of
reading the same input bytes.

Makes N copies (default 1000) of the `ok` run fixture (tests/fixtures/runs/v1/ok: 2 ranks, 8
steps; launch.json + 6 journals, ~60 KB) under one folder, then in one invocation:
  1. `megacpp collect --all DIR` (the first fold: writes every manifest and receipt),
  2. the same again (nothing changes: every output must be byte-identical, checked by hash),
  3. the floor: reading every input file of every run once (Python, one thread), what any fold
     must at least do.
Prints the time per run of each, the ratio of each pass to the floor, and the goal's verdict
(<= 10 ms per run). Machines here are shared: compare ratios, not absolute times.

    MEGACPP_BIN=build/bin/megacpp .venv/bin/python bench/collect_all.py [--runs N] [--jobs J]
"""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "tests", "fixtures", "runs", "v1", "ok")


def outputs_digest(root):
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f == "manifest.json" or os.path.basename(dirpath) == "receipts":
                p = os.path.join(dirpath, f)
                h.update(p.encode())
                with open(p, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def read_inputs(root):
    total = 0
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "receipts"]
        for f in files:
            if f == "launch.json" or f.endswith(".journal"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    total += len(fh.read())
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    megacpp = os.environ.get("MEGACPP_BIN") or os.path.join(HERE, "..", "build", "bin", "megacpp")
    tmp = tempfile.mkdtemp(prefix="megacpp-bench-collect-")
    try:
        for i in range(args.runs):
            shutil.copytree(FIXTURE, os.path.join(tmp, "r%05d" % i),
                            ignore=shutil.ignore_patterns("expected"))
        times = []
        for label in ("first fold", "second fold"):
            t0 = time.perf_counter()
            p = subprocess.run([megacpp, "collect", "--all", tmp, "--jobs", str(args.jobs)],
                               capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if p.returncode != 0:
                sys.exit("collect --all failed: " + p.stderr[-2000:])
            print("  %-12s %s" % (label, p.stdout.strip()))
            if label == "first fold":
                digest = outputs_digest(tmp)
        identical = outputs_digest(tmp) == digest
        t0 = time.perf_counter()
        nbytes = read_inputs(tmp)
        floor = time.perf_counter() - t0
        per = [1e3 * t / args.runs for t in times]
        floor_per = 1e3 * floor / args.runs
        print("bench_collect: %d runs (%.1f KB of inputs each), %d threads" %
              (args.runs, nbytes / args.runs / 1e3, args.jobs))
        print("  %-34s %8.3f ms/run" % ("collect --all, first fold", per[0]))
        print("  %-34s %8.3f ms/run" % ("collect --all, second fold", per[1]))
        print("  %-34s %8.3f ms/run" % ("floor: read the inputs (1 thread)", floor_per))
        print("  ratio first fold / floor %.2fx, second fold / floor %.2fx" %
              (per[0] / floor_per, per[1] / floor_per))
        print("  second fold byte-identical: %s; goal <= 10 ms per run: %s" %
              ("yes" if identical else "NO", "met" if max(per) <= 10 else "NOT met"))
        return 0 if identical else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
