"""fp8_linear: an FP8 linear layer's forward and backward with its scaling state.

Forward: quantize x and the weight (E4M3) with their delayed (or current)
scales, one cuBLASLt FP8 GEMM with the bias fused. Backward: quantize the
output gradient once (E5M2 for "hybrid", E4M3 for "e4m3") with its
transpose, for both the dX and the dW GEMM. Every GEMM dequantizes with
exactly the scale its operand was quantized with (the ``scale_used`` the
quantize returned), even though the same quantize publishes the next scale
into the state. The settings travel as one ``LinearConfig``.

A call is checked once (``check_call``), then takes one of three routes,
chosen once (``_route``):

- the compute dtype: below ``min_gemm_size`` (and for empty inputs) exactly
  what the compute-dtype layer runs, ``F.linear`` in x's dtype, leaving the
  FP8 state untouched (the next FP8 call continues from the state the last
  one left);
- the eager C++ entry, on plain CUDA tensors the kernels serve: one C++ call
  (``csrc/linear.cpp``), whose autograd node runs its backward without
  Python;
- everything else (torch.compile, CUDA-graph capture of traced code, tensor
  subclasses, CPU, block scaling, an amax reduction group): the
  ``torch.library`` ops of ``torch_ops.ops`` under the autograd Functions
  below. Off the kernels those ops run the reference.

Both FP8 routes run one algorithm (docs/design.md).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import distributed
from . import extension
from . import gathered
from . import ops
from . import producers
from . import reference as ref
from . import settings as settings_lib
from . import sharing
from .config import DEFAULT_CONFIG
from .config import LinearConfig

E4M3 = ref.E4M3
MAX_HISTORY_LEN = ref.MAX_HISTORY_LEN
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass
class FP8LinearState:
    """Scaling state of one FP8 linear layer: six float32 tensors, updated in
    place, and optionally a gradient channel.

    ``*_scale`` are 0-d dequantization steps (``x ~= q * scale``);
    ``*_amax_history`` are ``(H,)`` with ``[0]`` the newest amax.

    With a gradient channel (the Keras layers' state), the output gradient's
    amax leaves through it instead of being recorded by the backward:
    ``grad_amax_pending`` is ``(3,)`` float32 ``[amax, token, loss_scale]``
    (read only; where it requires a gradient, the backward returns ``[amax of
    the output gradient (0 where not finite), token, 0]`` as its gradient,
    token 0 when not training), ``grad_fold_state`` ``(3,)`` float32
    ``[folds, last_token, last_loss_scale]``. A training call first folds the
    pending amax into the gradient state (``fold_pending_grad_amax``) and
    runs on the fold's copies of the gradient scale and history; its bias is
    added in x's dtype and its gradient rounded to x's dtype (as if cast with
    ``bias.to(x.dtype)``).

    Example:

    >>> state = FP8LinearState.create(history_len=16)
    >>> state.input_amax_history.shape
    torch.Size([16])
    """

    input_scale: torch.Tensor
    input_amax_history: torch.Tensor
    kernel_scale: torch.Tensor
    kernel_amax_history: torch.Tensor
    grad_scale: torch.Tensor
    grad_amax_history: torch.Tensor
    grad_amax_pending: torch.Tensor | None = None
    grad_fold_state: torch.Tensor | None = None

    @classmethod
    def create(cls, history_len: int = 1024, device=None, gradient_channel: bool = False) -> "FP8LinearState":
        """Fresh state: scales 1, empty histories of ``history_len`` entries
        (and, with ``gradient_channel``, a zero channel)."""
        check_history_len(history_len)

        def scale():
            return torch.ones((), dtype=torch.float32, device=device)

        def history():
            return torch.zeros((history_len,), dtype=torch.float32, device=device)

        channel = ()
        if gradient_channel:
            channel = (torch.zeros(3, dtype=torch.float32, device=device),
                       torch.zeros(3, dtype=torch.float32, device=device))
        return cls(scale(), history(), scale(), history(), scale(), history(), *channel)

    def tensors(self):
        """The six scaling tensors in field order (not the gradient channel)."""
        return (self.input_scale, self.input_amax_history, self.kernel_scale, self.kernel_amax_history,
                self.grad_scale, self.grad_amax_history)

    @property
    def has_gradient_channel(self) -> bool:
        """Whether the output gradient's amax leaves through ``grad_amax_pending``."""
        return self.grad_amax_pending is not None


# The six scaling tensors' names, in field order.
STATE_NAMES = tuple(f.name for f in dataclasses.fields(FP8LinearState))[:6]


def check_history_len(history_len):
    """Raises naming ``history_len`` unless it is an integer in [1, MAX_HISTORY_LEN]."""
    if isinstance(history_len, bool) or not isinstance(history_len, int) or not 1 <= history_len <= MAX_HISTORY_LEN:
        raise ValueError(f"history_len: expected an integer from 1 to {MAX_HISTORY_LEN}, got {history_len!r}")


def check_state(state, device):
    """Raises naming the field of ``state`` that is not a float32 tensor of
    its shape on ``device``: scales one element of rank <= 1, histories
    contiguous, non-empty and 1-D, a gradient channel two contiguous (3,)
    tensors."""
    if not isinstance(state, FP8LinearState):
        raise TypeError(f"state: expected an FP8LinearState, got {type(state).__name__}")
    for i, (name, t) in enumerate(zip(STATE_NAMES, state.tensors())):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"state.{name}: expected a float32 tensor on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} on {getattr(t, 'device', '?')}")
        if i % 2 == 0 and (t.dim() > 1 or t.numel() != 1):
            raise ValueError(f"state.{name}: expected a scale of shape () or (1,), got {tuple(t.shape)}")
        if i % 2 == 1 and (t.dim() != 1 or t.numel() < 1 or not t.is_contiguous()):
            raise ValueError(f"state.{name}: expected a contiguous, non-empty 1-D history (H,), got "
                             f"{tuple(t.shape)}")
    pending, fold_state = state.grad_amax_pending, state.grad_fold_state
    if pending is None and fold_state is None:
        return
    for name, t in (("grad_amax_pending", pending), ("grad_fold_state", fold_state)):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (3,)
                or t.device != device or not t.is_contiguous()):
            raise ValueError(f"state.{name}: expected a contiguous float32 tensor of shape (3,) on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} on "
                             f"{getattr(t, 'device', '?')}")


