"""Bad inputs, faults and arguments: each case and its expected outcome.

| case | expected outcome |
|---|---|
| first batch tiny (1e-37 and zeros), tiny gradients, `most_recent` mid-run | finite weights; no scale below 2**-126 |
| empty batch, `FP8Dense` / `FP8EinsumDense`, training and inference | `(0, units)` output and zero gradients, as `Dense` |
| `torch_ops.fp8_linear` with K = 0 or M = 0 | what `F.linear` gives; state untouched |
| margin outside [0, 8], inf, NaN, negative (recipe, policy name, torch_ops) | ValueError naming `margin` |
| margin = 1 | the amax maps to fmt_max / 2 (headroom, not saturation) |
| an inf or NaN input element | a non-finite output where `Dense`'s is; the state does not record it |
| an inf input under fp16 loss scaling | the step is skipped, as with `Dense` |
| one 1e6 outlier, delayed scaling | the next `history_len` calls keep its scale (documented); `most_recent` recovers at once |
| `backward(retain_graph=True)` twice, two losses on one graph (torch_ops) | both work; the gradient amax is recorded once per forward |
| `torch.utils.checkpoint` recomputation (torch_ops) | each amax recorded once |
| wrong-shaped state tensors, a `(1, 1)` scale (torch_ops) | ValueError naming the state field |
| `min_gemm_size` of -1 or "x" | ValueError naming `min_gemm_size` |
| a NumPy array as `x` (torch_ops) | TypeError naming `x` and the type |
| `history_len=2**62` (Keras and torch_ops) | ValueError naming `history_len` |
| `"FP8_HYBRID"` | accepted, as `"fp8_hybrid"` |
| duplicate settings in a policy name | ValueError naming the setting |
| a truncated `.keras` file | Keras's ValueError naming the file |
| an FP8 model loaded without `import keras_fp8` | Keras's error naming the keras_fp8 class and module |
| leaving an `autocast` scope from another thread | RuntimeError; every other scope intact |
| torch.compile steps, then eager steps, then a resume | the same state as all-eager training, still recording |
| `convert(..., policy="fp8_hybrid_float16")` of a mixed_float16 or float32 model | `compile` uses keras_fp8's LossScaleOptimizer |
| an `exclude` pattern matching the empty string (`"logits|"`, `"x*"`), in a policy or `convert` | ValueError naming `exclude`; nothing converted |
| `exclude=head` on a model named `multihead_net` / `multihead_seq` | only the layer `head` stays plain (the model's name is not searched); `summary` lists it with the pattern |
| 8 threads training one layer at once | every call's amaxes recorded (8N of 8N) |
| a NaN, inf, zero or negative scale, a non-finite or negative history entry in a `.weights.h5` / `.keras` / `load_own_variables` store | ValueError naming the variable; the layer unchanged |
| `layer.quantize("int8")` on an `Embedding`, an excluded `Dense`, a `Dense` subclass or an FP8 layer under an FP8 policy | ValueError naming `keras_fp8.unconvert`; nothing changed |
| `FP8Dense` / `FP8EinsumDense` given a quantized policy (`"int8_from_float32"`, a `DTypePolicyMap` entry) | ValueError naming `dtype` |
| `convert(model)` without `policy` | the layers run FP8 under `fp8_hybrid` |
| a complex64 input | a warning saying the layer runs as `Dense` in complex64 |
| a misspelled or misplaced key in a policy name (`histroy_len`) | ValueError listing the valid keys |
| a training step in the compute dtype (below `min_gemm_size`, an empty batch) between FP8 steps, through a Keras optimizer | the last FP8 step's gradient amax is recorded (JAX's optimizer would overwrite the pending value: the compute-dtype call folds it) |
| an empty local batch on one process of a Keras FP8 model under torch DDP (gloo, two processes) | its layers take part in every amax reduction (zero): no hang, no abort; the state equal on both processes and to one process's on the rows kept (`test_keras_torch_ddp.py`, "empty_batch") |
| a tied `FP8ReversibleEmbedding`'s projection | the `(vocabulary, hidden)` embeddings read as stored (`"out_in"`), no transposed copy per call; `FP8Dense`'s bits on their transpose (`test_keras_hub.py`, `test_jax_routes.py`) |
| `FP8EinsumDense` with a bias, any `bias_axes` (bfloat16, outputs in the thousands) | one rounding after the bias: `FP8Dense`'s bits for the same kernel, bias and state, and the NumPy reference's (`test_fp8_einsum_dense.py`, `FP8EinsumDenseBiasTest`) |
"""

