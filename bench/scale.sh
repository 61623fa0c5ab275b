#!/usr/bin/env bash
# The seed pipeline's geometry through every stage, and a seed-scale trace replayed in
# bounded memory (docs/reliability.md). Each stage's wall time and peak RSS are printed.
#
#   bench/scale.sh [WORK_DIR]   (default: build/bench-scale; TOKENS, default 1000000)
#
# Last line: scale: stages=N stage_max_rss_mib=M replay_tokens=T replay_trace_gib=G replay_rss_mib=R
#   M = the largest peak RSS of synth, collect, select, slice, eval and replay on the
#       48-layer, 512-expert, top-10 model (collect: >= 10,000 tokens, trace top-64)
#   R = peak RSS of replaying a trace of T tokens x 48 layers x top-64 (G GiB on disk)
#       through four configurations. Target: R <= 2048.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
make -s -C "$root" build >/dev/null
bin=$root/build/bin
work=${1:-$root/build/bench-scale}
tokens=${TOKENS:-1000000}
mkdir -p "$work"
cd "$work"

max_rss=0 stages=0
stage() {  # stage NAME COMMAND...: runs it under /usr/bin/time, prints seconds and peak RSS
  local name=$1
  shift
  /usr/bin/time -f "%e %M" -o "$name.time" "$@" >"$name.log" 2>&1 || { echo "$name failed, see $work/$name.log" >&2; exit 1; }
  local s kb
  read -r s kb <"$name.time"
  echo "$name: ${s} s, peak RSS $((kb / 1024)) MiB"
  last_rss=$((kb / 1024))
  stages=$((stages + 1))
  [ "$last_rss" -gt "$max_rss" ] && max_rss=$last_rss
  return 0
}

python3 - <<'PY'
import random
random.seed(5)
words = ["expert", "cache", "router", "token", "layer", "stream", "disk", "prune", "keep", "map"]
with open("calib.txt", "w") as f:
    for i in range(450):
        f.write(" ".join(random.choice(words) for _ in range(10)) + f" {i}.\n")
        f.write(f"def f{i}(x): return x * {i} + {random.randrange(100)}\n")
with open("eval.txt", "w") as f:
    for i in range(200):
        f.write(" ".join(random.choice(words) for _ in range(12)) + ".\n")
PY
stage synth "$bin/moeprune" synth --arch qwen4exp --layers 48 --experts 512 --used 10 --embd 64 --ff 32 --type q8_0 \
  -o seed.gguf
stage collect "$bin/moeprune" collect -m seed.gguf -f calib.txt -c 512 -o stats.json --trace t.mptrace --trace-top 64
collected=$(sed -n 's/.* windows, \([0-9]*\) tokens.*/\1/p' collect.log | tail -1)
echo "collect: ${collected} tokens"
[ "${collected:-0}" -ge 10000 ] || { echo "collect covered fewer than 10,000 tokens" >&2; exit 1; }
stage select "$bin/moeprune" select --stats stats.json -k 256 --metric reap,freq -o maps
stage slice "$bin/moeprune" slice -m seed.gguf --keep maps/reap-k256.json -o pruned.gguf
stage eval "$bin/moeprune" eval -m seed.gguf -f eval.txt --keep maps/reap-k256.json --candidate pruned.gguf -c 256 \
  --json eval.json
stage replay "$bin/moeprune" replay --trace t.mptrace --policy lru,lfu,ema,sieve --cache 64,128 --model seed.gguf
stage_max=$max_rss

# A seed-scale trace: TOKENS tokens x 48 layers x top-64 in the seed's Q4RT layout (a
# repeated random block: what is measured is memory, not hit rates).
if [ ! -f big.q4rt ] || [ "$(stat -c %s big.q4rt)" -ne $((16 + tokens * 48 * 64 * 4)) ]; then
  python3 - "$tokens" <<'PY'
import random, struct, sys
tokens, layers, experts, m = int(sys.argv[1]), 48, 512, 64
random.seed(7)
block_tokens = 1000
rows = bytearray()
for t in range(block_tokens):
    for l in range(layers):
        ids = random.sample(range(experts), m)
        rows += struct.pack(f"<{m}H", *ids)
        rows += struct.pack(f"<{m}e", *[8.0 - 0.125 * i for i in range(m)])
with open("big.q4rt", "wb") as f:
    f.write(b"Q4RT" + struct.pack("<HHHHI", 1, layers, experts, m, tokens))
    left = tokens
    while left > 0:
        n = min(left, block_tokens)
        f.write(rows[: n * layers * m * 4])
        left -= n
PY
fi
stage replay-big "$bin/moeprune" replay --trace big.q4rt --policy lru,ema --cache 64,128 --k 10
gib=$(awk -v b="$(stat -c %s big.q4rt)" 'BEGIN { printf "%.1f", b / 1073741824 }')
echo "scale: stages=$stages stage_max_rss_mib=$stage_max replay_tokens=$tokens replay_trace_gib=$gib replay_rss_mib=$last_rss"
