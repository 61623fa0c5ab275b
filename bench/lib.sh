# Timing helpers shared by the side-by-side bench scripts (sourced; `work` is the
# script's work folder, where each command's log goes).
now() { date +%s.%N; }
run() {  # run NAME COMMAND...: seconds of wall time; stops the script if COMMAND fails
  local name=$1 t0 t1
  shift
  t0=$(now)
  "$@" >"$work/$name.log" 2>&1 || { echo "$name failed, see $work/$name.log" >&2; exit 1; }
  t1=$(now)
  awk "BEGIN { print $t1 - $t0 }"
}
best() { sort -g | head -1; }  # the fastest of the times on stdin
