"""torch backend: FP8 layers run torch_ops, with the keras.ops reference's state.

Every FP8 layer's matmul on the torch backend is `torch_ops.fp8_linear`
(the compiled kernels on an FP8 GPU, torch_ops's reference elsewhere). After
training calls its state must equal `keras_fp8.numerics` run explicitly
(tests/support/keras_reference.py) bit for bit, and its outputs and gradients agree
element by element (exactly up to float32 summation order under the
emulation, within FP8 tolerance on a GPU).
"""

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from tests.support.backend_utils import assert_traces_as_one_graph
from tests.support.backend_utils import real_fp8_gemm
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import to_numpy
from tests.support.keras_reference import ReferenceSteps
from tests.support.keras_reference import assert_same_state
from tests.support.keras_reference import layer_state

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch backend only")


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _assert_close(actual, expected, msg=""):
    """Element by element: |a - b| <= atol + rtol * |b|."""
    rtol = 3e-2 if real_fp8_gemm() else 2**-7
    atol = rtol * 1e-2 * max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=msg)


def _train_call(layer, x, upstream):
    """A training call and its backward; the optimizer's overwrite of
    `grad_amax_pending` applied. Returns `(y, dx, dkernel, dbias)`."""
    import torch

    xt = torch.tensor(x, device=_device()).requires_grad_()
    for v in layer.trainable_variables:
        v.value.grad = None
    y = layer(xt, training=True)
    (y.float() * torch.tensor(upstream, device=_device())).sum().backward()
    pending_grad = layer.grad_amax_pending.value.grad
    if pending_grad is not None:  # none below min_gemm_size: the optimizer skips it
        layer.grad_amax_pending.assign(pending_grad)
    db = None if layer.bias is None else to_numpy(layer.bias.value.grad)
    return to_numpy(y.detach()), to_numpy(xt.grad), to_numpy(layer._kernel.value.grad), db


class ReferenceStateTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("aligned", (64, 32), 48, "fp8_hybrid[history_len=8]", True),
        ("ragged_rank3", (3, 7, 33), 17, "fp8_hybrid[history_len=8]", True),
        ("e4m3_current", (16, 32), 24, "fp8_e4m3[scaling=current]", False),
        ("margin_most_recent", (32, 48), 40,
         "fp8_hybrid[history_len=8,margin=1.0,amax_compute_algo=most_recent]", True),
        ("float16", (16, 32), 8, "fp8_hybrid_float16[history_len=4]", False),
    )
    def test_training_calls_equal_the_reference(self, shape, units, policy, use_bias):
        layer = FP8Dense(units, dtype=policy, use_bias=use_bias, min_gemm_size=0)
        layer.build(shape)
        if use_bias:
            layer.bias.assign(rng_normal((units,), 3, 0.5))
        ref = ReferenceSteps(layer_state(layer), layer.dtype_policy.recipe, layer.compute_dtype)
        kernel = to_numpy(layer.kernel)
        bias = None if not use_bias else to_numpy(layer.bias)
        for step in range(4):
            x = rng_normal(shape, 10 + step, 1.0 + step)
            up = rng_normal(shape[:-1] + (units,), 20 + step, 10.0**-step)
            y, dx, dk, db = _train_call(layer, x, up)
            ry, rdx, rdk, rdb = ref.step(x.reshape(-1, shape[-1]), kernel, up.reshape(-1, units), bias)
            _assert_close(y.reshape(-1, units), ry, f"y, step {step}")
            _assert_close(dx.reshape(-1, shape[-1]), rdx, f"dx, step {step}")
            _assert_close(dk, rdk, f"dkernel, step {step}")
            if use_bias:
                _assert_close(db, rdb, f"dbias, step {step}")
            assert_same_state(layer, ref.state)

    def test_einsum_layer_equals_the_reference(self):
        layer = FP8EinsumDense("abc,cde->abde", (None, 4, 8), dtype="fp8_hybrid[history_len=4]", min_gemm_size=0)
        layer.build((2, 6, 32))
        ref = ReferenceSteps(layer_state(layer), layer.dtype_policy.recipe)
        kernel = to_numpy(layer.kernel).reshape(32, 32)
        for step in range(3):
            x = rng_normal((2, 6, 32), step)
            up = rng_normal((2, 6, 4, 8), 5 + step)
            y, _, dk, _ = _train_call(layer, x, up)
            ry, _, rdk, _ = ref.step(x.reshape(12, 32), kernel, up.reshape(12, 32))
            _assert_close(y.reshape(12, 32), ry)
            _assert_close(dk.reshape(32, 32), rdk)
            assert_same_state(layer, ref.state)

    def test_layer_used_twice_in_one_step_records_once(self):
        import torch

        layer = FP8Dense(16, dtype="fp8_hybrid[history_len=4]", min_gemm_size=0, use_bias=False)
        layer.build((8, 32))
        x = rng_normal((8, 32), 0)
        for step in range(2):
            xt = torch.tensor(x, device=_device())
            y = layer(xt, training=True) + layer(xt * 2.0, training=True)
            y.float().sum().backward()
            pending = to_numpy(layer.grad_amax_pending.value.grad)
            layer.grad_amax_pending.assign(layer.grad_amax_pending.value.grad)
            layer.grad_amax_pending.value.grad = None
            # Both uses emit the same token; their amaxes sum (an upper bound).
            self.assertEqual(pending[1], 2.0 * (step + 1))
            self.assertEqual(pending[0], 2.0)  # d(sum)/dy = 1 from each use
        state = layer_state(layer)
        self.assertEqual(np.count_nonzero(state["grad_amax_history"]), 1)  # folded once, at step 2
        self.assertEqual(np.count_nonzero(state["input_amax_history"]), 4)  # two calls a step
        np.testing.assert_array_equal(state["grad_fold_state"][:2], [1.0, 2.0])


