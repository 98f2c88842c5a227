"""torch backend: FP8 layers dispatch to torch_ops with the same numerics.

On CPU the dispatch is forced onto torch_ops's own ops (their emulation); on
an FP8 GPU the compiled kernels run. Either way the FP8 state after training
steps must equal the keras.ops emulation's bit for bit, and the outputs and
gradients agree within FP8 tolerance.
"""

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from tests.backend_utils import assert_traces_as_one_graph
from tests.backend_utils import rng_normal
from tests.backend_utils import to_numpy
from tests.torch_ops_utils import counting_linear_folded

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch backend only"
)


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _fp8_gpu():
    import torch

    if not torch.cuda.is_available():
        return False
    import torch_ops

    return torch_ops.is_available()


def _run_steps(layer, xs, ups, dispatch):
    """Forward+backward steps, overwriting the pending grad like an optimizer."""
    import torch

    with _Dispatch(dispatch):
        outs, dxs, dks = [], [], []
        for x, up in zip(xs, ups):
            xt = torch.tensor(x, device=_device()).requires_grad_()
            for v in layer.trainable_variables:
                v.value.grad = None
            y = layer(xt, training=True)
            (y.float() * torch.tensor(up, device=_device())).sum().backward()
            layer.grad_amax_pending.assign(layer.grad_amax_pending.value.grad)
            outs.append(to_numpy(y.detach()))
            dxs.append(to_numpy(xt.grad))
            dks.append(to_numpy(layer._kernel.value.grad))
        return outs, dxs, dks


def _clone_pair(make):
    keras.utils.set_random_seed(0)
    a = make()
    keras.utils.set_random_seed(0)
    b = make()
    return a, b


def _seeded_classifier(features, hidden, classes, **compile_kwargs):
    """Two FP8Dense layers (ReLU between, FP8 GEMMs at any size, 8-entry
    histories) from seed 0, compiled with Adam and a sparse cross-entropy."""
    keras.utils.set_random_seed(0)
    policy = "fp8_hybrid[history_len=8]"
    model = keras.Sequential([
        keras.Input((features,)),
        FP8Dense(hidden, activation="relu", min_gemm_size=0, dtype=policy),
        FP8Dense(classes, min_gemm_size=0, dtype=policy),
    ])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_kwargs)
    return model


