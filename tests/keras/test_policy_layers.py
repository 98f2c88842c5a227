"""The policy alone: Keras's own Dense/EinsumDense under an FP8 policy.

| case | expected outcome |
|---|---|
| `Dense`/`EinsumDense` built under an FP8 policy (global, `dtype=`, an `autocast` scope, a `DTypePolicyMap` entry) | an `FP8Dense`/`FP8EinsumDense`: the same state variables, bit-identical outputs, gradients and state to one written as such |
| `MultiHeadAttention` under the global policy | its four projections are FP8 layers |
| the policy's `exclude`, a `DTypePolicyMap` entry, a per-layer `dtype=` | those layers stay plain and compute as under `mixed_bfloat16` |
| an unsupported equation, `lora_rank=` at build, a `Dense` subclass | a plain layer, a one-time warning naming it |
| LoRA enabled after build, integer inputs | the call runs as the plain layer, a one-time warning naming it; the state does not advance |
| `model.quantize(...)` on a model with FP8 layers or FP8 policies | ValueError naming the layers and `keras_fp8.unconvert`; nothing quantized |
| Keras's `int8` / `float8` quantization of a plain model, after `import keras_fp8` | works as without keras_fp8 |
| `fp8_hybrid_float16` as global policy or `DTypePolicyMap` default | `compile` wraps keras_fp8's `LossScaleOptimizer` |
"""

import warnings

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from tests.support.backend_utils import rng_normal
from tests.support.composite_layers import Block
from tests.support.composite_layers import functional_model
from tests.support.backend_utils import to_numpy
from tests.support.backend_utils import train_call_with_grads
from tests.support.keras_reference import layer_state

# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")

_FP8 = (FP8Dense, FP8EinsumDense)
_PROJECTIONS = (keras.layers.Dense, keras.layers.EinsumDense)


def _fp8_layers(model):
    return [l for l in model._flatten_layers() if isinstance(l, _FP8)]


def _projections(model):
    return [l for l in model._flatten_layers() if isinstance(l, _PROJECTIONS)]


def _functional():
    return functional_model()


class PolicyMakesFP8LayersTest(parameterized.TestCase):
    def test_global_policy(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid")
        model = _functional()
        fp8 = _fp8_layers(model)
        self.assertEqual(len(fp8), len(_projections(model)))
        self.assertCountEqual(
            [l.path for l in fp8],
            ["mha/query", "mha/key", "mha/value", "mha/attention_output",
             "block/up", "block/down", "head"],
        )
        state_names = set(keras_fp8.layers.fp8_state.STATE_VARIABLE_NAMES)
        for layer in fp8:
            names = [v.name for v in layer.weights]
            self.assertEqual(set(names) - {"kernel", "bias"}, state_names, layer.path)
            self.assertLen(names, len(state_names) + (2 if layer.bias is not None else 1))
        self.assertIs(type(model.get_layer("norm")), keras.layers.LayerNormalization)
        model.compile(optimizer="adam", loss="mse", run_eagerly=True)
        model.fit(rng_normal((8, 6, 16), 0), rng_normal((8, 4), 1), batch_size=4, verbose=0)
        for layer in fp8:
            self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 2, layer.path)
            self.assertEqual(np.count_nonzero(to_numpy(layer.grad_amax_history)), 1, layer.path)

    @parameterized.named_parameters(
        ("dense", lambda **kw: keras.layers.Dense(12, **kw),
         lambda **kw: FP8Dense(12, **kw), (5, 20), (5, 12)),
        ("einsum", lambda **kw: keras.layers.EinsumDense("abc,cde->abde", (None, 3, 4), bias_axes="de", **kw),
         lambda **kw: FP8EinsumDense("abc,cde->abde", (None, 3, 4), bias_axes="de", **kw),
         (2, 5, 16), (2, 5, 3, 4)),
    )
    def test_same_numerics_as_the_fp8_layer(self, plain, explicit, shape, out_shape):
        policy = "fp8_hybrid[history_len=8]"
        made = plain(dtype=policy)
        written = explicit(dtype=policy)
        made.build(shape)
        written.build(shape)
        self.assertIs(type(made), type(written))
        self.assertEqual([v.name for v in made.weights], [v.name for v in written.weights])
        written.set_weights(made.get_weights())
        for step in range(3):
            x = rng_normal(shape, step)
            upstream = rng_normal(out_shape, 10 + step)
            a = train_call_with_grads(made, x, upstream)
            b = train_call_with_grads(written, x, upstream)
            for got, want in zip(a[:2], b[:2]):
                np.testing.assert_array_equal(got, want)
            for path, grad in a[2].items():
                np.testing.assert_array_equal(grad, b[2][path.replace(made.name, written.name)])
            state_a, state_b = layer_state(made), layer_state(written)
            for name in state_a:
                np.testing.assert_array_equal(state_a[name], state_b[name], err_msg=name)

    def test_per_layer_dtype(self):
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(8, dtype="fp8_e4m3[scaling=current]", name="fp8"),
            keras.layers.Dense(4, name="plain"),
        ])
        self.assertIsInstance(model.get_layer("fp8"), FP8Dense)
        self.assertEqual(model.get_layer("fp8").recipe, None)
        self.assertEqual(tuple(model.get_layer("fp8").input_amax_history.shape), (1,))
        self.assertIs(type(model.get_layer("plain")), keras.layers.Dense)

    def test_autocast_scope(self):
        with keras_fp8.autocast("fp8_hybrid[history_len=4]"):
            layer = keras.layers.Dense(4)
            layer.build((2, 8))
        self.assertIsInstance(layer, FP8Dense)
        self.assertEqual(tuple(layer.input_amax_history.shape), (4,))

    def test_dtype_policy_map(self):
        # The map keras_hub passes to its layers: each layer takes the entry
        # of its path, else the default.
        policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_bfloat16")
        policy_map["block/down"] = "fp8_hybrid[history_len=4]"
        block = Block(8, dtype=policy_map, name="block")
        block.build((2, 5, 8))
        self.assertIs(type(block.up), keras.layers.Dense)
        self.assertIsInstance(block.down, FP8EinsumDense)
        self.assertEqual(block.down.compute_dtype, "bfloat16")
        self.assertEqual(tuple(block.down.input_amax_history.shape), (4,))
        y = block(rng_normal((2, 5, 8), 0), training=True)
        self.assertEqual(np.count_nonzero(to_numpy(block.down.input_amax_history)), 1)
        self.assertEqual(tuple(y.shape), (2, 5, 8))
        # The other way round: FP8 by default, one layer kept plain.
        policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="fp8_hybrid")
        policy_map["block/up"] = "mixed_bfloat16"
        block = Block(8, dtype=policy_map, name="block")
        block.build((2, 5, 8))
        self.assertIs(type(block.up), keras.layers.Dense)
        self.assertIsInstance(block.down, FP8EinsumDense)


