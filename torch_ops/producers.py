"""Fused producers: the op before an FP8 linear quantizes its output for it.

A norm before the Q, K and V projections, or the gated activation before a
down projection, writes its output ``y`` in the compute dtype; the FP8 linear
that reads ``y`` then quantizes it (one more pass over ``y``, and one for its
amax). A fused producer writes ``y``, its FP8 copy and its amax in one pass
(``torch_ops::scaled_rows_quantize``, ``torch_ops::gated_quantize``) and
leaves the copy in the one-quantize-per-tensor cache (``torch_ops.sharing``),
where the linear takes it instead of quantizing (docs/numerics.md, "Fused
producers").

The copy must be the one the linear would make itself: its scale is the
linear's own. Under delayed scaling that scale is known before ``y`` exists
(the linear's state; seeded from ``y``'s amax while its history is empty,
which the kernels settle on the device). So a ``Producer`` is linked to the
linear that reads its output first: the first time a linear quantizes a
tensor a producer made, it links itself (``link``); from the next call on
the producer quantizes with that linear's state. The deposit is reserved for
that linear, and only while its scale and history are the tensors the
producer read, unchanged since (their version counters): any other reader
first, a state changed in between, and the linear quantizes ``y`` itself as
without fusion. Current and block scaling need ``y``'s values before the
scale, so they link nothing; neither does a linear under an amax reduction
group (its amax is the group's), nor one with ``fuse_producers=False`` or
``share_quantized_inputs=False``.

Fused or not, the result is the same bits: ``y`` is the producer's own math
rounded to its dtype (the ops compute it exactly as the unfused torch ops
do), the copy is the linear's quantize of that ``y``, and the gradients are
the unfused graph's, op for op. Eager code only: under torch.compile the
producers run unfused (as sharing, they decide by identities Dynamo does
not trace).

Example:

>>> producer = Producer()
>>> x32 = torch.randn(4, 64)
>>> inv = torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True) + 1e-6)
>>> y = scaled_rows(x32, inv, torch.ones(64), torch.bfloat16, producer)
>>> y.dtype
torch.bfloat16
"""

from __future__ import annotations

import weakref

import torch

from . import ops
from . import reference as ref
from . import sharing


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class Producer:
    """A fused producer's link to the FP8 linear that reads its output first
    (one per producing layer: a norm, a gated FFN's activation)."""

    __slots__ = ("_link", "__weakref__")

    def __init__(self):
        self._link = None

    @property
    def linked(self) -> bool:
        """Whether a live linear's delayed-scaling state is linked."""
        link = self._link
        return link is not None and link.alive()

    def unlink(self):
        """Forgets the linked linear: the next call runs unfused."""
        self._link = None


class _Link:
    __slots__ = ("history", "scale", "settings", "fp8_dtype", "margin")

    def __init__(self, history, scale, settings, fp8_dtype, margin):
        self.history = weakref.ref(history)
        self.scale = weakref.ref(scale)
        self.settings = settings
        self.fp8_dtype = fp8_dtype
        self.margin = margin

    def alive(self):
        return self.history() is not None and self.scale() is not None


def link(x, config, history, scale, settings, group) -> None:
    """Called by an FP8 linear that quantized ``x`` itself: where a producer
    made ``x``, it is linked to this linear's input state (or unlinked where
    this linear's copy cannot be made ahead: see the module docstring)."""
    producer = sharing.producer_of(x)
    if producer is None:
        return
    if (config.scaling != "delayed" or not config.fuse_producers or not config.share_quantized_inputs
            or group is not None):
        producer.unlink()
        return
    producer._link = _Link(history, scale, settings, config.forward_dtype, config.margin)


def _fusable(producer, *tensors):
    """The producer's live link where this call can run fused (eager, plain
    tensors), else None."""
    if producer is None or not ops.plain(*tensors):
        return None
    link = producer._link
    if link is None:
        return None
    history, scale = link.history(), link.scale()
    if history is None or scale is None:
        producer.unlink()
        return None
    return link, history, scale