class ComputeDtypeBelowMinGemmSizeTest(parameterized.TestCase):
    def test_runs_exactly_dense_and_leaves_the_state(self):
        import torch

        layer = FP8Dense(8, dtype="fp8_hybrid[history_len=4]", min_gemm_size=10**12)
        dense = keras.layers.Dense(8, dtype="mixed_bfloat16")
        layer.build((4, 16))
        dense.build((4, 16))
        dense.kernel.assign(layer.kernel)
        dense.bias.assign(rng_normal((8,), 1))
        layer.bias.assign(dense.bias)
        before = layer_state(layer)
        x = rng_normal((4, 16), 0)
        y, dx, dk, _ = _train_call(layer, x, np.ones((4, 8), np.float32))
        xt = torch.tensor(x, device=_device()).requires_grad_()
        yd = dense(xt, training=True)
        yd.float().sum().backward()
        np.testing.assert_array_equal(y, to_numpy(yd.detach()))
        np.testing.assert_array_equal(dx, to_numpy(xt.grad))
        np.testing.assert_array_equal(dk, to_numpy(dense.kernel.value.grad))
        assert_same_state(layer, before)

    def test_first_fp8_call_after_a_stretch_continues_the_state(self):
        """The state did not advance during the compute-dtype calls; the next
        FP8 call is exactly the reference's next call from that state."""
        layer = FP8Dense(8, dtype="fp8_hybrid[history_len=4]", use_bias=False, min_gemm_size=64 * 16 * 8)
        layer.build((64, 16))
        ref = ReferenceSteps(layer_state(layer), layer.dtype_policy.recipe)
        kernel = to_numpy(layer.kernel)
        big = [rng_normal((64, 16), i, 1.0 + i) for i in range(3)]
        ups = [rng_normal((64, 8), 10 + i) for i in range(3)]
        _train_call(layer, big[0], ups[0])
        ref.step(big[0], kernel, ups[0])
        for i in range(3):  # a stretch of small calls: the compute dtype
            _train_call(layer, rng_normal((2, 16), 30 + i, 100.0), np.ones((2, 8), np.float32))
        assert_same_state(layer, ref.state)
        for x, up in zip(big[1:], ups[1:]):
            y, _, _, _ = _train_call(layer, x, up)
            ry, _, _, _ = ref.step(x, kernel, up)
            _assert_close(y, ry)
            assert_same_state(layer, ref.state)

    def test_a_fresh_layer_seeds_at_its_first_fp8_call(self):
        layer = FP8Dense(8, dtype="fp8_hybrid[history_len=4]", use_bias=False, min_gemm_size=64 * 16 * 8)
        layer.build((64, 16))
        ref = ReferenceSteps(layer_state(layer), layer.dtype_policy.recipe)
        _train_call(layer, rng_normal((2, 16), 0, 1e3), np.ones((2, 8), np.float32))
        x, up = rng_normal((64, 16), 1), rng_normal((64, 8), 2)
        _train_call(layer, x, up)
        ref.step(x, to_numpy(layer.kernel), up)
        assert_same_state(layer, ref.state)


