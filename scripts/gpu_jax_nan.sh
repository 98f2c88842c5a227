#!/usr/bin/env bash
# Diagnose the JAX-GPU FitState NaN: probe FP8 dots at tiny shapes, then the
# state tests under both GEMM output settings.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/log.txt
T0=$(date +%s); BUDGET=${BUDGET:-200}
source "$(dirname "$0")/lib.sh"
XF="--xla_gpu_enable_triton_gemm=false --xla_allow_excess_precision=false"
XLA_FLAGS=$XF step probe 60 python3 scripts/jax_fp8_probe.py; cat "$OUT/probe.txt" | grep -v Warning | tail -20 | tee -a "$LOG"
for go in compute float32; do
  KERAS_BACKEND=jax KERAS_FP8_JAX_GEMM_OUTPUT=$go XLA_FLAGS=$XF step "tests_$go" 70 python3 -m pytest \
    tests/test_training.py tests/test_jax_state.py -q -p no:cacheprovider --tb=line -W ignore -k "not Accuracy"
  tail -12 "$OUT/tests_$go.txt" | tee -a "$LOG"
done
say "[$(($(date +%s) - T0))s] done"
