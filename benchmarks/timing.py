"""Shared timing helper of the benchmarks (CUDA events, median)."""

import random
import statistics

import torch


def _timed_ms(fn, calls=1):
    """Milliseconds per call of `calls` back-to-back `fn()` calls between two
    CUDA events, synchronized once at the end."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def cuda_median_ms(fn, iters=30, warmup=5):
    """Median milliseconds of `fn()` over `iters` runs after `warmup` runs.

    Each run is timed with CUDA events and synchronized, so host time before
    the first kernel of a run counts too.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_timed_ms(fn) for _ in range(iters))


def capture_graph(fn, per_graph=1):
    """A CUDA graph of `per_graph` calls of `fn()`, captured after 3 eager
    warm-up calls on a side stream and replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def cuda_graph_median_ms(fn, iters=20, warmup=3, per_graph=1):
    """GPU time of one `fn()` without host overhead: `per_graph` calls captured
    in one CUDA graph (`capture_graph`), the graph replayed under
    `cuda_median_ms`, divided by `per_graph`."""
    graph = capture_graph(fn, per_graph)
    return cuda_median_ms(graph.replay, iters, warmup) / per_graph


def interleaved_median_ms(fns, rounds=5, iters=6, warmup=3, calls=1):
    """`cuda_median_ms` for several functions measured side by side.

    Each of `rounds` rounds times every function `iters` times in turn, so
    slow drifts of the GPU (clocks, power, temperature) fall on all of them
    alike; the result is each function's median over its `rounds * iters`
    samples. The order of the functions changes from round to round (a
    seeded shuffle): host-bound calls ran up to 15% slower right after
    some neighbours than after others, and a fixed order gave the same
    function the same neighbour every round.

    Args:
        fns: Dict from name to a function of no arguments.
        calls: Back-to-back calls per sample (per-call time of the sample).
            1 (default): each call synchronized on its own, so host time
            before the first kernel counts in full (latency); more: the
            host queues ahead of the GPU, and a sample is max(host, GPU)
            time per call (throughput, as inside a training loop).

    Returns:
        Dict from name to median milliseconds.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in fns}
    order = list(fns)
    shuffle = random.Random(0).shuffle
    for r in range(rounds):
        if r:
            shuffle(order)
        for name in order:
            samples[name] += [_timed_ms(fns[name], calls) for _ in range(iters)]
    return {name: statistics.median(times) for name, times in samples.items()}