def check_call(x, weight, bias, state, config) -> int:
    """The checks of an ``fp8_linear`` call (every route): raises naming the
    argument, what was expected and what was given. Returns N."""
    if type(config) is not LinearConfig:
        raise TypeError(f"config: expected a torch_ops.LinearConfig, got {type(config).__name__}")
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x: expected a tensor of rank >= 2, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x: expected bfloat16, float16 or float32, got {x.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D tensor, got shape {tuple(weight.shape)}")
    if weight.dtype not in _FLOATS:
        raise TypeError(f"weight: expected bfloat16, float16 or float32, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight: expected device {x.device}, got {weight.device}")
    in_out = config.weight_layout == "in_out"
    k_w = weight.shape[0] if in_out else weight.shape[1]
    if k_w != x.shape[-1]:
        raise ValueError(f"weight: shape {tuple(weight.shape)} with weight_layout={config.weight_layout!r} does not "
                         f"match x's last dimension {x.shape[-1]}")
    n = weight.shape[1] if in_out else weight.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != n
                             or bias.device != x.device):
        raise ValueError(f"bias: expected shape ({n},) on {x.device}, got {tuple(getattr(bias, 'shape', ()))} "
                         f"on {getattr(bias, 'device', type(bias).__name__)}")
    check_state(state, x.device)
    return n


# --------------------------------------------------------------------------- the route of a call
COMPUTE_DTYPE = "compute dtype"
EAGER_ENTRY = "eager C++ entry"
OPS = "torch.library ops"


