"""fp16 FP8 training: the FP8-aware LossScaleOptimizer."""

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from tests.support import numpy_reference as reference
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import to_numpy


# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")


def _model():
    keras.utils.set_random_seed(0)
    layer = FP8Dense(8, name="fp8")
    model = keras.Sequential([keras.Input((16,)), layer])
    return model, layer


def _fp8_state(layer):
    return {v.name: to_numpy(v) for v in layer.fp8_state_variables}


class LossScaleOptimizerTest(parameterized.TestCase):
    def test_compile_wraps_for_fp16_fp8_policies(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid_float16")
        model, _ = _model()
        model.compile(optimizer="adam", loss="mse")
        self.assertIsInstance(model.optimizer, keras_fp8.optimizers.LossScaleOptimizer)
        self.assertIsInstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        self.assertIsInstance(model.optimizer.inner_optimizer, keras.optimizers.Adam)

    def test_no_double_wrap(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid_float16")
        model, _ = _model()
        optimizer = keras_fp8.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
        model.compile(optimizer=optimizer, loss="mse")
        self.assertIs(model.optimizer, optimizer)

    def test_bf16_policy_is_not_wrapped(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid")
        model, _ = _model()
        model.compile(optimizer="sgd", loss="mse")
        self.assertNotIsInstance(model.optimizer, keras.optimizers.LossScaleOptimizer)

    def test_overflow_step_is_skipped_and_poisons_nothing(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid_float16[history_len=8]")
        model, layer = _model()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        x = rng_normal((4, 16), 0)
        y = rng_normal((4, 8), 1)

        model.train_on_batch(x, y)  # step A
        scale_a = float(to_numpy(model.optimizer.dynamic_scale))
        pending_a = to_numpy(layer.grad_amax_pending)
        self.assertEqual(pending_a[2], scale_a)
        kernel_before = to_numpy(layer.kernel)

        # Step B overflows: targets far outside fp16 range once scaled.
        model.train_on_batch(x, np.full((4, 8), 6e4, "float32"))
        np.testing.assert_array_equal(to_numpy(layer.kernel), kernel_before)
        self.assertEqual(float(to_numpy(model.optimizer.dynamic_scale)), scale_a / 2)
        for name, value in _fp8_state(layer).items():
            self.assertTrue(np.isfinite(value).all(), msg=name)
        # B's forward folded A's amax, recorded under loss scale scale_a.
        history_b = to_numpy(layer.grad_amax_history)
        self.assertEqual(np.count_nonzero(history_b), 1)
        self.assertEqual(history_b[0], pending_a[0])

        model.train_on_batch(x, y)  # step C
        history_c = to_numpy(layer.grad_amax_history)
        # No record from B; A's amax rescaled with the loss scale.
        self.assertEqual(np.count_nonzero(history_c), 1)
        self.assertEqual(history_c[0], pending_a[0] / 2)
        self.assertEqual(
            float(to_numpy(layer.grad_scale)),
            float(reference.compute_scale(pending_a[0] / 2, 1.0, "e5m2")),
        )
        for name, value in _fp8_state(layer).items():
            self.assertTrue(np.isfinite(value).all(), msg=name)

        model.train_on_batch(x, y)  # step D folds C's amax
        self.assertEqual(np.count_nonzero(to_numpy(layer.grad_amax_history)), 2)

    def test_loss_scale_growth_rescales_history(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid_float16[history_len=8]")
        model, layer = _model()
        optimizer = keras_fp8.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.001), initial_scale=64.0, dynamic_growth_steps=2
        )
        model.compile(optimizer=optimizer, loss="mse")
        x = rng_normal((4, 16), 0)
        y = rng_normal((4, 8), 1)
        model.train_on_batch(x, y)  # scale 64, pending amax a1 (at 64)
        a1 = to_numpy(layer.grad_amax_pending)[0]
        model.train_on_batch(x, y)  # folds a1; 2nd finite step: scale -> 128
        self.assertEqual(float(to_numpy(optimizer.dynamic_scale)), 128.0)
        pending = to_numpy(layer.grad_amax_pending)
        self.assertEqual(pending[2], 128.0)
        model.train_on_batch(x, y)  # folds: history x2, then records a2 (x2)
        history = to_numpy(layer.grad_amax_history)
        self.assertEqual(history[1], np.float32(a1 * 2))
        self.assertEqual(history[0], pending[0])