import re
import subprocess
import sys
import threading
import warnings
import zipfile

import keras
import numpy as np
import pytest

import keras_fp8
from keras_fp8 import numerics
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from tests.support.backend_utils import REPO
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import subprocess_env
from tests.support.backend_utils import to_numpy
from tests.support.keras_reference import layer_state

torch_only = pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch backend (torch_ops) only")


def _model(policy="fp8_hybrid[history_len=8]", features=16, units=8, use_bias=True):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((features,)),
        FP8Dense(32, activation="relu", dtype=policy, min_gemm_size=0),
        FP8Dense(units, dtype=policy, min_gemm_size=0, use_bias=use_bias),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _all_finite(model):
    return all(np.isfinite(to_numpy(v)).all() for v in model.weights)


# --------------------------------------------------------------------------- 1. tiny amaxes
def test_tiny_first_batch_keeps_the_model_finite():
    model = _model()
    x = np.zeros((16, 16), np.float32)
    x[::3, ::5] = 1e-37
    y = np.zeros((16, 8), np.float32)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    model.fit(rng_normal((16, 16), 1), rng_normal((16, 8), 2), batch_size=16, epochs=2, verbose=0)
    assert _all_finite(model)
    for layer in model.layers:
        for role in ("input", "kernel", "grad"):
            assert float(to_numpy(getattr(layer, f"{role}_scale"))) >= numerics.MIN_SCALE


def test_tiny_gradients_keep_the_model_finite():
    model = _model()
    x, y = rng_normal((16, 16), 0), rng_normal((16, 8), 1)
    model.fit(x, y, sample_weight=np.full((16,), 1e-36, np.float32), batch_size=16, epochs=2, verbose=0)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert _all_finite(model)
    assert float(to_numpy(model.layers[1].grad_scale)) > 0.0


def test_tiny_batch_mid_run_under_most_recent():
    model = _model("fp8_hybrid[history_len=8,amax_compute_algo=most_recent]")
    x, y = rng_normal((16, 16), 0), rng_normal((16, 8), 1)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    model.fit(x * 1e-38, y * 0, batch_size=16, epochs=1, verbose=0)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert _all_finite(model)


def test_scale_floor_is_one_rule():
    """The smallest scale, before the margin: the smallest normal float32.
    (Subnormal windows are left out: XLA's CPU backend reads them as zero.)"""
    for window in (1e-37, 2e-38, 2.0**-126):
        s = numerics.compute_scale(np.float32(window), np.float32(1.0), "e4m3")
        assert float(to_numpy(s)) == 2.0**-126
    s = numerics.compute_scale(np.float32(1e-37), np.float32(1.0), "e4m3", margin=3)
    assert float(to_numpy(s)) == 2.0**-123


# --------------------------------------------------------------------------- 2. empty batches
@pytest.mark.parametrize("training", [True, False])
def test_empty_batch_works_like_dense(training):
    layer = FP8Dense(8, dtype="fp8_hybrid", min_gemm_size=0)
    dense = keras.layers.Dense(8, dtype="mixed_bfloat16")
    x = np.zeros((0, 16), np.float32)
    y = layer(x, training=training)
    assert tuple(y.shape) == tuple(dense(x).shape) == (0, 8)
    einsum = FP8EinsumDense("abc,cd->abd", (None, 8), dtype="fp8_hybrid", min_gemm_size=0)
    assert tuple(einsum(np.zeros((0, 5, 16), np.float32), training=training).shape) == (0, 5, 8)
    assert np.count_nonzero(to_numpy(layer.input_amax_history)) == 0


def test_empty_batch_backward_gives_zero_gradients():
    """The layer's backward on an empty batch, as Dense's: zero gradients.
    (Keras's own `train_on_batch` rejects an empty batch for any model.)"""
    from tests.support.backend_utils import train_call_with_grads

    layer = FP8Dense(8, dtype="fp8_hybrid", min_gemm_size=0)
    layer.build((None, 16))
    y, dx, grads = train_call_with_grads(layer, np.zeros((0, 16), np.float32), np.zeros((0, 8), np.float32))
    assert y.shape == (0, 8) and dx.shape == (0, 16)
    np.testing.assert_array_equal(grads[layer.kernel.path], np.zeros((16, 8), np.float32))
    np.testing.assert_array_equal(grads[layer.bias.path], np.zeros((8,), np.float32))
    assert np.count_nonzero(to_numpy(layer.input_amax_history)) == 0