def _route(x, weight, bias, state, config, training, n):
    """(route, extension) of a checked call, decided once."""
    ext = extension.kernels_for(x)
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    group = distributed.reduction_group() if training else None
    if m == 0 or k == 0:
        # An empty local batch of a training call still takes part in the
        # amax reductions of its process group (contributing zero), so that
        # every process makes the same collectives.
        if k == 0 or group is None:
            return COMPUTE_DTYPE, ext
    else:
        limit = config.min_gemm_size
        if limit is None:
            limit = settings_lib.get_settings().resolved_min_gemm_size(ext is not None)
        if m * n * k < limit:
            return COMPUTE_DTYPE, ext
    # The C++ entry: plain CUDA tensors (ops.plain: outside torch.compile, no
    # subclass), per-tensor scaling, no amax reduction (it has no collective).
    if (ext is not None and config.scaling != "block" and group is None
            and not config.requantize_weight_in_backward and ops.plain(x, weight, bias, *state.tensors(), state.grad_amax_pending, state.grad_fold_state)):
        return EAGER_ENTRY, ext
    return OPS, ext


def compute_dtype_linear(x, weight, bias, weight_layout):
    """What ``nn.Linear`` computes in x's dtype (the weight and bias cast to it)."""
    w = weight.t() if weight_layout == "in_out" else weight
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, w, bias)


def _recomputing() -> bool:
    """True inside a backward pass, where activation checkpointing
    (``torch.utils.checkpoint``) recomputes forwards: such a forward must not
    record its amaxes a second time (it quantizes with the state's scales).
    Under torch.compile the partitioner never recomputes a mutating op."""
    return gathered.in_backward()


# config -> (config, the extension's LinearOptions): built once per config.
_NATIVE_OPTIONS: dict = {}


def native_options(ext, config: LinearConfig):
    """``config`` as the C++ entry's ``LinearOptions`` struct (built once per
    config object)."""
    entry = _NATIVE_OPTIONS.get(id(config))
    if entry is not None and entry[0] is config:
        return entry[1]
    options = ext.LinearOptions()
    options.grad_dtype = config.grad_dtype
    options.current_scaling = config.scaling == "current"
    options.margin_multiplier = ref.margin_multiplier(config.margin)
    options.amax_algorithm = ref.AMAX_COMPUTE_ALGO_IDS[config.amax_compute_algo]
    options.fold_window = 0 if config.fold_window is None else config.fold_window
    options.in_out = config.in_out
    options.fast_accum_forward = config.fast_accum_forward
    options.fast_accum_dgrad = config.fast_accum_dgrad
    options.fast_accum_wgrad = config.fast_accum_wgrad
    if len(_NATIVE_OPTIONS) >= 256:  # configs made per call: keep the table small
        _NATIVE_OPTIONS.clear()
    _NATIVE_OPTIONS[id(config)] = (config, options)
    return options


# --------------------------------------------------------------------------- public
def linear_call(x, weight, bias, state, config, training):
    """``fp8_linear``, returning ``(y, route)``: the route the call took
    (``COMPUTE_DTYPE``, ``EAGER_ENTRY`` or ``OPS``)."""
    n = check_call(x, weight, bias, state, config)
    route, ext = _route(x, weight, bias, state, config, training, n)
    if route is COMPUTE_DTYPE:
        return compute_dtype_linear(x, weight, bias, config.weight_layout), route
    if route is EAGER_ENTRY:
        # x quantized by an earlier linear (its FP8 copy, scale used, amax),
        # or, where sharing applies, this call's own copy to leave for the next.
        settings = shared = None
        if config.share_quantized_inputs:
            history = state.input_amax_history
            settings = _share_settings(config, history, None)
            shared = sharing.lookup(x, settings, history, torch.is_grad_enabled() and weight.requires_grad,
                                    state.input_scale)
        out = ext.linear(x, weight, bias, list(state.tensors()), state.grad_amax_pending, state.grad_fold_state,
                         native_options(ext, config), bool(training), not _recomputing(),
                         settings_lib.get_settings().gemm_autotune, [] if shared is None else list(shared),
                         settings is not None and shared is None)
        if settings is not None and shared is None:
            sharing.store(x, settings, state.input_amax_history, tuple(out[1:]))
            producers.link(x, config, state.input_amax_history, state.input_scale, settings, None)
        return out[0], route
    if state.has_gradient_channel:
        return _folded_linear(x, weight, bias, state, config, training), route
    if config.scaling == "block":
        return _block_fp8_linear(x, weight, bias, config, None), route
    return _python_fp8_linear(x, weight, bias, state, config, training, None), route


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state: FP8LinearState | None = None,
    config: LinearConfig = DEFAULT_CONFIG,
    training: bool = True,
) -> torch.Tensor:
    """FP8 linear: ``x @ W^T + bias`` with FP8 GEMMs and in-place scaling state.

    Args:
        x: ``(..., K)`` bfloat16, float16 or float32; the output has x's dtype.
        weight: ``(N, K)`` for ``config.weight_layout="out_in"``
            (``nn.Linear``), ``(K, N)`` for ``"in_out"`` (a Keras kernel).
        bias: Optional ``(N,)``.
        state: The layer's ``FP8LinearState``, updated in place when
            training (with a gradient channel: see ``FP8LinearState``).
        config: A ``LinearConfig``: formats, scaling, margin, accumulation,
            weight layout, ``min_gemm_size``.
        training: False quantizes with the state's scales (seeded from the
            tensor while its history is empty) and records nothing.

    Returns:
        ``(..., N)`` in x's dtype.

    Example:

    >>> state = torch_ops.FP8LinearState.create(history_len=16)
    >>> y = torch_ops.fp8_linear(torch.randn(8, 32), torch.randn(64, 32), None, state)
    >>> y.shape
    torch.Size([8, 64])
    """
    return linear_call(x, weight, bias, state, config, training)[0]


