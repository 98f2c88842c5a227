#!/usr/bin/env bash
# The GPU test run: builds the torch_ops kernels, then runs the test suite
# with TORCH_OPS_REQUIRE_KERNELS=1 (a kernel build that fails fails the
# tests), one log per part under LOG_DIR. `all` runs the three parts side by
# side, each with 4 pytest-xdist workers where xdist imports (about 5
# minutes on one H200 with 16 cores); each log ends with the skip reasons.
#
#   bash tools/gpu_tests.sh LOG_DIR [torch|keras-torch|keras-jax|all]
set -uo pipefail
log_dir=${1:?usage: gpu_tests.sh LOG_DIR [part]}
part=${2:-all}
mkdir -p "$log_dir" && log_dir=$(cd "$log_dir" && pwd)
export PYTHONUNBUFFERED=1 TORCH_OPS_REQUIRE_KERNELS=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/.." || exit 1
if ls .whl/*.whl > /dev/null 2>&1 && ! KERAS_BACKEND=jax python3 -c "import keras" > /dev/null 2>&1; then  # as tools/gpu_bench.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 - <<'PY' | tee "$log_dir/env.txt"
import platform, subprocess
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip())
for name in ("jax", "keras", "torchao", "transformer_engine"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:  # noqa: BLE001
        print(name, "not importable:", type(e).__name__)
PY
start=$(date +%s)
python3 -m torch_ops build > "$log_dir/build.txt" 2>&1
echo "build rc=$? in $(( $(date +%s) - start )) s" | tee -a "$log_dir/build.txt"
run() {  # run NAME SECONDS BACKEND PYTEST_ARGS...
  local name=$1 limit=$2 backend=$3; shift 3
  local t0; t0=$(date +%s)
  KERAS_BACKEND=$backend timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=10 \
    "${workers[@]}" "$@" \
    > "$log_dir/$name.txt" 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t0 )) s: $(tail -n 1 "$log_dir/$name.txt")" | tee -a "$log_dir/summary.txt"
}
workers=()
python3 -c "import xdist" > /dev/null 2>&1 && workers=(-n 4)
case $part in
  torch|all) run torch_ops 420 torch tests/torch_ops tests/keras/test_torch_backend.py tests/keras/test_bad_input.py & ;;&
  keras-torch|all) run keras_torch 420 torch tests --ignore=tests/torch_ops --ignore=tests/keras/test_torch_backend.py \
      --ignore=tests/keras/test_bad_input.py & ;;&
  keras-jax|all) run keras_jax 420 jax tests --ignore=tests/torch_ops & ;;
esac
wait
