"""FP8 dtype policies: registration, names, and non-FP8 layers under them."""

import os
import pytest
import tempfile

import keras
import numpy as np
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import to_numpy


# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")


class PolicyNameTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("hybrid", "fp8_hybrid", "bfloat16", "hybrid"),
        ("hybrid_float16", "fp8_hybrid_float16", "float16", "hybrid"),
        ("e4m3", "fp8_e4m3", "bfloat16", "e4m3"),
    )
    def test_set_global_policy(self, name, compute_dtype, fp8_format):
        keras.mixed_precision.set_global_policy(name)
        policy = keras.mixed_precision.global_policy()
        self.assertIsInstance(policy, keras_fp8.FP8DTypePolicy)
        self.assertIsInstance(policy, keras.DTypePolicy)
        self.assertEqual(policy.name, name)
        self.assertEqual(policy.compute_dtype, compute_dtype)
        self.assertEqual(policy.variable_dtype, "float32")
        self.assertIsNone(policy.quantization_mode)
        self.assertEqual(policy.recipe.fp8_format, fp8_format)
        self.assertEqual(keras.dtype_policies.get(name), policy)
        self.assertEqual(keras.layers.Dense(2, dtype=name).dtype_policy, policy)
        self.assertEqual(keras.config.dtype_policy().name, name)

    def test_settings_are_in_the_name(self):
        recipe = keras_fp8.DelayedScaling(
            history_len=16, margin=1.0, amax_compute_algo="most_recent"
        )
        policy = keras_fp8.FP8DTypePolicy("fp8_hybrid", recipe=recipe)
        self.assertEqual(
            policy.name,
            "fp8_hybrid[history_len=16,margin=1.0,amax_compute_algo=most_recent]",
        )
        rebuilt = keras.dtype_policies.get(policy.name)
        self.assertEqual(rebuilt.recipe, recipe)
        current = keras_fp8.FP8DTypePolicy(
            "fp8_e4m3", recipe=keras_fp8.CurrentScaling(fp8_format="e4m3")
        )
        self.assertEqual(current.name, "fp8_e4m3[scaling=current]")
        self.assertEqual(
            keras.dtype_policies.get(current.name).recipe, current.recipe
        )

    def test_unknown_fp8_name(self):
        with self.assertRaisesRegex(ValueError, "fp8_e5m2.*Valid names.*fp8_hybrid"):
            keras.mixed_precision.set_global_policy("fp8_e5m2")
        with self.assertRaisesRegex(ValueError, "Valid names"):
            keras.dtype_policies.get("fp8_turbo")
        with self.assertRaisesRegex(ValueError, "Valid names"):
            keras.layers.Dense(2, dtype="fp8_nope")

    def test_bad_settings(self):
        with self.assertRaisesRegex(ValueError, "history_len"):
            keras.dtype_policies.get("fp8_hybrid[history_len=0]")
        with self.assertRaisesRegex(ValueError, "margin"):
            keras.dtype_policies.get("fp8_hybrid[margin=-1]")
        with self.assertRaisesRegex(ValueError, "history_len"):
            keras.dtype_policies.get("fp8_hybrid[history_len=many]")
        with self.assertRaisesRegex(ValueError, "scaling"):
            keras.dtype_policies.get("fp8_hybrid[scaling=sometimes]")
        with self.assertRaisesRegex(ValueError, "fp8_format"):
            keras_fp8.FP8DTypePolicy(
                "fp8_hybrid", recipe=keras_fp8.DelayedScaling(fp8_format="e4m3")
            )

    def test_recipe_validation(self):
        with self.assertRaisesRegex(ValueError, "history_len"):
            keras_fp8.DelayedScaling(history_len=0)
        with self.assertRaisesRegex(ValueError, "history_len"):
            keras_fp8.DelayedScaling(history_len=2.5)
        with self.assertRaisesRegex(ValueError, "margin"):
            keras_fp8.DelayedScaling(margin=-0.5)
        with self.assertRaisesRegex(ValueError, "amax_compute_algo"):
            keras_fp8.DelayedScaling(amax_compute_algo="mean")
        with self.assertRaisesRegex(ValueError, "fp8_format.*e4m3.*hybrid"):
            keras_fp8.CurrentScaling(fp8_format="e5m2")

    def test_recipe_serialization(self):
        for recipe in [keras_fp8.DelayedScaling(history_len=3, margin=2.0),
                       keras_fp8.CurrentScaling(margin=1.0, fp8_format="e4m3")]:
            config = keras.saving.serialize_keras_object(recipe)
            self.assertEqual(keras.saving.deserialize_keras_object(config), recipe)
            self.assertEqual(type(recipe).from_config(recipe.get_config()), recipe)

    def test_other_policies_untouched(self):
        for name in ["float32", "mixed_bfloat16", "mixed_float16", "bfloat16"]:
            policy = keras.dtype_policies.get(name)
            self.assertIs(type(policy), keras.DTypePolicy)
        self.assertEqual(
            type(keras.dtype_policies.get("float8_from_float32")).__name__,
            "QuantizedFloat8DTypePolicy",
        )


def _sequential():
    return keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(20, 16),
        keras.layers.LayerNormalization(),
        keras.layers.Conv1D(8, 3),
        keras.layers.Flatten(),
        keras.layers.Dense(16),
    ])