def _deposit(y, q, scale_used, amax, link, history, scale, versions, transpose):
    """Leaves y's copy for the linked linear, under y and under its 2-D
    ``(-1, C)`` view (the two ways the FP8 layers pass their input); with
    ``transpose`` (the call records a graph: the linear's weight gradient
    reads x^T) also the transposed copy, laid out as the linear's quantize
    lays it out."""
    cols = y.shape[-1]
    qt = None
    if transpose:
        qt = ops.transposed_copy(q, cols)
    payload = (q, qt, scale_used, amax)
    for view in (y, y.view(-1, cols)) if y.dim() != 2 else (y,):
        sharing.deposit(view, link.settings, payload, history, scale, versions)


def note(y, producer):
    """Records that ``producer`` made ``y`` (computed unfused), so that the
    FP8 linear reading it can link itself; returns ``y``."""
    if producer is not None:
        sharing.note_produced(y, producer)
    return y


_note = note


# --------------------------------------------------------------------------- scaled rows (a norm's last step)
class _ScaledRowsFunction(torch.autograd.Function):
    """y = round((x * row_mul) * weight) with the copy deposited; its
    backward is the unfused ops' (two MulBackward nodes and the cast's),
    returned with the shapes autograd reduces the broadcasts from."""

    @staticmethod
    def forward(ctx, x, row_mul, weight, out_dtype, fused, transpose):
        link, history, scale = fused
        cols = x.shape[-1]
        x2d = x.detach().reshape(-1, cols).contiguous()
        versions = (history._version, scale._version)
        y2d, q, scale_used, amax = ops.scaled_rows_quantize(x2d, row_mul.detach(), weight.detach(), out_dtype,
                                                            history, scale, link.fp8_dtype, link.margin, True)
        # Only what the gradients asked for is kept (a cast's factors of one
        # take none: its input stays unsaved, as the cast's own backward).
        need_x, need_row, need_w = ctx.needs_input_grad[:3]
        ctx.save_for_backward(x if need_row or need_w else None, row_mul if need_x or need_w else None,
                              weight if need_x or need_row else None)
        y = y2d.view(x.shape)
        _deposit(y, q, scale_used, amax, link, history, scale, versions, transpose)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, row_mul, weight = ctx.saved_tensors
        need_x, need_row, need_w = ctx.needs_input_grad[:3]
        g_b = gy.to(torch.float32)
        g_a = g_b * weight if need_x or need_row else None
        return (g_a * row_mul if need_x else None, g_a * x if need_row else None,
                g_b * (x * row_mul) if need_w else None, None, None, None)


def scaled_rows(x, row_mul, weight, out_dtype, producer=None):
    """A norm's last step, ``((x * row_mul) * weight)`` in float32 rounded to
    ``out_dtype`` (``reference.scaled_rows``), fused with the linked linear's
    quantize where ``producer`` is linked.

    Args:
        x: ``(..., C)`` float32 (the norm's float32 input, as Keras's RMSNorms
            cast it), bfloat16 or float16 (read as float32).
        row_mul: ``(..., 1)`` float32 per-row factor (``rsqrt(var + eps)``),
            computed by the caller exactly as the norm does.
        weight: ``(C,)`` factor per column (the norm's scale, as the norm
            multiplies by it).
        out_dtype: The output's dtype (the compute dtype).
        producer: The layer's ``Producer``, or None (never fused).

    Returns:
        ``(..., C)`` in ``out_dtype``; differentiable in x, row_mul and weight.
    """
    fused = _fusable(producer, x, row_mul, weight)
    if (fused is None or x.dtype not in _FLOATS or row_mul.dtype != torch.float32 or x.dim() < 2
            or tuple(row_mul.shape) != (*x.shape[:-1], 1) or tuple(weight.shape) != (x.shape[-1],)
            or x.numel() == 0):
        return _note(((x * row_mul) * weight).to(out_dtype), producer)
    return _note(_ScaledRowsFunction.apply(x, row_mul, weight, out_dtype, fused, torch.is_grad_enabled()), producer)


