#!/usr/bin/env bash
# Corpus building speed and memory on a generated ~200 MB mixed corpus (prose JSONL with
# planted exact and near duplicates, conversations with a shared preamble, CJK text, code
# in repositories), all of it read, deduplicated and split, with a 2M-token calib budget
# measured with the default model's tokenizer.
#
#   bench/corpus.sh [WORK_DIR] [MB] [CALIB_TOKENS]   (default build/bench-corpus, 200, 2000000)
#
# Last line: corpus: mb_per_s=R rss_mib=M
#   R = input megabytes (10^6 bytes) / wall seconds of `moeprune corpus`, M = its peak RSS.
#   Targets: R >= 20 on a 2-core machine, M <= 1024.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
make -s -C "$root" build >/dev/null
cmake --build "$root/build" --target moeprune_bench_corpus >/dev/null
bin=$root/build/bin
work=${1:-$root/build/bench-corpus}
mb=${2:-200}
tokens=${3:-2000000}
source "$root/bench/lib.sh"
mkdir -p "$work"
data=$work/data-$mb-$tokens
[ -f "$data/corpus.toml" ] || "$bin/moeprune_bench_corpus" "$data" "$mb" "$tokens"
[ -f "$work/model.gguf" ] || "$bin/moeprune" synth --arch qwen3moe --layers 2 --experts 8 --used 2 -o "$work/model.gguf" >/dev/null
bytes=$(du -sb --apparent-size "$data" | awk '{print $1}')
rm -rf "$work/out"
/usr/bin/time -v -o "$work/corpus.time" "$bin/moeprune" corpus -m "$work/model.gguf" --manifest "$data/corpus.toml" \
  -o "$work/out" > "$work/corpus.log"
cat "$work/corpus.log"
secs=$(grep "Elapsed (wall clock)" "$work/corpus.time" | awk '{print $NF}' | awk -F: '{ s = 0; for (i = 1; i <= NF; i++) s = s * 60 + $i; print s }')
rss_kib=$(grep "Maximum resident set size" "$work/corpus.time" | awk '{print $NF}')
awk -v b="$bytes" -v s="$secs" -v r="$rss_kib" 'BEGIN {
  printf "%.1f MB of sources in %.2f s\n", b / 1e6, s
  printf "corpus: mb_per_s=%.1f rss_mib=%.0f\n", b / 1e6 / s, r / 1024 }'
