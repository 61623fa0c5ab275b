#!/usr/bin/env bash
# Fault injection (docs/reliability.md), on a small synthesized model:
#  1. kill: collect, eval, corpus and run are each killed with SIGKILL at KILLS random
#     moments of an uninterrupted run's duration, then run again (collect with --resume
#     when it left a checkpoint, run as is: it resumes by itself). After every kill, each
#     file under its final name must be whole (JSON parses, a trace verifies, anything
#     else equals the uninterrupted run's); after the rerun, every output must equal the
#     uninterrupted run's (JSON compared without its timings).
#  2. disk full: every writer runs under a file-size limit smaller than its output: it
#     must fail, naming the file, leave nothing under the final name, and its inputs
#     must be unchanged.
#  3. races: two processes write the same output at once: the result is one whole output.
#  4. signals (where this machine lets moeprune make memory cgroups): measure, and a run
#     while it measures and while it verifies, are sent INT, TERM and HUP at a moment
#     their worker decodes; each must die of the signal and leave no cgroup, no worker
#     or llama-bench child, no scratch folder and no half-written output (docs/measure.md).
# The last line is
#   faults: kills=K reruns=R disk_full=D races=N signals=S losses=L
# and the script fails unless L = 0.
#
#   scripts/faults.sh [WORK_DIR]   (default build/faults; KILLS=20)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
make -s -C "$root" build >/dev/null
M=$root/build/bin/moeprune
work=${1:-$root/build/faults}
kills=${KILLS:-20}
rm -rf "$work"
mkdir -p "$work"
cd "$work"
RANDOM=16  # the same moments every run

losses=0
loss() { echo "LOSS: $*" >&2; losses=$((losses + 1)); }

# --- inputs: a planted model and three small sources ---------------------------------
"$M" synth --arch qwen3moe --layers 3 --experts 12 --used 2 --dead 2 --specialists -o m.gguf >/dev/null
python3 - <<'PY'
import os, random
random.seed(1)
syll = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "xe", "zi", "pu"]
for d in ("prose", "code", "zh"):
    os.makedirs(f"src/{d}", exist_ok=True)
for i in range(24):
    prose = " ".join(random.choice(syll) + random.choice(syll) for _ in range(120))
    code = "".join(f"int {random.choice(syll)}{l}(int x) {{ return x * {random.randrange(100)}; }}\n" for l in range(12))
    zh = "".join(chr(0x4E00 + random.randrange(1500)) for _ in range(80))
    open(f"src/prose/p{i}.md", "w").write(prose + "\n")
    open(f"src/code/c{i}.cpp", "w").write(code)
    open(f"src/zh/z{i}.txt", "w").write(zh + "\n")
open("corpus.toml", "w").write('[corpus]\nseed = 2\n[[source]]\npath = "src/prose"\ndomain = "prose"\n'
                               '[[source]]\npath = "src/code"\ndomain = "code"\n[[source]]\npath = "src/zh"\ndomain = "zh"\n')
