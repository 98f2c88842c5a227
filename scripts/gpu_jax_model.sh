#!/usr/bin/env bash
# Issue 5, one device call (~280 s): the Keras-JAX model benchmark.
# Run 1 of this script (2026-11-29) found: bf16 compiles in ~20 s, but an
# fp8_hybrid train step of one block did not get through build + compile +
# 6 steps in 60 s (4 blocks: not in 100 s). This version asks why:
#  1. benchmarks/jax_step.py, fp8_hybrid, full width, 1 block, under two XLA
#     settings that shorten GEMM autotuning (PHASE lines show how far each got).
#  2. benchmarks/model.py (4 blocks, model.fit) mixed_bfloat16 and fp8_hybrid,
#     both under the setting of step 1 that compiled fastest (none: defaults).
# Everything goes to $OUT/log.txt.
set -o pipefail
export PYTHONUNBUFFERED=1 KERAS_BACKEND=jax
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/log.txt
T0=$(date +%s); BUDGET=${BUDGET:-280}
SIZES=${SIZES:-}  # e.g. "--hidden 256 --mlp 512 --heads 4 --seq 128 --vocab 1000 --batch 2" on a CPU
say() { echo "$*" | tee -a "$LOG"; }
step() {  # step NAME LIMIT_S CMD...: runs with min(LIMIT, time left)
  local name=$1 lim=$2; shift 2
  local left=$((BUDGET - ($(date +%s) - T0)))
  ((lim > left)) && lim=$left
  if ((lim < 20)); then say "[skip $name: ${left}s left]"; return 1; fi
  say "=== $name (limit ${lim}s) $*"
  timeout "$lim" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  cat "$OUT/$name.txt" >> "$LOG"; rm -f "$OUT/$name.txt"
  say "[$(($(date +%s) - T0))s] $name rc=$rc"
  return $rc
}
say "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader)"
say "$(python3 -c 'import jax, keras; print("jax", jax.__version__, "keras", keras.__version__, jax.devices())' 2>&1 | tail -1)"

FLAGS_A="--xla_gpu_autotune_level=0"
FLAGS_B="--xla_gpu_enable_triton_gemm=false"
step diag_a 60 env XLA_FLAGS="$FLAGS_A" python3 benchmarks/jax_step.py \
  --policy fp8_hybrid --blocks 1 --iters 3 $SIZES
step diag_b 60 env XLA_FLAGS="$FLAGS_B" python3 benchmarks/jax_step.py \
  --policy fp8_hybrid --blocks 1 --iters 3 $SIZES
FLAGS=$(python3 - "$LOG" <<'EOF'
import json, sys
done = [json.loads(l[5:]) for l in open(sys.argv[1]) if l.startswith("STEP ")]
print(min(done, key=lambda r: r["compile_s"])["xla_flags"] if done else "")
EOF
)
say "XLA_FLAGS for the model runs: '$FLAGS'"
M="benchmarks/model.py --stack keras --warmup 3 --steps 8 $SIZES"
step model_bf16 90 env XLA_FLAGS="$FLAGS" python3 $M --policy mixed_bfloat16
step model_fp8 110 env XLA_FLAGS="$FLAGS" python3 $M --policy fp8_hybrid
say "--- summary"
grep -hE "^(PHASE|GEMMS|STEP|RESULT|===)" "$LOG" | cut -c1-1500
