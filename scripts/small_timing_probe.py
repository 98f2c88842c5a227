"""Why benchmarks/linear.py and benchmarks/host_overhead.py disagree at the
small shapes (a device-run diagnostic): the same forward+backward steps,
called as a module (linear.py's OursLinear) and as a plain function
(host_overhead.py), each timed both ways in one alternating loop: host wall
time around the call and a synchronize, and CUDA events around the call.

    python scripts/small_timing_probe.py [--shape 4096x1024x1024] [--iters 1500]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_ops  # noqa: E402
from benchmarks.host_overhead import fwd_bwd_step, make_inputs  # noqa: E402
from benchmarks.linear import OursLinear  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="4096x1024x1024")
    p.add_argument("--iters", type=int, default=1500)
    a = p.parse_args()
    M, K, N = (int(v) for v in a.shape.split("x"))
    lin, x, gy = make_inputs(M, K, N, "cuda")
    st = torch_ops.FP8LinearState.create(1024, device="cuda")
    st_off = torch_ops.FP8LinearState.create(1024, device="cuda")
    w = lin.weight
    ours, ours_off = OursLinear(lin), OursLinear(lin, record=False)
    product = torch_ops.FP8Linear.from_linear(lin)  # the library's module (its own state)
    ext = torch_ops.linear._ext()
    st_ext = torch_ops.FP8LinearState.create(1024, device="cuda")
    fast_args = torch_ops.linear._fast_args("hybrid", "delayed", 0.0, "max", "out_in")
    limit = torch_ops.linear._gemm_limit(None)

    def step(fn):
        return fwd_bwd_step(fn, x, w, gy)

    fns = {
        "nn.Linear (module)": step(lambda: lin(x)),
        "OursLinear default (module, as linear.py)": step(lambda: ours(x)),
        "OursLinear training=False (module)": step(lambda: ours_off(x)),
        "OursLinear.forward (no Module.__call__)": step(lambda: ours.forward(x)),
        "fp8_linear with OursLinear's state": step(lambda: torch_ops.fp8_linear(x, w, state=ours.state)),
        "fp8_linear default (function, as host_overhead.py)": step(lambda: torch_ops.fp8_linear(x, w, state=st)),
        "fp8_linear training=False (function)": step(
            lambda: torch_ops.fp8_linear(x, w, state=st_off, training=False)),
        "torch_ops.FP8Linear (module)": step(lambda: product(x)),
        "C++ entry called directly (no Python path)": step(
            lambda: ext.linear(x, w, None, st_ext.tensors(), *fast_args, True, None, limit)),
    }
    for fn in fns.values():
        for _ in range(30):
            fn()
    torch.cuda.synchronize()
    wall = {k: [] for k in fns}
    ev = {k: [] for k in fns}
    order = list(fns.items())
    for i in range(a.iters):
        k = (i // 2) % len(order)  # a rotating order: no variant always runs right after another
        for name, fn in order[k:] + order[:k]:
            if i % 2:
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                wall[name].append((time.perf_counter() - t0) * 1e6)
            else:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                ev[name].append(e0.elapsed_time(e1) * 1e3)
    base_w = statistics.median(wall["nn.Linear (module)"])
    base_e = statistics.median(ev["nn.Linear (module)"])
    print(f"### {a.shape}: median us per step (wall: perf_counter + synchronize; events: CUDA events)")
    print("| variant | wall us | minus nn.Linear | events us | minus nn.Linear |\n|---|---|---|---|---|")
    for name in fns:
        mw, me = statistics.median(wall[name]), statistics.median(ev[name])
        print(f"| {name} | {mw:.1f} | {mw - base_w:+.1f} | {me:.1f} | {me - base_e:+.1f} |")


if __name__ == "__main__":
    main()
