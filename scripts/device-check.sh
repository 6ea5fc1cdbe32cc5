#!/usr/bin/env bash
# The device check (`make device-check`), run on the GPU machine in one command: builds what the
# GPU tests and benchmarks need against that machine's torch and the packages `make device-prep`
# unpacked into build-device/prefix (carried there), runs every test labelled gpu, the CUDA
# plugin's test, the ops benchmark's CUDA half, Polar Express against the bfloat16 product rate,
# a timed run of the default recipe on the device, the device recipe gpu-small with its MFU (and
# its kernels under torch's profiler) and its checkpoint stall against a device
# copy and DCP async_save, and two runs whose device memory is printed against the plan, and
# writes one report:
# $OUT/device-check.txt when OUT is set (the device tool's folder that comes back), else
# build-gpu/device-check.txt.
#
# Contract: never stops at the first failure (every part runs and says PASS/FAIL with its
# seconds); each part has its own time bound and the whole check a budget (DEVICE_CHECK_BUDGET_S,
# 540 s: scripts/device-check-lib.sh), so it ends with its goals within the device tool's
# 600-s command even when parts hang, a part the budget cannot fit named as not run; exits
# non-zero when any part failed or did not run. Builds only the
# targets below (not every test and benchmark) so that a 16-core machine builds them in a
# few minutes.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
REPORT_DIR="${OUT:-$ROOT/build-gpu}"
mkdir -p "$REPORT_DIR"
REPORT="$REPORT_DIR/device-check.txt"
: > "$REPORT"
# say, part (each part bounded by its limit and the budget left), goal, finish. DEVICE_CHECK_PARTS
# (names, space-separated) runs only those parts after the build: a rerun of what failed, or an
# investigation, within the device time left.
# shellcheck source=scripts/device-check-lib.sh
source "$ROOT/scripts/device-check-lib.sh"

say "device-check at $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo -dirty)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee -a "$REPORT"
say "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"

if [ ! -f build-device/env.sh ]; then
  say "FAIL no build-device/env.sh: run 'make device-prep' on a machine with Debian's registry and carry build-device"
  exit 1
fi
# shellcheck source=/dev/null
source build-device/env.sh
PY="${MEGACPP_PYTHON:-python3}"
# The machine's python may itself be a venv (its torch in that venv's site-packages), so .venv
# is a link to its prefix rather than a new venv over the base interpreter.
if [ ! -x .venv/bin/python3 ]; then
  rm -rf .venv
  ln -sfn "$("$PY" -c 'import sys; print(sys.prefix)')" .venv
fi
.venv/bin/python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "devices", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' \
  2>&1 | tee -a "$REPORT"
say "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null) $( (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>/dev/null | tail -1)"
say "cmake: $(cmake --version | head -1); c++: $(c++ --version | head -1)"

TARGETS=(megacpp megacpp-trainer megacpp-data-loader megacpp-collector megacpp-checkpointer
         megacpp_store megacpp_trainer_cuda ops_test cuda_plugin_test ops_bench bench_orthogonalize
         bench_pipeline_overhead bench_adamw_step bench_muon_tail gpu_staging_test
         gpu_staging_peer)
# Warnings are not errors on the GPU machine (a device's time is not spent on a warning);
# MEGACPP_WERROR=ON makes them so (`make device-rehearsal` builds the same targets that way). A
# failed configure leaves its log's tail in the report (CMakeError.log before CMake 3.26,
# CMakeConfigureLog.yaml since).
part configure 120 cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DMEGACPP_WERROR="${MEGACPP_WERROR:-OFF}" -DMEGACPP_BUILD_BENCH=ON \
  || { tail -n 60 build-gpu/CMakeFiles/CMakeError.log build-gpu/CMakeFiles/CMakeConfigureLog.yaml \
         2>/dev/null | tee -a "$REPORT"; exit 1; }
