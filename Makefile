# The front door: every target is idempotent and incremental.
#   make build   install missing Debian packages, fetch the pinned llama.cpp, configure, build
#   make demo    build, then run the whole job (moeprune run) on the default model and a corpus from this machine
#   make test    build, then run the whole test suite, plain and under ASan+UBSan, and a fuzz smoke
#   make fuzz    every fuzz target for FUZZ_RUNS executions (docs/reliability.md)
#   make faults  kill/resume, disk-full and race checks of every writer (docs/reliability.md)
#   make archs   the architecture matrix alone, then docs/architectures.md from its results
#   make bench   every bench script, side by side with its peer; last lines as in docs/benchmarks.md
BUILD_DIR  ?= build
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
# make test SANITIZE=address,undefined: moeprune's code instrumented, in its own build folder.
SANITIZE   ?=
ifneq ($(SANITIZE),)
BUILD_DIR  := build-sanitize
CMAKE_ARGS += -DMOEPRUNE_SANITIZE=$(SANITIZE)
export ASAN_OPTIONS ?= detect_leaks=1:abort_on_error=1
export LSAN_OPTIONS ?= suppressions=$(CURDIR)/tests/lsan.supp
export UBSAN_OPTIONS ?= print_stacktrace=1:halt_on_error=1
# The architecture matrix and the realism tier run in the plain pass only: they are llama.cpp's graphs, 54 times, and its decode of the trained model.
CTEST_ARGS += -LE 'arch|realism'
endif
DEMO_DIR   ?= demo
# make fuzz: every libFuzzer target (fuzz/) for FUZZ_RUNS executions, in build-fuzz/ (clang).
FUZZ_DIR   ?= build-fuzz
FUZZ_RUNS  ?= 1000000
FUZZ_SMOKE_RUNS ?= 20000

CTEST_ARGS ?=
.PHONY: archs build deps llama configure demo test fuzz fuzz-build fuzz-seeds faults bench clean

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target moeprune llama-peers moeprune_tests moeprune_arch_tests moeprune_realism_tests

deps:
	@bash scripts/install-deps.sh

llama: deps
	@if ! echo "$(CMAKE_ARGS)" | grep -q MOEPRUNE_LLAMA_DIR; then bash scripts/fetch-llama.sh third_party/llama.cpp; fi
	@bash scripts/fetch-vega.sh third_party/vega

configure: llama
	@if [ ! -f $(BUILD_DIR)/CMakeCache.txt ]; then \
	  cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS); \
	fi

demo: build
	@bash scripts/demo.sh $(BUILD_DIR) $(DEMO_DIR)

# The whole suite, then the same suite again with moeprune's code under AddressSanitizer
# and UndefinedBehaviorSanitizer (build-sanitize/); any report fails it.
test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS)
ifeq ($(SANITIZE),)
	$(MAKE) test SANITIZE=address,undefined
	$(MAKE) fuzz FUZZ_RUNS=$(FUZZ_SMOKE_RUNS)
endif

# The fuzz targets, built with clang, libFuzzer and ASan+UBSan over moeprune and llama.cpp
# alike; a finding stops the run with its input under $(FUZZ_DIR)/fuzz-artifacts/.
fuzz-build: llama
	@if [ ! -f $(FUZZ_DIR)/CMakeCache.txt ]; then \
	  CC=clang CXX=clang++ cmake -S . -B $(FUZZ_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEPRUNE_FUZZ=ON \
	    -DMOEPRUNE_BUILD_TESTS=OFF; \
	fi
	cmake --build $(FUZZ_DIR) -j $(JOBS) --target fuzz-targets

fuzz: fuzz-build
	@bash scripts/fuzz.sh $(FUZZ_DIR) $(FUZZ_RUNS)

# SIGKILL at random moments then rerun, disk full for every writer, two writers of one output.
faults: build
	@bash scripts/faults.sh

# Every MoE architecture of the pinned llama.cpp through synth, collect, slice and eval.
archs: build
	rm -rf $(BUILD_DIR)/arch-results
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) -L arch; status=$$?; cd $(CURDIR) && \
	  python3 scripts/arch-table.py $(BUILD_DIR)/arch-results docs/architectures.md && exit $$status

# Every benchmark (bench/*.sh), one after another; BENCH_SKIP="scale" leaves the longest out.
bench: build
	@bash bench/all.sh

# Rewrites the committed seeds (fuzz/corpus/) from moeprune's own writers.
fuzz-seeds: build
	MOEPRUNE_FUZZ_SEEDS=$(CURDIR)/fuzz/corpus $(BUILD_DIR)/bin/moeprune_tests --gtest_also_run_disabled_tests \
	  --gtest_filter=FuzzSeeds.DISABLED_Write

clean:
	rm -rf $(BUILD_DIR) $(DEMO_DIR) $(FUZZ_DIR)
