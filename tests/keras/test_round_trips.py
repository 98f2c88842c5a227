"""Round trips: `.keras`, `.weights.h5` between the plain and FP8 forms,
`unconvert`, and other backends, for models made FP8 by the policy or by
`convert`.

| case | expected outcome |
|---|---|
| `.keras` of a Sequential / Functional (with `MultiHeadAttention` and a custom layer) / subclassed model, FP8 by the policy, loaded under `float32` | FP8 layers again; identical weights, FP8 state and predictions; training resumes exactly as the uninterrupted run |
| the same models FP8 by `convert(policy=...)` | the same (the parents rebuild the converted layers from a `DTypePolicyMap`) |
| a subclassed model whose layers take the global policy | FP8 when loaded under the FP8 policy; otherwise plain layers, the kernels loaded, a warning |
| `.weights.h5` of the plain model into the FP8 one | kernels and biases; the FP8 state fresh |
| `.weights.h5` of the FP8 model into the plain one | kernels and biases; a warning that the FP8 state is left out |
| `unconvert` | plain Dense/EinsumDense and mixed-precision policies, the same weights and (FP8 off) outputs; the `.keras` file loads where keras_fp8 is not imported |
| `.keras` saved under the other backend | FP8 layers, identical state; predictions within bf16 rounding |
"""

import json
import os
import subprocess
import sys
import tempfile
import zipfile

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from tests.support.composite_layers import Block
from tests.support.composite_layers import functional_model
from tests.support.backend_utils import REPO
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import run_under_other_backend
from tests.support.backend_utils import subprocess_env
from tests.support.backend_utils import to_numpy

# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")

_FP8 = (FP8Dense, FP8EinsumDense)
POLICY = "fp8_hybrid[history_len=8,min_gemm_size=0]"


@keras.saving.register_keras_serializable(package="keras_fp8_tests")
class Net(keras.Model):
    """Subclassed; `forward_dtype` passes the model's policy on to its layers
    (else they take the global policy, as Keras layers do)."""

    def __init__(self, forward_dtype=True, **kwargs):
        super().__init__(**kwargs)
        self.forward_dtype = forward_dtype
        dtype = {"dtype": self.dtype_policy} if forward_dtype else {}
        self.block = Block(16, name="block", **dtype)
        self.head = keras.layers.Dense(4, name="head", **dtype)

    def call(self, x, training=None):
        # `training` passed on explicitly: under JAX, `fit` runs `call`
        # without a Keras call context for the sublayers to read it from.
        h = keras.ops.mean(self.block(x, training=training), axis=1)
        return self.head(h, training=training)

    def get_config(self):
        return {**super().get_config(), "forward_dtype": self.forward_dtype}


def sequential():
    return keras.Sequential([
        keras.Input((6, 16)),
        keras.layers.Dense(32, activation="relu", name="body"),
        keras.layers.EinsumDense("abc,cd->abd", (None, 24), bias_axes="d", name="proj"),
        keras.layers.GlobalAveragePooling1D(name="pool"),
        keras.layers.Dense(4, name="head"),
    ], name="seq")


def functional():
    return functional_model()


def subclassed():
    model = Net(name="net")
    model(np.zeros((1, 6, 16), "float32"))
    return model


_MODELS = (
    ("sequential", sequential, 3),
    ("functional", functional, 7),
    ("subclassed", subclassed, 3),
)


def data():
    return rng_normal((8, 6, 16), 5), rng_normal((8, 4), 6)


def fp8_layers(model):
    return [l for l in model._flatten_layers() if isinstance(l, _FP8)]


def values(model):
    """Every variable but the optimizer's, by name in model order (a reloaded
    Sequential's paths lose the model's name)."""
    return [(v.name, to_numpy(v)) for v in model.weights]


def assert_same_values(test, got, expected):
    test.assertEqual([n for n, _ in got], [n for n, _ in expected])
    for (name, a), (_, b) in zip(got, expected):
        np.testing.assert_array_equal(a, b, err_msg=name)


def train(model, x, y, epochs=1):
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)


def compile_model(model):
    # Eager: these tiny steps cost less than compiling each model's train
    # function (JAX caches its per-op programs across models).
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", run_eagerly=True)


def predict(model, x):
    return to_numpy(model(x, training=False))


