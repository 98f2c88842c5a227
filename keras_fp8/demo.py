"""The keras-fp8 demo: train a small model in FP8 and in bfloat16, compare.

Trains the same MLP (same initial weights, same data order) on the
handwritten-digits data set that ships inside scikit-learn, once under the
`fp8_hybrid` policy (FP8 matmuls) and once under `mixed_bfloat16`, one Keras
progress bar per run, with an `FP8Monitor` on the FP8 run; then prints the
two runs side by side and the monitor's one-line health summary.

Usage:

    python -m keras_fp8.demo [--backend=torch|jax] [--policy=fp8_hybrid]
        [--epochs=30] [--batch_size=64] [--seed=0] [--threads=0] [--plot=PATH]
"""

import importlib.util
import os
import sys
import time
import warnings

import keras
from absl import app
from absl import flags

_BACKEND = flags.DEFINE_enum(
    "backend", None, ["torch", "jax"], "Keras backend (default: the current)."
)
_POLICY = flags.DEFINE_string(
    "policy", "fp8_hybrid", "FP8 policy for the FP8 run (e.g. fp8_e4m3)."
)
_EPOCHS = flags.DEFINE_integer("epochs", 30, "Training epochs per run.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed (weights, data split).")
_PLOT = flags.DEFINE_string(
    "plot", None, "Save the FP8Monitor's curves to this image file (needs matplotlib)."
)
_MONITOR_EVERY = flags.DEFINE_integer(
    "monitor_every", 25, "FP8Monitor: measure every this many steps of the FP8 run."
)
_THREADS = flags.DEFINE_integer(
    "threads", 0, "CPU threads for torch (0: the idle cores, 1 to 4)."
)

# The extra that installs each backend.
BACKEND_EXTRAS = {"torch": "torch", "jax": "jax"}
# More threads than this do not help the demo's small matmuls.
MAX_THREADS = 4


def load_digits(seed):
    """The 8x8 digits of scikit-learn, scaled to [0, 1], split 75/25."""
    import numpy as np
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_train = int(0.75 * len(x))
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def build_model(input_dim, num_classes):
    import keras_fp8

    return keras.Sequential(
        [
            keras.Input((input_dim,)),
            keras_fp8.layers.FP8Dense(256, activation="relu"),
            keras.layers.LayerNormalization(),
            keras_fp8.layers.FP8Dense(256, activation="relu"),
            keras_fp8.layers.FP8Dense(num_classes),
        ]
    )


def real_fp8_gemms():
    """Whether FP8 layers run real FP8 GEMMs here (else the exact emulation)."""
    if keras.backend.backend() == "torch":
        import torch
        import torch_ops

        return torch.cuda.is_available() and torch_ops.is_available()
    from keras_fp8.backends import jax as jax_backend

    return jax_backend.fp8_gemm_supported()


def emulation_note():
    """One paragraph saying where the FP8 matmuls run and what that costs."""
    if real_fp8_gemms():
        return ("FP8 GEMMs run on this GPU's FP8 tensor cores (min_gemm_size=0, so even the demo's "
                "small layers take the FP8 path; at this size bf16 is about as fast).")
    return ("FP8 is emulated here (no FP8 GPU): each FP8 matmul quantizes its operands with the "
            "exact FP8 rounding and multiplies them in float32, bit for bit the numerics of the GPU "
            "path but slower than bf16 (extra quantize passes, float32 GEMMs). On an FP8 GPU "
            "(sm_89, sm_90) the same layers run FP8 tensor-core GEMMs.")


def cap_threads(requested=0):
    """Sets torch's CPU threads: `requested`, else the cores that are idle
    now (at least 1, at most `MAX_THREADS`). A busy machine made the
    emulated run 15x slower with one thread per core (the threads wait on
    each other). Returns the count, or None where it does not apply."""
    if keras.backend.backend() != "torch":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    if requested <= 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        busy = int(round(os.getloadavg()[0])) if hasattr(os, "getloadavg") else 0
        requested = max(1, min(cores - busy, MAX_THREADS))
    torch.set_num_threads(requested)
    return requested


