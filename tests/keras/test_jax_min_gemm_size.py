"""JAX: below `min_gemm_size` an FP8 layer runs its compute-dtype layer and
leaves its FP8 state alone (as tests/keras/test_torch_backend.py's
`ComputeDtypeBelowMinGemmSizeTest` proves for torch), and the default
threshold applies where real FP8 GEMMs run: an FP8 GPU, faked on the CPU
(`fp8_gemm_supported`), whose FP8 products XLA's CPU backend runs."""

import keras
import numpy as np
import pytest

import keras_fp8
from keras_fp8 import recipes
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import train_call_with_grads
from tests.support.keras_reference import ReferenceSteps
from tests.support.keras_reference import assert_same_state
from tests.support.keras_reference import layer_state

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX backend only")


@pytest.fixture
def jax_backend():
    from keras_fp8.backends import jax as jax_backend

    return jax_backend


@pytest.fixture
def real_fp8_gemms(monkeypatch, jax_backend):
    """The JAX backend as on an FP8 GPU: real FP8 GEMMs (XLA's FP8 dot; the
    custom calls off, which need the GPU)."""
    from keras_fp8.backends import jax_gemm

    monkeypatch.setattr(jax_backend, "fp8_gemm_supported", lambda: True)
    monkeypatch.setattr(jax_gemm, "_enabled", False)


def _train_call(layer, x, upstream):
    """A training call and its backward; the optimizer's overwrite of
    `grad_amax_pending` applied after an FP8 call (as torch's optimizer,
    which gets no gradient for it below `min_gemm_size`).

    Returns:
        `(y, dx, dkernel, dbias)` and whether the call ran FP8.
    """
    y, dx, grads = train_call_with_grads(layer, x, upstream)
    ran_fp8 = layer.fp8_execution()[0] == "FP8"
    if ran_fp8:
        layer.grad_amax_pending.assign(grads[layer.grad_amax_pending.path])
    db = None if layer.bias is None else grads[layer.bias.path]
    return (y, dx, grads[layer._kernel.path], db), ran_fp8


def test_the_default_is_real_where_real_fp8_gemms_run(jax_backend, monkeypatch):
    x = np.ones((4, 16), np.float32)
    monkeypatch.setattr(jax_backend, "fp8_gemm_supported", lambda: False)
    assert jax_backend.default_min_gemm_size(x) == 0  # the emulation: FP8 at every size
    monkeypatch.setattr(jax_backend, "fp8_gemm_supported", lambda: True)
    # torch_ops's DEFAULT_MIN_GEMM_SIZE: the same GEMM and quantize kernels.
    assert jax_backend.default_min_gemm_size(x) == recipes.DEFAULT_MIN_GEMM_SIZE == 8192 * 2048 * 2048


@pytest.mark.parametrize("make,make_plain,shape", [
    (lambda: FP8Dense(8, dtype="fp8_hybrid[history_len=4]"), lambda: keras.layers.Dense(8, dtype="mixed_bfloat16"),
     (4, 16)),
    (lambda: FP8Dense(24, activation="relu", dtype="fp8_hybrid"),
     lambda: keras.layers.Dense(24, activation="relu", dtype="mixed_bfloat16"), (2, 8, 32)),
    (lambda: FP8Dense(24, use_bias=False, dtype="fp8_hybrid_float16"),
     lambda: keras.layers.Dense(24, use_bias=False, dtype="mixed_float16"), (16, 32)),
    (lambda: FP8EinsumDense("abc,cde->abde", (None, 4, 6), bias_axes="de", dtype="fp8_hybrid"),
     lambda: keras.layers.EinsumDense("abc,cde->abde", (None, 4, 6), bias_axes="de", dtype="mixed_bfloat16"),
     (2, 8, 32)),
], ids=["dense", "dense_relu_rank3", "float16_no_bias", "einsum_heads"])
def test_below_the_default_a_layer_runs_exactly_its_compute_dtype_layer(real_fp8_gemms, jax_backend, make,
                                                                         make_plain, shape):
    # No min_gemm_size on the layer or its policy: the backend's default,
    # far above these calls.
    keras.utils.set_random_seed(0)
    layer, plain = make(), make_plain()
    layer.build(shape)
    plain.build(shape)
    plain._kernel.assign(layer._kernel.value)
    if layer.bias is not None:
        plain.bias.assign(rng_normal(tuple(plain.bias.shape), 1))
        layer.bias.assign(plain.bias.value)
    before = layer_state(layer)
    x = rng_normal(shape, 2)
    upstream = rng_normal(tuple(plain(x).shape), 3)
    y, dx, grads = train_call_with_grads(layer, x, upstream)
    want_y, want_dx, want_grads = train_call_with_grads(plain, x, upstream)
    assert layer.fp8_execution()[0] == f"{layer.compute_dtype} (< min_gemm_size)"
    assert layer.fp8_execution()[2] == recipes.DEFAULT_MIN_GEMM_SIZE
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(dx, want_dx)
    np.testing.assert_array_equal(grads[layer._kernel.path], want_grads[plain._kernel.path])
    if layer.bias is not None:
        np.testing.assert_array_equal(grads[layer.bias.path], want_grads[plain.bias.path])
    np.testing.assert_array_equal(grads[layer.grad_amax_pending.path], np.zeros((3,), np.float32))
    assert_same_state(layer, before)


