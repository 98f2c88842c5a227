"""The policy-level autocast scope."""

import pytest
import threading

import keras
import numpy as np
from absl.testing import parameterized

import keras_fp8
from keras_fp8.autocast import current
from keras_fp8.layers import FP8Dense
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import to_numpy


# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")


class AutocastTest(parameterized.TestCase):
    def test_layers_built_inside_get_the_policy(self):
        with keras_fp8.autocast("fp8_e4m3"):
            inner = keras.layers.Dense(3)
            fp8 = FP8Dense(3)
        outer = keras.layers.Dense(3)
        self.assertEqual(inner.dtype_policy.name, "fp8_e4m3")
        self.assertEqual(fp8.dtype_policy.name, "fp8_e4m3")
        self.assertEqual(outer.dtype_policy.name, "float32")

    def test_enables_fp8_for_a_float32_layer(self):
        layer = FP8Dense(8)
        x = rng_normal((4, 16), 0)
        y_plain = to_numpy(layer(x))
        with keras_fp8.autocast("fp8_hybrid"):
            y_fp8 = to_numpy(layer(x, training=True))
        self.assertGreater(np.abs(y_fp8 - y_plain).max(), 0.0)
        self.assertGreater(float(to_numpy(layer.input_amax_history)[0]), 0.0)

    def test_disabled_scope_runs_in_compute_precision(self):
        layer = FP8Dense(8, dtype="fp8_hybrid")
        dense = keras.layers.Dense(8, dtype="mixed_bfloat16")
        x = rng_normal((4, 16), 0)
        layer.build(x.shape)
        dense.build(x.shape)
        dense.kernel.assign(layer.kernel)
        with keras_fp8.autocast(enabled=False):
            y = to_numpy(layer(x, training=True))
        np.testing.assert_array_equal(y, to_numpy(dense(x)))
        np.testing.assert_array_equal(to_numpy(layer.input_amax_history), 0.0)

    def test_scope_recipe_wins(self):
        layer = FP8Dense(8, dtype="fp8_hybrid")
        x = rng_normal((4, 16), 0)
        with keras_fp8.autocast(recipe=keras_fp8.CurrentScaling()):
            layer(x, training=True)
        # Current scaling records no history.
        np.testing.assert_array_equal(to_numpy(layer.input_amax_history), 0.0)
        self.assertNotEqual(float(to_numpy(layer.input_scale)), 1.0)

    def test_nesting_restores_outer_scope(self):
        self.assertIsNone(current())
        with keras_fp8.autocast("fp8_hybrid") as outer:
            with keras_fp8.autocast("fp8_e4m3", enabled=False):
                self.assertFalse(current().enabled)
            self.assertIs(current(), outer)
        self.assertIsNone(current())

    def test_threads_do_not_see_each_others_scope(self):
        seen = {}
        entered = threading.Event()
        release = threading.Event()

        def worker():
            with keras_fp8.autocast("fp8_e4m3"):
                entered.set()
                release.wait(5)

        thread = threading.Thread(target=worker)
        thread.start()
        entered.wait(5)
        seen["main"] = current()
        release.set()
        thread.join()
        self.assertIsNone(seen["main"])

    def test_torch_compile_traces_the_lookup_outside_scopes(self):
        if keras.backend.backend() != "torch":
            self.skipTest("torch.compile")
        import torch

        def step(x):
            return x + (1.0 if current() is None else 2.0)

        torch._dynamo.reset()
        # No scope open: no graph break (Dynamo cannot trace ContextVar.get).
        full = torch.compile(step, fullgraph=True, backend="eager")
        self.assertEqual(float(full(torch.zeros(()))), 1.0)
        # The compiled code guards on the open-scope count: inside a scope
        # it recompiles and sees the scope.
        compiled = torch.compile(step, backend="eager")
        self.assertEqual(float(compiled(torch.zeros(()))), 1.0)
        with keras_fp8.autocast("fp8_hybrid"):
            self.assertEqual(float(compiled(torch.zeros(()))), 2.0)
        self.assertEqual(float(compiled(torch.zeros(()))), 1.0)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "enabled"):
            with keras_fp8.autocast(enabled="yes"):
                pass
        with self.assertRaisesRegex(ValueError, "FP8 dtype policy"):
            with keras_fp8.autocast("mixed_bfloat16"):
                pass
        with self.assertRaisesRegex(ValueError, "recipe"):
            with keras_fp8.autocast(recipe=3):
                pass
