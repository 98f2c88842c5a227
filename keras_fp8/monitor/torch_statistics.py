"""What the monitor runs on the torch backend: the probe's autodiff and the
statistics table.

The table runs eagerly without autograd (`compile_function`); the
statistics of a large GPU tensor are compiled by `torch.compile`
(`tensor_stats_function`), during a table's first run only.
"""

import contextlib
import functools
import warnings

import torch

from keras_fp8.monitor import statistics


def probe_function(loss_fn, gradients=True):
    """The probe's autodiff (`keras_fp8.monitor.probe`): returns `run(values,
    batch)`, which calls `loss_fn(tap, None, batch)` (the variables read
    directly) and returns `(loss, aux, {key: d loss / d y})` for every `y`
    that `loss_fn` passed through `tap(key, y)` (None where `y` does not
    reach the loss). `torch.autograd.grad`: no `.grad` is written. With
    `gradients=False` the pass runs without autograd and the dict is empty."""

    def forward(values, batch):
        with torch.no_grad():
            loss, aux = loss_fn(lambda key, y: y, None, batch)
        return loss, aux, {}

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

    return run if gradients else forward


def compile_function(fn):
    """How the monitor runs its statistics table: eagerly, without autograd,
    each tensor's statistics by `tensor_stats_function`. The kernels they
    read are parameters that require a gradient: a recorded graph would
    keep every intermediate of every layer's statistics alive as long as the
    table (on a billion-parameter model, more memory than its training step).

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


# `statistics.tensor_stats` compiled for GPU tensors (`tensor_stats_function`),
# built on first use; `_stats_compile_failure` keeps why compiling failed.
# Tensors below STATS_COMPILE_MIN_ELEMENTS run eagerly: compiled, a large
# tensor's statistics take a fraction of their eager time
# (docs/monitor.md), but compiling takes seconds once, and a small model's
# statistics cost little either way.
STATS_COMPILE_MIN_ELEMENTS = 1 << 24
# `compile_function` settles a table after its first run with
# `torch.compiler.set_stance` (torch 2.6 on); without it nothing compiles.
_CAN_SETTLE = hasattr(torch.compiler, "set_stance")
_compiled_stats = None
_stats_compile_failure = None


def tensor_stats_function():
    """How the monitor's table computes one tensor's statistics
    (`statistics.tensor_stats`): for a tensor on a GPU of at least
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
    return statistics.tensor_stats(x, scale, fmt)


def _eager_division():
    """Inductor options under which a compiled float32 division rounds
    correctly, as eager's does: Triton's `/` is approximate (up to 2 ulp),
    and `reciprocal(scale)` 1 ulp off moves an element at the format's edge
    across the saturation test. Empty where this torch has no such
    option."""
    from torch._inductor import config

    known = config.get_config_copy()
    return {key: True for key in ("eager_numerics.division_rounding", "emulate_division_rounding") if key in known}


def _stats_compile_options():
    """Inductor options of the compiled statistics: correctly rounded
    division (`_eager_division`) and no FX graph cache. Under dynamic
    shapes inductor splits a reduction according to the sizes of the
    tensor it compiles for, and the cache key leaves those sizes out: a
    compilation cached for a small tensor (the tests compile some) would
    run a later process's large tensors through one unsplit reduction,
    many times slower (tools/stats_cache_probe.py shows it). Uncached, each
    process compiles for its own first tensor, which `_tensor_stats` keeps
    at `STATS_COMPILE_MIN_ELEMENTS` or more."""
    return {**_eager_division(), "fx_graph_cache": False}


def _compiled_tensor_stats(x, scale, fmt):
    """`statistics.tensor_stats` by `torch.compile` (on any device)."""
    global _compiled_stats, _stats_compile_failure
    if _stats_compile_failure is not None:
        return statistics.tensor_stats(x, scale, fmt)
    if _compiled_stats is None:
        _compiled_stats = torch.compile(statistics.tensor_stats, dynamic=True, options=_stats_compile_options())
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
        return statistics.tensor_stats(x, scale, fmt)
