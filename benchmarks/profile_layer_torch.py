"""Where a Keras-torch layer step spends its time at one shape (host vs GPU).

    KERAS_BACKEND=torch python benchmarks/profile_layer_torch.py --shape 4096x1024x1024

For Keras Dense bf16 and FP8Dense (default min_gemm_size): the median host
microseconds of the forward call, of `backward()`, and of the wait for the
GPU after it, then a torch.profiler table of a few steps (CPU ops by self
time, with their CUDA time). The same three phases follow for the calls
under the Keras layers, without Keras: `torch_ops.fp8_linear_folded` on the
FP8 layer's own tensors (what its eager fast call runs), plain
`torch_ops.fp8_linear`, and a bf16 `F.linear` of a float32 master weight
(what Dense computes under mixed_bfloat16). `--no-profile` skips the tables.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import torch  # noqa: E402

from benchmarks.keras_layer import make_layer  # noqa: E402


def phases(layer, x, g, iters):
    """Median host us of `layer(x, training=True)`, of its `backward(g)`, and
    of the GPU wait after it. `layer`: any callable taking (x, training)."""
    fwd, bwd, wait = [], [], []
    for i in range(iters + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = layer(x, training=True)
        t1 = time.perf_counter()
        y.backward(g)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if i >= 5:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            wait.append(t3 - t2)
    return [1e6 * statistics.median(v) for v in (fwd, bwd, wait)]


def report(name, shape, times):
    f, b, w = times
    print(f"## {name} {shape}: host forward {f:.1f} us, host backward {b:.1f} us, "
          f"then GPU wait {w:.1f} us (total {f + b + w:.1f} us)")


def raw_calls(layer, k, n):
    """The FP8 layer's step without Keras, as callables `(x, training)`."""
    import torch_ops
    from keras_fp8.backends import torch as fp8_torch

    def folded(x, training):
        return fp8_torch._linear_folded(
            torch_ops, layer, x, layer._kernel._value, None, layer._fp8_recipe(),
            training, layer._min_gemm_size(), fp8_torch._read_value)

    state = torch_ops.FP8LinearState.create(1024, device="cuda")
    w32 = torch.randn(k, n, device="cuda", requires_grad=True)

    def plain(x, training):
        return torch_ops.fp8_linear(x, w32, state=state, weight_layout="in_out", training=training)

    def linear_bf16(x, training):
        return torch.nn.functional.linear(x, w32.to(torch.bfloat16).t())

    return {"torch_ops.fp8_linear_folded (the layer's tensors)": folded,
            "torch_ops.fp8_linear (plain)": plain,
            "F.linear bf16 of a float32 master": linear_bf16}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4096x1024x1024")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    m, k, n = (int(v) for v in args.shape.split("x"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for kind in ("bf16", "fp8"):
        layer = make_layer(kind, k, n)
        report(kind, args.shape, phases(layer, x, g, args.iters))
        if kind == "fp8":
            for name, call in raw_calls(layer, k, n).items():
                report(name, args.shape, phases(call, x, g, args.iters))
        if args.no_profile:
            keras.backend.clear_session()
            continue
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(5):
                layer(x, training=True).backward(g)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                        max_name_column_width=60))
        keras.backend.clear_session()


if __name__ == "__main__":
    main()
