"""A non-finite amax is never recorded (docs/numerics.md), on every backend:
a NaN in a layer's output gradient or input leaves the histories and scales
as they were. The tensors hold 32768 elements: a max-reduction that drops
a NaN (XLA's on the CPU, at this size) would give a finite amax. The JAX
backend's three routes are covered one by one in
tests/keras/test_jax_routes.py."""

import numpy as np
import pytest

from keras_fp8.layers import FP8Dense
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import train_call_with_grads
from tests.support.keras_reference import layer_state

M, K, N = 256, 128, 128
POLICIES = ["fp8_hybrid[history_len=4]", "fp8_hybrid[scaling=current]", "fp8_e4m3[scaling=block]"]


def _layer(policy):
    layer = FP8Dense(N, dtype=policy, min_gemm_size=0)
    layer.build((None, K))
    return layer


@pytest.mark.parametrize("policy", POLICIES)
def test_a_nan_output_gradient_records_nothing(policy):
    layer = _layer(policy)
    layer.grad_amax_pending.assign([3.0, 1.0, 0.0])  # folded by the next training call
    upstream = rng_normal((M, N), 1)
    upstream[7, 3] = np.nan
    _, dx, grads = train_call_with_grads(layer, rng_normal((M, K), 0), upstream)
    pending = grads[layer.grad_amax_pending.path]
    assert np.isnan(dx).any()
    # "Nothing pending" (0), with a fresh token: the optimizer's overwrite
    # then folds nothing.
    assert pending[0] == 0.0 and pending[1] > 0.0, pending
    layer.grad_amax_pending.assign(pending)
    before = layer_state(layer)
    train_call_with_grads(layer, rng_normal((M, K), 2), rng_normal((M, N), 3))
    after = layer_state(layer)
    for name in ("grad_amax_history", "grad_scale"):
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert after["grad_amax_history"][0] == 3.0  # the clean amax folded before it


@pytest.mark.parametrize("policy", POLICIES[:2])
def test_a_nan_input_records_nothing(policy):
    layer = _layer(policy)
    train_call_with_grads(layer, rng_normal((M, K), 0), rng_normal((M, N), 1))
    before = layer_state(layer)
    x = rng_normal((M, K), 2)
    x[200, 5] = np.nan
    y, _, _ = train_call_with_grads(layer, x, rng_normal((M, N), 3))
    assert np.isnan(y[200]).all() and np.isfinite(np.delete(y, 200, 0)).all()
    after = layer_state(layer)
    for name in ("input_amax_history", "input_scale"):
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