@torch_only
@pytest.mark.parametrize("shape", [(4, 0, 8), (0, 16, 8)])
def test_torch_ops_empty_inputs(shape):
    import torch

    import torch_ops

    m, k, n = shape
    x = torch.randn(m, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    b = torch.randn(n, requires_grad=True)
    state = torch_ops.FP8LinearState.create(4)
    y = torch_ops.fp8_linear(x, w, b, state, torch_ops.LinearConfig(min_gemm_size=0))
    assert torch.equal(y, torch.nn.functional.linear(x, w, b))
    y.sum().backward()
    assert w.grad.shape == w.shape and x.grad.shape == x.shape
    assert float(state.input_amax_history.abs().max()) == 0.0


def _optimizer_step(layer, optimizer, x, upstream):
    """A training call, its backward and a Keras optimizer's step, which
    overwrites `grad_amax_pending` with its gradient: on JAX every step
    (zero where no FP8 backward ran), on torch only where it has one."""
    variables = layer.trainable_variables
    if keras.backend.backend() == "torch":
        xt = keras.ops.convert_to_tensor(x)
        for v in variables:
            v.value.grad = None
        y = layer(xt, training=True)
        (y.float() * keras.ops.convert_to_tensor(upstream, "float32")).sum().backward()
        grads = [v.value.grad for v in variables]
    else:
        from tests.support.backend_utils import train_call_with_grads

        _, _, by_path = train_call_with_grads(layer, x, upstream)
        grads = [by_path[v.path] for v in variables]
    optimizer.apply(grads, variables)


@pytest.mark.parametrize("between", ["below_min_gemm_size", "empty_batch"])
@pytest.mark.parametrize("make,shape", [
    (lambda: FP8Dense(8, dtype="fp8_hybrid[history_len=4]", min_gemm_size=64 * 16 * 8), (64, 16)),
    (lambda: FP8EinsumDense("abc,cd->abd", (None, 8), bias_axes="d", dtype="fp8_hybrid[history_len=4]",
                            min_gemm_size=64 * 16 * 8), (4, 16, 16)),
], ids=["dense", "einsum"])
def test_a_compute_dtype_step_keeps_the_pending_gradient_amax(make, shape, between):
    """The last FP8 step's output-gradient amax, pending, is recorded at the
    next FP8 step although a step in the compute dtype came between."""
    layer = make()
    layer.build(shape)
    optimizer = keras.optimizers.SGD(0.0)
    optimizer.build(layer.trainable_variables)

    def step(rows, seed):
        x = rng_normal((rows,) + shape[1:], seed)
        _optimizer_step(layer, optimizer, x, rng_normal(x.shape[:-1] + (8,), seed + 1))
        return layer.fp8_execution()[0]

    assert step(shape[0], 0) == "FP8"
    pending = to_numpy(layer.grad_amax_pending)
    assert pending[0] > 0
    assert step(2 if between == "below_min_gemm_size" else 0, 2) != "FP8"
    assert step(shape[0], 4) == "FP8"
    history = to_numpy(layer.grad_amax_history)
    assert history[0] == pending[0] and np.count_nonzero(history) == 1


# --------------------------------------------------------------------------- 3. margin
@pytest.mark.parametrize("margin", [9, 150, 1000, float("inf"), float("nan"), -1, "1"])
def test_margin_out_of_range_is_named(margin):
    with pytest.raises(ValueError, match="margin"):
        keras_fp8.DelayedScaling(margin=margin)
    with pytest.raises(ValueError, match="margin"):
        keras_fp8.CurrentScaling(margin=margin)


@pytest.mark.parametrize("name", ["fp8_hybrid[margin=inf]", "fp8_hybrid[margin=150]", "fp8_hybrid[margin=nan]"])
def test_margin_in_policy_name_is_named(name):
    with pytest.raises(ValueError, match="margin"):
        keras_fp8.FP8DTypePolicy(name)


@torch_only
@pytest.mark.parametrize("margin", [-1.0, float("nan"), 9.0, float("inf")])
def test_torch_ops_margin_is_named(margin):
    import torch

    import torch_ops

    with pytest.raises(ValueError, match="margin"):
        torch_ops.fp8_linear(torch.randn(4, 8), torch.randn(4, 8), None, torch_ops.FP8LinearState.create(4),
                             torch_ops.LinearConfig(margin=margin))
    with pytest.raises(ValueError, match="margin"):
        torch_ops.FP8Linear(8, 4, margin=margin)


def test_margin_is_headroom():
    s = numerics.compute_scale(np.float32(448.0), np.float32(1.0), "e4m3", margin=1)
    assert float(to_numpy(s)) == 2.0  # 448 maps to 224: room for twice the amax


# --------------------------------------------------------------------------- 4. non-finite inputs
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_input_gives_non_finite_output(bad):
    layer = FP8Dense(8, dtype="fp8_hybrid", min_gemm_size=0)
    dense = keras.layers.Dense(8, dtype="mixed_bfloat16")
    x = rng_normal((4, 16), 0)
    layer(x, training=True)
    dense.build((4, 16))
    dense.kernel.assign(layer.kernel)
    x[1, 3] = bad
    history = to_numpy(layer.input_amax_history)
    y, y_dense = to_numpy(layer(x, training=True)), to_numpy(dense(x))
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(y_dense))
    assert not np.isfinite(y[1]).any() and np.isfinite(np.delete(y, 1, 0)).all()
    np.testing.assert_array_equal(to_numpy(layer.input_amax_history), history)  # not recorded


