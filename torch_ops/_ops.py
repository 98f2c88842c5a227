"""torch.library custom ops (namespace ``torch_ops``).

Each op runs the CUDA kernel when its input is on an FP8-capable GPU with the
extension built, and the emulation otherwise (CPU, older GPUs), so the same
graph works everywhere. Mutated arguments are declared, and every op has a
fake (meta) implementation: ``torch.compile(fullgraph=True)`` traces through
them and CUDA graphs capture them (no host sync, no host-side index).

The ops work on 2-D ``x`` (rows, cols). ``pad=True`` makes the fp8 outputs'
rows a multiple of 16 bytes long (zero padding), the layout cuBLASLt FP8 needs:
q is (R, round16(C)), qt is (C, round16(R)). An output that was not asked for
is an empty tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import _build
from . import _env
from . import emulation as emu

_FMT = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
# "cublaslt" (csrc/gemm.cpp, default) or "scaled_mm" (torch._scaled_mm, which
# is cuBLASLt too, through PyTorch): a fallback switch, read once at import.
GEMM_BACKEND = _env.choice("TORCH_OPS_GEMM_BACKEND", ("cublaslt", "scaled_mm"), "cublaslt")
_ALGO = {"max": 0, "most_recent": 1}


def _r16(v: int) -> int:
    return (v + 15) // 16 * 16


def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and _build.is_available()


def _mdiv(margin: float) -> float:
    # 2**-margin rounded to float32, the multiplier the emulation uses
    # (docs/numerics.md: scales are built by multiplication).
    return emu.f32(2.0 ** -float(margin))


def _empty_fp8(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    return torch.empty((0,), dtype=dt, device=x.device)


def _pad_cols(q: torch.Tensor, cols: int) -> torch.Tensor:
    if q.shape[1] == cols:
        return q.contiguous()
    return F.pad(q.view(torch.uint8), (0, cols - q.shape[1])).view(q.dtype)


def _emu_outputs(x, scale_used, dt, transpose, pad, write_q):
    R, C = x.shape
    q = emu.quantize_with_scale(x, scale_used, dt)
    qt = _pad_cols(q.t().contiguous(), _r16(R) if pad else R) if transpose else _empty_fp8(x, dt)
    qo = _pad_cols(q, _r16(C) if pad else C) if write_q else _empty_fp8(x, dt)
    return qo, qt


def _fake_outputs(x, dt, transpose, pad, write_q):
    R, C = x.shape
    q = x.new_empty((R, _r16(C) if pad else C), dtype=dt) if write_q else x.new_empty((0,), dtype=dt)
    qt = x.new_empty((C, _r16(R) if pad else R), dtype=dt) if transpose else x.new_empty((0,), dtype=dt)
    return q, qt


# --------------------------------------------------------------------------- quantize
def _quantize_impl(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool, pad: bool, write_q: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_kernel(x):
        return tuple(_build.load().quantize(x, scale, _FMT[fp8_dtype], transpose, pad, write_q))
    q, qt = _emu_outputs(x, scale, fp8_dtype, transpose, pad, write_q)
    return q, qt, emu.amax(x)

# The registered ops (what torch.compile traces) are the _*_impl functions
# themselves, registered with torch.library.custom_op.
quantize_op = torch.library.custom_op("torch_ops::quantize", mutates_args=())(_quantize_impl)


@quantize_op.register_fake
def _(x, scale, fp8_dtype, transpose, pad, write_q):
    q, qt = _fake_outputs(x, fp8_dtype, transpose, pad, write_q)
    return q, qt, x.new_empty((), dtype=torch.float32)


# --------------------------------------------------------------------------- delayed
def _quantize_delayed_impl(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: float,
    amax_compute_algo: str,
    transpose: bool,
    record: bool,
    pad: bool,
    write_q: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_kernel(x):
        return tuple(
            _build.load().quantize_delayed(
                x, amax_history, scale, _FMT[fp8_dtype], _mdiv(margin), _ALGO[amax_compute_algo],
                transpose, record, pad, write_q,
            )
        )
    # Same rule as emulation.quantize_delayed, written out to also produce the
    # padded layouts.
    a = emu.amax(x)
    empty = amax_history.amax() == 0
    scale_used = torch.where(empty, emu.compute_scale(a, scale, fp8_dtype, margin), scale.reshape(()).float()).clone()
    q, qt = _emu_outputs(x, scale_used, fp8_dtype, transpose, pad, write_q)
    if record:
        new_hist = torch.where(torch.isfinite(a), emu._shifted(amax_history, a), amax_history)
        amax_history.copy_(new_hist)
        scale.copy_(
            emu.compute_scale(emu.window(amax_history, amax_compute_algo), scale_used, fp8_dtype, margin).reshape(
                scale.shape
            )
        )
    return q, qt, scale_used, a

quantize_delayed_op = torch.library.custom_op("torch_ops::quantize_delayed", mutates_args=("amax_history", "scale"))(
    _quantize_delayed_impl
)


@quantize_delayed_op.register_fake
def _(x, amax_history, scale, fp8_dtype, margin, amax_compute_algo, transpose, record, pad, write_q):
    q, qt = _fake_outputs(x, fp8_dtype, transpose, pad, write_q)
    return q, qt, x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)


# --------------------------------------------------------------------------- current
def _quantize_current_impl(
    x: torch.Tensor,
    prev_scale: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    margin: float,
    transpose: bool,
    pad: bool,
    write_q: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_kernel(x):
        return tuple(
            _build.load().quantize_current(x, prev_scale, _FMT[fp8_dtype], _mdiv(margin), transpose, pad, write_q)
        )
    a = emu.amax(x)
    prev = torch.ones((), dtype=torch.float32, device=x.device) if prev_scale is None else prev_scale
    scale_used = emu.compute_scale(a, prev, fp8_dtype, margin).clone()
    q, qt = _emu_outputs(x, scale_used, fp8_dtype, transpose, pad, write_q)
    return q, qt, scale_used, a

quantize_current_op = torch.library.custom_op("torch_ops::quantize_current", mutates_args=())(_quantize_current_impl)


@quantize_current_op.register_fake
def _(x, prev_scale, fp8_dtype, margin, transpose, pad, write_q):
    q, qt = _fake_outputs(x, fp8_dtype, transpose, pad, write_q)
    return q, qt, x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)


# --------------------------------------------------------------------------- record
def _record_amax_impl(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: float,
    amax_compute_algo: str,
    skip_zero: bool,
) -> None:
    if _use_kernel(amax_history):
        _build.load().record_amax(
            amax_history, scale, amax.reshape(()).float().contiguous(), _FMT[fp8_dtype], _mdiv(margin),
            _ALGO[amax_compute_algo], skip_zero,
        )
        return
    emu.record_amax(
        amax_history, scale, amax, fp8_dtype, margin=margin, amax_compute_algo=amax_compute_algo, skip_zero=skip_zero
    )

record_amax_op = torch.library.custom_op("torch_ops::record_amax", mutates_args=("amax_history", "scale"))(
    _record_amax_impl
)


@record_amax_op.register_fake
def _(amax_history, scale, amax, fp8_dtype, margin, amax_compute_algo, skip_zero):
    return None


# --------------------------------------------------------------------------- gemm
def _gemm_impl(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    use_fast_accum: bool,
) -> torch.Tensor:
    if _use_kernel(a):
        if GEMM_BACKEND == "scaled_mm":
            return _scaled_mm_gemm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
        return _build.load().gemm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
    return emu.fp8_gemm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def _pad_rows_cols(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = t.shape
    if (r, c) == (rows, cols) and t.is_contiguous():
        return t
    return F.pad(t.contiguous().view(torch.uint8), (0, cols - c, 0, rows - r)).view(t.dtype)


def _scaled_mm_gemm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum):
    M, K = a.shape
    N = b.shape[0]
    Kp, Np = _r16(K), _r16(N)
    a2 = _pad_rows_cols(a, M, Kp)
    b2 = _pad_rows_cols(b, Np, Kp)
    fuse = bias is not None and Np == N and out_dtype != torch.float32
    out = torch._scaled_mm(
        a2, b2.t(), scale_a=scale_a.reshape(()).float(), scale_b=scale_b.reshape(()).float(),
        bias=bias.to(out_dtype) if fuse else None, out_dtype=out_dtype, use_fast_accum=use_fast_accum,
    )
    if Np != N:
        out = out[:, :N].contiguous()
    if bias is not None and not fuse:
        out = (out.float() + bias.float()).to(out_dtype)
    return out

gemm_op = torch.library.custom_op("torch_ops::gemm", mutates_args=())(_gemm_impl)


@gemm_op.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


# --------------------------------------------------------------------------- eager fast path
# In eager mode the custom-op dispatcher (and its dynamo-disable wrapper) cost
# ~100 us of host time per call on the H200 machine, more than a small GEMM.
# On plain tensors outside torch.compile we call the implementations directly;
# under torch.compile (or on fake/functional tensors while a graph is traced)
# the registered ops are used, so graphs still see them.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(*ts) -> bool:
    if torch.compiler.is_compiling():
        return False
    # Parameters (Keras torch variables are ones) are plain storage too; any
    # other subclass (fake, functional, ...) takes the registered op.
    return all(t is None or type(t) in _PLAIN_TYPES for t in ts)


def quantize(x, scale, fp8_dtype, transpose, pad, write_q):
    if _plain(x, scale):
        return _quantize_impl(x, scale, fp8_dtype, transpose, pad, write_q)
    return torch.ops.torch_ops.quantize(x, scale, fp8_dtype, transpose, pad, write_q)


def quantize_delayed(x, amax_history, scale, fp8_dtype, margin, algo, transpose, record, pad, write_q):
    if _plain(x, amax_history, scale):
        return _quantize_delayed_impl(x, amax_history, scale, fp8_dtype, margin, algo, transpose, record, pad, write_q)
    return torch.ops.torch_ops.quantize_delayed(x, amax_history, scale, fp8_dtype, margin, algo, transpose, record,
                                                pad, write_q)


def quantize_current(x, prev_scale, fp8_dtype, margin, transpose, pad, write_q):
    if _plain(x, prev_scale):
        return _quantize_current_impl(x, prev_scale, fp8_dtype, margin, transpose, pad, write_q)
    return torch.ops.torch_ops.quantize_current(x, prev_scale, fp8_dtype, margin, transpose, pad, write_q)


def record_amax(amax_history, scale, amax, fp8_dtype, margin, algo, skip_zero):
    if _plain(amax_history, scale, amax):
        return _record_amax_impl(amax_history, scale, amax, fp8_dtype, margin, algo, skip_zero)
    return torch.ops.torch_ops.record_amax(amax_history, scale, amax, fp8_dtype, margin, algo, skip_zero)


def gemm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum):
    if _plain(a, b, scale_a, scale_b, bias):
        return _gemm_impl(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
    return torch.ops.torch_ops.gemm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
