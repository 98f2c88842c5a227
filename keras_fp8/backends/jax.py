"""FP8 matmul for the JAX backend.

On an FP8-capable GPU (compute capability >= 8.9) the quantized operands go
straight into `jax.lax.dot_general` (the product in the output dtype, see
`GEMM_OUTPUT`), so XLA emits cuBLASLt FP8 GEMMs for the forward and both
backward products.
Elsewhere the exact emulation of `emulation.py` runs.

The gradient state cannot be assigned inside a JAX backward pass; the output
gradient's amax leaves through the cotangent of `grad_amax_pending`.
"""

import functools
import os

import jax
import jax.numpy as jnp

from keras_fp8.backends import emulation


@functools.lru_cache(maxsize=None)
def fp8_gemm_supported():
    """True when the default JAX device is a GPU with FP8 tensor cores."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    if device.platform != "gpu":
        return False
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        return False
    major, minor = (int(v) for v in str(capability).split(".")[:2])
    return (major, minor) >= (8, 9)


# Where the FP8 GEMMs of a bf16/fp16 output write their product: "compute"
# (default: the GEMM writes the output dtype, and the scale is applied to
# that in float32 with one more rounding to the output dtype) or "float32"
# (a float32 product, then scaled and cast in one more pass over a float32
# matrix: one rounding, more memory traffic). On the H200 the model
# benchmark ran at 136.4 ms/step with "compute" and 139.6 ms with "float32"
# (docs/benchmarks.md). Read at import.
GEMM_OUTPUT = os.environ.get("KERAS_FP8_JAX_GEMM_OUTPUT", "compute")
if GEMM_OUTPUT not in ("float32", "compute"):
    raise ValueError(
        "KERAS_FP8_JAX_GEMM_OUTPUT: expected 'float32' or 'compute', got "
        f"{GEMM_OUTPUT!r}"
    )


def _rewrite_size_threshold():
    """XLA's `xla_gpu_gemm_rewrite_size_threshold` as set in `XLA_FLAGS`
    (default 100)."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.lstrip("-").partition("=")
        if name == "xla_gpu_gemm_rewrite_size_threshold" and value.isdigit():
            return int(value)
    return 100


# XLA leaves a dot whose two operand matrices hold fewer than
# `xla_gpu_gemm_rewrite_size_threshold` elements to its loop emitter, which
# multiplies in the operand type: FP8 operands then overflow (the products of
# a delayed-scaled E4M3 and E5M2 value exceed both formats' range) and the
# result holds inf and NaN. Below this many operand elements (or XLA's
# threshold, if larger) the operands are upcast to float32 first, which is
# exact (the emulation's product); FP8 buys nothing at such sizes.
SMALL_DOT_ELEMENTS = 16384


def is_small_dot(m, k, n):
    """Whether an `(m, k) @ (k, n)` FP8 product runs upcast (see
    `SMALL_DOT_ELEMENTS`)."""
    return m * k + k * n < max(SMALL_DOT_ELEMENTS, _rewrite_size_threshold())


def _xla_fp8_matmul(a_q, b_q, scale, out_dtype):
    """`(a_q @ b_q) * scale` with FP8 operands handed to XLA directly
    (upcast to float32 for the small products of `is_small_dot`)."""
    if is_small_dot(a_q.shape[0], a_q.shape[1], b_q.shape[1]):
        return emulation.scaled_matmul(a_q, b_q, scale, out_dtype)
    out_dtype = jnp.dtype(out_dtype)
    narrow = GEMM_OUTPUT == "compute" and out_dtype.itemsize < 4
    product = jax.lax.dot_general(
        a_q,
        b_q,
        dimension_numbers=(((1,), (0,)), ((), ())),
        preferred_element_type=out_dtype if narrow else jnp.float32,
    )
    return (product.astype(jnp.float32) * scale).astype(out_dtype)


def _matmul():
    return _xla_fp8_matmul if fp8_gemm_supported() else emulation.scaled_matmul


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _fp8_matmul(
    x, kernel, pending, x_scale, kernel_scale, grad_scale, grad_history,
    emit_token, recipe,
):
    y, _, _ = emulation.forward(
        x, kernel, x_scale, kernel_scale, recipe, matmul=_matmul()
    )
    return y


def _fp8_matmul_fwd(
    x, kernel, pending, x_scale, kernel_scale, grad_scale, grad_history,
    emit_token, recipe,
):
    y, x_q, kernel_q = emulation.forward(
        x, kernel, x_scale, kernel_scale, recipe, matmul=_matmul()
    )
    residuals = (
        x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history,
        emit_token, jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype),
    )
    return y, residuals


def _fp8_matmul_bwd(recipe, residuals, grad):
    (x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history,
     emit_token, x_proto, kernel_proto) = residuals
    dx, dkernel, dpending = emulation.backward(
        grad, x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history,
        emit_token, recipe, x_proto.dtype, kernel_proto.dtype,
        matmul=_matmul(),
    )
    zeros = jnp.zeros_like
    return (
        dx, dkernel, dpending, zeros(x_scale), zeros(kernel_scale),
        zeros(grad_scale), zeros(grad_history), zeros(emit_token),
    )


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def fp8_matmul(
    x, kernel, grad_amax_pending, x_scale, kernel_scale, grad_scale,
    grad_history, emit_token, *, recipe,
):
    """See `keras_fp8.backends`."""
    return _fp8_matmul(
        x, kernel, grad_amax_pending, x_scale, kernel_scale, grad_scale,
        grad_history, emit_token, recipe,
    )
