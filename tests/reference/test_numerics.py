"""The reference numerics (keras_fp8.numerics) against ml_dtypes and NumPy."""

import ml_dtypes
import numpy as np
from absl.testing import parameterized
import keras
from keras import ops

import keras_fp8
from keras_fp8 import numerics
from tests.support import backend_utils
from tests.support import numpy_reference as reference

_NP_DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}


def _special_values(fmt):
    _, fmt_max = reference.FMT[fmt]
    tiny = float(ml_dtypes.finfo(reference.FMT[fmt][0]).smallest_subnormal)
    return np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, fmt_max, -fmt_max,
         fmt_max * 1.07, -fmt_max * 3, 1e30, tiny, tiny / 2, tiny * 0.75,
         -tiny * 1.5, tiny * 3.5],
        np.float32,
    )


class QuantizeTest(parameterized.TestCase):
    @parameterized.product(
        fmt=["e4m3", "e5m2"],
        dtype=["float32", "bfloat16", "float16"],
        seed=[0, 1],
    )
    def test_bit_exact_against_ml_dtypes(self, fmt, dtype, seed):
        rng = np.random.default_rng(seed)
        _, fmt_max = reference.FMT[fmt]
        # Random magnitudes over the whole range, past the max and into the
        # subnormals, plus the special values.
        x = rng.standard_normal(4096) * np.exp2(rng.uniform(-24, 20, 4096))
        x = np.concatenate([x, _special_values(fmt)]).astype(np.float32)
        x = x.astype(_NP_DTYPES[dtype]).astype(np.float32)
        finite = np.abs(x[np.isfinite(x)])
        scale = np.float32(rng.uniform(0.5, 2.0) * finite.max() / fmt_max / 8)
        q = numerics.quantize(
            ops.cast(ops.convert_to_tensor(x), dtype),
            ops.convert_to_tensor(scale),
            fmt,
        )
        ours = ops.convert_to_numpy(ops.cast(q, "float32"))
        expected = reference.quantize(x, scale, fmt).astype(np.float32)
        np.testing.assert_array_equal(np.isnan(ours), np.isnan(expected))
        np.testing.assert_array_equal(
            ours[~np.isnan(ours)], expected[~np.isnan(expected)]
        )
        # Saturation: no inf ever comes out.
        self.assertFalse(np.isinf(ours).any())
        # The float8 bytes themselves agree.
        ours_bytes = backend_utils.fp8_bytes(q)
        np.testing.assert_array_equal(
            ours_bytes[~np.isnan(ours)],
            reference.quantize(x, scale, fmt).view(np.uint8)[~np.isnan(ours)],
        )

    def test_dequantize_is_exact(self):
        x = np.random.default_rng(3).standard_normal(512).astype(np.float32)
        q = numerics.quantize(ops.convert_to_tensor(x), 0.01, "e4m3")
        ours = ops.convert_to_numpy(numerics.dequantize(q, 0.01))
        expected = reference.dequantize(reference.quantize(x, 0.01, "e4m3"), 0.01)
        np.testing.assert_array_equal(ours, expected)

    def test_compiled_widening_keeps_the_fp8_rounding(self):
        # Inside one compiled function XLA on a GPU would fold float32 ->
        # float8 -> float32 into nothing (tests/keras/test_jax_gpu.py checks it
        # there); every widening goes through numerics.widen, which keeps
        # the two conversions apart (an optimization barrier under JAX).
        if keras.backend.backend() != "jax":
            self.skipTest("the JAX backend compiles the round trip")
        import jax

        x = np.random.default_rng(4).standard_normal((64, 48)).astype(np.float32)
        expected = reference.dequantize(reference.quantize(x, 0.01, "e4m3"), 0.01)
        paths = {
            "dequantize": lambda x: numerics.dequantize(numerics.quantize(x, 0.01, "e4m3"), 0.01),
            "scaled_matmul": lambda x: numerics.scaled_matmul(
                numerics.quantize(x, 0.01, "e4m3"), numerics.quantize(np.eye(48, dtype=np.float32), 1.0, "e4m3"),
                0.01, "float32"),
            "quantization_stats": lambda x: numerics.quantization_stats(x, 0.01, "e4m3")["sqnr_db"],
        }
        for name, fn in paths.items():
            compiled = jax.jit(fn)
            self.assertIn("optimization_barrier", compiled.lower(x).as_text(), name)
            if name != "quantization_stats":
                np.testing.assert_array_equal(np.asarray(compiled(x)), expected, err_msg=name)

    def test_amax_propagates_non_finite(self):
        x = np.array([1.0, -3.0, 2.0], np.float32)
        self.assertEqual(float(numerics.compute_amax(x)), 3.0)
        self.assertTrue(np.isinf(float(numerics.compute_amax(np.append(x, -np.inf)))))
        self.assertTrue(np.isnan(float(numerics.compute_amax(np.append(x, np.nan)))))