def _compute_dtype_twin(layer, shape):
    """The plain Keras layer `layer` computes below `min_gemm_size`: its
    config without the FP8 arguments, under the policy's compute dtype, with
    the same weights."""
    config = layer.get_config()
    config.pop("recipe"), config.pop("min_gemm_size")
    config["dtype"] = {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}.get(layer.compute_dtype, "float32")
    plain = (keras.layers.EinsumDense if isinstance(layer, FP8EinsumDense) else keras.layers.Dense)(**config)
    plain.build(shape)
    for mine, theirs in zip(layer.trainable_variables, plain.trainable_variables):
        theirs.assign(mine)
    return plain


def _train_steps(layer, shape, steps):
    """`steps` training calls of `layer` through `call()` (Keras's
    `Layer.__call__`) and their backwards, on inputs in its compute dtype;
    the optimizer's overwrite of `grad_amax_pending` applied. Returns every
    step's y, dx, dkernel (and dbias)."""
    import torch

    outs = []
    for step in range(steps):
        x = torch.tensor(rng_normal(shape, step), device=_device()).to(getattr(torch, layer.compute_dtype))
        x.requires_grad_()
        y = layer(x, training=True)
        y.float().square().sum().backward()
        pending = getattr(layer, "grad_amax_pending", None)
        if pending is not None and pending.value.grad is not None:  # none below min_gemm_size
            pending.assign(pending.value.grad)
        outs += [to_numpy(y.detach().float()), to_numpy(x.grad.float()), to_numpy(layer._kernel.value.grad)]
        if layer.bias is not None:
            outs.append(to_numpy(layer.bias.value.grad))
        for v in layer.trainable_variables:
            v.value.grad = None
    return outs


