"""fp8_linear: an FP8 linear layer's forward and backward with its scaling state.

Forward: quantize x and the weight (E4M3) with their delayed (or current)
scales, one cuBLASLt FP8 GEMM with fast accumulation and the bias fused.
Backward: quantize the output gradient once (E5M2 for "hybrid", E4M3 for
"e4m3") with its transpose, for both the dX and the dW GEMM (split
accumulation). Every GEMM dequantizes with exactly the scale its operand was
quantized with (the ``scale_used`` the quantize returned), even though the
same quantize publishes the next scale into the state.

Two execution paths, one algorithm (docs/design.md):

- eager, on plain CUDA tensors the kernels serve: one C++ call
  (``csrc/linear.cpp``), whose autograd node runs its backward without Python;
- everything else (torch.compile, CUDA-graph capture of traced code, tensor
  subclasses, CPU): the ``torch.library`` ops of ``torch_ops.ops`` under the
  autograd Function below. Off the kernels those ops run the reference.

Block scaling (``scaling="block"``) runs one path for both: the same custom
ops under ``_BlockLinearFunction``, each GEMM cuBLASLt's block-scaled one.

Below ``min_gemm_size`` (and for empty inputs) a call runs exactly what the
compute-dtype layer runs, ``F.linear`` in x's dtype, and leaves the FP8 state
untouched: the next FP8 call continues from the state the last one left.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import distributed
from . import extension
from . import gathered
from . import ops
from . import reference as ref
from . import settings as settings_lib

E4M3 = ref.E4M3
SCALINGS = ("delayed", "current", "block")
WEIGHT_LAYOUTS = ("out_in", "in_out")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
# Longest amax history a state may have.
MAX_HISTORY_LEN = 2**20


@dataclasses.dataclass
class FP8LinearState:
    """Scaling state of one FP8 linear layer: six float32 tensors, updated in place.

    ``*_scale`` are 0-d dequantization steps (``x ~= q * scale``);
    ``*_amax_history`` are ``(H,)`` with ``[0]`` the newest amax.

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

    @classmethod
    def create(cls, history_len: int = 1024, device=None) -> "FP8LinearState":
        """Fresh state: scales 1, empty histories of ``history_len`` entries."""
        check_history_len(history_len)

        def scale():
            return torch.ones((), dtype=torch.float32, device=device)

        def history():
            return torch.zeros((history_len,), dtype=torch.float32, device=device)

        return cls(scale(), history(), scale(), history(), scale(), history())

    def tensors(self):
        """The six tensors in field order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


STATE_NAMES = tuple(f.name for f in dataclasses.fields(FP8LinearState))


def check_history_len(history_len):
    """Raises naming ``history_len`` unless it is an integer in [1, MAX_HISTORY_LEN]."""
    if isinstance(history_len, bool) or not isinstance(history_len, int) or not 1 <= history_len <= MAX_HISTORY_LEN:
        raise ValueError(f"history_len: expected an integer from 1 to {MAX_HISTORY_LEN}, got {history_len!r}")


def check_options(fp8_format, scaling, amax_compute_algo, power_of_two=False):
    """Raises ValueError naming the first option that is not one of its accepted
    values (fp8_linear's and FP8Linear's options)."""
    if not isinstance(power_of_two, bool):
        raise ValueError(f"power_of_two: expected a bool, got {power_of_two!r}")
    if power_of_two and scaling != "block":
        raise ValueError(f"power_of_two: applies to scaling='block' only, got scaling={scaling!r}")
    if fp8_format not in ref.FP8_FORMATS:
        raise ValueError(f"fp8_format: expected one of {tuple(ref.FP8_FORMATS)}, got {fp8_format!r}")
    if scaling not in SCALINGS:
        raise ValueError(f"scaling: expected one of {SCALINGS}, got {scaling!r}")
    if amax_compute_algo not in ref.AMAX_COMPUTE_ALGOS:
        raise ValueError(f"amax_compute_algo: expected one of {ref.AMAX_COMPUTE_ALGOS}, got {amax_compute_algo!r}")


def _check(x, weight, bias, state, fp8_format, scaling, amax_compute_algo, weight_layout, power_of_two=False):
    """The Python path's argument checks (the C++ entry makes the same)."""
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
    check_options(fp8_format, scaling, amax_compute_algo, power_of_two)
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout: expected one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    k_w = weight.shape[0] if weight_layout == "in_out" else weight.shape[1]
    if k_w != x.shape[-1]:
        raise ValueError(f"weight: shape {tuple(weight.shape)} with weight_layout={weight_layout!r} does not match "
                         f"x's last dimension {x.shape[-1]}")
    n = weight.shape[1] if weight_layout == "in_out" else weight.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != n
                             or bias.device != x.device):
        raise ValueError(f"bias: expected shape ({n},) on {x.device}, got {tuple(getattr(bias, 'shape', ()))} "
                         f"on {getattr(bias, 'device', type(bias).__name__)}")
    check_state(state, x.device)


