#!/usr/bin/env bash
# One device call for the Keras side: GPU tests (torch dispatch, JAX HLO),
# the Keras layer benchmark and the model benchmark, on both backends.
# Logs under $OUT; a short summary last.
#   PHASES="tests layer model" bash scripts/gpu_keras.sh
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PHASES=${PHASES:-"tests layer model"}
MODEL_STEPS=${MODEL_STEPS:-"--warmup 4 --steps 10"}
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

python3 -c "import torch, jax, keras; print('torch', torch.__version__, torch.version.cuda, 'jax', jax.__version__, jax.devices(), 'keras', keras.__version__)" 2>&1 | tail -1 | tee "$OUT/env_keras.txt"
log "build torch_ops"; timeout 300 python3 -m torch_ops build > "$OUT/build.txt" 2>&1; log "build rc=$?"

if has tests; then
  log "keras tests on GPU (torch)"
  KERAS_BACKEND=torch timeout 300 python3 -m pytest tests/test_torch_dispatch.py tests/test_fp8_dense.py tests/test_loss_scaling.py -q -p no:cacheprovider -rfEs --tb=short -W ignore 2>&1 | tee "$OUT/tests_keras_torch.txt" | tail -15
  log "keras tests on GPU (jax)"
  KERAS_BACKEND=jax timeout 300 python3 -m pytest tests/test_jax_gpu.py tests/test_fp8_dense.py tests/test_training.py -q -s -p no:cacheprovider -rfEs --tb=short -W ignore 2>&1 | tee "$OUT/tests_keras_jax.txt" | grep -v "^Epoch\|step -" | tail -40
fi
if has layer; then
  for b in torch jax; do
    log "layer benchmark $b"
    KERAS_BACKEND=$b timeout 240 python3 benchmarks/keras_layer.py ${LAYER_ARGS:-} 2>&1 | tee "$OUT/bench_layer_$b.txt" | grep -E "^\||^###|host|FAILED"
  done
fi
if has model; then
  for cfg in "torch keras mixed_bfloat16" "torch keras fp8_hybrid" "jax keras mixed_bfloat16" "jax keras fp8_hybrid" "torch torch bf16" "torch torch torchao"; do
    set -- $cfg
    extra=""; [ "$3" = torchao ] && extra="--torchao"
    log "model $cfg"
    KERAS_BACKEND=$1 timeout 240 python3 benchmarks/model.py --stack $2 --policy $3 $extra $MODEL_STEPS 2>&1 | tee -a "$OUT/bench_model.txt" | grep -E "RESULT|Error|error" | cut -c1-160
  done
fi
echo "================ summary ($(($(date +%s) - T0))s) ================"
tail -2 "$OUT/tests_keras_torch.txt" "$OUT/tests_keras_jax.txt" 2>/dev/null
grep -h SUMMARY "$OUT"/bench_layer_*.txt 2>/dev/null
grep -h "host us" "$OUT"/bench_layer_torch.txt 2>/dev/null
grep -h RESULT "$OUT/bench_model.txt" 2>/dev/null | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line.split('RESULT ', 1)[1]); print(f\"{r['stack']:40s} {r['ms_per_step']:8.1f} ms/step {r['tok_per_s']/1e3:7.1f}k tok/s  losses {[round(l, 3) for l in r['losses']]}\")"
