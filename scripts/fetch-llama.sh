#!/usr/bin/env bash
# Fetches the pinned llama.cpp (the release node-llama-cpp@3.21.1 ships as a git
# bundle) into a git-ignored folder. Idempotent: a checkout at the pinned commit
# is left alone.
set -euo pipefail
DEST=${1:-third_party/llama.cpp}
PIN_PACKAGE=node-llama-cpp@3.21.1
PIN_COMMIT=80fb11ac73e66d89eae2c6a91d8a77428fa733ed

if [ -d "$DEST/.git" ] && [ "$(git -C "$DEST" rev-parse HEAD)" = "$PIN_COMMIT" ]; then
  exit 0
fi
if [ -e "$DEST" ]; then
  echo "error: $DEST exists but is not llama.cpp at $PIN_COMMIT; remove it or pass -DMOEPRUNE_LLAMA_DIR" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "fetching llama.cpp from $PIN_PACKAGE"
if ! (cd "$work" && npm pack --silent "$PIN_PACKAGE" >"$work/npm.log" 2>&1); then
  echo "error: npm could not fetch $PIN_PACKAGE, which carries the pinned llama.cpp. npm said:" >&2
  sed 's/^/  /' "$work/npm.log" >&2
  cat >&2 <<'HELP'
Check that this machine reaches the npm registry (network, proxy settings, or a proxy
certificate it must trust: npm config get proxy / cafile), or build against an
existing llama.cpp checkout at the pinned commit:
  make build CMAKE_ARGS="-DMOEPRUNE_LLAMA_DIR=/path/to/llama.cpp"
HELP
  exit 1
fi
tar -xzf "$work"/node-llama-cpp-*.tgz -C "$work" package/llama/gitRelease.bundle
mkdir -p "$(dirname "$DEST")"
git clone -q "$work/package/llama/gitRelease.bundle" "$DEST.partial"
got=$(git -C "$DEST.partial" rev-parse HEAD)
if [ "$got" != "$PIN_COMMIT" ]; then
  rm -rf "$DEST.partial"
  echo "error: $PIN_PACKAGE holds llama.cpp $got, expected $PIN_COMMIT" >&2
  exit 1
fi
mv "$DEST.partial" "$DEST"
