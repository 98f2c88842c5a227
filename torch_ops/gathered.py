"""A weight FSDP2 gathered in FP8 (``torch_ops.fsdp``): its bytes and scale,
which ``fp8_linear`` takes as its GEMM operand (a leaf: ``linear`` and
``fsdp`` both import it).
"""

from __future__ import annotations

import warnings

import torch
import torch.utils._pytree as pytree

from . import ops

_aten = torch.ops.aten


def wrapper_subclass(cls, t, dtype=None, shape=None, requires_grad=None):
    return torch.Tensor._make_wrapper_subclass(
        cls, t.shape if shape is None else shape, strides=None if shape is not None else t.stride(),
        storage_offset=0 if shape is not None else t.storage_offset(), dtype=t.dtype if dtype is None else dtype,
        layout=t.layout, device=t.device, requires_grad=t.requires_grad if requires_grad is None else requires_grad)


def in_backward() -> bool:
    """True inside a backward pass (FSDP2's re-gather, a recomputed forward)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


_warned_dequantized = []


class FP8GatheredWeight(torch.Tensor):
    """A gathered FP8 weight: E4M3 bytes (``_data``) and the scale they were
    quantized with (``_scale``), reporting the parameter's shape and dtype.

    ``fp8_linear`` takes its bytes as the GEMM operand. Any other use (a call
    below ``min_gemm_size``, another module reading the weight) gets the
    dequantized values, with a one-time warning.
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return wrapper_subclass(cls, data, dtype=dtype, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self._data = data
        self._scale = scale

    def __repr__(self):
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, scale={self._scale!r})"

    def dequantized(self) -> torch.Tensor:
        """``q * scale`` in the reported dtype."""
        return (self._data.to(torch.float32) * self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default):
            w = args[0]
            return cls(w._data, w._scale, w.dtype)
        if func is _aten.as_strided.default:  # FSDP2 narrows the gathered rows to the weight's shape
            w = args[0]
            return cls(func(w._data, *args[1:], **kwargs), w._scale, w.dtype)
        if not _warned_dequantized:
            _warned_dequantized.append(True)
            warnings.warn(f"A weight gathered in FP8 ({func}) is used outside fp8_linear: the op gets its "
                          "dequantized values.", stacklevel=2)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantized(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, dtype, outer_size, outer_stride):
        return FP8GatheredWeight(inner_tensors["_data"], inner_tensors["_scale"], dtype)


def fp8_operands(weight, in_out: bool, need_dx: bool):
    """For a weight gathered in FP8: ``(qw_fwd, qw_bwd, scale)``, the GEMM
    operands ``linear`` otherwise quantizes (``qw_bwd`` empty unless
    ``need_dx``) and a copy of their scale; None for any other weight. The
    operand kept for the backward never aliases FSDP2's all-gather buffer
    (FSDP2 frees it after the forward)."""
    if type(weight) is not FP8GatheredWeight:
        return None
    q, qt = ops.fp8_layouts(weight._data, in_out or need_dx, (not in_out) or need_dx)
    if in_out:
        return qt, (q.clone() if need_dx and q.data_ptr() == weight._data.data_ptr() else q), weight._scale.clone()
    return q, qt, weight._scale.clone()
