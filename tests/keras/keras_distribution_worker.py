"""FP8 models under keras.distribution on 8 virtual CPU devices (JAX).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 KERAS_BACKEND=jax \\
        python tests/keras_distribution_worker.py OUT.json

Trains a two-layer FP8 model with `DataParallel` and with `ModelParallel`
on a 2 x 4 ("batch", "model") mesh whose LayoutMap keys also match the FP8
state variables' paths (`.*dense_1.*kernel.*` matches `kernel_scale` and
`kernel_amax_history`), beside one model on one device stepping on the same
global batch from the same weights (copied in before each step, so that
the FP8 state rule is compared, not the order of the sharded gradient
sums). Then `model.fit` under `DataParallel`, and a save and reload of the
`ModelParallel` model inside the distribution's scope. Writes what
`test_keras_distribution.py` checks as JSON: every state variable that
differs from the single-device run (as "path@step"), whether every state
variable is replicated, the kernels' shardings.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_fp8  # noqa: E402
from keras_fp8.layers import FP8Dense  # noqa: E402

STEPS = 3
ROWS = 16  # the global batch


def build():
    keras.utils.set_random_seed(0)
    recipe = keras_fp8.DelayedScaling(history_len=2)
    model = keras.Sequential([
        keras.Input((16,)),
        FP8Dense(32, activation="gelu", name="dense_1", recipe=recipe, min_gemm_size=0),
        FP8Dense(8, name="dense_2", recipe=recipe, min_gemm_size=0),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def batch(step):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((ROWS, 16)).astype("float32")
    x[ROWS // 2:] *= 10.0  # the second half of the batch: other devices, larger amaxes
    return x, rng.standard_normal((ROWS, 8)).astype("float32")


def fp8_layers(model):
    return [layer for layer in model.layers if isinstance(layer, FP8Dense)]


def state(model):
    return {f"{layer.name}/{v.name}": np.asarray(v.value) for layer in fp8_layers(model)
            for v in layer.fp8_state_variables}


def replicated(model):
    """Whether every FP8 state variable is fully replicated, its device
    copies equal."""
    for layer in fp8_layers(model):
        for v in layer.fp8_state_variables:
            value = v.value
            if not value.sharding.is_fully_replicated:
                return False
            shards = [np.asarray(s.data) for s in value.addressable_shards]
            if any(not np.array_equal(shards[0], s) for s in shards[1:]):
                return False
    return True


def kernel_specs(model):
    return {layer.name: str(layer._kernel.value.sharding.spec) for layer in fp8_layers(model)}


def differences(got, want, step):
    return [f"{name}@{step}" for name in want if not np.array_equal(got[name], want[name], equal_nan=True)]


def copy_weights(source, target):
    """Kernels and biases only: the FP8 state evolves on its own."""
    for s, t in zip(fp8_layers(source), fp8_layers(target)):
        t._kernel.assign(np.asarray(s._kernel.value))
        t.bias.assign(np.asarray(s.bias.value))


def reset(model, initial):
    for layer, values in zip(fp8_layers(model), initial):
        for v, value in zip(layer.fp8_state_variables, values):
            v.assign(value)


def stepped(distribution, reference, initial):
    """Trains a model under `distribution` and `reference` on one device
    side by side, from the same weights each step."""
    with distribution.scope():
        model = build()
    reset(reference, initial)
    diffs = []
    for step in range(STEPS):
        x, y = batch(step)
        copy_weights(model, reference)
        with distribution.scope():
            model.train_on_batch(x, y)
        reference.train_on_batch(x, y)
        diffs += differences(state(model), state(reference), step)
    return model, {"differences": diffs, "replicated": replicated(model), "kernel_specs": kernel_specs(model)}


def main(out_path):
    devices = keras.distribution.list_devices()
    assert len(devices) == 8, devices
    reference = build()
    initial = [[np.asarray(v.value) for v in layer.fp8_state_variables] for layer in fp8_layers(reference)]
    results = {}

    data_parallel = keras.distribution.DataParallel(devices=devices)
    _, results["data_parallel"] = stepped(data_parallel, reference, initial)

    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense_1.*kernel.*"] = (None, "model")
    layout_map[".*dense_1.*bias"] = ("model",)
    layout_map[".*dense_2.*kernel.*"] = ("model", None)
    model_parallel = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    model, results["model_parallel"] = stepped(model_parallel, reference, initial)

    # Save and reload inside the scope: the state comes back, replicated.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        with model_parallel.scope():
            model.save(path)
            loaded = keras.saving.load_model(path)
        diffs = differences(state(loaded), state(model), "loaded")
        # One more step each: the reloaded state continues as the original.
        x, y = batch(STEPS)
        with model_parallel.scope():
            model.train_on_batch(x, y)
            loaded.train_on_batch(x, y)
        diffs += differences(state(loaded), state(model), "after")
        results["reload"] = {"differences": diffs, "replicated": replicated(loaded),
                             "kernel_specs": kernel_specs(loaded)}

    # model.fit under DataParallel: 2 steps, from the reference's weights.
    with data_parallel.scope():
        fitted = build()
    reset(reference, initial)
    copy_weights(fitted, reference)
    xs, ys = zip(*(batch(step) for step in range(2)))
    x, y = np.concatenate(xs), np.concatenate(ys)
    with data_parallel.scope():
        fitted.fit(x, y, batch_size=ROWS, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=ROWS, epochs=1, shuffle=False, verbose=0)
    got, want = state(fitted), state(reference)
    results["fit"] = {
        "replicated": replicated(fitted),
        "max_relative_difference": max(
            float(np.max(np.abs(got[k] - want[k]) / np.maximum(np.abs(want[k]), 1e-30))) for k in want),
    }
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
