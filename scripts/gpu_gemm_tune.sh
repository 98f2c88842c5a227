#!/usr/bin/env bash
# One device call for the cuBLASLt GEMM autotuning (csrc/gemm.cpp): build, the
# GEMM + linear GPU tests, then benchmarks/linear.py at the three large shapes
# twice: autotuning off (TORCH_OPS_GEMM_AUTOTUNE=0, heuristic top-1, no torchao)
# and on (the default, with torchao; one line per tuned plan from
# TORCH_OPS_GEMM_AUTOTUNE_LOG=1). Logs under $OUT (5 files), both summaries last.
#   OUT=/tmp/out bash scripts/gpu_gemm_tune.sh       (BUDGET: seconds for the whole script)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-330}
SHAPES=${SHAPES:-16384x4096x4096,16384x4096x14336,16384x14336x4096}
ITERS=${ITERS:-20}
left() { echo $((BUDGET - ($(date +%s) - T0))); }

PHASES="build tests" TESTS_TIMEOUT=${TESTS_TIMEOUT:-150} \
  TESTS="tests/torch_ops/test_torch_ops_kernels.py::GemmKernelTest tests/torch_ops/test_torch_ops_linear.py" \
  OUT=$OUT bash scripts/gpu_torch_ops.sh > "$OUT/build_tests_console.txt" 2>&1
tail -4 "$OUT/tests.txt"

echo "[$(($(date +%s) - T0))s] linear benchmark, autotune off (timeout 75s)"
TORCH_OPS_GEMM_AUTOTUNE=0 timeout 75 python3 benchmarks/linear.py --shapes "$SHAPES" --iters "$ITERS" --no-torchao \
  > "$OUT/bench_linear_off.txt" 2>&1
echo "[$(($(date +%s) - T0))s] linear benchmark, autotune on (timeout $(left)s)"
L=$(left); ((L < 30)) && L=30
TORCH_OPS_GEMM_AUTOTUNE_LOG=1 timeout "$L" python3 benchmarks/linear.py --shapes "$SHAPES" --iters "$ITERS" \
  > "$OUT/bench_linear.txt" 2>&1

echo
echo "================ summary ($(($(date +%s) - T0))s) ================"
grep -E "rc=|available:" "$OUT/build_tests_console.txt" | head -4
tail -2 "$OUT/tests.txt"
echo "--- autotune log (on run)"
grep "autotune:" "$OUT/bench_linear.txt"
echo "--- autotune OFF"
grep -E "^# |Error|error" "$OUT/bench_linear_off.txt" | head -3
if grep -q "### summary" "$OUT/bench_linear_off.txt"; then sed -n '/### summary/,$p' "$OUT/bench_linear_off.txt"
else grep -E "^(###|\| )" "$OUT/bench_linear_off.txt"; fi
echo "--- autotune ON"
grep -E "^# |Error|error" "$OUT/bench_linear.txt" | head -3
grep -E "^(###|\| )" "$OUT/bench_linear.txt"