PY
"$M" corpus -m m.gguf --manifest corpus.toml -o data >/dev/null
"$M" collect -m m.gguf -f data/calib.jsonl -c 128 -t 2 -o stats.json --trace t.mptrace >/dev/null
"$M" select --stats stats.json -k 8 --metric reap -o maps >/dev/null
keep=$(ls maps/*.json | head -1)

# Canonical JSON without timings, for comparing runs.
canon() {
  python3 - "$1" <<'PY'
import json, sys
# Timings are measurements (a resumed collect times only what it evaluated), and a
# run's stage manifests hold digests of JSON outputs, which hold timings themselves.
manifest = sys.argv[1].endswith("stage.json")
def strip(x):
    if isinstance(x, dict):
        return {k: ("json digest" if manifest and k.endswith(".json") else strip(v))
                for k, v in x.items() if k not in ("seconds", "tok_per_s", "timing")}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x
print(json.dumps(strip(json.load(open(sys.argv[1]))), sort_keys=True))
PY
}
same_file() {  # same_file FILE REF
  case "$1" in
    *.json) [ "$(canon "$1")" = "$(canon "$2")" ] ;;
    *) cmp -s "$1" "$2" ;;
  esac
}
checkpoint() {  # a collect checkpoint says so inside
  python3 -c "import json,sys; p=json.load(open(sys.argv[1])).get('settings',{}).get('progress'); sys.exit(0 if isinstance(p,dict) and not p.get('complete',False) else 1)" "$1" 2>/dev/null
}
corpus_set_whole() {  # corpus_set_whole DIR: corpus.json describes the calib and eval beside it
  python3 - "$1" <<'PY' 2>/dev/null
import json, os, sys
d = sys.argv[1]
r = json.load(open(os.path.join(d, "corpus.json")))
for side in ("calib", "eval"):
    o = r["outputs"][side]
    b = open(os.path.join(d, side + ".jsonl"), "rb").read()
    if len(b) != o["bytes"] or b.count(b"\n") != o["documents"]:
        sys.exit(1)
PY
}
finals() { find "$1" -type f ! -name '*.partial.*' | sed "s|^$1/||" | sort; }
now() { date +%s.%N; }

# --- 1. kill at random moments, then run again ---------------------------------------
n_kills=0 n_reruns=0
kill_loop() {  # kill_loop NAME OUTDIR -- COMMAND... (writes under OUTDIR)
  local name=$1 out=$2
  shift 3
  rm -rf "$out" "ref-$name"
  mkdir -p "$out"
  local t0 t1
  t0=$(now)
  "$@" >/dev/null 2>&1 || { echo "$name: the uninterrupted run failed" >&2; exit 1; }
  t1=$(now)
  mv "$out" "ref-$name"
  local duration
  duration=$(awk "BEGIN { print $t1 - $t0 }")
  for i in $(seq 1 "$kills"); do
    rm -rf "$out"
    mkdir -p "$out"
    local at
    at=$(awk -v d="$duration" -v r="$RANDOM" 'BEGIN { printf "%.3f", d * r / 32768 }')
    "$@" >/dev/null 2>&1 &
    local pid=$!
    sleep "$at"
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    n_kills=$((n_kills + 1))
    # Whatever is under a final name now must be whole.
    if [ -d "$out" ]; then
      for f in $(finals "$out"); do
        local p="$out/$f" r="ref-$name/$f"
        case "$f" in
          *.json)
            python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$p" 2>/dev/null || loss "$name kill $i at ${at}s: $f is not whole JSON"
            checkpoint "$p" && loss "$name kill $i at ${at}s: $f is a checkpoint under the statistics' own name"
            if [ -f "$r" ] && ! same_file "$p" "$r"; then
              loss "$name kill $i at ${at}s: $f differs from the uninterrupted run's"
            fi
            if [ "$(basename "$f")" = corpus.json ] && ! corpus_set_whole "$(dirname "$p")"; then
              loss "$name kill $i at ${at}s: $f does not describe the calib.jsonl and eval.jsonl beside it"
            fi ;;
          *.checkpoint)
            checkpoint "$p" || loss "$name kill $i at ${at}s: $f is not a collect checkpoint" ;;
          *.mptrace|*.trace)
            "$M" trace verify "$p" >/dev/null 2>&1 || loss "$name kill $i at ${at}s: $f does not verify" ;;
          *)
            if [ -f "$r" ] && ! cmp -s "$p" "$r"; then loss "$name kill $i at ${at}s: $f differs"; fi ;;
        esac
      done
    fi
    # Run again: collect resumes from its checkpoint when it left one.
    local again=("$@")
    if [ "$name" = collect ] && [ -f "$out/stats.json.checkpoint" ]; then
      again+=(--resume)
    fi
    if ! "${again[@]}" >"$name-rerun-$i.log" 2>&1; then
      loss "$name kill $i at ${at}s: the rerun failed: $(tail -1 "$name-rerun-$i.log")"
      continue
    fi
    n_reruns=$((n_reruns + 1))
    [ "$(finals "$out")" = "$(finals "ref-$name")" ] || loss "$name kill $i at ${at}s: other files than the uninterrupted run: $(diff <(finals "$out") <(finals "ref-$name") | tr '\n' ' ')"
    for f in $(finals "ref-$name"); do
      [ -f "$out/$f" ] && ! same_file "$out/$f" "ref-$name/$f" && loss "$name kill $i at ${at}s: $f differs after the rerun"
    done
    find "$out" -name '*.partial.*' -delete
  done
  echo "kill $name: $kills kills in ${duration}s runs"
}
kill_loop collect out-collect -- "$M" collect -m m.gguf -f data/calib.jsonl -c 64 -t 2 -o out-collect/stats.json \
  --trace out-collect/t.mptrace --save-every 1
kill_loop eval out-eval -- "$M" eval -m m.gguf -f data/eval.jsonl -c 64 -t 2 --keep "$keep" --json out-eval/eval.json \
  --base-out out-eval/base.mpkl --per-token out-eval/tokens.jsonl
kill_loop corpus out-corpus -- "$M" corpus -m m.gguf --manifest corpus.toml -o out-corpus
kill_loop run out-run -- "$M" run -m m.gguf --corpus corpus.toml -k 6,8 --criteria reap,freq --ram 0.2GB --reserve 0 \
  -c 64 -t 2 -o out-run

# --- 2. disk full -----------------------------------------------------------------------
n_full=0
inputs_sum() { cat m.gguf stats.json t.mptrace "$keep" data/calib.jsonl data/eval.jsonl | md5sum; }
before=$(inputs_sum)
full() {  # full NAME KIB FINAL -- COMMAND...: FINAL must not exist afterwards
  local name=$1 kib=$2 final=$3
  shift 4
  rm -rf "$final"
  local log="full-$name.log"
  # The limit applies to the command only: its messages go through a pipe, not a file.
  if sh -c 'ulimit -f "$0"; exec "$@"' "$kib" "$@" 2>&1 | cat >"$log"; then
    loss "disk full $name: succeeded under a ${kib} KiB file limit"
  else
    grep -q "$(basename "$final")" "$log" || loss "disk full $name: the error does not name the file: $(tail -1 "$log")"
    [ -e "$final" ] && ! { [ -d "$final" ] && [ -z "$(finals "$final")" ]; } && loss "disk full $name: $final exists"
  fi
  n_full=$((n_full + 1))
}
full synth 64 full.gguf -- "$M" synth --layers 2 --experts 8 --used 2 -o full.gguf
full slice 64 full-sliced.gguf -- "$M" slice -m m.gguf --keep "$keep" -o full-sliced.gguf
full collect 8 full-stats.json -- "$M" collect -m m.gguf -f data/calib.jsonl -c 64 -t 2 -o full-stats.json
full collect-trace 16 full.mptrace -- "$M" collect -m m.gguf -f data/calib.jsonl -c 64 -t 2 -o full2-stats.json --trace full.mptrace
full select 0 full-maps -- "$M" select --stats stats.json -k 8 --metric reap,freq -o full-maps
full eval 4 full-eval.json -- "$M" eval -m m.gguf -f data/eval.jsonl -c 64 -t 2 --keep "$keep" --json full-eval.json
full eval-base 16 full.mpkl -- "$M" eval -m m.gguf -f data/eval.jsonl -c 64 -t 2 --base-out full.mpkl
full replay 1 full-replay.json -- "$M" replay --trace t.mptrace --policy lru,lfu,ema,sieve --cache 4,6,8,10 --json full-replay.json
full corpus 16 full-corpus -- "$M" corpus -m m.gguf --manifest corpus.toml -o full-corpus
# corpus's outputs take their names together: under every limit, either a new whole set
# or the old set byte for byte (another seed, so the two differ).
"$M" corpus -m m.gguf --manifest corpus.toml --seed 7 -o corpus-old >/dev/null 2>&1
old_set=$(cat corpus-old/calib.jsonl corpus-old/eval.jsonl corpus-old/corpus.json | md5sum)
for kib in 1 4 8 12 16 19 24 32 48 64; do
  rm -rf corpus-limit && cp -r corpus-old corpus-limit
  if sh -c 'ulimit -f "$0"; exec "$@"' "$kib" "$M" corpus -m m.gguf --manifest corpus.toml -o corpus-limit >/dev/null 2>&1; then
    corpus_set_whole corpus-limit || loss "disk full corpus ${kib} KiB: a finished set that does not describe itself"
  else
    [ "$(cat corpus-limit/calib.jsonl corpus-limit/eval.jsonl corpus-limit/corpus.json | md5sum)" = "$old_set" ] ||
      loss "disk full corpus ${kib} KiB: the failed run changed the old set"
    [ -z "$(find corpus-limit -name '*.partial.*')" ] || loss "disk full corpus ${kib} KiB: temporary files left behind"
  fi
  n_full=$((n_full + 1))
done
full trace-export 2 full-npy -- "$M" trace export t.mptrace --npy full-npy
full replay-csv 1 full.csv -- "$M" replay --trace t.mptrace --policy lru,lfu,ema,sieve --cache 4,6,8,10 --csv full.csv
full eval-per-token 2 full-tokens.jsonl -- "$M" eval -m m.gguf -f data/eval.jsonl -c 64 -t 2 --keep "$keep" --per-token full-tokens.jsonl
full collect-imatrix 8 full.imatrix.gguf -- "$M" collect -m m.gguf -f data/calib.jsonl -c 64 -t 2 -o full3-stats.json --imatrix full.imatrix.gguf
full merge 1 full-merged.json -- "$M" merge stats.json out-collect/stats.json -o full-merged.json
"$M" replay --trace t.mptrace --policy lru --cache 4,8 --model m.gguf --json plan-replay.json >/dev/null
"$M" eval -m m.gguf -f data/eval.jsonl -c 64 -t 2 --keep "$keep" --json plan-eval.json >/dev/null
full plan 1 full-plan.json -- "$M" plan -m m.gguf --replay plan-replay.json --eval plan-eval.json --ram 1G --reserve 0 --json full-plan.json
[ "$(inputs_sum)" = "$before" ] || loss "disk full: an input changed"
echo "disk full: $n_full writers under a file-size limit"

# --- 3. two writers of one output -------------------------------------------------------
n_races=0
"$M" slice -m m.gguf --keep "$keep" -o race-ref.gguf >/dev/null
for i in 1 2 3; do
  rm -f race.gguf
  "$M" slice -m m.gguf --keep "$keep" -o race.gguf >/dev/null 2>&1 &
  a=$!
  "$M" slice -m m.gguf --keep "$keep" -o race.gguf >/dev/null 2>&1 &
  b=$!
  wait "$a" || true
  wait "$b" || true
  cmp -s race.gguf race-ref.gguf || loss "race $i: race.gguf is not one whole slice"
  n_races=$((n_races + 1))
done
echo "races: $n_races"

# --- 4. signals to measure, and to a run that measures or verifies --------------------------
n_signals=0
if "$M" measure --check >/dev/null 2>&1; then
  parent=$("$M" measure --check | sed 's/.* under //')
  sigdir=$work/signals
  mkdir -p "$sigdir/tmp"
  # A llama-bench that never ends, and whose child (named by exec -a) must die with it.
  printf '#!/bin/bash\nbash -c "exec -a moeprune-faults-bench sleep 1000" & wait\n' > "$sigdir/bench.sh"
  chmod +x "$sigdir/bench.sh"
  cgroups() { ls "$parent" | { grep '^moeprune-measure-' || true; } | sort; }
  # What a signalled process left: new cgroups, scratch folders, workers, llama-bench
  # children, partial outputs.
  left_after() {  # left_after CGROUPS_BEFORE DIR
    echo "cgroups=$(comm -13 <(echo "$1") <(cgroups) | grep -c .)" \
         "scratch=$(ls "$sigdir/tmp" | grep -c '^moeprune-measure-')" \
         "workers=$(pgrep -fc "measure-worker $sigdir/tmp/")" "bench=$(pgrep -fc '[m]oeprune-faults-bench')" \
         "partial=$(find "$2" -name '*.partial.*' | grep -c .)"
  }
  clean="cgroups=0 scratch=0 workers=0 bench=0 partial=0"
  worker_runs() { pgrep -f "measure-worker $sigdir/tmp/" >/dev/null; }
  bench_runs() { pgrep -f '[m]oeprune-faults-bench' >/dev/null; }
  signal_one() {  # signal_one NAME SIGNAL READY LOG DIR -- COMMAND...: signal COMMAND once the command READY succeeds
    local name=$1 sig=$2 ready=$3 log=$4 dir=$5
    shift 6
    local before
    before=$(cgroups)
    TMPDIR=$sigdir/tmp "$@" >"$log" 2>&1 &
    local pid=$!
    for _ in $(seq 600); do
      eval "$ready" && break
      sleep 0.05
    done
    kill "-$sig" "$pid" 2>/dev/null || loss "$name: it ended before the signal (was it ever ready?)"
    local rc=0
    wait "$pid" || rc=$?
    sleep 0.5
    local expect=$((128 + $(kill -l "$sig")))
    [ "$rc" -eq "$expect" ] || loss "$name: exit $rc after SIG$sig, not $expect"
    local left
    left=$(left_after "$before" "$dir")
    [ "$left" = "$clean" ] || loss "$name: SIG$sig left $left"
    n_signals=$((n_signals + 1))
  }
  for sig in INT TERM HUP; do
    signal_one "measure" "$sig" worker_runs "$sigdir/measure.log" "$sigdir" -- "$M" measure -m m.gguf -f data/eval.jsonl \
      --warmup 0 --tokens 300 --probe-mib 1 --json "$sigdir/m.json" --trace "$sigdir/m.mptrace"
    [ ! -e "$sigdir/m.json" ] || loss "measure: SIG$sig left m.json under its final name"
    signal_one "measure in llama-bench" "$sig" bench_runs "$sigdir/bench.log" "$sigdir" -- "$M" measure -m m.gguf \
      -f data/eval.jsonl --warmup 0 --tokens 16 --probe-mib 1 --llama-bench "$sigdir/bench.sh" --json "$sigdir/b.json"
  done
  # A finished measured run, then each of its measuring stages again, signalled.
  run_args=(run -m m.gguf --corpus corpus.toml -k 8 --criteria reap --ram 0.3GB -c 128 -t 2 --measure 75% \
            --measure-tokens 200 --verify -o "$sigdir/run")
  TMPDIR=$sigdir/tmp "$M" "${run_args[@]}" >/dev/null 2>&1 || loss "signals: the measured run failed"
  for stage in measure verify; do
    for sig in INT TERM HUP; do
      signal_one "run --from $stage" "$sig" "grep -qE '$stage +running' $sigdir/run.log 2>/dev/null && worker_runs" \
        "$sigdir/run.log" "$sigdir/run" -- \
        "$M" "${run_args[@]}" --from "$stage"
      for out in "$sigdir/run/$stage"/*.json; do
        [ ! -e "$out" ] || [ -e "$sigdir/run/$stage/stage.json" ] || loss "run --from $stage: SIG$sig left $out without stage.json"
      done
    done
  done
  echo "signals: $n_signals signalled runs"
else
  echo "signals: skipped ($("$M" measure --check 2>&1 | head -c 200))"
fi

echo "faults: kills=$n_kills reruns=$n_reruns disk_full=$n_full races=$n_races signals=$n_signals losses=$losses"
[ "$losses" -eq 0 ]
