"""fp8_linear: an FP8 linear layer's forward and backward with its scaling state.

Forward: quantize x and the weight (E4M3) with their delayed (or current)
scales, one cuBLASLt FP8 GEMM with fast accumulation and the bias fused.
Backward: quantize the output gradient once (E5M2 for "hybrid", E4M3 for
"e4m3"), with its transpose, and use it for both the dX and the dW GEMM (split
accumulation). Every GEMM dequantizes with exactly the scale its operand was
quantized with (the ``scale_used`` tensors the quantize ops return), even though
the same ops publish the next scale into the state.

The quantize ops run outside the autograd.Function (they are not
differentiable); the Function holds the GEMMs and the backward. The same code
runs on the emulation ops (``emulation.fp8_linear``) as the reference.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import _build
from . import _env
from . import _ops
from . import emulation as emu
from .fold import check_channel
from .fold import fold_pending_grad_amax

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

# Below this M*N*K the GEMMs run in the compute dtype (bf16/fp16/fp32) while
# the FP8 state is still updated exactly as in the FP8 path: at small sizes
# quantize + FP8 GEMM launches cost more than they save. Overridable per call
# (min_gemm_size=...) or by the environment variable, read once at import.
# The default comes from benchmarks/linear.py on an H200 (docs/benchmarks.md).
DEFAULT_MIN_GEMM_SIZE = _env.integer("TORCH_OPS_FP8_MIN_GEMM_SIZE", 8192 * 2048 * 2048)


@dataclasses.dataclass
class FP8LinearState:
    """Scaling state of one FP8 linear layer: six float32 tensors, updated in place.

    ``*_scale`` are 0-d dequantization steps (x ~= q * scale); ``*_amax_history``
    are (H,) with ``[0]`` the newest amax (DESIGN.md, "Numerics").
    """

    input_scale: torch.Tensor
    input_amax_history: torch.Tensor
    kernel_scale: torch.Tensor
    kernel_amax_history: torch.Tensor
    grad_scale: torch.Tensor
    grad_amax_history: torch.Tensor

    @classmethod
    def create(cls, history_len: int = 1024, device=None) -> "FP8LinearState":
        if history_len < 1:
            raise ValueError(f"history_len: expected >= 1, got {history_len}")

        def s():
            return torch.ones((), dtype=torch.float32, device=device)

        def h():
            return torch.zeros((history_len,), dtype=torch.float32, device=device)

        return cls(s(), h(), s(), h(), s(), h())

    def tensors(self):
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


class _KernelOps:
    """The registered custom ops (kernel on FP8 GPUs, emulation elsewhere)."""

    pads = True

    @staticmethod
    def delayed(x, hist, scale, dt, margin, algo, transpose, record, write_q):
        return _ops.quantize_delayed(x, hist, scale, dt, margin, algo, transpose, record, True, write_q)

    @staticmethod
    def current(x, prev, dt, margin, transpose, write_q):
        return _ops.quantize_current(x, prev, dt, margin, transpose, True, write_q)

    @staticmethod
    def gemm(a, b, sa, sb, bias, out_dtype, fast):
        return _ops.gemm(a, b, sa, sb, bias, out_dtype, fast)


class _EmuOps:
    """Pure emulation, no custom ops, no padding: the reference."""

    pads = False

    @staticmethod
    def delayed(x, hist, scale, dt, margin, algo, transpose, record, write_q):
        return emu.quantize_delayed(
            x, hist, scale, dt, margin=margin, amax_compute_algo=algo, transpose=transpose, record=record
        )

    @staticmethod
    def current(x, prev, dt, margin, transpose, write_q):
        return emu.quantize_current(x, dt, margin=margin, prev_scale=prev, transpose=transpose)

    @staticmethod
    def gemm(a, b, sa, sb, bias, out_dtype, fast):
        return emu.fp8_gemm(a, b, sa, sb, bias=bias, out_dtype=out_dtype, use_fast_accum=fast)


def _quant(ops, scaling, x, hist, scale, dt, margin, algo, transpose, record, write_q):
    if scaling == "delayed":
        return ops.delayed(x, hist, scale, dt, margin, algo, transpose, record, write_q)
    return ops.current(x, scale, dt, margin, transpose, write_q)


def _make_fn(ops):
    class _FP8LinearFn(torch.autograd.Function):
        """Inputs after the differentiable ones are precomputed fp8 operands and
        the grad state; only x, weight, bias and the sink get gradients."""

        @staticmethod
        def forward(ctx, x2d, weight, bias, sink, qx, qw_fwd, sx, sw, qxt, qw_bwd, grad_hist, grad_scale, cfg):
            (in_out, small, grad_dt, scaling, margin, algo, record_grad) = cfg
            ctx.cfg = cfg
            ctx.has_bias = bias is not None
            ctx.has_sink = sink is not None
            ctx.shapes = (x2d.shape, weight.shape)
            ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
            if small:
                w_nk = (weight.t() if in_out else weight).to(x2d.dtype)
                out = F.linear(x2d, w_nk, None if bias is None else bias.to(x2d.dtype))
                ctx.save_for_backward(x2d, weight, grad_hist, grad_scale)
            else:
                out = ops.gemm(qx, qw_fwd, sx, sw, bias, x2d.dtype, True)
                ctx.save_for_backward(qxt, qw_bwd, sx, sw, grad_hist, grad_scale)
            return out

        @staticmethod
        def backward(ctx, g):
            (in_out, small, grad_dt, scaling, margin, algo, record_grad) = ctx.cfg
            need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
            x_dtype, w_dtype, b_dtype = ctx.dtypes
            g2d = g.contiguous()
            dx = dw = db = dsink = None
            if small:
                x2d, weight, grad_hist, grad_scale = ctx.saved_tensors
                _, _, _, ga = _quant(ops, scaling, g2d, grad_hist, grad_scale, grad_dt, margin, algo,
                                     False, record_grad, False)
                w = weight.to(g2d.dtype)
                if need_dx:
                    dx = g2d @ (w.t() if in_out else w)
                if need_dw:
                    # In the weight's own layout: in_out (K, N) = x^T g.
                    xg = x2d.to(g2d.dtype)
                    dw = (xg.t() @ g2d if in_out else g2d.t() @ xg).to(w_dtype)
            else:
                qxt, qw_bwd, sx, sw, grad_hist, grad_scale = ctx.saved_tensors
                qg, qgt, sg, ga = _quant(ops, scaling, g2d, grad_hist, grad_scale, grad_dt, margin, algo,
                                         need_dw, record_grad, need_dx)
                if need_dx:
                    dx = ops.gemm(qg, qw_bwd, sg, sw, None, x_dtype, False)
                if need_dw:
                    if in_out:
                        dw = ops.gemm(qxt, qgt, sx, sg, None, w_dtype, False)
                    else:
                        dw = ops.gemm(qgt, qxt, sg, sx, None, w_dtype, False)
            if ctx.has_bias and need_db:
                db = g2d.sum(0, dtype=torch.float32).to(b_dtype)
            if ctx.has_sink:
                dsink = torch.where(torch.isfinite(ga), ga, torch.zeros_like(ga))
            return dx, dw, db, dsink, None, None, None, None, None, None, None, None, None

    return _FP8LinearFn


_KernelFn = _make_fn(_KernelOps)
_EmuFn = _make_fn(_EmuOps)

_FORMATS = ("hybrid", "e4m3")
_SCALINGS = ("delayed", "current")
_LAYOUTS = ("out_in", "in_out")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def check_options(fp8_format, scaling, amax_compute_algo):
    """Raises ValueError naming the first of fp8_linear's options that is not
    one of its accepted values (also FP8Linear's constructor check)."""
    if fp8_format not in _FORMATS:
        raise ValueError(f"fp8_format: expected one of {_FORMATS}, got {fp8_format!r}")
    if scaling not in _SCALINGS:
        raise ValueError(f"scaling: expected one of {_SCALINGS}, got {scaling!r}")
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"amax_compute_algo: expected 'max' or 'most_recent', got {amax_compute_algo!r}")


