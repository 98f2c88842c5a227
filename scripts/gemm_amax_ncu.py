"""Nsight Compute driver: our gemm_amax (with and without its records) and
cuBLAS's bf16 GEMMs at the small shape where ours is slower in CUDA-graph
replay (1024x2048x1024: the forward and dX), each launched once inside an
NVTX range "prof" after warm-up (session 19).

Usage (GPU):
    ncu --clock-control none --nvtx --nvtx-include "prof/" --set full \\
        -o /tmp/prof python scripts/gemm_amax_ncu.py
    ncu --import /tmp/prof.ncu-rep --page source --csv --print-source sass
"""

import torch

import torch_ops


def main():
    ext = torch_ops.linear._ext()
    bf = torch.bfloat16
    M, K, N = 1024, 2048, 1024
    x = torch.randn(M, K, device="cuda", dtype=bf)
    w = torch.randn(N, K, device="cuda", dtype=bf) * 0.05
    g = torch.randn(M, N, device="cuda", dtype=bf) * 1e-3
    hs = [[torch.zeros(16, device="cuda"), torch.ones((), device="cuda")] for _ in range(3)]
    calls = [
        ("cuBLAS forward", lambda: torch.mm(x, w.t())),
        ("ours forward (split-K)", lambda: ext.gemm_amax(x, w, 0, [], [], 0, 0, 0, 1.0)),
        ("ours forward, recording x and W", lambda: ext.gemm_amax(x, w, 0, hs[0], hs[1], 0, 0, 0, 1.0)),
        ("cuBLAS dX", lambda: torch.mm(g, w)),
        ("ours dX", lambda: ext.gemm_amax(g, w, 1, [], [], 1, 0, 0, 1.0)),
        ("ours dX, recording g", lambda: ext.gemm_amax(g, w, 1, hs[2], [], 1, 0, 0, 1.0)),
    ]
    for name, fn in calls:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("prof")
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(name, "profiled")


if __name__ == "__main__":
    main()
