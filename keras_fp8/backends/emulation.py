"""The exact FP8 matmul emulation, in `keras.ops` (any backend, any device).

FP8 values dequantize exactly to float32 and float32 products of two FP8
values are exact, so a float32 matmul of the dequantized operands followed by
the product of the two scales reproduces what an FP8 GEMM with float32
accumulation computes (up to the accumulation order).
"""

from keras import ops

from keras_fp8 import scaling


def scaled_matmul(a_q, b_q, scale, out_dtype):
    """Returns `(a_q @ b_q) * scale` in `out_dtype`, accumulated in float32.

    Args:
        a_q: `(M, K)` FP8 tensor.
        b_q: `(K, N)` FP8 tensor.
        scale: float32 scalar, the product of the two operands' scales.
        out_dtype: Output dtype.
    """
    product = ops.matmul(ops.cast(a_q, "float32"), ops.cast(b_q, "float32"))
    return ops.cast(ops.multiply(product, scale), out_dtype)


def forward(x, kernel, x_scale, kernel_scale, recipe, matmul=scaled_matmul):
    """Quantizes both operands and multiplies them.

    Returns:
        `(y, x_q, kernel_q)`.
    """
    fmt = recipe.forward_format
    x_q = scaling.quantize(x, x_scale, fmt)
    kernel_q = scaling.quantize(kernel, kernel_scale, fmt)
    y = matmul(x_q, kernel_q, ops.multiply(x_scale, kernel_scale), x.dtype)
    return y, x_q, kernel_q


def backward(
    grad,
    x_q,
    kernel_q,
    x_scale,
    kernel_scale,
    grad_scale,
    grad_history,
    emit_token,
    recipe,
    x_dtype,
    kernel_dtype,
    matmul=scaled_matmul,
):
    """The backward pass: one quantized gradient for both gradient matmuls.

    Returns:
        `(dx, dkernel, dpending)`.
    """
    fmt = recipe.backward_format
    amax = scaling.compute_amax(grad)
    scale = scaling.backward_scale(amax, grad_history, grad_scale, fmt, recipe)
    grad_q = scaling.quantize(grad, scale, fmt)
    dx = matmul(
        grad_q,
        ops.transpose(kernel_q),
        ops.multiply(scale, kernel_scale),
        x_dtype,
    )
    dkernel = matmul(
        ops.transpose(x_q), grad_q, ops.multiply(x_scale, scale), kernel_dtype
    )
    finite_amax = ops.where(ops.isfinite(amax), amax, ops.zeros_like(amax))
    dpending = ops.stack(
        [finite_amax, ops.cast(emit_token, "float32"), ops.zeros_like(amax)]
    )
    return dx, dkernel, dpending
