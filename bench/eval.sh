#!/usr/bin/env bash
# eval against llama-perplexity's KL divergence on the same model, text, window,
# threads and scoring (second half of each window, llama-perplexity's convention),
# side by side in one run, best of 3 alternating rounds.
#
#   bench/eval.sh [WORK_DIR]   (default: build/bench-eval)
#
# Last line: eval: base_ratio=A cand_ratio=B storage_ratio=C
#   A = eval's base pass (--base-out) time / llama-perplexity --kl-divergence-base time
#   B = eval time per keep map (masked in the base model, against the recorded base)
#       / llama-perplexity --kl-divergence time for one candidate (the same map, sliced)
#   C = eval's base file bytes / llama-perplexity's base file bytes
# Targets: A <= 1.0, B <= 1.0, C <= 0.01.
#
# The line before it: eval-closed-loop: closed_loop_ratio=R
#   R = time of one closed-loop configuration (lru, lambda 0.5: routing re-chosen and
#       written into the graph, token by token) / time of one plain eval pass (a keep
#       map masked in the base model), each the marginal cost of two more passes in the
#       same command (so model load and the base pass cancel), --score all.
# Target: R <= 1.10.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
make -s -C "$root" build peers >/dev/null
bin=$root/build/bin
work=${1:-$root/build/bench-eval}
mkdir -p "$work"
cd "$work"

# qwen3moe, 8 layers x 64 experts (top-8), width 256, with the real 151,936-token
# Qwen2 vocabulary: the vocabulary is what makes base files large.
[ -f m.gguf ] || "$bin/moeprune" synth --layers 8 --experts 64 --used 8 --embd 256 --ff 256 --type q8_0 -o m.gguf >/dev/null
if [ ! -f text.txt ]; then
  for i in $(seq 1 60); do
    echo "The expert cache keeps the most useful experts resident while the rest stream from disk, round $i."
    echo "def route(tokens, k=$i): return sorted(range(len(tokens)), key=lambda j: -tokens[j])[:k]"
    echo "専門家の混合モデルは、入力ごとに一部の専門家だけを使います。我们在笔记本电脑上运行大型语言模型。"
  done > text.txt
fi
maps=()
for k in 48 32 24 16; do
  python3 - "$k" > "keep$k.json" <<'PY'
import json, sys
k = int(sys.argv[1])
print(json.dumps({"format": "moeprune-keep", "version": 1, "n_expert": 64, "k": k,
                  "layers": {str(l): list(range(k)) for l in range(8)}}))
PY
  maps+=("keep$k.json")
done
[ -f sliced.gguf ] || "$bin/moeprune" slice -m m.gguf --keep keep32.json -o sliced.gguf >/dev/null
threads=$(nproc)
ctx=512
common=(-f text.txt -c $ctx -b $ctx -t "$threads")
. "$root/bench/lib.sh"
eb=() lb=() ec=() lc=()
for round in 1 2 3; do
  rm -f base.mpkl base.kld
  eb+=("$(run eval-base "$bin/moeprune" eval -m m.gguf "${common[@]}" --score second-half --no-parse-special --base-out base.mpkl)")
  lb+=("$(run llama-base "$bin/llama-perplexity" -m m.gguf "${common[@]}" --kl-divergence-base base.kld)")
  ec+=("$(run eval-keep "$bin/moeprune" eval -m m.gguf "${common[@]}" --score second-half --no-parse-special --base base.mpkl --keep "$(IFS=,; echo "${maps[*]}")")")
  lc+=("$(run llama-cand "$bin/llama-perplexity" -m sliced.gguf "${common[@]}" --kl-divergence-base base.kld --kl-divergence)")
done
# Closed loop vs. plain passes: marginal time of passes 2 and 3 on each side.
cl=(-f text.txt -c $ctx -b $ctx -t "$threads" --no-parse-special --cache-policy lru --cache 16 --j 2)
p1=() p3=() c1=() c3=()
for round in 1 2 3; do
  p1+=("$(run plain-1 "$bin/moeprune" eval -m m.gguf "${common[@]}" --no-parse-special --keep keep48.json)")
  c1+=("$(run closed-1 "$bin/moeprune" eval -m m.gguf "${cl[@]}" --lambda 0.5)")
  p3+=("$(run plain-3 "$bin/moeprune" eval -m m.gguf "${common[@]}" --no-parse-special --keep keep48.json,keep32.json,keep24.json)")
  c3+=("$(run closed-3 "$bin/moeprune" eval -m m.gguf "${cl[@]}" --lambda 0.5,1,2)")
done
tp1=$(printf '%s\n' "${p1[@]}" | best)
tp3=$(printf '%s\n' "${p3[@]}" | best)
tc1=$(printf '%s\n' "${c1[@]}" | best)
tc3=$(printf '%s\n' "${c3[@]}" | best)
echo "best of 3: 1 and 3 keep maps ${tp1}s ${tp3}s; 1 and 3 closed-loop configurations ${tc1}s ${tc3}s"
awk -v a="$tc1" -v b="$tc3" -v c="$tp1" -v d="$tp3" \
  'BEGIN { printf "eval-closed-loop: closed_loop_ratio=%.2f\n", (b - a) / (d - c) }'

a=$(printf '%s\n' "${eb[@]}" | best)
b=$(printf '%s\n' "${lb[@]}" | best)
c=$(printf '%s\n' "${ec[@]}" | best)
d=$(printf '%s\n' "${lc[@]}" | best)
sa=$(stat -c %s base.mpkl)
sb=$(stat -c %s base.kld)
n=${#maps[@]}
echo "best of 3: eval base pass ${a}s, llama-perplexity base ${b}s; eval ${n} keep maps ${c}s, llama-perplexity one candidate ${d}s; base files ${sa} vs ${sb} bytes"
awk -v a="$a" -v b="$b" -v c="$c" -v d="$d" -v n="$n" -v sa="$sa" -v sb="$sb" \
  'BEGIN { printf "eval: base_ratio=%.2f cand_ratio=%.2f storage_ratio=%.4f\n", a / b, (c / n) / d, sa / sb }'