# 270 s is what a 16-core machine needs with room; DEVICE_CHECK_BUILD_S lets a smaller one (the
# rehearsal's) take longer.
part build "${DEVICE_CHECK_BUILD_S:-270}" cmake --build build-gpu -j "$(nproc)" --target "${TARGETS[@]}" || exit 1

part gpu_tests 150 ctest --test-dir build-gpu -L gpu --output-on-failure
# The fused kernels against torch's operations, and NCCL at world 1 with its abort (its
# communicator's set-up takes seconds).
part cuda_plugin_test 60 build-gpu/bin/cuda_plugin_test
part ops_bench 60 build-gpu/bin/ops_bench
# DistMuon's Polar Express (bfloat16, gpu-small's shapes) against the device's bfloat16 product
# rate (issue 32's goal: >= 70%).
part polar_express_rate 60 build-gpu/bin/bench_orthogonalize --device cuda
# DistAdamW's update on gpu-small's AdamW parameters: torch's operations against the fused
# kernel a CUDA rank runs (issue 32: wired in only where it beats torch's), and the copy limit.
part adamw_step 60 build-gpu/bin/bench_adamw_step --device cuda
# DistMuon's step on gpu-small's matrices: its tail through torch's operations against the fused
# kernel a CUDA rank runs (issue 32: wired in only where it beats torch's).
part muon_tail 60 build-gpu/bin/bench_muon_tail --device cuda
# The golden losses on the device: tiny at world 1 on cuda:0 against the CPU's golden (20 steps
# and 2 validation losses; tests/e2e/golden_test.py GoldenLossesOnDevice).
part golden_on_cuda 60 env MEGACPP_GOLDEN_DEVICE=cuda MEGACPP_BIN="$ROOT/build-gpu/bin/megacpp" \
  python3 tests/e2e/golden_test.py -v GoldenLossesOnDevice
# The default recipe on the device, timed: tokens/s from its receipts.
RUN=$(mktemp -d)/run
part tiny_on_cuda 45 build-gpu/bin/megacpp run tiny --ranks 1 --steps 200 --device cuda \
  --run-dir "$RUN" --progress plain
[ -f "$RUN/receipts/bench_result.json" ] && cp "$RUN/receipts/bench_result.json" "$REPORT_DIR/tiny_cuda_bench_result.json"
[ -d "$RUN/logs" ] && tail -30 "$RUN"/logs/trainer-0.log 2>/dev/null | tee -a "$REPORT" > /dev/null

# The device recipe: gpu-small (254 M parameters, bf16-mixed, 32 x 1024 tokens a step) on one
# GPU for 60 steps, and its MFU over the steps after the 10th against the card's dense bf16 peak
# (bench/mfu.py; issue 32's goal: >= 40%), beside its PyTorch twin's (eager, DDP, autocast) on
# the same GPU for 30 steps: whether the gap to the goal is megacpp's or eager PyTorch's.
SMALL_RUN=$(mktemp -d)/run
gpu_small_mfu() {
  build-gpu/bin/megacpp run gpu-small --ranks 1 --steps 60 --device cuda --run-dir "$SMALL_RUN" \
    --progress plain || return 1
  python3 bench/mfu.py "$SMALL_RUN" --megacpp build-gpu/bin/megacpp --peak-tflops auto --warmup 10 \
    --twin --twin-steps 30
}
export -f gpu_small_mfu
export SMALL_RUN
part gpu_small_mfu 200 bash -c gpu_small_mfu
[ -f "$SMALL_RUN/receipts/bench_result.json" ] && cp "$SMALL_RUN/receipts/bench_result.json" "$REPORT_DIR/gpu_small_bench_result.json"

# Where gpu-small's device time goes, kernel by kernel, and how much of the wall time the device
# is idle: steps 8..12 under torch's profiler (MEGACPP_PROFILE_STEPS, stages/trainer/step_profile.h;
# no Nsight Systems needed on the machine).
gpu_small_kernels() {
  local dir
  dir=$(mktemp -d)
  MEGACPP_PROFILE_STEPS=8:12 build-gpu/bin/megacpp run gpu-small --ranks 1 --steps 12 \
    --device cuda --run-dir "$dir/run" --progress none || return 1
  head -80 "$dir/run/logs/profile-0.txt"
}
export -f gpu_small_kernels
part gpu_small_kernels 120 bash -c gpu_small_kernels

