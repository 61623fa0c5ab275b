# The front door: every target is idempotent and incremental.
#   make build   install missing Debian packages, fetch the pinned llama.cpp, configure, build moeprune
#   make demo    build, then run the whole job (moeprune run) on the default model and a corpus from this machine
#   make peers   llama.cpp's tools the tests and benches run beside moeprune (llama-perplexity, ...)
#   make check   the daily loop: the unit and model tiers, plain, in build/ (minutes)
#   make test    the whole suite (CI): every tier under ASan+UBSan, fuzz smoke
#   make fuzz    every fuzz target for FUZZ_RUNS executions (docs/reliability.md)
#   make faults  kill/resume, disk-full and race checks of every writer (docs/reliability.md)
#   make archs   the architecture matrix alone, then docs/architectures.md from its results
#   make bench   every bench script, side by side with its peer; last lines as in docs/benchmarks.md
BUILD_DIR  ?= build
# The instrumented build (make test, make fuzz): moeprune under ASan+UBSan+libFuzzer coverage.
CHECK_DIR  ?= build-check
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
# One compiler for every build folder, so llama.cpp (uninstrumented in all of them) is
# compiled once and the second folder takes its objects from ccache; clang, because the
# fuzz targets need libFuzzer. `make build CC=gcc CXX=g++` works for the plain build.
ifeq ($(origin CC),default)
CC  := clang
endif
ifeq ($(origin CXX),default)
CXX := clang++
endif
export CC CXX
export ASAN_OPTIONS ?= detect_leaks=1:abort_on_error=1
export LSAN_OPTIONS ?= suppressions=$(CURDIR)/tests/lsan.supp
export UBSAN_OPTIONS ?= print_stacktrace=1:halt_on_error=1
DEMO_DIR   ?= demo
FUZZ_RUNS  ?= 1000000
FUZZ_SMOKE_RUNS ?= 10000
CTEST_ARGS ?=

.PHONY: archs build check check-build deps llama configure configure-check demo peers test fuzz fuzz-seeds faults bench clean

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target moeprune

deps:
	@bash scripts/install-deps.sh

llama: deps
	@if ! echo "$(CMAKE_ARGS)" | grep -q MOEPRUNE_LLAMA_DIR; then bash scripts/fetch-llama.sh third_party/llama.cpp; fi
	@bash scripts/fetch-vega.sh third_party/vega

configure: llama
	@if [ ! -f $(BUILD_DIR)/CMakeCache.txt ]; then \
	  cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS); \
	fi

configure-check: llama
	@if [ ! -f $(CHECK_DIR)/CMakeCache.txt ]; then \
	  cmake -S . -B $(CHECK_DIR) -DCMAKE_BUILD_TYPE=Release -DMOEPRUNE_SANITIZE=address,undefined -DMOEPRUNE_FUZZ=ON \
	    $(CMAKE_ARGS); \
	fi

# The demo prints the llama-completion command that runs its recommendation: built beside moeprune.
demo: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target moeprune llama-completion
	@bash scripts/demo.sh $(BUILD_DIR) $(DEMO_DIR)

peers: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target llama-peers

check-build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target moeprune llama-peers moeprune_tests

check: check-build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) -L 'unit|model' $(CTEST_ARGS)

# Each phase timed, then the slowest tests (scripts/test.sh, docs/reliability.md).
test: configure-check
	@bash scripts/test.sh $(CHECK_DIR) $(JOBS) $(FUZZ_SMOKE_RUNS)

fuzz: configure-check
	cmake --build $(CHECK_DIR) -j $(JOBS) --target fuzz-targets
	@bash scripts/fuzz.sh $(CHECK_DIR) $(FUZZ_RUNS)

# SIGKILL at random moments then rerun, disk full for every writer, two writers of one output.
faults: build
	@bash scripts/faults.sh

# Every MoE architecture of the pinned llama.cpp through synth, collect, slice and eval.
archs: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target moeprune llama-peers moeprune_arch_tests
	rm -rf $(BUILD_DIR)/arch-results
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) -L arch; status=$$?; cd $(CURDIR) && \
	  python3 scripts/arch-table.py $(BUILD_DIR)/arch-results docs/architectures.md && exit $$status

# Every benchmark (bench/*.sh), one after another; BENCH_SKIP="scale" leaves the longest out.
bench: build
	@bash bench/all.sh

# Rewrites the committed seeds (fuzz/corpus/) from moeprune's own writers.
fuzz-seeds: check-build
	MOEPRUNE_FUZZ_SEEDS=$(CURDIR)/fuzz/corpus $(BUILD_DIR)/bin/moeprune_tests --gtest_also_run_disabled_tests \
	  --gtest_filter=FuzzSeeds.DISABLED_Write

clean:
	rm -rf $(BUILD_DIR) $(DEMO_DIR) $(CHECK_DIR)
