"""JAX: the FP8 state advances through jit/stateless training loops."""

import keras
import ml_dtypes
import numpy as np
import pytest

import keras_fp8
from tests.support import numpy_reference as reference
from tests.support.backend_utils import REPO
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import subprocess_env
from tests.support.backend_utils import to_numpy

pytestmark = [pytest.mark.usefixtures("fp8_at_every_size"), pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX backend only"
)]


def _model():
    keras.mixed_precision.set_global_policy("fp8_hybrid[history_len=8]")
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((16,)), keras_fp8.layers.FP8Dense(8, name="fp8"),
    ])


def test_hand_written_jit_step_advances_state():
    import jax
    import jax.numpy as jnp

    model = _model()
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    layer = model.get_layer("fp8")

    @jax.jit
    def train_step(state, x, y):
        trainable, non_trainable, opt_vars = state

        def loss_fn(trainable):
            pred, nt = model.stateless_call(trainable, non_trainable, x, training=True)
            return jnp.mean((pred.astype(jnp.float32) - y) ** 2), nt

        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return loss, (trainable, non_trainable, opt_vars)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    xs = [rng_normal((4, 16), i, 1.0 + i) for i in range(3)]
    y = rng_normal((4, 8), 9)
    for x in xs:
        _, state = train_step(state, x, y)
    for v, value in zip(model.trainable_variables, state[0]):
        v.assign(value)
    for v, value in zip(model.non_trainable_variables, state[1]):
        v.assign(value)
    history = to_numpy(layer.input_amax_history)
    expected = [reference.amax(x.astype(ml_dtypes.bfloat16)) for x in xs]
    np.testing.assert_array_equal(history[:3], expected[::-1])
    # The third step's gradient amax is still pending.
    assert np.count_nonzero(to_numpy(layer.grad_amax_history)) == 2
    assert to_numpy(layer.grad_amax_pending)[1] == 3.0


def test_data_parallel_on_one_device():
    import jax

    distribution = keras.distribution.DataParallel(devices=jax.devices()[:1])
    keras.distribution.set_distribution(distribution)
    try:
        model = _model()
        model.compile(optimizer="adam", loss="mse")
        x = rng_normal((32, 16), 0)
        y = rng_normal((32, 8), 1)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        layer = model.get_layer("fp8")
        assert np.count_nonzero(to_numpy(layer.input_amax_history)) == 4
        assert np.count_nonzero(to_numpy(layer.grad_amax_history)) == 3
    finally:
        keras.distribution.set_distribution(None)


def test_jax_and_torch_emulations_quantize_identically(tmp_path):
    """Same inputs and scale: the JAX bytes equal the reference (and torch's)."""
    import subprocess
    import sys

    from keras_fp8 import numerics
    from tests.support.backend_utils import fp8_bytes

    x = rng_normal((257, 65), 3, 30.0)
    scale = np.float32(0.0371)
    ours = {fmt: fp8_bytes(numerics.quantize(x, scale, fmt)) for fmt in ("e4m3", "e5m2")}
    np.save(tmp_path / "x.npy", x)
    script = (
        "import numpy as np, keras_fp8\n"
        "from keras_fp8 import numerics\n"
        "from tests.support.backend_utils import fp8_bytes\n"
        f"x = np.load({str(tmp_path / 'x.npy')!r})\n"
        "for fmt in ('e4m3', 'e5m2'):\n"
        f"    np.save({str(tmp_path)!r} + '/' + fmt + '.npy', fp8_bytes(numerics.quantize(x, np.float32({float(scale)!r}), fmt)))\n"
    )
    env = subprocess_env(KERAS_BACKEND="torch")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=REPO)
    for fmt in ("e4m3", "e5m2"):
        np.testing.assert_array_equal(np.load(tmp_path / f"{fmt}.npy"), ours[fmt])


def test_small_products_are_upcast(monkeypatch):
    from keras_fp8.backends import jax as jax_backend

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert jax_backend.is_small_dot(16, 4, 8)
    assert jax_backend.is_small_dot(64, 64, 64)
    assert not jax_backend.is_small_dot(256, 80, 96)
    monkeypatch.setenv(
        "XLA_FLAGS", "--xla_gpu_gemm_rewrite_size_threshold=100000 --foo=1"
    )
    assert jax_backend.is_small_dot(256, 80, 96)
    # A value that is not a plain ASCII number is not XLA's: the default holds.
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_gemm_rewrite_size_threshold=10\u00b2")
    assert not jax_backend.is_small_dot(256, 80, 96)


def test_symbolic_batch_takes_the_fp8_path():
    # Keras's shape inference on JAX traces a None batch as a symbol: a size
    # comparison with it is inconclusive and must not be made.
    from jax import export

    from keras_fp8.backends import jax as jax_backend

    (batch,) = export.symbolic_shape("b")
    assert not jax_backend.is_small_dot(batch, 16, 8)
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    inputs = keras.Input((6, 16))
    outputs = keras_fp8.layers.FP8Dense(8, min_gemm_size=2**40)(inputs)
    model = keras.Model(inputs, outputs)
    assert model.output_shape == (None, 6, 8)
    assert model(np.ones((2, 6, 16), "float32")).shape == (2, 6, 8)


def test_operands_are_rounded_to_their_dtype_under_jit():
    # XLA on a GPU may skip a float32 -> bfloat16 rounding inside a fusion;
    # the amax must be the bfloat16 value's (7.3244 rounds to 7.3125).
    import jax
    import jax.numpy as jnp

    from keras_fp8.backends import jax as jax_backend

    def amax(x):
        return jnp.max(jnp.abs(jax_backend._as_stored(x.astype(jnp.bfloat16)).astype(jnp.float32)))

    assert float(jax.jit(amax)(jnp.array([1.0, -7.3244], jnp.float32))) == 7.3125