def _rel(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


class TorchDispatchTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("aligned", (64, 32), 48, "fp8_hybrid[history_len=8]"),
        ("ragged", (3, 7, 33), 17, "fp8_hybrid[history_len=8]"),
        ("e4m3_current", (16, 32), 24, "fp8_e4m3[scaling=current]"),
        ("margin_most_recent", (32, 48), 40,
         "fp8_hybrid[history_len=8,margin=1.0,amax_compute_algo=most_recent]"),
    )
    def test_same_state_as_emulation(self, shape, units, policy):
        dispatch = None  # kernels on an FP8 GPU, else torch_ops

        def make():
            layer = FP8Dense(units, dtype=policy, min_gemm_size=0)
            layer.build(shape)
            return layer

        ours, ref = _clone_pair(make)
        n = 4
        xs = [rng_normal(shape, 10 + i, 1.0 + i) for i in range(n)]
        ups = [rng_normal(shape[:-1] + (units,), 20 + i) for i in range(n)]
        out_a, dx_a, dk_a = _run_steps(ours, xs, ups, dispatch)
        out_b, dx_b, dk_b = _run_steps(ref, xs, ups, "emulation")
        for name in ("input_amax_history", "kernel_amax_history", "input_scale",
                     "kernel_scale", "grad_amax_history", "grad_scale",
                     "grad_amax_pending", "grad_fold_state"):
            if "scaling=current" in policy and name in ("input_scale", "kernel_scale"):
                continue  # torch_ops does not publish current-scaling scales
            np.testing.assert_array_equal(
                to_numpy(getattr(ours, name)), to_numpy(getattr(ref, name)),
                err_msg=name,
            )
        for a, b in zip(out_a, out_b):
            self.assertLess(_rel(a, b), 1e-2)
        for a, b in zip(dx_a, dx_b):
            self.assertLess(_rel(a, b), 1e-2)
        for a, b in zip(dk_a, dk_b):
            self.assertLess(_rel(a, b), 1e-2)

    def test_small_gemm_fallback_keeps_state_warm(self):
        dispatch = None  # kernels on an FP8 GPU, else torch_ops

        def make():
            layer = FP8Dense(8, dtype="fp8_hybrid[history_len=4]",
                             min_gemm_size=10**12)
            layer.build((4, 16))
            return layer

        ours, ref = _clone_pair(make)
        xs = [rng_normal((4, 16), i) for i in range(3)]
        ups = [rng_normal((4, 8), 9 + i) for i in range(3)]
        _run_steps(ours, xs, ups, dispatch)
        _run_steps(ref, xs, ups, "emulation")
        np.testing.assert_array_equal(
            to_numpy(ours.input_amax_history), to_numpy(ref.input_amax_history)
        )
        np.testing.assert_array_equal(
            to_numpy(ours.grad_amax_history), to_numpy(ref.grad_amax_history)
        )

    def test_layer_used_twice_in_one_step(self):
        import torch

        dispatch = None  # kernels on an FP8 GPU, else torch_ops

        def make():
            layer = FP8Dense(16, dtype="fp8_hybrid[history_len=4]", min_gemm_size=0)
            layer.build((8, 32))
            return layer

        ours, ref = _clone_pair(make)
        x = rng_normal((8, 32), 0)
        for layer, mode in ((ours, dispatch), (ref, "emulation")):
            with _Dispatch(mode):
                for _ in range(2):
                    xt = torch.tensor(x, device=_device()).requires_grad_()
                    y = layer(xt, training=True) + layer(xt * 2.0, training=True)
                    y.float().sum().backward()
                    layer.grad_amax_pending.assign(layer.grad_amax_pending.value.grad)
                    layer.grad_amax_pending.value.grad = None
        for name in ("input_amax_history", "grad_amax_history", "grad_amax_pending",
                     "grad_fold_state", "grad_scale"):
            np.testing.assert_array_equal(
                to_numpy(getattr(ours, name)), to_numpy(getattr(ref, name)), err_msg=name
            )

    def test_einsum_dispatches_too(self):
        dispatch = None  # kernels on an FP8 GPU, else torch_ops

        def make():
            layer = FP8EinsumDense("abc,cde->abde", (None, 4, 8),
                                   dtype="fp8_hybrid[history_len=4]",
                                   min_gemm_size=0)
            layer.build((2, 6, 32))
            return layer

        ours, ref = _clone_pair(make)
        xs = [rng_normal((2, 6, 32), i) for i in range(2)]
        ups = [rng_normal((2, 6, 4, 8), 5 + i) for i in range(2)]
        out_a, _, _ = _run_steps(ours, xs, ups, dispatch)
        out_b, _, _ = _run_steps(ref, xs, ups, "emulation")
        np.testing.assert_array_equal(
            to_numpy(ours.kernel_amax_history), to_numpy(ref.kernel_amax_history)
        )
        self.assertLess(_rel(out_a[-1], out_b[-1]), 1e-2)

    @pytest.mark.skipif(not _fp8_gpu(), reason="needs an FP8 GPU and torch_ops kernels")
    def test_fit_on_gpu_uses_kernels(self):
        import torch_ops
        from keras_fp8.backends import torch as torch_backend

        self.assertIs(torch_backend._kernels_for(
            __import__("torch").ones(1, device="cuda")), torch_ops)
        keras.mixed_precision.set_global_policy("fp8_hybrid")
        model = keras.Sequential([
            keras.Input((256,)), FP8Dense(512, activation="relu", min_gemm_size=0),
            FP8Dense(10, min_gemm_size=0),
        ])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = rng_normal((512, 256), 0)
        y = np.random.default_rng(0).integers(0, 10, 512)
        h = model.fit(x, y, batch_size=64, epochs=2, verbose=0)
        self.assertTrue(np.isfinite(h.history["loss"]).all())
        self.assertEqual(np.count_nonzero(to_numpy(model.layers[0].input_amax_history)), 16)
        model.predict(x, verbose=0)