def test_the_first_fp8_call_after_a_stretch_continues_the_state(real_fp8_gemms, jax_backend, monkeypatch):
    """The state did not advance during the compute-dtype calls, but for
    the fold of the last FP8 step's pending gradient amax (the fold the next
    FP8 call would make, made by the first compute-dtype training call:
    Keras's JAX optimizer would overwrite the pending value); the next FP8
    call is exactly the reference's next call from that state."""
    monkeypatch.setattr(recipes, "DEFAULT_MIN_GEMM_SIZE", 64 * 16 * 8)
    layer = FP8Dense(8, dtype="fp8_hybrid[history_len=4]", use_bias=False)
    layer.build((64, 16))
    ref = ReferenceSteps(layer_state(layer), layer.dtype_policy.recipe)
    kernel = np.asarray(layer.kernel.numpy(), np.float32)
    big = [rng_normal((64, 16), i, 1.0 + i) for i in range(3)]
    ups = [rng_normal((64, 8), 10 + i) for i in range(3)]
    (_, ran_fp8) = _train_call(layer, big[0], ups[0])
    assert ran_fp8
    ref.step(big[0], kernel, ups[0])
    for i in range(3):  # a stretch of small calls: the compute dtype
        (_, ran_fp8) = _train_call(layer, rng_normal((2, 16), 30 + i, 100.0), np.ones((2, 8), np.float32))
        assert not ran_fp8
    ref.fold()
    assert_same_state(layer, ref.state)
    for x, up in zip(big[1:], ups[1:]):
        (y, dx, dk, _), _ = _train_call(layer, x, up)
        ry, rdx, rdk, _ = ref.step(x, kernel, up)
        # The products of these small calls run the exact emulation on
        # every device (jax_backend.is_small_dot): the reference's bits.
        for got, want in ((y, ry), (dx, rdx), (dk, rdk)):
            np.testing.assert_array_equal(got, want)
        assert_same_state(layer, ref.state)


def test_a_fresh_layer_seeds_at_its_first_fp8_call(real_fp8_gemms, jax_backend, monkeypatch):
    monkeypatch.setattr(recipes, "DEFAULT_MIN_GEMM_SIZE", 64 * 16 * 8)
    layer = FP8Dense(8, dtype="fp8_hybrid[history_len=4]", use_bias=False)
    layer.build((64, 16))
    ref = ReferenceSteps(layer_state(layer), layer.dtype_policy.recipe)
    _train_call(layer, rng_normal((2, 16), 0, 1e3), np.ones((2, 8), np.float32))
    x, up = rng_normal((64, 16), 1), rng_normal((64, 8), 2)
    _train_call(layer, x, up)
    ref.step(x, np.asarray(layer.kernel.numpy(), np.float32), up)
    assert_same_state(layer, ref.state)


def test_fit_keeps_the_pending_gradient_amax_through_a_compute_dtype_step(real_fp8_gemms, jax_backend, monkeypatch):
    monkeypatch.setattr(recipes, "DEFAULT_MIN_GEMM_SIZE", 64 * 16 * 8)
    inputs = keras.Input((16,))
    layer = FP8Dense(8, dtype="fp8_hybrid[history_len=4]")
    model = keras.Model(inputs, layer(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    big, small = (rng_normal((64, 16), 0), rng_normal((64, 8), 1)), (rng_normal((2, 16), 2), rng_normal((2, 8), 3))
    model.fit(*big, batch_size=64, epochs=1, verbose=0)
    pending = np.asarray(layer.grad_amax_pending.numpy())
    assert pending[0] > 0
    model.fit(*small, batch_size=2, epochs=1, verbose=0)
    model.fit(*big, batch_size=64, epochs=1, verbose=0)
    assert np.asarray(layer.grad_amax_history.numpy())[0] == pending[0]

