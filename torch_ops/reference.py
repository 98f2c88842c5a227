"""The torch reference of every numerics rule of ``torch_ops``.

These functions *are* the numerics (docs/design.md, "Numerics"; docs/
numerics.md has the exact float32 operations): the CUDA kernels, the C++
eager entry and the ``torch.library`` ops are tested against them, byte for
byte where they quantize and bit for bit where they update state. They run
on any device, need no compiler, and import nothing else of ``torch_ops``.

State updates use tensor operations only (``torch.where``), never a Python
``if`` on a tensor's value: no host synchronization, so the reference is
CUDA-graph and ``torch.compile`` safe too.

Example:

>>> x = torch.randn(8, 16)
>>> scale = compute_scale(amax(x), torch.ones(()), torch.float8_e4m3fn)
>>> q = quantize_with_scale(x, scale, torch.float8_e4m3fn)
"""

from __future__ import annotations

import functools
import math
import struct

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# The largest finite value of each FP8 format.
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# fp8_format -> (forward dtype, gradient dtype).
FP8_FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# Fold counts wrap here, so that fold tokens stay exact in float32.
FOLD_COUNT_PERIOD = 2.0**20
# The smallest scale before the margin: the smallest normal float32 (its
# reciprocal is finite; nothing subnormal that a flushing backend rounds
# differently).
MIN_SCALE = 2.0**-126
# Largest margin: the window's amax maps to fmt_max / 2**margin.
MAX_MARGIN = 8.0


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """The largest finite value of ``fp8_dtype``."""
    try:
        return FP8_MAX[fp8_dtype]
    except KeyError:
        raise ValueError(
            f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}"
        ) from None


@functools.lru_cache(maxsize=64)
def f32(value: float) -> float:
    """``value`` rounded to float32, as a Python float (exactly representable).

    A Python float that is an exact float32 value multiplies a float32 tensor
    in float32 and reaches a CUDA kernel as an argument, with no host-to-device
    copy (a pageable copy would synchronize the stream).
    """
    return struct.unpack("f", struct.pack("f", float(value)))[0]


