#!/usr/bin/env bash
# The GPU benchmark run (docs/benchmarks.md): every benchmark the results
# page needs, one log per script under LOG_DIR (each log holds the tables
# and every worker's RESULT lines).
#
#   bash tools/gpu_bench.sh LOG_DIR [PART...]
#
# PART (default: 1 2 3 4) on one H200, each group under ten minutes:
#   1  build linear quantize layer small   (~9-10 min)
#   2  build model                         (~7-8 min: torch + JAX, --monitor)
#   3  quality: bf16, delayed, current     (~6 min: the GPU size, JAX)
#   4  quality_block: block                (~4 min: bf16 from the committed
#      benchmarks/results/quality_gpu.json; merge the two JSON files with
#      `quality.py --from-json A,B --json benchmarks/results/quality_gpu.json`)
#   5  quality_seeds: bf16 and delayed at seeds 1 and 2, the two seeds'
#      processes side by side (~6 min; the gaps beside seed 0's:
#      `quality.py --across-seeds A,B,C`)
#   6  probe: tools/jax_fp8_dot_probe.py, every way (~4 min)
#   7  model_xla: the JAX decoder with the backend's custom calls off
#      (model.py --jax-xla-fp8: XLA's quantize fusions and FP8 dot; ~2 min)
#   8  quality_seeds_more: as 5 at seeds 3 and 4 (the five seeds' gaps:
#      `quality.py --across-seeds A,B,C,D,E`)
#   9  build model_loss: the torch decoder under Keras's loss and the same
#      loss on flattened rows (model.py --loss keras / flat; ~4 min)
# or the single parts by name. A run stops starting work SECONDS after it
# began (default 570; GPU_BENCH_SECONDS=...): each part gets at most its own
# limit and what is left, and passes it on as its scripts' --time-budget, so
# a part cut short still prints its table from the processes that ran. The
# compilation caches (kernels, inductor, XLA) live under /tmp: the second
# and third process of a script reuse the first one's work. Where .whl/
# holds wheels (for a machine without Keras) they are installed into
# /tmp/site first, as for tools/gpu_tests.sh. Each group writes at most 8
# files: group 1 (summary, build, linear, quantize, layer, model_small),
# group 2 (summary, build, model), groups 3 and 4 (summary, the quality log
# and its JSON, and group 3's PNG).
set -uo pipefail
log_dir=${1:?usage: gpu_bench.sh LOG_DIR [PART...]}
shift
parts=${*:-1 2 3 4}
mkdir -p "$log_dir" && log_dir=$(cd "$log_dir" && pwd)
cd "$(dirname "$0")/.." || exit 1
deadline=$(( $(date +%s) + ${GPU_BENCH_SECONDS:-570} ))
export PYTHONUNBUFFERED=1 TORCH_OPS_REQUIRE_KERNELS=1
if ls .whl/*.whl > /dev/null 2>&1 && ! KERAS_BACKEND=jax python3 -c "import keras" > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" | tee -a "$log_dir/summary.txt"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
if [ ! -s "$log_dir/summary.txt" ]; then
  python3 -c "from benchmarks import timing; print(timing.env_line(timing.environment()))" \
    >> "$log_dir/summary.txt" 2>&1
fi

run() {  # run NAME LIMIT COMMAND...: at most LIMIT s (and what is left); @BUDGET@ = that minus 15 s
  local name=$1 limit=$2; shift 2
  local left=$(( deadline - $(date +%s) ))
  (( left < limit )) && limit=$left
  if (( limit < 30 )); then
    echo "$name not run: ${left} s left of the run" | tee -a "$log_dir/summary.txt"
    return
  fi
  local args=() a
  for a in "$@"; do args+=("${a//@BUDGET@/$(( limit - 15 ))}"); done
  local t0; t0=$(date +%s)
  timeout "$limit" "${args[@]}" > "$log_dir/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc in $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$log_dir/summary.txt"
}

quality_at_seeds() {  # quality_at_seeds SEED...: bf16 and delayed at each seed, the seeds side by side
  local seed
  for seed in "$@"; do
    run "quality_seed$seed" 560 env KERAS_BACKEND=jax XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 python3 \
      benchmarks/quality.py --size gpu --seed "$seed" --recipes bf16,delayed --time-budget @BUDGET@ \
      --json "$log_dir/quality_gpu_seed$seed.json" &
  done
  wait
}

part() {
  case $1 in
    build) run build 150 python3 -m torch_ops build ;;
    linear) run linear 240 python3 benchmarks/linear.py --processes 3 --time-budget @BUDGET@ \
        --process-timeout 120 ;;
    quantize) run quantize 60 python3 benchmarks/quantize.py --processes 3 --time-budget @BUDGET@ \
        --process-timeout 40 ;;
    layer) run layer 200 python3 benchmarks/keras_layer.py --processes 3 --backends torch,jax \
        --time-budget @BUDGET@ --process-timeout 60 ;;
    small) run model_small 120 python3 benchmarks/model.py --size small --processes 3 --backends torch \
        --peers none --time-budget @BUDGET@ --process-timeout 60 ;;
    model) run model 480 python3 benchmarks/model.py --processes 3 --backends torch,jax --monitor \
        --time-budget @BUDGET@ --process-timeout 170 ;;
    quality) run quality 560 env KERAS_BACKEND=jax python3 benchmarks/quality.py --size gpu \
        --recipes bf16,delayed,current --time-budget @BUDGET@ --plot "$log_dir/quality_gpu.png" \
        --json "$log_dir/quality_gpu.json" ;;
    quality_block) run quality_block 560 env KERAS_BACKEND=jax python3 benchmarks/quality.py --size gpu \
        --recipes block --baseline-json benchmarks/results/quality_gpu.json --json "$log_dir/quality_block.json" ;;
    quality_seeds) quality_at_seeds 1 2 ;;
    quality_seeds_more) quality_at_seeds 3 4 ;;
    probe) run probe 240 python3 tools/jax_fp8_dot_probe.py --hlo-dir /tmp/jax_fp8_dot_hlo ;;
    model_loss)
      local loss
      for loss in keras flat; do
        run "model_loss_$loss" 110 python3 benchmarks/model.py --processes 3 --backends torch --loss "$loss" \
          --peers none --no-shortcut-ablation --time-budget @BUDGET@ --process-timeout 60
      done ;;
    model_xla) run model_xla_fp8 150 python3 benchmarks/model.py --processes 3 --backends jax --jax-xla-fp8 \
        --time-budget @BUDGET@ --process-timeout 100 ;;
    1) part build; part linear; part quantize; part layer; part small ;;
    2) part build; part model ;;
    3) part quality ;;
    4) part quality_block ;;
    5) part quality_seeds ;;
    6) part probe ;;
    7) part model_xla ;;
    8) part quality_seeds_more ;;
    9) part build; part model_loss ;;
    *) echo "unknown part $1" | tee -a "$log_dir/summary.txt" ;;
  esac
}
for p in $parts; do
  part "$p"
done
