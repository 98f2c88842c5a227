"""Backend-specific FP8 matmuls (with their gradients).

Each backend module exposes the same function:

    fp8_matmul(x, kernel, grad_amax_pending, x_scale, kernel_scale,
               grad_scale, grad_history, emit_token, *, recipe) -> y

computing `y = x @ kernel` for `x` of shape `(M, K)` and `kernel` of shape
`(K, N)` with both operands quantized to the recipe's forward format using the
given scales, and a backward pass that quantizes the output gradient once (to
the backward format, seeding its scale from its own amax while `grad_history`
is empty) for both the input and the kernel gradient. The "gradient" of
`grad_amax_pending` is `[amax of the output gradient (0 if not finite),
emit_token, 0]`: see `keras_fp8/layers/fp8_state.py`.

`torch` runs the compiled kernels of `torch_ops` on FP8-capable CUDA GPUs and
the exact emulation elsewhere; `jax` runs FP8 `dot_general` through XLA on
FP8-capable GPUs and the exact emulation elsewhere.
"""

import importlib

import keras

_SUPPORTED = ("jax", "torch")
# Imported once, at `import keras_fp8` (`preload`): `importlib` inside a
# traced call would break a torch.compile graph.
_LOADED = {}


def get():
    """Returns the module implementing FP8 matmuls for the Keras backend."""
    name = keras.backend.backend()
    module = _LOADED.get(name)
    if module is not None:
        return module
    if name not in _SUPPORTED:
        raise NotImplementedError(
            f"keras_fp8 supports the Keras backends {list(_SUPPORTED)}; the "
            f"current backend is {name!r}. Set KERAS_BACKEND=jax or torch."
        )
    module = importlib.import_module(f"keras_fp8.backends.{name}")
    _LOADED[name] = module
    return module


def preload():
    """Imports the current Keras backend's module now, if it is supported.

    Called by `import keras_fp8`, so that an FP8 layer's first call never
    imports: inside torch.compile that import would be a graph break.
    """
    if keras.backend.backend() in _SUPPORTED:
        install = getattr(get(), "install", None)
        if install is not None:
            install()


def prepare_device(tensor):
    """Lets the current backend settle, in eager code, where FP8 matmuls on
    `tensor`'s device will run (torch: whether the compiled kernels serve
    it), so that a later traced call does not. A no-op elsewhere."""
    if keras.backend.backend() not in _SUPPORTED:
        return
    prepare = getattr(get(), "prepare_device", None)
    if prepare is not None:
        prepare(tensor)