def _check(x, weight, bias, state, fp8_format, scaling, amax_compute_algo, weight_layout, grad_amax_sink):
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x: expected a tensor of rank >= 2, got {getattr(x, 'shape', type(x))}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x: expected bfloat16, float16 or float32, got {x.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D tensor, got {getattr(weight, 'shape', type(weight))}")
    if weight.dtype not in _FLOATS:
        raise TypeError(f"weight: expected bfloat16, float16 or float32, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight: expected device {x.device}, got {weight.device}")
    check_options(fp8_format, scaling, amax_compute_algo)
    if weight_layout not in _LAYOUTS:
        raise ValueError(f"weight_layout: expected one of {_LAYOUTS}, got {weight_layout!r}")
    K = x.shape[-1]
    k_w = weight.shape[1] if weight_layout == "out_in" else weight.shape[0]
    if k_w != K:
        raise ValueError(
            f"weight: shape {tuple(weight.shape)} with weight_layout={weight_layout!r} does not match "
            f"x's last dimension {K}"
        )
    N = weight.shape[0] if weight_layout == "out_in" else weight.shape[1]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N or bias.device != x.device):
        raise ValueError(f"bias: expected shape ({N},) on {x.device}, got {tuple(bias.shape)} on {bias.device}")
    if not isinstance(state, FP8LinearState):
        raise TypeError(f"state: expected an FP8LinearState, got {type(state).__name__}")
    for f in dataclasses.fields(state):
        t = getattr(state, f.name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device != x.device:
            raise ValueError(
                f"state.{f.name}: expected a float32 tensor on {x.device}, got "
                f"{getattr(t, 'dtype', type(t))} on {getattr(t, 'device', '?')}"
            )
    if grad_amax_sink is not None:
        if grad_amax_sink.dim() != 0 or grad_amax_sink.dtype != torch.float32:
            raise ValueError("grad_amax_sink: expected a 0-d float32 tensor with requires_grad=True")


def _fp8_linear(ops, fn, x, weight, bias, state, fp8_format, scaling, margin, amax_compute_algo, weight_layout,
                training, grad_amax_sink, min_gemm_size):
    _check(x, weight, bias, state, fp8_format, scaling, amax_compute_algo, weight_layout, grad_amax_sink)
    lead = x.shape[:-1]
    K = x.shape[-1]
    in_out = weight_layout == "in_out"
    N = weight.shape[1] if in_out else weight.shape[0]
    x2d = x.reshape(-1, K)
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    M = x2d.shape[0]
    if min_gemm_size is None:
        min_gemm_size = DEFAULT_MIN_GEMM_SIZE
    small = M * N * K < min_gemm_size
    grad_dt = E5M2 if fp8_format == "hybrid" else E4M3
    grad_on = torch.is_grad_enabled()
    need_dx = grad_on and x.requires_grad
    need_dw = grad_on and weight.requires_grad
    xd = x2d.detach()
    wd = weight.detach()
    if not wd.is_contiguous():
        wd = wd.contiguous()
    record = bool(training) and scaling == "delayed"
    s = state
    # x: forward operand (M, K) and, for dW, its transpose (K, M).
    qx, qxt, sx, _ = _quant(ops, scaling, xd, s.input_amax_history, s.input_scale, E4M3, margin,
                            amax_compute_algo, need_dw and not small, record, not small)
    # weight: forward wants (N, K), dX wants (K, N). out_in stores (N, K).
    fwd_from_t = in_out  # the (N, K) operand is the transpose of an in_out weight
    qw_a, qw_t, sw, _ = _quant(
        ops, scaling, wd, s.kernel_amax_history, s.kernel_scale, E4M3, margin, amax_compute_algo,
        (not small) and (fwd_from_t or need_dx), record, (not small) and ((not fwd_from_t) or need_dx),
    )
    qw_fwd, qw_bwd = (qw_t, qw_a) if fwd_from_t else (qw_a, qw_t)
    cfg = (in_out, small, grad_dt, scaling, float(margin), amax_compute_algo,
           bool(training) and scaling == "delayed" and grad_amax_sink is None)
    if grad_on and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
                    or grad_amax_sink is not None):
        out = fn.apply(x2d, weight, bias, grad_amax_sink, qx, qw_fwd, sx, sw, qxt, qw_bwd,
                       s.grad_amax_history, s.grad_scale, cfg)
    else:
        with torch.no_grad():
            if small:
                w_nk = (wd.t() if in_out else wd).to(x2d.dtype)
                out = F.linear(xd, w_nk, None if bias is None else bias.to(x2d.dtype))
            else:
                out = ops.gemm(qx, qw_fwd, sx, sw, bias, x2d.dtype, True)
    return out.reshape(*lead, N)


