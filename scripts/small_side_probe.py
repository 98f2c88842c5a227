"""Small shapes, the state launch's stream (a device-run A/B): bf16
nn.Linear forward+backward against fp8_linear's small path with its state
launch on the backward's stream (mode 0), on a side stream beside the
backward's GEMMs (1), the default (2: 1 while captured, 0 otherwise), and
without a state update (training=False, the bound). Three timings side by
side, as benchmarks/linear.py takes them: synchronized (call by call, the
variants alternating), back-to-back (20 calls per sample) and CUDA-graph
replay (GPU time; the variants' graphs replayed in turn); then the host time
of the forward alone and of the backward alone (wall clock per call, the
forward untimed before each backward).

    python scripts/small_side_probe.py [--shapes 4096x1024x1024,1024x2048x1024] [--iters 2000]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_ops  # noqa: E402
from benchmarks.linear import OursLinear, fwd_bwd  # noqa: E402
from benchmarks.timing import _timed_ms, capture_graph, interleaved_median_ms  # noqa: E402


def with_mode(ext, mode, fn):
    """`fn` run with the small path's state launch in `mode` (read when the
    forward builds the backward's hooks)."""

    def step():
        was = ext.set_small_record_stream(mode)
        try:
            fn()
        finally:
            ext.set_small_record_stream(was)

    return step


def graph_medians(fns, rounds, per_round):
    """GPU time per step of each function captured in its own CUDA graph, the
    graphs replayed in turn (`rounds` rounds of `per_round` replays)."""
    graphs = {name: capture_graph(fn) for name, fn in fns.items()}
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, g in graphs.items():
            samples[name] += [_timed_ms(g.replay) for _ in range(per_round)]
    return {name: statistics.median(v) for name, v in samples.items()}, graphs


def host_split(ext, modules, modes, x, gy, reps=7, calls=500):
    """Host microseconds per call of each module's forward alone and of its
    backward alone (the forward untimed before it), no synchronization
    between calls; the modules in turn, median of `reps` runs."""
    fwd = {name: [] for name in modules}
    bwd = {name: [] for name in modules}
    for _ in range(reps):
        for name, m in modules.items():
            was = ext.set_small_record_stream(modes.get(name, 0))
            try:
                torch.cuda.synchronize()
                tf = tb = 0.0
                for _ in range(calls):
                    x.grad = None
                    m.weight.grad = None
                    t0 = time.perf_counter()
                    y = m(x)
                    t1 = time.perf_counter()
                    y.backward(gy)
                    t2 = time.perf_counter()
                    tf += t1 - t0
                    tb += t2 - t1
                torch.cuda.synchronize()
            finally:
                ext.set_small_record_stream(was)
            fwd[name].append(tf / calls * 1e6)
            bwd[name].append(tb / calls * 1e6)
    return ({k: statistics.median(v) for k, v in fwd.items()}, {k: statistics.median(v) for k, v in bwd.items()})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4096x1024x1024,1024x2048x1024")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--trace", default=None, help="a folder: Chrome traces of three replays of each variant's graph")
    a = p.parse_args()
    ext = torch_ops.linear._ext()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for shape in a.shapes.split(","):
        M, K, N = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        fns = {
            "bf16 nn.Linear": fwd_bwd(lin, x, gy),
            "small path, mode 0 (backward's stream)": with_mode(ext, 0, fwd_bwd(OursLinear(lin), x, gy)),
            "small path, mode 1 (side stream)": with_mode(ext, 1, fwd_bwd(OursLinear(lin), x, gy)),
            "small path, mode 2 (default: side stream while captured)": with_mode(
                ext, 2, fwd_bwd(OursLinear(lin), x, gy)),
            "small path, no state update (training=False)": fwd_bwd(OursLinear(lin, record=False), x, gy),
        }
        sync = interleaved_median_ms(fns, a.iters, 1)
        b2b = interleaved_median_ms(fns, max(1, a.iters // 20), 1, warmup=1, calls=20)
        graph, graphs = graph_medians(fns, 10, 20)
        base = "bf16 nn.Linear"
        print(f"\n## {shape} (ms per forward+backward; ratio = bf16 / variant)\n")
        print("| variant | synchronized | ratio | back-to-back | ratio | CUDA graph | ratio |")
        print("|---|---|---|---|---|---|---|")
        for name in fns:
            print(f"| {name} | {sync[name]:.4f} | {sync[base] / sync[name]:.3f} | {b2b[name]:.4f} | "
                  f"{b2b[base] / b2b[name]:.3f} | {graph[name]:.4f} | {graph[base] / graph[name]:.3f} |")
        if a.trace:
            for i, (name, g) in enumerate(graphs.items()):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        g.replay()
                    torch.cuda.synchronize()
                prof.export_chrome_trace(os.path.join(a.trace, f"graph_{shape}_{i}.json"))
            print(f"traces: {a.trace}/graph_{shape}_<variant index>.json")
        ours = {"mode 0": OursLinear(lin), "mode 1": OursLinear(lin), "training=False": OursLinear(lin, record=False)}
        fwd = {"nn.Linear": lin}
        fwd.update(ours)
        modes = {"mode 1": 1}
        host_f, host_b = host_split(ext, fwd, modes, x, gy)
        print("\nhost us per call, forward alone: " + ", ".join(f"{k} {v:.1f}" for k, v in host_f.items()))
        print("host us per call, backward alone: " + ", ".join(f"{k} {v:.1f}" for k, v in host_b.items()))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