# P1 on the device: gpu-small in `megacpp run --device cuda` against the same TrainStep in a
# plain loop with its batches already on the device (issue 32's goal: <= 1.03 with async H2D).
part p1_gpu_small 150 build-gpu/bin/bench_pipeline_overhead --device cuda --recipe gpu-small \
  --steps 30 --warmup 5 --repeats 1

# The checkpoint stall on the device: gpu-small with a checkpoint every 20 steps, its journaled
# stall against a device-to-device copy of rank 0's share, a pinned host copy and torch DCP's
# async_save of the same tensors on the GPU, blocking and with TorchTitan's pinned async
# staging (bench/checkpoint_stall.py; issue 32's goals: <= 1.2 x the device copy, >= 5 x below
# DCP).
STALL_DIR=$(mktemp -d)
sed -e 's/^checkpoint_every = .*/checkpoint_every = 20/' recipes/gpu-small.toml > "$STALL_DIR/gpu-small-ck20.toml"
checkpoint_stall() {
  # Each process's device memory while the device-staged run runs (nvidia-smi, once a second;
  # its output to a file, never to the report's pipe): the checkpointer's CUDA context on the
  # rank's device is what the memory plan does not count yet.
  ( while sleep 1; do
      nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits
    done ) > "$STALL_DIR/apps.csv" 2> /dev/null &
  local sampler=$!
  trap 'kill $sampler 2> /dev/null' RETURN
  # Staged on the device (exported to the checkpointer through the handle socket), and the same
  # run staged in the host region for comparison.
  MEGACPP_SNAPSHOT_STAGING=device build-gpu/bin/megacpp run "$STALL_DIR/gpu-small-ck20.toml" \
    --ranks 1 --steps 42 --device cuda --run-dir "$STALL_DIR/run" --progress none || return 1
  kill $sampler 2> /dev/null
  python3 - "$STALL_DIR/apps.csv" <<'PY'
import collections, os, sys
most = collections.defaultdict(int)
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 3 and parts[2].isdigit():
        most[os.path.basename(parts[1])] = max(most[os.path.basename(parts[1])], int(parts[2]))
print("device memory per process, the most nvidia-smi saw (MiB): " +
      (", ".join("%s %d" % kv for kv in sorted(most.items())) or "none seen"))
PY
  MEGACPP_SNAPSHOT_STAGING=host build-gpu/bin/megacpp run "$STALL_DIR/gpu-small-ck20.toml" \
    --ranks 1 --steps 42 --device cuda --run-dir "$STALL_DIR/run-host" --progress none || return 1
  build-gpu/bin/megacpp verify "$STALL_DIR/run" || return 1
  python3 bench/checkpoint_stall.py "$STALL_DIR/run" --repeats 2 --host-run "$STALL_DIR/run-host"
}
export -f checkpoint_stall
export STALL_DIR
part checkpoint_stall 200 bash -c checkpoint_stall

[ -f "$RUN/launch.json" ] && say "tiny on cuda: muonPrecision $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("muonPrecision"))' "$RUN/launch.json")"
# Device memory against the plan (issue: measured within 15% of it): `large` in bf16-mixed +
# selective and `tiny-hybrid`, 1 rank, a checkpoint halfway; the plan's per-rank total on cuda
# (device memory, with the snapshot staging where it is staged on the device) against the peak
# bytes torch's caching allocator held in tensors (devicePeak) and from the driver
# (deviceReserved), each plus the device staging buffer.
MEM_DIR=$(mktemp -d)
sed -e 's/^name = .*/name = "large-bs"/' -e 's/^checkpoint_every = .*/checkpoint_every = 3/' \
  -e 's/^\[train\]$/[train]\nprecision = "bf16-mixed"\nrecompute = "selective"/' \
  recipes/large.toml > "$MEM_DIR/large-bs.toml"
