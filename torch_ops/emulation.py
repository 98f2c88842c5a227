"""Pure-torch reference of every op in ``torch_ops`` (CPU or any GPU).

These functions define the numerics (DESIGN.md, "Numerics"); the CUDA kernels
are tested byte-for-byte against them. They never touch the compiled
extension, so they run on a machine without CUDA or a compiler.

All state updates are written with tensor ops only (``torch.where``), never a
Python ``if`` on a tensor value: no host sync, so the emulation itself is
CUDA-graph and ``torch.compile`` friendly.
"""

from __future__ import annotations

import functools
import struct

import torch

FP8_MAX = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}

_ALGOS = ("max", "most_recent")


def fp8_max(fp8_dtype: torch.dtype) -> float:
    try:
        return FP8_MAX[fp8_dtype]
    except KeyError:
        raise ValueError(
            f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}"
        ) from None


def _as_scalar(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(()).to(torch.float32)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| in float32; NaN if x has a NaN, inf if it has an inf (0-d)."""
    a = x.detach().to(torch.float32).abs()
    if a.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # torch.amax propagates NaN (unlike fmaxf), which is what we want.
    return a.amax()


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """q = cast_RNE(clamp(float32(x) * (1 / scale), -max, max)); NaN stays NaN.

    A correctly rounded reciprocal, then a product: XLA rewrites x / scale
    into exactly this, so every backend agrees bit for bit (docs/numerics.md).
    """
    m = fp8_max(fp8_dtype)
    y = x.detach().to(torch.float32) * (1.0 / _as_scalar(scale))
    # torch.clamp keeps NaN and maps +-inf to +-max; the cast itself is RNE.
    return y.clamp(-m, m).to(fp8_dtype)


@functools.lru_cache(maxsize=64)
def f32(value: float) -> float:
    """`value` rounded to float32, as a Python float (exactly representable)."""
    return struct.unpack("f", struct.pack("f", float(value)))[0]


def compute_scale(window: torch.Tensor, prev: torch.Tensor, fp8_dtype: torch.dtype, margin: float = 0.0) -> torch.Tensor:
    """(window * f32(1/fmt_max)) * f32(2**-margin) if window is finite and > 0, else prev."""
    w = _as_scalar(window)
    p = _as_scalar(prev)
    # Python floats that are exact float32 values multiply a float32 tensor in
    # float32, and reach a CUDA kernel as arguments: no host-to-device copy
    # (a pageable copy would synchronize the stream).
    new = (w * f32(1.0 / fp8_max(fp8_dtype))) * f32(2.0 ** -float(margin))
    ok = torch.isfinite(w) & (w > 0)
    return torch.where(ok, new, p)


def window(history: torch.Tensor, amax_compute_algo: str = "max") -> torch.Tensor:
    if amax_compute_algo == "max":
        return history.amax()
    if amax_compute_algo == "most_recent":
        return history[0]
    raise ValueError(f"amax_compute_algo: expected one of {_ALGOS}, got {amax_compute_algo!r}")


def _shifted(history: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.cat([value.reshape(1).to(history.dtype), history[:-1]])


def record_amax(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    amax_value: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    margin: float = 0.0,
    amax_compute_algo: str = "max",
    skip_zero: bool = False,
) -> None:
    """Record amax into history (in place) iff finite (and > 0 with skip_zero);
    then scale = compute_scale(window(history), scale). In place, no host sync."""
    a = _as_scalar(amax_value)
    ok = torch.isfinite(a)
    if skip_zero:
        ok = ok & (a > 0)
    new_hist = torch.where(ok, _shifted(amax_history, a), amax_history)
    amax_history.copy_(new_hist)
    new_scale = compute_scale(window(amax_history, amax_compute_algo), scale, fp8_dtype, margin)
    scale.copy_(new_scale.reshape(scale.shape))


def _flat2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1])


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, transpose: bool = False):
    """-> (q, q_t or None, amax). q has x's shape; q_t is (C, R) with C = x.shape[-1]."""
    q = quantize_with_scale(x, scale, fp8_dtype)
    qt = _flat2d(q).t().contiguous() if transpose else None
    return q, qt, amax(x)


def quantize_delayed(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    margin: float = 0.0,
    amax_compute_algo: str = "max",
    transpose: bool = False,
    record: bool = True,
):
    """Delayed scaling, one call. -> (q, q_t or None, scale_used, amax). In place on history/scale."""
    a = amax(x)
    empty = amax_history.amax() == 0
    scale_used = torch.where(empty, compute_scale(a, scale, fp8_dtype, margin), _as_scalar(scale)).clone()
    q, qt, _ = quantize(x, scale_used, fp8_dtype, transpose=transpose)
    if record:
        new_hist = torch.where(torch.isfinite(a), _shifted(amax_history, a), amax_history)
        amax_history.copy_(new_hist)
        scale.copy_(compute_scale(window(amax_history, amax_compute_algo), scale_used, fp8_dtype, margin).reshape(scale.shape))
    return q, qt, scale_used, a


def quantize_current(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    margin: float = 0.0,
    prev_scale: torch.Tensor | None = None,
    transpose: bool = False,
):
    """Current scaling: scale from this tensor's own amax. -> (q, q_t or None, scale_used, amax)."""
    a = amax(x)
    prev = torch.ones((), dtype=torch.float32, device=x.device) if prev_scale is None else prev_scale
    scale_used = compute_scale(a, prev, fp8_dtype, margin)
    q, qt, _ = quantize(x, scale_used, fp8_dtype, transpose=transpose)
    return q, qt, scale_used, a


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = True,
) -> torch.Tensor:
    """(a @ b^T) * scale_a * scale_b (+ bias): a (M,K) fp8, b (N,K) fp8; float32 accumulate."""
    del use_fast_accum  # the emulation always accumulates in float32
    acc = a.to(torch.float32) @ b.to(torch.float32).t()
    out = acc * (_as_scalar(scale_a) * _as_scalar(scale_b))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def fp8_linear(x, weight, bias=None, **kwargs):
    """Reference of ``torch_ops.fp8_linear`` on these functions (same keywords;
    ``min_gemm_size`` defaults to 0: always the FP8 path)."""
    from .linear import fp8_linear_emulated

    return fp8_linear_emulated(x, weight, bias, **kwargs)
