# Quick start: `make run` and `make test`. Both do all set-up (Debian packages, the torch
# venv outside the clone), configure and build incrementally, and are idempotent.
BUILD      ?= build
BUILD_SAN  ?= build-asan
BUILD_TSAN ?= build-tsan
JOBS       ?= $(shell nproc)
WERROR     := $(if $(MEGACPP_WERROR),ON,OFF)
RUN_DIR    ?= runs/run-$(shell date +%Y%m%d-%H%M%S)
STEPS      ?= 60
RANKS      ?= 2
CTEST_ARGS ?=
MEGACPP_FUZZ_SECONDS ?= 300

.PHONY: all setup configure build build-run run run-cpp test test-full test-unit test-sanitize build-sanitize test-tsan build-tsan fuzz chaos multinode format format-check shell-check bench bench-train-step bench-memory-plan bench-failure bench-recovery bench-multinode device-prep device-test device-check device-rehearsal clean

all: build

setup:
	@bash scripts/setup.sh

# Configured once per build directory and -Werror setting (a stamp); after that ninja re-runs
# CMake itself when a CMakeLists.txt changes, so a warm `make run` does not configure again.
configure: setup
	@if [ ! -f $(BUILD)/build.ninja ] || [ ! -f $(BUILD)/.configured-werror-$(WERROR) ]; then \
	  rm -f $(BUILD)/.configured-werror-*; \
	  cmake -S . -B $(BUILD) -G Ninja -DMEGACPP_WERROR=$(WERROR) > $(BUILD).configure.log 2>&1 || \
	    { cat $(BUILD).configure.log; exit 1; }; \
	  touch $(BUILD)/.configured-werror-$(WERROR); fi

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# What `megacpp run` executes, and nothing else (no test, no benchmark): the command, its stages
# and the plugins it loads (the CUDA plugin is a dependency of the trainer where it builds).
RUN_TARGETS := megacpp megacpp-trainer megacpp-data-loader megacpp-collector megacpp-checkpointer \
               megacpp_store
build-run: configure
	@cmake --build $(BUILD) -j $(JOBS) --target $(RUN_TARGETS)

run: build-run
	@$(BUILD)/bin/megacpp run tiny --ranks $(RANKS) --steps $(STEPS) --run-dir $(RUN_DIR)

# cpp-tiny on real text: the C++ standard library headers, tokenized once by `megacpp prepare`
# into runs/data/cpp (reused while its dataset.json exists), then trained on.
run-cpp: build-run
	@test -f runs/data/cpp/dataset.json || $(BUILD)/bin/megacpp prepare /usr/include/c++ --out runs/data/cpp
	@$(BUILD)/bin/megacpp run cpp-tiny --ranks $(RANKS) --steps $(STEPS) --run-dir $(RUN_DIR) --data-dir runs/data

# Every test: format and shell-script checks, the full build's ctest (unit, integration, e2e, the bounded chaos
# sample), an ASan+UBSan build of the torch-free libraries with their unit tests and a 10 s
# run of each fuzz target, and a ThreadSanitizer build of the unit tests that run threads.
test: build format-check shell-check
	@ctest --test-dir $(BUILD) --output-on-failure -j 2 -LE full $(CTEST_ARGS)
	@$(MAKE) --no-print-directory test-sanitize
	@$(MAKE) --no-print-directory test-tsan

# The sanitizer build is clang's: ASan+UBSan on the torch-free libraries, and the libFuzzer
# targets of tests/fuzz.
# Line tables only (-g1): a sanitizer's report still names file and line, at less compile time
# (CMakeLists.txt says why for the main build).
build-sanitize: setup
	@if [ -f $(BUILD_SAN)/CMakeCache.txt ] && \
	  ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++$$' $(BUILD_SAN)/CMakeCache.txt; then \
	  echo "$(BUILD_SAN) was built by another compiler: removing it for the clang build"; \
	  rm -rf $(BUILD_SAN); fi
	@cmake -S . -B $(BUILD_SAN) -G Ninja -DMEGACPP_WERROR=$(WERROR) -DMEGACPP_WITH_TORCH=OFF \
	  -DMEGACPP_BUILD_BENCH=OFF -DMEGACPP_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=Debug \
	  -DCMAKE_C_FLAGS_DEBUG=-g1 -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
	  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DMEGACPP_FUZZ=ON \
	  -DMEGACPP_FUZZ_SECONDS=$(MEGACPP_FUZZ_SECONDS) \
	  > $(BUILD_SAN).configure.log 2>&1 || (cat $(BUILD_SAN).configure.log; exit 1)
	@cmake --build $(BUILD_SAN) -j $(JOBS)

test-sanitize: build-sanitize
	@ASAN_OPTIONS=detect_leaks=1 ctest --test-dir $(BUILD_SAN) --output-on-failure -j 2 -L unit

