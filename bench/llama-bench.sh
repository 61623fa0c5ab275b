#!/usr/bin/env bash
# measure's tokens/s against llama.cpp's own llama-bench, run under the same memory-cgroup
# limits on the same model (issue 29): the check that what measure reports is llama.cpp's
# decode and not something of moeprune's making.
#
#   bench/llama-bench.sh [WORK_DIR] [TOKENS]   (default build/bench-stream, 32 tokens)
#
# The model of bench/stream.sh (8 layers x 64 experts of 3.2 MiB q8_0, 2 GiB), resident
# and under 25%, 50% and 100% of its expert bytes. For every limit `moeprune measure
# --llama-bench` runs llama-bench's text generation (-p 0 -n TOKENS -r 3) in a fresh cgroup
# of the same limit after dropping the model's pages, right before and right after its own
# run; llama-bench's repetitions after the first (which starts cold, as measure's warm-up
# does), averaged over both, are compared with measure's timed tokens. Both load the model with llama.cpp's defaults (mmap, repacking allowed: q8_0 is
# not repacked on x86). llama-bench decodes random tokens, measure the repository's docs.
# Needs root or a delegated memory cgroup; about 10 minutes here.
# Last line: llama-bench: points=N median_diff=M max_diff=E
#   diff = |measure - llama-bench| / llama-bench tokens/s (target: E <= 0.10)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
make -s -C "$root" build peers >/dev/null
bin=$root/build/bin
work=${1:-$root/build/bench-stream}
tokens=${2:-32}
mkdir -p "$work"
model=$work/stream.gguf
[ -f "$model" ] || "$bin/moeprune" synth --layers 8 --experts 64 --used 4 --embd 1024 --ff 1024 --type q8_0 \
    --seed 7 -o "$model" >/dev/null
cat "$root"/README.md "$root"/docs/*.md > "$work/text.txt"
"$bin/moeprune" measure -m "$model" -f "$work/text.txt" --ram 25%,50%,100% --tokens "$tokens" --probe-mib 0 \
    --llama-bench "$bin/llama-bench" --json "$work/llama-bench.json"
python3 - "$work/llama-bench.json" <<'PY'
import json, statistics, sys
m = json.load(open(sys.argv[1]))
diffs = [r["llama_bench"]["difference"] for r in [m["resident"]] + m["runs"]]
print(f"llama-bench: points={len(diffs)} median_diff={statistics.median(diffs):.3f} max_diff={max(diffs):.3f}")
PY
