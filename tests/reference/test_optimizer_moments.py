"""The FP8 optimizer moments (keras_fp8.numerics, FP8Adam/FP8AdamW) against
the NumPy/ml_dtypes reference, bit for bit where they quantize or update state."""

import keras
import ml_dtypes
import numpy as np
from absl.testing import parameterized
from keras import ops

import keras_fp8
from keras_fp8 import numerics
from tests.support import moments_reference as reference

# Ragged sizes (none a multiple of 128), a scalar, one shorter than a block.
SHAPES = [(5, 77), (1000,), (3,), (), (129,), (2, 3, 45)]


def _signed(rng, shape, low=-20, high=20):
    """Random values over a wide range of magnitudes (no zeros)."""
    return (rng.standard_normal(shape) * np.exp2(rng.uniform(low, high, shape))).astype(np.float32)


def _with_special_blocks(x, rng, tiny, huge):
    """`x` (flat) with its blocks 1, 2, 3 (where it has them) replaced:
    tiny values, huge values, zeros only."""
    x = x.reshape(-1).copy()
    b = reference.BLOCK
    spread = rng.uniform(1.0, 4.0, b).astype(np.float32) * np.where(rng.random(b) < 0.5, -1, 1)
    for i, fill in enumerate([tiny * spread, huge * spread, np.zeros(b, np.float32)], start=1):
        lo, hi = i * b, min((i + 1) * b, x.size)
        if lo < hi:
            x[lo:hi] = fill[:hi - lo]
    return x


def _bytes(q):
    """The raw bits of a float8 or float16 NumPy array, for exact comparison."""
    q = np.asarray(q)
    return q.view(np.uint8 if q.dtype.itemsize == 1 else np.uint16)


def _numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


