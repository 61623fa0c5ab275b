#!/usr/bin/env bash
# Installs the Debian packages moeprune builds against, only those missing,
# so a second run costs nothing and needs no network.
set -euo pipefail
packages=(cmake g++ make git pkg-config libgtest-dev libcli11-dev nlohmann-json3-dev libzstd-dev libfmt-dev libxxhash-dev libboost-math-dev libtomlplusplus-dev libgumbo-dev time ccache
  chromium   # the report test loads report.html in headless Chromium
  manpages-zh  # CJK text for make demo
  clang libclang-rt-dev llvm  # make fuzz: libFuzzer, sanitizer runtimes, llvm-symbolizer
  python3    # make faults and the eval and scale bench scripts compare JSON with it
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm fetches llama.cpp; Node.js may come from outside Debian, so only its absence matters.
command -v npm >/dev/null 2>&1 || missing+=(npm)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing Debian packages: ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq || true
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
