"""Where a Keras-torch training step spends its GPU time (torch.profiler).

    KERAS_BACKEND=torch python benchmarks/profile_keras_torch.py --policy fp8_hybrid

Builds the decoder of benchmarks/model.py (same flags), trains a few warm-up
steps with model.fit, then profiles --steps more and prints: the kernels with
the most CUDA time, GPU busy time against wall time per step (a GPU that waits
for the host shows as busy < wall), and the host-synchronizing calls counted
by `torch.cuda.set_sync_debug_mode("warn")`. `--gaps N` also lists the N
longest stretches in which no kernel ran, with the kernels on either side
(where a step's GPU idle time falls).
"""

import argparse
import collections
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import model as model_bench  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default="fp8_hybrid")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", default=None,
                        help="also write {kernel name: [calls, us per step]} to this file (to diff two policies)")
    parser.add_argument("--ops-json", default=None,
                        help="also record input shapes and write {op and its input shapes: [calls, us of kernels "
                             "it launched itself, per step]} to this file (which op runs which copy or cast)")
    parser.add_argument("--gaps", type=int, default=0,
                        help="also list this many of the longest GPU idle stretches, with the kernels around them")
    args, rest = parser.parse_known_args()
    import keras
    import torch

    margs = model_bench.parse_args(rest + ["--policy", args.policy, "--warmup", "3", "--steps", str(args.steps)])
    model = model_bench.keras_model(margs)
    x, y = model_bench.data(margs)
    n = margs.batch
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model.fit(x[: 3 * n], y[: 3 * n], batch_size=n, epochs=1, shuffle=False, verbose=0)
    sync()
    xs, ys = x[3 * n: (3 + args.steps) * n], y[3 * n: (3 + args.steps) * n]
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    sync_stacks = collections.Counter()

    def record_sync(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename]
            sync_stacks[" <- ".join(
                f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(frames[-6:])
            )] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record_sync
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
            + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []),
            record_shapes=bool(args.ops_json),
        ) as prof:
            t0 = time.perf_counter()
            model.fit(xs, ys, batch_size=n, epochs=1, shuffle=False, verbose=0)
            sync()
            wall = time.perf_counter() - t0
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
    events = prof.key_averages()
    # Kernel rows only: a CPU op's self device time repeats its kernels'.
    device_type = getattr(torch.autograd, "DeviceType", None)
    kernels = [e for e in events if device_type is not None
               and getattr(e, "device_type", None) == device_type.CUDA]
    total_cuda_us = sum(e.self_device_time_total for e in kernels)
    print(f"# {keras.backend.backend()} {args.policy}: {args.steps} profiled steps, wall "
          f"{1e3 * wall / args.steps:.1f} ms/step (profiler on), GPU busy "
          f"{total_cuda_us / 1e3 / args.steps:.1f} ms/step")
    print(f"host-synchronizing calls: {sum(sync_stacks.values())}")
    for stack, count in sync_stacks.most_common(12):
        print(f"  sync x{count}: {stack}")
    if args.gaps and kernels:
        print_gaps(prof.events(), device_type.CUDA, args.gaps, args.steps)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({e.key: [e.count / args.steps, e.self_device_time_total / args.steps] for e in kernels}, f,
                      indent=0)
    if args.ops_json:
        import json

        ops = {}
        for e in prof.key_averages(group_by_input_shape=True):
            if device_type is not None and getattr(e, "device_type", None) == device_type.CPU and e.self_device_time_total:
                ops[f"{e.key} {e.input_shapes}"] = [e.count / args.steps, e.self_device_time_total / args.steps]
        with open(args.ops_json, "w") as f:
            json.dump(ops, f, indent=0)
    print(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=args.top, max_name_column_width=110))


def print_gaps(events, cuda, top, steps):
    """The `top` longest stretches without a running kernel, in time order of
    the profiled window, and their total per step."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if getattr(e, "device_type", None) == cuda)
    gaps, end, last = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, end, last, name))
        if stop > end:
            end, last = stop, name
    total = sum(g[0] for g in gaps)
    print(f"GPU idle between the first and last kernel: {total / 1e3 / steps:.2f} ms/step in {len(gaps)} gaps; "
          f"gaps > 50 us: {sum(g[0] for g in gaps if g[0] > 50) / 1e3 / steps:.2f} ms/step")
    t0 = spans[0][0]
    for us, at, before, after in sorted(sorted(gaps, reverse=True)[:top], key=lambda g: g[1]):
        print(f"  gap {us / 1e3:7.3f} ms at {(at - t0) / 1e3:8.2f} ms: {before[:60]} -> {after[:60]}")


if __name__ == "__main__":
    main()
