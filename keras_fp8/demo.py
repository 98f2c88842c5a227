"""The keras-fp8 demo: train a small model in FP8 and in bfloat16, compare.

Trains the same MLP (same initial weights, same data order) on the
handwritten-digits data set that ships inside scikit-learn, once under the
`fp8_hybrid` policy (FP8 matmuls) and once under `mixed_bfloat16`, with
Keras's progress bar, then prints the two runs side by side.

Usage:

    python -m keras_fp8.demo [--backend=torch|jax] [--policy=fp8_hybrid]
        [--epochs=30] [--batch_size=64]
"""

import os
import sys
import time

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
    import keras

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


def train(policy, data, epochs, batch_size, seed):
    """Trains one model under `policy`; returns its metrics."""
    import keras

    (x_train, y_train), (x_test, y_test) = data
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(seed)
    model = build_model(x_train.shape[1], 10)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    print(f"\n=== {policy} ({keras.backend.backend()} backend) ===")
    start = time.perf_counter()
    history = model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=True,
        verbose=2,
    )
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return {
        "policy": policy,
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
    header = f"{'':20s}" + "".join(f"{r['policy']:>18s}" for r in results)
    lines = [header]
    for label, key, fmt in keys:
        lines.append(
            f"{label:20s}" + "".join(f"{fmt.format(r[key]):>18s}" for r in results)
        )
    gap = 100 * (results[0]["test_accuracy"] - results[1]["test_accuracy"])
    lines.append(f"accuracy gap (FP8 - bf16): {gap:+.2f} points")
    return "\n".join(lines)


def main(argv):
    import keras

    if _BACKEND.value and _BACKEND.value != keras.backend.backend():
        # The backend is fixed when Keras is imported: restart under it.
        env = dict(os.environ, KERAS_BACKEND=_BACKEND.value)
        args = [sys.executable, "-m", "keras_fp8.demo"] + sys.argv[1:]
        os.execve(sys.executable, args, env)

    import keras_fp8  # noqa: F401  (registers the FP8 policies)

    data = load_digits(_SEED.value)
    results = [
        train(policy, data, _EPOCHS.value, _BATCH_SIZE.value, _SEED.value)
        for policy in (_POLICY.value, "mixed_bfloat16")
    ]
    print("\n" + format_comparison(results))


if __name__ == "__main__":
    app.run(main)
