"""FP8 matmuls for the JAX backend.

The state updates are `keras_fp8.numerics`' rules on the layer's variables
(assignments inside `stateless_call` propagate). On an FP8-capable GPU
(compute capability >= 8.9) the quantized operands go straight into
`jax.lax.dot_general`, so XLA emits cuBLASLt FP8 GEMMs for the forward and
both backward products (the product in the output dtype, scaled in a
second pass). By default (`jax_gemm.enabled()`) a layer runs torch_ops's
fused quantize and cuBLASLt FP8 GEMM instead, as XLA custom calls (one
read of each operand for both layouts and the amax; the scales and the
bias in the GEMM's epilogue, one rounding), where they apply
(`_fused_applies`; products they do not take run XLA's dot, or the GEMM
custom call alone where it applies). Elsewhere the exact emulation
(`numerics.scaled_matmul`) runs.

A variable cannot be assigned inside a JAX backward pass: the output
gradient's amax leaves through the cotangent of `grad_amax_pending`, which
the optimizer overwrites, and the next training forward folds it.
"""

import functools
import os

import jax
import jax.numpy as jnp
import keras
from keras import ops

from keras_fp8 import compat
from keras_fp8 import numerics
from keras_fp8 import recipes
from keras_fp8.backends import jax_gemm

# Below this M*N*K an FP8 layer on a GPU with real FP8 GEMMs runs what the
# compute-dtype layer runs (torch_ops's threshold, the same GEMM libraries
# underneath).
DEFAULT_MIN_GEMM_SIZE = 8192 * 2048 * 2048


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


def prepare_device(tensor):
    """Builds and checks the custom calls (`jax_gemm.available`,
    `jax_gemm.quantize_available`) in eager code, on an FP8 GPU, so that
    the first traced product does not."""
    if fp8_gemm_supported() and jax_gemm.enabled():
        jax_gemm.available()
        jax_gemm.quantize_available()


def default_min_gemm_size(x):
    """See `keras_fp8.backends`: FP8 at every size under the emulation."""
    return DEFAULT_MIN_GEMM_SIZE if fp8_gemm_supported() else 0


