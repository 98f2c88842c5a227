"""FP8Dense: numerics against an explicit quantize-then-matmul reference."""

import keras
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from tests.support import numpy_reference as reference
from tests.support.backend_utils import REPO
from tests.support.backend_utils import assert_traces_as_one_graph
from tests.support.backend_utils import gemm_rtol
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import subprocess_env
from tests.support.backend_utils import to_numpy
from tests.support.backend_utils import train_call_with_grads

# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")


_BF16 = ml_dtypes.bfloat16


def _bf16(x):
    return np.asarray(x, np.float32).astype(_BF16).astype(np.float32)


def _assert_close_bf16(actual, expected, msg=""):
    """Equal up to one bfloat16 rounding step (float32 summation order); on
    GPUs within the FP8 tensor cores' accumulation error."""
    rtol = gemm_rtol(emulated=2**-7)
    np.testing.assert_allclose(
        actual, expected, rtol=rtol, atol=rtol * 1e-2 * np.abs(expected).max(),
        err_msg=msg,
    )


class FP8DenseNumericsTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("rank2", (16, 32), 24),
        ("rank3_ragged", (3, 7, 33), 17),
        ("rank4", (2, 3, 5, 8), 4),
    )
    def test_forward_and_gradients_match_reference(self, shape, units):
        keras.utils.set_random_seed(1)
        layer = FP8Dense(units, dtype="fp8_hybrid")
        layer.build(shape)
        bias = rng_normal((units,), 7, 0.1)
        layer.bias.assign(bias)
        # bfloat16-representable data, so that the JAX stateless path (which
        # skips __call__'s input cast) sees the same values.
        x = _bf16(rng_normal(shape, 2, 3.0))
        upstream = _bf16(rng_normal(shape[:-1] + (units,), 3))
        kernel = to_numpy(layer.kernel.value)

        y, dx, grads = train_call_with_grads(layer, x, upstream)

        # Forward: the first call seeds every scale from its own amax.
        xb = _bf16(x).reshape(-1, shape[-1])
        sx = reference.compute_scale(reference.amax(xb), 1.0, "e4m3")
        sk = reference.compute_scale(reference.amax(kernel), 1.0, "e4m3")
        y_ref = _bf16(reference.fp8_matmul(xb, kernel, sx, sk) + _bf16(bias))  # one rounding
        _assert_close_bf16(y.reshape(-1, units), y_ref, "forward")

        # Backward: the output gradient is quantized once to E5M2.
        g = _bf16(upstream).reshape(-1, units)
        sg = reference.compute_scale(reference.amax(g), 1.0, "e5m2")
        qg = reference.dequantize(reference.quantize(g, sg, "e5m2"), 1.0)
        qx = reference.dequantize(reference.quantize(xb, sx, "e4m3"), 1.0)
        qk = reference.dequantize(reference.quantize(kernel, sk, "e4m3"), 1.0)
        dx_ref = _bf16((qg @ qk.T) * np.float32(sg * sk))
        dk_ref = (qx.T @ qg) * np.float32(sx * sg)
        _assert_close_bf16(dx.reshape(-1, shape[-1]), dx_ref, "dx")
        rtol = gemm_rtol()
        np.testing.assert_allclose(
            grads[layer.kernel.path], dk_ref, rtol=rtol,
            atol=rtol * 1e-1 * np.abs(dk_ref).max(),
        )
        np.testing.assert_allclose(grads[layer.bias.path], g.sum(0), rtol=1e-2)
        # The pending gradient amax: [amax of the output gradient, token 1].
        np.testing.assert_array_equal(
            grads[layer.grad_amax_pending.path], [reference.amax(g), 1.0, 0.0]
        )
        # State after the call: amaxes recorded, next scales published.
        np.testing.assert_array_equal(
            to_numpy(layer.input_amax_history)[:2], [reference.amax(xb), 0.0]
        )
        np.testing.assert_array_equal(
            to_numpy(layer.kernel_amax_history)[:2], [reference.amax(kernel), 0.0]
        )
        self.assertEqual(float(to_numpy(layer.input_scale)), float(sx))
        self.assertEqual(float(to_numpy(layer.kernel_scale)), float(sk))

    def test_e4m3_format_quantizes_gradient_to_e4m3(self):
        layer = FP8Dense(8, dtype="fp8_e4m3", use_bias=False)
        layer.build((4, 16))
        x = _bf16(rng_normal((4, 16), 0))
        upstream = _bf16(rng_normal((4, 8), 1))
        kernel = to_numpy(layer.kernel.value)
        _, dx, _ = train_call_with_grads(layer, x, upstream)
        g = _bf16(upstream)
        sg = reference.compute_scale(reference.amax(g), 1.0, "e4m3")
        sk = reference.compute_scale(reference.amax(kernel), 1.0, "e4m3")
        qg = reference.dequantize(reference.quantize(g, sg, "e4m3"), 1.0)
        qk = reference.dequantize(reference.quantize(kernel, sk, "e4m3"), 1.0)
        _assert_close_bf16(dx, _bf16((qg @ qk.T) * np.float32(sg * sk)))

    def test_second_call_uses_delayed_scale(self):
        layer = FP8Dense(8, dtype="fp8_hybrid", use_bias=False)
        layer.build((4, 16))
        kernel = to_numpy(layer.kernel.value)
        x1 = rng_normal((4, 16), 0, 1.0)
        x2 = rng_normal((4, 16), 1, 10.0)  # a much larger amax
        layer(x1, training=True)
        y2 = to_numpy(layer(x2, training=True))
        sx = reference.compute_scale(reference.amax(_bf16(x1)), 1.0, "e4m3")
        sk = reference.compute_scale(reference.amax(kernel), 1.0, "e4m3")
        # x2 is quantized with x1's scale: it saturates, as delayed scaling does.
        _assert_close_bf16(y2, _bf16(reference.fp8_matmul(_bf16(x2), kernel, sx, sk)))
        np.testing.assert_array_equal(
            to_numpy(layer.input_amax_history)[:3],
            [reference.amax(_bf16(x2)), reference.amax(_bf16(x1)), 0.0],
        )

    def test_inference_does_not_record(self):
        layer = FP8Dense(8, dtype="fp8_hybrid")
        x = rng_normal((4, 16), 0)
        layer(x, training=True)
        state = [to_numpy(v) for v in layer.fp8_state_variables]
        layer(rng_normal((4, 16), 5, 4.0), training=False)
        layer(rng_normal((4, 16), 6, 4.0))
        for before, v in zip(state, layer.fp8_state_variables):
            np.testing.assert_array_equal(before, to_numpy(v))

    def test_nan_input_is_not_recorded_and_propagates(self):
        layer = FP8Dense(4, dtype="fp8_hybrid")
        x = rng_normal((3, 8), 0)
        layer(x, training=True)
        history = to_numpy(layer.input_amax_history)
        scale = to_numpy(layer.input_scale)
        x_bad = x.copy()
        x_bad[1, 2] = np.nan
        y = to_numpy(layer(x_bad, training=True))
        self.assertTrue(np.isnan(y[1]).all())
        np.testing.assert_array_equal(to_numpy(layer.input_amax_history), history)
        np.testing.assert_array_equal(to_numpy(layer.input_scale), scale)

    def test_current_scaling_recipe(self):
        layer = FP8Dense(8, dtype="fp8_hybrid", recipe=keras_fp8.CurrentScaling())
        layer.build((4, 16))
        kernel = to_numpy(layer.kernel.value)
        layer(rng_normal((4, 16), 0), training=True)
        x2 = rng_normal((4, 16), 1, 10.0)
        y2 = to_numpy(layer(x2, training=True))
        sx = reference.compute_scale(reference.amax(_bf16(x2)), 1.0, "e4m3")
        sk = reference.compute_scale(reference.amax(kernel), 1.0, "e4m3")
        _assert_close_bf16(y2, _bf16(reference.fp8_matmul(_bf16(x2), kernel, sx, sk)))
        self.assertEqual(float(to_numpy(layer.input_scale)), float(sx))


