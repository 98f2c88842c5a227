"""Backend-specific FP8 matmuls: one module per Keras backend.

Each backend module provides:

    fp8_matmul(layer, x, kernel, bias, config, training, kernel_layout, source=None) -> y
        `y = x @ kernel (+ bias)` for `x` of shape `(M, K)` and `kernel` of
        shape `(K, N)` (`kernel_layout="in_out"`) or `y = x @ kernel^T (+
        bias)` for a kernel stored `(N, K)` (`"out_in"`: read as stored, no
        transposed copy; its gradient `(N, K)` too), both quantized to the
        recipe's forward format, with a
        backward pass that quantizes the output gradient once (the backward
        format) for both gradient matmuls. Layers reading the same tensor
        quantize it once (docs/numerics.md, "One quantize per tensor"):
        `source`, `(inputs, layout)`, names the tensor `x` was made from and
        how (None: not shared; the kernel's layout plays no part, sharing
        is about x). It reads and (when training)
        updates the layer's FP8 state variables (public attributes of the
        layer), and returns the output gradient's amax through the gradient
        of `grad_amax_pending` (see `keras_fp8/layers/fp8_state.py`).
        `config` is what `linear_config` made of the call's recipe. The rules
        are `keras_fp8.numerics`'.
    default_min_gemm_size(x) -> int
        The `min_gemm_size` a layer without one of its own uses for `x`.
    saved_for_backward(loss_fn, trainable_values, other_values) -> report
        What the backward pass of `loss_fn` keeps of the tensors it names
        (`keras_fp8.kept_inputs`). `loss_fn(trainable_values, other_values)`
        runs a forward pass and returns `(loss, inputs)`: a float32 scalar
        and a list of tensors of that pass. The backend differentiates the
        loss with respect to `trainable_values` (without running the
        backward; `other_values` may be updated in place, so the backend
        hands `loss_fn` copies where its ops do that) and returns, per
        tensor of `inputs`, `(shape, dtype, nbytes, savers)`: `savers` the
        sorted `(scope_path, op)` of every op that saves that tensor's
        memory for the backward (`scope_path` the name scopes open when the
        op ran, `compat.current_scope_path`; empty where none does).

and may provide `linear_config(recipe, min_gemm_size, kernel_layout)` (the
backend's form of a recipe for one layer's matmuls, made once per layer and
recipe: torch, a `torch_ops.LinearConfig`; without it `fp8_matmul` gets the
recipe itself),
`prepare_device(tensor)` (settle, in eager code, where FP8 matmuls on
`tensor`'s device run), `mark_amax_channel(variable)` (tell the backend's
data-parallel tooling that this variable's gradient is an amax) and
`fold_pending_grad_amax(layer, recipe)` (what a training call of an FP8
layer that runs in the compute dtype does to keep the pending gradient
amax: JAX, whose optimizers overwrite it with a zero gradient, folds it)
and `reduces_amaxes()` (whether training calls reduce amaxes over
processes now, so that an empty one must still take part).

`jax` runs FP8 `dot_general` through XLA on FP8-capable GPUs and the exact
emulation elsewhere; `torch` runs `torch_ops` (the compiled kernels on the
GPUs they serve, its exact reference elsewhere).
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
        get()


def prepare_device(tensor):
    """Lets the current backend settle, in eager code, where FP8 matmuls on
    `tensor`'s device will run (torch: whether the compiled kernels serve
    it), so that a later traced call does not. A no-op elsewhere."""
    if keras.backend.backend() not in _SUPPORTED:
        return
    prepare = getattr(get(), "prepare_device", None)
    if prepare is not None:
        prepare(tensor)


def linear_config(recipe, min_gemm_size, kernel_layout="in_out"):
    """The current backend's form of `recipe` for one layer's FP8 matmuls
    (what the layer passes to `fp8_matmul` as `config`): torch, a
    `torch_ops.LinearConfig` carrying `min_gemm_size` (the limit the layer
    resolved; None where the call's size is not known) and the layer's
    `kernel_layout` (`"in_out"` or `"out_in"`); elsewhere the recipe
    itself."""
    make = getattr(get(), "linear_config", None)
    return recipe if make is None else make(recipe, min_gemm_size, kernel_layout)


def mark_amax_channel(variable):
    """Lets the current backend know that `variable`'s gradient is an amax
    (`grad_amax_pending`), not a gradient (torch: so that
    `torch_ops.distributed.prepare_ddp` keeps DDP from averaging it). A
    no-op elsewhere."""
    if keras.backend.backend() not in _SUPPORTED:
        return
    mark = getattr(get(), "mark_amax_channel", None)
    if mark is not None:
        mark(variable)


def reduces_amaxes():
    """Whether the current backend's FP8 training calls reduce their amaxes
    over processes now (torch: `torch_ops.distributed.reduction_group()`
    under `torch.distributed`), so that a call with an empty input must
    still take part. False elsewhere."""
    reduces = getattr(get(), "reduces_amaxes", None)
    return reduces is not None and reduces()


def saved_for_backward(loss_fn, trainable_values, other_values):
    """What the backward of `loss_fn` keeps of the tensors it returns, by the
    current backend (see the module docstring)."""
    return get().saved_for_backward(loss_fn, trainable_values, other_values)