class ExclusionTest(parameterized.TestCase):
    def test_exclude_in_the_policy_name(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid[history_len=8,exclude=head|mha/key]")
        model = _functional()
        self.assertIs(type(model.get_layer("head")), keras.layers.Dense)
        self.assertIs(type(model.get_layer("mha")._key_dense), keras.layers.EinsumDense)
        self.assertIsInstance(model.get_layer("mha")._query_dense, FP8EinsumDense)
        self.assertLen(_fp8_layers(model), 5)
        head = model.get_layer("head")
        self.assertEqual(head.compute_dtype, "bfloat16")
        self.assertEqual(head.variable_dtype, "float32")
        # The head computes what a mixed_bfloat16 Dense computes.
        reference = keras.layers.Dense(4, dtype="mixed_bfloat16")
        h = rng_normal((3, 16), 0)
        reference.build(h.shape)
        reference.set_weights(head.get_weights())
        np.testing.assert_array_equal(to_numpy(head(h)), to_numpy(reference(h)))

    def test_exclude_is_part_of_the_name(self):
        policy = keras_fp8.FP8DTypePolicy(
            "fp8_hybrid", recipe=keras_fp8.DelayedScaling(history_len=16), exclude="logits|head"
        )
        self.assertEqual(policy.name, "fp8_hybrid[history_len=16,exclude=logits|head]")
        rebuilt = keras.dtype_policies.deserialize(keras.dtype_policies.serialize(policy))
        self.assertEqual(rebuilt, policy)
        self.assertEqual(rebuilt.exclude, "logits|head")
        self.assertEqual(rebuilt.recipe.history_len, 16)
        self.assertEqual(
            keras_fp8.FP8DTypePolicy("fp8_hybrid[min_gemm_size=0]", exclude="x").name,
            "fp8_hybrid[min_gemm_size=0,exclude=x]",
        )

    @parameterized.named_parameters(
        ("comma", "a,b", "separate settings"),
        ("bracket", "dense[0]", "separate settings"),
        ("not_a_regex", "(head", "regular expression"),
        ("empty", "", "non-empty"),
        ("number", 3, "non-empty string"),
    )
    def test_bad_exclude(self, exclude, regex):
        with self.assertRaisesRegex(ValueError, f"`exclude`.*{regex}|{regex}"):
            keras_fp8.FP8DTypePolicy("fp8_hybrid", exclude=exclude)

    def test_conflicting_exclude(self):
        with self.assertRaisesRegex(ValueError, "Conflicting.*exclude"):
            keras_fp8.FP8DTypePolicy("fp8_hybrid[exclude=a]", exclude="b")

    def test_convert_keeps_excluded_layers_plain(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid[exclude=head]")
        model = _functional()
        self.assertEqual(keras_fp8.convert(model), [])
        self.assertIs(type(model.get_layer("head")), keras.layers.Dense)

    def test_explicit_fp8_layers_are_not_excluded(self):
        layer = FP8Dense(4, dtype="fp8_hybrid[exclude=.+]")
        layer(rng_normal((2, 8), 0), training=True)
        self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 1)


class CannotRunFP8Test(parameterized.TestCase):
    def _build_warns(self, layer, shape, regex):
        with self.assertWarnsRegex(UserWarning, regex):
            layer.build(shape)
        self.assertNotIsInstance(layer, _FP8)
        # Once per layer.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer(rng_normal(shape, 0))
        self.assertEqual([str(w.message) for w in caught if "keras_fp8" in str(w.message)], [])

    def test_unsupported_equation(self):
        layer = keras.layers.EinsumDense("abc,bcd->abd", (5, 4), dtype="fp8_hybrid", name="batched")
        self._build_warns(layer, (2, 5, 8), "'batched'.*EinsumDense.*plain.*bfloat16.*not in FP8.*single matmul")
        self.assertEqual(layer.compute_dtype, "bfloat16")

    def test_lora_rank_at_build(self):
        layer = keras.layers.Dense(4, lora_rank=2, dtype="fp8_hybrid", name="lora")
        self._build_warns(layer, (2, 8), "'lora'.*LoRA")
        self.assertTrue(layer.lora_enabled)

    def test_dense_subclass(self):
        class MyDense(keras.layers.Dense):
            pass

        layer = MyDense(4, dtype="fp8_hybrid", name="mine")
        self._build_warns(layer, (2, 8), "'mine'.*MyDense.*subclass")

    def test_lora_enabled_after_build_runs_plain(self):
        layer = keras.layers.Dense(4, dtype="fp8_hybrid", name="later_lora")
        x = rng_normal((3, 8), 0)
        layer(x, training=True)
        self.assertIsInstance(layer, FP8Dense)
        layer.enable_lora(2)
        layer.lora_kernel_b.assign(rng_normal(tuple(layer.lora_kernel_b.shape), 1))
        with self.assertWarnsRegex(UserWarning, "'later_lora'.*runs in bfloat16, not in FP8.*LoRA"):
            y = to_numpy(layer(x, training=True))
        reference = keras.layers.Dense(4, dtype="mixed_bfloat16")
        reference.build(x.shape)
        reference.enable_lora(2)
        reference.set_weights([to_numpy(v) for v in (
            layer._kernel, layer.bias, layer.lora_kernel_a, layer.lora_kernel_b)])
        np.testing.assert_array_equal(y, to_numpy(reference(x)))
        self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 1)

    def test_integer_inputs_run_plain(self):
        layer = keras.layers.Dense(4, dtype="fp8_hybrid", name="ints")
        x = np.arange(16, dtype="int32").reshape(2, 8)
        layer.build(x.shape)
        with self.assertWarnsRegex(UserWarning, "'ints'.*floating-point"):
            y = layer(x, training=True)
        self.assertEqual(tuple(y.shape), (2, 4))
        self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 0)