def test_inf_input_skips_the_fp16_step():
    model = _model("fp8_hybrid_float16[history_len=8]")
    assert isinstance(model.optimizer, keras_fp8.optimizers.LossScaleOptimizer)
    x, y = rng_normal((16, 16), 0), rng_normal((16, 8), 1)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    before = [to_numpy(v) for v in model.trainable_weights if "grad_amax_pending" not in v.path]
    x[2, 2] = np.inf
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    after = [to_numpy(v) for v in model.trainable_weights if "grad_amax_pending" not in v.path]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- 5. outliers
def test_an_outlier_holds_the_scale_for_history_len_calls():
    """Documented in the guide: one 1e6 outlier makes the next calls quantize
    with its scale until it leaves the window; `most_recent` recovers at once."""
    for algo, calls in (("max", 4), ("most_recent", 1)):
        layer = FP8Dense(8, dtype=f"fp8_hybrid[history_len=4,amax_compute_algo={algo}]", min_gemm_size=0)
        x = rng_normal((16, 16), 0)
        layer(x, training=True)
        outlier = x.copy()
        outlier[0, 0] = 1e6
        layer(outlier, training=True)
        high = float(to_numpy(layer.input_scale))
        for i in range(calls):
            assert float(to_numpy(layer.input_scale)) == high, (algo, i)
            layer(x, training=True)
        assert float(to_numpy(layer.input_scale)) < high / 1000, algo


# --------------------------------------------------------------------------- 6. torch_ops autograd
@torch_only
def test_retain_graph_and_two_losses_record_once():
    import torch

    import torch_ops

    for second in ("retain_graph", "two_losses"):
        state = torch_ops.FP8LinearState.create(4)
        x = torch.randn(8, 16, requires_grad=True)
        w = torch.randn(4, 16, requires_grad=True)
        y = torch_ops.fp8_linear(x, w, None, state, torch_ops.LinearConfig(min_gemm_size=0))
        if second == "retain_graph":
            y.sum().backward(retain_graph=True)
            y.sum().backward()
        else:
            (y.sum() + (y * 2).sum()).backward(retain_graph=True)
            y.mean().backward()
        assert torch.count_nonzero(state.grad_amax_history) == 1, second
        lin = torch.nn.Linear(16, 4, bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        assert x.grad.shape == x.shape and w.grad.shape == w.shape


@torch_only
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_records_each_amax_once(use_reentrant):
    import torch
    import torch.utils.checkpoint

    import torch_ops

    layer = torch_ops.FP8Linear(16, 8, history_len=4, min_gemm_size=0)
    x = torch.randn(8, 16, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=use_reentrant)
    y.sum().backward()
    for name in ("input_amax_history", "kernel_amax_history", "grad_amax_history"):
        assert torch.count_nonzero(getattr(layer, name)) == 1, name


# --------------------------------------------------------------------------- 7. errors
@torch_only
def test_torch_ops_state_and_argument_errors_are_named():
    import torch

    import torch_ops

    x, w = torch.randn(4, 8), torch.randn(4, 8)

    def state(**bad):
        s = torch_ops.FP8LinearState.create(4)
        for k, v in bad.items():
            setattr(s, k, v)
        return s

    for field, value in (("input_scale", torch.ones(1, 1)), ("input_scale", torch.ones(4)),
                         ("grad_amax_history", torch.zeros(())), ("kernel_amax_history", torch.zeros(0)),
                         ("grad_scale", torch.ones(2, 2))):
        with pytest.raises(ValueError, match=f"state.{field}"):
            torch_ops.fp8_linear(x, w, None, state(**{field: value}), torch_ops.LinearConfig(min_gemm_size=0))
    for bad in (-1, "x", 1.5):
        with pytest.raises(ValueError, match="min_gemm_size"):
            torch_ops.LinearConfig(min_gemm_size=bad)
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor, got numpy.ndarray"):
        torch_ops.fp8_linear(np.ones((8, 16), np.float32), w, None, state(),
                             torch_ops.LinearConfig(min_gemm_size=0))
    with pytest.raises(ValueError, match="history_len"):
        torch_ops.FP8LinearState.create(2**62)
    with pytest.raises(ValueError, match="history_len"):
        torch_ops.FP8Linear(8, 4, history_len=2**62)


def test_keras_argument_errors_are_named():
    with pytest.raises(ValueError, match="history_len"):
        keras_fp8.DelayedScaling(history_len=2**62)
    with pytest.raises(ValueError, match="history_len"):
        keras_fp8.FP8DTypePolicy("fp8_hybrid[history_len=4611686018427387904]")
    for bad in (-1, "x"):
        with pytest.raises(ValueError, match="min_gemm_size"):
            FP8Dense(4, min_gemm_size=bad)
    with pytest.raises(ValueError, match="min_gemm_size"):
        keras_fp8.FP8DTypePolicy("fp8_hybrid[min_gemm_size=-1]")


def test_policy_names_in_any_case():
    keras.mixed_precision.set_global_policy("FP8_HYBRID")
    policy = keras.mixed_precision.global_policy()
    assert isinstance(policy, keras_fp8.FP8DTypePolicy) and policy.name == "fp8_hybrid"
    assert keras_fp8.FP8DTypePolicy("Fp8_E4m3[history_len=16]").name == "fp8_e4m3[history_len=16]"
    with pytest.raises(ValueError, match="Unknown FP8 dtype policy name.*fp8_hybrid"):
        keras.mixed_precision.set_global_policy("FP8_WHATEVER")


def test_duplicate_policy_settings_are_named():
    with pytest.raises(ValueError, match="Duplicate setting 'history_len'"):
        keras_fp8.FP8DTypePolicy("fp8_hybrid[history_len=16,history_len=32]")


def test_truncated_keras_file(tmp_path):
    path = tmp_path / "m.keras"
    _model().save(path)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.keras"
    truncated.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="truncated.keras"):
        keras.models.load_model(truncated)


