"""FP8 matmuls for the torch backend: `torch_ops`, on every device.

An FP8 layer's matmul is `torch_ops.fp8_linear_folded` on the layer's own
variables (their tensors are the op's state, updated in place: no copies, no
host sync). On the GPUs the compiled kernels serve, an eager call is one C++
call; under torch.compile (`jit_compile=True`) and on every other device the
`torch.library` ops run, over the kernels or over torch_ops's exact reference
(which is tested bit for bit against `keras_fp8.numerics`). Eager and
compiled training therefore run the same ops on the same state.
"""

import contextlib
import functools
import warnings

import torch
import torch_ops
from keras import activations
from torch_ops import extension as torch_ops_extension

from keras_fp8 import compat
from keras_fp8 import numerics


def _kernels_for(x):
    """torch_ops's extension where its kernels serve `x`'s device, else None
    (a one-time warning on a CUDA GPU they cannot serve)."""
    return torch_ops_extension.kernels_for(x)


def prepare_device(tensor):
    """Settles (and caches) whether the compiled kernels serve `tensor`'s
    device: the capability check, the build and the one-time warning run
    here, when a layer builds, not inside a call torch.compile traces."""
    _kernels_for(tensor)


def mark_amax_channel(variable):
    """See `keras_fp8.backends`: marks the variable's torch Parameter for
    `torch_ops.distributed.prepare_ddp` (where it exists yet)."""
    value = compat.raw_value(variable)
    if isinstance(value, torch.Tensor):
        torch_ops.distributed.mark_amax_channel(value)


def default_min_gemm_size(x):
    """See `keras_fp8.backends`: torch_ops's setting for `x`'s device."""
    return torch_ops.get_settings().resolved_min_gemm_size(_kernels_for(x) is not None)


def _variable_reader():
    """How to read the layer's variables in this call, in their own dtype.

    Outside a stateless scope a Keras torch variable's value is its `_value`
    tensor, cast by `.value` only when it autocasts; reading it directly skips
    `.value`'s checks (host time). Inside one (e.g. `stateless_call`), the
    scope holds the values.
    """
    return compat.raw_value if compat.in_stateless_scope() else compat.stored_value


def _linear_folded(layer, x, kernel, bias, recipe, training, value):
    return torch_ops.fp8_linear_folded(
        x,
        kernel,
        None if bias is None else value(bias),
        state=(
            value(layer.input_scale),
            value(layer.input_amax_history),
            value(layer.kernel_scale),
            value(layer.kernel_amax_history),
            value(layer.grad_scale),
            value(layer.grad_amax_history),
        ),
        pending=value(layer.grad_amax_pending),
        fold_state=value(layer.grad_fold_state),
        fp8_format=recipe.fp8_format,
        scaling=recipe.name,
        margin=float(recipe.margin),
        amax_compute_algo=getattr(recipe, "amax_compute_algo", "max"),
        window=getattr(recipe, "history_len", None),
        weight_layout="in_out",
        training=bool(training),
        min_gemm_size=0,  # the layer ran its own min_gemm_size check
        power_of_two=bool(getattr(recipe, "power_of_two", False)),
    )


def fp8_matmul(layer, x, kernel, bias, recipe, training):
    """See `keras_fp8.backends`: `torch_ops.fp8_linear_folded`, whose bias is
    added in x's dtype (fused into the GEMM)."""
    return _linear_folded(layer, x, kernel, bias, recipe, training, _variable_reader())


# `Dense(activation=None)` stores this identity function.
_IDENTITY = activations.linear


