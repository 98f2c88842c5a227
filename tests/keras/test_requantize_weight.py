"""`requantize_weight_in_backward` (a recipe field and policy-name key): the
backward quantizes the kernel again from the forward's state instead of
keeping its FP8 copy; the same bits as keeping it, on both backends
(docs/numerics.md, "Weights in the backward")."""

import keras
import numpy as np
from absl.testing import parameterized

import keras_fp8
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import to_numpy
from tests.support.backend_utils import train_call_with_grads


def _train(policy, layer_class, seed=3):
    """Outputs, input and variable gradients and the FP8 state over three
    training calls on fresh data (tiny, huge and unit magnitudes)."""
    keras.utils.set_random_seed(seed)
    if layer_class == "dense":
        layer = keras_fp8.FP8Dense(24, dtype=policy)
    else:
        layer = keras_fp8.FP8EinsumDense("abc,cde->abde", (None, 4, 6), bias_axes="de", dtype=policy)
    layer.build((2, 8, 32))
    out = []
    for step, magnitude in enumerate((1e-3, 1e3, 1.0)):
        x = (rng_normal((2, 8, 32), 10 + step) * magnitude).astype("float32")
        upstream = rng_normal((2, 8) + tuple(layer.compute_output_shape((2, 8, 32))[2:]), 20 + step)
        y, dx, grads = train_call_with_grads(layer, x, upstream)
        out += [y, dx] + [grads[k] for k in sorted(grads)]
    out += [to_numpy(v) for v in layer.non_trainable_variables]
    return out


class RequantizeWeightInBackwardTest(parameterized.TestCase):
    @parameterized.product(
        base=("fp8_hybrid[min_gemm_size=0", "fp8_hybrid[scaling=current,min_gemm_size=0",
              "fp8_e4m3[scaling=block,min_gemm_size=0"),
        layer_class=("dense", "einsum"),
    )
    def test_same_bits_as_keeping_the_copy(self, base, layer_class):
        kept = _train(base + "]", layer_class)
        again = _train(base + ",requantize_weight_in_backward=true]", layer_class)
        self.assertEqual(len(kept), len(again))
        for i, (a, b) in enumerate(zip(kept, again)):
            np.testing.assert_array_equal(a, b, err_msg=f"item {i}")

    def test_the_policy_name_carries_it(self):
        policy = keras.dtype_policies.get("fp8_hybrid[requantize_weight_in_backward=true]")
        self.assertTrue(policy.recipe.requantize_weight_in_backward)

    def test_a_bad_value_names_the_field(self):
        with self.assertRaisesRegex(ValueError, "requantize_weight_in_backward"):
            keras_fp8.DelayedScaling(requantize_weight_in_backward="yes")

    def test_no_fp8_kernel_among_the_residuals_on_jax(self):
        if keras.backend.backend() != "jax":
            self.skipTest("the JAX backend's residuals")
        # JAX's own residual listing (what `jax.ad_checkpoint.print_saved_residuals` prints).
        from jax._src.ad_checkpoint import saved_residuals

        def fp8_residuals(policy):
            layer = keras_fp8.FP8Dense(48, dtype=policy)
            layer.build((64, 32))
            trainable = [v.value for v in layer.trainable_variables]
            non_trainable = [v.value for v in layer.non_trainable_variables]

            def loss(trainable, x):
                y, _ = layer.stateless_call(trainable, non_trainable, x, training=True)
                return y.astype("float32").sum()

            found = saved_residuals(loss, trainable, rng_normal((64, 32), 1))
            return sorted(tuple(aval.shape) for aval, _ in found if "float8" in str(aval.dtype))

        self.assertEqual(fp8_residuals("fp8_hybrid[min_gemm_size=0]"), [(32, 48), (64, 32)])
        self.assertEqual(fp8_residuals("fp8_hybrid[min_gemm_size=0,requantize_weight_in_backward=true]"), [(64, 32)])