def _rewrite_size_threshold():
    """XLA's `xla_gpu_gemm_rewrite_size_threshold` as set in `XLA_FLAGS`
    (default 100)."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.lstrip("-").partition("=")
        if name == "xla_gpu_gemm_rewrite_size_threshold" and value.isascii() and value.isdigit():
            return int(value)
    return 100


# XLA leaves a dot whose two operand matrices hold fewer than
# `xla_gpu_gemm_rewrite_size_threshold` elements to its loop emitter, which
# multiplies in the operand type: FP8 operands then overflow (the products of
# a delayed-scaled E4M3 and E5M2 value exceed both formats' range) and the
# result holds inf and NaN. Below this many operand elements (or XLA's
# threshold, if larger) the operands are upcast to float32 first, which is
# exact (the emulation's product).
SMALL_DOT_ELEMENTS = 16384


def is_small_dot(m, k, n):
    """Whether an `(m, k) @ (k, n)` FP8 product runs upcast (see
    `SMALL_DOT_ELEMENTS`). Symbolic sizes (Keras's shape inference) are
    not small: the output spec is the same either way."""
    if recipes.gemm_size((m, k, n)) is None:
        return False
    return m * k + k * n < max(SMALL_DOT_ELEMENTS, _rewrite_size_threshold())


def _custom_calls_allowed():
    """Whether `jax_gemm`'s custom calls may run here: enabled, an FP8 GPU,
    and no Keras distribution (XLA's SPMD partitioner knows how to split its
    own dot, not a custom call: it would gather the operands)."""
    return jax_gemm.enabled() and fp8_gemm_supported() and keras.distribution.distribution() is None


def _custom_call_applies(a_q, b_q, out_dtype):
    """Whether this product runs `jax_gemm`'s GEMM custom call: allowed
    (`_custom_calls_allowed`), shapes it takes, and available."""
    return _custom_calls_allowed() and jax_gemm.supports(a_q, b_q, out_dtype) and jax_gemm.available()


def _xla_fp8_matmul(a_q, b_q, scale, out_dtype, bias=None, precision=None):
    """`(a_q @ b_q) * scale (+ bias)` with FP8 operands handed to XLA directly:
    the GEMM writes the output dtype; the scale and bias are applied to that
    in float32 (one fused pass). `precision=None` lets cuBLASLt accumulate
    in its fast FP8 mode; `Precision.HIGHEST` turns that off."""
    if is_small_dot(a_q.shape[0], a_q.shape[1], b_q.shape[1]):
        return numerics.scaled_matmul(a_q, b_q, scale, out_dtype, bias)
    out_dtype = jnp.dtype(out_dtype)
    product = jax.lax.dot_general(
        a_q, b_q, dimension_numbers=(((1,), (0,)), ((), ())), precision=precision,
        preferred_element_type=out_dtype if out_dtype.itemsize < 4 else jnp.float32,
    )
    y = product.astype(jnp.float32) * scale
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def _gpu_fp8_matmul(a_q, b_q, scale, out_dtype, bias=None, precision=None):
    """An FP8 product on the GPU: `jax_gemm`'s custom call where it applies
    (`_custom_call_applies`), else `_xla_fp8_matmul`. `precision` as
    there: None or DEFAULT is cuBLASLt's fast accumulation."""
    if not is_small_dot(a_q.shape[0], a_q.shape[1], b_q.shape[1]) and _custom_call_applies(a_q, b_q, out_dtype):
        fast = precision is None or precision == jax.lax.Precision.DEFAULT
        # The first operand is written as it is before any transpose of it
        # (see _fp8_matmul_bwd).
        a_q = jax.lax.optimization_barrier(a_q)
        return jax_gemm.scaled_matmul(a_q, b_q, scale, out_dtype, bias, fast_accum=fast)
    return _xla_fp8_matmul(a_q, b_q, scale, out_dtype, bias, precision)


def _matmul():
    return _gpu_fp8_matmul if fp8_gemm_supported() else numerics.scaled_matmul


def _backward_matmul():
    """The backward's two products accumulate in full, as the GEMM contract
    asks (docs/design.md, numerics): the custom call without fast
    accumulation; XLA enables cuBLASLt's fast FP8 accumulation for every
    FP8 dot at the default precision, and at `Precision.HIGHEST` keeps the
    FP8 GEMM and accumulates in full."""
    if fp8_gemm_supported():
        return functools.partial(_gpu_fp8_matmul, precision=jax.lax.Precision.HIGHEST)
    return numerics.scaled_matmul


def keep_rounding(q):
    """`q` behind an optimization barrier, so that XLA cannot fold the
    conversion that made it (to FP8) and the one that widens it into one
    (`SimplifyFPConversions` on a GPU): the widened values are then FP8
    values, as on every other path (`keras_fp8.backends.keep_rounding`)."""
    return jax.lax.optimization_barrier(q)


def _as_stored(x):
    """`x` rounded to its own dtype. XLA on a GPU may hand a 16-bit value
    that a fusion computes in float32 on unrounded
    (`xla_allow_excess_precision`, on by default); the amax and the
    quantization must see the value the dtype holds, as every other path
    does (docs/design.md, numerics)."""
    dtype = jnp.dtype(x.dtype)
    if dtype.itemsize >= 4 or not jnp.issubdtype(dtype, jnp.floating):
        return x
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _bias_grad(grad, has_bias, bias_proto):
    """The bias gradient: summed in float32, rounded to the output's dtype
    (as the torch backend's fused bias rounds it); a placeholder without
    a bias."""
    if not has_bias:
        return jnp.zeros((), bias_proto.dtype)
    return _as_stored(jnp.sum(grad.astype(jnp.float32), axis=0).astype(grad.dtype)).astype(bias_proto.dtype)


# `bias` is a `(N,)` tensor where `has_bias`, else an unused placeholder.
@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _fp8_matmul(x, kernel, bias, pending, x_scale, kernel_scale, grad_scale, grad_history, emit_token, recipe,
                has_bias):
    y, _, _ = numerics.fp8_forward(x, kernel, x_scale, kernel_scale, recipe, bias if has_bias else None,
                                   matmul=_matmul())
    return y


def _fp8_matmul_fwd(x, kernel, bias, pending, x_scale, kernel_scale, grad_scale, grad_history, emit_token, recipe,
                    has_bias):
    y, x_q, kernel_q = numerics.fp8_forward(x, kernel, x_scale, kernel_scale, recipe, bias if has_bias else None,
                                            matmul=_matmul())
    residuals = (x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history, emit_token,
                 jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype), jnp.zeros((), bias.dtype))
    return y, residuals