class FP8DenseTwiceTest(parameterized.TestCase):
    def test_layer_used_twice_in_one_step(self):
        shared = FP8Dense(8, dtype="fp8_hybrid", use_bias=False)
        inp = keras.Input((16,))
        out = keras.layers.Add()([shared(inp), shared(keras.ops.multiply(inp, 3.0))])
        model = keras.Model(inp, out)
        x = rng_normal((4, 16), 0)
        upstream = rng_normal((4, 8), 1)
        _, _, grads = train_call_with_grads(model, x, upstream)
        xb = _bf16(x)
        history = to_numpy(shared.input_amax_history)
        np.testing.assert_array_equal(
            history[:3], [reference.amax(_bf16(x * 3.0)), reference.amax(xb), 0.0]
        )
        pending = grads[shared.grad_amax_pending.path]
        g_amax = reference.amax(_bf16(upstream))
        # Both uses see the same upstream gradient: amaxes sum (upper bound),
        # tokens sum to 2 (two uses, token 1).
        np.testing.assert_allclose(pending, [2 * g_amax, 2.0, 0.0], rtol=1e-6)

        # The optimizer overwrites the pending value; the next forward (two
        # calls again) folds it exactly once.
        shared.grad_amax_pending.assign(pending)
        train_call_with_grads(model, x, upstream)
        grad_history = to_numpy(shared.grad_amax_history)
        np.testing.assert_allclose(grad_history[:2], [2 * g_amax, 0.0], rtol=1e-6)

    def test_stale_pending_is_not_folded_twice(self):
        # A skipped (fp16 overflow) step never overwrites the pending value.
        layer = FP8Dense(8, dtype="fp8_hybrid")
        layer.build((4, 16))
        x = rng_normal((4, 16), 0)
        upstream = rng_normal((4, 8), 1)
        _, _, grads = train_call_with_grads(layer, x, upstream)
        layer.grad_amax_pending.assign(grads[layer.grad_amax_pending.path])
        train_call_with_grads(layer, x, upstream)  # folds; its step is skipped
        train_call_with_grads(layer, x, upstream)  # stale pending: no fold
        grad_history = to_numpy(layer.grad_amax_history)
        self.assertEqual(np.count_nonzero(grad_history), 1)