class PrequantizeTest(parameterized.TestCase):
    """The FP8 kernels quantized ahead after each optimizer update
    (`backends.torch.prequantize_kernels`, hooked into the torch trainer's
    `train_step`)."""

    def test_train_step_is_hooked(self):
        from keras.src.backend.torch import trainer as torch_trainer

        from keras_fp8.backends import torch as torch_backend

        self.assertIsNotNone(torch_backend._keras_train_step)
        self.assertIsNot(torch_trainer.TorchTrainer.train_step, torch_backend._keras_train_step)

    def test_model_that_is_not_a_layer_is_named(self):
        from keras_fp8.backends import torch as torch_backend

        with self.assertRaisesRegex(TypeError, "model: expected a Keras model or layer, got list"):
            torch_backend.prequantize_kernels([])

    def test_nothing_ahead_off_the_kernels(self):
        from keras_fp8.backends import torch as torch_backend

        model = keras.Sequential([keras.Input((8,)), FP8Dense(4, min_gemm_size=0)])
        if _fp8_gpu():
            self.skipTest("the kernels serve this device")
        self.assertEqual(torch_backend.prequantize_kernels(model), 0)

    def test_layers_converted_later_are_found(self):
        from keras_fp8.backends import torch as torch_backend

        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, name="a"), keras.layers.Dense(4, name="b")
        ])
        self.assertEqual(torch_backend._fp8_layers(model), [])
        keras_fp8.convert(model, exclude=["b"])
        self.assertEqual([layer.name for layer in torch_backend._fp8_layers(model)], ["a"])
        # A layer is an FP8 layer of its own.
        self.assertEqual(torch_backend._fp8_layers(model.layers[0]), [model.layers[0]])

    def test_layer_list_does_not_keep_the_model_alive(self):
        import gc
        import weakref

        from keras_fp8.backends import torch as torch_backend

        model = keras.Sequential([keras.Input((8,)), FP8Dense(4)])
        self.assertLen(torch_backend._fp8_layers(model), 1)
        ref = weakref.ref(model)
        del model
        gc.collect()
        self.assertIsNone(ref())

    @pytest.mark.skipif(not _fp8_gpu(), reason="needs an FP8 GPU and torch_ops kernels")
    def test_fit_equals_quantizing_in_the_call(self):
        from unittest import mock

        import torch_ops

        from keras_fp8.backends import torch as torch_backend

        fp8_linear_folded = torch_ops.linear.fp8_linear_folded

        def train(prequantize):
            taken = []

            def counting(*args, prequantized_weight=None, **kwargs):
                y = fp8_linear_folded(*args, prequantized_weight=prequantized_weight, **kwargs)
                if prequantized_weight is not None:
                    taken.append(prequantized_weight.used)
                return y

            model = _seeded_classifier(64, 128, 16)
            x = rng_normal((128, 64), 0)
            y = np.random.default_rng(0).integers(0, 16, 128)
            with mock.patch.object(torch_backend, "PREQUANTIZE", prequantize), \
                    mock.patch.object(torch_ops.linear, "fp8_linear_folded", counting):
                history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
                model.evaluate(x, y, batch_size=64, verbose=0)  # spends the last step's, unused
            return history.history["loss"], [to_numpy(v) for v in model.variables], taken

        loss, variables, taken = train(True)
        want_loss, want_variables, none_taken = train(False)
        # 8 steps x 2 layers: every training call after the first step took
        # its kernel quantized ahead; the two evaluate calls did not.
        self.assertEqual(none_taken, [])
        self.assertEqual(taken, [True] * 14 + [False] * 2)
        self.assertEqual(loss, want_loss)
        self.assertEqual(len(variables), len(want_variables))
        for a, b in zip(variables, want_variables):
            np.testing.assert_array_equal(a, b)


