# Shared by the device scripts: `say` logs a line to $LOG and stdout; `step
# NAME LIMIT CMD...` runs CMD with min(LIMIT, time left of $BUDGET) seconds,
# appending its output to $OUT/NAME.txt. Needs OUT, LOG, T0 and BUDGET set.
say() { echo "$*" | tee -a "$LOG"; }
step() {
  local name=$1 lim=$2; shift 2
  local left=$((BUDGET - ($(date +%s) - T0)))
  ((lim > left)) && lim=$left
  if ((lim < 15)); then say "[skip $name: ${left}s left]"; return 1; fi
  timeout "$lim" "$@" >> "$OUT/$name.txt" 2>&1; local rc=$?
  say "[$(($(date +%s) - T0))s] $name rc=$rc"
  return $rc
}
