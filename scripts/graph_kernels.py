"""The kernels of one captured small-shape training step, as the GPU ran
them in a graph replay (torch.profiler): name, start relative to the
replay's first kernel, duration, and the gap before each, for nn.Linear's
step and fp8_linear's in each graph mode. Where a step's replay time goes
beyond its kernels' (docs/benchmarks.md, session 21).

Usage (GPU): python scripts/graph_kernels.py [MxKxN ...]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import torch_ops
from benchmarks.timing import capture_graph


def kernels_of(graph, replays=20):
    """[(name, start_us, dur_us)] of the last of `replays` replays."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    per = len(evs) // replays
    last = evs[-per:] if per else []
    return [(e.name, e.time_range.start, e.time_range.end - e.time_range.start) for e in last]


def main(shapes):
    ext = torch_ops.linear._ext()
    bf = torch.bfloat16
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=bf, requires_grad=True)
        g = torch.randn(M, N, device="cuda", dtype=bf) * 1e-3
        lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=bf)
        state = torch_ops.FP8LinearState.create(1024, device="cuda")

        def step_bf16():
            x.grad = lin.weight.grad = None
            lin(x).backward(g)

        def step_ours(mode):
            def run():
                x.grad = lin.weight.grad = None
                was = ext.set_gemm_amax_in_graphs(mode)
                try:
                    torch_ops.fp8_linear(x, lin.weight, state=state).backward(g)
                finally:
                    ext.set_gemm_amax_in_graphs(was)
            return run

        steps = {"nn.Linear": step_bf16}
        steps.update({f"fp8_linear, graph mode {m}": step_ours(m) for m in (0, 1, 2, 3)})
        for name, fn in steps.items():
            ks = kernels_of(capture_graph(fn))
            if not ks:
                print(f"\n{M}x{K}x{N} {name}: no kernels recorded")
                continue
            t0 = ks[0][1]
            total = ks[-1][1] + ks[-1][2] - t0
            print(f"\n{M}x{K}x{N} {name}: first kernel start to last kernel end {total:.2f} us")
            prev_end = t0
            for kname, start, dur in ks:
                print(f"  +{start - t0:7.2f} gap {start - prev_end:6.2f} dur {dur:6.2f}  {kname[:110]}")
                prev_end = start + dur


if __name__ == "__main__":
    args = sys.argv[1:] or ["4096x1024x1024", "1024x2048x1024"]
    main([tuple(int(v) for v in a.split("x")) for a in args])