# Eager fast path: on plain CUDA tensors outside torch.compile, the whole
# call (quantize launches, GEMMs, autograd Function with its backward) runs in
# C++ (csrc/linear.cpp, the same kernels and state rules as _fp8_linear on
# _KernelOps, which stays the path of torch.compile and tensor subclasses).
# TORCH_OPS_LINEAR_FAST=0 turns it off (read at import).
FAST_PATH = _env.choice("TORCH_OPS_LINEAR_FAST", ("0", "1"), "1") == "1"
_FMT_ID = {"hybrid": 1, "e4m3": 0}
_SCALING_ID = {"delayed": 1, "current": 2}
_ALGO_ID = {"max": 0, "most_recent": 1}
_LAYOUT_ID = {"out_in": False, "in_out": True}
_T, _P = torch.Tensor, torch.nn.Parameter
_ext_cache = []
# (fp8_format, scaling, margin, amax_compute_algo, weight_layout) -> the C++
# entry's (grad_fmt, scaling, mdiv, algo, in_out), None where one is invalid.
_FAST_ARGS = {}


def _ext():
    """The compiled extension, or None where the kernels are unusable (cached)."""
    if not _ext_cache:
        _ext_cache.append(_build.load() if _build.is_available() else None)
    return _ext_cache[0]