class FP8DenseBehaviourTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("float32", "float32"), ("mixed_bfloat16", "mixed_bfloat16")
    )
    def test_without_fp8_policy_equals_dense(self, policy):
        keras.mixed_precision.set_global_policy(policy)
        kwargs = dict(units=12, activation="gelu", kernel_initializer="glorot_normal",
                      bias_initializer="random_normal")
        dense = keras.layers.Dense(**kwargs)
        fp8 = FP8Dense(**kwargs)
        x = rng_normal((5, 3, 20), 0)
        dense.build(x.shape)
        fp8.build(x.shape)
        fp8.kernel.assign(dense.kernel)
        fp8.bias.assign(dense.bias)
        np.testing.assert_array_equal(to_numpy(fp8(x)), to_numpy(dense(x)))
        np.testing.assert_array_equal(
            to_numpy(fp8(x, training=True)), to_numpy(dense(x, training=True))
        )

    def test_disabled_autocast_equals_dense(self):
        # (A Dense under fp8_hybrid would be an FP8 layer: the reference is
        # the plain Dense of the same compute dtype.)
        dense = keras.layers.Dense(12, dtype="mixed_bfloat16")
        fp8 = FP8Dense(12, dtype="fp8_hybrid")
        x = rng_normal((5, 20), 0)
        dense.build(x.shape)
        fp8.build(x.shape)
        fp8.kernel.assign(dense.kernel)
        fp8.bias.assign(dense.bias)
        with keras_fp8.autocast(enabled=False):
            y = to_numpy(fp8(x))
        np.testing.assert_array_equal(y, to_numpy(dense(x)))
        self.assertNotEqual(np.abs(to_numpy(fp8(x)) - y).max(), 0.0)

    def test_state_variables(self):
        layer = FP8Dense(8, dtype="fp8_hybrid[history_len=16]")
        layer.build((None, 4))
        shapes = {v.name: (tuple(v.shape), v.dtype, v.trainable) for v in layer.weights}
        for role in ("input", "kernel", "grad"):
            self.assertEqual(shapes[f"{role}_scale"], ((), "float32", False))
            self.assertEqual(shapes[f"{role}_amax_history"], ((16,), "float32", False))
        self.assertEqual(shapes["grad_amax_pending"], ((3,), "float32", True))
        self.assertTrue(layer.grad_amax_pending.overwrite_with_gradient)
        self.assertEqual(float(to_numpy(layer.input_scale)), 1.0)
        self.assertEqual(len(layer.trainable_weights), 3)
        self.assertEqual(len(layer.non_trainable_weights), 7)

    def test_default_history_len(self):
        layer = FP8Dense(8, dtype="fp8_hybrid")
        layer.build((None, 4))
        self.assertEqual(tuple(layer.input_amax_history.shape), (1024,))

    def test_config_round_trip(self):
        layer = FP8Dense(
            7, activation="relu", use_bias=False, kernel_regularizer="l2",
            recipe=keras_fp8.DelayedScaling(history_len=8, margin=1.0),
            dtype="fp8_hybrid", name="proj",
        )
        config = layer.get_config()
        clone = FP8Dense.from_config(config)
        self.assertEqual(clone.get_config(), config)
        self.assertEqual(clone.recipe, layer.recipe)
        self.assertIsInstance(clone.dtype_policy, keras_fp8.FP8DTypePolicy)
        clone = keras.layers.deserialize(keras.layers.serialize(layer))
        self.assertEqual(clone.recipe, layer.recipe)

    def test_masking_passes_through(self):
        model = keras.Sequential([
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(10, 8, mask_zero=True),
            FP8Dense(4),
        ])
        keras.mixed_precision.set_global_policy("fp8_hybrid")
        out = model.layers[-1].compute_mask(None, keras.ops.ones((2, 5), "bool"))
        self.assertIsNotNone(out)
        self.assertTrue(model.layers[-1].supports_masking)

    def test_regularizer_loss(self):
        layer = FP8Dense(4, kernel_regularizer="l2", dtype="fp8_hybrid")
        layer(rng_normal((2, 3), 0), training=True)
        self.assertLen(layer.losses, 1)


