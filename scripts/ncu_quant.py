"""Calls for Nsight Compute: the transposing quantize kernel (versions from
argv, default 3 and 4) and the non-transposing one at 16384x4096 bf16, each
three times after two warm-ups, with a device copy for comparison.

    ncu --clock-control none --set full -k regex:quant python3 scripts/ncu_quant.py 3 4
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_ops  # noqa: E402
from torch_ops import linear as lin  # noqa: E402

R, C = (int(v) for v in os.environ.get("NCU_SHAPE", "16384x4096").split("x"))
x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
hist = torch.zeros(1024, device="cuda")
scale = torch.ones((), device="cuda")
e4 = torch.float8_e4m3fn
torch_ops.quantize_delayed(x, hist, scale, e4)
ext = lin._ext()
for v in [int(a) for a in sys.argv[1:]] or [3, 4]:
    ext.set_tile_version(v)
    for _ in range(5):
        torch_ops.quantize_delayed(x, hist, scale, e4, transpose=True)
ext.set_tile_version(0)
for _ in range(5):
    torch_ops.quantize_delayed(x, hist, scale, e4, transpose=False)
for _ in range(3):
    x.clone()
torch.cuda.synchronize()
print("ok")