def fold_pending_grad_amax(pending, fold_state, amax_history, scale, fp8_dtype, *, margin=0.0,
                           amax_compute_algo="max", window=None, update_scale=True):
    """Folds a pending output-gradient amax into the gradient state, in place.

    The reference is ``torch_ops.reference.fold_pending_grad_amax``; this runs
    it as one CUDA launch where the kernels serve the device.

    Args:
        pending: ``(3,)`` float32 ``[amax, token, loss_scale]`` (read only).
        fold_state: ``(3,)`` float32 ``[folds, last_token, last_loss_scale]``.
        amax_history: ``(H,)`` float32 gradient amax history (newest first).
        scale: One-element float32 gradient scale.
        fp8_dtype: The gradient's FP8 dtype.
        margin, amax_compute_algo: As for ``LinearConfig``.
        window: How many of the newest entries ``"max"`` reduces (default: all).
        update_scale: False leaves the scale alone but for a loss-scale rescale
            (current scaling).

    Returns:
        ``(token, scale, history)``: the 0-d token this call's backward emits,
        and copies of the new scale and history.

    Example:

    >>> pending, fold_state = torch.tensor([3.0, 1.0, 0.0]), torch.zeros(3)
    >>> history, scale = torch.zeros(16), torch.ones(())
    >>> token, _, _ = torch_ops.fold_pending_grad_amax(
    ...     pending, fold_state, history, scale, torch.float8_e5m2)
    >>> float(history[0]), float(token)
    (3.0, 2.0)
    """
    if amax_compute_algo not in ref.AMAX_COMPUTE_ALGOS:
        raise ValueError(f"amax_compute_algo: expected one of {ref.AMAX_COMPUTE_ALGOS}, got {amax_compute_algo!r}")
    for name, t in (("pending", pending), ("fold_state", fold_state)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (3,):
            raise ValueError(f"{name}: expected a float32 tensor of shape (3,), got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if (not isinstance(amax_history, torch.Tensor) or amax_history.dim() != 1 or amax_history.dtype != torch.float32
            or amax_history.numel() < 1):
        raise ValueError("amax_history: expected a non-empty 1-D float32 tensor, got "
                         f"{getattr(amax_history, 'dtype', type(amax_history).__name__)} "
                         f"{tuple(getattr(amax_history, 'shape', ()))}")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"scale: expected one float32 element, got {getattr(scale, 'dtype', type(scale).__name__)} "
                         f"{tuple(getattr(scale, 'shape', ()))}")
    window = amax_history.numel() if window is None else int(window)
    if window < 1:
        raise ValueError(f"window: expected >= 1, got {window}")
    ref.fp8_max(fp8_dtype)
    return ops.fold(pending.detach(), fold_state, amax_history, scale, fp8_dtype, ref.check_margin(margin),
                    amax_compute_algo, window, bool(update_scale))