class KerasFileTest(parameterized.TestCase):
    def _round_trip(self, model, n_fp8, tmp_path):
        x, y = data()
        compile_model(model)
        train(model, x, y)
        self.assertLen(fp8_layers(model), n_fp8)
        path = os.path.join(tmp_path, "model.keras")
        model.save(path)
        keras.mixed_precision.set_global_policy("float32")
        loaded = keras.models.load_model(path)
        self.assertLen(fp8_layers(loaded), n_fp8)
        assert_same_values(self, values(loaded), values(model))
        np.testing.assert_array_equal(predict(loaded, x), predict(model, x))
        # Training resumes as if uninterrupted (optimizer state included).
        train(model, x, y)
        train(loaded, x, y)
        assert_same_values(self, values(loaded), values(model))
        for layer in fp8_layers(loaded):
            self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 2, layer.path)
        return loaded

    @parameterized.named_parameters(*_MODELS)
    def test_made_fp8_by_the_policy(self, make, n_fp8):
        keras.mixed_precision.set_global_policy(POLICY)
        keras.utils.set_random_seed(0)
        self._round_trip(make(), n_fp8, tempfile.mkdtemp())

    # (Sequential: tests/keras/test_convert.py.)
    @parameterized.named_parameters(*_MODELS[1:])
    def test_made_fp8_by_convert(self, make, n_fp8):
        keras.utils.set_random_seed(0)
        model = make()
        converted = keras_fp8.convert(model, policy=POLICY)
        self.assertLen(converted, n_fp8)
        loaded = self._round_trip(model, n_fp8, tempfile.mkdtemp())
        for layer in fp8_layers(loaded):
            self.assertEqual(layer.dtype_policy.name if not isinstance(
                layer.dtype_policy, keras.dtype_policies.DTypePolicyMap)
                else layer.dtype_policy[layer.path].name, POLICY)

    def test_subclassed_layers_taking_the_global_policy(self):
        keras.mixed_precision.set_global_policy(POLICY)
        keras.utils.set_random_seed(0)
        model = Net(forward_dtype=False, name="net")
        model(np.zeros((1, 6, 16), "float32"))
        self.assertLen(fp8_layers(model), 3)
        path = os.path.join(tempfile.mkdtemp(), "net.keras")
        model.save(path)
        # Under the FP8 policy: FP8 again, same state.
        loaded = keras.models.load_model(path)
        self.assertLen(fp8_layers(loaded), 3)
        assert_same_values(self, values(loaded), values(model))
        # Under another policy the layers are plain: the kernels load, and a
        # warning says the FP8 state was left out.
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        keras_fp8.policy_layers._warned_dropped_state.clear()
        with self.assertWarnsRegex(UserWarning, "FP8 checkpoint.*global policy"):
            plain = keras.models.load_model(path)
        self.assertEqual(fp8_layers(plain), [])
        kernels = [(n, v) for n, v in values(model) if n in ("kernel", "bias")]
        assert_same_values(self, values(plain), kernels)


class WeightsFileTest(parameterized.TestCase):
    def test_plain_weights_into_the_fp8_model(self):
        x, y = data()
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        plain = functional()
        compile_model(plain)
        train(plain, x, y)
        path = os.path.join(tempfile.mkdtemp(), "plain.weights.h5")
        plain.save_weights(path)

        keras.mixed_precision.set_global_policy(POLICY)
        fp8 = functional()
        compile_model(fp8)
        train(fp8, x, y)  # state recorded, then reset by the load
        fp8.load_weights(path)
        for layer in fp8_layers(fp8):
            for state in layer.fp8_state_variables:
                value = to_numpy(state)
                fresh = 1.0 if state.name.endswith("_scale") else 0.0
                np.testing.assert_array_equal(value, np.full(value.shape, fresh), err_msg=state.path)
        kept = [v for v in fp8.weights if v.name not in keras_fp8.layers.fp8_state.STATE_VARIABLE_NAMES]
        self.assertEqual([v.path for v in kept], [v.path for v in plain.weights])
        for a, b in zip(kept, plain.weights):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b), err_msg=a.path)
        train(fp8, x, y)
        for layer in fp8_layers(fp8):
            self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 1)

    def test_fp8_weights_into_the_plain_model(self):
        x, y = data()
        keras.mixed_precision.set_global_policy(POLICY)
        fp8 = functional()
        compile_model(fp8)
        train(fp8, x, y)
        path = os.path.join(tempfile.mkdtemp(), "fp8.weights.h5")
        fp8.save_weights(path)

        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        plain = functional()
        keras_fp8.policy_layers._warned_dropped_state.clear()
        with self.assertWarnsRegex(UserWarning, "FP8 checkpoint.*leaves its FP8 state out"):
            plain.load_weights(path)
        self.assertEqual(fp8_layers(plain), [])
        kept = [v for v in fp8.weights if v.name not in keras_fp8.layers.fp8_state.STATE_VARIABLE_NAMES]
        self.assertEqual([v.path for v in plain.weights], [v.path for v in kept])
        for a, b in zip(plain.weights, kept):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b), err_msg=a.path)
        # The plain model computes what the FP8 one does with FP8 off.
        with keras_fp8.autocast(enabled=False):
            expected = to_numpy(fp8(x))
        np.testing.assert_array_equal(to_numpy(plain(x)), expected)