class _Dispatch:
    """Chooses where the FP8 layers' matmuls run, and counts the calls that
    went through Keras's generic `Layer.__call__`.

    Modes: "kernels" (the real choice: the compiled kernels on an FP8 GPU),
    "torch_ops" (forced onto torch_ops's ops, their emulation on CPU),
    "emulation" (the keras.ops emulation path). Default: "kernels" on an FP8
    GPU, else "torch_ops".
    """

    def __init__(self, mode=None):
        self.mode = mode or ("kernels" if _fp8_gpu() else "torch_ops")

    def __enter__(self):
        import torch_ops
        from keras.src.layers.layer import Layer

        from keras_fp8.backends import torch as torch_backend

        self.generic_calls = 0
        self._original_kernels_for = torch_backend._kernels_for
        if self.mode == "torch_ops":
            torch_backend._kernels_for = lambda t: torch_ops
        elif self.mode == "emulation":
            torch_backend._kernels_for = lambda t: None
        self._original_call = Layer.__call__
        original_call = self._original_call

        def counting_call(layer, *args, **kwargs):
            if isinstance(layer, (FP8Dense, FP8EinsumDense)):
                self.generic_calls += 1
            return original_call(layer, *args, **kwargs)

        Layer.__call__ = counting_call
        return self

    def __exit__(self, *exc):
        from keras.src.layers.layer import Layer

        from keras_fp8.backends import torch as torch_backend

        torch_backend._kernels_for = self._original_kernels_for
        Layer.__call__ = self._original_call


class FastCallTest(parameterized.TestCase):
    """The eager fast path of FP8 layers' `__call__` (torch backend)."""

    def _bf16(self, shape, seed):
        import torch

        return torch.tensor(rng_normal(shape, seed), device=_device()).bfloat16()

    @parameterized.named_parameters(
        ("dense", lambda: FP8Dense(24, dtype="fp8_hybrid[history_len=4]", min_gemm_size=0), (16, 32)),
        ("dense_bias_relu", lambda: FP8Dense(24, activation="relu", dtype="fp8_hybrid[history_len=4]",
                                             min_gemm_size=0), (2, 8, 32)),
        ("dense_rank4_small_gemm", lambda: FP8Dense(24, dtype="fp8_hybrid[history_len=4]"), (2, 3, 4, 32)),
        ("dense_no_bias_e4m3", lambda: FP8Dense(24, use_bias=False, dtype="fp8_e4m3[history_len=4]",
                                                min_gemm_size=0), (16, 32)),
        ("einsum_heads_bias", lambda: FP8EinsumDense("abc,cde->abde", (None, 4, 6), bias_axes="de",
                                                     dtype="fp8_hybrid[history_len=4]", min_gemm_size=0),
         (2, 8, 32)),
        ("einsum_out_proj_gelu", lambda: FP8EinsumDense("abcd,cde->abe", (None, 24), activation="gelu",
                                                        dtype="fp8_hybrid[history_len=4]", min_gemm_size=0),
         (2, 8, 4, 8)),
    )
    def test_fast_path_equals_keras_call(self, make, shape):
        import torch

        from keras_fp8.backends import torch as torch_backend

        fast_layer, slow_layer = _clone_pair(make)
        fast_layer.build(shape)
        slow_layer.build(shape)
        results = []
        for layer, fast in ((fast_layer, True), (slow_layer, False)):
            original = torch_backend.fast_layer_call
            if not fast:
                torch_backend.fast_layer_call = lambda *a: None
            try:
                with _Dispatch() as dispatch:
                    outs = []
                    for step in range(3):
                        x = self._bf16(shape, step).requires_grad_()
                        y = layer(x, training=True)
                        y.float().square().sum().backward()
                        layer.grad_amax_pending.assign(layer.grad_amax_pending.value.grad)
                        outs += [to_numpy(y.detach().float()), to_numpy(x.grad.float()),
                                 to_numpy(layer._kernel.value.grad)]
                        if layer.bias is not None:
                            outs.append(to_numpy(layer.bias.value.grad))
                        for v in layer.trainable_variables:
                            v.value.grad = None
                    self.assertEqual(dispatch.generic_calls, 0 if fast else 3)
            finally:
                torch_backend.fast_layer_call = original
            outs += [to_numpy(v) for v in layer.fp8_state_variables]
            results.append(outs)
        for a, b in zip(*results):
            np.testing.assert_array_equal(a, b)
        del torch

    @pytest.mark.skipif(not _fp8_gpu(), reason="needs an FP8 GPU and torch_ops kernels")
    def test_gpu_call_is_one_cpp_call_equal_to_python_path(self):
        from torch_ops import linear as L

        def make():
            return FP8Dense(24, activation="relu", dtype="fp8_hybrid[history_len=4]")

        results = []
        for fast in (True, False):
            keras.utils.set_random_seed(0)
            layer = make()
            layer.build((2, 8, 32))
            saved_fast = L.FAST_PATH
            L.FAST_PATH = fast
            try:
                with counting_linear_folded() as calls:
                    outs = []
                    for step in range(3):
                        x = self._bf16((2, 8, 32), step).requires_grad_()
                        y = layer(x, training=True)
                        y.float().square().sum().backward()
                        layer.grad_amax_pending.assign(layer.grad_amax_pending.value.grad)
                        outs += [y.detach(), x.grad, layer._kernel.value.grad, layer.bias.value.grad]
                        for v in layer.trainable_variables:
                            v.value.grad = None
            finally:
                L.FAST_PATH = saved_fast
            self.assertEqual(calls, [True] * 3 if fast else [])
            results.append(outs + [v.value.clone() for v in layer.fp8_state_variables])
        for a, b in zip(*results):
            self.assertTrue(__import__("torch").equal(a, b))

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
        block(x)  # builds (generic path)
        with _Dispatch() as dispatch:
            block(x)
            self.assertEqual(np.count_nonzero(to_numpy(block.first.input_amax_history)), 0)
            block(x, training=True)
            self.assertEqual(np.count_nonzero(to_numpy(block.first.input_amax_history)), 1)
            self.assertEqual(np.count_nonzero(to_numpy(block.frozen.input_amax_history)), 0)
            block(x, training=False)
            self.assertEqual(np.count_nonzero(to_numpy(block.first.input_amax_history)), 1)
            self.assertEqual(dispatch.generic_calls, 0)

    def test_other_inputs_take_the_generic_path(self):
        import torch

        layer = FP8Dense(8, dtype="fp8_hybrid[history_len=4]", min_gemm_size=0)
        layer.build((4, 16))
        with _Dispatch() as dispatch:
            layer(self._bf16((4, 16), 0).float(), training=True)  # needs a cast
            self.assertEqual(dispatch.generic_calls, 1)
            masked = self._bf16((4, 16), 1)
            masked._keras_mask = torch.ones(4, dtype=torch.bool, device=masked.device)
            layer(masked, training=True)
            self.assertEqual(dispatch.generic_calls, 2)
            with self.assertRaisesRegex(ValueError, "incompatible|expected"):
                layer(self._bf16((4, 12), 2), training=True)  # Keras's input check
            self.assertEqual(dispatch.generic_calls, 3)
            handle = layer.register_forward_hook(lambda *a: None)
            layer(self._bf16((4, 16), 3), training=True)
            handle.remove()
            self.assertEqual(dispatch.generic_calls, 4)
        self.assertEqual(np.count_nonzero(to_numpy(layer.input_amax_history)), 3)


