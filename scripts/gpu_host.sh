#!/usr/bin/env bash
# One device call for the host time of an FP8 linear call (issues 3 and 4),
# capped at $BUDGET s: build this tree (and, if $OLD holds an earlier tree's
# torch_ops/, csrc/, keras_fp8/ and benchmarks/, that one too, for same-run
# before/after rows), the GPU tests of the touched code, then the host-time
# and small-shape benchmarks, each new then old.
#   BUDGET=330 OLD=.hp_old bash scripts/gpu_host.sh
source "$(dirname "$0")/lib.sh"
device_init 330
PHASES=${PHASES:-"build tests layer linear profile model"}  # also: kprofile
OLD=${OLD:-}
[ -n "$OLD" ] && [ ! -d "$OLD/torch_ops" ] && OLD=
old() {  # old NAME LIMIT CMD...: CMD on the old tree (its own build cache)
  local name=$1 lim=$2; shift 2
  [ -z "$OLD" ] && return 0
  echo "=== OLD ($OLD) $*" >> "$OUT/$name.txt"
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext_old PYTHONPATH="$PWD/$OLD:$PYTHONPATH" step "$name" "$lim" "$@"
}
new() {
  local name=$1; echo "=== NEW $*" >> "$OUT/$name.txt"; step "$@"
}
say "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader) $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)') old=${OLD:-none}"
if has build; then
  if [ -n "$OLD" ]; then
    (cd "$OLD" && TORCH_EXTENSIONS_DIR=/tmp/torch_ext_old PYTHONPATH="$PWD:$PYTHONPATH" \
      timeout 200 python3 -m torch_ops build > "$OUT/build_old.log" 2>&1; echo "old build rc=$?" >> "$LOG") &
  fi
  step build 200 python3 -m torch_ops build; tail -2 "$OUT/build.txt" | tee -a "$LOG"
  wait; cat "$OUT/build_old.log" >> "$OUT/build.txt" 2>/dev/null; rm -f "$OUT/build_old.log"
fi
if has tests; then
  KERAS_BACKEND=torch step tests ${TESTS_LIMIT:-150} python3 -m pytest ${TESTS:-tests/torch_ops/test_torch_ops_linear.py tests/torch_ops/test_torch_ops_fold.py tests/test_torch_dispatch.py tests/test_training.py tests/test_loss_scaling.py tests/test_saving.py} -q -p no:cacheprovider --tb=short -W ignore
  tail -1 "$OUT/tests.txt" | tee -a "$LOG"; grep -E "^FAILED|^ERROR" "$OUT/tests.txt" | head -20 | tee -a "$LOG"
fi
LAYER="--shapes ${LAYER_SHAPES:-4096x1024x1024,16384x4096x14336} --kinds bf16,fp8 --iters 10"
if has layer; then
  KERAS_BACKEND=torch new layer 60 python3 benchmarks/keras_layer.py $LAYER
  KERAS_BACKEND=torch old layer 60 python3 "$OLD/benchmarks/keras_layer.py" $LAYER
  grep -E "^===|^###|^\| |host|FAILED" "$OUT/layer.txt" | tee -a "$LOG"
fi
if has linear; then
  new linear 60 python3 benchmarks/linear.py --shapes 4096x1024x1024,1024x2048x1024 --no-torchao
  old linear 60 python3 "$OLD/benchmarks/linear.py" --shapes 4096x1024x1024,1024x2048x1024 --no-torchao
  grep -E "^===|^\| (ours|bf16|nn)|graph" "$OUT/linear.txt" | head -30 | tee -a "$LOG"
fi
if has profile; then
  KERAS_BACKEND=torch new profile 40 python3 benchmarks/profile_layer_torch.py --shape 4096x1024x1024 --top 30
  KERAS_BACKEND=torch old profile 40 python3 "$OLD/benchmarks/profile_layer_torch.py" --shape 4096x1024x1024 --top 30
  grep -E "^===|^## " "$OUT/profile.txt" | tee -a "$LOG"
fi
SMALL="--stack keras --hidden 1024 --mlp 2816 --heads 8 --seq 512 --vocab 8000 --warmup 3 --steps 10"
if has model; then
  KERAS_BACKEND=torch new model 45 python3 benchmarks/model.py --policy mixed_bfloat16 $SMALL
  KERAS_BACKEND=torch new model 45 python3 benchmarks/model.py --policy fp8_hybrid $SMALL
  KERAS_BACKEND=torch old model 45 python3 "$OLD/benchmarks/model.py" --policy fp8_hybrid $SMALL
  grep -E "^===|RESULT" "$OUT/model.txt" | cut -c1-160 | tee -a "$LOG"
fi
if has kprofile; then  # GPU busy vs wall and host syncs of a small-model step
  for p in fp8_hybrid mixed_bfloat16; do
    KERAS_BACKEND=torch new kprofile 40 python3 benchmarks/profile_keras_torch.py --policy $p --top 25 ${SMALL% --warmup*}
  done
  grep -E "^===|^# |host-synchronizing|  sync" "$OUT/kprofile.txt" | tee -a "$LOG"
fi
say "[$(($(date +%s) - T0))s] done"