sed -e 's/^checkpoint_every = .*/checkpoint_every = 10/' recipes/tiny-hybrid.toml > "$MEM_DIR/tiny-hybrid.toml"
memory_on_cuda() {
  local rc=0
  for recipe in "$MEM_DIR/large-bs.toml" "$MEM_DIR/tiny-hybrid.toml"; do
    local run steps=6
    run="$MEM_DIR/run-$(basename "$recipe" .toml)"
    [[ $recipe == *tiny-hybrid* ]] && steps=20
    local plan
    plan=$(build-gpu/bin/megacpp plan "$recipe" --ranks 1 --device cuda)
    grep "memory per rank" <<< "$plan"
    build-gpu/bin/megacpp run "$recipe" --ranks 1 --steps "$steps" --device cuda \
      --run-dir "$run" --progress none || { rc=1; continue; }
    python3 - "$run" "$plan" <<'PY' || rc=1
import json, os, re, sys
m = json.load(open(os.path.join(sys.argv[1], "receipts", "bench_result.json")))["memory"]
plan = float(re.search(r"memory per rank \(.*\): .*?: ([0-9.]+) GiB", sys.argv[2]).group(1))
peak, reserved = m.get("devicePeak", 0) / 2**30, m.get("deviceReserved", 0) / 2**30
print("%s: plan %.3f GiB, device peak %.3f GiB (%.2f of the plan), reserved %.3f GiB (%.2f)"
      % (os.path.basename(sys.argv[1]), plan, peak, peak / plan, reserved, reserved / plan))
assert peak > 0, "no device memory recorded"
PY
  done
  return $rc
}
export -f memory_on_cuda
export MEM_DIR
part memory_on_cuda 90 bash -c memory_on_cuda

# A NaN gradient on the GPU rank: the run must end `diverged`, nothing of that step committed.
NAN_RUN=$(mktemp -d)/run
CK5_DIR=$(mktemp -d)
sed 's/^checkpoint_every = 20/checkpoint_every = 5/' recipes/tiny.toml > "$CK5_DIR/ck5.toml"
diverged_on_cuda() {
  MEGACPP_FAULT=trainer:0:optimizer:7:nan build-gpu/bin/megacpp run "$CK5_DIR/ck5.toml" \
    --ranks 1 --steps 20 --device cuda --run-dir "$NAN_RUN" --progress none && return 1
  python3 - "$NAN_RUN" <<'PY'
import json, os, sys
m = json.load(open(os.path.join(sys.argv[1], "manifest.json")))
print("state", m["state"], "error", m.get("error", {}).get("kind"), m.get("error", {}).get("message"))
print("latest", m.get("latestCheckpoint"))
assert m["state"] == "error" and m["error"]["kind"] == "diverged", m
assert m.get("latestCheckpoint") == "checkpoints/step_00000005", m
PY
}
export -f diverged_on_cuda
export NAN_RUN CK5_DIR
part diverged_on_cuda 60 bash -c diverged_on_cuda

# The issue's goals as the parts above printed them, gathered at the end of the report (what a
# `tail` of it shows first); a goal whose part did not run or failed says so.
say "== goals (the card: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
goal "P1 (<= 1.03)" "ratio pipeline/in-process"
goal "checkpoint stall (<= 1.2 x device copy, >= 5 x below DCP)" "ratios: megacpp stall"
goal "checkpoint stall against DCP staging in the background" "ratios: DCP async staging"
goal "gpu-small MFU (>= 40%)" "^mfu: [0-9.]+ tokens/s .*MFU [0-9.]+%"
goal "gpu-small against its PyTorch twin (tokens/s)" "megacpp / twin tokens/s"
goal "Polar Express (>= 0.70 of the bf16 product rate)" "Polar Express at [0-9.]+ of it"
goal "fused AdamW (stays on if torch / fused > 1)" "fused update .*torch / fused"
goal "fused Muon tail (stays on if torch / fused > 1)" "step, fused tail .*torch / fused"

finish
