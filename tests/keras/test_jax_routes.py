"""The JAX backend's three routes (`keras_fp8.backends.jax.route`), on any
machine: which route a call takes, and each route's products and state
against the exact emulation. The FUSED route runs with its two custom calls
stood in for by numerics (their GPU tests, tests/keras/test_jax_gpu.py, hold
the kernels to numerics); the XLA route runs XLA's FP8 dot, which XLA's CPU
backend runs too (exactly, in float32), on a GPU faked for the choice."""

import re

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_fp8
from keras_fp8 import numerics
from keras_fp8 import recipes
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import train_call_with_grads
from tests.support.keras_reference import layer_state

pytestmark = [
    pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX backend's routes"),
    pytest.mark.usefixtures("fp8_at_every_size"),
]


@pytest.fixture
def jax_backend():
    from keras_fp8.backends import jax as jax_backend

    return jax_backend


@pytest.fixture
def fp8_gpu(monkeypatch, jax_backend):
    """The backend as on an FP8 GPU (`fp8_gemm_supported`), custom calls off."""
    from keras_fp8.backends import jax_block
    from keras_fp8.backends import jax_gemm

    monkeypatch.setattr(jax_backend, "fp8_gemm_supported", lambda: True)
    monkeypatch.setattr(jax_gemm, "_enabled", False)
    # The XLA route's block variant: the scan of FP8 dots (Triton, which the
    # Pallas kernel needs, has no CPU).
    monkeypatch.setattr(jax_block, "gpu_block_matmul", jax_block.scan_block_matmul)


def _nan_safe_amax(x):
    # As the kernels compute it: NaN wins (csrc/quantize_kernels.cuh).
    return jnp.where(jnp.any(jnp.isnan(x)), jnp.float32(jnp.nan), numerics.compute_amax(x))


@pytest.fixture
def custom_calls(monkeypatch, fp8_gpu):
    """The custom calls on and available, stood in for by numerics; returns
    the list of scale modes the quantize was called with."""
    from keras_fp8.backends import jax_gemm

    calls = []

    def quantize(x, scale, fmt, scale_mode="given", history=None, margin=0.0):
        calls.append(scale_mode)
        amax = _nan_safe_amax(x)
        if scale_mode == "current":
            used = numerics.compute_scale(amax, scale, fmt, margin)
        else:
            used, _, _ = numerics.delayed_scale_update(amax, history, scale, fmt, recipes.DelayedScaling(margin=margin),
                                                       record=False)
        q = numerics.quantize(x, used, fmt)
        return q, jnp.transpose(q), amax, used

    def matmul_nt(a_q, b_t, scale, out_dtype, bias=None, fast_accum=True):
        return numerics.scaled_matmul(a_q, jnp.transpose(b_t), scale, out_dtype, bias)

    monkeypatch.setattr(jax_gemm, "_enabled", True)
    monkeypatch.setattr(jax_gemm, "available", lambda: True)
    monkeypatch.setattr(jax_gemm, "quantize_available", lambda: True)
    monkeypatch.setattr(jax_gemm, "quantize", quantize)
    monkeypatch.setattr(jax_gemm, "scaled_matmul_nt", matmul_nt)
    return calls


# --------------------------------------------------------------------------- the choice
def _route(jax_backend, m, k, n, recipe=None, x_dtype="bfloat16"):
    # The route reads shapes and dtypes only.
    return jax_backend.route(jax.ShapeDtypeStruct((m, k), x_dtype), jax.ShapeDtypeStruct((k, n), "float32"),
                             recipe or recipes.DelayedScaling())


def test_off_an_fp8_gpu_every_call_is_emulated(jax_backend):
    if jax_backend.fp8_gemm_supported():
        pytest.skip("an FP8 GPU")
    for recipe in (recipes.DelayedScaling(), recipes.CurrentScaling(), recipes.BlockScaling()):
        assert _route(jax_backend, 256, 512, 384, recipe) == jax_backend.EMULATION