def test_loading_without_import_names_keras_fp8(tmp_path):
    path = tmp_path / "m.keras"
    _model().save(path)
    code = f"import keras\nkeras.models.load_model({str(path)!r})\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=subprocess_env(KERAS_BACKEND=keras.backend.backend()), cwd=REPO)
    assert r.returncode != 0
    assert "FP8Dense" in r.stderr and "keras_fp8" in r.stderr


# --------------------------------------------------------------------------- 8. scopes
def test_leaving_a_scope_from_another_thread_leaves_scopes_intact():
    autocast_module = sys.modules["keras_fp8.autocast"]

    scope = keras_fp8.autocast("fp8_hybrid")
    state = scope.__enter__()
    errors = []

    def leave():
        try:
            scope.__exit__(None, None, None)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=leave)
    t.start()
    t.join()
    try:
        assert errors and "thread" in errors[0]
        assert autocast_module.current() is state  # still open here
        other = []
        t = threading.Thread(target=lambda: other.append(autocast_module._open_scopes))
        t.start()
        t.join()
        assert other == [1]
    finally:
        scope.__exit__(None, None, None)
    assert autocast_module.current() is None and autocast_module._open_scopes == 0


# --------------------------------------------------------------------------- 9. compiled and eager
@torch_only
def test_compiled_then_eager_then_resumed_equals_eager(tmp_path):
    x = rng_normal((64, 16), 0)
    y = rng_normal((64, 8), 1)

    def run(plan):
        model = _model()
        path = tmp_path / "ckpt.weights.h5"
        for kind in plan:
            if kind == "resume":
                model.save_weights(path)
                model = _model()
                model.load_weights(path)
                continue
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=kind == "compiled")
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return [layer_state(layer) for layer in model.layers]

    eager = run(["eager", "eager", "eager", "eager"])
    mixed = run(["compiled", "eager", "resume", "compiled", "eager"])
    import ml_dtypes

    for i, (layer_eager, layer_mixed) in enumerate(zip(eager, mixed)):
        for name in layer_eager:
            # Every step recorded once, in every history, whichever way it ran.
            assert np.count_nonzero(layer_mixed[name]) == np.count_nonzero(layer_eager[name]), (i, name)
        # The fold's tokens advance the same way.
        np.testing.assert_array_equal(layer_mixed["grad_fold_state"], layer_eager["grad_fold_state"])
        # Amaxes are of the tensors the ops see: bf16 values, as eager.
        for name in ("input_amax_history", "grad_amax_history"):
            h = layer_mixed[name]
            np.testing.assert_array_equal(h, h.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=name)
        # Weights (and what follows from them) may round differently where
        # inductor fuses the loss and the optimizer: close, not equal.
        for name in layer_eager:
            np.testing.assert_allclose(layer_mixed[name], layer_eager[name], rtol=5e-2, err_msg=name)
    # The first layer's input amaxes come from the data: exact.
    np.testing.assert_array_equal(mixed[0]["input_amax_history"], eager[0]["input_amax_history"])
    assert np.count_nonzero(eager[0]["grad_amax_history"]) == 8  # 16 steps, history 8: full


