"""The FP8 layers' quantize kernels inside the issue model's training step,
next to the same calls alone: is a quantize slower in the model than on its
own (clocks after the GEMMs, cache state, launch order)?

    KERAS_BACKEND=torch python benchmarks/quant_in_model.py [model.py flags]

Trains benchmarks/model.py's decoder under fp8_hybrid for a few warm-up
steps, profiles --steps more (a chrome trace, read back), and groups the
quantize kernels by (kernel, grid). Then it runs `torch_ops.quantize_delayed`
alone, under the same profiler, on every (shape, dtype) the FP8 layers
quantize in a step (x and the output gradient in bfloat16, the kernel in
float32, each with its transpose) and prints, per (kernel, grid): calls per
step and mean microseconds in the model, mean microseconds alone, and the
ratio. Unmatched rows are kernels that only one side launched.
"""

import argparse
import collections
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import model as model_bench  # noqa: E402


def kernel_times(prof, match="quant"):
    """{(kernel name, grid): [microseconds, ...]} of the profiled kernels
    whose name contains `match`, from the profiler's chrome trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    times = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel" and match in e.get("name", ""):
            grid = tuple(e.get("args", {}).get("grid", ()))
            times[(e["name"], grid)].append(float(e["dur"]))
    return times


def layer_shapes(model, tokens):
    """The (rows, cols, dtype, fp8 dtype) of every quantize the FP8 layers
    run in one training step."""
    import torch

    from keras_fp8.layers.fp8_state import FP8StateMixin

    shapes = set()
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, FP8StateMixin) and hasattr(layer, "_kernel"):
            k, n = layer._kernel.shape
            shapes.add((tokens, k, torch.bfloat16, torch.float8_e4m3fn))  # x
            shapes.add((tokens, n, torch.bfloat16, torch.float8_e5m2))  # the output gradient
            shapes.add((k, n, torch.float32, torch.float8_e4m3fn))  # the kernel
    return sorted(shapes, key=str)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5, help="calls of each quantize alone")
    args, rest = parser.parse_known_args()
    import torch

    import torch_ops

    margs = model_bench.parse_args(rest + ["--policy", "fp8_hybrid", "--warmup", "3", "--steps", str(args.steps)])
    model = model_bench.keras_model(margs)
    x, y = model_bench.data(margs)
    n = margs.batch
    model.fit(x[: 3 * n], y[: 3 * n], batch_size=n, epochs=1, shuffle=False, verbose=0)
    torch.cuda.synchronize()
    cuda = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=cuda) as prof:
        model.fit(x[3 * n:(3 + args.steps) * n], y[3 * n:(3 + args.steps) * n], batch_size=n, epochs=1,
                  shuffle=False, verbose=0)
        torch.cuda.synchronize()
    in_model = kernel_times(prof)

    calls = []
    for rows, cols, dtype, fp8 in layer_shapes(model, n * margs.seq):
        t = torch.randn(rows, cols, device="cuda", dtype=dtype)
        hist, scale = torch.zeros(1024, device="cuda"), torch.ones((), device="cuda")
        torch_ops.quantize_delayed(t, hist, scale, fp8, transpose=True)  # the history holds an entry from here on
        calls.append((t, hist, scale, fp8))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=cuda) as prof:
        for t, hist, scale, fp8 in calls:
            for _ in range(args.calls):
                torch_ops.quantize_delayed(t, hist, scale, fp8, transpose=True)
        torch.cuda.synchronize()
    alone = kernel_times(prof)

    print("| kernel | grid | calls per step | us in the model | us alone | model / alone |")
    print("|---|---|---|---|---|---|")
    total_model = total_alone = 0.0
    for key in sorted(set(in_model) | set(alone)):
        m, a = in_model.get(key, []), alone.get(key, [])
        mm = sum(m) / len(m) if m else float("nan")
        aa = sum(a) / len(a) if a else float("nan")
        if m:
            total_model += sum(m) / args.steps
            if a:
                total_alone += aa * len(m) / args.steps
        print(f"| {key[0][:70]} | {key[1]} | {len(m) / args.steps:g} | {mm:.1f} | {aa:.1f} | "
              f"{mm / aa if m and a else float('nan'):.3f} |")
    print(f"quantize kernels per step: {total_model / 1e3:.3f} ms in the model; the matched ones would take "
          f"{total_alone / 1e3:.3f} ms at their speed alone")


if __name__ == "__main__":
    main()
