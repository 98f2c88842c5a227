"""torch_ops: FP8 linear layers and ops for PyTorch, over compiled CUDA kernels.

Standalone: never imports Keras. On a GPU the build targets (sm_89, sm_90)
the CUDA kernels in ``csrc/`` are built on first use (cached; ``python -m
torch_ops build`` builds ahead of time); everywhere else every function runs
the exact reference (``torch_ops.reference``), with identical numerics.
docs/torch_ops.md is the guide.

Public: the names in ``__all__``. ``torch_ops.reference`` (the numerics),
``torch_ops.ops`` (the ``torch.library`` ops), ``torch_ops.extension``,
``torch_ops.distributed`` (the amax reduction group, DDP) and
``torch_ops.fsdp`` (FP8 all-gather for FSDP2) are importable modules;
everything else, and every name starting with ``_``, is internal.
"""

from __future__ import annotations

import torch

from . import distributed
from . import extension as _extension
from . import fsdp
from . import ops as _ops
from . import reference
from .config import LinearConfig
from .linear import FP8LinearState
from .linear import fold_pending_grad_amax
from .linear import fp8_linear
from .module import FP8Linear
from .module import convert_to_fp8
from .settings import DEFAULT_MIN_GEMM_SIZE
from .settings import Settings
from .settings import get_settings
from .settings import set_settings

__all__ = [
    "DEFAULT_MIN_GEMM_SIZE",
    "FP8Linear",
    "FP8LinearState",
    "LinearConfig",
    "Settings",
    "build",
    "convert_to_fp8",
    "distributed",
    "fold_pending_grad_amax",
    "fp8_gemm",
    "fp8_linear",
    "fsdp",
    "get_settings",
    "is_available",
    "quantize",
    "quantize_current",
    "quantize_delayed",
    "record_amax",
    "reference",
    "set_settings",
    "unavailable_reason",
]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def is_available(device=None) -> bool:
    """True when the compiled kernels serve ``device`` (default: the current
    CUDA device). May build the extension on first call (cached)."""
    return _extension.is_available(device)


def unavailable_reason(device=None) -> str | None:
    """One line saying why the kernels do not serve ``device``, or None."""
    return _extension.unavailable_reason(device)


def build(verbose: bool = False):
    """Builds the extension now (ahead of time).

    Raises:
        RuntimeError: with the reason, where it cannot be built here.
    """
    return _extension.load(verbose=verbose)


def _x2d(x, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() == 0:
        x = x.reshape(1, 1)
    return x.detach().reshape(-1, x.shape[-1]).contiguous()


def _fp8(fp8_dtype) -> torch.dtype:
    if fp8_dtype not in reference.FP8_MAX:
        raise ValueError(f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    return fp8_dtype


def _scalar(t, name: str, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        raise ValueError(f"{name}: expected a 1-element float32 tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device != like.device:
        raise ValueError(f"{name}: expected device {like.device}, got {t.device}")
    return t


def _history(t, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError("amax_history: expected a contiguous 1-D float32 tensor (H,), got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device != like.device:
        raise ValueError(f"amax_history: expected device {like.device}, got {t.device}")
    return t


def _algo(a: str) -> str:
    if a not in reference.AMAX_COMPUTE_ALGOS:
        raise ValueError(f"amax_compute_algo: expected one of {reference.AMAX_COMPUTE_ALGOS}, got {a!r}")
    return a


def _shaped(x, q, qt, transpose):
    return q.reshape(x.shape), (qt if transpose else None)


def quantize(x, scale, fp8_dtype, *, transpose: bool = False):
    """Quantizes ``x`` with a given scale: ``q = cast(clamp(x * (1 / scale)))``.

    Returns:
        ``(q, q_t or None, amax)``: ``q`` shaped like ``x``; ``q_t`` is
        ``(C, R)`` for ``x`` viewed as ``(R, C)``, ``C = x.shape[-1]``.
    """
    x2 = _x2d(x)
    s = _scalar(scale, "scale", x2)
    q, qt, amax = _ops.quantize(x2, s.reshape(()), _fp8(fp8_dtype), bool(transpose), False, True)
    return (*_shaped(x, q, qt, transpose), amax)


def quantize_delayed(x, amax_history, scale, fp8_dtype, *, margin: float = 0.0, amax_compute_algo: str = "max",
                     transpose: bool = False, record: bool = True):
    """Delayed scaling in one call (``reference.quantize_delayed``); in place
    on ``amax_history`` and ``scale`` when ``record``.

    Returns:
        ``(q, q_t or None, scale_used, amax)``.
    """
    x2 = _x2d(x)
    h = _history(amax_history, x2)
    s = _scalar(scale, "scale", x2)
    q, qt, su, amax = _ops.quantize_delayed(x2, h, s, _fp8(fp8_dtype), reference.check_margin(margin),
                                            _algo(amax_compute_algo), bool(transpose), bool(record), False, True)
    return (*_shaped(x, q, qt, transpose), su, amax)


def quantize_current(x, fp8_dtype, *, margin: float = 0.0, prev_scale=None, transpose: bool = False):
    """Current scaling: ``scale_used = compute_scale(amax(x), prev_scale or 1)``.

    Returns:
        ``(q, q_t or None, scale_used, amax)``.
    """
    x2 = _x2d(x)
    prev = None if prev_scale is None else _scalar(prev_scale, "prev_scale", x2)
    q, qt, su, amax = _ops.quantize_current(x2, prev, _fp8(fp8_dtype), reference.check_margin(margin),
                                            bool(transpose), False, True)
    return (*_shaped(x, q, qt, transpose), su, amax)


def record_amax(amax_history, scale, amax, fp8_dtype, *, margin: float = 0.0, amax_compute_algo: str = "max",
                skip_zero: bool = False) -> None:
    """Records ``amax`` (iff finite; and > 0 with ``skip_zero``), then
    ``scale = compute_scale(window, scale)``. In place, on the device."""
    if not isinstance(amax_history, torch.Tensor):
        raise TypeError(f"amax_history: expected a torch.Tensor, got {type(amax_history).__name__}")
    _history(amax_history, amax_history)
    _scalar(scale, "scale", amax_history)
    if not isinstance(amax, torch.Tensor) or amax.numel() != 1:
        raise ValueError(f"amax: expected a 1-element tensor, got {type(amax).__name__}")
    if amax.device != amax_history.device:
        raise ValueError(f"amax: expected device {amax_history.device}, got {amax.device}")
    _ops.record_amax(amax_history, scale, amax.reshape(()).to(torch.float32), _fp8(fp8_dtype),
                     reference.check_margin(margin), _algo(amax_compute_algo), bool(skip_zero))


def fp8_gemm(a, b, scale_a, scale_b, *, bias=None, out_dtype=torch.bfloat16, use_fast_accum: bool = True):
    """``(a @ b^T) * scale_a * scale_b (+ bias)`` for FP8 ``a`` (M, K) and ``b``
    (N, K), accumulated in float32."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in reference.FP8_MAX:
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
    return _ops.gemm(a, b, scale_a.reshape(()), scale_b.reshape(()), bias, out_dtype, bool(use_fast_accum),
                     get_settings().gemm_autotune)