class FP8DenseBadInputTest(parameterized.TestCase):
    def test_rank_one_input(self):
        layer = FP8Dense(4, dtype="fp8_hybrid")
        with self.assertRaisesRegex(ValueError, "min_ndim=2|ndim"):
            layer(np.ones((3,), "float32"))

    def test_mismatched_last_dimension(self):
        layer = FP8Dense(4, dtype="fp8_hybrid")
        layer(np.ones((2, 3), "float32"))
        with self.assertRaisesRegex(ValueError, "axis -1|incompatible"):
            layer(np.ones((2, 5), "float32"))

    def test_integer_input_runs_as_dense_with_a_warning(self):
        layer = FP8Dense(4, dtype="fp8_hybrid", name="int_in")
        dense = keras.layers.Dense(4, dtype="mixed_bfloat16")
        x = np.arange(6, dtype="int32").reshape(2, 3)
        layer.build(x.shape)
        dense.build(x.shape)
        dense.set_weights(layer.get_weights()[:2])
        with self.assertWarnsRegex(UserWarning, "'int_in'.*not in FP8.*floating-point.*int32"):
            y = to_numpy(layer(x, training=True))
        np.testing.assert_array_equal(y, to_numpy(dense(x)))
        # The state did not advance.
        self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 0)

    def test_bad_units(self):
        with self.assertRaisesRegex(ValueError, "units"):
            FP8Dense(0)

    def test_bad_recipe(self):
        with self.assertRaisesRegex(ValueError, "recipe"):
            FP8Dense(4, recipe="fastest")




class NoSpuriousWarningTest(parameterized.TestCase):
    def test_the_filter_matches_only_pending_only_lists(self):
        import re

        from keras_fp8.layers.fp8_state import PENDING_ONLY_MISSING_GRADIENTS

        pattern = re.compile(PENDING_ONLY_MISSING_GRADIENTS, re.I)
        self.assertTrue(pattern.match(
            "Gradients do not exist for variables ['a/fp8_dense/grad_amax_pending', "
            "'b/fp8_dense_1/grad_amax_pending'] when minimizing the loss."
        ))
        self.assertFalse(pattern.match(
            "Gradients do not exist for variables ['a/fp8_dense/grad_amax_pending', "
            "'dense/kernel'] when minimizing the loss."
        ))

    def test_fit_without_fp8_prints_no_missing_gradient_warning(self):
        import subprocess
        import sys

        script = (
            "import numpy as np, keras, keras_fp8\n"
            "keras.mixed_precision.set_global_policy('mixed_bfloat16')\n"
            "m = keras.Sequential([keras.Input((8,)), keras_fp8.FP8Dense(4)])\n"
            "m.compile('sgd', 'mse')\n"
            "m.fit(np.ones((8, 8)), np.ones((8, 4)), verbose=0)\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True,
            env=subprocess_env(), cwd=REPO, check=True,
        )
        self.assertNotIn("Gradients do not exist", result.stderr)


