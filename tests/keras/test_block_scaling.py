"""Block scaling (`keras_fp8.BlockScaling`) through the Keras layers, on the
running backend: numerics against the NumPy reference (tests/support/numpy_reference.py),
the state it keeps, policy names, `.keras` files, and the JAX GPU kernels'
CPU forms (Pallas in interpret mode, the scan of FP8 dots)."""

import os
import tempfile

import keras
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from tests.support import numpy_reference as reference
from tests.support.backend_utils import assert_within_terms
from tests.support.backend_utils import gemm_rtol
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import run_under_other_backend
from tests.support.backend_utils import to_numpy
from tests.support.backend_utils import train_call_with_grads

pytestmark = pytest.mark.usefixtures("fp8_at_every_size")


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _dq(q_and_scales, axis):
    """Dequantized tiles (float64): q times its tile's scale along `axis`."""
    q, s = q_and_scales
    q = q.astype(np.float64)
    if axis == 1:
        return q * np.repeat(s, reference.BLOCK, axis=1)[:, : q.shape[1]]
    return q * np.repeat(s, reference.BLOCK, axis=0)[: q.shape[0]]


def _dq_blocks(q_and_scales):
    q, s = q_and_scales
    full = np.repeat(np.repeat(s, reference.BLOCK, axis=0), reference.BLOCK, axis=1)
    return q.astype(np.float64) * full[: q.shape[0], : q.shape[1]]


def _close(actual, expected, msg):
    rtol = gemm_rtol(emulated=2**-7)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * 2e-2 * np.abs(expected).max(),
                               err_msg=msg)


class BlockDenseTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("e4m3", "fp8_e4m3[scaling=block]", "e4m3", False),
        ("hybrid_pow2", "fp8_hybrid[scaling=block,power_of_two=true]", "e5m2", True),
    )
    def test_matches_the_numpy_reference(self, policy, grad_fmt, pow2):
        units, shape = 136, (2, 20, 300)  # K and N not multiples of 128
        layer = FP8Dense(units, dtype=policy)
        layer.build(shape)
        self.assertIsInstance(layer.dtype_policy.recipe, keras_fp8.BlockScaling)
        layer.bias.assign(rng_normal((units,), 7, 0.1))
        x = _bf16(rng_normal(shape, 2, 3.0) * np.exp2(np.arange(shape[-1]) % 7 - 3))
        upstream = _bf16(rng_normal(shape[:-1] + (units,), 3))
        kernel = to_numpy(layer.kernel.value)
        y, dx, grads = train_call_with_grads(layer, x, upstream)

        x2 = x.reshape(-1, shape[-1])
        g = upstream.reshape(-1, units)
        xq = _dq(reference.quantize_tiles(x2, "e4m3", 1, 0.0, pow2), 1)
        kq = _dq_blocks(reference.quantize_blocks(kernel, "e4m3", 0.0, pow2))
        y_ref = _bf16(_bf16(xq @ kq) + _bf16(to_numpy(layer.bias)))
        _close(y.reshape(-1, units), y_ref, "forward")
        gq = _dq(reference.quantize_tiles(g, grad_fmt, 1, 0.0, pow2), 1)
        _close(dx.reshape(-1, shape[-1]), _bf16(gq @ kq.T), "dx")
        xc = _dq(reference.quantize_tiles(x2, "e4m3", 0, 0.0, pow2), 0)
        gc = _dq(reference.quantize_tiles(g, grad_fmt, 0, 0.0, pow2), 0)
        _close(grads[layer.kernel.path], xc.T @ gc, "dkernel")
        np.testing.assert_array_equal(grads[layer.grad_amax_pending.path], [reference.amax(g), 1.0, 0.0])
        # No input or kernel state: histories of one entry, untouched.
        for role in ("input", "kernel"):
            self.assertEqual(to_numpy(getattr(layer, f"{role}_amax_history")).tolist(), [0.0])
            self.assertEqual(float(to_numpy(getattr(layer, f"{role}_scale"))), 1.0)

    def test_einsum_dense(self):
        layer = FP8EinsumDense("abc,cde->abde", output_shape=(None, 4, 40), bias_axes="de",
                               dtype="fp8_e4m3[scaling=block]")
        x = rng_normal((2, 6, 200), 1)
        y = to_numpy(layer(x, training=True))
        kernel = to_numpy(layer.kernel.value).reshape(200, 160)
        xq = _dq(reference.quantize_tiles(_bf16(x.reshape(-1, 200)), "e4m3", 1), 1)
        kq = _dq_blocks(reference.quantize_blocks(kernel, "e4m3"))
        _close(y.reshape(-1, 160), _bf16(xq @ kq), "forward")

    def test_fit_and_keras_file_round_trip(self):
        keras.utils.set_random_seed(0)
        policy = "fp8_hybrid[scaling=block,margin=1.0]"
        model = keras.Sequential([keras.Input((160,)), FP8Dense(96, activation="relu", dtype=policy),
                                  FP8Dense(10, dtype=policy)])
        model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = rng_normal((64, 160), 0)
        y = np.arange(64) % 10
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        self.assertTrue(np.all(np.isfinite(history.history["loss"])))
        self.assertLess(history.history["loss"][-1], history.history["loss"][0])
        path = os.path.join(tempfile.mkdtemp(), "block.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertEqual(loaded.layers[0].dtype_policy.name, model.layers[0].dtype_policy.name)
        self.assertEqual(loaded.layers[0].dtype_policy.recipe, keras_fp8.BlockScaling(fp8_format="hybrid", margin=1.0))
        for a, b in zip(model.variables, loaded.variables):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b), err_msg=a.path)
        np.testing.assert_array_equal(to_numpy(model.predict(x, verbose=0)), to_numpy(loaded.predict(x, verbose=0)))
        loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)


