"""Where an eager torch_ops.fp8_linear step spends GPU time: kernel by kernel.

    python benchmarks/profile_linear.py [--shape 16384x4096x4096] [--min-gemm-size N] [--cpu]

Runs forward+backward (bf16 x, weight and output gradient, as in
benchmarks/linear.py) under torch.profiler after warm-up, then prints for one
step every GPU kernel with its duration and the idle gap before it, and the
step's span, busy time and total gap. A gap is time the GPU waited for the
host (or for a synchronization).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_ops  # noqa: E402
from benchmarks.linear import OursLinear, fwd_bwd  # noqa: E402


def gpu_kernels(prof):
    """(start_us, end_us, name) of every GPU activity, in start order."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="16384x4096x4096")
    p.add_argument("--min-gemm-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cpu", action="store_true",
                   help="also the host side: CPU time per op and per step (20 steps, back to back)")
    a = p.parse_args(argv)
    M, K, N = (int(v) for v in a.shape.split("x"))
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    variants = {"bf16 nn.Linear": fwd_bwd(lin, x, gy),
                "torch_ops.fp8_linear": fwd_bwd(OursLinear(lin, min_gemm_size=a.min_gemm_size), x, gy)}
    for name, step in variants.items():
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                step()
            torch.cuda.synchronize()
        ks = gpu_kernels(prof)
        per = len(ks) // a.steps
        last = ks[-per:]  # the last step (steady state, host queued ahead)
        span = last[-1][1] - last[0][0]
        busy = sum(e - s for s, e, _ in last)
        print(f"\n### {name}, {M}x{K}x{N}: {len(ks)} GPU activities in {a.steps} steps; last step: "
              f"span {span:.1f} us, busy {busy:.1f} us, gaps {span - busy:.1f} us\n")
        print("| kernel | us | gap before (us) |")
        print("|---|---|---|")
        prev_end = None
        for s, e, n in last:
            gap = 0.0 if prev_end is None else s - prev_end
            print(f"| {n[:90]} | {e - s:.1f} | {gap:.1f} |")
            prev_end = e
        # Gaps between steps (the host's turn-around between iterations).
        starts = [ks[i * per][0] for i in range(a.steps)]
        ends = [ks[(i + 1) * per - 1][1] for i in range(a.steps)]
        print("\nbetween steps (us): " + ", ".join(f"{starts[i + 1] - ends[i]:.1f}" for i in range(a.steps - 1)))
        if a.cpu:
            n = 20
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(n):
                    step()
                torch.cuda.synchronize()
            print(f"\nhost, {n} steps (self CPU us per step, top 20):\n")
            rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
            print("| op | calls per step | self us per step | total us per step |")
            print("|---|---|---|---|")
            for e in rows:
                print(f"| {e.key[:80]} | {e.count / n:.1f} | {e.self_cpu_time_total / n:.1f} | {e.cpu_time_total / n:.1f} |")


if __name__ == "__main__":
    main()
