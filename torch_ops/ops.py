"""The ``torch.library`` custom ops of torch_ops (namespace ``torch_ops``).

Each op runs the CUDA kernel where ``extension.kernels_for`` serves its input's
device, and the reference (``torch_ops.reference``) elsewhere, so the same
graph works everywhere. Mutated arguments are declared and every op has a
fake implementation: ``torch.compile(fullgraph=True)`` traces through them
and CUDA graphs capture them (no host sync, no host-side index).

The ops take 2-D ``x`` (rows, cols). ``pad=True`` lays the FP8 outputs out as
cuBLASLt's FP8 GEMMs need them: rows a multiple of 16 bytes long, the padding
zero bytes (``q`` is (R, round16(C)), ``qt`` is (C, round16(R))). An output
that was not asked for is an empty tensor.

Outside torch.compile, on plain tensors, the functions at the bottom call the
implementations directly: the custom-op dispatcher costs tens of
microseconds of host time per call, more than a small kernel.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from . import extension
from . import reference as ref

_FMT_ID = ref.FP8_FORMAT_IDS
_ALGO_ID = ref.AMAX_COMPUTE_ALGO_IDS


def _r16(v: int) -> int:
    return (v + 15) // 16 * 16


def _pad_cols(q: torch.Tensor, cols: int) -> torch.Tensor:
    if q.shape[1] == cols:
        return q.contiguous()
    return F.pad(q.view(torch.uint8), (0, cols - q.shape[1])).view(q.dtype)


def transposed_copy(q: torch.Tensor, cols: int) -> torch.Tensor:
    """The transposed FP8 copy of ``q``'s first ``cols`` columns (``q``: the
    row-major copy, its rows padded or not), laid out as the quantize ops lay
    their transposed output: rows padded to a multiple of 16 (a byte copy)."""
    rows = q.shape[0]
    qt = q[:, :cols].contiguous().view(torch.uint8).t().contiguous().view(q.dtype)
    return _pad_cols(qt, _r16(rows))


def _layouts(x, q, dt, transpose, pad, write_q):
    """The reference's q in the layouts the op was asked for."""
    R, C = x.shape
    qt = _pad_cols(q.t().contiguous(), _r16(R) if pad else R) if transpose else x.new_empty((0,), dtype=dt)
    qo = _pad_cols(q, _r16(C) if pad else C) if write_q else x.new_empty((0,), dtype=dt)
    return qo, qt


def fp8_layouts(q, transpose, write_q):
    """An FP8 tensor's GEMM-ready (padded) layouts, as the quantize ops lay
    them out: ``(q, q_t)``, each empty where not asked for."""
    return _layouts(q, q, q.dtype, transpose, True, write_q)


def _fake_layouts(x, dt, transpose, pad, write_q):
    R, C = x.shape
    q = x.new_empty((R, _r16(C) if pad else C), dtype=dt) if write_q else x.new_empty((0,), dtype=dt)
    qt = x.new_empty((C, _r16(R) if pad else R), dtype=dt) if transpose else x.new_empty((0,), dtype=dt)
    return q, qt


def _scalar_out(x):
    return x.new_empty((), dtype=torch.float32)


# --------------------------------------------------------------------------- quantize (a given scale)
def _quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool, pad: bool,
                write_q: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = extension.kernels_for(x)
    if ext is not None:
        return tuple(ext.quantize(x, scale, _FMT_ID[fp8_dtype], transpose, pad, write_q))
    q = ref.quantize_with_scale(x, scale, fp8_dtype)
    return (*_layouts(x, q, fp8_dtype, transpose, pad, write_q), ref.amax(x))


quantize_op = torch.library.custom_op("torch_ops::quantize", mutates_args=())(_quantize)


@quantize_op.register_fake
def _(x, scale, fp8_dtype, transpose, pad, write_q):
    return (*_fake_layouts(x, fp8_dtype, transpose, pad, write_q), _scalar_out(x))