class BlockPolicyTest(parameterized.TestCase):
    def test_names(self):
        recipe = keras_fp8.BlockScaling(power_of_two=True)
        policy = keras_fp8.FP8DTypePolicy("fp8_e4m3", recipe=recipe)
        self.assertEqual(policy.name, "fp8_e4m3[scaling=block,power_of_two=True]")
        self.assertEqual(keras.dtype_policies.get(policy.name).recipe, recipe)
        hybrid = keras.dtype_policies.get("fp8_hybrid[scaling=block]")
        self.assertEqual(hybrid.recipe, keras_fp8.BlockScaling(fp8_format="hybrid"))
        self.assertEqual(keras_fp8.recipes.get("block"), keras_fp8.BlockScaling())

    @parameterized.parameters("fp8_hybrid[scaling=block,power_of_two=maybe]", "fp8_hybrid[power_of_two=true]",
                              "fp8_hybrid[scaling=block,history_len=4]")
    def test_bad_names(self, name):
        with self.assertRaises(ValueError):
            keras.dtype_policies.get(name)

    def test_bad_recipe_arguments(self):
        with self.assertRaisesRegex(ValueError, "power_of_two"):
            keras_fp8.BlockScaling(power_of_two="yes")
        with self.assertRaisesRegex(ValueError, "margin"):
            keras_fp8.BlockScaling(margin=-1)


def _agreement_data(seed=0):
    return rng_normal((33, 260), seed, 2.0), rng_normal((260, 72), 7, 0.2)


def predictions(policy, seed=0):
    """A fixed FP8Dense's output on fixed data (for the cross-backend test),
    FP8 at this small size on every device."""
    x, kernel = _agreement_data(seed)
    layer = FP8Dense(72, dtype=policy, min_gemm_size=0)
    layer.build(x.shape)
    layer.kernel.assign(kernel)
    return to_numpy(layer(x, training=True))


def test_torch_and_jax_agree(tmp_path):
    policy = "fp8_e4m3[scaling=block]"
    out = str(tmp_path / "y.npy")
    script = f"import numpy as np\nfrom tests.keras.test_block_scaling import predictions\nnp.save({out!r}, predictions({policy!r}))\n"
    run_under_other_backend(script)
    # The same bytes and scales on both backends; the matmuls differ in
    # summation order (and, on GPUs, in the tensor cores' partial sums), then
    # one bfloat16 rounding each.
    x, kernel = _agreement_data()
    assert_within_terms(predictions(policy), np.load(out), np.abs(x) @ np.abs(kernel), 2.0**-7, "torch vs jax")


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX kernels")
class JaxBlockKernelsTest(parameterized.TestCase):
    @parameterized.parameters((40, 300, 200, False), (130, 256, 129, True), (256, 384, 128, False))
    def test_pallas_and_scan_equal_the_reference(self, m, k, n, b_tiles):
        import jax.numpy as jnp

        from keras_fp8 import numerics
        from keras_fp8.backends import jax_block

        a = jnp.asarray(rng_normal((m, k), 1, 3.0))
        b = jnp.asarray(rng_normal((k, n), 2))
        a_q, a_s = numerics.quantize_tiles(a, "e4m3", 1)
        b_q, b_s = numerics.quantize_tiles(b, "e5m2", 0) if b_tiles else numerics.quantize_blocks(b, "e4m3")
        bias = jnp.asarray(rng_normal((n,), 3))
        want = np.asarray(numerics.block_matmul(a_q, a_s, b_q, b_s, "float32", bias, b_tiles))
        abs_sum = np.asarray(numerics.block_matmul(jnp.abs(a_q.astype(jnp.float32)), a_s,
                                                   jnp.abs(b_q.astype(jnp.float32)), b_s, "float32", None, b_tiles))
        pallas = jax_block.pallas_block_matmul(a_q, a_s, b_q, b_s, jnp.float32, bias, b_tiles, interpret=True)
        scan = jax_block.scan_block_matmul(a_q, a_s, b_q, b_s, jnp.float32, bias, b_tiles)
        for name, got in (("pallas", pallas), ("scan", scan)):
            assert_within_terms(got, want, abs_sum + np.abs(np.asarray(bias)), 2.0**-20, name)

    def test_a_symbolic_batch_takes_the_scan_without_a_warning(self):
        # Keras's shape inference traces the batch as a symbol; Triton takes
        # no symbolic grid, so that trace gets the scan's shapes, silently,
        # and the shape is not recorded as one the kernel failed for.
        import warnings

        import jax
        import jax.numpy as jnp

        from keras_fp8.backends import jax_block

        (batch,) = jax.export.symbolic_shape("b")
        a_q = jax.ShapeDtypeStruct((batch * 8, 256), jnp.float8_e4m3fn)
        a_s = jax.ShapeDtypeStruct((batch * 8, 2), jnp.float32)
        b_q = jax.ShapeDtypeStruct((256, 128), jnp.float8_e4m3fn)
        b_s = jax.ShapeDtypeStruct((2, 1), jnp.float32)
        failed = set(jax_block._PALLAS_FAILED)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = jax.eval_shape(
                lambda *t: jax_block.gpu_block_matmul(*t, jnp.bfloat16), a_q, a_s, b_q, b_s)
        self.assertEqual((out.shape[1], out.dtype), (128, jnp.bfloat16))
        self.assertEqual(jax_block._PALLAS_FAILED, failed)