def check_state(state, device):
    """Raises naming the field of ``state`` that is not a float32 tensor of
    its shape on ``device``: scales one element of rank <= 1, histories
    non-empty and 1-D."""
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


def _as_state(state):
    if isinstance(state, FP8LinearState):
        return state
    if isinstance(state, (tuple, list)) and len(state) == 6:
        return FP8LinearState(*state)
    raise TypeError(f"state: expected an FP8LinearState or its six tensors, got {type(state).__name__}")


# --------------------------------------------------------------------------- below min_gemm_size
def _runs_compute_dtype(x, weight, weight_layout, min_gemm_size, kernels) -> bool:
    """Whether this call runs the compute-dtype linear: an empty input, or
    ``M*N*K`` below ``min_gemm_size`` (None: the settings', resolved for
    whether the ``kernels`` serve x's device)."""
    k = x.shape[-1]
    if x.numel() == 0 or k == 0:
        return True
    if min_gemm_size is None:
        min_gemm_size = settings_lib.get_settings().resolved_min_gemm_size(kernels)
    n = weight.shape[1] if weight_layout == "in_out" else weight.shape[0]
    return (x.numel() // k) * n * k < min_gemm_size


def _compute_dtype_linear(x, weight, bias, weight_layout):
    """What ``nn.Linear`` computes in x's dtype (the weight and bias cast to it)."""
    w = weight.t() if weight_layout == "in_out" else weight
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, w, bias)


def compute_dtype_call(x, weight, bias, min_gemm_size):
    """For a module whose weight and bias are its own (checked at
    construction): ``nn.Linear``'s result where this call runs the compute
    dtype (a plain float tensor x of the weight's K, below
    ``min_gemm_size``), else None. The host path of small layers, kept as
    short as ``nn.Linear``'s."""
    if type(x) is not torch.Tensor or x.dtype not in _FLOATS or x.dim() < 2 or x.shape[-1] != weight.shape[1]:
        return None
    if x.device != weight.device:
        return None
    kernels = x.is_cuda and extension.kernels_for(x) is not None
    if not _runs_compute_dtype(x, weight, "out_in", min_gemm_size, kernels):
        return None
    return _compute_dtype_linear(x, weight, bias, "out_in")


