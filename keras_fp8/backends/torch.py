"""FP8 matmul for the torch backend.

On a CUDA GPU with FP8 tensor cores (sm_89+) and the compiled `torch_ops`
kernels available, the quantize and GEMM steps run there; elsewhere the exact
emulation of `emulation.py` runs (with a one-time warning on a CUDA GPU that
lacks FP8 or the compiled kernels). `torch_ops` is imported lazily, here only.
"""

import functools
import warnings

import numpy as np
import torch

from keras_fp8 import recipes
from keras_fp8.backends import emulation


@functools.lru_cache(maxsize=None)
def _torch_ops_if_usable(device_index):
    """Returns the `torch_ops` module if it can run on this CUDA device."""
    major, minor = torch.cuda.get_device_capability(device_index)
    reason = None
    if (major, minor) < (8, 9):
        reason = f"compute capability {major}.{minor} has no FP8 tensor cores"
    else:
        try:
            import torch_ops
        except ImportError as e:
            reason = f"torch_ops could not be imported ({e})"
        else:
            if torch_ops.is_available():
                return torch_ops
            reason = torch_ops.unavailable_reason()
    warnings.warn(
        "keras_fp8: running the exact FP8 emulation on "
        f"{torch.cuda.get_device_name(device_index)}: {reason}.",
        stacklevel=3,
    )
    return None


def _kernels_for(tensor):
    if tensor.device.type != "cuda":
        return None
    return _torch_ops_if_usable(tensor.device.index or 0)


def _cuda_scaled_matmul(torch_ops):
    def matmul(a_q, b_q, scale, out_dtype):
        # cuBLASLt wants both operands K-contiguous: b as (N, K).
        one = torch.ones((), dtype=torch.float32, device=a_q.device)
        out = torch_ops.fp8_gemm(
            a_q.contiguous(), b_q.t().contiguous(), scale, one,
            out_dtype=_torch_dtype(out_dtype),
        )
        return out

    return matmul


def _torch_dtype(dtype):
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, str(dtype))


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, kernel, pending, x_scale, kernel_scale, grad_scale,
        grad_history, emit_token, recipe, matmul,
    ):
        y, x_q, kernel_q = emulation.forward(
            x, kernel, x_scale, kernel_scale, recipe, matmul=matmul
        )
        ctx.save_for_backward(
            x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history,
            emit_token,
        )
        ctx.recipe = recipe
        ctx.matmul = matmul
        ctx.dtypes = (x.dtype, kernel.dtype)
        return y

    @staticmethod
    def backward(ctx, grad):
        (x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history,
         emit_token) = ctx.saved_tensors
        dx, dkernel, dpending = emulation.backward(
            grad.contiguous(), x_q, kernel_q, x_scale, kernel_scale,
            grad_scale, grad_history, emit_token, ctx.recipe, *ctx.dtypes,
            matmul=ctx.matmul,
        )
        return (dx, dkernel, dpending) + (None,) * 7


class _EmitToken(torch.autograd.Function):
    """Identity on `y` whose backward adds `[0, token, 0]` to the pending grad.

    `torch_ops.fp8_linear` returns the output gradient's amax as the gradient
    of `pending[0]`; this adds the fold token in `pending[1]`.
    """

    @staticmethod
    def forward(ctx, y, pending, token):
        ctx.save_for_backward(token)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        zero = torch.zeros_like(token)
        dpending = torch.stack([zero, token, zero])
        return grad, dpending, None


_FOLD_COUNT_PERIOD = 2.0**20