def _fast_args(fp8_format, scaling, margin, amax_compute_algo, weight_layout):
    key = (fp8_format, scaling, margin, amax_compute_algo, weight_layout)
    args = _FAST_ARGS.get(key)
    if args is None and key not in _FAST_ARGS:
        fmt = _FMT_ID.get(fp8_format)
        sc = _SCALING_ID.get(scaling)
        algo = _ALGO_ID.get(amax_compute_algo)
        in_out = _LAYOUT_ID.get(weight_layout)
        if None not in (fmt, sc, algo, in_out):
            args = (fmt, sc, _ops._mdiv(margin), algo, in_out)
        if len(_FAST_ARGS) < 256:
            _FAST_ARGS[key] = args
    return args


def _fast_ext(x, weight):
    """The extension when the C++ entry may take this call (plain CUDA x and
    weight outside torch.compile, kernels usable), else None. The C++ entry
    declines (returns None) other tensors that are not plain."""
    if (type(x) is not _T and type(x) is not _P) or (type(weight) is not _T and type(weight) is not _P):
        return None
    if not x.is_cuda or _ops.GEMM_BACKEND != "cublaslt" or torch.compiler.is_compiling():
        return None
    return _ext_cache[0] if _ext_cache else _ext()


def _call_entry(entry, *args):
    """`entry(*args)` (a C++ entry point), or None where pybind11 rejects the
    argument types (not tensors where tensors go): the Python path then runs
    and names the argument."""
    try:
        return entry(*args)
    except TypeError as e:
        if "incompatible function arguments" in str(e):
            return None
        raise


def _gemm_limit(min_gemm_size):
    return DEFAULT_MIN_GEMM_SIZE if min_gemm_size is None else int(min(min_gemm_size, 1 << 62))


