"""FP8EinsumDense: equations, numerics against FP8Dense, state, errors."""

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import to_numpy
from tests.support.backend_utils import train_call_with_grads


# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")


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

    def test_integer_input_runs_as_einsum_dense_with_a_warning(self):
        # The call is EinsumDense's: whatever EinsumDense does with integer
        # inputs on this backend (torch's einsum refuses int32 x bfloat16).
        layer = FP8EinsumDense("ab,bc->ac", (4,), dtype="fp8_hybrid", name="int_in")
        plain = keras.layers.EinsumDense("ab,bc->ac", (4,), dtype="mixed_bfloat16")
        x = np.ones((2, 3), "int32")
        layer.build(x.shape)
        plain.build(x.shape)
        plain.set_weights(layer.get_weights()[:1])
        try:
            expected = to_numpy(plain(x))
        except Exception as e:  # noqa: BLE001 (the backend's own error)
            with self.assertWarnsRegex(UserWarning, "'int_in'.*floating-point"):
                with self.assertRaises(type(e)):
                    layer(x)
            return
        with self.assertWarnsRegex(UserWarning, "'int_in'.*floating-point"):
            np.testing.assert_array_equal(to_numpy(layer(x)), expected)


def _bf16(x):
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


class FP8EinsumDenseReferenceTest(parameterized.TestCase):
    """Outputs and gradients against the explicit quantize-then-einsum
    reference: the input and the kernel quantized to E4M3 with the scales the
    first call seeds, the output gradient to E5M2, einsum in float32 over the
    dequantized values; compared element by element."""

    @parameterized.named_parameters(
        ("dense_3d", "abc,cd->abd", (2, 5, 16), (None, 8), "d"),
        ("heads", "abc,cde->abde", (2, 5, 16), (None, 4, 6), None),
        ("heads_bias", "abc,cde->abde", (2, 5, 16), (None, 4, 6), "de"),
        ("out_proj", "abcd,cde->abe", (2, 5, 4, 6), (None, 16), "e"),
        ("transposed_kernel", "abc,dc->abd", (2, 5, 16), (None, 8), None),
        ("transposed_input", "acb,cd->abd", (2, 16, 5), (None, 8), None),
        ("transposed_output", "abc,cd->adb", (2, 5, 16), (8, None), None),
    )
    def test_outputs_and_gradients_match_reference(self, equation, in_shape, out_shape, bias_axes):
        from tests.support import numpy_reference as reference
        from tests.support.backend_utils import gemm_rtol

        keras.utils.set_random_seed(3)
        layer = FP8EinsumDense(equation, out_shape, bias_axes=bias_axes, dtype="fp8_hybrid", min_gemm_size=0)
        layer.build(in_shape)
        if layer.bias is not None:
            layer.bias.assign(rng_normal(tuple(layer.bias.shape), 4, 0.1))
        x = _bf16(rng_normal(in_shape, 1, 2.0))
        y_shape = tuple(to_numpy(layer(x)).shape)  # a call without training: nothing recorded
        upstream = _bf16(rng_normal(y_shape, 2))
        kernel = to_numpy(layer.kernel)
        y, dx, grads = train_call_with_grads(layer, x, upstream)

        inputs, _, output = equation.partition("->")
        x_axes, k_axes = inputs.split(",")
        sx = reference.compute_scale(reference.amax(x), 1.0, "e4m3")
        sk = reference.compute_scale(reference.amax(kernel), 1.0, "e4m3")
        sg = reference.compute_scale(reference.amax(upstream), 1.0, "e5m2")
        qx = reference.dequantize(reference.quantize(x, sx, "e4m3"), sx)
        qk = reference.dequantize(reference.quantize(kernel, sk, "e4m3"), sk)
        qg = reference.dequantize(reference.quantize(upstream, sg, "e5m2"), sg)
        y_ref = np.einsum(equation, qx, qk)
        if layer.bias is not None:  # added in float32, one rounding (docs/numerics.md)
            y_ref = y_ref + _bf16(to_numpy(layer.bias))
        y_ref = _bf16(y_ref)
        dx_ref = _bf16(np.einsum(f"{output},{k_axes}->{x_axes}", qg, qk))
        dk_ref = np.einsum(f"{x_axes},{output}->{k_axes}", qx, qg)

        rtol = gemm_rtol(emulated=2**-7)
        for name, got, want in (("y", y, y_ref), ("dx", dx, dx_ref), ("dkernel", grads[layer.kernel.path], dk_ref)):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * 1e-2 * np.abs(want).max(), err_msg=name)
        np.testing.assert_array_equal(
            grads[layer.grad_amax_pending.path], [reference.amax(upstream), 1.0, 0.0])