class ScaleTest(parameterized.TestCase):
    @parameterized.product(fmt=["e4m3", "e5m2"], margin=[0.0, 1.0, 3.0])
    def test_compute_scale(self, fmt, margin):
        for window in [3.5, 1e-30, 0.0, np.inf, np.nan, 5e4]:
            ours = float(numerics.compute_scale(np.float32(window), np.float32(0.25), fmt, margin))
            expected = reference.compute_scale(window, 0.25, fmt, margin)
            self.assertEqual(ours, float(expected), msg=f"window={window}")

    def test_record_amax_layout_and_non_finite(self):
        h = np.array([3.0, 2.0, 1.0, 0.5], np.float32)
        np.testing.assert_array_equal(
            ops.convert_to_numpy(numerics.record_amax(h, np.float32(7.0))),
            [7.0, 3.0, 2.0, 1.0],
        )
        for bad in [np.inf, -np.inf, np.nan]:
            np.testing.assert_array_equal(
                ops.convert_to_numpy(numerics.record_amax(h, np.float32(bad))), h
            )
        np.testing.assert_array_equal(
            ops.convert_to_numpy(numerics.record_amax(h, np.float32(0.0))),
            [0.0, 3.0, 2.0, 1.0],
        )
        np.testing.assert_array_equal(
            ops.convert_to_numpy(
                numerics.record_amax(h, np.float32(0.0), skip_zero=True)
            ),
            h,
        )

    @parameterized.product(
        algo=["max", "most_recent"], margin=[0.0, 2.0], history_len=[1, 4, 16],
        fmt=["e4m3", "e5m2"],
    )
    def test_delayed_scaling_against_reference(self, algo, margin, history_len, fmt):
        recipe = keras_fp8.DelayedScaling(
            history_len=history_len, margin=margin, amax_compute_algo=algo
        )
        ref = reference.DelayedOperand(history_len, fmt, margin, algo)
        history = np.zeros(history_len, np.float32)
        scale = np.float32(1.0)
        rng = np.random.default_rng(history_len)
        amaxes = list(rng.uniform(0.1, 100.0, 12).astype(np.float32))
        # Zero and non-finite amaxes in the middle of the run.
        amaxes[4:4] = [np.float32(0.0), np.float32(np.inf), np.float32(np.nan)]
        for i, a in enumerate(amaxes):
            record = i != 9  # one inference call in the middle
            used, history, scale = numerics.delayed_scale_update(
                np.float32(a), history, scale, fmt, recipe, record=record
            )
            expected_used = ref.step(a, record=record)
            self.assertEqual(float(used), float(expected_used), msg=f"call {i}")
            np.testing.assert_array_equal(ops.convert_to_numpy(history), ref.history)
            self.assertEqual(float(scale), float(ref.scale), msg=f"call {i}")
            history = ops.convert_to_numpy(history)
            scale = np.float32(ops.convert_to_numpy(scale))

    def test_first_call_seeds_from_its_own_amax(self):
        recipe = keras_fp8.DelayedScaling(history_len=4)
        used, history, scale = numerics.delayed_scale_update(
            np.float32(44.8), np.zeros(4, np.float32), np.float32(1.0), "e4m3", recipe
        )
        self.assertAlmostEqual(float(used), 0.1, places=6)
        self.assertEqual(float(scale), float(used))
        np.testing.assert_array_equal(
            ops.convert_to_numpy(history), np.array([44.8, 0, 0, 0], np.float32)
        )

    def test_first_call_non_finite_keeps_scale(self):
        recipe = keras_fp8.DelayedScaling(history_len=4)
        used, history, scale = numerics.delayed_scale_update(
            np.float32(np.nan), np.zeros(4, np.float32), np.float32(1.0), "e4m3", recipe
        )
        self.assertEqual(float(used), 1.0)
        self.assertEqual(float(scale), 1.0)
        np.testing.assert_array_equal(ops.convert_to_numpy(history), np.zeros(4))

    def test_current_scaling(self):
        recipe = keras_fp8.CurrentScaling(margin=1.0)
        used, history, scale = numerics.operand_scale(
            np.float32(448.0), np.zeros(3, np.float32), np.float32(7.0), "e4m3", recipe
        )
        # margin=1: the amax maps to 448 / 2, headroom for twice the amax.
        self.assertEqual(float(used), 2.0)
        self.assertEqual(float(scale), 2.0)
        np.testing.assert_array_equal(ops.convert_to_numpy(history), np.zeros(3))
        used, _, _ = numerics.operand_scale(
            np.float32(0.0), np.zeros(3, np.float32), np.float32(7.0), "e4m3", recipe
        )
        self.assertEqual(float(used), 7.0)


