#!/usr/bin/env bash
# A short device call: build, torch_ops GPU tests, Keras GPU tests (torch
# dispatch, JAX HLO), the torch layer benchmark at one shape and the model
# benchmark (Keras torch bf16/fp8, Keras JAX fp8). Logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*"; }
log build; timeout 120 python3 -m torch_ops build > "$OUT/build.txt" 2>&1; log "build rc=$?"
timeout 60 python3 -m pytest tests/torch_ops -q -x -p no:cacheprovider --tb=short -W ignore > "$OUT/tests_torch_ops.txt" 2>&1; log "torch_ops tests: $(tail -1 $OUT/tests_torch_ops.txt)"
KERAS_BACKEND=torch timeout 60 python3 -m pytest tests/test_torch_dispatch.py tests/test_fp8_dense.py -q -p no:cacheprovider --tb=short -W ignore > "$OUT/tests_keras_torch.txt" 2>&1; log "keras torch GPU tests: $(tail -1 $OUT/tests_keras_torch.txt)"
KERAS_BACKEND=jax XLA_FLAGS=--xla_allow_excess_precision=false timeout 60 python3 -m pytest tests/test_jax_gpu.py -q -s -p no:cacheprovider --tb=short -W ignore > "$OUT/tests_keras_jax.txt" 2>&1; log "keras jax GPU tests: $(tail -1 $OUT/tests_keras_jax.txt)"
KERAS_BACKEND=torch timeout 45 python3 benchmarks/keras_layer.py --shapes 16384x4096x14336 --iters 10 > "$OUT/bench_layer_torch.txt" 2>&1; log "layer bench"; grep -E "^\| |host" "$OUT/bench_layer_torch.txt"
for cfg in "torch mixed_bfloat16" "torch fp8_hybrid" "jax fp8_hybrid"; do
  set -- $cfg
  KERAS_BACKEND=$1 timeout 110 python3 benchmarks/model.py --stack keras --policy $2 --warmup 3 --steps 6 >> "$OUT/bench_model.txt" 2>&1
  log "model $cfg: $(grep RESULT $OUT/bench_model.txt | tail -1 | cut -c1-110)"
done