def margin_multiplier(margin: float) -> float:
    """``2**margin`` rounded to float32: the factor scales are multiplied by."""
    return f32(2.0 ** float(margin))


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(()).to(torch.float32)


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` in float32 (0-d); NaN or inf if ``x`` holds one; 0 if empty."""
    a = x.detach().to(torch.float32).abs()
    if a.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # torch.amax propagates NaN (unlike fmaxf), which is what the rules want.
    return a.amax()


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``q = cast_RNE(clamp(float32(x) * (1 / scale), -max, max))``; a
    non-finite element (NaN, +-inf) quantizes to NaN.

    A correctly rounded reciprocal, then a product: XLA rewrites ``x / scale``
    into exactly this, so every backend agrees bit for bit. The clamp makes
    the cast saturate (ml_dtypes and XLA turn E4M3 overflow into NaN, every
    backend turns E5M2 overflow into inf); an inf input must not saturate
    into a finite value, so it becomes NaN first.
    """
    m = fp8_max(fp8_dtype)
    xf = x.detach().to(torch.float32)
    y = torch.where(torch.isinf(xf), float("nan"), xf * (1.0 / _scalar(scale)))
    # torch.clamp keeps NaN; the cast itself is RNE.
    return y.clamp(-m, m).to(fp8_dtype)


def compute_scale(window: torch.Tensor, prev: torch.Tensor, fp8_dtype: torch.dtype,
                  margin: float = 0.0) -> torch.Tensor:
    """The scale for an amax window: ``max(window * f32(1/max), MIN_SCALE) *
    f32(2**margin)``: the window maps to ``max / 2**margin``.

    Where ``window`` is not finite or not positive, ``prev`` is kept.
    """
    w = _scalar(window)
    new = torch.clamp_min(w * f32(1.0 / fp8_max(fp8_dtype)), MIN_SCALE) * margin_multiplier(margin)
    return torch.where(torch.isfinite(w) & (w > 0), new, _scalar(prev))


def window(history: torch.Tensor, amax_compute_algo: str = "max", length: int | None = None) -> torch.Tensor:
    """The amax a history's next scale covers: the max of its newest ``length``
    entries (all by default), or its newest entry (``"most_recent"``)."""
    if amax_compute_algo == "most_recent":
        return history[0]
    if amax_compute_algo != "max":
        raise ValueError(f"amax_compute_algo: expected one of {AMAX_COMPUTE_ALGOS}, got {amax_compute_algo!r}")
    if length is not None and length < history.numel():
        history = history[:length]
    return history.amax()


def shifted(history: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``history`` with ``value`` at slot 0 and the oldest entry dropped."""
    return torch.cat([value.reshape(1).to(history.dtype), history[:-1]])


def history_is_empty(history: torch.Tensor) -> torch.Tensor:
    """True while nothing but zeros has been recorded (the seed rule)."""
    return history.amax() == 0


def record_amax(amax_history: torch.Tensor, scale: torch.Tensor, amax_value: torch.Tensor, fp8_dtype: torch.dtype,
                *, margin: float = 0.0, amax_compute_algo: str = "max", skip_zero: bool = False) -> None:
    """Records ``amax_value`` (iff finite; and > 0 with ``skip_zero``), then
    ``scale = compute_scale(window(history), scale)``. In place."""
    a = _scalar(amax_value)
    ok = torch.isfinite(a)
    if skip_zero:
        ok = ok & (a > 0)
    amax_history.copy_(torch.where(ok, shifted(amax_history, a), amax_history))
    new_scale = compute_scale(window(amax_history, amax_compute_algo), scale, fp8_dtype, margin)
    scale.copy_(new_scale.reshape(scale.shape))


def delayed_scale_used(a: torch.Tensor, amax_history: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                       margin: float = 0.0) -> torch.Tensor:
    """The scale a delayed-scaling call quantizes with: the state's, or, while
    the history is empty, one seeded from the call's own amax ``a``."""
    seeded = compute_scale(a, scale, fp8_dtype, margin)
    return torch.where(history_is_empty(amax_history), seeded, _scalar(scale))


def quantize_delayed(x: torch.Tensor, amax_history: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *,
                     margin: float = 0.0, amax_compute_algo: str = "max", record: bool = True):
    """Delayed scaling, one call: quantize with the scale from earlier amaxes,
    then (``record``) record this call's amax and publish the next scale.

    Returns:
        ``(q, scale_used, amax)``; ``amax_history`` and ``scale`` are updated
        in place when ``record``.
    """
    a = amax(x)
    scale_used = delayed_scale_used(a, amax_history, scale, fp8_dtype, margin).clone()
    q = quantize_with_scale(x, scale_used, fp8_dtype)
    if record:
        amax_history.copy_(torch.where(torch.isfinite(a), shifted(amax_history, a), amax_history))
        new_scale = compute_scale(window(amax_history, amax_compute_algo), scale_used, fp8_dtype, margin)
        scale.copy_(new_scale.reshape(scale.shape))
    return q, scale_used, a


def quantize_current(x: torch.Tensor, fp8_dtype: torch.dtype, *, margin: float = 0.0,
                     prev_scale: torch.Tensor | None = None):
    """Current scaling: the scale from this tensor's own amax (``prev_scale``,
    default 1, where that amax is zero or not finite).

    Returns:
        ``(q, scale_used, amax)``.
    """
    a = amax(x)
    prev = torch.ones((), dtype=torch.float32, device=x.device) if prev_scale is None else prev_scale
    scale_used = compute_scale(a, prev, fp8_dtype, margin)
    return quantize_with_scale(x, scale_used, fp8_dtype), scale_used, a


def fold_pending_grad_amax(pending: torch.Tensor, fold_state: torch.Tensor, amax_history: torch.Tensor,
                           scale: torch.Tensor, fp8_dtype: torch.dtype, *, margin: float = 0.0,
                           amax_compute_algo: str = "max", window_len: int | None = None,
                           update_scale: bool = True):
    """Folds a pending output-gradient amax into the gradient state, in place.

    ``pending = [amax, token, loss_scale]`` is what the last backward returned
    through the gradient channel; ``fold_state = [folds, last_token,
    last_loss_scale]`` tells a fresh value (token > 0 and new) from one already
    folded. A changed fp16 loss scale first rescales the history and the scale
    by ``loss_scale / last_loss_scale`` (powers of two: exact; the scale no
    lower than ``MIN_SCALE``). A fresh, finite,
    positive amax is recorded; the scale then follows the window (delayed
    scaling, ``update_scale``).

    Returns:
        ``(token, scale, history)``: the token this call's backward emits
        (``folds + 1``), and copies of the new scale (0-d) and history that stay
        valid when the state is folded again before that backward runs.
    """
    amax_value, token, loss_scale = pending[0], pending[1], pending[2]
    folds, last_token, last_loss_scale = fold_state[0], fold_state[1], fold_state[2]
    rescale = torch.where(
        (loss_scale > 0) & (last_loss_scale > 0),
        loss_scale / torch.clamp_min(last_loss_scale, 1e-30),
        torch.ones_like(loss_scale),
    )
    amax_history.mul_(rescale)
    scale.copy_(torch.clamp_min(scale * rescale, MIN_SCALE))
    fresh = (token > 0) & (token != last_token)
    ok = fresh & torch.isfinite(amax_value) & (amax_value > 0)
    amax_history.copy_(torch.where(ok, shifted(amax_history, amax_value), amax_history))
    if update_scale:
        new_scale = compute_scale(window(amax_history, amax_compute_algo, window_len), scale, fp8_dtype, margin)
        scale.copy_(torch.where(fresh, new_scale, _scalar(scale)).reshape(scale.shape))
    new_folds = torch.where(fresh, torch.remainder(folds + 1.0, FOLD_COUNT_PERIOD), folds)
    fold_state.copy_(torch.stack([
        new_folds,
        torch.where(fresh, token, last_token),
        torch.where(loss_scale > 0, loss_scale, last_loss_scale),
    ]))
    return new_folds + 1.0, scale.reshape(()).clone(), amax_history.clone()


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(a @ b^T) * scale_a * scale_b (+ bias)`` for FP8 ``a`` (M, K) and ``b``
    (N, K), accumulated in float32.

    FP8 values dequantize exactly to float32 and their products are exact, so
    this is what an FP8 GEMM with float32 accumulation computes, up to the
    order of the sums.
    """
    acc = a.to(torch.float32) @ b.to(torch.float32).t()
    out = acc * (_scalar(scale_a) * _scalar(scale_b))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def check_margin(margin) -> float:
    """Returns ``margin`` as a float; raises unless it is a number in [0, MAX_MARGIN]."""
    if (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin)
            or not 0 <= margin <= MAX_MARGIN):
        raise ValueError(f"margin: expected a number from 0 to {MAX_MARGIN:g}, got {margin!r}")
    return float(margin)
