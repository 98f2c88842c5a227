"""keras_fp8.convert: in-place conversion of built models to FP8 layers."""

import os
import pytest
import tempfile
import warnings

import keras
import numpy as np
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import to_numpy

# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")


_POLICY = "fp8_hybrid[history_len=8]"


def sequential():
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="body"),
            keras.layers.EinsumDense("ab,bc->ac", (24,), bias_axes="c",
                                     name="proj"),
            keras.layers.Dense(4, name="head"),
        ],
        name="seq",
    )
    return model, rng_normal((32, 16), 0)


def functional():
    inp = keras.Input((6, 16))
    h = keras.layers.MultiHeadAttention(2, 8, name="mha")(inp, inp)
    h = keras.layers.Dense(32, activation="gelu", name="body")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    out = keras.layers.Dense(4, name="head")(h)
    return keras.Model(inp, out, name="func"), rng_normal((8, 6, 16), 1)


class Block(keras.layers.Layer):
    """A custom layer holding Dense layers in an attribute and a list."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(units, activation="relu", name="inner")
        self.stack = [keras.layers.Dense(units, name=f"stack{i}") for i in range(2)]

    def build(self, input_shape):
        self.inner.build(input_shape)
        shape = input_shape[:-1] + (self.inner.units,)
        for layer in self.stack:
            layer.build(shape)

    def call(self, x):
        h = self.inner(x)
        for layer in self.stack:
            h = layer(h)
        return h


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Block(16, name="block")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.block(x))


def subclassed():
    model = Net(name="net")
    x = rng_normal((32, 12), 2)
    model(x)
    return model, x


def nested_functional():
    inp = keras.Input((12,))
    out = keras.layers.Dense(3, name="head")(Block(16, name="block")(inp))
    return keras.Model(inp, out, name="nested"), rng_normal((32, 12), 3)


_MODELS = (
    ("sequential", sequential, ["seq/body", "seq/proj"]),
    ("functional_mha", functional,
     ["mha/query", "mha/key", "mha/value", "mha/attention_output", "body"]),
    ("subclassed", subclassed,
     ["net/block/inner", "net/block/stack0", "net/block/stack1"]),
    ("nested_custom_layer", nested_functional,
     ["block/inner", "block/stack0", "block/stack1"]),
)


def _rel_err(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _predict(model, x):
    return to_numpy(model(x, training=False))


class ConvertModelsTest(parameterized.TestCase):
    @parameterized.named_parameters(*_MODELS)
    def test_converts_in_place_keeping_weights_and_outputs(self, make, paths):
        keras.utils.set_random_seed(0)
        model, x = make()
        y_before = _predict(model, x)
        weights = {v.path: (v, to_numpy(v)) for v in model.weights}
        layers_before = {id(l) for l in model._flatten_layers()}

        # A non-FP8 policy: converted without turning FP8 on.
        converted = keras_fp8.convert(model, exclude="head", policy="float32")

        self.assertCountEqual(converted, paths)
        found = {
            l.path: l for l in model._flatten_layers()
            if isinstance(l, (FP8Dense, FP8EinsumDense))
        }
        self.assertCountEqual(found, paths)
        self.assertEqual({id(l) for l in model._flatten_layers()}, layers_before)
        for layer in found.values():
            self.assertEqual(layer.path.split("/")[-1], layer.name)
            self.assertEqual(
                layer.input_amax_history.path, layer.path + "/input_amax_history"
            )
            self.assertEqual(tuple(layer.input_amax_history.shape), (1024,))
        # Same variable objects, same values; the head stays a Dense.
        by_path = {v.path: v for v in model.weights}
        for path, (variable, value) in weights.items():
            self.assertIs(by_path[path], variable)
            np.testing.assert_array_equal(to_numpy(variable), value)
        heads = [l for l in model._flatten_layers() if l.name == "head"]
        self.assertIs(type(heads[0]), keras.layers.Dense)

        # float32 policy: exactly the old outputs; also with FP8 disabled.
        np.testing.assert_array_equal(_predict(model, x), y_before)
        with keras_fp8.autocast(enabled=False):
            np.testing.assert_array_equal(_predict(model, x), y_before)
        # FP8 on: quantization noise, but close.
        with keras_fp8.autocast("fp8_hybrid"):
            y_fp8 = _predict(model, x)
        self.assertGreater(np.abs(y_fp8 - y_before).max(), 0.0)
        self.assertLess(_rel_err(y_fp8, y_before), 0.1)

    @parameterized.named_parameters(*_MODELS)
    def test_variable_tracking(self, make, paths):
        model, _ = make()
        n_train = len(model.trainable_variables)
        n_non_train = len(model.non_trainable_variables)
        keras_fp8.convert(model, exclude="head")
        # Per layer: grad_amax_pending is trainable (overwritten by the
        # optimizer), the 7 other state variables are not.
        self.assertLen(model.trainable_variables, n_train + len(paths))
        self.assertLen(model.non_trainable_variables, n_non_train + 7 * len(paths))
        if keras.backend.backend() == "torch":
            params = {id(p) for p in model.parameters()}
            for v in model.variables:
                self.assertIn(id(v.value), params, v.path)
        # An optimizer built after conversion sees the new variables.
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
        seen = {id(v) for v in optimizer._trainable_variables}
        self.assertEqual(seen, {id(v) for v in model.trainable_variables})
        for layer in model._flatten_layers():
            if isinstance(layer, (FP8Dense, FP8EinsumDense)):
                self.assertIn(id(layer.grad_amax_pending), seen)


class ConvertTrainTest(parameterized.TestCase):
    def test_fit_under_global_fp8_policy(self):
        # Built under the global FP8 policy, the Dense/EinsumDense layers are
        # FP8 layers already (the policy alone): convert finds nothing to do.
        keras.mixed_precision.set_global_policy(_POLICY)
        keras.utils.set_random_seed(0)
        model, x = sequential()
        self.assertEqual(keras_fp8.convert(model), [])
        body = model.get_layer("body")
        self.assertIsInstance(body, FP8Dense)
        self.assertIsInstance(model.get_layer("proj"), FP8EinsumDense)
        self.assertEqual(body.dtype_policy.name, _POLICY)
        self.assertEqual(tuple(body.input_amax_history.shape), (8,))
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        x, y = x[:8], rng_normal((8, 4), 1)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        for name in ("body", "proj", "head"):
            layer = model.get_layer(name)
            self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 2)
            # Step 1's gradient amax was folded by step 2's forward.
            self.assertEqual(np.count_nonzero(to_numpy(layer.grad_amax_history)), 1)

    def test_fit_with_policy_argument(self):
        keras.utils.set_random_seed(0)
        model, x = functional()
        keras_fp8.convert(
            model, exclude=["head"], policy=_POLICY,
            recipe=keras_fp8.DelayedScaling(history_len=4),
        )
        query = model.get_layer("mha")._query_dense
        self.assertIsInstance(query.dtype_policy, keras_fp8.FP8DTypePolicy)
        self.assertEqual(query.compute_dtype, "bfloat16")
        self.assertEqual(tuple(query.input_amax_history.shape), (4,))
        self.assertEqual(model.get_layer("head").dtype_policy.name, "float32")
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x[:4], rng_normal((4, 4), 1), batch_size=2, epochs=1, verbose=0)
        for layer in (query, model.get_layer("body")):
            self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 2)


    def test_convert_after_compile_and_fit(self):
        keras.utils.set_random_seed(0)
        model, x = sequential()
        x, y = x[:8], rng_normal((8, 4), 1)
        model.compile(optimizer="adam", loss="mse")
        model.fit(x, y, batch_size=4, verbose=0)
        y_before = model.predict(x, verbose=0)
        with self.assertWarnsRegex(UserWarning, "compile"):
            keras_fp8.convert(model, exclude="head", policy=_POLICY)
        with keras_fp8.autocast(enabled=False):
            np.testing.assert_allclose(
                model.predict(x, verbose=0), y_before, rtol=2e-2, atol=2e-2
            )
        model.compile(optimizer="adam", loss="mse")
        model.fit(x, y, batch_size=4, verbose=0)
        body = model.get_layer("body")
        self.assertEqual(np.count_nonzero(to_numpy(body.input_amax_history)), 2)


class ConvertSelectionTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("regex_include", dict(include="^b"), ["body"]),
        ("regex_exclude_path", dict(exclude="^(proj|head)$"), ["body"]),
        # The model's own name ("seq") is not part of the searched path.
        ("regex_not_the_model_name", dict(exclude="s"), ["body", "proj", "head"]),
        ("list_include", dict(include=["proj", "head"]), ["proj", "head"]),
        ("list_exclude_path", dict(exclude=("seq/body",)), ["proj", "head"]),
        ("callable", dict(include=lambda l: getattr(l, "units", 0) == 32), ["body"]),
        ("include_and_exclude", dict(include="o", exclude="head"), ["body", "proj"]),
        ("nothing", dict(include=[]), []),
    )
    def test_include_exclude(self, kwargs, names):
        model, _ = sequential()
        converted = keras_fp8.convert(model, **kwargs)
        self.assertCountEqual(converted, [f"seq/{n}" for n in names])
        for layer in model.layers:
            self.assertEqual(
                isinstance(layer, (FP8Dense, FP8EinsumDense)), layer.name in names
            )

    def test_second_convert_leaves_fp8_layers_alone(self):
        model, _ = sequential()
        keras_fp8.convert(model, exclude="head")
        state = model.get_layer("body").input_scale
        self.assertEqual(keras_fp8.convert(model), ["seq/head"])
        self.assertIs(model.get_layer("body").input_scale, state)

    def test_options_reach_layers(self):
        model, _ = sequential()
        keras_fp8.convert(
            model, recipe="current", min_gemm_size=0, policy="fp8_e4m3"
        )
        for layer in model.layers:
            self.assertIsInstance(layer.recipe, keras_fp8.CurrentScaling)
            self.assertEqual(layer.min_gemm_size, 0)
            self.assertEqual(layer.dtype_policy.name, "fp8_e4m3")

    def test_lora_and_quantized_layers_are_skipped_with_warning(self):
        model, _ = sequential()
        model.get_layer("body").enable_lora(2)
        model.get_layer("head").quantize("int8")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            converted = keras_fp8.convert(model)
        self.assertEqual(converted, ["seq/proj"])
        messages = " ".join(str(w.message) for w in caught)
        self.assertRegex(messages, "'seq/body'.*LoRA")
        self.assertRegex(messages, "'seq/head'.*quantized.*int8")
        self.assertIs(type(model.get_layer("body")), keras.layers.Dense)

    def test_dense_subclass_is_skipped_with_warning(self):
        class MyDense(keras.layers.Dense):
            pass

        model = keras.Sequential([keras.Input((4,)), MyDense(3, name="mine")])
        with self.assertWarnsRegex(UserWarning, "'.*mine'.*subclass"):
            self.assertEqual(keras_fp8.convert(model), [])


    def test_unbuilt_nested_layer_is_skipped_with_warning(self):
        class WithSpare(keras.layers.Layer):
            def __init__(self):
                super().__init__(name="with_spare")
                self.used = keras.layers.Dense(3, name="used")
                self.spare = keras.layers.Dense(3, name="spare")

            def build(self, input_shape):
                self.used.build(input_shape)

            def call(self, x):
                return self.used(x)

        layer = WithSpare()
        layer(rng_normal((2, 4), 0))
        with self.assertWarnsRegex(UserWarning, "'spare'.*not built"):
            converted = keras_fp8.convert(layer)
        self.assertEqual(converted, ["with_spare/used"])

    def test_single_layer(self):
        layer = keras.layers.EinsumDense("...b,bc->...c", (5,), name="solo")
        x = rng_normal((2, 3, 4), 0)
        y = to_numpy(layer(x))
        self.assertEqual(keras_fp8.convert(layer, policy="float32"), ["solo"])
        self.assertIsInstance(layer, FP8EinsumDense)
        np.testing.assert_array_equal(to_numpy(layer(x)), y)
        with keras_fp8.autocast():
            self.assertLess(_rel_err(to_numpy(layer(x)), y), 0.1)


class ConvertSavingTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("sequential", sequential), ("functional", functional)
    )
    def test_keras_file_round_trip(self, make):
        keras.utils.set_random_seed(0)
        model, x = make()
        converted = keras_fp8.convert(model, exclude="head|mha", policy=_POLICY)
        self.assertNotEmpty(converted)
        classes = [l["class_name"] for l in model.get_config()["layers"]]
        self.assertIn("FP8Dense", classes)
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, rng_normal((x.shape[0], 4), 1), batch_size=4, verbose=0)

        path = os.path.join(tempfile.mkdtemp(), "converted.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        for name in [p.split("/")[-1] for p in converted]:
            original, restored = model.get_layer(name), loaded.get_layer(name)
            self.assertIs(type(restored), type(original))
            self.assertEqual(restored.dtype_policy.name, _POLICY)
            # (A reloaded Sequential's paths lose the model's name: compare
            # variable names.)
            for a, b in zip(original.weights, restored.weights):
                self.assertEqual(a.name, b.name)
                np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
            self.assertGreater(
                np.count_nonzero(to_numpy(restored.input_amax_history)), 0
            )
        np.testing.assert_array_equal(_predict(loaded, x), _predict(model, x))

    def test_mha_keras_file_into_rebuilt_converted_model(self):
        # MultiHeadAttention rebuilds its projections as EinsumDense from its
        # config, so `load_model` cannot restore them as FP8 layers: rebuild
        # the model, convert it the same way, load the archive's weights.
        keras.utils.set_random_seed(0)
        model, x = functional()
        keras_fp8.convert(model, policy=_POLICY)
        model(x, training=True)  # records some state
        path = os.path.join(tempfile.mkdtemp(), "mha.keras")
        model.save(path)

        keras.utils.set_random_seed(7)
        rebuilt, _ = functional()
        keras_fp8.convert(rebuilt, policy=_POLICY)
        rebuilt.load_weights(path)
        for a, b in zip(model.weights, rebuilt.weights):
            self.assertEqual(a.path, b.path)
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b))

    def test_subclassed_weights_round_trip(self):
        # A subclassed model rebuilds Dense layers from its own code: convert
        # the rebuilt model the same way, then load the weights.
        keras.utils.set_random_seed(0)
        model, x = subclassed()
        keras_fp8.convert(model, exclude="head", policy=_POLICY)
        model(x, training=True)  # records some state
        path = os.path.join(tempfile.mkdtemp(), "net.weights.h5")
        model.save_weights(path)

        keras.utils.set_random_seed(7)
        rebuilt, _ = subclassed()
        keras_fp8.convert(rebuilt, exclude="head", policy=_POLICY)
        rebuilt.load_weights(path)
        for a, b in zip(model.weights, rebuilt.weights):
            self.assertEqual(a.path, b.path)
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
        np.testing.assert_array_equal(_predict(rebuilt, x), _predict(model, x))


class ConvertBadArgumentsTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("model_not_layer", dict(model="model"), TypeError, "`model`.*str"),
        ("model_array", dict(model=np.ones(3)), TypeError, "`model`"),
        ("include_int", dict(include=3), TypeError, "`include`.*int"),
        ("exclude_list_of_int", dict(exclude=[1]), TypeError, "`exclude`"),
        ("bad_regex", dict(exclude="(head"), ValueError, "`exclude`"),
        ("bad_min_gemm_size", dict(min_gemm_size=-1), ValueError, "min_gemm_size"),
        ("bad_recipe", dict(recipe="fastest"), ValueError, "recipe"),
        ("bad_policy", dict(policy="int8"), ValueError, "`policy`"),
    )
    def test_bad_arguments(self, kwargs, error, regex):
        model, _ = sequential()
        kwargs = dict(kwargs)
        target = kwargs.pop("model", model)
        with self.assertRaisesRegex(error, regex):
            keras_fp8.convert(target, **kwargs)
        # Nothing was converted.
        self.assertFalse(
            any(isinstance(l, FP8Dense) for l in model._flatten_layers())
        )

    def test_unbuilt_model(self):
        model = keras.Sequential([keras.layers.Dense(3)])
        with self.assertRaisesRegex(ValueError, "`model`.*built"):
            keras_fp8.convert(model)