class KerasQuantizationTest(parameterized.TestCase):
    def _plain_model(self):
        return keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="body"),
            keras.layers.Dense(4, name="head"),
        ])

    @parameterized.named_parameters(("int8", "int8"), ("float8", "float8"))
    def test_keras_quantization_untouched(self, mode):
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        model = self._plain_model()
        x = rng_normal((4, 16), 0)
        y = to_numpy(model(x))
        model.quantize(mode)
        self.assertEqual(model.get_layer("body").quantization_mode, mode)
        self.assertNotIsInstance(model.get_layer("body"), _FP8)
        np.testing.assert_allclose(to_numpy(model(x)), y, rtol=0.2, atol=0.2)

    def test_quantize_refuses_fp8_models_before_changing_anything(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid[exclude=head]")
        model = keras.Sequential([
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(10, 16, name="embed"),
            keras.layers.Flatten(),
            keras.layers.Dense(32, name="body"),
            keras.layers.Dense(4, name="head"),
        ])
        with self.assertRaisesRegex(ValueError, r"quantize\(mode='int8'\).*FP8.*'sequential.*/embed'.*/body'.*keras_fp8.unconvert"):
            model.quantize("int8")
        self.assertTrue(all(l.quantization_mode is None for l in model.layers))
        with self.assertRaisesRegex(ValueError, "/body'.*unconvert"):
            model.get_layer("body").quantize("int8")
        keras_fp8.unconvert(model)
        model.quantize("int8")
        self.assertEqual(model.get_layer("body").quantization_mode, "int8")
        self.assertEqual(model.get_layer("body").dtype_policy.name, "int8_from_mixed_bfloat16")


class LossScalingTest(parameterized.TestCase):
    def test_global_float16_policy(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid_float16")
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss="mse")
        self.assertIsInstance(model.optimizer, keras_fp8.optimizers.LossScaleOptimizer)
        model.fit(rng_normal((8, 8), 0), rng_normal((8, 4), 1), epochs=2, verbose=0)
        self.assertGreater(float(to_numpy(model.layers[0].grad_amax_pending)[2]), 0.0)

    def test_policy_map_default(self):
        policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="fp8_hybrid_float16")
        block = Block(8, dtype=policy_map, name="block")
        inp = keras.Input((5, 8))
        model = keras.Model(inp, block(inp))
        self.assertIsInstance(block.up, FP8Dense)
        model.compile(optimizer="sgd", loss="mse")
        self.assertIsInstance(model.optimizer, keras_fp8.optimizers.LossScaleOptimizer)