# --------------------------------------------------------------------------- one quantize per tensor
def _share_settings(config, history, group):
    """What a per-tensor-scaled FP8 copy of x depends on besides x: the
    sharing key (``torch_ops.sharing``) of a linear's input."""
    return ("per_tensor", config.scaling, config.forward_dtype, config.margin, config.amax_compute_algo,
            history.numel(), None if group is None else id(group))


def _record_shared(config, history, scale, amax, scale_used):
    """Records the amax of a copy another linear made in this linear's state,
    as its own quantize would have: delayed scaling records it and moves the
    scale to the window (the fallback where the window is unusable is the
    state's scale, which is what its own call would have used then); current
    scaling stores the scale the copy was made with, or keeps its own where
    the amax defines none."""
    if config.scaling == "delayed":
        ops.record_amax(history, scale, amax, config.forward_dtype, config.margin, config.amax_compute_algo, False)
        return
    usable = torch.isfinite(amax) & (amax > 0)
    scale.copy_(torch.where(usable, scale_used.reshape(()), scale.reshape(())).reshape(scale.shape))


def _quantize_input(config, x, x2d, state, transpose, record, training):
    """x's ``(q, q_t, scale_used, amax)``: taken from the linear that
    quantized the same tensor with the same settings before (its amax then
    recorded here, when ``record``), else made here and left for the next."""
    history, scale = state.input_amax_history, state.input_scale
    settings = None
    if config.share_quantized_inputs:
        group = distributed.reduction_group() if training else None
        settings = _share_settings(config, history, group)
        shared = sharing.lookup(x, settings, history, transpose, scale)
        if shared is not None:
            if record:
                _record_shared(config, history, scale, shared[3], shared[2])
            return shared
    q, qt, scale_used, amax = _quantize(config, x2d.detach(), history, scale, config.forward_dtype, transpose, record,
                                        True, reduce=training)
    out = (q, qt if transpose else None, scale_used, amax)
    if settings is not None:
        sharing.store(x, settings, history, out)
        producers.link(x, config, history, scale, settings, group)
    return out


def _quantize_input_tiles(config, x, x2d, transpose):
    """x's block-scaled copies ``(q, q_t, scales, scales_t)``: 1 x 128 tiles
    along K, and (``transpose``) x^T in tiles along M (else None, None).
    They depend on x alone: taken from an earlier linear where it made them
    with the same settings, else made here and left for the next."""
    settings = None
    if config.share_quantized_inputs:
        settings = ("block", config.forward_dtype, config.margin, config.power_of_two)
        shared = sharing.lookup(x, settings, None, transpose)
        if shared is not None:
            return shared
    dt, margin, pow2 = config.forward_dtype, config.margin, config.power_of_two
    xd = x2d.detach()
    qx, sx = ops.quantize_tiles(xd, dt, False, margin, pow2)
    qxt, sxt = ops.quantize_tiles(xd, dt, True, margin, pow2) if transpose else (None, None)
    out = (qx, qxt, sx, sxt)
    if settings is not None:
        sharing.store(x, settings, None, out)
    return out


# --------------------------------------------------------------------------- the ops route
def _quantize(config, x, history, scale, dt, transpose, record, write_q, reduce=False):
    """(q, q_t, scale_used, amax) in the GEMM-ready layouts. Training calls
    under current scaling store the scale they used in ``scale``. With
    ``reduce`` (an input or output gradient of a training call: never a
    weight, which is the same on every process, nor an evaluation call,
    which may run on one process alone) and an amax reduction group in
    effect, the amax is the group's max (``distributed.quantize_global``)."""
    group = distributed.reduction_group() if reduce else None
    scaling, margin, algo = config.scaling, config.margin, config.amax_compute_algo
    if group is not None:
        return distributed.quantize_global(scaling, x, history, scale, dt, margin, algo, transpose, record, write_q,
                                           group)
    if scaling == "delayed":
        return ops.quantize_delayed(x, history, scale, dt, margin, algo, transpose, record, True, write_q)
    out = ops.quantize_current(x, scale, dt, margin, transpose, True, write_q)
    if record:
        scale.copy_(out[2].reshape(scale.shape))
    return out


