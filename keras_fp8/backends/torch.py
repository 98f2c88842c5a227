"""FP8 matmuls for the torch backend: `torch_ops`, on every device.

An FP8 layer's matmul is `torch_ops.fp8_linear` on the layer's own variables
(their tensors are the op's state, updated in place: no copies, no host
sync), with the layer's `torch_ops.LinearConfig` (`linear_config`, made once
per layer and recipe). On the GPUs the compiled kernels serve, an eager call
is one C++ call; under torch.compile (`jit_compile=True`) and on every other
device the `torch.library` ops run, over the kernels or over torch_ops's
exact reference (which is tested bit for bit against `keras_fp8.numerics`).
Eager and compiled training therefore run the same ops on the same state.
"""

import contextlib
import functools
import warnings

import torch
import torch_ops
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


def linear_config(recipe, min_gemm_size):
    """See `keras_fp8.backends`: the `torch_ops.LinearConfig` of a Keras
    layer's matmul under `recipe` (a Keras kernel is `(K, N)`: "in_out";
    the gradient channel's fold reduces the recipe's history length)."""
    return torch_ops.LinearConfig(
        fp8_format=recipe.fp8_format,
        scaling=recipe.name,
        margin=recipe.margin,
        amax_compute_algo=getattr(recipe, "amax_compute_algo", "max"),
        fold_window=getattr(recipe, "history_len", None),
        power_of_two=getattr(recipe, "power_of_two", False),
        weight_layout="in_out",
        min_gemm_size=min_gemm_size,
    )


def _variable_reader():
    """How to read the layer's variables in this call, in their own dtype.

    Outside a stateless scope a Keras torch variable's value is its `_value`
    tensor, cast by `.value` only when it autocasts; reading it directly skips
    `.value`'s checks (host time). Inside one (e.g. `stateless_call`), the
    scope holds the values.
    """
    return compat.raw_value if compat.in_stateless_scope() else compat.stored_value


def fp8_matmul(layer, x, kernel, bias, config, training):
    """See `keras_fp8.backends`: `torch_ops.fp8_linear` on the layer's FP8
    state variables (the gradient channel included), whose bias is added in
    x's dtype (fused into the GEMM)."""
    value = _variable_reader()
    state = torch_ops.FP8LinearState(
        value(layer.input_scale),
        value(layer.input_amax_history),
        value(layer.kernel_scale),
        value(layer.kernel_amax_history),
        value(layer.grad_scale),
        value(layer.grad_amax_history),
        grad_amax_pending=value(layer.grad_amax_pending),
        grad_fold_state=value(layer.grad_fold_state),
    )
    return torch_ops.fp8_linear(x, kernel, None if bias is None else value(bias), state, config, bool(training))


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