def _fp8_matmul_bwd(recipe, has_bias, residuals, grad):
    grad = _as_stored(grad)
    (x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history, emit_token, x_proto, kernel_proto,
     bias_proto) = residuals
    if fp8_gemm_supported() and jax_gemm.enabled():
        # The backward transposes the saved FP8 operands. Left free, XLA
        # fuses those transposes into the forward's quantize (reading x
        # again and keeping x_q and its transpose alive from the forward
        # on, and, for the output gradient, deriving the row-major copy
        # from the transposed one): the barrier makes each transpose a copy
        # of the one-byte array.
        x_q, kernel_q = jax.lax.optimization_barrier((x_q, kernel_q))
    dx, dkernel, dpending = numerics.fp8_backward(
        grad, x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history, emit_token, recipe,
        x_proto.dtype, kernel_proto.dtype, matmul=_backward_matmul(),
    )
    dbias = _bias_grad(grad, has_bias, bias_proto)
    zeros = jnp.zeros_like
    return (dx, dkernel, dbias, dpending, zeros(x_scale), zeros(kernel_scale), zeros(grad_scale),
            zeros(grad_history), zeros(emit_token))


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def _fold_grad_state(layer, recipe, training):
    """A training call folds the last backward's pending gradient amax into
    the gradient state (`numerics.fold_pending_grad_amax`).

    Returns:
        `(grad_history, grad_scale, emit_token)` for this call's backward.
    """
    if not training:
        return layer.grad_amax_history.value, layer.grad_scale.value, ops.zeros((), "float32")
    pending = ops.stop_gradient(compat.raw_value(layer.grad_amax_pending))
    grad_history, grad_scale, fold_state, emit_token = numerics.fold_pending_grad_amax(
        pending, layer.grad_fold_state.value, layer.grad_amax_history.value, layer.grad_scale.value,
        recipe.backward_format, recipe)
    layer.grad_amax_history.assign(grad_history)
    layer.grad_scale.assign(grad_scale)
    layer.grad_fold_state.assign(fold_state)
    return grad_history, grad_scale, emit_token


# --------------------------------------------------------------------------- block scaling
def _block_matmul_impl():
    if fp8_gemm_supported():
        from keras_fp8.backends import jax_block

        return _upcast_small(jax_block.gpu_block_matmul)
    return numerics.block_matmul


def _upcast_small(gpu_matmul):
    """`gpu_matmul`, except for dots small enough that XLA multiplies them in
    the operand type (`is_small_dot`): those run the exact emulation."""

    def matmul(a_q, a_scales, b_q, b_scales, out_dtype, bias=None, b_tiles=False):
        if is_small_dot(a_q.shape[0], min(a_q.shape[1], numerics.BLOCK), b_q.shape[1]):
            return numerics.block_matmul(a_q, a_scales, b_q, b_scales, out_dtype, bias, b_tiles)
        return gpu_matmul(a_q, a_scales, b_q, b_scales, out_dtype, bias, b_tiles)

    return matmul


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _block_fp8_matmul(x, kernel, bias, pending, emit_token, recipe, has_bias):
    y, _ = numerics.block_forward(x, kernel, recipe, bias if has_bias else None, matmul=_block_matmul_impl())
    return y


def _block_fp8_matmul_fwd(x, kernel, bias, pending, emit_token, recipe, has_bias):
    y, residuals = numerics.block_forward(x, kernel, recipe, bias if has_bias else None,
                                          matmul=_block_matmul_impl())
    protos = (jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype), jnp.zeros((), bias.dtype))
    return y, (residuals, emit_token, protos)


def _block_fp8_matmul_bwd(recipe, has_bias, saved, grad):
    grad = _as_stored(grad)
    residuals, emit_token, (x_proto, kernel_proto, bias_proto) = saved
    dx, dkernel, dpending = numerics.block_backward(grad, residuals, emit_token, recipe, x_proto.dtype,
                                                    kernel_proto.dtype, matmul=_block_matmul_impl())
    return dx, dkernel, _bias_grad(grad, has_bias, bias_proto), dpending, jnp.zeros_like(emit_token)