class TorchCompileTracesTest(parameterized.TestCase):
    """Under torch.compile an FP8 layer is one graph on every path: the
    compiled kernels (tests/keras/test_torch_dispatch.py, on an FP8 GPU) and the
    emulation that runs everywhere else (here)."""

    def setUp(self):
        super().setUp()
        if keras.backend.backend() != "torch":
            self.skipTest("torch.compile")

    @parameterized.product(
        kind=["delayed", "bias_relu", "einsum", "current", "small_gemm"],
        training=[True, False],
    )
    def test_layer_call_has_no_graph_break(self, kind, training):
        from keras_fp8.layers import FP8EinsumDense

        shape = (2, 4, 32)
        layer = {
            "delayed": lambda: FP8Dense(16, dtype="fp8_hybrid[history_len=4]", min_gemm_size=0),
            "bias_relu": lambda: FP8Dense(16, activation="relu", dtype="fp8_hybrid", min_gemm_size=0),
            "einsum": lambda: FP8EinsumDense("abc,cd->abd", (None, 16), dtype="fp8_hybrid", min_gemm_size=0),
            "current": lambda: FP8Dense(16, dtype="fp8_e4m3", recipe=keras_fp8.CurrentScaling(), min_gemm_size=0),
            # Below min_gemm_size: compute-dtype GEMMs, state still kept.
            "small_gemm": lambda: FP8Dense(16, dtype="fp8_hybrid"),
        }[kind]()
        layer.build(shape)
        x = keras.ops.cast(rng_normal(shape, 0), "bfloat16")
        assert_traces_as_one_graph(lambda x: layer(x, training=training), x)

    def test_first_call_of_a_fresh_process_traces(self):
        # `import keras_fp8` loads the backend's module: the first FP8 call
        # of a process, compiled, imports nothing (an import would break
        # the graph; in this test process earlier tests have loaded it).
        import subprocess
        import sys

        script = (
            "import torch, keras_fp8\n"
            "from tests.support.backend_utils import assert_traces_as_one_graph\n"
            "layer = keras_fp8.layers.FP8Dense(16, dtype='fp8_hybrid', min_gemm_size=0)\n"
            "layer.build((8, 32))\n"
            "x = torch.randn(8, 32, dtype=torch.bfloat16, device=layer.kernel.value.device)\n"
            "assert_traces_as_one_graph(lambda x: layer(x, training=True), x)\n"
        )
        subprocess.run([sys.executable, "-c", script], check=True,
                       env=subprocess_env(KERAS_BACKEND="torch"), cwd=REPO)

    def test_compiled_training_calls_equal_eager(self):
        import torch

        def run(compiled):
            layer = FP8Dense(16, dtype="fp8_hybrid[history_len=4]", min_gemm_size=0)
            layer.build((8, 32))
            layer.kernel.assign(rng_normal((32, 16), 1))
            call = lambda x: layer(x, training=True)  # noqa: E731
            if compiled:
                torch._dynamo.reset()
                call = torch.compile(call, fullgraph=True, backend="aot_eager")
            results = []
            for seed in range(3):
                x = keras.ops.cast(rng_normal((8, 32), 10 + seed), "bfloat16")
                x.requires_grad_(True)
                y = call(x)
                y.float().square().sum().backward()
                results += [to_numpy(y.detach().float()), to_numpy(x.grad.float())]
            return results + [to_numpy(v) for v in layer.fp8_state_variables]

        for eager, compiled in zip(run(False), run(True)):
            np.testing.assert_array_equal(compiled, eager)
