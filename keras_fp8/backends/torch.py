"""FP8 matmul for the torch backend.

On a CUDA GPU with FP8 tensor cores (sm_89+) and the compiled `torch_ops`
kernels available, the quantize and GEMM steps run there; elsewhere the exact
emulation of `emulation.py` runs (with a one-time warning on a CUDA GPU that
lacks FP8 or the compiled kernels). `torch_ops` is imported lazily, here only.
"""

import functools
import warnings

import torch

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
