"""Host time of one small linear step, per part: nn.Linear against fp8_linear.

    python benchmarks/host_overhead.py [--shape 1024x2048x1024] [--iters 3000]

At small shapes a training step is host-bound, so what fp8_linear's small
path (bf16 GEMMs, FP8 state kept) costs is host time. The variants run in
turn, one call each, every call synchronized and timed with
`time.perf_counter` (host wall time, GPU included), so that drifts and the
autograd worker's wake-ups fall on all of them alike. Prints the median
microseconds per call of each variant and its difference from nn.Linear:

- forward only, under `torch.no_grad()`: F.linear; fp8_linear with
  training=False (the C++ entry and the same GEMM, no state update); the
  C++ entry called directly (`torch_ops.linear._ext().linear`, without the
  Python wrapper);
- forward + backward: nn.Linear; fp8_linear default (the state update: one
  post-hook on the GEMM node and one launch in the backward); fp8_linear with training=False (the
  entry, no state update).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_ops  # noqa: E402


def alternate_us(fns, iters, warmup=50):
    """Median host microseconds per call of each function of `fns` (a dict),
    calling them in turn, each call followed by a device synchronization."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    samples = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            samples[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def make_inputs(M, K, N, device):
    """(nn.Linear without bias, x requiring grad, output gradient), bf16, seeded."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    lin = torch.nn.Linear(K, N, bias=False, device=device, dtype=dt)
    x = torch.randn(M, K, device=device, dtype=dt, requires_grad=True)
    gy = torch.randn(M, N, device=device, dtype=dt)
    return lin, x, gy


def fwd_bwd_step(fn, x, w, gy):
    """One training step of `fn()` (forward) and its backward with `gy`,
    the gradients of x and w cleared first."""
    def call():
        x.grad = None
        w.grad = None
        fn().backward(gy)
    return call


def variants(M, K, N, device):
    """(forward-only variants, forward+backward variants) as dicts of callables."""
    from torch_ops import linear as lin_mod

    lin, x, gy = make_inputs(M, K, N, device)
    w = lin.weight
    st = torch_ops.FP8LinearState.create(1024, device=device)
    st_off = torch_ops.FP8LinearState.create(1024, device=device)
    ext = lin_mod._ext() if device == "cuda" else None

    def no_grad(fn):
        def call():
            with torch.no_grad():
                fn()
        return call

    fwd = {
        "F.linear": no_grad(lambda: torch.nn.functional.linear(x, w)),
        "fp8_linear, training=False": no_grad(lambda: torch_ops.fp8_linear(x, w, state=st_off, training=False)),
    }
    if ext is not None:
        ts = st_off.tensors()
        args = lin_mod._fast_args("hybrid", "delayed", 0.0, "max", "out_in")
        fwd["C++ entry direct, training=False"] = no_grad(
            lambda: ext.linear(x, w, None, ts, *args, False, None, lin_mod._gemm_limit(None)))

    def step(fn):
        return fwd_bwd_step(fn, x, w, gy)

    fwd_bwd = {
        "nn.Linear": step(lambda: lin(x)),
        "fp8_linear default (state kept)": step(lambda: torch_ops.fp8_linear(x, w, state=st)),
        "fp8_linear, training=False (no state update)": step(
            lambda: torch_ops.fp8_linear(x, w, state=st_off, training=False)),
    }
    return fwd, fwd_bwd


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1024x2048x1024", help="M x K x N; several separated by commas")
    p.add_argument("--iters", type=int, default=3000)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for shape in args.shape.split(","):
        M, K, N = (int(v) for v in shape.split("x"))
        fwd, fwd_bwd = variants(M, K, N, device)
        print(f"\n### {M}x{K}x{N}, host microseconds per call (median of {args.iters}, variants in turn)\n")
        print("| variant | us | minus the first row |\n|---|---|---|")
        for group in (fwd, fwd_bwd):
            us = alternate_us(group, args.iters)
            base = next(iter(us.values()))
            for name, v in us.items():
                print(f"| {name} | {v:.1f} | {v - base:+.1f} |")


if __name__ == "__main__":
    main()
