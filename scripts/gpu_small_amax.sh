#!/usr/bin/env bash
# One device call for the small path on our GEMMs (csrc/gemm_amax.cu): the
# build, its tests, the graph probe, linear.py at the small shapes with the
# default TORCH_OPS_GEMM_AMAX_GRAPHS and with 1, the full suite (written
# for session 17's branch, used in session 18). Run from the repo root on the GPU
# machine after installing the wheels (.whl, ../shared/tools/gpu-wheels.sh):
#   bash scripts/gpu_small_amax.sh
# Logs under $OUT/x (one file per step).
ROOT=$PWD
export MAX_JOBS=12 PYTHONPATH=/tmp/site:$ROOT TORCH_EXTENSIONS_DIR=/tmp/torch_ext
source scripts/lib.sh
OUT=${OUT:-/tmp/out}/x
device_init 560
step build 170 python3 -m torch_ops build || exit 1
KERAS_BACKEND=torch step gtests 120 python3 -m pytest tests/torch_ops/test_torch_ops_gemm_amax.py -q -p no:cacheprovider --tb=short -W ignore
tail -8 "$OUT/gtests.txt"
step gprobe 90 python3 scripts/gemm_amax_graph_probe.py
tail -26 "$OUT/gprobe.txt"
step lbench 100 python3 benchmarks/linear.py --shapes 4096x1024x1024,1024x2048x1024 --no-torchao --small-iters 600
TORCH_OPS_GEMM_AMAX_GRAPHS=1 step lbench_graphs 100 python3 benchmarks/linear.py --shapes 4096x1024x1024,1024x2048x1024 --no-torchao --small-iters 600
grep -A4 "^| M x K x N" "$OUT/lbench.txt" | head -5; grep -A4 "^| M x K x N" "$OUT/lbench_graphs.txt" | head -5
KERAS_BACKEND=torch step tests 170 python3 -m pytest tests/torch_ops tests/test_torch_dispatch.py tests/test_saving.py tests/test_loss_scaling.py -q -p no:cacheprovider --tb=short -W ignore
tail -5 "$OUT/tests.txt"
