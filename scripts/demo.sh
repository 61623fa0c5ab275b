#!/usr/bin/env bash
# make demo: the whole job on the built-in default. The default model is the trained
# fixture (tests/fixtures/trained/model.gguf, docs/trained-model.md): a 32-expert qwen3moe
# that learned English prose, code, Chinese and chat, so pruning it costs something real.
# The corpus is assembled from text already on the machine (llama.cpp's Markdown docs and
# C++ sources, fetched by set-up; Chinese man pages from Debian's manpages-zh), and
# `moeprune run` goes end to end. Every step is skipped when its output is already there,
# and `moeprune run` skips unchanged stages.
#
#   scripts/demo.sh BUILD_DIR DEMO_DIR
set -euo pipefail
build=${1:-build}
demo=${2:-demo}
bin=$build/bin/moeprune
llama=third_party/llama.cpp
mkdir -p "$demo"

model=tests/fixtures/trained/model.gguf

zh=$demo/corpus/zh
if [ ! -f "$zh/.done" ]; then
  mkdir -p "$zh"
  for page in /usr/share/man/zh_CN/man1/*.gz; do
    name=$(basename "$page" .1.gz)
    # The text of the page, without roff requests and font escapes; pages that are not UTF-8 are left out.
    zcat "$page" | grep -v '^\.' | sed -e 's/\\f[BIRP]//g' -e 's/\\[-,\/]//g' > "$zh/$name.txt.tmp" || true
    if iconv -f UTF-8 -t UTF-8 "$zh/$name.txt.tmp" >/dev/null 2>&1 && [ -s "$zh/$name.txt.tmp" ]; then
      mv "$zh/$name.txt.tmp" "$zh/$name.txt"
    else
      rm -f "$zh/$name.txt.tmp"
    fi
  done
  touch "$zh/.done"
fi

root=$(pwd)
cat > "$demo/corpus.toml.tmp" <<TOML
# The demo corpus: prose, code and Chinese, with llama.cpp's tokens as the unit.
[corpus]
tokens = 30000
doc_tokens = 1024
truncate = "left"       # one unit per document (its end), so the held-out side has several
tasks_per_domain = 25   # choice tasks from the held-out side, scored for every keep map

[[source]]
name = "llama.cpp docs"
path = "$root/$llama/docs"
domain = "prose"
weight = 2
eval_tokens = 2500      # a task's wrong endings come from other held-out documents

[[source]]
name = "llama.cpp sources"
path = "$root/$llama/src/*.cpp"
domain = "code"
weight = 2
eval_tokens = 2500

[[source]]
name = "manpages-zh"
path = "corpus/zh"
domain = "zh"
weight = 1
eval_tokens = 2500
TOML
if ! cmp -s "$demo/corpus.toml.tmp" "$demo/corpus.toml"; then mv "$demo/corpus.toml.tmp" "$demo/corpus.toml"; else rm "$demo/corpus.toml.tmp"; fi

# RAM: the process's own memory (about 9 MB measured here: KV cache, buffers), the
# non-expert weights (17 MB, almost all the 32,064-token embedding) and room for about 14
# of the 32 experts (96 KiB each) of each of the 4 layers, so that keeping every expert
# means streaming and K 12 fits. Where moeprune may make memory cgroups, the timing is
# measured: llama.cpp decoding the model under 25% and 50% of its expert bytes, and the
# recommendation measured for real (--verify). Elsewhere it rests on guesses (a PCIe 3
# SSD, 2 ms of compute per token, 10 MB of process memory), and the demo says why.
# This model decodes a token in about a millisecond, and the same run measured 960 and
# 1,300 tokens/s a minute apart: every measured run is taken five times, interleaved,
# and kept at its median (--measure-repeats).
timing=(--measure 25%,50% --measure-repeats 5 --verify)
# As root, llama.cpp is also measured at a read-ahead of 128 KB beside the model's device's
# own (measure puts it back), so that the plan can recommend one.
source=$(findmnt -no SOURCE -T "$model" 2>/dev/null || true)
disk=$(lsblk -no PKNAME "$source" 2>/dev/null | head -1 || true)
disk=${disk:-$(basename "${source:-none}")}
if [ "$(id -u)" = 0 ] && [ -w "/sys/block/$disk/queue/read_ahead_kb" ]; then
  timing+=(--read-ahead-kb "$(cat "/sys/block/$disk/queue/read_ahead_kb"),128")
fi
if ! "$bin" measure --check; then
  echo "demo: nothing measured; tokens/s rest on a guessed SSD and compute time" >&2
  timing=(--reserve 10MB --ssd 3.9 --compute-ms 2)
fi
"$bin" run -m "$model" --corpus "$demo/corpus.toml" -k 12,16,24 --ram 32MB "${timing[@]}" \
  --criteria reap,reap-lcb,freq,random --llama-bin "$build/bin" -o "$demo/run"