def _fast(x, weight, bias, state, fp8_format, scaling, margin, amax_compute_algo, weight_layout, training,
          grad_amax_sink, min_gemm_size):
    """The C++ fast path's output, or None when the call must take the Python path
    (not CUDA, kernels unusable, tensor subclasses, torch.compile, invalid
    arguments: the Python path raises the errors)."""
    ext = _fast_ext(x, weight)
    if ext is None or type(state) is not FP8LinearState:
        return None
    args = _fast_args(fp8_format, scaling, margin, amax_compute_algo, weight_layout)
    if args is None:
        return None
    fmt, sc, mdiv, algo, in_out = args
    s = state
    ts = (s.input_scale, s.input_amax_history, s.kernel_scale, s.kernel_amax_history, s.grad_scale,
          s.grad_amax_history)
    # Tensor arguments are checked in C++ (same messages as _check).
    return _call_entry(ext.linear, x, weight, bias, ts, fmt, sc, mdiv, algo, in_out, bool(training), grad_amax_sink,
                       _gemm_limit(min_gemm_size))


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
    grad_amax_sink: torch.Tensor | None = None,
    min_gemm_size: int | None = None,
) -> torch.Tensor:
    """FP8 linear: ``x @ W^T + bias`` with FP8 GEMMs and in-place scaling state.

    Args:
      x: (..., K) bfloat16/float16/float32; the output has x's dtype.
      weight: (N, K) for ``weight_layout="out_in"`` (nn.Linear), (K, N) for
        ``"in_out"`` (a Keras Dense kernel; no transpose copy is made).
      bias: optional (N,).
      state: FP8LinearState (updated in place when training with delayed scaling).
      fp8_format: "hybrid" (E4M3 forward, E5M2 gradient) or "e4m3".
      scaling: "delayed" (history-based, DESIGN.md) or "current" (each tensor's
        own amax; state scales serve as the fallback; nothing is recorded).
      training: False -> delayed scaling uses the state's current scales (seeded
        from the tensor when its history is empty) and records nothing.
      grad_amax_sink: optional 0-d float32 tensor with requires_grad=True; if
        given, the backward records nothing in the grad state and returns the
        gradient's amax (0 where non-finite) as this tensor's gradient.
      min_gemm_size: M*N*K below which the GEMMs run in the compute dtype (the
        FP8 state is still updated with the same values); default
        DEFAULT_MIN_GEMM_SIZE (env TORCH_OPS_FP8_MIN_GEMM_SIZE). On the C++
        fast path, while autograd records (and without a sink): with bf16 x
        and weight on sm_90, eagerly, our own GEMMs record x's and the
        weight's amaxes in the forward and the gradient's in the backward,
        as the FP8 path (docs/torch_ops.md); otherwise x's and the weight's
        amaxes are recorded together with the gradient's when the backward
        runs (one launch per step).
    """
    if FAST_PATH:
        out = _fast(x, weight, bias, state, fp8_format, scaling, margin, amax_compute_algo, weight_layout,
                    training, grad_amax_sink, min_gemm_size)
        if out is not None:
            return out
    return _fp8_linear(_KernelOps, _KernelFn, x, weight, bias, state, fp8_format, scaling, margin,
                       amax_compute_algo, weight_layout, training, grad_amax_sink, min_gemm_size)


def fp8_linear_python(x, weight, bias=None, *, state, fp8_format="hybrid", scaling="delayed", margin=0.0,
                      amax_compute_algo="max", weight_layout="out_in", training=True, grad_amax_sink=None,
                      min_gemm_size=None):
    """fp8_linear without the C++ fast path: the registered ops and a Python
    autograd.Function (what torch.compile traces). For tests and benchmarks."""
    return _fp8_linear(_KernelOps, _KernelFn, x, weight, bias, state, fp8_format, scaling, margin,
                       amax_compute_algo, weight_layout, training, grad_amax_sink, min_gemm_size)


def fp8_linear_emulated(x, weight, bias=None, *, state, fp8_format="hybrid", scaling="delayed", margin=0.0,
                        amax_compute_algo="max", weight_layout="out_in", training=True, grad_amax_sink=None,
                        min_gemm_size=0):
    """Reference fp8_linear on the pure emulation (no custom ops, no kernels).
    Defaults to min_gemm_size=0, i.e. always the FP8 path."""
    return _fp8_linear(_EmuOps, _EmuFn, x, weight, bias, state, fp8_format, scaling, margin, amax_compute_algo,
                       weight_layout, training, grad_amax_sink, min_gemm_size)