def cast(x, out_dtype, producer=None):
    """``x`` rounded to ``out_dtype`` (a norm computed in float32, cast to
    the compute dtype after it: Keras's ``LayerNormalization`` on torch),
    fused with the linked linear's quantize where ``producer`` is linked.

    The fused op is ``scaled_rows`` with factors of one: ``(x * 1) * 1`` is
    ``x`` exactly, so ``y`` is the cast's bits and the gradient ``x``
    receives is the cast's (the incoming gradient in float32).

    Args:
        x: ``(..., C)`` float32.
        out_dtype: The output's dtype (the compute dtype).
        producer: The layer's ``Producer``, or None (never fused).

    Returns:
        ``x.to(out_dtype)``; differentiable in x.
    """
    fused = _fusable(producer, x)
    if fused is None or x.dtype != torch.float32 or x.dim() < 2 or x.numel() == 0 or out_dtype == x.dtype:
        return _note(x.to(out_dtype), producer)
    rows = torch.ones((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    cols = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
    return _note(_ScaledRowsFunction.apply(x, rows, cols, out_dtype, fused, torch.is_grad_enabled()), producer)


# --------------------------------------------------------------------------- gated activations
_ACT_BACKWARD = {
    "silu": lambda g, x: torch.ops.aten.silu_backward(g, x),
    "gelu_tanh": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    "gelu": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="none"),
}


class _GatedFunction(torch.autograd.Function):
    """y = round(up * round(act(gate))) with the copy deposited; its backward
    is the unfused ops' (the cast to float32, the activation's backward, the
    cast back, MulBackward)."""

    @staticmethod
    def forward(ctx, gate, up, activation, fused, transpose):
        link, history, scale = fused
        cols = gate.shape[-1]
        g2d = gate.detach().reshape(-1, cols).contiguous()
        u2d = None if up is None else up.detach().reshape(-1, cols).contiguous()
        versions = (history._version, scale._version)
        y2d, q, scale_used, amax = ops.gated_quantize(g2d, u2d, activation, history, scale, link.fp8_dtype,
                                                      link.margin, True)
        ctx.activation = activation
        ctx.has_up = up is not None
        ctx.save_for_backward(gate, up)
        y = y2d.view(gate.shape)
        _deposit(y, q, scale_used, amax, link, history, scale, versions, transpose)
        return y

    @staticmethod
    def backward(ctx, gy):
        gate, up = ctx.saved_tensors
        act = ctx.activation
        g32 = gate.to(torch.float32)
        if act == "identity":
            a, g_a = gate, gy
        else:
            a = ref.producer_activation(g32, act).to(gate.dtype)
            g_a = gy
        g_up = None
        if ctx.has_up:
            g_up = gy * a
            g_a = gy * up
        if act != "identity":
            g_a = _ACT_BACKWARD[act](g_a.to(torch.float32), g32).to(gate.dtype)
        return g_a, g_up, None, None, None


def gated(gate, up, activation="silu", producer=None):
    """``round(act(gate)) * up`` in ``gate``'s dtype (``reference.gated``:
    SwiGLU with ``"silu"``, GeGLU with ``"gelu_tanh"``; ``up=None``: the
    activation alone; ``"identity"``: the gate comes activated), fused with
    the linked linear's quantize where ``producer`` is linked.

    Args:
        gate: ``(..., C)`` bfloat16, float16 or float32.
        up: None, or a tensor of gate's shape and dtype.
        activation: One of ``reference.PRODUCER_ACTIVATIONS``.
        producer: The layer's ``Producer``, or None (never fused).

    Returns:
        ``(..., C)`` in gate's dtype; differentiable in gate and up.
    """
    if activation not in ref.PRODUCER_ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ref.PRODUCER_ACTIVATIONS}, got {activation!r}")
    fused = _fusable(producer, gate, up)
    if (fused is None or gate.dim() < 1 or gate.numel() == 0 or gate.dtype not in _FLOATS
            or (up is not None and (up.shape != gate.shape or up.dtype != gate.dtype))):
        a = gate if activation == "identity" else ref.producer_activation(gate.to(torch.float32),
                                                                          activation).to(gate.dtype)
        return _note(a if up is None else up * a, producer)
    return _note(_GatedFunction.apply(gate, up, activation, fused, torch.is_grad_enabled()), producer)