# --------------------------------------------------------------------------- the compile path
def _quantize(scaling, x, history, scale, dt, margin, algo, transpose, record, write_q, reduce=False):
    """(q, q_t, scale_used, amax) in the GEMM-ready layouts. Training calls
    under current scaling store the scale they used in ``scale``. With
    ``reduce`` (an input or output gradient of a training call: never a
    weight, which is the same on every process, nor an evaluation call,
    which may run on one process alone) and an amax reduction group in
    effect, the amax is the group's max (``distributed.quantize_global``)."""
    group = distributed.reduction_group() if reduce else None
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
    """The GEMMs and the backward of the compile path. Inputs after the
    differentiable ones (x, weight, bias, sink) are the quantized operands and
    the gradient state; the sink (optional, 0-d) receives the output
    gradient's amax instead of the gradient state recording it."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, sink, qx, qw_fwd, sx, sw, qxt, qw_bwd, grad_history, grad_scale, config):
        ctx.config = config
        ctx.has_bias = bias is not None
        ctx.has_sink = sink is not None
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        autotune = config[-1]
        ctx.save_for_backward(qxt, qw_bwd, sx, sw)
        # The gradient state is state, updated in place by the backward: kept
        # without saved-tensor version checks, so that a second backward
        # through this node (retain_graph) finds it.
        ctx.grad_state = (grad_history, grad_scale)
        ctx.recorded = False
        # The bias is added in x's dtype (the GEMM's epilogue takes it so).
        return ops.gemm(qx, qw_fwd, sx, sw, None if bias is None else bias.to(x2d.dtype), x2d.dtype, True, autotune)

    @staticmethod
    def backward(ctx, g):
        in_out, grad_dt, scaling, margin, algo, record_grad, training, autotune = ctx.config
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        qxt, qw_bwd, sx, sw = ctx.saved_tensors
        grad_history, grad_scale = ctx.grad_state
        # One record per forward: a second backward through the same graph
        # (retain_graph, two losses) quantizes with the state's scale.
        record = record_grad and scaling == "delayed" and not ctx.recorded
        ctx.recorded = True
        g2d = g.contiguous()
        qg, qgt, sg, ga = _quantize(scaling, g2d, grad_history, grad_scale, grad_dt, margin, algo, need_dw, record,
                                    need_dx, reduce=training)
        dx = dw = db = dsink = None
        if need_dx:
            dx = ops.gemm(qg, qw_bwd, sg, sw, None, x_dtype, False, autotune)
        del qg  # the weight gradient's GEMM runs without the row-major copy (peak memory)
        if need_dw:
            dw = (ops.gemm(qxt, qgt, sx, sg, None, w_dtype, False, autotune) if in_out
                  else ops.gemm(qgt, qxt, sg, sx, None, w_dtype, False, autotune))
        if ctx.has_bias and need_db:
            db = g2d.sum(0, dtype=torch.float32).to(b_dtype)
        if ctx.has_sink:
            dsink = torch.where(torch.isfinite(ga), ga, torch.zeros_like(ga))
        return dx, dw, db, dsink, None, None, None, None, None, None, None, None, None


def _recomputing() -> bool:
    """True inside a backward pass, where activation checkpointing
    (``torch.utils.checkpoint``) recomputes forwards: such a forward must not
    record its amaxes a second time (it quantizes with the state's scales).
    Under torch.compile the partitioner never recomputes a mutating op."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _as_2d(x, weight, weight_layout):
    """(in_out, N, x as a contiguous (M, K) matrix)."""
    in_out = weight_layout == "in_out"
    x2d = x.reshape(-1, x.shape[-1])
    return in_out, weight.shape[1] if in_out else weight.shape[0], x2d if x2d.is_contiguous() else x2d.contiguous()


def _python_fp8_linear(x, weight, bias, state, fp8_format, scaling, margin, algo, weight_layout, training, sink):
    """The compile path's FP8 linear (the arguments checked, not small)."""
    in_out, n, x2d = _as_2d(x, weight, weight_layout)
    grad_on = torch.is_grad_enabled()
    need_dx = grad_on and x.requires_grad
    need_dw = grad_on and weight.requires_grad
    fwd_dt, grad_dt = ref.FP8_FORMATS[fp8_format]
    record = bool(training) and not _recomputing()
    s = state
    qx, qxt, sx, _ = _quantize(scaling, x2d.detach(), s.input_amax_history, s.input_scale, fwd_dt, margin, algo,
                               need_dw, record, True, reduce=bool(training))
    # A weight FSDP2 gathered in FP8 comes quantized (its state recorded at the gather).
    fp8_weight = gathered.fp8_operands(weight, in_out, need_dx)
    if fp8_weight is not None:
        qw_fwd, qw_bwd, sw = fp8_weight
    else:
        wd = weight.detach()
        if not wd.is_contiguous():
            wd = wd.contiguous()
        # The forward wants the weight as (N, K), dX as (K, N); out_in stores (N, K).
        qw, qwt, sw, _ = _quantize(scaling, wd, s.kernel_amax_history, s.kernel_scale, fwd_dt, margin, algo,
                                   in_out or need_dx, record, (not in_out) or need_dx)
        qw_fwd, qw_bwd = (qwt, qw) if in_out else (qw, qwt)
    autotune = settings_lib.get_settings().gemm_autotune
    needs_graph = grad_on and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
                               or sink is not None)
    if needs_graph:
        config = (in_out, grad_dt, scaling, float(margin), algo, bool(training) and sink is None, bool(training),
                  autotune)
        out = _FP8LinearFunction.apply(x2d, weight, bias, sink, qx, qw_fwd, sx, sw, qxt, qw_bwd,
                                       s.grad_amax_history, s.grad_scale, config)
    else:
        out = ops.gemm(qx, qw_fwd, sx, sw, None if bias is None else bias.detach().to(x2d.dtype), x2d.dtype, True,
                       autotune)
    return out.reshape(*x.shape[:-1], n)