class _EmitToken(torch.autograd.Function):
    """Identity on `y` whose backward adds `[0, token, 0]` to `pending`'s
    gradient (fp8_linear returns the amax as the gradient of `pending[0]`)."""

    @staticmethod
    def forward(ctx, y, pending, token):
        ctx.save_for_backward(token)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        zero = torch.zeros_like(token)
        return grad, torch.stack([zero, token, zero]), None


class PrequantizedWeight:
    """A weight quantized ahead of its next training call (`prequantize_weight`).

    Holds the quantize's outputs (``q``, ``q_t``, the scale it used, the
    weight's amax) and the event its side stream recorded; ``used`` tells
    whether the call it was passed to took it. Used once: the
    call it is passed to records the amax into the kernel history as its
    own quantize would have, provided the weight and the kernel scale and
    history are the same tensors, unmodified since (version counters).
    """

    __slots__ = ("weight", "kernel_scale", "kernel_amax_history", "versions", "options", "tensors", "event", "used")

    def __init__(self, weight, kernel_scale, kernel_amax_history, options, tensors, event):
        self.weight = weight
        self.kernel_scale = kernel_scale
        self.kernel_amax_history = kernel_amax_history
        self.versions = (weight._version, kernel_scale._version, kernel_amax_history._version)
        self.options = options
        self.tensors = tensors
        self.event = event
        self.used = False

    def take(self, x, weight, kernel_scale, kernel_amax_history, options, training, min_gemm_size):
        """The four tensors for the C++ entry when this call may use them, else
        an empty list. Either way the current stream waits for the side stream
        (which read the weight and the state), and this object is spent."""
        torch.cuda.current_stream(weight.device).wait_event(self.event)
        tensors, self.tensors = self.tensors, None
        K = x.shape[-1] if x.dim() else 0
        small = K == 0 or (x.numel() // K) * (weight.numel() // K) * K < _gemm_limit(min_gemm_size)
        if (tensors is None or not training or small or weight is not self.weight
                or kernel_scale is not self.kernel_scale or kernel_amax_history is not self.kernel_amax_history
                or options != self.options
                or (weight._version, kernel_scale._version, kernel_amax_history._version) != self.versions):
            return []
        return list(tensors)


_side_streams = {}


def prequantize_weight(weight, state, *, margin=0.0, amax_compute_algo="max"):
    """Quantizes `weight` for its next training call, on a side stream.

    Delayed scaling quantizes the weight with the kernel scale the state holds
    now; a training step's optimizer update is the last change to the weight
    before the next forward. Called right after it, the quantize runs on a
    side stream, and the next `fp8_linear_folded(..., prequantized_weight=...)`
    records the weight's amax into the state instead of quantizing again.
    The state then advances exactly as without it; a weight or state modified
    in between (PyTorch in-place ops bump their version counters), another
    tensor, or a call that does not record (inference, below
    `min_gemm_size`) leaves it unused.

    Args:
      weight: The 2-D weight as the next call will receive it (contiguous,
        CUDA; either layout: both orientations are written).
      state: FP8LinearState, or its six tensors in field order.
      margin, amax_compute_algo: As the next call will use.

    Returns:
      A `PrequantizedWeight`, or None where the compiled kernels do not serve
      this weight (CPU, no FP8 GPU, torch.compile tracing, a tensor subclass,
      not contiguous).

    Raises:
      TypeError, ValueError: naming the argument (`state`, the weight or a
        state tensor, `amax_compute_algo`) that is not what is expected.

    Example:

    ```python
    optimizer.step()
    pre = torch_ops.linear.prequantize_weight(weight, state)
    ...
    y = fp8_linear_folded(x, weight, state=state, ..., prequantized_weight=pre)
    ```
    """
    tensors = tuple(state.tensors()) if isinstance(state, FP8LinearState) else state
    if not isinstance(tensors, (tuple, list)) or len(tensors) != 6:
        raise TypeError(f"state: expected an FP8LinearState or its six tensors, got {type(state).__name__}")
    kernel_scale, kernel_amax_history = tensors[2:4]
    return prequantize_weights([(weight, kernel_scale, kernel_amax_history)], margin=margin,
                               amax_compute_algo=amax_compute_algo)[0]


def _check_prequantize_item(i, item):
    """Raises naming `items[i]` where it is not a (weight, kernel_scale,
    kernel_amax_history) triple of the dtypes, ranks and device expected."""
    if not isinstance(item, (tuple, list)) or len(item) != 3:
        raise ValueError(f"items[{i}]: expected a (weight, kernel_scale, kernel_amax_history) triple, "
                         f"got {type(item).__name__}")
    w, scale, hist = item
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"items[{i}] weight: expected a 2-D tensor, got {getattr(w, 'shape', type(w))}")
    if w.dtype not in _FLOATS:
        raise TypeError(f"items[{i}] weight: expected bfloat16, float16 or float32, got {w.dtype}")
    for name, t, ok in (("kernel_scale", scale, lambda t: t.numel() == 1),
                        ("kernel_amax_history", hist, lambda t: t.dim() == 1)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device != w.device or not ok(t):
            what = "one element" if name == "kernel_scale" else "a 1-D history"
            raise ValueError(f"items[{i}] {name}: expected a float32 tensor of {what} on {w.device}, got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))} on "
                             f"{getattr(t, 'device', '?')}")


def prequantize_weights(items, *, margin=0.0, amax_compute_algo="max"):
    """`prequantize_weight` for many weights in one launch sequence.

    One side-stream switch, one event and one C++ call for all of them: at
    the end of a training step the host is the bottleneck, so what this
    costs the host is what decides whether it pays.

    Args:
      items: `(weight, kernel_scale, kernel_amax_history)` triples.
      margin, amax_compute_algo: As the next calls will use.

    Returns:
      A list with a `PrequantizedWeight` or None per item.

    Raises:
      TypeError, ValueError: naming `items[i]` (and which of its tensors) or
        `amax_compute_algo` where it is not what is expected.
    """
    check_options("hybrid", "delayed", amax_compute_algo)
    for i, item in enumerate(items):
        _check_prequantize_item(i, item)
    result = [None] * len(items)
    if not items:
        return result
    ext = _fast_ext(items[0][0], items[0][0])
    args = None if ext is None else _fast_args("hybrid", "delayed", margin, amax_compute_algo, "out_in")
    if args is None:
        return result
    device = items[0][0].device
    take = [i for i, (w, s, h) in enumerate(items)
            if type(w) in (_T, _P) and type(s) in (_T, _P) and type(h) in (_T, _P) and w.device == device
            and w.dim() == 2 and w.is_contiguous() and w.numel() > 0]
    if not take:
        return result
    main = torch.cuda.current_stream(device)
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams.setdefault(device, torch.cuda.Stream(device))
    side.wait_stream(main)
    with torch.cuda.stream(side):
        outs = ext.prequantize([items[i][0] for i in take], [items[i][1] for i in take],
                               [items[i][2] for i in take], args[2], args[3], main.cuda_stream)
        event = torch.cuda.Event()
        event.record(side)
    options = (args[2], args[3])
    for i, tensors in zip(take, outs):
        w, s, h = items[i]
        result[i] = PrequantizedWeight(w, s, h, options, tensors, event)
    return result


def _fp8_linear_folded_python(x, weight, bias, state, pending, fold_state, fp8_format, margin, amax_compute_algo,
                              window, weight_layout, training, min_gemm_size):
    if fp8_format not in _FORMATS:
        raise ValueError(f"fp8_format: expected one of {_FORMATS}, got {fp8_format!r}")
    # Checked whether or not this call folds (the C++ entry checks them always).
    check_channel(pending, fold_state)
    if window is not None and window < 1:
        raise ValueError(f"window: expected >= 1, got {window}")
    s = state if isinstance(state, FP8LinearState) else FP8LinearState(*state)
    token = None
    if training:
        token, grad_scale, grad_history = fold_pending_grad_amax(
            pending, fold_state, s.grad_amax_history, s.grad_scale, E5M2 if fp8_format == "hybrid" else E4M3,
            margin=margin, amax_compute_algo=amax_compute_algo, window=window,
        )
        s = FP8LinearState(s.input_scale, s.input_amax_history, s.kernel_scale, s.kernel_amax_history, grad_scale,
                           grad_history)
    sink = pending.requires_grad and torch.is_grad_enabled()
    y = fp8_linear(
        x, weight, None if bias is None else bias.to(x.dtype), state=s, fp8_format=fp8_format, scaling="delayed",
        margin=margin, amax_compute_algo=amax_compute_algo, weight_layout=weight_layout, training=bool(training),
        grad_amax_sink=pending[0] if sink else None, min_gemm_size=min_gemm_size,
    )
    if not sink:
        return y
    if token is None:
        token = torch.zeros((), dtype=torch.float32, device=x.device)
    return _EmitToken.apply(y, pending, token)


def fp8_linear_folded(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    state,
    pending: torch.Tensor,
    fold_state: torch.Tensor,
    fp8_format: str = "hybrid",
    margin: float = 0.0,
    amax_compute_algo: str = "max",
    window: int | None = None,
    weight_layout: str = "out_in",
    training: bool = True,
    min_gemm_size: int | None = None,
    prequantized_weight: PrequantizedWeight | None = None,
) -> torch.Tensor:
    """fp8_linear (delayed scaling) whose output gradient's amax leaves through
    a gradient channel instead of the grad state: the Keras layers' call.

    When training, first ``fold_pending_grad_amax(pending, fold_state, ...)``
    folds the last backward's pending amax into the grad state (in place) and
    gives this call's token; the call then runs on the fold's snapshots of the
    grad scale and history. When ``pending.requires_grad`` (and grad mode is
    on), the backward records nothing in the grad state and returns
    ``[amax of the output gradient (0 where not finite), token, 0]`` as
    ``pending``'s gradient (token 0 when not training). The bias is added in
    x's dtype and its gradient is rounded to x's dtype (as if the caller had
    cast it with ``bias.to(x.dtype)``).

    On plain CUDA tensors outside torch.compile this is one C++ call
    (csrc/linear.cpp, ``linear_folded``); elsewhere the same ops run from
    Python (fold_pending_grad_amax, fp8_linear, a token node), with the same
    state, outputs and gradients.

    Args:
      x, weight, bias, fp8_format, margin, amax_compute_algo, weight_layout,
        training, min_gemm_size: as in ``fp8_linear``.
      state: FP8LinearState, or its six tensors in field order.
      pending: (3,) float32 ``[amax, token, loss_scale]`` (read only).
      fold_state: (3,) float32 ``[folds, last_token, last_loss_scale]``,
        updated in place when training.
      window: as in ``fold_pending_grad_amax`` (default: the whole history).
      prequantized_weight: optional ``prequantize_weight(weight, state, ...)``
        result: used (once) where it still matches this call, see there.
    """
    if prequantized_weight is not None and not isinstance(prequantized_weight, PrequantizedWeight):
        raise TypeError("prequantized_weight: expected None or prequantize_weight's PrequantizedWeight, got "
                        f"{type(prequantized_weight).__name__}")
    if FAST_PATH and (window is None or window >= 1):
        ext = _fast_ext(x, weight)
        args = None if ext is None else _fast_args(fp8_format, "delayed", margin, amax_compute_algo, weight_layout)
        if args is not None:
            if type(state) is FP8LinearState:
                s = state
                state = (s.input_scale, s.input_amax_history, s.kernel_scale, s.kernel_amax_history, s.grad_scale,
                         s.grad_amax_history)
            pre = [] if prequantized_weight is None else prequantized_weight.take(
                x, weight, state[2], state[3], (args[2], args[3]), training, min_gemm_size)
            out = _call_entry(ext.linear_folded, x, weight, bias, pending, fold_state, state, args[0], args[2],
                              args[3], 0 if window is None else int(window), args[4], bool(training),
                              _gemm_limit(min_gemm_size), pre)
            if out is not None:
                if pre:
                    prequantized_weight.used = True
                return out
    if prequantized_weight is not None and prequantized_weight.tensors is not None:
        prequantized_weight.take(x, weight, None, None, None, False, min_gemm_size)  # orders it; unused
    return _fp8_linear_folded_python(x, weight, bias, state, pending, fold_state, fp8_format, margin,
                                     amax_compute_algo, window, weight_layout, training, min_gemm_size)
