#!/usr/bin/env bash
# One device call for issue 4 (Keras on torch + GPU), capped at $BUDGET s:
# build, the Keras torch GPU tests (and the torch_ops fold tests), the Keras
# layer benchmark with the host cost, the model benchmark (Keras torch bf16 and
# fp8, a small model of both, the plain-PyTorch bf16 and torchao peers), and a
# profile of the fp8 step. Each phase gets min(its limit, time left).
source "$(dirname "$0")/lib.sh"
device_init 330
PHASES=${PHASES:-"build tests model layer small jaxtests jax peers profile"}
say "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader) $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')"
if has build; then step build 150 python3 -m torch_ops build; tail -2 "$OUT/build.txt" | tee -a "$LOG"; fi
if has tests; then
  KERAS_BACKEND=torch step tests 130 python3 -m pytest ${TESTS:-tests/torch_ops/test_torch_ops_fold.py tests/test_torch_dispatch.py tests/test_fp8_dense.py tests/test_loss_scaling.py tests/test_fp8_einsum_dense.py tests/test_convert.py tests/test_saving.py tests/test_autocast.py tests/test_training.py} -q -p no:cacheprovider --tb=short -W ignore
  tail -1 "$OUT/tests.txt" | tee -a "$LOG"; grep -E "^FAILED|^ERROR" "$OUT/tests.txt" | head -20 | tee -a "$LOG"
fi
if has layer; then
  KERAS_BACKEND=torch step layer 100 python3 benchmarks/keras_layer.py --shapes ${LAYER_SHAPES:-16384x4096x4096,16384x4096x14336,16384x14336x4096,4096x1024x1024} --iters 10
  grep -E "^###|^\| |host|FAILED" "$OUT/layer.txt" | tee -a "$LOG"
fi
model() {  # model NAME LIMIT ARGS...
  local name=$1 lim=$2; shift 2
  step "$name" "$lim" python3 benchmarks/model.py "$@" --warmup 3 --steps 6
  { grep RESULT "$OUT/$name.txt" || tail -3 "$OUT/$name.txt"; } | tail -1 | cut -c1-600 | tee -a "$LOG"
}
if has model; then
  KERAS_BACKEND=torch model model_bf16 60 --stack keras --policy mixed_bfloat16
  KERAS_BACKEND=torch model model_fp8 60 --stack keras --policy fp8_hybrid
fi
SMALL="--hidden 1024 --mlp 2816 --heads 8 --seq 512 --vocab 8000"
if has small; then
  KERAS_BACKEND=torch model small_bf16 40 --stack keras --policy mixed_bfloat16 $SMALL
  KERAS_BACKEND=torch model small_fp8 40 --stack keras --policy fp8_hybrid $SMALL
fi
if has jaxtests; then
  # XLA's excess precision would let an amax see values before their bf16
  # rounding: the exact-state tests turn it off.
  KERAS_BACKEND=jax XLA_FLAGS=--xla_allow_excess_precision=false step jaxtests 120 python3 -m pytest \
    tests/test_training.py tests/test_jax_state.py tests/test_jax_gpu.py tests/test_saving.py \
    tests/test_cross_backend_state.py tests/test_xla_flags.py -k "not Accuracy" -q -p no:cacheprovider --tb=short -W ignore
  tail -1 "$OUT/jaxtests.txt" | tee -a "$LOG"; grep -E "^FAILED|^ERROR" "$OUT/jaxtests.txt" | head -20 | tee -a "$LOG"
fi
if has jax; then
  # XLA_FLAGS as the user has them (empty by default): import keras_fp8 adds
  # the Triton-GEMM flag for both policies.
  JF=${JAX_XLA_FLAGS:-}
  KERAS_BACKEND=jax XLA_FLAGS="$JF" model jax_fp8 170 --stack keras --policy fp8_hybrid
  KERAS_BACKEND=jax XLA_FLAGS="$JF" model jax_bf16 80 --stack keras --policy mixed_bfloat16
fi
if has peers; then
  model torch_bf16 50 --stack torch
  model torchao 100 --stack torch --torchao
fi
if has profile; then
  for p in ${PROFILE_POLICIES:-fp8_hybrid mixed_bfloat16}; do
    KERAS_BACKEND=torch step profile_$p 50 python3 benchmarks/profile_keras_torch.py --policy $p --top 40
    grep -E "^# |host-sync|  sync" "$OUT/profile_$p.txt" | tee -a "$LOG"
  done
fi
say "[$(($(date +%s) - T0))s] done"