class MomentQuantizationTest(parameterized.TestCase):
    @parameterized.parameters(*SHAPES)
    def test_first_moment_bit_exact(self, *shape):
        rng = np.random.default_rng(len(shape) + int(np.prod(shape)))
        m = _with_special_blocks(_signed(rng, (int(np.prod(shape)),)), rng, 1e-30, 1e18).reshape(shape)
        q, scales = numerics.quantize_first_moment(ops.convert_to_tensor(m))
        q_ref, scales_ref = reference.quantize_first_moment(m)
        self.assertEqual(tuple(q.shape), tuple(shape))
        self.assertEqual(tuple(scales.shape), (numerics.moment_blocks(shape),))
        np.testing.assert_array_equal(_bytes(_numpy(ops.view(q, "uint8")).view(ml_dtypes.float8_e4m3fn)),
                                      _bytes(q_ref))
        np.testing.assert_array_equal(_numpy(scales), scales_ref)
        np.testing.assert_array_equal(_numpy(numerics.dequantize_first_moment(q, scales)),
                                      reference.dequantize_first_moment(q_ref, scales_ref))

    @parameterized.parameters(*SHAPES)
    def test_second_moment_bit_exact(self, *shape):
        rng = np.random.default_rng(10 + len(shape) + int(np.prod(shape)))
        r = _with_special_blocks(_signed(rng, (int(np.prod(shape)),), -30, 30), rng, 1e-15, 1e18)
        v = np.square(r).reshape(shape).astype(np.float32)
        q, scales = numerics.quantize_second_moment(ops.convert_to_tensor(v))
        q_ref, scales_ref = reference.quantize_second_moment(v)
        self.assertEqual(_numpy(q).dtype, np.float16)
        np.testing.assert_array_equal(_bytes(_numpy(q)), _bytes(q_ref))
        np.testing.assert_array_equal(_numpy(scales), scales_ref)
        # Scales are powers of two: sqrt(v) is float16's rounding of it.
        mantissa, _ = np.frexp(scales_ref)
        np.testing.assert_array_equal(mantissa, 0.5)
        v_back = _numpy(numerics.dequantize_second_moment(q, scales))
        np.testing.assert_array_equal(v_back, reference.dequantize_second_moment(q_ref, scales_ref))
        # What the format keeps: 11 significant bits of sqrt(v), so v within
        # 2**-10 relatively, wherever sqrt(v) is above 2**-14 of its block's max.
        if v.size:
            r, r_back = np.sqrt(v).reshape(-1), np.sqrt(v_back).reshape(-1)
            block_max = np.repeat(scales_ref * 65504, reference.BLOCK)[:r.size]
            normal = r > block_max * 2.0**-14
            np.testing.assert_allclose(r_back[normal], r[normal], rtol=2.0**-11)

    def test_root_scale_edges(self):
        """The power-of-two scale at its edges: amaxes whose base is exactly a
        power of two or an ulp either side, the floor, the largest float32."""
        f32max = float(np.finfo(np.float32).max)
        amax = [65504.0, 65504.0 * 2.0**-30, 65504.0 * 2.0**40, 1e-30, 2e-38, 0.0, f32max, np.inf, np.nan]
        amax = np.array(amax, np.float32)
        amax = np.concatenate([amax, np.nextafter(amax[:3], np.float32(np.inf)),
                               np.nextafter(amax[:3], np.float32(0))]).astype(np.float32)
        got = _numpy(numerics._root_scale(ops.convert_to_tensor(amax)))
        np.testing.assert_array_equal(got, [reference.root_scale(a) for a in amax])
        np.testing.assert_array_equal(got[:3], [1.0, 2.0**-30, 2.0**40])
        np.testing.assert_array_equal(got[4:9], [2.0**-126, 1.0, 2.0**113, 1.0, 1.0])

    def test_special_values(self):
        m = np.zeros(300, np.float32)
        m[5], m[7] = np.nan, 3.0            # block 0: NaN
        m[130], m[131] = np.inf, -2.0        # block 1: inf
        m[260] = 1.0                         # block 2: finite
        q, scales = numerics.quantize_first_moment(ops.convert_to_tensor(m))
        q_ref, scales_ref = reference.quantize_first_moment(m)
        np.testing.assert_array_equal(_numpy(scales), scales_ref)
        np.testing.assert_array_equal(_numpy(scales)[:2], [1.0, 1.0])
        back = _numpy(numerics.dequantize_first_moment(q, scales))
        self.assertTrue(np.isnan(back[5]) and np.isnan(back[130]))  # non-finite stays non-finite
        self.assertEqual(back[7], 3.0)
        self.assertEqual(back[260], 1.0)
        v = np.abs(m)
        q, scales = numerics.quantize_second_moment(ops.convert_to_tensor(v))
        q_ref, scales_ref = reference.quantize_second_moment(v)
        # Equal bytes, except a NaN's payload, which XLA on a GPU writes as
        # float16's all-ones mantissa (0x7fff) where NumPy writes 0x7e00.
        got = _numpy(q)
        nan = np.isnan(np.asarray(q_ref, np.float32))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
        np.testing.assert_array_equal(_bytes(got)[~nan], _bytes(q_ref)[~nan])
        back = _numpy(numerics.dequantize_second_moment(q, scales))
        self.assertTrue(np.isnan(back[5]) and np.isnan(back[130]))
        self.assertEqual(back[260], 1.0)


def _gradients(rng, shape):
    """Gradients over a wide range, with a tiny, a huge and a zero block."""
    return _with_special_blocks(_signed(rng, (int(np.prod(shape)),), -12, 12), rng, 1e-15, 1e15).reshape(shape)


class OptimizerStepTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("adamw", keras_fp8.optimizers.FP8AdamW, dict(weight_decay=0.05)),
        ("adam", keras_fp8.optimizers.FP8Adam, dict(beta_2=0.95, epsilon=1e-6)),
    )
    def test_steps_match_the_reference(self, cls, options):
        rng = np.random.default_rng(3)
        shapes = [(7, 130), (300,), ()]
        weights = [_signed(rng, s, -3, 3) for s in shapes]
        variables = [keras.Variable(w, name=f"w{i}") for i, w in enumerate(weights)]
        optimizer = cls(learning_rate=0.01, **options)
        refs = [reference.AdamFP8Moments(s, 0.01, **options) for s in shapes]
        for step in range(6):
            grads = [_gradients(rng, s) for s in shapes]
            before = [w.copy() for w in weights]
            optimizer.apply([ops.convert_to_tensor(g) for g in grads], variables)
            for i, (variable, ref) in enumerate(zip(variables, refs)):
                weights[i] = ref.step(weights[i], grads[i])
                msg = f"step {step}, variable {i}"
                np.testing.assert_array_equal(
                    np.asarray(optimizer._momentums[i].numpy()), _bytes(ref.m_q).reshape(shapes[i]), err_msg=msg)
                np.testing.assert_array_equal(np.asarray(optimizer._momentum_scales[i].numpy()), ref.m_scales,
                                              err_msg=msg)
                np.testing.assert_array_equal(_bytes(np.asarray(optimizer._velocities[i].numpy())),
                                              _bytes(ref.v_q), err_msg=msg)
                np.testing.assert_array_equal(np.asarray(optimizer._velocity_scales[i].numpy()), ref.v_scales,
                                              err_msg=msg)
                # The weights: `beta**t` and the weight decay may round an ulp
                # apart between NumPy and a backend (torch decays by
                # `w * (1 - wd * lr)`): the step agrees to 1e-5 of its size,
                # the weight to its last bits beyond that.
                got = np.asarray(variable.numpy())
                self.assertTrue(np.all(np.abs(got - weights[i]) <= 1e-5 * np.abs(weights[i] - before[i])
                                       + 4 * np.spacing(np.abs(weights[i]))), msg=msg)
                # The reference's state, not a drifted copy: feed it ours.
                weights[i] = np.asarray(variable.numpy())

    def test_compiled_step_within_rounding_of_eager(self):
        """A compiled step (JAX's model.fit) quantizes as the eager one, but
        XLA contracts `a * b + c` into a fused multiply-add, as it does in
        Keras's own Adam: the float32 moments before quantization may be an
        ulp apart, and so, rarely, a stored value one step of its format."""
        if keras.backend.backend() != "jax":
            self.skipTest("JAX: the jitted stateless update of model.fit")
        import jax

        rng = np.random.default_rng(4)
        shapes = [(9, 140), (50,)]
        variables = [keras.Variable(_signed(rng, s, -3, 3)) for s in shapes]
        optimizer = keras_fp8.optimizers.FP8AdamW(learning_rate=0.01)
        optimizer.build(variables)
        state = ([v.value for v in variables], [v.value for v in optimizer.variables])
        jitted = jax.jit(optimizer.stateless_apply)
        for step in range(4):
            grads = [ops.convert_to_tensor(_gradients(rng, s)) for s in shapes]
            compiled = jitted(state[1], grads, state[0])
            eager = optimizer.stateless_apply(state[1], grads, state[0])
            for a, b in zip(compiled[0], eager[0]):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
            named = dict(zip([v.name for v in optimizer.variables], zip(compiled[1], eager[1])))
            for i in range(len(shapes)):
                for kind in ("momentum", "velocity"):
                    (qc, qe), (sc, se) = (named[optimizer._momentums[i].name], named[optimizer._momentum_scales[i].name]) \
                        if kind == "momentum" else (named[optimizer._velocities[i].name],
                                                    named[optimizer._velocity_scales[i].name])
                    np.testing.assert_allclose(np.asarray(sc), np.asarray(se), rtol=2.0**-22)
                    if kind == "momentum":
                        c = numerics.dequantize_first_moment(ops.view(qc, "float8_e4m3fn"), sc)
                        e = numerics.dequantize_first_moment(ops.view(qe, "float8_e4m3fn"), se)
                        rtol = 2.0**-3
                    else:
                        c = numerics.dequantize_second_moment(qc, sc)
                        e = numerics.dequantize_second_moment(qe, se)
                        rtol = 2.0**-9
                    c, e = _numpy(c), _numpy(e)
                    msg = f"step {step}, {kind} {i}"
                    # A block's scale an ulp apart moves each of its values by
                    # an ulp; a value rounded to the neighbouring step is rare.
                    self.assertLessEqual(np.mean(~np.isclose(c, e, rtol=2.0**-20, atol=0)), 0.01, msg=msg)
                    np.testing.assert_allclose(c, e, rtol=rtol, atol=float(np.max(np.asarray(se))) * 2.0**-9,
                                               err_msg=msg)
            state = compiled