class UnconvertTest(parameterized.TestCase):
    def _check_plain(self, model, trained, x):
        self.assertEqual(fp8_layers(model), [])
        for layer in model._flatten_layers():
            policy = layer.dtype_policy
            policies = [policy]
            if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
                policies = [policy.default_policy] + [policy[k] for k in policy]
            for p in policies:
                self.assertNotIsInstance(p, keras_fp8.FP8DTypePolicy, layer.path)
        kept = [(n, v) for n, v in trained if n not in keras_fp8.layers.fp8_state.STATE_VARIABLE_NAMES]
        assert_same_values(self, values(model), kept)

    def test_back_to_plain(self):
        # Made FP8 by convert: DTypePolicyMaps to undo too. (Made FP8 by the
        # policy: test_saved_plain_model_loads_without_keras_fp8.)
        x, y = data()
        keras.utils.set_random_seed(0)
        model = functional()
        keras_fp8.convert(model, policy=POLICY)
        compile_model(model)
        train(model, x, y)
        with keras_fp8.autocast(enabled=False):
            expected = to_numpy(model(x))
        trained = values(model)
        n_trainable = len(model.trainable_variables) - len(fp8_layers(model))
        with self.assertWarnsRegex(UserWarning, "compile"):
            paths = keras_fp8.unconvert(model)
        self.assertLen(paths, 7)
        self._check_plain(model, trained, x)
        self.assertLen(model.trainable_variables, n_trainable)
        if keras.backend.backend() == "torch":
            self.assertEqual(
                {id(p) for p in model.parameters()}, {id(v.value) for v in model.variables}
            )
        np.testing.assert_array_equal(to_numpy(model(x)), expected)
        compile_model(model)
        train(model, x, y)

    def test_saved_plain_model_loads_without_keras_fp8(self):
        keras.mixed_precision.set_global_policy(POLICY)
        keras.utils.set_random_seed(0)
        inp = keras.Input((6, 16))
        h = keras.layers.MultiHeadAttention(2, 8, name="mha")(inp, inp)
        out = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(inp, out)
        x, y = data()
        model(x, training=True)
        keras_fp8.unconvert(model)
        self.assertEqual(fp8_layers(model), [])
        workdir = tempfile.mkdtemp()
        path = os.path.join(workdir, "plain.keras")
        model.save(path)
        with zipfile.ZipFile(path) as archive:
            self.assertNotIn("keras_fp8", archive.read("config.json").decode())
        np.save(os.path.join(workdir, "x.npy"), x)
        script = (
            "import sys, numpy as np, keras\n"
            f"m = keras.models.load_model({path!r})\n"
            "assert 'keras_fp8' not in sys.modules\n"
            f"x = np.load({os.path.join(workdir, 'x.npy')!r})\n"
            f"np.save({os.path.join(workdir, 'pred.npy')!r}, "
            "np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(m(x), 'float32'))))\n"
        )
        env = subprocess_env(KERAS_BACKEND=keras.backend.backend())
        # Not from the repository: keras_fp8 must not be importable there.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in env["PYTHONPATH"].split(os.pathsep) if os.path.abspath(p) != REPO
        )
        subprocess.run([sys.executable, "-c", script], check=True, env=env,
                       cwd=workdir, timeout=300)
        np.testing.assert_array_equal(np.load(os.path.join(workdir, "pred.npy")), to_numpy(model(x)))

    def test_bad_policy(self):
        model = sequential()
        with self.assertRaisesRegex(ValueError, "`policy`.*not an FP8"):
            keras_fp8.unconvert(model, policy="fp8_hybrid")
        with self.assertRaisesRegex(TypeError, "`model`"):
            keras_fp8.unconvert("model")


class OtherBackendTest(parameterized.TestCase):
    def test_keras_file_from_the_other_backend(self):
        # (In CI this runs under both backends: both directions.)
        workdir = tempfile.mkdtemp()
        script = (
            "import json, numpy as np, keras, keras_fp8\n"
            "from tests.keras.test_round_trips import functional, data, compile_model, train, predict\n"
            "keras.utils.set_random_seed(2)\n"
            f"keras.mixed_precision.set_global_policy({POLICY!r}); m = functional()\n"
            "x, y = data(); compile_model(m); train(m, x, y)\n"
            f"m.save({os.path.join(workdir, 'm.keras')!r})\n"
            f"np.savez({os.path.join(workdir, 'values.npz')!r}, "
            "**{v.path: keras.ops.convert_to_numpy(v) for v in m.weights})\n"
            f"np.save({os.path.join(workdir, 'pred.npy')!r}, "
            "predict(m, x))\n"
        )
        run_under_other_backend(script)

        keras.mixed_precision.set_global_policy("float32")
        loaded = keras.models.load_model(os.path.join(workdir, "m.keras"), compile=False)
        self.assertLen(fp8_layers(loaded), 7)
        saved = dict(np.load(os.path.join(workdir, "values.npz")))
        self.assertCountEqual([v.path for v in loaded.weights], saved)
        for v in loaded.weights:
            np.testing.assert_array_equal(to_numpy(v), saved[v.path], err_msg=v.path)
        x, y = data()
        pred = predict(loaded, x)
        expected = np.load(os.path.join(workdir, "pred.npy"))
        # The backends' bf16 ops (softmax, layer norm) may round one bf16 ulp
        # apart, which can flip the E4M3 rounding of the next FP8 layer's
        # input (2**-3 relative): FP8 tolerance.
        self.assertLess(np.linalg.norm(pred - expected) / np.linalg.norm(expected), 5e-2)
        np.testing.assert_allclose(pred, expected, rtol=0, atol=2**-3 * np.abs(expected).max())
        compile_model(loaded)
        train(loaded, x, y)
        for layer in fp8_layers(loaded):
            self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 2, layer.path)
