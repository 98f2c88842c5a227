#!/usr/bin/env bash
# One device call for the JAX backend (capped at $BUDGET s): the model
# benchmark (fp8_hybrid) with XLA's default flags in the environment
# (keras_fp8 adds the Triton-GEMM flag itself at import), and the JAX GPU
# tests (torch_ops is built in the background for the
# cross-backend saving test's torch subprocess).
source "$(dirname "$0")/lib.sh"
device_init 300
result() { { grep RESULT "$OUT/$1.txt" || tail -3 "$OUT/$1.txt"; } | tail -1 | cut -c1-600 | tee -a "$LOG"; }
say "XLA_FLAGS in the environment: '${XLA_FLAGS-}'"
(python3 -m torch_ops build > "$OUT/build.txt" 2>&1; echo "build rc=$?" >> "$OUT/build.txt") &
M="benchmarks/model.py --stack keras --warmup 3 --steps 6"
KERAS_BACKEND=jax step jax_fp8 100 python3 $M --policy fp8_hybrid; result jax_fp8
grep "step 0 done\|step 1 done" "$OUT/jax_fp8.txt" | head -2 | tee -a "$LOG"
wait; tail -1 "$OUT/build.txt" | tee -a "$LOG"
KERAS_BACKEND=jax XLA_FLAGS=--xla_allow_excess_precision=false step jax_tests 150 python3 -m pytest \
  tests/test_training.py tests/test_jax_state.py tests/test_jax_gpu.py tests/test_saving.py \
  tests/test_xla_flags.py tests/test_cross_backend_state.py -q -p no:cacheprovider --tb=short -W ignore -k "not Accuracy"
tail -1 "$OUT/jax_tests.txt" | tee -a "$LOG"
say "[$(($(date +%s) - T0))s] done"
