#!/usr/bin/env bash
# Every bench script, one after another (`make bench`), each with its own log; ends
# with one markdown row per script (its last line, the date, machine and commit) in
# the form docs/benchmarks.md records them.
#
#   bench/all.sh [SCRIPT...]   (default: every bench/*.sh but this one and lib.sh)
#
# scale.sh is the long one (about half an hour, 12 GiB of disk); BENCH_SKIP=scale
# leaves scripts out by name (space separated).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
logs=$root/build/bench-logs
mkdir -p "$logs"
scripts=("$@")
if [ ${#scripts[@]} -eq 0 ]; then
  for s in "$root"/bench/*.sh; do
    name=$(basename "$s" .sh)
    case " all lib ${BENCH_SKIP:-} " in *" $name "*) continue ;; esac
    scripts+=("$name")
  done
fi
commit=$(git -C "$root" rev-parse --short HEAD)
dirty=$(git -C "$root" status --porcelain --untracked-files=no | grep -q . && echo "+changes" || true)
machine="$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
rows=()
status=0
for name in "${scripts[@]}"; do
  echo "== bench/$name.sh" >&2
  if bash "$root/bench/$name.sh" > "$logs/$name.log" 2>&1; then
    last=$(tail -n 1 "$logs/$name.log")
  else
    last="FAILED (see build/bench-logs/$name.log)"
    status=1
  fi
  echo "$last" >&2
  rows+=("| $name.sh | \`$last\` | $(date -u +%F) | $commit$dirty |")
done
echo "machine: $machine"
echo "| script | last line | date | commit |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
