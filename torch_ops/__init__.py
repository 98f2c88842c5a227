"""torch_ops: FP8 ops for PyTorch (fused quantize kernels, cuBLASLt FP8 GEMMs).

Standalone: never imports Keras. On an FP8 GPU (sm_89+) with nvcc the CUDA
kernels in ``csrc/`` are built on first use (cached; ``python -m torch_ops
build`` builds ahead of time); everywhere else every function runs the
pure-torch emulation with identical numerics (``torch_ops.emulation``).
See docs/torch_ops.md.
"""

from __future__ import annotations

import torch

from . import emulation
from . import _build
from . import _ops  # registers torch.ops.torch_ops.*
from .fold import fold_pending_grad_amax
from .linear import DEFAULT_MIN_GEMM_SIZE, FP8LinearState, fp8_linear
from .module import FP8Linear, convert_to_fp8

__all__ = [
    "DEFAULT_MIN_GEMM_SIZE",
    "FP8Linear",
    "FP8LinearState",
    "build",
    "convert_to_fp8",
    "emulation",
    "fp8_gemm",
    "fp8_linear",
    "fold_pending_grad_amax",
    "is_available",
    "quantize",
    "quantize_current",
    "quantize_delayed",
    "record_amax",
    "unavailable_reason",
]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def is_available() -> bool:
    """True when the compiled kernels can be used (CUDA, sm_89+, built or buildable).
    May build the extension on first call (cached)."""
    return _build.is_available()


def unavailable_reason() -> str | None:
    """One line saying why the kernels are not usable, or None."""
    return _build.unavailable_reason()


def build(verbose: bool = False):
    """Build the extension now (ahead of time); raises RuntimeError with the reason."""
    return _build.load(verbose=verbose)


def _x2d(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() == 0:
        x = x.reshape(1, 1)
    return x.detach().reshape(-1, x.shape[-1]).contiguous()


def _fp8(fp8_dtype) -> torch.dtype:
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    return fp8_dtype


def _scalar(t, name: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        raise ValueError(f"{name}: expected a 1-element float32 tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device != x.device:
        raise ValueError(f"{name}: expected device {x.device}, got {t.device}")
    return t


def _history(t, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError("amax_history: expected a contiguous 1-D float32 tensor (H,), got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device != x.device:
        raise ValueError(f"amax_history: expected device {x.device}, got {t.device}")
    return t


def _algo(a: str) -> str:
    if a not in ("max", "most_recent"):
        raise ValueError(f"amax_compute_algo: expected 'max' or 'most_recent', got {a!r}")
    return a


def _shape_out(x, q, qt, transpose):
    q = q.reshape(x.shape)
    return q, (qt if transpose else None)


def quantize(x, scale, fp8_dtype, *, transpose: bool = False):
    """q = cast(clamp(x / scale)) with a given scale. -> (q, q_t or None, amax).
    q has x's shape; q_t is (C, R) for x viewed as (R, C), C = x.shape[-1]."""
    x2 = _x2d(x)
    s = _scalar(scale, "scale", x2)
    q, qt, amax = _ops.quantize(x2, s.reshape(()), _fp8(fp8_dtype), bool(transpose), False, True)
    q, qt = _shape_out(x, q, qt, transpose)
    return q, qt, amax


def quantize_delayed(x, amax_history, scale, fp8_dtype, *, margin: float = 0.0, amax_compute_algo: str = "max",
                     transpose: bool = False, record: bool = True):
    """Delayed scaling, one call (DESIGN.md). In place on amax_history/scale when record.
    -> (q, q_t or None, scale_used, amax); scale_used is its own 0-d tensor."""
    x2 = _x2d(x)
    h = _history(amax_history, x2)
    s = _scalar(scale, "scale", x2)
    q, qt, su, amax = _ops.quantize_delayed(
        x2, h, s, _fp8(fp8_dtype), float(margin), _algo(amax_compute_algo), bool(transpose), bool(record), False, True
    )
    q, qt = _shape_out(x, q, qt, transpose)
    return q, qt, su, amax


def quantize_current(x, fp8_dtype, *, margin: float = 0.0, prev_scale=None, transpose: bool = False):
    """Current scaling: scale_used = compute_scale(amax(x), prev_scale or 1). -> (q, q_t or None, scale_used, amax)."""
    x2 = _x2d(x)
    prev = None if prev_scale is None else _scalar(prev_scale, "prev_scale", x2)
    q, qt, su, amax = _ops.quantize_current(
        x2, prev, _fp8(fp8_dtype), float(margin), bool(transpose), False, True
    )
    q, qt = _shape_out(x, q, qt, transpose)
    return q, qt, su, amax


def record_amax(amax_history, scale, amax, fp8_dtype, *, margin: float = 0.0, amax_compute_algo: str = "max",
                skip_zero: bool = False) -> None:
    """Record amax (iff finite; and > 0 with skip_zero), then scale = compute_scale(window, scale).
    In place, device-side, no host sync."""
    h = amax_history
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"amax_history: expected a torch.Tensor, got {type(h).__name__}")
    _history(h, h)
    _scalar(scale, "scale", h)
    if not isinstance(amax, torch.Tensor) or amax.numel() != 1:
        raise ValueError(f"amax: expected a 1-element tensor, got {type(amax).__name__}")
    if amax.device != h.device:
        raise ValueError(f"amax: expected device {h.device}, got {amax.device}")
    _ops.record_amax(h, scale, amax.reshape(()).to(torch.float32), _fp8(fp8_dtype), float(margin),
                                    _algo(amax_compute_algo), bool(skip_zero))


def fp8_gemm(a, b, scale_a, scale_b, *, bias=None, out_dtype=torch.bfloat16, use_fast_accum: bool = True):
    """out (M, N) = (a @ b^T) * scale_a * scale_b (+ bias); a (M, K), b (N, K) fp8; float32 accumulation."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{name}: expected a 2-D float8_e4m3fn/float8_e5m2 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"b: expected (N, {a.shape[1]}) to match a's K, got {tuple(b.shape)}")
    if b.device != a.device:
        raise ValueError(f"b: expected device {a.device}, got {b.device}")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ValueError("a, b: E5M2 x E5M2 is not supported; one operand must be E4M3")
    if out_dtype not in _FLOATS:
        raise ValueError(f"out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    _scalar(scale_a, "scale_a", a)
    _scalar(scale_b, "scale_b", a)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[0] or bias.device != a.device):
        raise ValueError(f"bias: expected shape ({b.shape[0]},) on {a.device}, got {tuple(bias.shape)}")
    return _ops.gemm(a, b, scale_a.reshape(()), scale_b.reshape(()), bias, out_dtype,
                                    bool(use_fast_accum))