def test_on_an_fp8_gpu_the_custom_calls_where_they_apply(jax_backend, custom_calls):
    assert _route(jax_backend, 256, 512, 384) == jax_backend.FUSED
    assert _route(jax_backend, 256, 512, 384, recipes.CurrentScaling()) == jax_backend.FUSED
    assert _route(jax_backend, 256, 512, 384, x_dtype="float32") == jax_backend.FUSED
    # No custom call takes per-block scales.
    assert _route(jax_backend, 256, 512, 384, recipes.BlockScaling()) == jax_backend.XLA
    # M, K and N must be multiples of 16 (each is one GEMM's contraction).
    assert _route(jax_backend, 300, 512, 384) == jax_backend.XLA
    assert _route(jax_backend, 256, 520, 384) == jax_backend.XLA
    assert _route(jax_backend, 256, 512, 200) == jax_backend.XLA
    assert _route(jax_backend, 256, 512, 384, x_dtype="float64") == jax_backend.XLA


def test_xla_takes_what_the_custom_calls_cannot(jax_backend, custom_calls, monkeypatch):
    from keras_fp8.backends import jax_gemm

    jax_gemm.set_enabled(False)
    assert _route(jax_backend, 256, 512, 384) == jax_backend.XLA
    jax_gemm.set_enabled(True)
    monkeypatch.setattr(jax_gemm, "quantize_available", lambda: False)
    assert _route(jax_backend, 256, 512, 384) == jax_backend.XLA
    monkeypatch.setattr(jax_gemm, "quantize_available", lambda: True)
    # XLA's partitioner splits its own dot, not a custom call.
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:1]))
    try:
        assert _route(jax_backend, 256, 512, 384) == jax_backend.XLA
    finally:
        keras.distribution.set_distribution(None)
    assert _route(jax_backend, 256, 512, 384) == jax_backend.FUSED


