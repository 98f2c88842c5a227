"""The torch and JAX emulations produce bit-identical FP8 state.

For the same weights, inputs and output gradients, a few training calls of an
FP8Dense under each backend leave exactly the same histories, scales and
pending gradient amax (the matmul results may differ in the last float32
bits, which the state never sees here: the upstream gradient is given).
"""


import numpy as np

from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import run_under_other_backend
from tests.support.backend_utils import to_numpy
from tests.support.backend_utils import train_call_with_grads

_NAMES = (
    "input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history",
    "grad_scale", "grad_amax_history", "grad_amax_pending", "grad_fold_state",
)


def run_steps(policy):
    """Three training calls; returns the FP8 state as a dict of arrays."""
    import keras_fp8

    layer = keras_fp8.FP8Dense(24, use_bias=False, dtype=policy, min_gemm_size=0)
    layer.build((40, 48))
    layer.kernel.assign(rng_normal((48, 24), 7, 0.2))
    for step in range(3):
        x = rng_normal((40, 48), step, 1.0 + step)
        upstream = rng_normal((40, 24), 10 + step, 10.0**-step)
        _, _, grads = train_call_with_grads(layer, x, upstream)
        layer.grad_amax_pending.assign(grads[layer.grad_amax_pending.path])
    return {name: to_numpy(getattr(layer, name)) for name in _NAMES}


def test_torch_and_jax_states_are_bit_identical(tmp_path):
    policy = "fp8_hybrid[history_len=8,margin=1.0]"
    out = str(tmp_path / "state.npz")
    script = (
        "import numpy as np\n"
        "from tests.keras.test_cross_backend_state import run_steps\n"
        f"np.savez({out!r}, **run_steps({policy!r}))\n"
    )
    run_under_other_backend(script, TORCH_OPS_DISABLE="0")
    theirs = dict(np.load(out))
    ours = run_steps(policy)
    for name in _NAMES:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert np.count_nonzero(ours["grad_amax_history"]) == 2
