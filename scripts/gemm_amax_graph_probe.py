"""Where the small path's GPU time goes in CUDA-graph replay (session 17):
the GEMMs of one step as our gemm_amax (with and without its state
records) and as cuBLAS (torch.mm), the backward's two GEMMs in one launch
(gemm_amax_pair, session 20), each step captured into a graph and
replayed; the whole small-path step (fp8_linear) and nn.Linear's. Each
row: back-to-back replays (GPU time), one synchronized replay per sample
as benchmarks/linear.py's graph column (that also holds the host's
launch of the graph until its first kernel), and the host's time in
graph.replay() alone.

Usage (GPU): python scripts/gemm_amax_graph_probe.py [--shapes MxKxN,...]
[--only SUBSTRING,...] (rows whose name holds one of them)
"""

import argparse
import statistics
import time

import torch

import torch_ops
from benchmarks.timing import capture_graph


def replay_us(fn, iters=300):
    g = capture_graph(fn)
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    back_to_back = sorted(times)[2]
    isolated, host = [], []
    for _ in range(200):
        start.record()
        t0 = time.perf_counter()
        g.replay()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        isolated.append(start.elapsed_time(end) * 1000)
    return back_to_back, statistics.median(isolated), statistics.median(host)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x1024x1024,1024x2048x1024")
    parser.add_argument("--only", default="", help="comma-separated substrings of the row names to run")
    args = parser.parse_args()
    only = [o for o in args.only.split(",") if o]
    ext = torch_ops.linear._ext()
    bf = torch.bfloat16
    for M, K, N in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        x = torch.randn(M, K, device="cuda", dtype=bf)
        w = torch.randn(N, K, device="cuda", dtype=bf) * 0.05
        g = torch.randn(M, N, device="cuda", dtype=bf) * 1e-3
        hs = [(torch.zeros(1024, device="cuda"), torch.ones((), device="cuda")) for _ in range(3)]
        st = lambda i: [hs[i][0], hs[i][1]]  # noqa: E731
        rows = {
            "fwd cuBLAS (x @ W^T)": lambda: torch.mm(x, w.t()),
            "fwd ours, no record": lambda: ext.gemm_amax(x, w, 0, [], [], 0, 0, 0, 1.0),
            "fwd ours, record x": lambda: ext.gemm_amax(x, w, 0, st(0), [], 0, 0, 0, 1.0),
            "fwd ours, record W": lambda: ext.gemm_amax(x, w, 0, [], st(1), 0, 0, 0, 1.0),
            "fwd ours, record x and W": lambda: ext.gemm_amax(x, w, 0, st(0), st(1), 0, 0, 0, 1.0),
            "dX cuBLAS (g @ W)": lambda: torch.mm(g, w),
            "dX ours, no record": lambda: ext.gemm_amax(g, w, 1, [], [], 1, 0, 0, 1.0),
            "dX ours, record g": lambda: ext.gemm_amax(g, w, 1, st(2), [], 1, 0, 0, 1.0),
            "dX ours, record g and W": lambda: ext.gemm_amax(g, w, 1, st(2), st(1), 1, 0, 0, 1.0),
            "dW cuBLAS (g^T @ x)": lambda: torch.mm(g.t(), x),
            "dW ours, no record": lambda: ext.gemm_amax(g, x, 2, [], [], 1, 0, 0, 1.0),
            "dW ours, record x": lambda: ext.gemm_amax(g, x, 2, [], st(0), 1, 0, 0, 1.0),
            "dW ours, record g and x": lambda: ext.gemm_amax(g, x, 2, st(2), st(0), 1, 0, 0, 1.0),
            # Two forwards in one graph: the second one's cost is the kernel's
            # without the graph's start (ours: its start hidden by PDL).
            "fwd cuBLAS x2": lambda: (torch.mm(x, w.t()), torch.mm(x, w.t())),
            "fwd ours, no record x2": lambda: (ext.gemm_amax(x, w, 0, [], [], 0, 0, 0, 1.0),
                                               ext.gemm_amax(x, w, 0, [], [], 0, 0, 0, 1.0)),
            "fwd ours, record x and W x2": lambda: (ext.gemm_amax(x, w, 0, st(0), st(1), 0, 0, 0, 1.0),
                                                    ext.gemm_amax(x, w, 0, st(0), st(1), 0, 0, 0, 1.0)),
            # Three GEMMs of a step, raw (no autograd), by where the records go.
            "3 GEMMs cuBLAS": lambda: (torch.mm(x, w.t()), torch.mm(g, w), torch.mm(g.t(), x)),
            "3 GEMMs: fwd ours (x, W), dX ours (g), dW cuBLAS": lambda: (
                ext.gemm_amax(x, w, 0, st(0), st(1), 0, 0, 0, 1.0), ext.gemm_amax(g, w, 1, st(2), [], 1, 0, 0, 1.0),
                torch.mm(g.t(), x)),
            "3 GEMMs: fwd cuBLAS, dX ours (g, W), dW ours (x)": lambda: (
                torch.mm(x, w.t()), ext.gemm_amax(g, w, 1, st(2), st(1), 1, 0, 0, 1.0),
                ext.gemm_amax(g, x, 2, [], st(0), 1, 0, 0, 1.0)),
            "3 GEMMs: fwd cuBLAS, dX cuBLAS, dW ours (g, x) + W's fwd ours": lambda: (
                ext.gemm_amax(x, w, 0, [], st(1), 0, 0, 0, 1.0), torch.mm(g, w),
                ext.gemm_amax(g, x, 2, st(2), st(0), 1, 0, 0, 1.0)),
            "dX + dW cuBLAS": lambda: (torch.mm(g, w), torch.mm(g.t(), x)),
        }

        if ext.gemm_amax_pair_applies(g, w, 1, g, x):  # all tiles in one wave
            rows["dX + dW ours (one launch), no record"] = \
                lambda: ext.gemm_amax_pair(g, w, 1, g, x, [[], [], [], []], [0, 0, 0, 0], 0, 1.0)
            rows["dX + dW ours (one launch), record g"] = \
                lambda: ext.gemm_amax_pair(g, w, 1, g, x, [st(2), [], [], []], [1, 0, 0, 0], 0, 1.0)
            rows["dX + dW ours (one launch), record g, W, x"] = \
                lambda: ext.gemm_amax_pair(g, w, 1, g, x, [st(2), st(1), [], st(0)], [1, 0, 0, 0], 0, 1.0)
        lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=bf)
        state = torch_ops.FP8LinearState.create(device="cuda")
        xr = x.clone().requires_grad_()

        def step_bf16():
            lin(xr).backward(g)

        def step_ours():
            torch_ops.fp8_linear(xr, lin.weight, state=state).backward(g)

        def in_graphs(mode, fn):
            def run():
                was = ext.set_gemm_amax_in_graphs(mode)
                try:
                    fn()
                finally:
                    ext.set_gemm_amax_in_graphs(was)
            return run

        def fresh_grads(fn):  # as benchmarks/linear.py: no accumulation into .grad
            def run():
                xr.grad = lin.weight.grad = None
                fn()
            return run

        # The gradients accumulate into .grad (one add per leaf each step) or
        # are set to None first (as zero_grad(set_to_none=True) and
        # benchmarks/linear.py).
        for tag, wrap in (("", lambda fn: fn), (", grads set to None", fresh_grads)):
            rows["step nn.Linear" + tag] = wrap(step_bf16)
            rows["step fp8_linear, captured: cuBLAS + state kernel" + tag] = wrap(in_graphs(0, step_ours))
            rows["step fp8_linear, captured: our GEMMs" + tag] = wrap(in_graphs(1, step_ours))
            rows["step fp8_linear, captured: auto (mode 2)" + tag] = wrap(in_graphs(2, step_ours))
            rows["step fp8_linear, captured: cuBLAS fwd (mode 3)" + tag] = wrap(in_graphs(3, step_ours))
        print(f"\n{M}x{K}x{N}: us per replay: back to back (median of 5 x 300) | one synchronized replay "
              "(median of 200, as linear.py) | host time in replay()")
        for name, fn in rows.items():
            if only and not any(o in name for o in only):
                continue
            b2b, iso, host = replay_us(fn)
            print(f"  {name:68s} {b2b:8.2f} | {iso:8.2f} | {host:6.1f}")


if __name__ == "__main__":
    main()
