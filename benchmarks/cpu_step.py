"""CPU step time of the exact emulation: FP8Dense vs Dense in model.fit.

    KERAS_BACKEND=torch python benchmarks/cpu_step.py
    KERAS_BACKEND=jax   python benchmarks/cpu_step.py

Trains a 3-layer MLP (512 -> 1024 -> 1024 -> 512, batch 256) for a few epochs
under mixed_bfloat16 (plain Dense) and fp8_hybrid (FP8Dense, emulated), and
prints the median ms per training step of each and their ratio.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_fp8  # noqa: E402


def step_ms(policy, layer_cls, steps=30):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((512,)),
        layer_cls(1024, activation="relu"),
        layer_cls(1024, activation="relu"),
        layer_cls(512),
    ])
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).standard_normal((256 * steps, 512)).astype("float32")
    y = np.random.default_rng(1).standard_normal((256 * steps, 512)).astype("float32")
    stamps = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])
            stamps.append(time.perf_counter())

    model.fit(x, y, batch_size=256, epochs=1, verbose=0, callbacks=[Timer()])
    return statistics.median(np.diff(stamps[5:]) * 1e3)


def main():
    dense = step_ms("mixed_bfloat16", keras.layers.Dense)
    fp8 = step_ms("fp8_hybrid", keras_fp8.layers.FP8Dense)
    print(f"{keras.backend.backend()} CPU: Dense (mixed_bfloat16) {dense:.1f} ms/step, "
          f"FP8Dense (fp8_hybrid, emulated) {fp8:.1f} ms/step, overhead {fp8 / dense:.2f}x")


if __name__ == "__main__":
    main()