# --------------------------------------------------------------------------- 10. fp16 through convert
@pytest.mark.parametrize("built_under", ["mixed_float16", "float32"])
def test_convert_to_float16_fp8_gets_keras_fp8_loss_scaling(built_under):
    keras.mixed_precision.set_global_policy(built_under)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(8)])
    keras.mixed_precision.set_global_policy("float32")
    keras_fp8.convert(model, policy="fp8_hybrid_float16", min_gemm_size=0)
    model.compile(optimizer="sgd", loss="mse")
    assert isinstance(model.optimizer, keras_fp8.optimizers.LossScaleOptimizer)
    model.fit(rng_normal((16, 16), 0), rng_normal((16, 8), 1), batch_size=16, epochs=2, verbose=0)
    # The loss scale reached the gradient channel (slot 2).
    assert float(to_numpy(model.layers[0].grad_amax_pending)[2]) > 0.0
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
    assert isinstance(model.optimizer, keras_fp8.optimizers.LossScaleOptimizer)


# --------------------------------------------------------------------------- 11. exclusion patterns
@pytest.mark.parametrize("pattern", ["logits|", "x*", "(head)?", "^"])
def test_exclude_matching_the_empty_string_is_refused(pattern):
    with pytest.raises(ValueError, match=r"`exclude`.*matches the empty string.*every layer"):
        keras_fp8.FP8DTypePolicy("fp8_hybrid", exclude=pattern)
    with pytest.raises(ValueError, match=r"`exclude`.*empty string"):
        keras.mixed_precision.set_global_policy(f"fp8_hybrid[exclude={pattern}]")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="logits")])
    with pytest.raises(ValueError, match=r"`exclude`.*empty string"):
        keras_fp8.convert(model, exclude=pattern)
    assert type(model.layers[0]) is keras.layers.Dense  # nothing converted