_block_fp8_matmul.defvjp(_block_fp8_matmul_fwd, _block_fp8_matmul_bwd)


def _block_matmul_call(layer, x, kernel, bias, recipe, training):
    """The block-scaled matmul: no input or kernel state; the gradient channel
    still carries the output gradient's amax (recorded by the fold)."""
    _, _, emit_token = _fold_grad_state(layer, recipe, training)
    has_bias = bias is not None
    bias_value = ops.cast(bias, x.dtype) if has_bias else jnp.zeros((), x.dtype)
    return _block_fp8_matmul(x, kernel, bias_value, compat.raw_value(layer.grad_amax_pending),
                             ops.stop_gradient(emit_token), recipe, has_bias)


# --------------------------------------------------------------------------- the fused path (custom calls)
def _scale_mode(recipe):
    """The quantize custom call's scale mode of a per-tensor recipe."""
    return "current" if isinstance(recipe, recipes.CurrentScaling) else "delayed"


def _fused_applies(x, kernel, recipe):
    """Whether a layer's product runs the fused path (`_fused_fp8_matmul`):
    the custom calls allowed (`_custom_calls_allowed`) and available, M, K
    and N positive multiples of 16 (each is the contraction of one of the
    three GEMMs), not a small dot, 16- or 32-bit float operands, and no
    E5M2 x E5M2 product."""
    if not _custom_calls_allowed():
        return False
    if isinstance(recipe, recipes.BlockScaling) or recipes.E5M2 == recipe.forward_format:
        return False
    m, k = x.shape
    n = kernel.shape[1]
    if not all(isinstance(v, int) and v > 0 and v % 16 == 0 for v in (m, k, n)) or is_small_dot(m, k, n):
        return False
    floats = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
    if jnp.dtype(x.dtype) not in floats or jnp.dtype(kernel.dtype) not in floats:
        return False
    return jax_gemm.available() and jax_gemm.quantize_available()


def _fused_forward(x, kernel, bias, x_scale, x_history, kernel_scale, kernel_history, recipe, has_bias):
    fmt, mode = recipe.forward_format, _scale_mode(recipe)
    x_q, x_q_t, x_amax, x_used = jax_gemm.quantize(x, x_scale, fmt, mode, x_history, recipe.margin)
    kernel_q, kernel_q_t, kernel_amax, kernel_used = jax_gemm.quantize(kernel, kernel_scale, fmt, mode,
                                                                       kernel_history, recipe.margin)
    y = jax_gemm.scaled_matmul_nt(x_q, kernel_q_t, ops.multiply(x_used, kernel_used), x.dtype,
                                  bias if has_bias else None, fast_accum=True)
    return (y, x_amax, kernel_amax, x_used, kernel_used), (x_q_t, kernel_q, x_used, kernel_used)


# The fused path: `numerics.fp8_forward` and `fp8_backward`'s products with
# the scales `numerics.operand_scale` and `backward_scale` pick, by the
# custom calls. Each quantize writes both layouts its operand's GEMMs read,
# so nothing is transposed in the program, and returns the amax and the
# scale it used; the state update stays with `numerics` (`_fused_call`).
# Returns `(y, x_amax, kernel_amax, x_scale_used, kernel_scale_used)`.
@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12))
def _fused_fp8_matmul(x, kernel, bias, pending, x_scale, x_history, kernel_scale, kernel_history, grad_scale,
                      grad_history, emit_token, recipe, has_bias):
    outputs, _ = _fused_forward(x, kernel, bias, x_scale, x_history, kernel_scale, kernel_history, recipe, has_bias)
    return outputs


def _fused_fp8_matmul_fwd(x, kernel, bias, pending, x_scale, x_history, kernel_scale, kernel_history, grad_scale,
                          grad_history, emit_token, recipe, has_bias):
    outputs, saved = _fused_forward(x, kernel, bias, x_scale, x_history, kernel_scale, kernel_history, recipe,
                                    has_bias)
    state = (x_scale, x_history, kernel_scale, kernel_history, grad_scale, grad_history, emit_token)
    protos = (jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype), jnp.zeros((), bias.dtype))
    return outputs, (saved, state, protos)


