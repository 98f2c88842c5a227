"""Where an eager torch_ops.fp8_linear step spends GPU time: kernel by kernel.

    python benchmarks/profile_linear.py [--shape 16384x4096x4096] [--min-gemm-size N] [--cpu] [--timeline]

Runs forward+backward (bf16 x, weight and output gradient, as in
benchmarks/linear.py) under torch.profiler after warm-up, then prints for one
step every GPU kernel with its duration and the idle gap before it, and the
step's span, busy time and total gap. A gap is time the GPU waited for the
host (or for a synchronization).

`--timeline`: one synchronized step per variant (nn.Linear, ours default,
ours with training=False) as a time line, host and GPU together: every
profiled host op or CUDA runtime call and every kernel, with its start and
end relative to the step's first host event and the thread it ran on (the
backward runs on the autograd engine's device thread). This shows whether
the end of a small synchronized step waits for the host or for the GPU.
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


# Host ops that only make views or metadata: left out of the time line.
_TRIVIAL = ("aten::t", "aten::transpose", "aten::as_strided", "aten::resolve_conj", "aten::resolve_neg",
            "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::expand", "aten::detach", "detach",
            "aten::empty_strided", "aten::is_same_size", "cudaGetDevice", "cudaGetLastError",
            "cudaPeekAtLastError", "cudaDeviceGetAttribute")


def timeline(step, steps=30, max_rows=90):
    """Prints the last of `steps` synchronized steps as (start, end, thread,
    name) rows, host and GPU events merged and ordered by start."""
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("## step"):
                step()
                torch.cuda.synchronize()
    evs = prof.events()
    marks = sorted(e.time_range.start for e in evs if e.name == "## step")
    t0 = marks[-1]
    rows = sorted((e.time_range.start - t0, e.time_range.end - t0, "gpu" if e.device_type ==
                   torch.autograd.DeviceType.CUDA else f"t{e.thread % 1000}", e.name)
                  for e in evs if e.time_range.start >= t0 and e.name != "## step" and e.name not in _TRIVIAL)
    end = max(r[1] for r in rows)
    print(f"step span {end:.1f} us (host + GPU; profiler on)\n")
    print("| start us | end us | where | event |\n|---|---|---|---|")
    for s0, e0, where, name in rows[:max_rows]:
        print(f"| {s0:.1f} | {e0:.1f} | {where} | {name[:70]} |")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="16384x4096x4096")
    p.add_argument("--min-gemm-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cpu", action="store_true",
                   help="also the host side: CPU time per op and per step (20 steps, back to back)")
    p.add_argument("--timeline", action="store_true",
                   help="only the time line of one synchronized step per variant (host and GPU events)")
    a = p.parse_args(argv)
    M, K, N = (int(v) for v in a.shape.split("x"))
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    variants = {"bf16 nn.Linear": fwd_bwd(lin, x, gy),
                "torch_ops.fp8_linear": fwd_bwd(OursLinear(lin, min_gemm_size=a.min_gemm_size), x, gy)}
    if a.timeline:
        variants["torch_ops.fp8_linear, training=False"] = fwd_bwd(
            OursLinear(lin, min_gemm_size=a.min_gemm_size, record=False), x, gy)
        for name, step in variants.items():
            print(f"\n### {name}, {M}x{K}x{N}: one synchronized step\n")
            timeline(step)
        return
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