def test_a_call_with_a_small_dot_is_emulated(jax_backend, fp8_gpu, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert _route(jax_backend, 256, 512, 384) == jax_backend.XLA
    assert _route(jax_backend, 4, 16, 8) == jax_backend.EMULATION
    # The forward holds 16384 operand elements, dx's (4 x 4 @ 4 x 2048) fewer.
    assert not jax_backend.is_small_dot(4, 2048, 4) and jax_backend.is_small_dot(4, 4, 2048)
    assert _route(jax_backend, 4, 2048, 4) == jax_backend.EMULATION
    # A block-scaled product sums dots over at most 128 of its contraction.
    assert _route(jax_backend, 32, 1024, 32) == jax_backend.XLA
    assert _route(jax_backend, 32, 1024, 32, recipes.BlockScaling()) == jax_backend.EMULATION
    (batch,) = jax.export.symbolic_shape("b")
    symbolic = jax.ShapeDtypeStruct((batch, 16), jnp.bfloat16)
    assert jax_backend.route(symbolic, jax.ShapeDtypeStruct((16, 8), "float32"),
                             recipes.DelayedScaling()) == jax_backend.XLA


# --------------------------------------------------------------------------- each route's products and state
def _steps(route_name, jax_backend, monkeypatch, policy, steps=2):
    """Compiled training steps of one FP8Dense called twice per step, a loss
    linear in its outputs (so that every route sees the same output
    gradients): the loss, the state, the gradients and the lowered text."""
    monkeypatch.setattr(jax_backend, "route", lambda x, kernel, recipe, kernel_layout=None: route_name)
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    layer = keras_fp8.layers.FP8Dense(48, use_bias=True)
    model = keras.Sequential([keras.Input((64,)), layer])
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    x = jnp.asarray(rng_normal((96, 64), 1))
    upstream = [jnp.asarray(rng_normal((96, 48), 2 + i)) for i in range(2)]

    def loss(trainable, non_trainable):
        total = 0.0
        for g in upstream:
            y, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
            total = total + jnp.sum(y.astype("float32") * g)
        return total, non_trainable

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    text = step.lower(trainable, non_trainable).as_text()
    outputs = []
    for _ in range(steps):
        (value, non_trainable), grads = step(trainable, non_trainable)
        # The optimizer overwrites the gradient channel with its gradient.
        trainable = [g if "grad_amax_pending" in v.path else t
                     for v, t, g in zip(model.trainable_variables, trainable, grads)]
        outputs.append((np.asarray(value), [np.asarray(g) for g in grads]))
    state = {v.name: np.asarray(t) for v, t in zip(model.non_trainable_variables, non_trainable)}
    return outputs, state, text


@pytest.mark.parametrize("policy", ["fp8_hybrid[history_len=4]", "fp8_hybrid[scaling=current]"])
def test_the_xla_route_runs_xla_fp8_dots_and_keeps_the_emulation_state(jax_backend, fp8_gpu, monkeypatch, policy):
    xla, xla_state, text = _steps(jax_backend.XLA, jax_backend, monkeypatch, policy)
    emulated, emulated_state, _ = _steps(jax_backend.EMULATION, jax_backend, monkeypatch, policy)
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    fp8_dots = [line for line in dots if re.search(r"tensor<\d+x\d+xf8E4M3FN>, tensor<\d+x\d+xf8E", line)
                or re.search(r"tensor<\d+x\d+xf8E5M2>, tensor<\d+x\d+xf8E4M3FN>", line)]
    # Two calls: each a forward and a dkernel product (x is no variable: no
    # dx), all FP8; the backward's at HIGHEST precision (cuBLASLt's full
    # accumulation).
    assert len(fp8_dots) == len(dots) == 4, dots
    assert sum("HIGHEST" in line for line in fp8_dots) == 2
    # The amaxes and scales are exact on every route: the same state, bit for bit.
    assert xla_state.keys() == emulated_state.keys()
    for name in xla_state:
        np.testing.assert_array_equal(xla_state[name], emulated_state[name], err_msg=name)
    # The products: XLA's dot rounds to bfloat16, then the scale and bias are
    # applied and rounded again; the emulation rounds once.
    for (value, grads), (want_value, want_grads) in zip(xla, emulated):
        np.testing.assert_allclose(value, want_value, rtol=2.0**-6)
        for got, want in zip(grads, want_grads):
            np.testing.assert_allclose(got, want, rtol=2.0**-6, atol=2.0**-6 * np.abs(want).max())


@pytest.mark.parametrize("policy", ["fp8_hybrid[history_len=4]", "fp8_hybrid[scaling=current]"])
def test_the_fused_route_computes_what_the_emulation_computes(jax_backend, custom_calls, monkeypatch, policy):
    fused, fused_state, _ = _steps(jax_backend.FUSED, jax_backend, monkeypatch, policy)
    # Traced once: two calls, three quantized operands each, one scale mode.
    assert len(custom_calls) == 6 and len(set(custom_calls)) == 1
    emulated, emulated_state, _ = _steps(jax_backend.EMULATION, jax_backend, monkeypatch, policy)
    for name in fused_state:
        np.testing.assert_array_equal(fused_state[name], emulated_state[name], err_msg=name)
    for (value, grads), (want_value, want_grads) in zip(fused, emulated):
        assert value.tobytes() == want_value.tobytes()
        for got, want in zip(grads, want_grads):
            assert got.tobytes() == want.tobytes()


# --------------------------------------------------------------------------- NaN amaxes are never recorded
_ROUTES = ["emulation", "xla", "fused"]


@pytest.fixture
def on_route(request, jax_backend, monkeypatch):
    """Runs the test's FP8 calls on one route (the custom calls stood in for)."""
    if request.param != "emulation":
        request.getfixturevalue("custom_calls")
    monkeypatch.setattr(jax_backend, "route", lambda x, kernel, recipe, kernel_layout=None: request.param)
    return request.param


# Large enough that XLA's CPU max-reduction drops a NaN from a plain amax.
_M, _K, _N = 256, 128, 128


@pytest.mark.parametrize("on_route", _ROUTES, indirect=True)
@pytest.mark.parametrize("policy", ["fp8_hybrid[history_len=4]", "fp8_hybrid[scaling=current]",
                                    "fp8_e4m3[scaling=block]"])
def test_a_nan_output_gradient_records_nothing(on_route, policy):
    if on_route == "fused" and "block" in policy:
        pytest.skip("no custom call takes per-block scales")
    layer = keras_fp8.layers.FP8Dense(_N, dtype=policy)
    layer.build((None, _K))
    upstream = rng_normal((_M, _N), 1)
    upstream[7, 3] = np.nan
    train_call_with_grads(layer, rng_normal((_M, _K), 0), rng_normal((_M, _N), 2))
    layer.grad_amax_pending.assign([3.0, 1.0, 0.0])  # folded by the next training call
    _, dx, grads = train_call_with_grads(layer, rng_normal((_M, _K), 0), upstream)
    pending = grads[layer.grad_amax_pending.path]
    assert pending[0] == 0.0 and pending[1] > 0.0, pending  # "nothing pending"
    assert np.isnan(dx).any()
    layer.grad_amax_pending.assign(pending)
    before = layer_state(layer)
    train_call_with_grads(layer, rng_normal((_M, _K), 3), rng_normal((_M, _N), 4))
    after = layer_state(layer)
    np.testing.assert_array_equal(after["grad_amax_history"], before["grad_amax_history"])
    np.testing.assert_array_equal(after["grad_scale"], before["grad_scale"])
    assert np.all(np.isfinite(after["grad_amax_history"])) and np.isfinite(after["grad_scale"]).all()


@pytest.mark.parametrize("on_route", _ROUTES, indirect=True)
@pytest.mark.parametrize("policy", ["fp8_hybrid[history_len=4]", "fp8_hybrid[scaling=current]"])
def test_a_nan_input_records_nothing(on_route, policy):
    layer = keras_fp8.layers.FP8Dense(_N, dtype=policy)
    layer.build((None, _K))
    train_call_with_grads(layer, rng_normal((_M, _K), 0), rng_normal((_M, _N), 1))
    before = layer_state(layer)
    x = rng_normal((_M, _K), 2)
    x[200, 5] = np.nan
    y, _, _ = train_call_with_grads(layer, x, rng_normal((_M, _N), 3))
    assert np.isnan(y[200]).all() and np.isfinite(np.delete(y, 200, 0)).all()
    after = layer_state(layer)
    for name in ("input_amax_history", "input_scale"):
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert np.count_nonzero(after["kernel_amax_history"]) == 2 or "current" in policy


def test_the_backend_amax_is_numerics_where_finite(jax_backend):
    # The NaN-safe amax changes nothing else: the same bits as
    # numerics.compute_amax, inf for an inf, 0 for zeros.
    amax = jax.jit(jax_backend._amax)
    x = rng_normal((_M, _K), 5, 3.0)
    for t in (jnp.asarray(x), jnp.asarray(x, jnp.bfloat16), jnp.zeros((_M, _K))):
        assert np.asarray(amax(t)).tobytes() == np.asarray(numerics.compute_amax(t)).tobytes()
    x[0, 0] = -np.inf
    assert np.isposinf(np.asarray(amax(jnp.asarray(x))))
    x[100, 100] = np.nan
    assert np.isnan(np.asarray(amax(jnp.asarray(x))))


# --------------------------------------------------------------------------- a kernel stored (N, K)
@pytest.mark.parametrize("on_route", _ROUTES, indirect=True)
@pytest.mark.parametrize("policy", ["fp8_hybrid[history_len=4]", "fp8_hybrid[scaling=current]",
                                    "fp8_e4m3[scaling=block]"])
def test_a_tied_projection_equals_fp8_dense_on_the_transpose(on_route, policy):
    """The tied vocabulary projection reads the `(N, K)` embeddings as
    stored ("out_in": no transposed copy); on every route its outputs,
    gradients and state are, bit for bit, an `FP8Dense`'s on their
    transpose (data whose float32 sums are exact in any order)."""
    from keras_fp8.layers import FP8ReversibleEmbedding
    from tests.support.backend_utils import rng_window
    from tests.support.composite_layers import Head

    embedding = FP8ReversibleEmbedding(256, 64, tie_weights=True, dtype=policy)
    embedding.build()
    embedding.embeddings.assign(rng_window((256, 64), 0, 64.0, 100.0))
    dense = keras_fp8.layers.FP8Dense(256, use_bias=False, dtype=policy)
    dense.build((None, 64))
    dense.kernel.assign(np.asarray(embedding.embeddings.numpy()).T)

    head = Head(embedding, dtype=policy)
    for step in range(2):
        x = rng_window((64, 64), 10 + step, 64.0, 100.0)
        up = rng_window((64, 256), 20 + step, 0.6, 1.0)
        y, dx, grads = train_call_with_grads(head, x, up)
        want_y, want_dx, want_grads = train_call_with_grads(dense, x, up)
        np.testing.assert_array_equal(y, want_y)
        np.testing.assert_array_equal(dx, want_dx)
        np.testing.assert_array_equal(grads[embedding.embeddings.path], want_grads[dense.kernel.path].T)
        for layer, g in ((embedding, grads), (dense, want_grads)):
            layer.grad_amax_pending.assign(g[layer.grad_amax_pending.path])
        got, want = layer_state(embedding), layer_state(dense)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