# --------------------------------------------------------------------------- block scaling
class _BlockLinearFunction(torch.autograd.Function):
    """Block-scaled FP8 linear (scaling="block", docs/design.md "Block
    scaling"): x and the output gradient in 1 x 128 tiles along the
    contraction of each GEMM, the weight in 128 x 128 blocks, every scale from
    its tile's own values (no state). The weight's two orientations come from
    one quantize (its bytes and their transpose, one set of block scales);
    x's 128 x 1 tiles (along M, for dW) are quantized in the forward."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, sink, config):
        in_out, fwd_dt, grad_dt, margin, pow2, need_dx, need_dw = config
        ctx.config = config
        ctx.has_bias = bias is not None
        ctx.has_sink = sink is not None
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        qx, sx = ops.quantize_tiles(x2d, fwd_dt, False, margin, pow2)
        qw, qwt, sw = ops.quantize_blocks(weight.detach(), fwd_dt, margin, pow2)
        # The forward's b is the weight as (N, K); dX's as (K, N).
        if in_out:  # weight (K, N): q (K, N), q_t (N, K), scales (Kb, Nb)
            w_fwd, s_fwd, w_bwd, s_bwd = qwt, sw.t(), qw, sw
        else:  # weight (N, K)
            w_fwd, s_fwd, w_bwd, s_bwd = qw, sw, qwt, sw.t()
        y = ops.block_gemm(qx, sx, w_fwd, s_fwd, False, None if bias is None else bias.to(x2d.dtype), x2d.dtype)
        saved = [w_bwd, s_bwd] if need_dx else [None, None]
        if need_dw:
            saved += list(ops.quantize_tiles(x2d, fwd_dt, True, margin, pow2))  # x^T (K, M) in tiles along M
        else:
            saved += [None, None]
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, g):
        in_out, fwd_dt, grad_dt, margin, pow2, _, _ = ctx.config
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        w_bwd, s_bwd, qxt, sxt = ctx.saved_tensors
        g2d = g.contiguous()
        dx = dw = db = dsink = None
        if need_dx:
            qg, sg = ops.quantize_tiles(g2d, grad_dt, False, margin, pow2)
            dx = ops.block_gemm(qg, sg, w_bwd, s_bwd, False, None, x_dtype)
            del qg, sg  # freed before the weight gradient's operands are made (peak memory)
        if need_dw:
            qgt, sgt = ops.quantize_tiles(g2d, grad_dt, True, margin, pow2)  # g^T (N, M) in tiles along M
            dw = (ops.block_gemm(qxt, sxt, qgt, sgt, True, None, w_dtype) if in_out
                  else ops.block_gemm(qgt, sgt, qxt, sxt, True, None, w_dtype))
        if ctx.has_bias and need_db:
            db = g2d.sum(0, dtype=torch.float32).to(b_dtype)
        if ctx.has_sink:
            ga = g2d.abs().amax().to(torch.float32)
            dsink = torch.where(torch.isfinite(ga), ga, torch.zeros_like(ga))
        return dx, dw, db, dsink, None


def _block_fp8_linear(x, weight, bias, fp8_format, margin, power_of_two, weight_layout, sink):
    """The block-scaled FP8 linear (the arguments checked, not small)."""
    in_out, n, x2d = _as_2d(x, weight, weight_layout)
    wd = weight if weight.is_contiguous() else weight.contiguous()
    fwd_dt, grad_dt = ref.FP8_FORMATS[fp8_format]
    grad_on = torch.is_grad_enabled()
    need_dx = grad_on and x.requires_grad
    need_dw = grad_on and weight.requires_grad
    config = (in_out, fwd_dt, grad_dt, float(margin), bool(power_of_two), need_dx, need_dw)
    needs_graph = grad_on and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
                               or sink is not None)
    if needs_graph:
        out = _BlockLinearFunction.apply(x2d, wd, bias, sink, config)
    else:
        with torch.no_grad():
            out = _BlockLinearFunction.forward(_NoContext(), x2d, wd, bias, None, config)
    return out.reshape(*x.shape[:-1], n)


class _NoContext:
    """Stands in for autograd's ctx when no graph is recorded."""

    needs_input_grad = (False, False, False, False, False)

    def save_for_backward(self, *tensors):
        pass