# The ThreadSanitizer build (clang, as the ASan build is): torch-free, only the unit tests
# labelled tsan (the ipc modules' threads and forked peers, the control client's thread,
# /metrics' HTTP threads, the dataset check and prepare thread pools). Any report fails the test; tests/tsan.supp holds the suppressions,
# each with its reason.
build-tsan: setup
	@if [ -f $(BUILD_TSAN)/CMakeCache.txt ] && \
	  ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++$$' $(BUILD_TSAN)/CMakeCache.txt; then \
	  echo "$(BUILD_TSAN) was built by another compiler: removing it for the clang build"; \
	  rm -rf $(BUILD_TSAN); fi
	@cmake -S . -B $(BUILD_TSAN) -G Ninja -DMEGACPP_WERROR=$(WERROR) -DMEGACPP_WITH_TORCH=OFF \
	  -DMEGACPP_BUILD_BENCH=OFF -DMEGACPP_SANITIZE=thread -DCMAKE_BUILD_TYPE=Debug \
	  -DCMAKE_C_FLAGS_DEBUG=-g1 -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
	  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  > $(BUILD_TSAN).configure.log 2>&1 || (cat $(BUILD_TSAN).configure.log; exit 1)
	@cmake --build $(BUILD_TSAN) -j $(JOBS) --target tsan_tests

test-tsan: build-tsan
	@ctest --test-dir $(BUILD_TSAN) --output-on-failure -j 2 -L tsan

# Each fuzz target for MEGACPP_FUZZ_SECONDS (300) from the committed seeds plus what earlier
# runs found (kept under $(BUILD_SAN)); a crash leaves its input in
# $(BUILD_SAN)/tests/fuzz/artifacts/.
fuzz: build-sanitize
	@ctest --test-dir $(BUILD_SAN) --output-on-failure -V -j 2 -L '^fuzz$$'

# Every chaos case (kill -9 of each stage kind, SIGSTOP, exceptions, a killed supervisor).
# Every test labelled full: all chaos cases, 200 checkpoint kill points, resume at world 3 and
# resharding.
test-full: build
	@ctest --test-dir $(BUILD) --output-on-failure -L full

# `make chaos`: every chaos case of one host, then every multinode test (root only).
chaos: build
	@ctest --test-dir $(BUILD) --output-on-failure -R 'chaos_full|checkpoint_kills_full'
	@ctest --test-dir $(BUILD) --output-on-failure -L multinode

# Every multinode test (root only): hosts as network namespaces, a real Slurm cluster of them and
# torchrun's c10d rendezvous across them, at 2 and 4 nodes. `make test` runs the 2-node ones.
multinode: build
	@ctest --test-dir $(BUILD) --output-on-failure -L multinode

# The GPU machine has torch and nvcc but no package registry: device-prep (here) unpacks the
# build's Debian packages into build-device/prefix (<= 64 MiB, carried there); device-test (there)
# builds against its own torch and runs the tests labelled gpu.
device-prep:
	@bash scripts/device-prep.sh

device-test:
	@bash scripts/device-test.sh

# On the GPU machine, one command: builds what the GPU checks need, runs the gpu tests, the
# CUDA plugin test, the ops bench and the default recipe on the device; one report file.
device-check:
	@bash scripts/device-check.sh

# Here, before a GPU is lent (root, Debian's registry): the device check's build and its parts
# that need no device, in a Debian 13 root with GCC 13 (the GPU machine's compiler) and only the
# carried prefix; then the built megacpp on 2 CPU ranks there.
device-rehearsal:
	@bash scripts/device-rehearsal.sh

format:
	@git ls-files '*.h' '*.cpp' '*.cu' | xargs clang-format -i

format-check:
	@bash scripts/check-format.sh

shell-check:
	@bash scripts/check-shell.sh

bench: build
	@$(BUILD)/bin/bench_pipeline_overhead
	@$(BUILD)/bin/bench_optimizer
	@$(BUILD)/bin/bench_prepare
	@$(BUILD)/bin/bench_data_loader
	@$(BUILD)/bin/bench_checkpoint
	@$(BUILD)/bin/bench_checkpoint_write
	@$(BUILD)/bin/bench_ssd
	@$(BUILD)/bin/bench_blocks
	@$(BUILD)/bin/bench_orthogonalize --d-model 512 --layers 4
	@$(BUILD)/bin/bench_adamw_step --d-model 256 --vocab 8192
	@$(BUILD)/bin/bench_muon_tail --d-model 256 --layers 4
	@MEGACPP_BIN=$(BUILD)/bin/megacpp .venv/bin/python bench/collect_all.py

# megacpp run against its Python twin (torchrun, DDP, torch.optim.Muon + AdamW) at the tiny,
# medium and large recipes, 3 trials each, alternately (about 15 minutes on 2 cores).
bench-train-step: build
	@.venv/bin/python bench/train_step.py

# Memory per rank and tokens/s of each precision / recomputation setting: megacpp's plan, megacpp
# measured, and the same model under DDP + torch.autocast / torch.utils.checkpoint (about 10
# minutes on 2 cores).
bench-memory-plan: build
	@.venv/bin/python bench/memory_plan.py

bench-failure: build
	@.venv/bin/python bench/failure_detection.py

bench-recovery: build
	@.venv/bin/python bench/recovery.py

# A node lost (killed, or its link cut) on namespace hosts: megacpp's job watch against torchrun
# multi-node on Gloo. Root only (sudo make bench-multinode).
bench-multinode: build
	@.venv/bin/python bench/multinode_failure.py --megacpp $(BUILD)/bin/megacpp

clean:
	rm -rf $(BUILD) $(BUILD_SAN) $(BUILD_TSAN) $(BUILD).configure.log $(BUILD_SAN).configure.log \
	  $(BUILD_TSAN).configure.log