class _FP8LinearFunction(torch.autograd.Function):
    """The GEMMs and the backward of the ops route. Inputs after the
    differentiable ones (x, weight, bias, sink) are the quantized operands,
    the gradient state, the config and the call's flags; the sink (optional,
    0-d) receives the output gradient's amax instead of the gradient state
    recording it."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, sink, qx, qw_fwd, sx, sw, qxt, qw_bwd, grad_history, grad_scale, config,
                record_grad, training, autotune):
        ctx.config = config
        ctx.record_grad = record_grad
        ctx.training = training
        ctx.autotune = autotune
        ctx.has_bias = bias is not None
        ctx.has_sink = sink is not None
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        # Without qw_bwd (requantize_weight_in_backward) the weight itself is
        # kept (a parameter: alive anyway) and quantized again for dX.
        ctx.save_for_backward(qxt, qw_bwd, sx, sw, weight if qw_bwd is None else None)
        # The gradient state is state, updated in place by the backward: kept
        # without saved-tensor version checks, so that a second backward
        # through this node (retain_graph) finds it.
        ctx.grad_state = (grad_history, grad_scale)
        ctx.recorded = False
        # The bias is added in x's dtype (the GEMM's epilogue takes it so).
        return ops.gemm(qx, qw_fwd, sx, sw, None if bias is None else bias.to(x2d.dtype), x2d.dtype,
                        config.fast_accum_forward, autotune)

    @staticmethod
    def backward(ctx, g):
        config, autotune = ctx.config, ctx.autotune
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        qxt, qw_bwd, sx, sw, weight = ctx.saved_tensors
        grad_history, grad_scale = ctx.grad_state
        # One record per forward: a second backward through the same graph
        # (retain_graph, two losses) quantizes with the state's scale.
        record = ctx.record_grad and config.scaling == "delayed" and not ctx.recorded
        ctx.recorded = True
        g2d = g.contiguous()
        qg, qgt, sg, ga = _quantize(config, g2d, grad_history, grad_scale, config.grad_dtype, need_dw, record,
                                    need_dx, reduce=ctx.training)
        dx = dw = db = dsink = None
        if need_dx:
            if qw_bwd is None:
                qw_bwd = _requantize_weight(config, weight, sw)
            dx = ops.gemm(qg, qw_bwd, sg, sw, None, x_dtype, config.fast_accum_dgrad, autotune)
        del qg  # the weight gradient's GEMM runs without the row-major copy (peak memory)
        if need_dw:
            fast = config.fast_accum_wgrad
            dw = (ops.gemm(qxt, qgt, sx, sg, None, w_dtype, fast, autotune) if config.in_out
                  else ops.gemm(qgt, qxt, sg, sx, None, w_dtype, fast, autotune))
        if ctx.has_bias and need_db:
            db = g2d.sum(0, dtype=torch.float32).to(b_dtype)
        if ctx.has_sink:
            dsink = torch.where(torch.isfinite(ga), ga, torch.zeros_like(ga))
        return (dx, dw, db, dsink) + (None,) * 12


def _requantize_weight(config, weight, scale_used):
    """The weight's FP8 copy in dX's layout, quantized with the scale the
    forward used: the bytes the forward would have kept (no amax recorded)."""
    wd = weight.detach()
    if not wd.is_contiguous():
        wd = wd.contiguous()
    in_out = config.in_out  # (K, N): dX reads it as stored; (N, K): transposed
    q, qt, _ = ops.quantize(wd, scale_used, config.forward_dtype, not in_out, True, in_out)
    return q if in_out else qt


def _as_2d(x, weight, in_out):
    """(N, x as a contiguous (M, K) matrix)."""
    x2d = x.reshape(-1, x.shape[-1])
    return weight.shape[1] if in_out else weight.shape[0], x2d if x2d.is_contiguous() else x2d.contiguous()


def _python_fp8_linear(x, weight, bias, state, config, training, sink):
    """The per-tensor-scaled FP8 linear of the ops route (the call checked)."""
    in_out = config.in_out
    n, x2d = _as_2d(x, weight, in_out)
    grad_on = torch.is_grad_enabled()
    need_dx = grad_on and x.requires_grad
    need_dw = grad_on and weight.requires_grad
    fwd_dt = config.forward_dtype
    record = bool(training) and not _recomputing()
    s = state
    qx, qxt, sx, _ = _quantize_input(config, x, x2d, s, need_dw, record, bool(training))
    # A weight FSDP2 gathered in FP8 comes quantized (its state recorded at the gather).
    fp8_weight = gathered.fp8_operands(weight, in_out, need_dx)
    if fp8_weight is not None:
        qw_fwd, qw_bwd, sw = fp8_weight
    else:
        wd = weight.detach()
        if not wd.is_contiguous():
            wd = wd.contiguous()
        # The forward wants the weight as (N, K), dX as (K, N); out_in stores (N, K).
        # With requantize_weight_in_backward only the forward's layout now.
        keep = need_dx and not config.requantize_weight_in_backward
        qw, qwt, sw, _ = _quantize(config, wd, s.kernel_amax_history, s.kernel_scale, fwd_dt, in_out or keep,
                                   record, (not in_out) or keep)
        qw_fwd, qw_bwd = (qwt, qw) if in_out else (qw, qwt)
        if not keep:
            qw_bwd = None
    autotune = settings_lib.get_settings().gemm_autotune
    needs_graph = grad_on and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
                               or sink is not None)
    if needs_graph:
        out = _FP8LinearFunction.apply(x2d, weight, bias, sink, qx, qw_fwd, sx, sw, qxt, qw_bwd,
                                       s.grad_amax_history, s.grad_scale, config, bool(training) and sink is None,
                                       bool(training), autotune)
    else:
        out = ops.gemm(qx, qw_fwd, sx, sw, None if bias is None else bias.detach().to(x2d.dtype), x2d.dtype,
                       config.fast_accum_forward, autotune)
    return out.reshape(*x.shape[:-1], n)


# --------------------------------------------------------------------------- the gradient channel
class _EmitToken(torch.autograd.Function):
    """Identity on ``y`` whose backward adds ``[0, token, 0]`` to ``pending``'s
    gradient (the FP8 linear returns the amax as the gradient of ``pending[0]``)."""

    @staticmethod
    def forward(ctx, y, pending, token):
        ctx.save_for_backward(token)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        zero = torch.zeros_like(token)
        return grad, torch.stack([zero, token, zero]), None


def _folded_linear(x, weight, bias, state, config, training):
    """The ops route of a state with a gradient channel (see FP8LinearState)."""
    pending, fold_state = state.grad_amax_pending, state.grad_fold_state
    s = state
    token = None
    if training:
        window = s.grad_amax_history.numel() if config.fold_window is None else config.fold_window
        token, grad_scale, grad_history = ops.fold(
            pending.detach(), fold_state, s.grad_amax_history, s.grad_scale, config.grad_dtype, config.margin,
            config.amax_compute_algo, window, config.scaling == "delayed")
        s = dataclasses.replace(s, grad_scale=grad_scale, grad_amax_history=grad_history)
    sink = pending.requires_grad and torch.is_grad_enabled()
    bias_x = None if bias is None else bias.to(x.dtype)
    if config.scaling == "block":
        y = _block_fp8_linear(x, weight, bias_x, config, pending[0] if sink else None)
    else:
        y = _python_fp8_linear(x, weight, bias_x, s, config, training, pending[0] if sink else None)
    if not sink:
        return y
    if token is None:
        token = torch.zeros((), dtype=torch.float32, device=x.device)
    return _EmitToken.apply(y, pending, token)


# --------------------------------------------------------------------------- block scaling
class _BlockLinearFunction(torch.autograd.Function):
    """Block-scaled FP8 linear (scaling="block", docs/design.md "Block
    scaling"): x and the output gradient in 1 x 128 tiles along the
    contraction of each GEMM, the weight in 128 x 128 blocks, every scale from
    its tile's own values (no state). The weight's two orientations come from
    one quantize (its bytes and their transpose, one set of block scales);
    x comes quantized (``_quantize_input_tiles``: 1 x 128 tiles along K, and
    along M for dW)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, sink, config, need_dx, need_dw, qx, sx, qxt, sxt):
        fwd_dt, margin, pow2 = config.forward_dtype, config.margin, config.power_of_two
        ctx.config = config
        ctx.has_bias = bias is not None
        ctx.has_sink = sink is not None
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        qw, qwt, sw = ops.quantize_blocks(weight.detach(), fwd_dt, margin, pow2)
        # The forward's b is the weight as (N, K); dX's as (K, N).
        if config.in_out:  # weight (K, N): q (K, N), q_t (N, K), scales (Kb, Nb)
            w_fwd, s_fwd, w_bwd, s_bwd = qwt, sw.t(), qw, sw
        else:  # weight (N, K)
            w_fwd, s_fwd, w_bwd, s_bwd = qw, sw, qwt, sw.t()
        y = ops.block_gemm(qx, sx, w_fwd, s_fwd, False, None if bias is None else bias.to(x2d.dtype), x2d.dtype)
        # requantize_weight_in_backward: the weight itself is kept, and its
        # blocks (scales from its values alone) quantized again for dX.
        requantize = need_dx and config.requantize_weight_in_backward
        saved = [w_bwd, s_bwd] if need_dx and not requantize else [None, None]
        saved += [qxt, sxt] if need_dw else [None, None]  # x^T (K, M) in tiles along M
        saved.append(weight if requantize else None)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, g):
        config = ctx.config
        grad_dt, margin, pow2 = config.grad_dtype, config.margin, config.power_of_two
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        w_bwd, s_bwd, qxt, sxt, weight = ctx.saved_tensors
        if weight is not None and need_dx:
            qw, qwt, sw = ops.quantize_blocks(weight.detach(), config.forward_dtype, margin, pow2)
            w_bwd, s_bwd = (qw, sw) if config.in_out else (qwt, sw.t())
        g2d = g.contiguous()
        dx = dw = db = dsink = None
        if need_dx:
            qg, sg = ops.quantize_tiles(g2d, grad_dt, False, margin, pow2)
            dx = ops.block_gemm(qg, sg, w_bwd, s_bwd, False, None, x_dtype)
            del qg, sg  # freed before the weight gradient's operands are made (peak memory)
        if need_dw:
            qgt, sgt = ops.quantize_tiles(g2d, grad_dt, True, margin, pow2)  # g^T (N, M) in tiles along M
            dw = (ops.block_gemm(qxt, sxt, qgt, sgt, True, None, w_dtype) if config.in_out
                  else ops.block_gemm(qgt, sgt, qxt, sxt, True, None, w_dtype))
        if ctx.has_bias and need_db:
            db = g2d.sum(0, dtype=torch.float32).to(b_dtype)
        if ctx.has_sink:
            ga = g2d.abs().amax().to(torch.float32)
            dsink = torch.where(torch.isfinite(ga), ga, torch.zeros_like(ga))
        return (dx, dw, db, dsink) + (None,) * 7


def _block_fp8_linear(x, weight, bias, config, sink):
    """The block-scaled FP8 linear (the call checked)."""
    n, x2d = _as_2d(x, weight, config.in_out)
    wd = weight if weight.is_contiguous() else weight.contiguous()
    grad_on = torch.is_grad_enabled()
    need_dx = grad_on and x.requires_grad
    need_dw = grad_on and weight.requires_grad
    needs_graph = grad_on and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
                               or sink is not None)
    qx, qxt, sx, sxt = _quantize_input_tiles(config, x, x2d, need_dw)
    if needs_graph:
        out = _BlockLinearFunction.apply(x2d, wd, bias, sink, config, need_dx, need_dw, qx, sx, qxt, sxt)
    else:
        with torch.no_grad():
            out = _BlockLinearFunction.forward(_NoContext(), x2d, wd, bias, None, config, need_dx, need_dw, qx, sx,
                                               qxt, sxt)
    return out.reshape(*x.shape[:-1], n)


class _NoContext:
    """Stands in for autograd's ctx when no graph is recorded."""

    needs_input_grad = (False,) * 11

    def save_for_backward(self, *tensors):
        pass