# --------------------------------------------------------------------------- the eager C++ entry
_T, _P = torch.Tensor, torch.nn.Parameter
_GRAD_FMT = {"hybrid": 1, "e4m3": 0}
_SCALING_ID = {"delayed": 1, "current": 2}
_ALGO_ID = {"max": 0, "most_recent": 1}
# (fp8_format, scaling, margin, amax_compute_algo, weight_layout) -> the C++
# entry's (grad_fmt, scaling, margin multiplier, algo, in_out); None where an
# option is invalid (the Python path then raises the error).
_ENTRY_ARGS: dict = {}


def _entry_args(fp8_format, scaling, margin, amax_compute_algo, weight_layout):
    key = (fp8_format, scaling, margin, amax_compute_algo, weight_layout)
    args = _ENTRY_ARGS.get(key)
    if args is None and key not in _ENTRY_ARGS:
        try:
            check_options(fp8_format, scaling, amax_compute_algo)
            multiplier = ref.margin_multiplier(ref.check_margin(margin))
            if weight_layout not in WEIGHT_LAYOUTS:
                raise ValueError(weight_layout)
        except (ValueError, TypeError):
            args = None
        else:
            args = (_GRAD_FMT[fp8_format], _SCALING_ID[scaling], multiplier, _ALGO_ID[amax_compute_algo],
                    weight_layout == "in_out")
        if len(_ENTRY_ARGS) < 256:
            _ENTRY_ARGS[key] = args
    return args


def _eager_entry(x, weight, training=True):
    """The extension when the C++ entry may take this call (plain CUDA x and
    weight the kernels serve, outside torch.compile, not a training call
    with an amax reduction group in effect: the C++ entry has no
    collective), else None."""
    if (type(x) is not _T and type(x) is not _P) or (type(weight) is not _T and type(weight) is not _P):
        return None
    if not x.is_cuda or torch.compiler.is_compiling() or (training and distributed.reduction_group() is not None):
        return None
    return extension.kernels_for(x)


def _call_entry(entry, *args):
    """``entry(*args)``, or None where pybind11 rejects the argument types
    (not tensors where tensors go): the Python path then names the argument."""
    try:
        return entry(*args)
    except TypeError as e:
        if "incompatible function arguments" in str(e):
            return None
        raise