def fast_layer_call(layer, args, kwargs):
    """An FP8 layer's `__call__` without Keras's generic machinery, or None.

    Keras's `Layer.__call__` costs about 0.4 ms of host time per call (argument
    binding, masks, scopes), more than the whole FP8 linear on a GPU. For the
    one case that dominates eager training, a plain tensor already in the
    compute dtype and no mask, where FP8 runs on the compiled kernels or the
    call runs the compute dtype (below `min_gemm_size`), this does what
    `__call__` would do and nothing else: resolve `training` from the
    argument or the outer call (and pass it on to later layers, as Keras
    does), enter the layer's autocast scope, and run `layer.call`. Every
    other case returns None and goes through `Layer.__call__`.

    A layer whose `call` is exactly the FP8 linear (`_fp8_call_is_linear`)
    goes one step further: the linear on the variables' own tensors (`x` of
    any rank, bias fused; below `min_gemm_size` the compute-dtype matmul
    `Dense.call` runs), then the activation inside the autocast scope.
    """
    if len(args) != 1 or (kwargs and (len(kwargs) != 1 or "training" not in kwargs)):
        return None
    x = args[0]
    if type(x) is not torch.Tensor or not x.is_floating_point() or compat.keras_mask(x) is not None:
        return None
    if (
        not layer.built
        or not layer.autocast
        or layer.activity_regularizer is not None
        or layer._forward_hooks
        or layer._forward_pre_hooks
        or torch.compiler.is_compiling()
        or x.dtype != getattr(torch, layer.input_dtype)
        or not layer._fast_call_accepts(x)
        or compat.distribution() is not None
    ):
        return None
    recipe = layer._fp8_call_recipe(x)
    if recipe is not None and _kernels_for(x) is None:
        return None
    context = compat.current_call_context()
    if "training" in kwargs:
        training = kwargs["training"]
    else:
        training = None if context is None else context.get_value("training")
    if context is not None:
        context.set_value("training", training)
    # Below min_gemm_size a float16 x on a CPU goes to `layer.call`: Keras's
    # matmul computes float16 in float32 there.
    cpu_float16 = recipe is None and x.dtype == torch.float16 and x.device.type == "cpu"
    if layer._fp8_call_is_linear() and not compat.in_stateless_scope() and not cpu_float16:
        if recipe is None:
            y = _compute_dtype_linear(layer, x)
        else:
            y = _linear_folded(layer, x, compat.stored_value(layer._kernel), layer.bias, recipe, training,
                               compat.stored_value)
        activation = layer.activation
        if activation is None or activation is _IDENTITY:
            return y
        with compat.autocast_scope(_autocast_dtype(layer)):
            return activation(y)
    with compat.autocast_scope(_autocast_dtype(layer)):
        return layer.call(x, training=training)


def _compute_dtype_linear(layer, x):
    """`Dense.call` in the compute dtype, as `Layer.__call__` runs it: the
    kernel and bias autocast to the compute dtype (x's), `ops.matmul`, then
    `ops.add` of the bias (tests/keras/test_torch_backend.py checks it bit for
    bit against the generic call)."""
    y = torch.matmul(x, compat.stored_value(layer._kernel).to(x.dtype))
    if layer.bias is not None:
        y = y + compat.stored_value(layer.bias).to(x.dtype)
    return y


def _autocast_dtype(layer):
    """The dtype of the autocast scope `Layer.__call__` enters (or None)."""
    compute_dtype = layer.compute_dtype
    return compute_dtype if compute_dtype != layer.variable_dtype else None


def probe_function(loss_fn):
    """The probe's autodiff (`keras_fp8.probe`): returns `run(values,
    batch)`, which calls `loss_fn(tap, None, batch)` (the variables read
    directly) and returns `(loss, aux, {key: d loss / d y})` for every `y`
    that `loss_fn` passed through `tap(key, y)` (None where `y` does not
    reach the loss). `torch.autograd.grad`: no `.grad` is written."""

    def run(values, batch):
        taps = {}

        def tap(key, y):
            taps[key] = y
            return y

        with torch.enable_grad():
            loss, aux = loss_fn(tap, None, batch)
            keys = [key for key, y in taps.items() if y.requires_grad]
            grads = {key: None for key in taps}
            if keys and loss.requires_grad:
                found = torch.autograd.grad(loss, [taps[key] for key in keys], allow_unused=True)
                grads.update(zip(keys, found))
        return loss.detach(), aux, grads

    return run


def compile_function(fn):
    """How the monitor runs its statistics table (`keras_fp8.callbacks`):
    eagerly, without autograd, each tensor's statistics by
    `tensor_stats_function`. The kernels they read are parameters that
    require a gradient: a recorded graph would keep every intermediate of
    every layer's statistics alive as long as the table (on a
    billion-parameter model, more memory than its training step).

    The table's first run compiles the statistics for the shapes and
    formats it meets; later runs reuse that code and run eagerly wherever it
    does not apply (`torch.compiler.set_stance("eager_on_recompile")`), so
    that a measurement in the middle of training never stops for a
    compilation."""
    ran = False

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal ran
        settled = ran and _CAN_SETTLE
        stance = torch.compiler.set_stance("eager_on_recompile") if settled else contextlib.nullcontext()
        with torch.no_grad(), stance:
            out = fn(*args, **kwargs)
        ran = True
        return out

    return run