class CallTest(parameterized.TestCase):
    """An FP8 layer is called through Keras's `Layer.__call__` like every
    layer; its `call()` against the reference."""

    def _bf16(self, shape, seed):
        import torch

        return torch.tensor(rng_normal(shape, seed), device=_device()).bfloat16()

    @parameterized.named_parameters(
        ("dense_bias_relu", lambda: FP8Dense(24, activation="relu", dtype="fp8_hybrid[history_len=4]",
                                             min_gemm_size=0), (2, 8, 32)),
        ("dense_no_bias_e4m3", lambda: FP8Dense(24, use_bias=False, dtype="fp8_e4m3[history_len=4]",
                                                min_gemm_size=0), (16, 32)),
        ("current", lambda: FP8Dense(24, dtype="fp8_hybrid[scaling=current]", min_gemm_size=0), (16, 32)),
        ("einsum_heads", lambda: FP8EinsumDense("abc,cde->abde", (None, 4, 6), dtype="fp8_hybrid[history_len=4]",
                                                min_gemm_size=0), (2, 8, 32)),
    )
    def test_training_calls_equal_the_reference(self, make, shape):
        import torch

        keras.utils.set_random_seed(0)
        layer = make()
        layer.build(shape)
        if layer.bias is not None:
            layer.bias.assign(rng_normal(tuple(layer.bias.shape), 3, 0.5))
        ref = ReferenceSteps(layer_state(layer), layer.dtype_policy.recipe, layer.compute_dtype)
        k = shape[-1]
        kernel = to_numpy(layer.kernel).reshape(k, -1)
        n = kernel.shape[1]
        bias = None if layer.bias is None else to_numpy(layer.bias).reshape(-1)
        activation = keras.activations.get(layer.get_config()["activation"])
        for step in range(3):
            x = rng_normal(shape, 10 + step, 1.0 + step)
            xt = torch.tensor(x, device=_device()).requires_grad_()
            y = layer(xt, training=True)
            up = rng_normal(tuple(y.shape), 20 + step, 10.0**-step)
            (y.float() * torch.tensor(up, device=_device())).sum().backward()
            layer.grad_amax_pending.assign(layer.grad_amax_pending.value.grad)
            # The reference of the matmul (the activation is relu or none:
            # where it passes, y is the matmul's output).
            pre = ref.step(x.reshape(-1, k), kernel, (up * (to_numpy(y.detach().float()) != 0)
                                                       if activation is keras.activations.relu
                                                       else up).reshape(-1, n), bias)
            ry = pre[0]
            if activation is keras.activations.relu:
                ry = np.maximum(ry, 0)
            _assert_close(to_numpy(y.detach().float()).reshape(-1, n), ry, f"y, step {step}")
            _assert_close(to_numpy(xt.grad).reshape(-1, k), pre[1], f"dx, step {step}")
            _assert_close(to_numpy(layer._kernel.value.grad).reshape(k, n), pre[2], f"dkernel, step {step}")
            assert_same_state(layer, ref.state)
            for v in layer.trainable_variables:
                v.value.grad = None

    @parameterized.named_parameters(
        ("bias_relu_rank3", dict(activation="relu"), "fp8_hybrid", (2, 8, 32)),
        ("no_bias", dict(use_bias=False), "fp8_hybrid", (16, 32)),
        ("float16", {}, "fp8_hybrid_float16", (16, 32)),
        ("float32_gelu", dict(activation="gelu"), "float32", (16, 32)),
        ("empty_batch", {}, "fp8_hybrid", (0, 32)),
        ("einsum_heads", dict(equation="abc,cde->abde", output_shape=(None, 4, 6), bias_axes="de"),
         "fp8_hybrid", (2, 8, 32)),
    )
    def test_below_min_gemm_size_call_equals_the_keras_layer(self, kwargs, policy, shape):
        # Below min_gemm_size (and for an empty batch) call() runs the base
        # layer's call: the same bits as the plain Keras layer, and the FP8
        # state does not move.
        keras.utils.set_random_seed(0)
        if "equation" in kwargs:
            layer = FP8EinsumDense(dtype=policy, min_gemm_size=10**12, **kwargs)
        else:
            layer = FP8Dense(24, dtype=policy, min_gemm_size=10**12, **kwargs)
        layer.build(shape)
        before = [to_numpy(v) for v in layer.fp8_state_variables]
        plain = _compute_dtype_twin(layer, shape)
        for a, b in zip(_train_steps(layer, shape, 2), _train_steps(plain, shape, 2)):
            np.testing.assert_array_equal(a, b)
        for v, was in zip(layer.fp8_state_variables, before):
            np.testing.assert_array_equal(to_numpy(v), was)

    def test_training_comes_from_the_outer_call(self):
        class Block(keras.layers.Layer):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                policy = "fp8_hybrid[history_len=4]"
                self.first = FP8Dense(16, min_gemm_size=0, dtype=policy)
                self.frozen = FP8Dense(16, min_gemm_size=0, dtype=policy)

            def call(self, x):
                return self.frozen(self.first(x), training=False)

        block = Block(dtype="mixed_bfloat16")
        x = self._bf16((8, 16), 0)
        block(x)
        self.assertEqual(np.count_nonzero(to_numpy(block.first.input_amax_history)), 0)
        block(x, training=True)
        self.assertEqual(np.count_nonzero(to_numpy(block.first.input_amax_history)), 1)
        self.assertEqual(np.count_nonzero(to_numpy(block.frozen.input_amax_history)), 0)
        block(x, training=False)
        self.assertEqual(np.count_nonzero(to_numpy(block.first.input_amax_history)), 1)

    def test_casts_masks_hooks_and_input_checks(self):
        import torch

        layer = FP8Dense(8, dtype="fp8_hybrid[history_len=4]", min_gemm_size=0)
        layer.build((4, 16))
        y = layer(self._bf16((4, 16), 0).float(), training=True)  # cast to the compute dtype
        self.assertEqual(y.dtype, torch.bfloat16)
        masked = self._bf16((4, 16), 1)
        masked._keras_mask = torch.ones(4, dtype=torch.bool, device=masked.device)
        layer(masked, training=True)
        with self.assertRaisesRegex(ValueError, "incompatible|expected"):
            layer(self._bf16((4, 12), 2), training=True)  # Keras's input check
        seen = []
        handle = layer.register_forward_hook(lambda *a: seen.append(True))
        layer(self._bf16((4, 16), 3), training=True)
        handle.remove()
        self.assertEqual(seen, [True])
        self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 3)

    def test_the_config_is_made_once_per_recipe(self):
        from unittest import mock

        from keras_fp8 import backends

        layer = FP8Dense(8, dtype="fp8_hybrid[history_len=4]", min_gemm_size=0)
        layer.build((4, 16))
        with mock.patch.object(backends, "linear_config", wraps=backends.linear_config) as make:
            for _ in range(3):
                layer(self._bf16((4, 16), 0), training=True)
            self.assertEqual(make.call_count, 1)
            with keras_fp8.autocast("fp8_hybrid[scaling=current]"):
                layer(self._bf16((4, 16), 0), training=True)
            self.assertEqual(make.call_count, 2)


