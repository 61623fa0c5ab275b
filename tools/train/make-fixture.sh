#!/usr/bin/env bash
# Retrains the committed fixture tests/fixtures/trained/ (docs/trained-model.md): the data
# (data.py), the model (train.py, PyTorch from Debian), PyTorch's reference logits and the
# realism tests' corpora; then runs the realism tests on the result. Only this recipe needs
# PyTorch: `make test` uses the committed files.
#
#   tools/train/make-fixture.sh [BUILD_DIR]
set -euo pipefail
build=${1:-build}
llama=third_party/llama.cpp
out=tests/fixtures/trained
work=$build/train
# Everything is made in $stage and replaces the committed fixture only when every step
# succeeded, so that a failed or interrupted run never leaves a half-new fixture.
stage=$work/fixture
rm -rf "$stage"
mkdir -p "$work" "$stage" "$out"

# Debian's PyTorch links the reference BLAS unless OpenBLAS provides libblas.so.3; with
# it, a step is about 30 times faster.
packages=(python3-torch python3-numpy python3-yaml libopenblas0-pthread manpages-zh)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# Debian's interpreter, where python3-torch is, whatever python3 is first on PATH.
py=/usr/bin/python3

cmake --build "$build" -j "$(nproc)" --target moeprune llama-tokenize llama-peers moeprune_realism_tests
# The template fixes every metadata key and tensor shape: a synth model of the trained
# model's shape with Phi-3's vocabulary (32,064 tokens, chat template with <|end|>).
"$build/bin/moeprune" synth --arch qwen3moe --layers 4 --experts 32 --used 4 --embd 128 --ff 64 \
  --vocab "$llama/models/ggml-vocab-phi-3.gguf" -o "$work/template.gguf"
$py tools/train/data.py --llama "$llama" --tokenize "$build/bin/llama-tokenize" \
  --tokenizer "$work/template.gguf" --out "$work/data" --fixture "$stage"
OPENBLAS_NUM_THREADS=2 $py tools/train/train.py --template "$work/template.gguf" --data "$work/data" \
  --out "$stage/model.gguf" --reference "$stage/reference-logits.json" --threads 2
cp "$stage"/* "$out"/
(cd "$build" && ctest --output-on-failure -L realism)
