#!/usr/bin/env bash
# Runs every libFuzzer target of a fuzz build for RUNS executions each, starting from the
# committed seeds (fuzz/corpus/NAME, never modified; new inputs go to the build folder).
# Prints one line per target and a last line
#   fuzz: targets=N runs=R crashes=C
# and fails at the first finding (crash, sanitizer report, leak, timeout, out-of-memory),
# whose input is kept under BUILD/fuzz-artifacts/.
#
#   scripts/fuzz.sh BUILD RUNS     (FUZZ_TARGETS="gguf trace": only those)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "$1" && pwd)
runs=$2
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
mkdir -p "$build/fuzz-artifacts" "$build/fuzz-logs"
total=0 n=0
for seeds in "$root"/fuzz/corpus/*/; do
  name=$(basename "$seeds")
  # FUZZ_TARGETS="gguf trace": only those.
  if [ -n "${FUZZ_TARGETS:-}" ] && [[ " $FUZZ_TARGETS " != *" $name "* ]]; then
    continue
  fi
  bin="$build/bin/fuzz_$name"
  [ -x "$bin" ] || { echo "fuzz: no target $bin for seeds $seeds" >&2; exit 1; }
  work="$build/fuzz-corpus/$name"
  mkdir -p "$work"
  log="$build/fuzz-logs/$name.log"
  t0=$(date +%s.%N)
  if ! "$bin" -runs="$runs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 -print_final_stats=1 \
       -artifact_prefix="$build/fuzz-artifacts/$name-" "$work" "$seeds" >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "fuzz: fuzz_$name found a problem; input under $build/fuzz-artifacts/, log $log" >&2
    exit 1
  fi
  t1=$(date +%s.%N)
  done_runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  printf 'fuzz_%-16s runs=%s seconds=%.0f coverage=%s corpus=%s\n' "$name" "$done_runs" \
    "$(awk "BEGIN { print $t1 - $t0 }")" "${cov:-?}" "$(ls "$work" | wc -l)"
  total=$((total + done_runs))
  n=$((n + 1))
done
echo "fuzz: targets=$n runs=$total crashes=0"