class _HeadNet(keras.Model):
    """A subclassed model whose name contains the pattern `head`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(8, name="up")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.up(x))


def _head_models():
    sequential = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, name="up"), keras.layers.Dense(3, name="head")],
        name="multihead_seq",
    )
    net = _HeadNet(name="multihead_net")
    net(rng_normal((2, 4), 0))
    return sequential, net


def test_exclude_matches_the_path_below_the_model():
    """`exclude=head` keeps the layer `head` plain, not every layer of a model
    whose name contains `head`; `keras_fp8.summary` lists what it kept plain."""
    keras.mixed_precision.set_global_policy("fp8_hybrid[exclude=head]")
    for model in _head_models():
        up, head = model.get_layer("up"), model.get_layer("head")
        assert up.path.startswith("multihead_")  # the path holds the model's name
        assert isinstance(up, FP8Dense), model.name
        assert type(head) is keras.layers.Dense, model.name
        printed = []
        keras_fp8.summary(model, print_fn=printed.append)
        assert re.search(r"Kept plain by an `exclude` pattern \(1\):\n  head  \(exclude='head'\)", printed[0])
        assert [(l.name, p) for l, p in keras_fp8.inspection.excluded_layers(model)] == [("head", "head")]
    # The same rule in `convert`, for its `exclude` and the policy's.
    keras.mixed_precision.set_global_policy("float32")
    for model in _head_models():
        assert sorted(keras_fp8.convert(model, exclude="head")) == [f"{model.name}/up"]
    for model in _head_models():
        converted = keras_fp8.convert(model, policy="fp8_hybrid[exclude=head]")
        assert converted == [f"{model.name}/up"]


# --------------------------------------------------------------------------- 12. one layer, many threads
def test_concurrent_training_calls_record_every_amax():
    """8 threads training one layer at once: every call's amaxes are recorded
    (a lock around each eager call's state update)."""
    threads, calls = 8, 4
    layer = FP8Dense(8, dtype=f"fp8_hybrid[history_len={2 * threads * calls}]", min_gemm_size=0)
    layer.build((None, 16))
    # Each thread's input has its own amax, exact in bfloat16.
    xs = [rng_normal((4, 16), i) for i in range(threads)]
    xs = [x / np.abs(x).max() * ((i + 1) / 8) for i, x in enumerate(xs)]
    errors = []

    def work(i):
        try:
            for _ in range(calls):
                layer(xs[i], training=True)
        except Exception as e:  # surfaced below
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    history = to_numpy(layer.input_amax_history)
    assert np.count_nonzero(history) == threads * calls
    expected = sorted([(i + 1) / 8 for i in range(threads)] * calls)
    np.testing.assert_array_equal(np.sort(history[history > 0]), expected)
    assert np.count_nonzero(to_numpy(layer.kernel_amax_history)) == threads * calls


# --------------------------------------------------------------------------- 13. a damaged checkpoint
@pytest.mark.parametrize(
    "variable, index, value",
    [("input_scale", None, np.nan), ("kernel_scale", None, 0.0), ("grad_scale", None, -1.0),
     ("input_scale", None, np.inf), ("input_amax_history", 3, np.nan), ("grad_amax_history", 0, np.inf),
     ("kernel_amax_history", 1, -2.0)],
)
@pytest.mark.parametrize("fmt", ["weights.h5", "keras"])
def test_loading_a_damaged_fp8_state_names_the_variable(tmp_path, fmt, variable, index, value):
    import h5py

    model = _model()
    model.fit(rng_normal((16, 16), 0), rng_normal((16, 8), 1), batch_size=16, epochs=1, verbose=0)
    path = tmp_path / f"m.{fmt}"
    model.save(path) if fmt == "keras" else model.save_weights(path)
    h5 = path
    if fmt == "keras":
        with zipfile.ZipFile(path) as archive:
            archive.extractall(tmp_path / "unzipped")
        h5 = tmp_path / "unzipped" / "model.weights.h5"
    layer = model.layers[1]
    # Saved after the kernel and bias, in STATE_VARIABLE_NAMES order.
    position = 2 + [v.name for v in layer.fp8_state_variables].index(variable)
    with h5py.File(h5, "r+") as f:
        entry = f[f"layers/dense_1/vars/{position}"]
        data = entry[()]
        if index is None:
            data = np.float32(value)
        else:
            data[index] = value
        entry[...] = data
    if fmt == "keras":
        with zipfile.ZipFile(path) as archive:
            members = {name: archive.read(name) for name in archive.namelist()}
        with zipfile.ZipFile(path, "w") as archive:
            for name, content in members.items():
                archive.writestr(name, h5.read_bytes() if name == "model.weights.h5" else content)
    fresh = _model()
    before = [to_numpy(v) for v in fresh.layers[1].weights]
    with pytest.raises(ValueError, match=rf"Invalid FP8 state in the checkpoint of layer .*: variable '[^']*/{variable}' holds"):
        keras.models.load_model(path) if fmt == "keras" else fresh.load_weights(path)
    if fmt == "weights.h5":  # the refused layer is unchanged
        for a, b in zip(before, fresh.layers[1].weights):
            np.testing.assert_array_equal(a, to_numpy(b))


def test_load_own_variables_validates_the_fp8_state():
    layer = FP8Dense(4, dtype="fp8_hybrid", min_gemm_size=0)
    layer(rng_normal((2, 8), 0), training=True)
    store = {}
    layer.save_own_variables(store)
    store = {k: to_numpy(v) for k, v in store.items()}
    store["4"] = np.float32(0.0)  # kernel_scale (after kernel, bias, input_scale, input_amax_history)
    kernel = to_numpy(layer.kernel)
    with pytest.raises(ValueError, match=r"'[^']*kernel_scale' holds 0\.0; expected a finite, positive scale"):
        layer.load_own_variables(store)
    np.testing.assert_array_equal(to_numpy(layer.kernel), kernel)
    store["4"] = np.float32(2.0)
    layer.load_own_variables(store)  # a valid state loads
    assert float(to_numpy(layer.kernel_scale)) == 2.0


# --------------------------------------------------------------------------- 14. Keras's quantization
class _MyDense(keras.layers.Dense):
    pass


@pytest.mark.parametrize("kind", ["embedding", "excluded_dense", "dense_subclass", "fp8_dense"])
def test_layer_quantize_under_an_fp8_policy_is_refused_changing_nothing(kind):
    keras.mixed_precision.set_global_policy("fp8_hybrid[exclude=kept]")
    if kind == "embedding":
        layer, x = keras.layers.Embedding(10, 16), np.arange(4).reshape(2, 2)
    else:
        make = {"excluded_dense": lambda: keras.layers.Dense(8, name="kept"),
                "dense_subclass": lambda: _MyDense(8),
                "fp8_dense": lambda: keras.layers.Dense(8)}[kind]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the subclass's "built as a plain layer"
            layer, x = make(), rng_normal((2, 16), 0)
            layer(x)
    y = to_numpy(layer(x))
    variables = [(v, to_numpy(v)) for v in layer.weights]
    with pytest.raises(ValueError, match=r"quantize\(mode='int8'\).*FP8 dtype policy.*unconvert"):
        layer.quantize("int8")
    assert layer.quantization_mode is None
    assert [v for v, _ in variables] == list(layer.weights)
    for v, value in variables:
        np.testing.assert_array_equal(to_numpy(v), value)
    np.testing.assert_array_equal(to_numpy(layer(x)), y)


@pytest.mark.parametrize("policy", ["int8_from_float32", "int8_from_mixed_bfloat16", "float8_from_float32"])
def test_fp8_layer_refuses_a_quantized_policy(policy):
    with pytest.raises(ValueError, match=rf"Invalid `dtype`.*quantized.*Received: dtype='{policy}'"):
        FP8Dense(3, dtype=policy)
    with pytest.raises(ValueError, match=rf"Invalid `dtype`.*Received: dtype='{policy}'"):
        FP8EinsumDense("ab,bc->ac", (3,), dtype=policy)
    # A DTypePolicyMap entry is known at build.
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    policy_map["q"] = policy
    layer = FP8Dense(3, dtype=policy_map, name="q")
    with pytest.raises(ValueError, match=rf"Invalid `dtype` for the FP8 layer 'q'.*Received: dtype='{policy}'"):
        layer(rng_normal((2, 4), 0))


# --------------------------------------------------------------------------- 15. convert's default policy
def test_convert_without_policy_runs_fp8():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(8)])
    assert len(keras_fp8.convert(model, min_gemm_size=0)) == 2
    for layer in model.layers:
        assert layer.dtype_policy.name == "fp8_hybrid"
        assert layer.active_recipe() is not None
    model.compile(optimizer="sgd", loss="mse")
    model.fit(rng_normal((16, 16), 0), rng_normal((16, 8), 1), batch_size=8, epochs=1, verbose=0)
    for layer in model.layers:
        assert np.count_nonzero(to_numpy(layer.input_amax_history)) == 2
        assert layer.fp8_execution()[0] == "FP8"