class TorchCompileTest(parameterized.TestCase):
    """jit_compile=True (torch.compile) on the torch_ops path."""

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
        "below_min_gemm_size": (lambda: FP8Dense(16, dtype="fp8_hybrid"), (8, 32)),
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
        with _Dispatch():
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

    def test_fit_with_jit_compile_equals_eager(self):
        def train(jit_compile):
            model = _seeded_classifier(32, 64, 10, jit_compile=jit_compile)
            x = rng_normal((64, 32), 0)
            y = np.random.default_rng(0).integers(0, 10, 64)
            with _Dispatch():
                history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            state = [to_numpy(v) for layer in model.layers for v in layer.fp8_state_variables]
            return history.history["loss"], state

        eager_loss, eager_state = train(False)
        compiled_loss, compiled_state = train(True)
        # Each of the 4 steps recorded once in every history, with or
        # without compilation.
        for a, b in zip(eager_state, compiled_state):
            self.assertEqual(np.count_nonzero(a), np.count_nonzero(b))
        self.assertEqual(np.count_nonzero(eager_state[1]), 4)  # input_amax_history
        # The first layer's input amaxes come from the data: exact. The rest
        # follow values that a compiled graph may round differently (fused
        # bf16 casts in the loss and its gradient): close.
        np.testing.assert_array_equal(compiled_state[1], eager_state[1])
        for a, b in zip(eager_state, compiled_state):
            np.testing.assert_allclose(b, a, rtol=2e-2)
        np.testing.assert_allclose(compiled_loss, eager_loss, rtol=1e-3)