# `numerics.quantization_stats` compiled for GPU tensors (`tensor_stats_function`),
# built on first use; `_stats_compile_failure` keeps why compiling failed.
# Tensors below STATS_COMPILE_MIN_ELEMENTS run eagerly: on one H200 a
# 16384 x 4096 tensor's statistics take 6.0 ms eagerly and 0.74 ms
# compiled, and compiling takes seconds once; a small model's statistics
# cost little either way.
STATS_COMPILE_MIN_ELEMENTS = 1 << 24
# `compile_function` settles a table after its first run with
# `torch.compiler.set_stance` (torch 2.6 on); without it nothing compiles.
_CAN_SETTLE = hasattr(torch.compiler, "set_stance")
_compiled_stats = None
_stats_compile_failure = None


def tensor_stats_function():
    """How the monitor's table computes one tensor's statistics
    (`numerics.quantization_stats`): for a tensor on a GPU of at least
    `STATS_COMPILE_MIN_ELEMENTS` elements, compiled by `torch.compile`
    (dynamic shapes, the input widened to float32 first, so one
    compilation per FP8 format), else eagerly. Eagerly each of its
    elementwise passes and reductions (some forty) reads and writes the
    whole tensor in float32; compiled, they are a few fused kernels. Where
    compiling fails, a one-time warning names why and the eager function
    runs from then on. Before torch 2.6 they run eagerly."""
    return _tensor_stats


def _tensor_stats(x, scale, fmt):
    if _CAN_SETTLE and x.device.type == "cuda" and x.numel() >= STATS_COMPILE_MIN_ELEMENTS:
        return _compiled_tensor_stats(x, scale, fmt)
    return numerics.quantization_stats(x, scale, fmt)


def _eager_division():
    """Inductor options under which a compiled float32 division rounds
    correctly, as eager's does: Triton's `/` is approximate (up to 2 ulp),
    and `reciprocal(scale)` 1 ulp off moves an element at the format's edge
    across the saturation test (seen on an H100). Empty where this torch
    has no such option."""
    from torch._inductor import config

    known = config.get_config_copy()
    return {key: True for key in ("eager_numerics.division_rounding", "emulate_division_rounding") if key in known}


def _stats_compile_options():
    """Inductor options of the compiled statistics: correctly rounded
    division (`_eager_division`) and no FX graph cache. Under dynamic
    shapes inductor splits a reduction according to the sizes of the
    tensor it compiles for, and the cache key leaves those sizes out: a
    compilation cached for a small tensor (the tests compile some) ran a
    later process's large tensors through one unsplit reduction (on one
    H100, a 16384 x 14336 tensor's statistics took 158.5 ms instead of
    2.6 ms, and the decoder's monitor 4.4 s a measurement instead of 0.33
    s). Uncached, each process compiles for its own first tensor, which
    `_tensor_stats` keeps at `STATS_COMPILE_MIN_ELEMENTS` or more."""
    return {**_eager_division(), "fx_graph_cache": False}


def _compiled_tensor_stats(x, scale, fmt):
    """`numerics.quantization_stats` by `torch.compile` (on any device)."""
    global _compiled_stats, _stats_compile_failure
    if _stats_compile_failure is not None:
        return numerics.quantization_stats(x, scale, fmt)
    if _compiled_stats is None:
        _compiled_stats = torch.compile(numerics.quantization_stats, dynamic=True, options=_stats_compile_options())
    try:
        # Detached: a parameter (the kernel) would be compiled for its own shape.
        return _compiled_stats(x.detach().float(), scale, fmt)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # the compiler stack (inductor, triton) failed here
        _stats_compile_failure = f"{type(e).__name__}: {e}"
        warnings.warn(
            "FP8Monitor: torch.compile of the statistics failed; they run eagerly (slower) from now on. "
            f"Cause: {_stats_compile_failure.splitlines()[0]}", stacklevel=2)
        return numerics.quantization_stats(x, scale, fmt)
