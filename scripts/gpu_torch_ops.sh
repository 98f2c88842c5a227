#!/usr/bin/env bash
# One device call: build the torch_ops extension, smoke-check it, run the GPU
# tests and the benchmarks; logs under $OUT, short summary last.
#   PHASES="build smoke qbench tests lbench" bash scripts/gpu_torch_ops.sh
#   TESTS="tests/torch_ops" PYTEST_ARGS="-k ..." LBENCH_ARGS="--shapes ..." (optional)
set -o pipefail
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PHASES=${PHASES:-"build smoke qbench tests lbench"}
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

{
  log "start: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null)"
  python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'py', sys.version.split()[0])"
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/env.txt"

if has build; then
  log "build"
  timeout 300 python3 -m torch_ops build -v 2>&1 | tee "$OUT/build.txt" | tail -30
  log "build rc=$?"
fi

if has smoke; then
  log "smoke"
  timeout 120 python3 - <<'EOF' 2>&1 | tee "$OUT/smoke.txt"
import torch, torch_ops
from torch_ops import emulation as emu
print("available:", torch_ops.is_available(), torch_ops.unavailable_reason())
e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
for shape in [(17, 33), (4095, 4097), (16384, 4096)]:
    x = (torch.randn(*shape, device="cuda") * 100).bfloat16()
    x.view(-1)[5] = float("nan")
    s = torch.tensor(0.173, device="cuda")
    for dt in (e4, e5):
        q, qt, a = torch_ops.quantize(x, s, dt, transpose=True)
        rq, rqt, ra = emu.quantize(x, s, dt, transpose=True)
        nb = lambda u, v: int(((u.view(torch.uint8) != v.view(torch.uint8)) & ~torch.isnan(v.float())).sum())
        print(shape, dt, "q diff", nb(q, rq), "qt diff", nb(qt, rqt), "amax", a.item(), ra.item())
EOF
  cat > /tmp/gemm_smoke.py <<'EOF'
import torch, torch_ops
from torch_ops import emulation as emu
e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
for line in open("/proc/self/maps"):
    if "cublas" in line and "r-xp" in line:
        print("maps:", line.split()[-1])
for mkn in [(17, 9, 33), (4096, 4096, 4096)]:
    M, K, N = mkn
    a = torch.randn(M, K, device="cuda").to(e4); b = torch.randn(N, K, device="cuda").to(e4)
    s1, s2 = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    o = torch_ops.fp8_gemm(a, b, s1, s2, out_dtype=torch.float32)
    r = emu.fp8_gemm(a, b, s1, s2, out_dtype=torch.float32)
    print("gemm", mkn, "relerr", ((o - r).norm() / r.norm()).item(), flush=True)
st = torch_ops.FP8LinearState.create(16, device="cuda")
x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = torch_ops.fp8_linear(x, w, state=st, min_gemm_size=0); y.backward(torch.randn_like(y))
print("linear ok", y.shape, x.grad.shape, w.grad.shape, st.grad_amax_history[:2].tolist(), st.grad_scale.item())
EOF
  timeout 60 python3 /tmp/gemm_smoke.py 2>&1 | tee -a "$OUT/smoke.txt"
  rc=$?
  log "gemm smoke rc=$rc"
  if [ $rc -ne 0 ]; then
    echo "gemm smoke failed (rc=$rc): backtrace, then TORCH_OPS_GEMM_BACKEND=scaled_mm for the rest" | tee -a "$OUT/smoke.txt"
    timeout 90 cuda-gdb -batch -ex run -ex bt --args python3 /tmp/gemm_smoke.py 2>&1 | grep -E "^#|signal|SIG" | head -40 | tee "$OUT/gdb.txt"
    export TORCH_OPS_GEMM_BACKEND=scaled_mm
    timeout 60 python3 /tmp/gemm_smoke.py 2>&1 | tee -a "$OUT/smoke.txt"
  fi
  log "smoke done"
fi

if has qbench; then
  log "quantize benchmark"
  timeout 90 python3 benchmarks/quantize.py 2>&1 | tee "$OUT/bench_quantize.txt"
fi

if has tests; then
  log "tests"
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest ${TESTS:-tests/torch_ops} -q -p no:cacheprovider -rfE --tb=short \
    --timeout 150 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.txt" | tail -60
  log "tests done"
fi

if has lbench; then
  log "linear benchmark"
  # DEADLINE (seconds since start) caps the benchmark to what is left of the call.
  LT=${LBENCH_TIMEOUT:-240}
  if [ -n "${DEADLINE:-}" ]; then LT=$((DEADLINE - $(date +%s) + T0)); [ $LT -lt 20 ] && LT=20; fi
  log "linear benchmark timeout ${LT}s"
  timeout $LT python3 benchmarks/linear.py ${LBENCH_ARGS:-} 2>&1 | tee "$OUT/bench_linear.txt" | grep -v "^|" | tail -20
fi

echo
echo "================ summary ($(($(date +%s) - T0))s) ================"
grep -E "rc=|available:|failed|maps:" "$OUT"/build.txt "$OUT"/smoke.txt 2>/dev/null | head -6
head -8 "$OUT/gdb.txt" 2>/dev/null
grep -E "diff|relerr|linear ok" "$OUT/smoke.txt" 2>/dev/null | head -12
grep -E "^\| " "$OUT/bench_quantize.txt" 2>/dev/null
tail -3 "$OUT/tests.txt" 2>/dev/null
sed -n '/### summary/,$p' "$OUT/bench_linear.txt" 2>/dev/null