def _functional():
    inp = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 16)(inp)
    h = keras.layers.LayerNormalization()(h)
    a = keras.layers.MultiHeadAttention(2, 8)(h, h, use_causal_mask=True)
    h = keras.layers.Add()([h, a])
    h = keras.layers.Conv1D(8, 3, padding="same")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    out = keras.layers.Dense(3)(keras.layers.Dropout(0.1)(h))
    return keras.Model(inp, out)


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(20, 16)
        self.norm = keras.layers.LayerNormalization()
        self.rnn = keras.layers.GRU(8)
        self.head = keras.layers.Dense(3)

    def call(self, x):
        return self.head(self.rnn(self.norm(self.embed(x))))


class NonFP8LayersTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("sequential", _sequential),
        ("functional", _functional),
        ("subclassed", _Subclassed),
    )
    def test_runs_like_mixed_bfloat16(self, make_model):
        # Dense/EinsumDense layers become FP8 layers under the policy; with
        # their FP8 matmuls off (autocast(enabled=False): each computes
        # exactly what Dense/EinsumDense does) or with every Dense/EinsumDense
        # excluded, the model computes exactly what it does under
        # mixed_bfloat16: every other layer runs as under mixed_bfloat16.
        x = np.random.default_rng(0).integers(0, 20, (4, 6)).astype("int32")
        outputs = {}
        for policy in ["mixed_bfloat16", "fp8_hybrid", "fp8_hybrid[exclude=.+]"]:
            keras.mixed_precision.set_global_policy(policy)
            keras.utils.set_random_seed(3)
            model = make_model()
            with keras_fp8.autocast(enabled=False):
                outputs[policy] = to_numpy(model(x))
            fp8_layers = [l for l in model._flatten_layers()
                          if isinstance(l, (FP8Dense, keras_fp8.FP8EinsumDense))]
            projections = [l for l in model._flatten_layers()
                           if isinstance(l, (keras.layers.Dense, keras.layers.EinsumDense))]
            self.assertLen(fp8_layers, len(projections) if policy == "fp8_hybrid" else 0)
            # Training works too (no crash, finite loss).
            model.compile(optimizer="sgd", loss="mse")
            y = np.zeros(outputs[policy].shape, "float32")
            loss = model.train_on_batch(x, y)
            self.assertTrue(np.isfinite(loss))
        for policy in ["fp8_hybrid", "fp8_hybrid[exclude=.+]"]:
            np.testing.assert_array_equal(
                outputs[policy], outputs["mixed_bfloat16"], err_msg=policy
            )

    def test_fp8_layers_beside_others(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid")
        model = keras.Sequential([
            keras.Input((5, 8)),
            FP8Dense(16, activation="relu"),
            keras.layers.LayerNormalization(),
            keras_fp8.FP8EinsumDense("abc,cd->abd", (None, 4)),
        ])
        y = model(rng_normal((2, 5, 8), 0))
        self.assertEqual(tuple(y.shape), (2, 5, 4))
        self.assertEqual(keras.backend.standardize_dtype(y.dtype), "bfloat16")


class PolicyReloadTest(parameterized.TestCase):
    def test_keras_reload_restores_policy_with_settings(self):
        name = "fp8_hybrid[history_len=8,amax_compute_algo=most_recent]"
        keras.mixed_precision.set_global_policy(name)
        model = keras.Sequential([
            keras.Input((4,)), FP8Dense(3), keras.layers.LayerNormalization()
        ])
        model(rng_normal((2, 4), 0), training=True)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        keras.mixed_precision.set_global_policy("float32")
        loaded = keras.models.load_model(path)
        for layer in loaded.layers:
            self.assertIsInstance(layer.dtype_policy, keras_fp8.FP8DTypePolicy)
            self.assertEqual(layer.dtype_policy.name, name)
        self.assertEqual(loaded.layers[0].dtype_policy.recipe.history_len, 8)
        self.assertEqual(tuple(loaded.layers[0].input_amax_history.shape), (8,))


class MinGemmSizeTest(parameterized.TestCase):
    def test_policy_and_layer_setting(self):
        policy = keras_fp8.FP8DTypePolicy("fp8_hybrid", min_gemm_size=4096)
        self.assertEqual(policy.name, "fp8_hybrid[min_gemm_size=4096]")
        rebuilt = keras.dtype_policies.get(policy.name)
        self.assertEqual(rebuilt.min_gemm_size, 4096)
        named = keras.dtype_policies.get("fp8_hybrid[history_len=8,min_gemm_size=0]")
        self.assertEqual((named.recipe.history_len, named.min_gemm_size), (8, 0))
        layer = FP8Dense(4, dtype=policy.name)
        self.assertEqual(layer._min_gemm_size(), 4096)
        layer = FP8Dense(4, dtype=policy.name, min_gemm_size=7)
        self.assertEqual(layer._min_gemm_size(), 7)
        self.assertEqual(FP8Dense.from_config(layer.get_config()).min_gemm_size, 7)

    def test_bad_values(self):
        with self.assertRaisesRegex(ValueError, "min_gemm_size"):
            FP8Dense(4, min_gemm_size=-1)
        with self.assertRaisesRegex(ValueError, "min_gemm_size"):
            keras.dtype_policies.get("fp8_hybrid[min_gemm_size=big]")
