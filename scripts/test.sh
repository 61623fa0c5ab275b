#!/usr/bin/env bash
# make test: the whole suite, each assertion once (docs/reliability.md, "What runs where").
#   1. the check build (CHECK): moeprune's code under ASan+UBSan and libFuzzer coverage,
#      llama.cpp uninstrumented, the peers, the test executables and the fuzz targets;
#   2. every tier (unit, model, matrix, e2e, arch, realism) under the sanitizers, in one
#      ctest run, so the longest tests start first beside the rest;
#   3. every fuzz target for SMOKE_RUNS executions from the committed seeds.
# moeprune's code is compiled once: a plain build of it beside the check build was a
# third of a cold run (docs/reliability.md), for tests that ran as well sanitized.
# Prints the wall time of every phase and the 20 slowest tests, and fails at the first
# failing phase (after printing what ran).
#
#   scripts/test.sh CHECK JOBS SMOKE_RUNS
set -euo pipefail
check=$1 jobs=$2 smoke_runs=$3
phases=() seconds=()
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

summary() {
  echo
  echo "== make test: wall time per phase"
  local total=0
  for i in "${!phases[@]}"; do
    printf '%-44s %6ds\n' "${phases[$i]}" "${seconds[$i]}"
    total=$((total + seconds[i]))
  done
  printf '%-44s %6ds\n' "total" "$total"
  if ls "$logs"/*.ctest >/dev/null 2>&1; then
    echo "== the 20 slowest tests"
    # ctest's lines: "  1/142 Test  #12: Suite.Name ....   Passed   12.34 sec"
    cat "$logs"/*.ctest | sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) .* \([0-9.]*\) sec$/\2 \1/p' |
      sort -rn | awk 'NR <= 20 { printf "%8.1fs  %s\n", $1, $2 }'  # awk reads it all: no SIGPIPE under pipefail
  fi
}

phase() {
  local name=$1 start status
  shift
  echo "== $name"
  start=$(date +%s)
  set +e
  "$@"
  status=$?
  set -e
  phases+=("$name")
  seconds+=($(($(date +%s) - start)))
  if [ $status -ne 0 ]; then
    summary
    echo "make test: '$name' failed" >&2
    exit $status
  fi
}

run_ctest() {
  local dir=$1 log=$2
  shift 2
  (cd "$dir" && ctest --output-on-failure -j "$jobs" "$@") | tee "$logs/$log.ctest"
  return "${PIPESTATUS[0]}"
}

phase "build: ASan+UBSan+fuzz ($check)" cmake --build "$check" -j "$jobs" \
  --target moeprune llama-peers moeprune_tests moeprune_arch_tests moeprune_realism_tests fuzz-targets
phase "tests: every tier under ASan+UBSan" run_ctest "$check" check -L 'unit|model|matrix|e2e|arch|realism'
phase "fuzz smoke: $smoke_runs runs per target" bash "$(dirname "$0")/fuzz.sh" "$check" "$smoke_runs"
summary