# --------------------------------------------------------------------------- 16. complex inputs
def test_complex_input_warning_says_what_runs():
    layer = FP8Dense(3, dtype="fp8_hybrid", min_gemm_size=0, name="cplx")
    x = keras.ops.convert_to_tensor(np.ones((2, 4), np.complex64))
    with pytest.warns(UserWarning, match=r"'cplx' \(FP8Dense\) runs as Dense in complex64, not in FP8: .*complex64"):
        y = layer(x)
    assert keras.ops.dtype(y) == "complex64"
    layer = FP8Dense(3, dtype="fp8_hybrid", min_gemm_size=0, name="ints")
    with pytest.warns(UserWarning, match=r"'ints' \(FP8Dense\) runs as Dense in bfloat16, not in FP8: .*int32"):
        y = layer(np.ones((2, 4), np.int32))
    assert keras.ops.dtype(y) == "bfloat16"


# --------------------------------------------------------------------------- 17. policy name keys
@pytest.mark.parametrize(
    "name, hint",
    [("fp8_hybrid[histroy_len=16]", r"'histroy_len'.*Did you mean 'history_len'\?"),
     ("fp8_hybrid[scaling=current,history_len=16]", r"'history_len'.* does not apply to scaling='current'"),
     ("fp8_hybrid[fp8_format=e4m3]", r"'fp8_format'.*comes from the base name"),
     ("fp8_hybrid[power_of_two=true]", r"'power_of_two'.* does not apply to scaling='delayed'")],
)
def test_unknown_policy_setting_lists_the_valid_ones(name, hint):
    with pytest.raises(ValueError, match=rf"Unknown setting {hint}.*Valid settings with scaling='\w+': scaling, "
                                         r"min_gemm_size, exclude, \w+"):
        keras_fp8.FP8DTypePolicy(name)
    with pytest.raises(ValueError, match="Valid settings"):
        keras.mixed_precision.set_global_policy(name)
