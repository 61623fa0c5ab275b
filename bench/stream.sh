#!/usr/bin/env bash
# The plan's streaming prediction against llama.cpp really streaming a model larger
# than its memory (issue 29).
#
#   bench/stream.sh [WORK_DIR] [TOKENS] [REPEATS]   (default build/bench-stream, 64 tokens, 3 repeats)
#
# A synthesized qwen3moe (8 layers x 64 experts of 3.2 MiB q8_0: 1.6 GiB of routed
# experts, 2 GiB in all) decoded by `moeprune measure` on this repository's docs under
# memory-cgroup limits of what stays resident plus 25, 50, 75 and 100% of the expert
# bytes (llama.cpp's --no-repack: q8_0 is not repacked on x86 anyway). Each limit's
# tokens/s is predicted from the resident run, the storage probe and the trace alone.
# As root, every limit is measured at the device's read-ahead and at 128 KB (measure
# --read-ahead-kb puts the device's back); otherwise at the device's alone. Every limit,
# and the resident decode the predictions start from, is measured REPEATS times, the rounds
# interleaved, and kept at its median (measure --repeats): on this machine one round's
# figures drifted 6-28% from the next's, more than the predictor's own error.
# Needs root or a delegated memory cgroup; about 12 minutes here.
# Last line (over every limit and read-ahead): stream: points=N median_err=M max_err=E
#   err = |predicted - measured| / measured tokens/s (targets: M <= 0.10, E <= 0.25)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
make -s -C "$root" build >/dev/null
bin=$root/build/bin
work=${1:-$root/build/bench-stream}
tokens=${2:-64}
repeats=${3:-3}
mkdir -p "$work"
model=$work/stream.gguf
[ -f "$model" ] || "$bin/moeprune" synth --layers 8 --experts 64 --used 4 --embd 1024 --ff 1024 --type q8_0 \
    --seed 7 -o "$model" >/dev/null
cat "$root"/README.md "$root"/docs/*.md > "$work/text.txt"
read_ahead=()
source=$(findmnt -no SOURCE -T "$work" 2>/dev/null || true)
disk=$(lsblk -no PKNAME "$source" 2>/dev/null | head -1 || true)
disk=${disk:-$(basename "${source:-none}")}
if [ "$(id -u)" = 0 ] && [ -r "/sys/block/$disk/queue/read_ahead_kb" ]; then
  read_ahead=(--read-ahead-kb "$(cat "/sys/block/$disk/queue/read_ahead_kb"),128")
else
  echo "stream: not root, or no block device under $work: measured at the device's read-ahead alone" >&2
fi
"$bin/moeprune" measure -m "$model" -f "$work/text.txt" --ram 25%,50%,75%,100% --tokens "$tokens" --repeats "$repeats" --no-repack \
    "${read_ahead[@]}" --json "$work/measure.json" --trace "$work/measure.mptrace"
python3 - "$work/measure.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
points = [r for r in m["runs"] if r["error"] is not None]
print(f"stream: points={len(points)} median_err={m['median_error']:.3f} max_err={m['max_error']:.3f}")
PY
