"""What FP8Monitor costs: model.fit time with and without it, interleaved.

Trains the demo's MLP (keras_fp8.demo.build_model, 64 -> 256 -> 256 -> 10,
fp8_hybrid with min_gemm_size=0) on the digits data set, batch 64, and
reports, per variant, the median over `--repeats` interleaved fits of the
time per training step; the first fit of each variant (compilation, caches)
is not counted. Variants: no monitor; FP8Monitor without a probe batch
every 10 steps; with a probe batch every 50 and every 10 steps.

    KERAS_BACKEND=torch python tools/monitor_overhead.py --threads 1
"""

import argparse
import statistics
import time

import keras
import numpy as np

import keras_fp8
from keras_fp8 import demo


def fit_seconds(model, x, y, batch_size, epochs, callbacks):
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(args.threads)
    (x, y), _ = demo.load_digits(0)
    batch = 64
    steps = args.epochs * -(-len(x) // batch)
    keras.mixed_precision.set_global_policy(keras_fp8.FP8DTypePolicy("fp8_hybrid", min_gemm_size=0))
    variants = {
        "no monitor": lambda: [],
        "monitor, no probe, every 10": lambda: [keras_fp8.callbacks.FP8Monitor(10, log_to_logs=False)],
        "monitor + probe, every 50": lambda: [
            keras_fp8.callbacks.FP8Monitor(50, probe=(x[:batch], y[:batch]), log_to_logs=False)],
        "monitor + probe, every 10": lambda: [
            keras_fp8.callbacks.FP8Monitor(10, probe=(x[:batch], y[:batch]), log_to_logs=False)],
    }
    models, monitors = {}, {}
    for name in variants:
        keras.utils.set_random_seed(0)
        model = demo.build_model(x.shape[1], 10)
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        monitors[name] = variants[name]()
        fit_seconds(model, x, y, batch, 1, monitors[name])  # warm-up: compiles, fills caches
        models[name] = model
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name in variants:
            times[name].append(fit_seconds(models[name], x, y, batch, args.epochs, monitors[name]) / steps)
    base = statistics.median(times["no monitor"])
    print(f"{keras.backend.backend()}, {steps} steps per fit, median of {args.repeats} interleaved fits")
    print(f"{'variant':30s} {'ms/step':>8s} {'range':>15s} {'overhead':>9s}")
    for name, values in times.items():
        med = statistics.median(values)
        lo, hi = min(values), max(values)
        print(f"{name:30s} {1e3 * med:8.2f} {1e3 * lo:7.2f}-{1e3 * hi:<7.2f} {100 * (med / base - 1):+8.1f}%")
    for name in ("monitor + probe, every 10",):
        per_probe = (statistics.median(times[name]) - base) * 10
        print(f"one monitored step ({name}): {1e3 * per_probe:.1f} ms over an unmonitored one")
    np.set_printoptions(precision=3)


if __name__ == "__main__":
    main()
