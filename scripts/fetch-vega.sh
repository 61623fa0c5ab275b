#!/usr/bin/env bash
# Fetches the pinned chart library the HTML report inlines (Vega, Vega-Lite, vega-embed)
# with npm into a git-ignored folder, checking each package's SHA-256. Idempotent.
set -euo pipefail
DEST=${1:-third_party/vega}
packages=(
  "vega@6.4.0 3521fb6ff68a94a40323954f0ba4484ba4014b157bfd37f89a3b063082320c42 build/vega.min.js"
  "vega-lite@6.5.0 811230a6bfd2cdbfc359d0c38f624a90df86657b7f251b67be88bcc4eee32b7f build/vega-lite.min.js"
  "vega-embed@7.3.0 d9a958ced3240f0418df7d5e12e97dba6e63cecda15b8403e47a0db7eb6ea859 build/vega-embed.min.js"
)
stamp="$DEST/.pinned"
want=$(printf '%s\n' "${packages[@]}")
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "fetching the report's chart library (vega, vega-lite, vega-embed)"
mkdir -p "$work/out"
for entry in "${packages[@]}"; do
  read -r spec sha file <<<"$entry"
  if ! (cd "$work" && npm pack --silent "$spec" >"$work/npm.log" 2>&1); then
    echo "error: npm could not fetch $spec for the HTML report. npm said:" >&2
    sed 's/^/  /' "$work/npm.log" >&2
    exit 1
  fi
  tgz=$(ls "$work"/*.tgz)
  got=$(sha256sum "$tgz" | awk '{print $1}')
  if [ "$got" != "$sha" ]; then
    echo "error: $spec has SHA-256 $got, expected $sha" >&2
    exit 1
  fi
  name=${spec%@*}
  mkdir -p "$work/$name"
  tar -xzf "$tgz" -C "$work/$name" "package/$file" package/LICENSE
  cp "$work/$name/package/$file" "$work/out/$(basename "$file")"
  cp "$work/$name/package/LICENSE" "$work/out/LICENSE.$name"
  rm -f "$tgz"
done
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$work/out" "$DEST"
printf '%s\n' "$want" > "$stamp"