class TorchCompileTest(parameterized.TestCase):
    """jit_compile=True (torch.compile) on the torch_ops ops."""

    _LAYERS = {
        "dense": (lambda: FP8Dense(16, dtype="fp8_hybrid[history_len=4]", min_gemm_size=0), (8, 32)),
        "dense_bias_relu_3d": (lambda: FP8Dense(16, activation="relu", dtype="fp8_hybrid", min_gemm_size=0),
                               (2, 8, 32)),
        "einsum": (lambda: FP8EinsumDense("abc,cd->abd", (None, 16), dtype="fp8_hybrid[history_len=4]",
                                          min_gemm_size=0), (2, 4, 32)),
        "einsum_transposes": (lambda: FP8EinsumDense("abc,dc->adb", (16, None), dtype="fp8_hybrid",
                                                     min_gemm_size=0), (2, 4, 32)),
        "current_scaling": (lambda: FP8Dense(16, dtype="fp8_e4m3", recipe=keras_fp8.CurrentScaling(),
                                             min_gemm_size=0), (8, 32)),
        "below_min_gemm_size": (lambda: FP8Dense(16, dtype="fp8_hybrid", min_gemm_size=10**12), (8, 32)),
        "float16": (lambda: FP8Dense(16, dtype="fp8_hybrid_float16", min_gemm_size=0), (8, 32)),
    }

    @parameterized.product(kind=sorted(_LAYERS), training=[True, False])
    def test_fp8_layer_traces_without_graph_breaks(self, kind, training):
        import torch

        make, shape = self._LAYERS[kind]
        layer = make()
        layer.build(shape)
        dtype = torch.float16 if kind == "float16" else torch.bfloat16
        x = torch.tensor(rng_normal(shape, 0), device=_device()).to(dtype)
        assert_traces_as_one_graph(lambda x: layer(x, training=training), x)

    def test_build_settles_where_the_matmuls_run(self):
        # Decided when an FP8 layer builds (eager), not in its first call,
        # which torch.compile may trace; not at all for a layer that never
        # computes in FP8 (no FP8-hardware warning for it).
        from unittest import mock

        from keras_fp8.backends import torch as torch_backend

        with mock.patch.object(torch_backend, "_kernels_for") as kernels_for:
            FP8Dense(4, dtype="fp8_hybrid").build((2, 8))
            self.assertEqual(kernels_for.call_count, 1)
            FP8Dense(4, dtype="mixed_bfloat16").build((2, 8))
            self.assertEqual(kernels_for.call_count, 1)
            with keras_fp8.autocast("fp8_hybrid"):
                FP8EinsumDense("ab,bc->ac", 4, dtype="float32").build((2, 8))
            self.assertEqual(kernels_for.call_count, 2)