# --------------------------------------------------------------------------- public
def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    state: FP8LinearState,
    fp8_format: str = "hybrid",
    scaling: str = "delayed",
    margin: float = 0.0,
    amax_compute_algo: str = "max",
    weight_layout: str = "out_in",
    training: bool = True,
    min_gemm_size: int | None = None,
    power_of_two: bool = False,
) -> torch.Tensor:
    """FP8 linear: ``x @ W^T + bias`` with FP8 GEMMs and in-place scaling state.

    Args:
        x: ``(..., K)`` bfloat16, float16 or float32; the output has x's dtype.
        weight: ``(N, K)`` for ``weight_layout="out_in"`` (``nn.Linear``),
            ``(K, N)`` for ``"in_out"`` (a Keras kernel; no transposed copy).
        bias: Optional ``(N,)``.
        state: The layer's ``FP8LinearState``, updated in place when training.
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradient) or ``"e4m3"``.
        scaling: ``"delayed"`` (scales from the amax histories),
            ``"current"`` (each tensor's own amax; a training call stores the
            scale it used, and the state's scale is the fallback for a tensor
            of zeros) or ``"block"`` (a scale per 1 x 128 tile of x and of the
            output gradient, per 128 x 128 block of the weight, each from its
            own values; the state is left as it is).
        margin: Scale margin, a number >= 0 (docs/numerics.md).
        amax_compute_algo: ``"max"`` over the history or ``"most_recent"``.
        weight_layout: ``"out_in"`` or ``"in_out"``.
        training: False quantizes with the state's scales (seeded from the
            tensor while its history is empty) and records nothing.
        min_gemm_size: ``M*N*K`` below which the call runs the compute-dtype
            linear and leaves the state alone (None: ``torch_ops.
            get_settings()``'s).
        power_of_two: Block scaling only: round each tile's scale up to a
            power of two.

    Returns:
        ``(..., N)`` in x's dtype.

    Example:

    >>> state = torch_ops.FP8LinearState.create(history_len=16)
    >>> y = torch_ops.fp8_linear(torch.randn(8, 32), torch.randn(64, 32), state=state)
    >>> y.shape
    torch.Size([8, 64])
    """
    settings_lib.check_min_gemm_size(min_gemm_size)
    ext = _eager_entry(x, weight, training)
    kernels = ext is not None or (isinstance(x, torch.Tensor) and extension.kernels_for(x) is not None)
    if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.dim() == 2 and x.dim() >= 1 \
            and _runs_compute_dtype(x, weight, weight_layout, min_gemm_size, kernels):
        _check(x, weight, bias, state, fp8_format, scaling, amax_compute_algo, weight_layout, power_of_two)
        return _compute_dtype_linear(x, weight, bias, weight_layout)
    if ext is not None and type(state) is FP8LinearState and scaling != "block":
        args = _entry_args(fp8_format, scaling, margin, amax_compute_algo, weight_layout)
        if args is not None:
            grad_fmt, scaling_id, multiplier, algo, in_out = args
            out = _call_entry(ext.linear, x, weight, bias, list(state.tensors()), grad_fmt, scaling_id, multiplier,
                              algo, in_out, bool(training), not _recomputing(), None,
                              settings_lib.get_settings().gemm_autotune)
            if out is not None:
                return out
    _check(x, weight, bias, state, fp8_format, scaling, amax_compute_algo, weight_layout, power_of_two)
    margin = ref.check_margin(margin)
    if scaling == "block":
        return _block_fp8_linear(x, weight, bias, fp8_format, margin, power_of_two, weight_layout, None)
    return _python_fp8_linear(x, weight, bias, state, fp8_format, scaling, margin, amax_compute_algo, weight_layout,
                              training, None)


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


