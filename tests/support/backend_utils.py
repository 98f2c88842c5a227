"""Backend-specific test helpers: gradients through a layer, tensors."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

# The repository's root (subprocesses of tests run there).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def to_numpy(x):
    if isinstance(x, keras.Variable):
        return np.asarray(x.numpy(), np.float32)
    return keras.ops.convert_to_numpy(keras.ops.cast(x, "float32"))


def assert_traces_as_one_graph(fn, x):
    """Asserts that torch.compile traces `fn(x)` as one graph, by calling it
    compiled with `fullgraph=True` (which raises at any graph break;
    `torch._dynamo.explain` misses one made before the first traced op)."""
    import torch

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend="eager")(x)


def train_call_with_grads(layer, x, upstream):
    """Calls `layer(x, training=True)` and backpropagates `upstream`.

    Applies the layer's non-trainable state updates, like a training step.

    Returns:
        `(y, dx, grads)`, with `grads` a dict from trainable variable path to
        gradient (NumPy float32).
    """
    backend = keras.backend.backend()
    if backend == "torch":
        # convert_to_tensor puts the data on Keras's device (the GPU if any).
        xt = keras.ops.convert_to_tensor(x).detach().requires_grad_()
        for v in layer.trainable_variables:
            v.value.grad = None
        y = layer(xt, training=True)
        loss = (y.float() * keras.ops.convert_to_tensor(upstream, "float32")).sum()
        loss.backward()
        # A variable outside the graph gets no gradient (None): zeros, as JAX
        # gives it.
        grads = {
            v.path: (np.zeros(v.shape, np.float32) if v.value.grad is None else to_numpy(v.value.grad))
            for v in layer.trainable_variables
        }
        return to_numpy(y.detach()), to_numpy(xt.grad), grads
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        def loss_fn(trainable, x):
            y, new_non_trainable = layer.stateless_call(
                trainable, non_trainable, x, training=True
            )
            loss = jnp.sum(y.astype(jnp.float32) * upstream)
            return loss, (y, new_non_trainable)

        # stateless_call skips __call__'s cast of the inputs: do it here.
        x = jnp.asarray(x).astype(layer.compute_dtype)
        (_, (y, new_nt)), (g_train, g_x) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True
        )(trainable, x)
        for v, value in zip(layer.non_trainable_variables, new_nt):
            v.assign(value)
        grads = {
            v.path: to_numpy(g)
            for v, g in zip(layer.trainable_variables, g_train)
        }
        return to_numpy(y), to_numpy(g_x), grads
    raise NotImplementedError(backend)


def real_fp8_gemm():
    """True where FP8 layers run real FP8 GEMMs (not the exact emulation)."""
    if keras.backend.backend() == "torch":
        import torch

        if not torch.cuda.is_available():
            return False
        import torch_ops

        return torch_ops.is_available()
    from keras_fp8.backends import jax as jax_backend

    return jax_backend.fp8_gemm_supported()


def jax_on_fp8_gpu():
    """True where the JAX backend runs on an FP8 GPU."""
    if keras.backend.backend() != "jax":
        return False
    from keras_fp8.backends import jax as jax_backend

    return jax_backend.fp8_gemm_supported()


# For JAX GPU test modules: FP8 at the tests' small sizes too (conftest.py's
# fixture; on a GPU the default threshold runs them in the compute dtype).
needs_jax_fp8_gpu = [
    pytest.mark.skipif(not jax_on_fp8_gpu(), reason="needs the JAX backend on an FP8 GPU"),
    pytest.mark.usefixtures("fp8_at_every_size"),
]


def gemm_rtol(emulated=1e-5):
    """Tolerance for an FP8 GEMM against the float32 reference: tight for the
    emulation, ~1e-2 on GPUs, whose FP8 tensor cores accumulate in reduced
    precision (fast accumulation) and in a different order."""
    return 2e-2 if real_fp8_gemm() else emulated


def assert_within_terms(got, want, abs_sum, out_rtol, msg=""):
    """A block-scaled FP8 product against its reference, element by element:
    within a fraction of the sum of the magnitudes of the element's terms
    (`abs_sum`; 2**-11 where FP8 tensor cores accumulate, whose partial sums
    over each 128-long stretch carry about 14 bits, 2**-16 where float32
    does) plus `out_rtol * |want|` (the output roundings)."""
    got, want, abs_sum = (np.asarray(a, dtype=np.float64) for a in (got, want, abs_sum))
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    assert not np.isnan(got).any(), f"{msg}: NaN"
    bound = (2.0**-11 if real_fp8_gemm() else 2.0**-16) * abs_sum + out_rtol * np.abs(want) + 1e-30
    bad = np.abs(got - want) > bound
    assert not bad.any(), (f"{msg}: {int(bad.sum())} of {want.size} elements beyond the bound; worst excess "
                           f"{float((np.abs(got - want) / bound).max()):.3g}x")


def rng_normal(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(
        "float32"
    )


def rng_window(shape, seed, low, high):
    """bfloat16 values of magnitude `low` to `high`, random signs. With
    `high / low` below 2 (and a scale seeded from their amax) they quantize
    into one binade of the FP8 format, so sums of a few hundred FP8
    products of such values are exact in float32, in any order: two
    layouts of one product can be compared bit for bit."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    values = rng.uniform(low, high, shape) * rng.choice([-1.0, 1.0], shape)
    return values.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def fp8_bytes(q):
    """The raw bytes of an FP8 backend tensor, as a NumPy uint8 array."""
    if keras.backend.backend() == "torch":
        import torch

        return q.detach().cpu().view(torch.uint8).numpy()
    return np.asarray(q).view(np.uint8)


def subprocess_env(**overrides):
    """The environment for a Python subprocess of a test: this repository
    first on `PYTHONPATH`, the caller's entries kept (on the GPU machine Keras
    itself comes from `PYTHONPATH`), plus `overrides`."""
    path = [REPO] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
    ]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), **overrides)


def run_under_other_backend(script, timeout=300, **env):
    """Runs `python -c script` in this repository under the other Keras
    backend (the environment of `subprocess_env`, plus `env`); fails the test
    where it fails or runs past `timeout` seconds."""
    other = "jax" if keras.backend.backend() == "torch" else "torch"
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO, timeout=timeout,
                   env=subprocess_env(KERAS_BACKEND=other, **env))