# --------------------------------------------------------------------------- delayed scaling
def _quantize_delayed(x: torch.Tensor, amax_history: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                        margin: float, amax_compute_algo: str, transpose: bool, record: bool, pad: bool,
                        write_q: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = extension.kernels_for(x)
    if ext is not None:
        return tuple(ext.quantize_delayed(x, amax_history, scale, _FMT_ID[fp8_dtype], ref.margin_multiplier(margin),
                                          _ALGO_ID[amax_compute_algo], transpose, record, pad, write_q))
    q, scale_used, a = ref.quantize_delayed(x, amax_history, scale, fp8_dtype, margin=margin,
                                            amax_compute_algo=amax_compute_algo, record=record)
    return (*_layouts(x, q, fp8_dtype, transpose, pad, write_q), scale_used, a)


quantize_delayed_op = torch.library.custom_op("torch_ops::quantize_delayed", mutates_args=("amax_history", "scale"))(_quantize_delayed)


@quantize_delayed_op.register_fake
def _(x, amax_history, scale, fp8_dtype, margin, amax_compute_algo, transpose, record, pad, write_q):
    return (*_fake_layouts(x, fp8_dtype, transpose, pad, write_q), _scalar_out(x), _scalar_out(x))


# --------------------------------------------------------------------------- current scaling
def _quantize_current(x: torch.Tensor, prev_scale: Optional[torch.Tensor], fp8_dtype: torch.dtype, margin: float,
                        transpose: bool, pad: bool,
                        write_q: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = extension.kernels_for(x)
    if ext is not None:
        return tuple(ext.quantize_current(x, prev_scale, _FMT_ID[fp8_dtype], ref.margin_multiplier(margin), transpose,
                                          pad, write_q))
    q, scale_used, a = ref.quantize_current(x, fp8_dtype, margin=margin, prev_scale=prev_scale)
    return (*_layouts(x, q, fp8_dtype, transpose, pad, write_q), scale_used, a)


quantize_current_op = torch.library.custom_op("torch_ops::quantize_current", mutates_args=())(_quantize_current)


@quantize_current_op.register_fake
def _(x, prev_scale, fp8_dtype, margin, transpose, pad, write_q):
    return (*_fake_layouts(x, fp8_dtype, transpose, pad, write_q), _scalar_out(x), _scalar_out(x))


# --------------------------------------------------------------------------- record an amax
def _record_amax(amax_history: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype,
                   margin: float, amax_compute_algo: str, skip_zero: bool) -> None:
    ext = extension.kernels_for(amax_history)
    if ext is not None:
        ext.record_amax(amax_history, scale, amax.reshape(()).float().contiguous(), _FMT_ID[fp8_dtype],
                        ref.margin_multiplier(margin), _ALGO_ID[amax_compute_algo], skip_zero)
        return
    ref.record_amax(amax_history, scale, amax, fp8_dtype, margin=margin, amax_compute_algo=amax_compute_algo,
                    skip_zero=skip_zero)


record_amax_op = torch.library.custom_op("torch_ops::record_amax", mutates_args=("amax_history", "scale"))(_record_amax)


@record_amax_op.register_fake
def _(amax_history, scale, amax, fp8_dtype, margin, amax_compute_algo, skip_zero):
    return None


# --------------------------------------------------------------------------- the gradient channel's fold
def _fold(pending: torch.Tensor, fold_state: torch.Tensor, history: torch.Tensor, scale: torch.Tensor,
            fp8_dtype: torch.dtype, margin: float, amax_compute_algo: str, window: int,
            update_scale: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = extension.kernels_for(pending)
    if ext is not None:
        return tuple(ext.fold_grad_amax(pending, fold_state, history, scale, ref.f32(1.0 / ref.fp8_max(fp8_dtype)),
                                        ref.margin_multiplier(margin), _ALGO_ID[amax_compute_algo], window,
                                        update_scale))
    with torch.no_grad():
        return ref.fold_pending_grad_amax(pending, fold_state, history, scale, fp8_dtype, margin=margin,
                                          amax_compute_algo=amax_compute_algo, window_len=window,
                                          update_scale=update_scale)


fold_op = torch.library.custom_op("torch_ops::fold_grad_amax", mutates_args=("fold_state", "history", "scale"))(_fold)


@fold_op.register_fake
def _(pending, fold_state, history, scale, fp8_dtype, margin, amax_compute_algo, window, update_scale):
    return pending.new_empty(()), pending.new_empty(()), history.new_empty(history.shape)


# --------------------------------------------------------------------------- FP8 GEMM
def _gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
            bias: Optional[torch.Tensor], out_dtype: torch.dtype, use_fast_accum: bool,
            autotune: bool) -> torch.Tensor:
    ext = extension.kernels_for(a)
    if ext is not None:
        return ext.gemm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, autotune)
    # Padded operands (pad=True layouts) carry zero bytes past K: harmless.
    return ref.fp8_gemm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)


