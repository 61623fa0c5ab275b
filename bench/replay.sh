#!/usr/bin/env bash
# Replay speed and memory.
#
#   bench/replay.sh [WORK_DIR] [TOKENS]   (default build/bench-replay, 16384 tokens)
#
# 1. A trace shaped like the seed pipeline's sweep (48 layers, 512 experts, top-64,
#    k = 10): the engine runs a 120-configuration sweep (5 policies x 24 cache sizes)
#    on one thread, then the reference of the tests runs the same configurations one
#    by one; the miss counts must agree.
# 2. A 1M-token trace (8 layers) replayed by `moeprune replay`: peak RSS against the
#    file size.
# 3. Every policy against LRU where users run them: a global cache over a seed-geometry
#    trace and a storage-style trace of ~49k objects (one thread each).
# Second-to-last line: replay-policies: slowest=P ratio_to_lru=R (R <= 3 is the target).
# Last line: replay: speedup=S mreq_per_s=R
#   S = reference time / engine time, R = million expert requests per second per core.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
make -s -C "$root" build >/dev/null
cmake --build "$root/build" --target moeprune_bench_replay >/dev/null
bin=$root/build/bin
work=${1:-$root/build/bench-replay}
tokens=${2:-16384}
mkdir -p "$work"

big=$work/million.trace
[ -f "$big" ] || "$bin/moeprune_bench_replay" write-trace "$big" 1000000 8
/usr/bin/time -v -o "$work/million.time" "$bin/moeprune" replay --trace "$big" --policy lru,sieve --cache 32,128 --k 10 >/dev/null
rss_kib=$(grep "Maximum resident set size" "$work/million.time" | awk '{print $NF}')
size=$(stat -c %s "$big")
awk -v r="$rss_kib" -v s="$size" 'BEGIN { printf "1M-token trace: %.0f MiB on disk, replay peak RSS %.0f MiB (%.1f%% of the file)\n", s / 1048576, r / 1024, 100 * r * 1024 / s }'

"$bin/moeprune_bench_replay" policies "$work" > "$work/policies.log"
head -n -1 "$work/policies.log"
sweep=$("$bin/moeprune_bench_replay" sweep "$work" "$tokens")
echo "$sweep" | head -n -1
tail -n 1 "$work/policies.log"
echo "$sweep" | tail -n 1
