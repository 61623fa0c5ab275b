#!/usr/bin/env bash
# Slice throughput and memory, measured side by side in one run against cp and
# llama-gguf-split --merge on the same machine, files and page cache.
#
#   bench/slice.sh [WORK_DIR]     (default: build/bench-slice; needs ~8 GB free)
#
# Last line: slice: cp_ratio=R rss_mib=M
#   R = time of cp / time of slice for the same number of bytes (>= 0.9: as fast as copying)
#   M = peak RSS of moeprune slice in MiB (target <= 64, whatever the tensor size)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
make -s -C "$root" build peers >/dev/null
cmake --build "$root/build" --target llama-gguf-split >/dev/null  # the peer for GGUF rewriting
bin=$root/build/bin
work=${1:-$root/build/bench-slice}
mkdir -p "$work"
cd "$work"

# 8 layers x 64 experts of f32 512x1024 (6 MiB each): 3 GiB of routed experts, ~3.2 GiB in all.
if [ ! -f m.gguf ]; then
  echo "synthesizing a ~3.2 GiB model (once; kept in $work)" >&2
  "$bin/moeprune" synth --layers 8 --experts 64 --used 8 --embd 512 --ff 1024 --type f32 -o m.gguf >/dev/null
fi
# Keep 48 of 64 experts in every layer, alternating gaps so the copy is many ranges, not one.
{
  printf '{"format": "moeprune-keep", "version": 1, "n_expert": 64, "k": 48, "metric": "bench", "layers": {'
  for l in 0 1 2 3 4 5 6 7; do
    ids=$(for e in $(seq 0 63); do if [ $(( (e + l) % 4 )) -ne 0 ]; then printf '%s,' "$e"; fi; done)
    printf '"%s": [%s]' "$l" "${ids%,}"
    if [ "$l" -lt 7 ]; then printf ', '; fi
  done
  printf '}}\n'
} > keep.json

now() { date +%s.%N; }
calc() { awk "BEGIN { print $* }"; }
secs() { calc "$2 - $1"; }
rss_of() { grep "Maximum resident set size" "$1" | awk '{print $NF}'; }

# Contenders alternate over five rounds from a warm page cache with no writeback
# pending (sync first), each output made durable (slice fsyncs; cp is followed by
# sync), and the median counts: disk writeback varies by tens of percent from one
# run to the next, and alternating keeps that from favouring either side.
cat m.gguf > /dev/null
median() { printf '%s\n' "$@" | sort -g | sed -n "$(( ($# + 1) / 2 ))p"; }
timed() {  # timed OUTPUT CMD...: seconds for CMD plus making OUTPUT durable
  local out=$1; shift
  rm -f "$out"; sync
  local t0 t1
  t0=$(now); "$@" >/dev/null; sync "$out"; t1=$(now)
  secs "$t0" "$t1"
}

/usr/bin/time -v -o slice.time "$bin/moeprune" slice -m m.gguf --keep keep.json -o s.gguf >/dev/null
bytes=$(stat -c %s s.gguf)
# cp's input: a file of exactly the bytes slice writes, as warm in the page cache as m.gguf.
cp s.gguf ref.bin
cat ref.bin > /dev/null
slice_runs=() cp_runs=()
for round in 1 2 3 4 5; do
  slice_runs+=("$(timed s.gguf "$bin/moeprune" slice -m m.gguf --keep keep.json -o s.gguf)")
  cp_runs+=("$(timed c.gguf cp ref.bin c.gguf)")
done
slice_s=$(median "${slice_runs[@]}")
cp_s=$(median "${cp_runs[@]}")
echo "slice runs: ${slice_runs[*]} s; cp runs: ${cp_runs[*]} s"

# llama-gguf-split --merge streams a whole model the same way: our peer for GGUF rewriting.
if ! ls split-00001-of-*.gguf >/dev/null 2>&1; then
  "$bin/llama-gguf-split" --split --split-max-size 900M m.gguf split >/dev/null
fi
first=$(ls split-00001-of-*.gguf)
cat split-0000*.gguf > /dev/null
merge_s=$(timed merged.gguf /usr/bin/time -v -o merge.time "$bin/llama-gguf-split" --merge "$first" merged.gguf)
merge_bytes=$(stat -c %s merged.gguf)
# Slicing from the split input too: all shards are read from the first.
slice_split_s=$(timed s2.gguf "$bin/moeprune" slice -m "$first" --keep keep.json -o s2.gguf)

mib() { calc "$1 / 1048576"; }
rss_kib=$(rss_of slice.time)
merge_rss_kib=$(rss_of merge.time)
printf '%-34s %9s %10s %10s %9s\n' "run" "MiB" "seconds" "MiB/s" "RSS MiB"
printf '%-34s %9.0f %10.2f %10.0f %9.1f\n' "moeprune slice 48/64, median" "$(mib "$bytes")" "$slice_s" "$(calc "$(mib "$bytes") / $slice_s")" "$(calc "$rss_kib / 1024")"
printf '%-34s %9.0f %10.2f %10.0f %9s\n' "moeprune slice, split input" "$(mib "$bytes")" "$slice_split_s" "$(calc "$(mib "$bytes") / $slice_split_s")" "-"
printf '%-34s %9.0f %10.2f %10.0f %9s\n' "cp + sync (same bytes), median" "$(mib "$bytes")" "$cp_s" "$(calc "$(mib "$bytes") / $cp_s")" "-"
printf '%-34s %9.0f %10.2f %10.0f %9.1f\n' "llama-gguf-split --merge + sync" "$(mib "$merge_bytes")" "$merge_s" "$(calc "$(mib "$merge_bytes") / $merge_s")" "$(calc "$merge_rss_kib / 1024")"
cp_ratio=$(calc "$cp_s / $slice_s")
merge_ratio=$(calc "($bytes / $slice_s) / ($merge_bytes / $merge_s)")
printf 'throughput relative to gguf-split --merge: %.2f\n' "$merge_ratio"
rm -f s.gguf s2.gguf c.gguf ref.bin merged.gguf
printf 'slice: cp_ratio=%.2f rss_mib=%.1f\n' "$cp_ratio" "$(calc "$rss_kib / 1024")"
