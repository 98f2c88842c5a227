"""FP8EinsumDense: equations, numerics against FP8Dense, state, errors."""

import keras
import numpy as np
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8EinsumDense
from tests.backend_utils import rng_normal
from tests.backend_utils import to_numpy
from tests.backend_utils import train_call_with_grads


class FP8EinsumDenseTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("dense_2d", "ab,bc->ac", (4, 16), (8,), None),
        ("dense_3d", "abc,cd->abd", (2, 5, 16), (None, 8), "d"),
        ("heads", "abc,cde->abde", (2, 5, 16), (None, 4, 6), "de"),
        ("out_proj", "abcd,cde->abe", (2, 5, 4, 6), (None, 16), "e"),
        ("ellipsis", "...b,bc->...c", (3, 2, 16), (8,), None),
        ("transposed", "abc,dc->abd", (2, 5, 16), (None, 8), None),
        ("input_transposed", "acb,cd->abd", (2, 16, 5), (None, 8), None),
        ("output_transposed", "abc,cd->adb", (2, 5, 16), (8, None), None),
    )
    def test_matches_explicit_fp8_matmul(self, equation, in_shape, out_shape, bias_axes):
        keras.utils.set_random_seed(0)
        layer = FP8EinsumDense(equation, out_shape, bias_axes=bias_axes, dtype="fp8_hybrid")
        plain = keras.layers.EinsumDense(equation, out_shape, bias_axes=bias_axes, dtype="mixed_bfloat16")
        x = rng_normal(in_shape, 1)
        y = to_numpy(layer(x, training=True))
        plain.build(in_shape)
        for v_plain, v in zip(plain.weights, layer.weights):
            v_plain.assign(v)
        y_plain = to_numpy(plain(x))
        self.assertEqual(y.shape, y_plain.shape)
        # FP8 quantization noise only: ~2**-4 relative, averaged by the sum.
        error = np.linalg.norm(y - y_plain) / np.linalg.norm(y_plain)
        self.assertLess(error, 0.1)
        self.assertGreater(error, 0.0)
        self.assertGreater(float(to_numpy(layer.kernel_amax_history)[0]), 0.0)

    def test_gradients_flow(self):
        layer = FP8EinsumDense("abc,cde->abde", (None, 4, 6), dtype="fp8_hybrid")
        layer.build((2, 5, 16))
        x = rng_normal((2, 5, 16), 0)
        _, dx, grads = train_call_with_grads(layer, x, rng_normal((2, 5, 4, 6), 1))
        self.assertEqual(dx.shape, x.shape)
        self.assertEqual(grads[layer.kernel.path].shape, (16, 4, 6))
        self.assertTrue(np.all(np.isfinite(grads[layer.kernel.path])))
        self.assertGreater(grads[layer.grad_amax_pending.path][0], 0.0)

    def test_without_fp8_equals_einsum_dense(self):
        layer = FP8EinsumDense("abc,cd->abd", (None, 8), bias_axes="d")
        plain = keras.layers.EinsumDense("abc,cd->abd", (None, 8), bias_axes="d")
        x = rng_normal((2, 5, 16), 0)
        layer.build(x.shape)
        plain.build(x.shape)
        for v_plain, v in zip(plain.weights, layer.weights):
            v_plain.assign(v)
        np.testing.assert_array_equal(to_numpy(layer(x)), to_numpy(plain(x)))

    def test_batched_equation_is_rejected(self):
        layer = FP8EinsumDense("abc,acd->abd", (None, 8), dtype="fp8_hybrid")
        with self.assertRaisesRegex(ValueError, "single matmul.*abc,acd->abd"):
            layer.build((2, 5, 16))

    def test_config_round_trip(self):
        layer = FP8EinsumDense(
            "abc,cd->abd", (None, 8), bias_axes="d",
            recipe=keras_fp8.DelayedScaling(history_len=4),
        )
        clone = FP8EinsumDense.from_config(layer.get_config())
        self.assertEqual(clone.get_config(), layer.get_config())

    def test_wrong_input_shape_names_inputs(self):
        layer = FP8EinsumDense("abc,cd->abd", (None, 8), dtype="fp8_hybrid")
        layer(rng_normal((2, 5, 16), 0))
        with self.assertRaisesRegex(ValueError, r"inputs: expected 3 axes.*\(16,\).*\(2, 4, 8\)"):
            layer(rng_normal((2, 4, 8), 1))
        with self.assertRaisesRegex(ValueError, r"ndim=3"):  # Keras's input spec
            layer(rng_normal((2, 5, 4, 16), 1))
        with self.assertRaisesRegex(ValueError, r"inputs: expected 3 axes.*\(2, 5, 4, 16\)"):
            layer.call(rng_normal((2, 5, 4, 16), 1))  # without __call__'s checks

    def test_integer_input(self):
        layer = FP8EinsumDense("ab,bc->ac", (4,), dtype="fp8_hybrid")
        with self.assertRaisesRegex(ValueError, "floating-point"):
            layer(np.ones((2, 3), "int32"))
