#!/usr/bin/env bash
# One device call for the Keras-on-torch path: build, the fold kernel and
# Keras torch GPU tests, the layer benchmark at one shape with the host cost,
# a torch.profiler look at a model step, and the model benchmark (bf16, fp8).
# Logs under $OUT; a short summary on stdout.
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
PHASES=${PHASES:-"build tests layer profile model"}
has() { [[ " $PHASES " == *" $1 "* ]]; }
log() { echo "[$(($(date +%s) - T0))s] $*"; }
if has build; then
  log build; timeout 150 python3 -m torch_ops build > "$OUT/build.txt" 2>&1; log "build rc=$?"; tail -3 "$OUT/build.txt"
fi
if has tests; then
  KERAS_BACKEND=torch timeout ${TESTS_TIMEOUT:-90} python3 -m pytest ${TESTS:-tests/torch_ops/test_torch_ops_fold.py tests/test_torch_dispatch.py tests/test_fp8_dense.py tests/test_loss_scaling.py} -q -p no:cacheprovider --tb=short -W ignore > "$OUT/tests.txt" 2>&1
  log "tests: $(tail -1 $OUT/tests.txt)"; grep -E "^FAILED|^ERROR" "$OUT/tests.txt" | head -20
fi
if has layer; then
  KERAS_BACKEND=torch timeout 90 python3 benchmarks/keras_layer.py --shapes ${LAYER_SHAPES:-16384x4096x14336} --kinds ${LAYER_KINDS:-bf16,fp8} --iters 10 > "$OUT/bench_layer_torch.txt" 2>&1
  log "layer bench"; grep -E "^\| |host|FAILED" "$OUT/bench_layer_torch.txt"
fi
if has profile; then
  for p in ${PROFILE_POLICIES:-fp8_hybrid}; do
    KERAS_BACKEND=torch timeout 120 python3 benchmarks/profile_keras_torch.py --policy $p --top 30 > "$OUT/profile_$p.txt" 2>&1
    log "profile $p"; grep -E "^# |host-sync|  sync:" "$OUT/profile_$p.txt"
  done
fi
if has model; then
  for cfg in ${MODEL_CFGS:-"torch:mixed_bfloat16" "torch:fp8_hybrid"}; do
    b=${cfg%%:*}; p=${cfg#*:}
    KERAS_BACKEND=$b timeout 120 python3 benchmarks/model.py --stack keras --policy $p --warmup 3 --steps 6 >> "$OUT/bench_model.txt" 2>&1
    log "model $cfg: $(grep RESULT $OUT/bench_model.txt | tail -1 | cut -c1-120)"
  done
fi
log done