gemm_op = torch.library.custom_op("torch_ops::gemm", mutates_args=())(_gemm)


@gemm_op.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, autotune):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


# --------------------------------------------------------------------------- block scaling
def _quantize_tiles(x: torch.Tensor, fp8_dtype: torch.dtype, transposed: bool, margin: float,
                    power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x 128 tiles of x's rows (q (R, C), scales (R, ceil(C/128))) or, with
    ``transposed``, of x^T's rows, i.e. of x's columns (q (C, R), scales (C,
    ceil(R/128))). The scales are a strided view (``_tile_scale_storage``)."""
    ext = extension.kernels_for(x)
    if ext is not None:
        return tuple(ext.quantize_tiles(x, _FMT_ID[fp8_dtype], transposed, ref.margin_multiplier(margin),
                                        power_of_two))
    q, scales = ref.quantize_tiles(x.t() if transposed else x, fp8_dtype, axis=1, margin=margin,
                                   power_of_two=power_of_two)
    out = _tile_scale_storage(scales.shape[0], scales.shape[1], x)
    out.copy_(scales)
    return q, out


def _tile_scale_storage(rows: int, tiles: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (rows, tiles) float32 tensor laid out as cuBLASLt's VEC128
    mode reads tile scales (csrc/block.cu writes them so): per tile, the rows
    side by side, rows padded to a multiple of 4."""
    ld = -(-rows // 4) * 4
    return like.new_empty((tiles, ld), dtype=torch.float32)[:, :rows].t()


quantize_tiles_op = torch.library.custom_op("torch_ops::quantize_tiles", mutates_args=())(_quantize_tiles)


@quantize_tiles_op.register_fake
def _(x, fp8_dtype, transposed, margin, power_of_two):
    r, c = (x.shape[1], x.shape[0]) if transposed else x.shape
    return x.new_empty((r, c), dtype=fp8_dtype), _tile_scale_storage(r, -(-c // ref.BLOCK), x)


def _quantize_blocks(w: torch.Tensor, fp8_dtype: torch.dtype, margin: float,
                     power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """128 x 128 blocks of w: (q, q_t, scales (ceil(R/128), ceil(C/128)))."""
    ext = extension.kernels_for(w)
    if ext is not None:
        return tuple(ext.quantize_blocks(w, _FMT_ID[fp8_dtype], ref.margin_multiplier(margin), power_of_two))
    q, scales = ref.quantize_blocks(w, fp8_dtype, margin=margin, power_of_two=power_of_two)
    return q, q.t().contiguous(), scales


quantize_blocks_op = torch.library.custom_op("torch_ops::quantize_blocks", mutates_args=())(_quantize_blocks)


@quantize_blocks_op.register_fake
def _(w, fp8_dtype, margin, power_of_two):
    r, c = w.shape
    return (w.new_empty((r, c), dtype=fp8_dtype), w.new_empty((c, r), dtype=fp8_dtype),
            w.new_empty((-(-r // ref.BLOCK), -(-c // ref.BLOCK)), dtype=torch.float32))


_BLOCK_GEMM_WARNED = set()


def _block_gemm(a: torch.Tensor, a_scales: torch.Tensor, b_t: torch.Tensor, b_scales: torch.Tensor, b_tiles: bool,
                bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b_t^T`` of block-scaled operands, ``a`` (M, K) in 1 x 128 tiles
    (``a_scales`` (M, ceil(K/128))), ``b_t`` (N, K) in 1 x 128 tiles
    (``b_tiles``: ``b_scales`` (N, ceil(K/128))) or 128 x 128 blocks
    (``b_scales`` (ceil(N/128), ceil(K/128))). cuBLASLt's block-scaled GEMM
    where the kernels serve the device and it has one for the combination
    (else a one-time warning, unless kernels are required, and the
    reference)."""
    ext = extension.kernels_for(a)
    if ext is not None:
        out = ext.block_gemm(a, a_scales, b_t, b_scales, b_tiles, bias, out_dtype)
        if out is not None:
            return out
        key = (a.dtype, b_t.dtype, b_tiles, out_dtype)
        if extension.kernels_required():
            raise RuntimeError(f"torch_ops: {extension.REQUIRE_VARIABLE}=1, but cuBLASLt has no block-scaled GEMM "
                               f"for a {a.dtype} x b {b_t.dtype} ({'tiles' if b_tiles else 'blocks'}) -> "
                               f"{out_dtype} at a {tuple(a.shape)}, b {tuple(b_t.shape)}")
        if key not in _BLOCK_GEMM_WARNED:
            _BLOCK_GEMM_WARNED.add(key)
            warnings.warn(f"torch_ops: cuBLASLt has no block-scaled GEMM for a {a.dtype} x b {b_t.dtype} "
                          f"({'tiles' if b_tiles else 'blocks'}) -> {out_dtype} on this GPU; the reference runs "
                          "(correct, slow).", stacklevel=2)
    return ref.block_gemm(a, a_scales, b_t.t(), b_scales.t(), b_tiles=b_tiles, bias=bias, out_dtype=out_dtype)


block_gemm_op = torch.library.custom_op("torch_ops::block_gemm", mutates_args=())(_block_gemm)


@block_gemm_op.register_fake
def _(a, a_scales, b_t, b_scales, b_tiles, bias, out_dtype):
    return a.new_empty((a.shape[0], b_t.shape[0]), dtype=out_dtype)


# --------------------------------------------------------------------------- fused producers
# A norm's last step or a gated activation, its output's FP8 copy (rows
# padded with ``pad``) and amax in one pass (reference: scaled_rows, gated,
# producer_quantize). ``amax_history`` given: ``scale`` is a linear's
# delayed-scaling state, seeded from the output's amax while the history is
# empty; both only read.
def _producer_layout(q, pad):
    return _pad_cols(q, _r16(q.shape[1])) if pad else q.contiguous()


def _scaled_rows_quantize(x: torch.Tensor, row_mul: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                          amax_history: Optional[torch.Tensor], scale: torch.Tensor, fp8_dtype: torch.dtype,
                          margin: float, pad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = row_mul.reshape(-1).to(torch.float32).contiguous()
    w = weight.reshape(-1).to(torch.float32).contiguous()
    ext = extension.kernels_for(x)
    if ext is not None:
        return tuple(ext.scaled_rows_quantize(x, rows, w, out_dtype, amax_history, scale, _FMT_ID[fp8_dtype],
                                              ref.margin_multiplier(margin), pad))
    y, q, scale_used, a = ref.rms_norm_quantize(x, rows, w, scale, fp8_dtype, out_dtype, amax_history=amax_history,
                                                margin=margin)
    return y, _producer_layout(q, pad), scale_used, a


scaled_rows_quantize_op = torch.library.custom_op("torch_ops::scaled_rows_quantize",
                                                  mutates_args=())(_scaled_rows_quantize)


def _fake_producer(x, out_dtype, fp8_dtype, pad):
    r, c = x.shape
    return (x.new_empty((r, c), dtype=out_dtype), x.new_empty((r, _r16(c) if pad else c), dtype=fp8_dtype),
            _scalar_out(x), _scalar_out(x))


@scaled_rows_quantize_op.register_fake
def _(x, row_mul, weight, out_dtype, amax_history, scale, fp8_dtype, margin, pad):
    return _fake_producer(x, out_dtype, fp8_dtype, pad)


def _gated_quantize(gate: torch.Tensor, up: Optional[torch.Tensor], activation: str,
                    amax_history: Optional[torch.Tensor], scale: torch.Tensor, fp8_dtype: torch.dtype, margin: float,
                    pad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = extension.kernels_for(gate)
    if ext is not None:
        return tuple(ext.gated_quantize(gate, up, ref.PRODUCER_ACTIVATION_IDS[activation], amax_history, scale,
                                        _FMT_ID[fp8_dtype], ref.margin_multiplier(margin), pad))
    y, q, scale_used, a = ref.glu_quantize(gate, up, activation, scale, fp8_dtype, gate.dtype,
                                           amax_history=amax_history, margin=margin)
    return y, _producer_layout(q, pad), scale_used, a


gated_quantize_op = torch.library.custom_op("torch_ops::gated_quantize", mutates_args=())(_gated_quantize)


@gated_quantize_op.register_fake
def _(gate, up, activation, amax_history, scale, fp8_dtype, margin, pad):
    return _fake_producer(gate, gate.dtype, fp8_dtype, pad)


# --------------------------------------------------------------------------- calls (direct where plain)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain(*ts) -> bool:
    """True outside torch.compile when every tensor is plain storage (a
    Tensor or Parameter, or None): then the implementations are called
    directly; any tensor subclass (fake, functional, DTensor) takes the op."""
    if torch.compiler.is_compiling():
        return False
    return all(t is None or type(t) in _PLAIN_TYPES for t in ts)


def quantize(x, scale, fp8_dtype, transpose, pad, write_q):
    if plain(x, scale):
        return _quantize(x, scale, fp8_dtype, transpose, pad, write_q)
    return torch.ops.torch_ops.quantize(x, scale, fp8_dtype, transpose, pad, write_q)


def quantize_delayed(x, amax_history, scale, fp8_dtype, margin, algo, transpose, record, pad, write_q):
    if plain(x, amax_history, scale):
        return _quantize_delayed(x, amax_history, scale, fp8_dtype, margin, algo, transpose, record, pad,
                                            write_q)
    return torch.ops.torch_ops.quantize_delayed(x, amax_history, scale, fp8_dtype, margin, algo, transpose, record,
                                                pad, write_q)


def quantize_current(x, prev_scale, fp8_dtype, margin, transpose, pad, write_q):
    if plain(x, prev_scale):
        return _quantize_current(x, prev_scale, fp8_dtype, margin, transpose, pad, write_q)
    return torch.ops.torch_ops.quantize_current(x, prev_scale, fp8_dtype, margin, transpose, pad, write_q)


def record_amax(amax_history, scale, amax, fp8_dtype, margin, algo, skip_zero):
    if plain(amax_history, scale, amax):
        return _record_amax(amax_history, scale, amax, fp8_dtype, margin, algo, skip_zero)
    return torch.ops.torch_ops.record_amax(amax_history, scale, amax, fp8_dtype, margin, algo, skip_zero)


def fold(pending, fold_state, history, scale, fp8_dtype, margin, algo, window, update_scale):
    if plain(pending, fold_state, history, scale):
        return _fold(pending, fold_state, history, scale, fp8_dtype, margin, algo, window, update_scale)
    return torch.ops.torch_ops.fold_grad_amax(pending, fold_state, history, scale, fp8_dtype, margin, algo, window,
                                              update_scale)


def gemm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, autotune):
    if plain(a, b, scale_a, scale_b, bias):
        return _gemm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, autotune)
    return torch.ops.torch_ops.gemm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, autotune)


def quantize_tiles(x, fp8_dtype, transposed, margin, power_of_two):
    if plain(x):
        return _quantize_tiles(x, fp8_dtype, transposed, margin, power_of_two)
    return torch.ops.torch_ops.quantize_tiles(x, fp8_dtype, transposed, margin, power_of_two)


def quantize_blocks(w, fp8_dtype, margin, power_of_two):
    if plain(w):
        return _quantize_blocks(w, fp8_dtype, margin, power_of_two)
    return torch.ops.torch_ops.quantize_blocks(w, fp8_dtype, margin, power_of_two)


def block_gemm(a, a_scales, b_t, b_scales, b_tiles, bias, out_dtype):
    if plain(a, a_scales, b_t, b_scales, bias):
        return _block_gemm(a, a_scales, b_t, b_scales, b_tiles, bias, out_dtype)
    return torch.ops.torch_ops.block_gemm(a, a_scales, b_t, b_scales, b_tiles, bias, out_dtype)


def scaled_rows_quantize(x, row_mul, weight, out_dtype, amax_history, scale, fp8_dtype, margin, pad):
    if plain(x, row_mul, weight, amax_history, scale):
        return _scaled_rows_quantize(x, row_mul, weight, out_dtype, amax_history, scale, fp8_dtype, margin, pad)
    return torch.ops.torch_ops.scaled_rows_quantize(x, row_mul, weight, out_dtype, amax_history, scale, fp8_dtype,
                                                    margin, pad)


def gated_quantize(gate, up, activation, amax_history, scale, fp8_dtype, margin, pad):
    if plain(gate, up, amax_history, scale):
        return _gated_quantize(gate, up, activation, amax_history, scale, fp8_dtype, margin, pad)
    return torch.ops.torch_ops.gated_quantize(gate, up, activation, amax_history, scale, fp8_dtype, margin, pad)