class RunProgress(keras.callbacks.Callback):
    """One Keras progress bar over all the epochs of a run."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.bar = keras.utils.Progbar(steps, stateful_metrics=["loss", "accuracy"], unit_name="step")
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        logs = logs or {}
        values = [(k, logs[k]) for k in ("loss", "accuracy") if k in logs]
        self.bar.update(self.seen, values, finalize=self.seen >= self.steps)


def train(policy, data, epochs, batch_size, seed, progress=False, monitor=None):
    """Trains one model under `policy`; returns its metrics.

    Args:
        policy: A dtype policy (name or object).
        data: `((x_train, y_train), (x_test, y_test))`.
        epochs, batch_size, seed: Training settings.
        progress: Show one progress bar for the whole run.
        monitor: Optional `keras_fp8.callbacks.FP8Monitor` for the run.
    """
    (x_train, y_train), (x_test, y_test) = data
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(seed)
    model = build_model(x_train.shape[1], 10)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    callbacks = [] if monitor is None else [monitor]
    if progress:
        steps = epochs * -(-len(x_train) // batch_size)
        callbacks.append(RunProgress(steps))
    start = time.perf_counter()
    history = model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=True,
        verbose=0,
        callbacks=callbacks,
    )
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    name = policy if isinstance(policy, str) else policy.name
    return {
        "policy": name,
        "train_loss": history.history["loss"][-1],
        "test_loss": loss,
        "test_accuracy": accuracy,
        "seconds": seconds,
    }


def format_comparison(results):
    """A side-by-side table of the runs' final metrics."""
    keys = [
        ("final train loss", "train_loss", "{:.4f}"),
        ("test loss", "test_loss", "{:.4f}"),
        ("test accuracy", "test_accuracy", "{:.2%}"),
        ("training time (s)", "seconds", "{:.1f}"),
    ]
    width = max(18, *(len(r["policy"]) + 2 for r in results))
    header = f"{'':20s}" + "".join(f"{r['policy']:>{width}s}" for r in results)
    lines = [header]
    for label, key, fmt in keys:
        lines.append(
            f"{label:20s}" + "".join(f"{fmt.format(r[key]):>{width}s}" for r in results)
        )
    gap = 100 * (results[0]["test_accuracy"] - results[1]["test_accuracy"])
    lines.append(f"accuracy gap (FP8 - bf16): {gap:+.2f} points")
    return "\n".join(lines)


def missing_backend_message(backend):
    """The error for a backend whose package is not installed (or None)."""
    if importlib.util.find_spec(backend) is not None:
        return None
    return (f"--backend={backend}: the {backend} package is not installed. "
            f"Install it with: pip install \"keras-fp8[{BACKEND_EXTRAS[backend]}]\"")


def fp8_policy(name):
    """The FP8 run's policy: `name`, with `min_gemm_size=0` unless the name
    sets it (the demo's layers are far below the GPU default)."""
    import keras_fp8
    from keras_fp8 import policy as policy_lib

    if not policy_lib.is_fp8_policy_name(name):
        raise app.UsageError(
            f"--policy: expected an FP8 policy name (one of {sorted(keras_fp8.POLICY_NAMES)}, "
            f"optionally with [settings]). Received: {name!r}")
    if "min_gemm_size" in name:
        return name
    return keras_fp8.FP8DTypePolicy(name, min_gemm_size=0)


def main(argv):
    if _BACKEND.value and _BACKEND.value != keras.backend.backend():
        message = missing_backend_message(_BACKEND.value)
        if message:
            raise app.UsageError(message)
        # The backend is fixed when Keras is imported: restart under it.
        env = dict(os.environ, KERAS_BACKEND=_BACKEND.value)
        args = [sys.executable, "-m", "keras_fp8.demo"] + sys.argv[1:]
        os.execve(sys.executable, args, env)

    import keras_fp8

    policy = fp8_policy(_POLICY.value)
    threads = cap_threads(_THREADS.value)
    print(f"keras-fp8 demo, {keras.backend.backend()} backend"
          + (f", {threads} CPU thread(s)" if threads else "") + ".")
    print(emulation_note())
    data = load_digits(_SEED.value)
    (x_train, y_train), _ = data
    batch = _BATCH_SIZE.value
    monitor = keras_fp8.callbacks.FP8Monitor(
        every_n_steps=_MONITOR_EVERY.value, probe=(x_train[:batch], y_train[:batch]), logs=None)
    results = []
    for run_policy in (policy, "mixed_bfloat16"):
        name = run_policy if isinstance(run_policy, str) else run_policy.name
        print(f"\n{name}:")
        # The monitor's warnings are printed after the table, not into the bar.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FP8Monitor")
            results.append(train(run_policy, data, _EPOCHS.value, batch, _SEED.value, progress=True,
                                 monitor=monitor if run_policy is policy else None))
    print("\n" + format_comparison(results))
    print(monitor.health_summary())
    for message in monitor.warnings:
        print("  " + message)
    if _PLOT.value:
        monitor.plot(path=_PLOT.value)
        print(f"FP8Monitor curves: {_PLOT.value}")


if __name__ == "__main__":
    app.run(main)
