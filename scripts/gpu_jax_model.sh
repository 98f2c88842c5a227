#!/usr/bin/env bash
# Issue 5, one device call (~280 s): the Keras-JAX model benchmark.
#  1. benchmarks/jax_step.py at full width, 1 block, for fp8_hybrid with both
#     GPU GEMM formulations (KERAS_FP8_JAX_GEMM=direct|scaled): compile time,
#     GEMM custom calls and their output types, cuDNN attention calls, step ms.
#  2. benchmarks/model.py (4 blocks, model.fit) mixed_bfloat16, then
#     fp8_hybrid with the faster formulation that kept every GEMM in FP8.
#  3. tests/test_jax_gpu.py with that formulation; the other formulation's
#     model run if time is left.
# Everything goes to $OUT/log.txt (plus the HLO of step 1, gzipped).
set -o pipefail
export PYTHONUNBUFFERED=1 KERAS_BACKEND=jax
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/log.txt
T0=$(date +%s); BUDGET=${BUDGET:-280}
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

SIZES=${SIZES:-}  # e.g. "--hidden 256 --mlp 512 --heads 4 --seq 128 --vocab 1000 --batch 2" on a CPU
SMALL="--blocks 1 --iters 5 $SIZES"
for mode in direct scaled; do
  step "diag_fp8_$mode" 60 python3 benchmarks/jax_step.py --policy fp8_hybrid \
    $SMALL --gemm $mode --dump "$OUT/hlo_fp8_$mode.txt.gz"
done
MODE=$(python3 - "$LOG" <<'EOF'
import json, sys
steps = {}
for line in open(sys.argv[1]):
    if line.startswith("STEP "):
        r = json.loads(line[5:])
        steps[r["gemm_mode"]] = r
def fp8(r):
    return sum(n for k, n in r["gemms"].items() if "$f8" in k)
def other(r):
    return sum(n for k, n in r["gemms"].items() if "$f8" not in k)
d, s = steps.get("direct"), steps.get("scaled")
ok = s and (not d or (fp8(s) >= fp8(d) and other(s) <= other(d)))
print("scaled" if ok and (not d or s["step_ms_median"] < d["step_ms_median"]) else "direct")
EOF
)
say "chosen GEMM formulation: $MODE"
grep -h '"cudnn_fmha_calls": 0' "$LOG" > /dev/null && step flash_check 40 python3 -c "
import jax.numpy as jnp
from keras.src.backend.jax.nn import _can_use_flash_attention as can
q = jnp.zeros((8, 2048, 32, 128), jnp.bfloat16)
print('keras flash check:', can(q, q, q, None, raise_error=True))"

M="benchmarks/model.py --stack keras --warmup 3 --steps 8 $SIZES"
step model_bf16 90 python3 $M --policy mixed_bfloat16
step "model_fp8_$MODE" 100 env KERAS_FP8_JAX_GEMM=$MODE python3 $M --policy fp8_hybrid
step "tests_jax_gpu_$MODE" 45 env KERAS_FP8_JAX_GEMM=$MODE XLA_FLAGS=--xla_allow_excess_precision=false \
  python3 -m pytest tests/test_jax_gpu.py -q -p no:cacheprovider --tb=short -W ignore
OTHER=$([ "$MODE" = scaled ] && echo direct || echo scaled)
step "model_fp8_$OTHER" 100 env KERAS_FP8_JAX_GEMM=$OTHER python3 $M --policy fp8_hybrid
say "--- summary"
grep -hE "^(STEP|RESULT)" "$LOG" | cut -c1-1500
