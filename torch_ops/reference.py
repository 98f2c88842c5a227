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
# The ids the compiled kernels know the formats and the amax algorithms by
# (csrc/fp8_kernels.h; the extension's load checks that they agree).
FP8_FORMAT_IDS = {E4M3: 0, E5M2: 1}
AMAX_COMPUTE_ALGO_IDS = {"max": 0, "most_recent": 1}
# Longest amax history a state may have (4 MB per operand).
MAX_HISTORY_LEN = 2**20
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


# --------------------------------------------------------------------------- block scaling
# Block scaling (DeepSeek-V3's recipe): activations and output gradients get a
# scale per 1 x 128 tile along the contraction dimension, weights one per
# 128 x 128 block; each from the tensor's own values in that tile (no
# history). A ragged last tile is shorter; zeros pad nothing but the shape.
BLOCK = 128


def block_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: float = 0.0,
                power_of_two: bool = False) -> torch.Tensor:
    """The scale of each tile from its amax: ``compute_scale``'s rule (floor,
    margin), rounded up to a power of two with ``power_of_two``; 1 for a tile
    that is all zeros or holds a non-finite value."""
    a = amax.to(torch.float32)
    s = torch.clamp_min(a * f32(1.0 / fp8_max(fp8_dtype)), MIN_SCALE) * margin_multiplier(margin)
    if power_of_two:
        mantissa, exponent = torch.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(max=127)  # 2**128 is inf
        s = torch.ldexp(torch.ones_like(s), exponent)
    return torch.where(torch.isfinite(a) & (a > 0), s, torch.ones_like(s))