def _fused_fp8_matmul_bwd(recipe, has_bias, residuals, cotangents):
    grad = _as_stored(cotangents[0])
    (x_q_t, kernel_q, x_used, kernel_used), state, (x_proto, kernel_proto, bias_proto) = residuals
    grad_scale, grad_history, emit_token = state[4:]
    grad_q, grad_q_t, amax, used = jax_gemm.quantize(grad, grad_scale, recipe.backward_format, _scale_mode(recipe),
                                                     grad_history, recipe.margin)
    dx = jax_gemm.scaled_matmul_nt(grad_q, kernel_q, ops.multiply(used, kernel_used), x_proto.dtype,
                                   fast_accum=False)
    dkernel = jax_gemm.scaled_matmul_nt(x_q_t, grad_q_t, ops.multiply(x_used, used), kernel_proto.dtype,
                                        fast_accum=False)
    dpending = numerics.pending_cotangent(amax, emit_token)
    return (dx, dkernel, _bias_grad(grad, has_bias, bias_proto), dpending) + tuple(jnp.zeros_like(v) for v in state)


_fused_fp8_matmul.defvjp(_fused_fp8_matmul_fwd, _fused_fp8_matmul_bwd)


def _fused_call(layer, x, kernel, bias, recipe, training):
    """`fp8_matmul` by the fused path: the custom calls quantize with the
    scales `numerics.operand_scale` would pick and return the amaxes, which
    `numerics.operand_scale` then records (training)."""
    roles = ("input", "kernel")
    histories = [getattr(layer, f"{role}_amax_history").value for role in roles]
    scales = [getattr(layer, f"{role}_scale").value for role in roles]
    grad_history, grad_scale, emit_token = _fold_grad_state(layer, recipe, training)
    has_bias = bias is not None
    bias_value = ops.cast(bias, x.dtype) if has_bias else jnp.zeros((), x.dtype)
    y, x_amax, kernel_amax, _, _ = _fused_fp8_matmul(
        x, kernel, bias_value, compat.raw_value(layer.grad_amax_pending), scales[0], histories[0], scales[1],
        histories[1], ops.stop_gradient(grad_scale), ops.stop_gradient(grad_history), ops.stop_gradient(emit_token),
        recipe, has_bias)
    if training:
        for role, amax in zip(roles, (x_amax, kernel_amax)):
            _record_scale(layer, role, ops.stop_gradient(amax), recipe.forward_format, recipe, training)
    return y


# --------------------------------------------------------------------------- per-tensor scaling
def _operand_scale(layer, role, x, fmt, recipe, training):
    """The scale quantizing operand `role`; records its amax when training."""
    return _record_scale(layer, role, numerics.compute_amax(ops.stop_gradient(x)), fmt, recipe, training)


def _record_scale(layer, role, amax, fmt, recipe, training):
    """`numerics.operand_scale` for operand `role`'s `amax` on the layer's
    state, which it updates when training; returns the scale used."""
    history = getattr(layer, f"{role}_amax_history")
    scale = getattr(layer, f"{role}_scale")
    scale_used, new_history, new_scale = numerics.operand_scale(
        amax, history.value, scale.value, fmt, recipe, record=training)
    if training:
        history.assign(new_history)
        scale.assign(new_scale)
    return ops.stop_gradient(scale_used)


def fp8_matmul(layer, x, kernel, bias, recipe, training):
    """See `keras_fp8.backends`."""
    x = _as_stored(x)
    if recipe.name == "block":
        return _block_matmul_call(layer, x, kernel, bias, recipe, training)
    if _fused_applies(x, kernel, recipe):
        return _fused_call(layer, x, kernel, bias, recipe, training)
    x_scale = _operand_scale(layer, "input", x, recipe.forward_format, recipe, training)
    kernel_scale = _operand_scale(layer, "kernel", kernel, recipe.forward_format, recipe, training)
    grad_history, grad_scale, emit_token = _fold_grad_state(layer, recipe, training)
    has_bias = bias is not None
    bias_value = ops.cast(bias, x.dtype) if has_bias else jnp.zeros((), x.dtype)
    return _fp8_matmul(
        x, kernel, bias_value, compat.raw_value(layer.grad_amax_pending), x_scale, kernel_scale,
        ops.stop_gradient(grad_scale), ops.stop_gradient(grad_history), ops.stop_gradient(emit_token), recipe,
        has_bias,
    )
