#!/usr/bin/env bash
# The build's layering check (cmake/check_layers.cmake) passes the tree as it is and
# refuses each include that runs up the layers or across to a sibling layer.
#   test_layering.sh SOURCE_ROOT
set -euo pipefail
root=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$root/src" "$tmp/src"
check() { cmake -DSRC="$tmp/src" -DSTAMP="$tmp/stamp" -P "$root/cmake/check_layers.cmake"; }
check
# refused FILE:INCLUDE WHY: the check refuses FILE including INCLUDE, saying WHY (a pattern).
refused() {
  local file=${1%%:*} include=${1#*:} why=$2
  echo "#include \"$include\"" >> "$tmp/src/$file"
  if check 2> "$tmp/err"; then
    echo "the layering check accepted $file including $include" >&2
    exit 1
  fi
  grep -q "$file: #include \"$include\": $why" "$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
  cp "$root/src/$file" "$tmp/src/$file"
}
# Each a layer reaching above itself (or sim and engine into each other), and measure
# into eval, a sibling stage it once reached for the router tap.
for pair in core/errors.h:formats/trace.h formats/trace.h:model/inspect.h model/inspect.h:engine/session.h \
            engine/session.h:sim/policy.h sim/policy.h:engine/session.h sim/throughput.h:replay/replay.h \
            engine/session.h:route/tap.h sim/policy.h:route/mask.h route/tap.h:eval/eval.h \
            measure/worker.cpp:eval/eval.h \
            replay/replay.h:collect/collect.h select/select.h:run/run.h run/run.h:cli/commands.h; do
  refused "$pair" "layer .* may not use"
done
# A folder's private header, from a folder whose layer may use that folder (eval>replay).
for pair in eval/eval.cpp:replay/runner.h run/run.cpp:replay/internal.h; do
  refused "$pair" "${pair#*:} is private to"
done
echo "layering: the tree passes, 14 upward includes and 2 private headers refused"