def _block_data(rng, shape, kind):
    """Random data for the block-scaling tests: tiles of very different
    magnitudes (tiny, huge, mixed), with zeros and non-finite values where
    asked."""
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "mixed":
        # Per-row and per-column magnitudes from 2**-100 to 2**100.
        x *= np.float32(2.0) ** rng.integers(-100, 100, (shape[0], 1)).astype(np.float32)
        x *= np.float32(2.0) ** rng.integers(-20, 20, (1, shape[1])).astype(np.float32)
    elif kind == "tiny":
        # Down to the scale floor, every input a normal float (XLA on CPU
        # flushes subnormal inputs to zero: docs/numerics.md).
        x = np.sign(x) * (np.abs(x) + np.float32(1.0)) * np.float32(1e-36)
    elif kind == "huge":
        x *= np.float32(1e37)
    elif kind == "special":
        r, c = shape
        x[0, :] = 0.0
        x[1 % r, 3 % c] = np.inf
        x[2 % r, 5 % c] = np.nan
        x[-1, -1] = -np.inf
    return x


def _bits(q):
    """FP8 values (as float32) as bits, every NaN one pattern (the sign of a
    NaN is not part of the contract): -0 and 0 stay apart."""
    f = np.asarray(q).astype(np.float32)
    return np.where(np.isnan(f), np.float32(np.nan), f).view(np.uint32) & np.where(
        np.isnan(f), np.uint32(0x7FFFFFFF), np.uint32(0xFFFFFFFF))


