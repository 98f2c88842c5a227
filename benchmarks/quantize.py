"""Fused FP8 quantize bandwidth: cast + transpose + amax + history update.

    python benchmarks/quantize.py [--shape 16384x4096] [--iters 100]

Counts the fewest bytes each variant must move (x read once; q, q_t written
once) over the median time (CUDA events, after warm-up), in TB/s, next to a
device-to-device copy and the eager-torch recipe (amax, scale, cast).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_ops  # noqa: E402
from benchmarks.timing import cuda_graph_median_ms, cuda_median_ms  # noqa: E402


def bench(fn, iters=100, warmup=10):
    return cuda_median_ms(fn, iters, warmup)


def bench_graph(fn, iters=20, per_graph=10):
    """GPU time only: per_graph calls captured in one CUDA graph, replayed."""
    return cuda_graph_median_ms(fn, iters, warmup=2, per_graph=per_graph)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="16384x4096")
    p.add_argument("--iters", type=int, default=100)
    a = p.parse_args(argv)
    R, C = (int(v) for v in a.shape.split("x"))
    dev = "cuda"
    e4 = torch.float8_e4m3fn
    x = torch.randn(R, C, device=dev, dtype=torch.bfloat16)
    n = x.numel()
    hist = torch.zeros(1024, device=dev)
    scale = torch.ones((), device=dev)
    torch_ops.quantize_delayed(x, hist, scale, e4)  # history non-empty from here on
    s_fixed = torch.tensor(0.01, device=dev)

    def eager():
        am = x.abs().amax().float()
        s = am / 448.0
        q = (x.float() / s).clamp(-448, 448).to(e4)
        return q, q.t().contiguous()

    def delayed_t():
        return torch_ops.quantize_delayed(x, hist, scale, e4, transpose=True)

    x32 = x.float()
    hist32 = torch.zeros(1024, device=dev)
    scale32 = torch.ones((), device=dev)
    torch_ops.quantize_delayed(x32, hist32, scale32, e4)

    def delayed_t32():
        return torch_ops.quantize_delayed(x32, hist32, scale32, e4, transpose=True)

    # (name, fn, bytes, setup): setup is the transposing kernel version (None:
    # the default), or (version, tiles per warp, tile rows per block,
    # programmatic launch, pre-pass) for the lean kernel's options
    # (set_lean_options; set_delayed_prepass: 1 a pre-pass finds delayed
    # scaling's scale, 0 the lean kernel checks the history itself, -1 the
    # default).
    variants = [
        ("device copy (x.clone())", lambda: x.clone(), 2 * n * 2, None),
        ("eager torch: amax + scale + cast + transpose", eager, 2 * n + n + n, None),
        ("ours: quantize (given scale), q + amax", lambda: torch_ops.quantize(x, s_fixed, e4), 2 * n + n, None),
        ("ours: quantize (given scale), q + q_t + amax",
         lambda: torch_ops.quantize(x, s_fixed, e4, transpose=True), 2 * n + 2 * n, None),
        ("ours: quantize_delayed, q + q_t + amax + history + next scale", delayed_t, 2 * n + 2 * n, None),
        ("ours: the same, tile kernel v2 (register loads)", delayed_t, 2 * n + 2 * n, 2),
        ("ours: the same, tile kernel v3 (cp.async double buffer)", delayed_t, 2 * n + 2 * n, 3),
        ("ours: the same, tile kernel v5 (lean: registers only, a 64x64 tile per warp, 2 x 4 per block)", delayed_t, 2 * n + 2 * n, 5),
        ("ours: v5 with a pre-pass for the scale (before the eleventh session)", delayed_t, 2 * n + 2 * n,
         (5, 1, 2, -1, 1)),
        ("ours: v5, a pre-pass, no programmatic launch after it", delayed_t, 2 * n + 2 * n, (5, 1, 2, 0, 1)),
        ("ours: v5, history checked in the kernel, fallback launch not early", delayed_t, 2 * n + 2 * n,
         (5, 1, 2, 0, 0)),
        ("ours: v5 before the ninth session: 2 tiles per warp, 8 side by side, a pre-pass, no programmatic launch",
         delayed_t, 2 * n + 2 * n, (5, 2, 1, 0, 1)),
        ("ours: v5, 2 tiles per warp, 8 side by side", delayed_t, 2 * n + 2 * n, (5, 2, 1, -1, -1)),
        ("ours: v5, blocks of 4 x 2 tiles", delayed_t, 2 * n + 2 * n, (5, 1, 4, -1, -1)),
        ("ours: float32 x (a master weight), q + q_t, tile kernel v2 (before v5)", delayed_t32, 4 * n + 2 * n, 2),
        ("ours: float32 x (a master weight), q + q_t, tile kernel v5 (lean)", delayed_t32, 4 * n + 2 * n, 5),
        ("ours: float32 x, v5 with a pre-pass (before the eleventh session)", delayed_t32, 4 * n + 2 * n,
         (5, 1, 2, -1, 1)),
        ("ours: quantize_delayed, q + amax + history (no transpose)",
         lambda: torch_ops.quantize_delayed(x, hist, scale, e4), 2 * n + n, None),
        ("ours: amax + history only (no fp8 output)",
         lambda: torch.ops.torch_ops.quantize_delayed(x, hist, scale, e4, 0.0, "max", False, True, True, False),
         2 * n, None),
        ("ours: quantize_current (two passes over x), q + q_t",
         lambda: torch_ops.quantize_current(x, e4, transpose=True), 2 * n + 2 * n, None),
    ]
    ext = torch_ops._build.load()
    props = torch.cuda.get_device_properties(0)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {props.name}; torch {torch.__version__}; "
          f"CUDA {torch.version.cuda}; x = {R} x {C} bfloat16")
    print("\nGPU time from CUDA-graph replay (10 calls per graph); 'eager us' adds the host-side launch path.\n")
    print("| variant | us (graph) | bytes (min) | TB/s | eager us |")
    print("|---|---|---|---|---|")
    for name, fn, nbytes, setup in variants:
        version, *lean, prepass = setup if isinstance(setup, tuple) else (setup, 1, 2, -1, -1)
        prev = ext.set_tile_version(version or 0)
        prev_lean, prev_prepass = ext.set_lean_options(*lean), ext.set_delayed_prepass(prepass)
        try:
            ms = bench_graph(fn)
            ms_e = bench(fn, a.iters)
        finally:
            ext.set_tile_version(prev)
            ext.set_lean_options(*prev_lean)
            ext.set_delayed_prepass(prev_prepass)
        print(f"| {name} | {ms * 1e3:.1f} | {nbytes / 1e6:.0f} MB | {nbytes / (ms * 1e-3) / 1e12:.2f} | {ms_e * 1e3:.1f} |")


if __name__ == "__main__":
    main()
