"""The FP8 GEMMs of the issue model's step (benchmarks/model.py: hidden 4096,
MLP 14336, 16384 tokens) on torch_ops.fp8_gemm, each tuned on its first call
(csrc/gemm.cpp), then timed: milliseconds per GEMM and per model step.

    TORCH_OPS_GEMM_CANDIDATES=16 TORCH_OPS_GEMM_AUTOTUNE_LOG=1 python scripts/gemm_candidates.py

Run it with different TORCH_OPS_GEMM_CANDIDATES to see whether more
heuristic candidates find faster algorithms (a device-run diagnostic).
"""

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_ops  # noqa: E402

T = 16384
# (name, projections of this shape per block, K, N): x (T, K) @ W (K, N).
LAYERS = [("qkv", 1, 4096, 12288), ("out", 1, 4096, 4096), ("gate/up", 2, 4096, 14336), ("down", 1, 14336, 4096)]
BLOCKS = 4


def timed(fn, iters=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    e4, e5, dev = torch.float8_e4m3fn, torch.float8_e5m2, "cuda"
    s = torch.ones((), device=dev)
    total = 0.0
    print(f"TORCH_OPS_GEMM_CANDIDATES={os.environ.get('TORCH_OPS_GEMM_CANDIDATES', '16 (default)')}")
    for name, count, K, N in LAYERS:
        x = torch.randn(T, K, device=dev).to(e4)       # forward a (M, K)
        wt = torch.randn(N, K, device=dev).to(e4)      # forward b (N, K)
        g = torch.randn(T, N, device=dev).to(e5)       # dX a (M, N)
        w = torch.randn(K, N, device=dev).to(e4)       # dX b (K, N)
        xt = torch.randn(K, T, device=dev).to(e4)      # dW a (K, M)
        gt = torch.randn(N, T, device=dev).to(e5)      # dW b (N, M)
        gemms = {
            "fwd": lambda: torch_ops.fp8_gemm(x, wt, s, s, out_dtype=torch.bfloat16, use_fast_accum=True),
            "dX": lambda: torch_ops.fp8_gemm(g, w, s, s, out_dtype=torch.bfloat16, use_fast_accum=False),
            "dW": lambda: torch_ops.fp8_gemm(xt, gt, s, s, out_dtype=torch.float32, use_fast_accum=False),
        }
        for kind, fn in gemms.items():
            ms = timed(fn)
            flops = 2.0 * T * K * N
            total += ms * count * BLOCKS
            print(f"{name:8s} {kind:3s} ms {ms:.4f}  TFLOP/s {flops / ms / 1e9:.0f}", flush=True)
        del x, wt, g, w, xt, gt
    print(f"model step FP8 GEMMs (sum over {BLOCKS} blocks): {total:.2f} ms")


if __name__ == "__main__":
    main()
