"""Shared timing helper of the benchmarks (CUDA events, median)."""

import statistics

import torch


def cuda_median_ms(fn, iters=30, warmup=5):
    """Median milliseconds of `fn()` over `iters` runs after `warmup` runs.

    Each run is timed with CUDA events and synchronized, so host time before
    the first kernel of a run counts too.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
