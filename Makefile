# Quick start: `make run` and `make test`. Both do all set-up (Debian packages, the torch
# venv outside the clone), configure and build incrementally, and are idempotent.
BUILD      ?= build
BUILD_SAN  ?= build-asan
JOBS       ?= $(shell nproc)
WERROR     := $(if $(MEGACPP_WERROR),ON,OFF)
RUN_DIR    ?= runs/run-$(shell date +%Y%m%d-%H%M%S)
STEPS      ?= 60
RANKS      ?= 2
CTEST_ARGS ?=

.PHONY: all setup configure build run test test-unit test-sanitize chaos format format-check bench bench-failure clean

all: build

setup:
	@bash scripts/setup.sh

configure: setup
	@cmake -S . -B $(BUILD) -G Ninja -DMEGACPP_WERROR=$(WERROR) > $(BUILD).configure.log 2>&1 || \
	  (cat $(BUILD).configure.log; exit 1)

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

run: build
	@$(BUILD)/bin/megacpp run tiny --ranks $(RANKS) --steps $(STEPS) --run-dir $(RUN_DIR)

# Every test: format check, the full build's ctest (unit, integration, e2e, the bounded chaos
# sample), and an ASan+UBSan build of the torch-free libraries with their unit tests.
test: build format-check
	@ctest --test-dir $(BUILD) --output-on-failure -j 2 -LE full $(CTEST_ARGS)
	@$(MAKE) --no-print-directory test-sanitize

test-sanitize: setup
	@cmake -S . -B $(BUILD_SAN) -G Ninja -DMEGACPP_WERROR=$(WERROR) -DMEGACPP_WITH_TORCH=OFF \
	  -DMEGACPP_BUILD_BENCH=OFF -DMEGACPP_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=Debug \
	  > $(BUILD_SAN).configure.log 2>&1 || (cat $(BUILD_SAN).configure.log; exit 1)
	@cmake --build $(BUILD_SAN) -j $(JOBS)
	@ASAN_OPTIONS=detect_leaks=1 ctest --test-dir $(BUILD_SAN) --output-on-failure -j 2 -L unit

# Every chaos case (kill -9 of each stage kind, SIGSTOP, exceptions, a killed supervisor).
chaos: build
	@ctest --test-dir $(BUILD) --output-on-failure -R chaos_full

format:
	@git ls-files '*.h' '*.cpp' '*.cu' | xargs clang-format -i

format-check:
	@bash scripts/check-format.sh

bench: build
	@$(BUILD)/bin/bench_pipeline_overhead
	@$(BUILD)/bin/bench_optimizer
	@$(BUILD)/bin/bench_prepare
	@$(BUILD)/bin/bench_data_loader

bench-failure: build
	@.venv/bin/python bench/failure_detection.py

clean:
	rm -rf $(BUILD) $(BUILD_SAN) $(BUILD).configure.log $(BUILD_SAN).configure.log