def _tiled(x2d: torch.Tensor, axis: int):
    """``x2d`` as (lines, tiles, BLOCK) tiles of BLOCK along ``axis``, zero
    padded, lines being the other axis; and the padded length."""
    t = x2d.detach().to(torch.float32)
    if axis == 0:
        t = t.t()
    lines, n = t.shape
    tiles = -(-n // BLOCK)
    t = torch.nn.functional.pad(t, (0, tiles * BLOCK - n))
    return t.reshape(lines, tiles, BLOCK), n


def quantize_tiles(x2d: torch.Tensor, fp8_dtype: torch.dtype, *, axis: int = 1, margin: float = 0.0,
                   power_of_two: bool = False):
    """Quantizes a 2-D tensor per tile of 128 along ``axis`` (1: 1 x 128 tiles
    of each row; 0: 128 x 1 tiles of each column).

    Returns:
        ``(q, scales)``: ``q`` shaped like ``x2d``; ``scales`` float32 of
        shape ``(rows, ceil(cols / 128))`` for axis 1, ``(ceil(rows / 128),
        cols)`` for axis 0.
    """
    t, n = _tiled(x2d, axis)
    if t.numel():
        scales = block_scale(t.abs().amax(dim=2), fp8_dtype, margin, power_of_two)
    else:
        scales = t.new_ones(t.shape[:2])
    q = quantize_with_scale_tiles(t, scales, fp8_dtype).reshape(t.shape[0], -1)[:, :n]
    if axis == 0:
        return q.t().contiguous(), scales.t().contiguous()
    return q.contiguous(), scales


def quantize_with_scale_tiles(t: torch.Tensor, scales: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``quantize_with_scale`` of (lines, tiles, BLOCK) tiles, each with its scale."""
    m = fp8_max(fp8_dtype)
    y = torch.where(torch.isinf(t), float("nan"), t * (1.0 / scales.unsqueeze(-1)))
    return y.clamp(-m, m).to(fp8_dtype)


def quantize_blocks(w2d: torch.Tensor, fp8_dtype: torch.dtype, *, margin: float = 0.0, power_of_two: bool = False):
    """Quantizes a 2-D tensor per 128 x 128 block.

    Returns:
        ``(q, scales)``: ``q`` shaped like ``w2d``; ``scales`` float32 of shape
        ``(ceil(rows / 128), ceil(cols / 128))``.
    """
    w = w2d.detach().to(torch.float32)
    r, c = w.shape
    rb, cb = -(-r // BLOCK), -(-c // BLOCK)
    padded = torch.nn.functional.pad(w, (0, cb * BLOCK - c, 0, rb * BLOCK - r))
    blocks = padded.reshape(rb, BLOCK, cb, BLOCK).permute(0, 2, 1, 3)  # (rb, cb, 128, 128)
    scales = block_scale(blocks.abs().amax(dim=(2, 3)), fp8_dtype, margin, power_of_two)
    m = fp8_max(fp8_dtype)
    y = torch.where(torch.isinf(blocks), float("nan"), blocks * (1.0 / scales[:, :, None, None]))
    q = y.clamp(-m, m).to(fp8_dtype).permute(0, 2, 1, 3).reshape(rb * BLOCK, cb * BLOCK)[:r, :c]
    return q.contiguous(), scales


def block_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, *,
               b_tiles: bool = False, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ b`` for block-scaled FP8 operands: ``a`` (M, K) with 1 x 128
    tiles along K (``a_scales`` (M, ceil(K/128))), ``b`` (K, N) with 128 x 128
    blocks (``b_scales`` (ceil(K/128), ceil(N/128))) or, with ``b_tiles``,
    128 x 1 tiles along K (``b_scales`` (ceil(K/128), N)). Each 128-long
    stretch of K is summed in float32 and multiplied by its two scales, then
    the stretches are added: what block-scaled FP8 GEMMs compute, up to the
    order of the sums.
    """
    m, k = a.shape
    n = b.shape[1]
    out = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    af, bf = a.to(torch.float32), b.to(torch.float32)
    for kb in range(-(-k // BLOCK)):
        sl = slice(kb * BLOCK, min(k, (kb + 1) * BLOCK))
        sb = b_scales[kb] if b_tiles else b_scales[kb].repeat_interleave(BLOCK)[:n]
        out += (af[:, sl] @ bf[sl, :]) * a_scales[:, kb:kb + 1] * sb[None, :]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


# --------------------------------------------------------------------------- fused producers
# The op before an FP8 linear (a norm, a gated activation) writes its output
# in the compute dtype and, in the same pass, its FP8 copy and amax for the
# linear that reads it (docs/numerics.md, "Fused producers"). Each is defined
# as the composition of the producer's own math, rounded to the output dtype,
# and ``quantize_with_scale`` of that rounded output: fusing changes no bit.
PRODUCER_ACTIVATIONS = ("identity", "silu", "gelu_tanh", "gelu")
# The ids the compiled kernels know the activations by (csrc/producers.cu).
PRODUCER_ACTIVATION_IDS = {name: i for i, name in enumerate(PRODUCER_ACTIVATIONS)}


def producer_activation(x32: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation`` of float32 ``x32`` in float32, as torch's own functions
    compute it (Keras's activations on torch call these)."""
    if activation == "identity":
        return x32
    if activation == "silu":
        return torch.nn.functional.silu(x32)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(x32, approximate="tanh")
    if activation == "gelu":
        return torch.nn.functional.gelu(x32)
    raise ValueError(f"activation: expected one of {PRODUCER_ACTIVATIONS}, got {activation!r}")


def scaled_rows(x: torch.Tensor, row_mul: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A norm's last step: ``((float32(x) * row_mul[r]) * float32(weight[c]))``
    rounded once to ``out_dtype``.

    ``row_mul`` (one float32 per row: ``1 / rms`` for RMSNorm) comes from the
    norm's own reduction, computed by the caller exactly as the norm does; the
    two products are separate float32 roundings, in this order (Llama's and
    Gemma's RMSNorm: ``x * rsqrt(var + eps)``, then ``* scale``; Gemma passes
    ``1 + scale`` as ``weight``)."""
    rows = row_mul.reshape(-1, 1).to(torch.float32)
    return ((x.to(torch.float32) * rows) * weight.to(torch.float32)).to(out_dtype)


def gated(gate: torch.Tensor, up: torch.Tensor | None, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """``round(act(gate)) * up`` rounded once to ``out_dtype`` (SwiGLU,
    GeGLU; ``up=None``: ``act(gate)`` alone, GELU).

    The activation runs in float32 and is rounded to ``out_dtype`` before the
    product, as Keras's gated FFNs compute it (Llama: the gate cast to
    float32, activated, cast back; then ``up * gate`` in the compute dtype,
    one rounding of an exact float32 product for 16-bit dtypes). With
    ``"identity"`` the gate comes activated already."""
    a = producer_activation(gate.to(torch.float32), activation).to(out_dtype)
    if up is None:
        return a
    return (up.to(torch.float32) * a.to(torch.float32)).to(out_dtype)


def producer_quantize(y: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *,
                      amax_history: torch.Tensor | None = None, margin: float = 0.0):
    """The FP8 copy of a producer's output ``y`` for the linear that reads it.

    Args:
        y: The producer's output, in its output dtype.
        scale: The scale to quantize with; with ``amax_history``, the reading
            linear's delayed-scaling state scale.
        fp8_dtype: The FP8 dtype.
        amax_history: The reading linear's input history (read only): while it
            is empty the scale is seeded from ``y``'s amax, as the linear's own
            quantize would (``delayed_scale_used``). None: ``scale`` as given.
        margin: The linear's margin (for the seed).

    Returns:
        ``(q, scale_used, amax)``: nothing is recorded (the linear records
        the amax in its own state when it takes the copy).
    """
    a = amax(y)
    if amax_history is None:
        scale_used = _scalar(scale).clone()
    else:
        scale_used = delayed_scale_used(a, amax_history, scale, fp8_dtype, margin).clone()
    return quantize_with_scale(y, scale_used, fp8_dtype), scale_used, a


def rms_norm_quantize(x, row_mul, weight, scale, fp8_dtype, out_dtype, *, amax_history=None, margin=0.0):
    """``scaled_rows`` then ``producer_quantize``: ``(y, q, scale_used, amax)``."""
    y = scaled_rows(x, row_mul, weight, out_dtype)
    return (y, *producer_quantize(y, scale, fp8_dtype, amax_history=amax_history, margin=margin))


def glu_quantize(gate, up, activation, scale, fp8_dtype, out_dtype, *, amax_history=None, margin=0.0):
    """``gated`` then ``producer_quantize``: ``(y, q, scale_used, amax)``
    (``up=None``: GELU and the like)."""
    y = gated(gate, up, activation, out_dtype)
    return (y, *producer_quantize(y, scale, fp8_dtype, amax_history=amax_history, margin=margin))
