#!/usr/bin/env bash
# Collect throughput against llama.cpp's own tools on the same model, corpus, context
# and threads, measured side by side in one run: llama-imatrix (the seed pipeline's
# collector, also watching the graph through the eval callback) and llama-perplexity
# (a plain forward pass with logits for every token).
#
#   bench/collect.sh [WORK_DIR]   (default: build/bench-collect)
#
# Line before last: collect+imatrix: imatrix_ratio=C
#   C = time of collect --imatrix (statistics, trace and llama.cpp's importance matrix in
#   one pass) / llama-imatrix time; target <= 1.00.
# Last line: collect: plain_ratio=A imatrix_ratio=B tok_per_s=T
#   A = collect time / llama-perplexity time (target <= 1.00: no dearer than a plain
#   forward pass), B = collect time / llama-imatrix time (target <= 0.90), both for
#   statistics and trace without imatrix; T = collect tokens per second.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
make -s -C "$root" build peers >/dev/null
bin=$root/build/bin
work=${1:-$root/build/bench-collect}
mkdir -p "$work"
cd "$work"

# qwen3moe, 8 layers x 64 experts (top-8), width 256: small enough for a laptop core,
# wide enough that the forward pass, not bookkeeping, should dominate.
[ -f m.gguf ] || "$bin/moeprune" synth --layers 8 --experts 64 --used 8 --embd 256 --ff 256 --type q8_0 -o m.gguf >/dev/null
if [ ! -f corpus.txt ]; then
  for i in $(seq 1 120); do
    echo "The expert cache keeps the most useful experts resident while the rest stream from disk, round $i."
    echo "def route(tokens, k=$i): return sorted(range(len(tokens)), key=lambda j: -tokens[j])[:k]"
    echo "専門家の混合モデルは、入力ごとに一部の専門家だけを使います。我们在笔记本电脑上运行大型语言模型。"
  done > corpus.txt
fi
threads=$(nproc)
. "$root/bench/lib.sh"
ctx=512
c_times=() ci_times=() i_times=() p_times=()
for round in 1 2 3; do
  c_times+=("$(run collect "$bin/moeprune" collect -m m.gguf -f corpus.txt -o stats.json --trace run.trace -c $ctx -b $ctx -t "$threads")")
  ci_times+=("$(run collect-imatrix "$bin/moeprune" collect -m m.gguf -f corpus.txt -o stats-i.json --trace run-i.trace --imatrix ours.gguf -c $ctx -b $ctx -t "$threads")")
  i_times+=("$(run imatrix "$bin/llama-imatrix" -m m.gguf -f corpus.txt -o imatrix.gguf -c $ctx -b $ctx -t "$threads" --no-ppl)")
  p_times+=("$(run perplexity "$bin/llama-perplexity" -m m.gguf -f corpus.txt -c $ctx -b $ctx -t "$threads")")
done
c=$(printf '%s\n' "${c_times[@]}" | best)
ci=$(printf '%s\n' "${ci_times[@]}" | best)
i=$(printf '%s\n' "${i_times[@]}" | best)
p=$(printf '%s\n' "${p_times[@]}" | best)
tokens=$(grep -o '"n_tokens":[0-9]*' stats.json | head -1 | cut -d: -f2)
echo "corpus: $tokens tokens in windows of $ctx; best of 3 rounds: collect ${c}s, collect --imatrix ${ci}s, llama-imatrix ${i}s, llama-perplexity ${p}s"
awk -v ci="$ci" -v i="$i" 'BEGIN { printf "collect+imatrix: imatrix_ratio=%.2f\n", ci / i }'
awk -v c="$c" -v i="$i" -v p="$p" -v n="$tokens" 'BEGIN { printf "collect: plain_ratio=%.2f imatrix_ratio=%.2f tok_per_s=%.0f\n", c / p, c / i, n / c }'
