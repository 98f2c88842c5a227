"""Keras layer forward+backward: FP8Dense vs Dense bf16 vs Keras's float8.

    KERAS_BACKEND=torch python benchmarks/keras_layer.py [--shapes MxKxN,...]
    KERAS_BACKEND=jax   python benchmarks/keras_layer.py

For each shape (M tokens x K in x N out) times, on random bf16 data:
- `Dense bf16`: keras.layers.Dense under mixed_bfloat16;
- `Keras float8`: the same Dense after `layer.quantize("float8")`;
- `FP8Dense`: keras_fp8.layers.FP8Dense under fp8_hybrid (delayed scaling);
forward+backward (dx and the weight gradient) and forward alone, median of
--iters timed iterations after warm-up. torch: eager autograd, CUDA events.
JAX: one jitted `stateless_call` + `jax.vjp` per iteration (forward timed as
its own jitted function whose output is consumed, so XLA cannot drop it).
Under torch it also reports the host time a Keras FP8Dense call adds over a
raw torch_ops.fp8_linear call (small shape, no synchronization).
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)

import keras  # noqa: E402

import keras_fp8  # noqa: E402

DEFAULT_SHAPES = "16384x4096x4096,16384x4096x14336,16384x14336x4096,4096x1024x1024"


def make_layer(kind, k, n):
    if kind == "fp8":
        layer = keras_fp8.layers.FP8Dense(n, use_bias=False, dtype="fp8_hybrid")
    else:
        layer = keras.layers.Dense(n, use_bias=False, dtype="mixed_bfloat16")
    layer.build((None, k))
    if kind == "keras_float8":
        layer.quantize("float8")
    return layer


def median_ms(times):
    return statistics.median(times)


def bench_torch(layer, m, k, n, iters):
    import torch

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step():
        y = layer(x, training=True)
        y.backward(g)

    def fwd():
        with torch.no_grad():
            layer(x, training=True)

    from benchmarks.timing import cuda_median_ms

    out = [cuda_median_ms(fn, iters, warmup=5) for fn in (step, fwd)]
    return out


def bench_jax(layer, m, k, n, iters):
    import jax
    import jax.numpy as jnp

    # stateless_call on a model runs the layer's __call__ (mixed-precision
    # autocast included), as the Keras trainer does.
    layer = keras.Sequential([keras.Input((k,), dtype="bfloat16"), layer])

    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]
    kx, kg = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    g = jax.random.normal(kg, (m, n), jnp.bfloat16)

    def forward(trainable, non_trainable, x):
        return layer.stateless_call(trainable, non_trainable, x, training=True)

    @jax.jit
    def step(trainable, non_trainable, x, g):
        y, vjp, new_nt = jax.vjp(
            lambda t, x: forward(t, non_trainable, x), trainable, x, has_aux=True
        )
        dt, dx = vjp(g)
        return dt, dx, new_nt

    @jax.jit
    def fwd(trainable, non_trainable, x):
        y, new_nt = forward(trainable, non_trainable, x)
        return jnp.sum(y.astype(jnp.float32)), new_nt

    out = []
    for fn, args in ((step, (trainable, non_trainable, x, g)),
                     (fwd, (trainable, non_trainable, x))):
        for _ in range(3):
            jax.block_until_ready(fn(*args))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(1e3 * (time.perf_counter() - t0))
        out.append(median_ms(times))
    return out


def host_overhead_torch(iters=200):
    """Host microseconds per forward call (no synchronization, small shape).

    Keras FP8Dense vs the raw torch_ops.fp8_linear call it makes, and for
    reference Keras Dense bf16 vs torch's F.linear (Keras's own per-call cost).
    """
    import torch
    import torch.nn.functional as F
    import torch_ops

    m = k = n = 256
    layer = keras_fp8.layers.FP8Dense(n, use_bias=False, dtype="fp8_hybrid", min_gemm_size=0)
    layer.build((None, k))
    dense = make_layer("bf16", k, n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    state = torch_ops.FP8LinearState.create(1024, device="cuda")
    w = layer.kernel.value.detach()
    w_bf16 = w.to(torch.bfloat16).t().contiguous()

    calls = {
        "keras": lambda: layer(x, training=True),
        "raw": lambda: torch_ops.fp8_linear(
            x, w, state=state, weight_layout="in_out", min_gemm_size=0),
        "keras_dense": lambda: dense(x, training=True),
        "linear": lambda: F.linear(x, w_bf16),
    }
    result = {}
    with torch.no_grad():
        for name, fn in calls.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            result[name] = 1e6 * (time.perf_counter() - t0) / iters
            torch.cuda.synchronize()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--kinds", default="bf16,keras_float8,fp8")
    args = parser.parse_args()
    backend = keras.backend.backend()
    bench = bench_torch if backend == "torch" else bench_jax
    names = {"bf16": "Keras Dense bf16", "keras_float8": "Keras float8",
             "fp8": "keras_fp8 FP8Dense"}
    print(f"# Keras layer benchmark, backend={backend}")
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        results = {}
        for kind in args.kinds.split(","):
            try:
                layer = make_layer(kind, k, n)
                results[kind] = bench(layer, m, k, n, args.iters)
            except Exception as e:  # report, keep going
                print(f"{shape} {kind}: FAILED {type(e).__name__}: {e}")
            finally:
                keras.backend.clear_session()
        base = results.get("bf16", [float("nan")])[0]
        print(f"\n### {backend} {m}x{k}x{n} (fwd+bwd ms / fwd ms / speed-up of fwd+bwd over bf16)")
        print("| layer | fwd+bwd ms | fwd ms | x bf16 |")
        print("|---|---|---|---|")
        for kind, (both, fwd) in results.items():
            print(f"| {names[kind]} | {both:.3f} | {fwd:.3f} | {base / both:.2f}x |")
            rows.append((backend, shape, kind, both, fwd, base / both))
    if backend == "torch":
        try:
            host = host_overhead_torch()
            print(f"\nhost us/call: Keras FP8Dense {host['keras']:.1f}, raw "
                  f"torch_ops.fp8_linear {host['raw']:.1f}, added "
                  f"{host['keras'] - host['raw']:.1f}; Keras Dense bf16 "
                  f"{host['keras_dense']:.1f} vs F.linear {host['linear']:.1f}, "
                  f"added {host['keras_dense'] - host['linear']:.1f}")
        except Exception as e:
            print(f"host overhead: FAILED {type(e).__name__}: {e}")
    print("\n### summary")
    for row in rows:
        print("SUMMARY " + " ".join(str(v) if not isinstance(v, float) else f"{v:.3f}" for v in row))


if __name__ == "__main__":
    main()
