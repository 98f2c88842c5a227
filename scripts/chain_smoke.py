"""Smoke check of gemm_amax_pair's chain (GPU): products against torch.mm at the chain's shapes."""
import torch

import torch_ops

ext = torch_ops.linear._ext()
print("clusters of 2, of 4, query error:", ext.gemm_chain_clusters(0), flush=True)
for M, K, N in ((4096, 1024, 1024), (2048, 2048, 1024), (1024, 4096, 1024), (4000, 1016, 1000)):
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ok = ext.gemm_amax_pair_applies(g, w, 1, g, x)
    if not ok:
        print(f"{M}x{K}x{N}: not taken", flush=True)
        continue
    dx, dw = ext.gemm_amax_pair(g, w, 1, g, x, [[], [], [], []], [0, 0, 0, 0], 0, 1.0)
    torch.cuda.synchronize()
    e1 = ((dx.float() - g.float() @ w.float()).norm() / (g.float() @ w.float()).norm()).item()
    e2 = ((dw.float() - g.float().t() @ x.float()).norm() / (g.float().t() @ x.float()).norm()).item()
    print(f"{M}x{K}x{N} dX relerr {e1:.2e} dW relerr {e2:.2e}", flush=True)