class BlockScalingTest(parameterized.TestCase):
    """The block-scaling reference (`numerics.quantize_tiles`,
    `quantize_blocks`, `block_matmul`) against the NumPy reference: bytes and
    scales equal, at aligned and ragged shapes."""

    @parameterized.product(
        shape=[(128, 256), (130, 300), (5, 3)],
        kind=["normal", "mixed", "tiny", "huge", "special"],
        fmt_pow2=[("e4m3", False), ("e5m2", False), ("e4m3", True)],
    )
    def test_tiles_bit_exact(self, shape, kind, fmt_pow2):
        fmt, power_of_two = fmt_pow2
        rng = np.random.default_rng(hash((shape, kind)) % 2**32)
        x = _block_data(rng, shape, kind)
        for axis in (0, 1):
            q, s = numerics.quantize_tiles(ops.convert_to_tensor(x), fmt, axis, 0.0, power_of_two)
            q_ref, s_ref = reference.quantize_tiles(x, fmt, axis, 0.0, power_of_two)
            np.testing.assert_array_equal(ops.convert_to_numpy(s), s_ref)
            np.testing.assert_array_equal(_bits(ops.convert_to_numpy(ops.cast(q, "float32"))), _bits(q_ref))

    @parameterized.product(
        shape=[(256, 128), (300, 130), (3, 5)],
        kind=["normal", "mixed", "special"],
        power_of_two=[False, True],
        margin=[0.0, 2.0],
    )
    def test_blocks_bit_exact(self, shape, kind, power_of_two, margin):
        rng = np.random.default_rng(hash((shape, kind, 1)) % 2**32)
        w = _block_data(rng, shape, kind)
        q, s = numerics.quantize_blocks(ops.convert_to_tensor(w), "e4m3", margin, power_of_two)
        q_ref, s_ref = reference.quantize_blocks(w, "e4m3", margin, power_of_two)
        np.testing.assert_array_equal(ops.convert_to_numpy(s), s_ref)
        np.testing.assert_array_equal(_bits(ops.convert_to_numpy(ops.cast(q, "float32"))), _bits(q_ref))

    def test_power_of_two_scales(self):
        amax = np.array([448.0, 448.0 * 1.5, 1e-37, 3e38, 0.0, np.inf, np.nan], np.float32)
        s = ops.convert_to_numpy(numerics.block_scale(amax, "e4m3", 0.0, True))
        np.testing.assert_array_equal(s, reference.block_scale(amax, "e4m3", 0.0, True))
        self.assertEqual(list(s[:2]), [1.0, 2.0])
        self.assertEqual(float(s[2]), 2.0**-126)  # the floor
        self.assertEqual(list(s[4:]), [1.0, 1.0, 1.0])  # zero or non-finite tiles
        finite = s[:4]
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(finite))), finite)

    @parameterized.product(
        mkn=[(64, 256, 128), (33, 300, 129), (130, 128, 5)],
        b_tiles=[False, True],
    )
    def test_block_matmul(self, mkn, b_tiles):
        m, k, n = mkn
        rng = np.random.default_rng(m * k + n)
        # Rows of magnitudes 2**-20 .. 2**20: every product stays normal in float32.
        a = rng.standard_normal((m, k)).astype(np.float32)
        a *= np.float32(2.0) ** rng.integers(-20, 20, (m, 1)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        a_q, a_s = reference.quantize_tiles(a, "e4m3", 1)
        b_q, b_s = (reference.quantize_tiles(b, "e5m2", 0) if b_tiles
                    else reference.quantize_blocks(b, "e4m3"))
        fp8 = {np.dtype(reference.FMT[f][0]): f for f in reference.FMT}

        def tensor(q):  # FP8 values through float32 (exact), then cast back
            return ops.cast(ops.convert_to_tensor(q.astype(np.float32)), numerics.recipes.FORMAT_DTYPE[fp8[q.dtype]])

        got = ops.convert_to_numpy(numerics.block_matmul(tensor(a_q), a_s, tensor(b_q), b_s, "float32",
                                                         b_tiles=b_tiles))
        want = reference.block_matmul(a_q, a_s, b_q, b_s, b_tiles)
        # float32 sums of exact products: |err| <= K * 2**-23 * sum |terms|.
        bound = reference.block_matmul(np.abs(a_q.astype(np.float32)), a_s, np.abs(b_q.astype(np.float32)),
                                       b_s, b_tiles) * k * 2.0**-23
        self.assertTrue(np.all(np.abs(got - want) <= bound + 1e-45))
