#!/usr/bin/env bash
# Follow-up device call (capped at $BUDGET s): the GPU test failures of the
# previous call, the small-shape layer profile, and the Keras-JAX model with
# both FP8 GEMM output settings beside bf16 and the torchao peer.
source "$(dirname "$0")/lib.sh"
device_init 300
result() { { grep RESULT "$OUT/$1.txt" || tail -3 "$OUT/$1.txt"; } | tail -1 | cut -c1-500 | tee -a "$LOG"; }
step build 150 python3 -m torch_ops build; tail -1 "$OUT/build.txt" | tee -a "$LOG"; rm -f "$OUT/build.txt"
KERAS_BACKEND=torch step tests 90 python3 -m pytest tests/test_torch_dispatch.py tests/test_saving.py -q -p no:cacheprovider --tb=short -W ignore
tail -1 "$OUT/tests.txt" | tee -a "$LOG"
KERAS_BACKEND=torch step small_profile 40 python3 benchmarks/profile_layer_torch.py --shape 4096x1024x1024
grep "^## " "$OUT/small_profile.txt" | tee -a "$LOG"
JF=--xla_gpu_enable_triton_gemm=false
KERAS_BACKEND=jax XLA_FLAGS=$JF KERAS_FP8_JAX_GEMM_OUTPUT=compute step jax_test 45 python3 -m pytest tests/test_jax_gpu.py -q -p no:cacheprovider --tb=short -W ignore
tail -1 "$OUT/jax_test.txt" | tee -a "$LOG"
M="benchmarks/model.py --stack keras --warmup 3 --steps 6"
KERAS_BACKEND=jax XLA_FLAGS=$JF KERAS_FP8_JAX_GEMM_OUTPUT=compute step jax_fp8_compute 45 python3 $M --policy fp8_hybrid; result jax_fp8_compute
KERAS_BACKEND=jax XLA_FLAGS=$JF step jax_bf16 35 python3 $M --policy mixed_bfloat16; result jax_bf16
KERAS_BACKEND=jax XLA_FLAGS=$JF step jax_fp8_f32 45 python3 $M --policy fp8_hybrid; result jax_fp8_f32
step torchao 70 python3 benchmarks/model.py --stack torch --torchao --warmup 3 --steps 6; result torchao
say "[$(($(date +%s) - T0))s] done"