@torch.no_grad()
def fold_pending_grad_amax(layer, recipe):
    """`FP8StateMixin._fold_pending_grad_amax` in plain torch ops, in place.

    The same float32 operations in the same order (bit-identical state), but
    without Keras's per-op conversions of Python scalars to device tensors,
    which cost milliseconds of host time per call on a GPU.

    Returns:
        The 0-d token this call's backward emits.
    """
    from keras_fp8 import scaling

    pending = layer.grad_amax_pending.value.detach()
    fold_state = layer.grad_fold_state.value
    history = layer.grad_amax_history.value
    scale = layer.grad_scale.value
    amax, token, loss_scale = pending[0], pending[1], pending[2]
    folds, last_token, last_loss_scale = fold_state[0], fold_state[1], fold_state[2]
    one = torch.ones_like(loss_scale)
    rescale = torch.where(
        (loss_scale > 0) & (last_loss_scale > 0),
        loss_scale / torch.clamp_min(last_loss_scale, 1e-30),
        one,
    )
    history.mul_(rescale)
    scale.mul_(rescale)
    new_last_loss_scale = torch.where(loss_scale > 0, loss_scale, last_loss_scale)
    fresh = (token > 0) & (token != last_token)
    record = fresh & torch.isfinite(amax) & (amax > 0)
    shifted = torch.cat([amax.reshape(1), history[:-1]])
    history.copy_(torch.where(record, shifted, history))
    if not isinstance(recipe, recipes.CurrentScaling):
        if recipe.amax_compute_algo == "most_recent":
            window = history[0]
        else:
            window = history[: recipe.history_len].amax()
        # Python scalars go to the kernel as float32 arguments: no host to
        # device copy (a pageable copy would synchronize the stream).
        new = (window * float(scaling.inverse_format_max(recipe.backward_format))) * float(
            np.float32(2.0 ** -float(recipe.margin))
        )
        usable = torch.isfinite(window) & (window > 0)
        scale.copy_(torch.where(fresh & usable, new, scale))
    new_folds = torch.where(
        fresh, torch.remainder(folds + 1.0, _FOLD_COUNT_PERIOD), folds
    )
    fold_state.copy_(
        torch.stack([new_folds, torch.where(fresh, token, last_token), new_last_loss_scale])
    )
    return new_folds + 1.0


def fused_fp8_matmul(layer, x, kernel, bias, recipe, training, min_gemm_size):
    """`x @ kernel (+ bias)` through `torch_ops.fp8_linear`, or None.

    Runs when the compiled kernels can serve `x`'s device. The layer's Keras
    variables are the kernels' state buffers: the fused quantize kernels
    update the input and kernel histories and scales in place (no copies, no
    host sync); the output gradient's amax and the fold token return through
    the gradient of `grad_amax_pending`, exactly as on the emulated path.

    Args:
        layer: The FP8 layer (its state variables and fold logic are used).
        x: `(M, K)` tensor in the compute dtype.
        kernel: `(K, N)` float32 kernel (the variable's own tensor).
        bias: Optional `(N,)` bias variable (read in the compute dtype),
            fused in the GEMM.
        recipe: The call's recipe.
        training: Whether amaxes are recorded.
        min_gemm_size: `M*N*K` below which the GEMMs run in the compute dtype
            (None: `torch_ops.DEFAULT_MIN_GEMM_SIZE`).

    Returns:
        The `(M, N)` output, or None when the kernels cannot run here.
    """
    torch_ops = _kernels_for(x)
    if torch_ops is None or isinstance(recipe, recipes.CurrentScaling):
        # torch_ops does not publish current-scaling scales; the generic path
        # (torch_ops GEMMs, keras.ops state) keeps the Keras semantics.
        return None
    if training:
        token = fold_pending_grad_amax(layer, recipe)
    else:
        token = torch.zeros((), dtype=torch.float32, device=x.device)
    state = torch_ops.FP8LinearState(
        input_scale=layer.input_scale.value,
        input_amax_history=layer.input_amax_history.value,
        kernel_scale=layer.kernel_scale.value,
        kernel_amax_history=layer.kernel_amax_history.value,
        # Read only (the gradient amax leaves through the sink), but saved
        # for the backward: copies, so that a second call of the layer in the
        # same step may fold into the variables in place.
        grad_scale=layer.grad_scale.value.clone(),
        grad_amax_history=layer.grad_amax_history.value.clone(),
    )
    pending = layer._raw_value(layer.grad_amax_pending)
    y = torch_ops.fp8_linear(
        x,
        kernel,
        None if bias is None else bias.value,
        state=state,
        fp8_format=recipe.fp8_format,
        scaling=recipe.name,
        margin=float(recipe.margin),
        amax_compute_algo=getattr(recipe, "amax_compute_algo", "max"),
        weight_layout="in_out",
        training=bool(training),
        grad_amax_sink=pending[0] if pending.requires_grad else None,
        min_gemm_size=min_gemm_size,
    )
    if not pending.requires_grad:
        return y
    return _EmitToken.apply(y, pending, token.detach())


def fp8_matmul(
    x, kernel, grad_amax_pending, x_scale, kernel_scale, grad_scale,
    grad_history, emit_token, *, recipe,
):
    """See `keras_fp8.backends`."""
    kernels = _kernels_for(x)
    matmul = (
        emulation.scaled_matmul if kernels is None
        else _cuda_scaled_matmul(kernels)
    )
    return _FP8Matmul.apply(
        x, kernel, grad_amax_pending, x_scale, kernel_scale, grad_scale,
        grad_history, emit_token, recipe, matmul,
    )