def _magnitudes(shape, seed, high=100.0):
    """bfloat16 values of magnitude 1 to `high`, random signs. Quantized
    with the scale their amax seeds, each is at least 4 (in E4M3, a multiple
    of 2**-1), so sums of up to 16 products of two are exact in float32,
    whatever the order: a reference can match bit for bit."""
    rng = np.random.default_rng(seed)
    values = rng.uniform(1.0, high, shape) * rng.choice([-1.0, 1.0], shape)
    return _bf16(values)


def _einsum_with_bias(equation, out_shape, bias_axes, in_shape):
    """An `fp8_hybrid` FP8EinsumDense built for `in_shape`, its kernel and
    bias set to fresh `_magnitudes`; returns `(layer, kernel, bias)`."""
    layer = FP8EinsumDense(equation, out_shape, bias_axes=bias_axes, dtype="fp8_hybrid")
    layer.build(in_shape)
    kernel = _magnitudes(tuple(layer.kernel.shape), 1)
    bias = _magnitudes(tuple(layer.bias.shape), 2)
    layer.kernel.assign(kernel)
    layer.bias.assign(bias)
    return layer, kernel, bias


class FP8EinsumDenseBiasTest(parameterized.TestCase):
    """The bias rounds once, as in `FP8Dense` (docs/numerics.md, "GEMMs"):
    added in float32 to the GEMM's float32 product, then one rounding to
    the compute dtype. At bfloat16 with outputs in the thousands and biases
    up to 100, rounding the product first changes about a quarter of the
    outputs."""

    @parameterized.named_parameters(
        # equation, output shape, bias axes; the equal FP8Dense's kernel and
        # bias as NumPy functions of the einsum's, and the einsum's output
        # (or output gradient) as FP8Dense's.
        ("dense_3d", "abc,cd->abd", (None, 8), "d", lambda k: k, lambda b: b, lambda y: y),
        ("heads", "abc,cde->abde", (None, 4, 6), "de",
         lambda k: k.reshape(16, 24), lambda b: b.reshape(24), lambda y: y.reshape(4, 8, 24)),
        # The kernel's output axes in the other order: the bias transposed
        # into the GEMM's columns.
        ("heads_kernel_transposed", "abc,ced->abde", (None, 4, 6), "de",
         lambda k: k.reshape(16, 24), lambda b: b.T.reshape(24), lambda y: y.transpose(0, 1, 3, 2).reshape(4, 8, 24)),
        ("output_transposed", "abc,cd->adb", (8, None), "d",
         lambda k: k, lambda b: b.reshape(8), lambda y: y.transpose(0, 2, 1)),
    )
    def test_equals_fp8_dense(self, equation, out_shape, bias_axes, dense_kernel, dense_bias, to_dense):
        in_shape = (4, 8, 16)
        layer, kernel, bias = _einsum_with_bias(equation, out_shape, bias_axes, in_shape)
        dense = FP8Dense(dense_kernel(kernel).shape[1], dtype="fp8_hybrid")
        dense.build(in_shape)
        dense.kernel.assign(dense_kernel(kernel))
        dense.bias.assign(dense_bias(bias))
        for step in range(2):  # the first call seeds the scales; the second uses the state
            x = _magnitudes(in_shape, 3 + step)
            upstream = _bf16(rng_normal(tuple(to_numpy(layer(x)).shape), 5 + step))
            y, dx, grads = train_call_with_grads(layer, x, upstream)
            y_dense, dx_dense, dense_grads = train_call_with_grads(
                dense, x, np.ascontiguousarray(to_dense(upstream)))
            np.testing.assert_array_equal(to_dense(y), y_dense)
            np.testing.assert_array_equal(dx, dx_dense)
            np.testing.assert_array_equal(dense_kernel(grads[layer.kernel.path]), dense_grads[dense.kernel.path])
            np.testing.assert_array_equal(dense_bias(grads[layer.bias.path]), dense_grads[dense.bias.path])
            np.testing.assert_array_equal(grads[layer.grad_amax_pending.path],
                                          dense_grads[dense.grad_amax_pending.path])
            for name in ("input_amax_history", "kernel_amax_history", "input_scale", "kernel_scale"):
                np.testing.assert_array_equal(to_numpy(getattr(layer, name)), to_numpy(getattr(dense, name)))

    @parameterized.named_parameters(
        # Biases that map onto the GEMM's columns (the epilogue adds them)
        # and biases that do not (added to the GEMM's float32 output): one
        # along an input axis of the output, one broadcast along an output
        # axis of the kernel.
        ("columns", "abc,cde->abde", (None, 4, 6), "de"),
        ("along_the_sequence", "abc,cd->abd", (8, 8), "b"),
        ("broadcast_over_heads", "abc,cde->abde", (None, 4, 6), "e"),
        ("sequence_and_heads", "abc,cde->abde", (8, 4, 6), "bd"),
    )
    def test_forward_matches_the_numpy_reference_bit_for_bit(self, equation, out_shape, bias_axes):
        from tests.support import numpy_reference as reference
        from tests.support.backend_utils import real_fp8_gemm

        in_shape = (4, 8, 16)
        layer, kernel, bias = _einsum_with_bias(equation, out_shape, bias_axes, in_shape)
        x = _magnitudes(in_shape, 3)
        # Multiples of 1/16 below 8: their float32 sums are exact in any order.
        upstream = np.round(rng_normal(tuple(to_numpy(layer(x)).shape), 4) * 16) / 16
        y, _, grads = train_call_with_grads(layer, x, upstream)

        sx = reference.compute_scale(reference.amax(x), 1.0, "e4m3")
        sk = reference.compute_scale(reference.amax(kernel), 1.0, "e4m3")
        qx = reference.quantize(x, sx, "e4m3").astype(np.float64)
        qk = reference.quantize(kernel, sk, "e4m3").astype(np.float64)
        product = np.einsum(equation, qx, qk).astype(np.float32) * np.float32(np.float32(sx) * np.float32(sk))
        y_ref = _bf16(product + bias)  # bias: bfloat16 values, added in float32, one rounding
        double = _bf16(_bf16(product) + bias)
        self.assertGreater(np.mean(y_ref != double), 0.1)  # the data tells the two rules apart
        if real_fp8_gemm():  # FP8 tensor cores accumulate in reduced precision
            np.testing.assert_allclose(y, y_ref, rtol=2e-2, atol=2e-2 * np.abs(y_ref).max())
        else:
            np.testing.assert_array_equal(y, y_ref)
        # The bias gradient: summed in float32, rounded once to the compute
        # dtype (as FP8Dense's).
        inputs, _, output = equation.partition("->")
        bias_letters = output[len(output) - len(layer.bias.shape):]
        summed = tuple(i for i, c in enumerate(output) if c not in bias_letters or c not in bias_axes)
        db_ref = _bf16(upstream.astype(np.float64).sum(axis=summed).astype(np.float32)).reshape(layer.bias.shape)
        np.testing.assert_array_equal(grads[layer.bias.path], db_ref)