def check_channel(pending, fold_state):
    """Raises a ValueError naming ``pending`` or ``fold_state`` unless each is a
    float32 tensor of shape (3,)."""
    for name, t in (("pending", pending), ("fold_state", fold_state)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (3,):
            raise ValueError(f"{name}: expected a float32 tensor of shape (3,), got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


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
        margin, amax_compute_algo: As for ``fp8_linear``.
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
    check_channel(pending, fold_state)
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


def fp8_linear_folded(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    state,
    pending: torch.Tensor,
    fold_state: torch.Tensor,
    fp8_format: str = "hybrid",
    scaling: str = "delayed",
    margin: float = 0.0,
    amax_compute_algo: str = "max",
    window: int | None = None,
    weight_layout: str = "out_in",
    training: bool = True,
    min_gemm_size: int | None = None,
    power_of_two: bool = False,
) -> torch.Tensor:
    """``fp8_linear`` whose output gradient's amax leaves through a gradient
    channel instead of being recorded by the backward: the Keras layers' call.

    A training call first folds the last backward's pending amax into the
    gradient state (``fold_pending_grad_amax``) and runs on the fold's copies
    of the gradient scale and history. Where ``pending.requires_grad`` (and
    grad mode is on), the backward records nothing and returns ``[amax of
    the output gradient (0 where not finite), token, 0]`` as ``pending``'s
    gradient (token 0 when not training). The bias is added in x's dtype and
    its gradient is rounded to x's dtype (as if cast with ``bias.to(x.dtype)``).

    Args:
        x, weight, bias, fp8_format, scaling, margin, amax_compute_algo,
            weight_layout, training, min_gemm_size, power_of_two: As for
            ``fp8_linear``.
        state: ``FP8LinearState``, or its six tensors in field order.
        pending: ``(3,)`` float32 ``[amax, token, loss_scale]`` (read only).
        fold_state: ``(3,)`` float32 ``[folds, last_token, last_loss_scale]``,
            updated in place when training.
        window: As for ``fold_pending_grad_amax`` (default: the whole history).

    Returns:
        ``(..., N)`` in x's dtype.
    """
    settings_lib.check_min_gemm_size(min_gemm_size)
    ext = _eager_entry(x, weight, training)
    kernels = ext is not None or (isinstance(x, torch.Tensor) and extension.kernels_for(x) is not None)
    if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.dim() == 2 and x.dim() >= 1 \
            and _runs_compute_dtype(x, weight, weight_layout, min_gemm_size, kernels):
        check_channel(pending, fold_state)
        _check(x, weight, bias, _as_state(state), fp8_format, scaling, amax_compute_algo, weight_layout,
               power_of_two)
        return _compute_dtype_linear(x, weight, bias, weight_layout)
    if ext is not None and (window is None or window >= 1) and scaling != "block":
        args = _entry_args(fp8_format, scaling, margin, amax_compute_algo, weight_layout)
        if args is not None:
            tensors = list(state.tensors() if type(state) is FP8LinearState else state)
            grad_fmt, scaling_id, multiplier, algo, in_out = args
            out = _call_entry(ext.linear_folded, x, weight, bias, pending, fold_state, tensors, grad_fmt, scaling_id,
                              multiplier, algo, 0 if window is None else int(window), in_out, bool(training),
                              not _recomputing(), settings_lib.get_settings().gemm_autotune)
            if out is not None:
                return out
    check_channel(pending, fold_state)
    if window is not None and window < 1:
        raise ValueError(f"window: expected >= 1, got {window}")
    s = _as_state(state)
    _check(x, weight, bias, s, fp8_format, scaling, amax_compute_algo, weight_layout, power_of_two)
    margin = ref.check_margin(margin)
    grad_dt = ref.FP8_FORMATS[fp8_format][1]
    token = None
    if training:
        token, grad_scale, grad_history = fold_pending_grad_amax(
            pending, fold_state, s.grad_amax_history, s.grad_scale, grad_dt, margin=margin,
            amax_compute_algo=amax_compute_algo, window=window, update_scale=scaling == "delayed")
        s = dataclasses.replace(s, grad_scale=grad_scale, grad_amax_history=grad_history)
    sink = pending.requires_grad and torch.is_grad_enabled()
    if scaling == "block":
        y = _block_fp8_linear(x, weight, None if bias is None else bias.to(x.dtype), fp8_format, margin,
                              power_of_two, weight_layout, pending[0] if sink else None)
    else:
        y = _python_fp8_linear(x, weight, None if bias is None else bias.to(x.dtype), s, fp8_format, scaling,
                               margin, amax_compute_algo, weight_layout, training, pending[0] if sink else None)
    if not sink:
        return y
    if token is None:
        token = torch.zeros((), dtype=torch.float32, device=x.device)
    return _EmitToken.apply(y, pending, token)
