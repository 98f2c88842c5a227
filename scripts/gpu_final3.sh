#!/usr/bin/env bash
# Last device call of a session (capped at $BUDGET s): build (in the
# background while the JAX GPU tests run), benchmarks/linear.py at the large
# and small shapes (torchao at the large ones), the Keras-torch model bf16 vs
# fp8_hybrid.
source "$(dirname "$0")/lib.sh"
device_init 380
say "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader) $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)') $(git log -1 --format=%h 2>/dev/null)"
(python3 -m torch_ops build > "$OUT/build.txt" 2>&1; echo "build rc=$?" >> "$OUT/build.txt") &
KERAS_BACKEND=jax XLA_FLAGS=--xla_allow_excess_precision=false step jaxtests 100 python3 -m pytest \
  tests/test_training.py tests/test_jax_state.py tests/test_jax_gpu.py tests/test_xla_flags.py \
  -k "not Accuracy" -q -p no:cacheprovider --tb=short -W ignore
tail -1 "$OUT/jaxtests.txt" | tee -a "$LOG"; grep -E "^FAILED|^ERROR" "$OUT/jaxtests.txt" | head | tee -a "$LOG"
wait; tail -1 "$OUT/build.txt" | tee -a "$LOG"
step linear 170 python3 benchmarks/linear.py --shapes 16384x4096x4096,16384x4096x14336,16384x14336x4096,4096x1024x1024,1024x2048x1024 --iters 20 --rounds 4
sed -n '/### summary/,$p' "$OUT/linear.txt" | tee -a "$LOG"
for p in mixed_bfloat16 fp8_hybrid; do
  KERAS_BACKEND=torch step "model_$p" 55 python3 benchmarks/model.py --stack keras --policy $p --warmup 3 --steps 6
  { grep RESULT "$OUT/model_$p.txt" || tail -3 "$OUT/model_$p.txt"; } | tail -1 | cut -c1-400 | tee -a "$LOG"
done
say "[$(($(date +%s) - T0))s] done"
