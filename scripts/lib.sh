# Shared by the device scripts. `device_init SECONDS` sets the environment
# (OUT, LOG, T0, BUDGET defaulting to SECONDS, unbuffered Python, the
# extension build cache); `say` logs a line to $LOG and stdout; `step NAME
# LIMIT CMD...` runs CMD with min(LIMIT, time left of $BUDGET) seconds,
# appending its output to $OUT/NAME.txt; `has PHASE` is true when $PHASES
# names PHASE.
device_init() {
  set -o pipefail
  export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-12} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/log.txt
  T0=$(date +%s); BUDGET=${BUDGET:-$1}
}
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
has() { [[ " $PHASES " == *" $1 "* ]]; }
