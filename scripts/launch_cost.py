"""Host microseconds per call of one tiny kernel launch, back to back (no
synchronization between calls): a PyTorch op (`t.abs_()` on one element)
against this extension's `record_amax` binding (pybind11 + checks + one
runtime-API launch of a one-block kernel). A diagnostic of launch cost on the
device's host.

    python scripts/launch_cost.py
"""
import statistics
import time

import torch

from torch_ops import _build


def per_call_us(fn, n=5000, reps=5):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) / n * 1e6)
    return statistics.median(out)


def main():
    ext = _build.load()
    t = torch.ones(1, device="cuda")
    hist = torch.zeros(16, device="cuda")
    scale = torch.ones((), device="cuda")
    amax = torch.ones((), device="cuda")
    fns = {
        "torch t.abs_() (1 element)": lambda: t.abs_(),
        "torch_ops record_amax (1 block)": lambda: ext.record_amax(hist, scale, amax, 0, 1.0, 0, False),
    }
    for name, fn in fns.items():
        for _ in range(200):
            fn()
    for name, fn in fns.items():
        print(f"| {name} | {per_call_us(fn):.2f} us |")


if __name__ == "__main__":
    main()
