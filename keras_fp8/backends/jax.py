"""FP8 matmuls for the JAX backend.

An FP8 layer call runs its three products (the forward; the backward's dx
and dkernel) by one route, chosen once per call by `route`:

- `FUSED`, the custom calls (`jax_gemm`, on an FP8 GPU where they apply:
  `_custom_calls_apply`): csrc's fused quantize writes each operand in both
  layouts the GEMMs read, with its amax and the scale it used, and its
  cuBLASLt GEMM applies the scales and the bias in its epilogue (one
  rounding).
- `XLA`, XLA's own FP8 products (on an FP8 GPU elsewhere: custom calls off
  by `jax_gemm.set_enabled(False)` or not available, shapes they do not
  take, a Keras distribution): XLA's fusions quantize and FP8
  `dot_general` multiplies (cuBLASLt underneath; the product written in
  the output dtype, then scaled).
- `EMULATION`, the exact emulation (`numerics.scaled_matmul`): off an FP8
  GPU, and for a call one of whose products is so small that XLA would
  multiply it in FP8 (`is_small_dot`).

Block scaling (`recipes.BlockScaling`) is a variant of the XLA route (its
Pallas kernel or scan of FP8 dots, `jax_block`) and of the emulation
(`numerics.block_matmul`); no custom call takes per-block scales. On every
route the scales and the state updates are `keras_fp8.numerics`' rules
(docs/numerics.md), on the layer's variables (assignments inside
`stateless_call` propagate).

A variable cannot be assigned inside a JAX backward pass: the output
gradient's amax leaves through the cotangent of `grad_amax_pending`, which
the optimizer overwrites, and the next training forward folds it.
"""

import functools
import os
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
import keras
from keras import ops

from keras_fp8 import compat
from keras_fp8 import numerics
from keras_fp8 import recipes
from keras_fp8.backends import jax_gemm
from keras_fp8.backends import jax_sharing

FUSED = "fused"
XLA = "xla"
EMULATION = "emulation"

# How a layer stores its kernel: `(K, N)` (Keras's Dense) or `(N, K)` (a
# tied embedding's projection, which reads the embedding matrix as stored).
IN_OUT = "in_out"
OUT_IN = "out_in"


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
    """See `keras_fp8.backends`: `recipes.DEFAULT_MIN_GEMM_SIZE` where real FP8
    GEMMs run (an FP8 GPU), 0 under the exact emulation, which reproduces
    the FP8 numerics at every size.

    The default route on an FP8 GPU runs torch_ops's cuBLASLt GEMM and
    quantize kernels, so the threshold is torch_ops's
    (`torch_ops.DEFAULT_MIN_GEMM_SIZE`, 8192 x 2048 x 2048): an `FP8Dense`
    under JAX trails `Dense` at 4096 x 1024 x 1024 and 1024 x 2048 x 1024,
    both below it, and leads it at 16384 x 4096 x 14336
    (docs/benchmarks.md). To be confirmed for JAX, shape by shape, by
    `benchmarks/keras_layer.py --backends jax --shapes ...`.
    """
    return recipes.DEFAULT_MIN_GEMM_SIZE if fp8_gemm_supported() else 0


# --------------------------------------------------------------------------- choosing the route
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
# threshold, if larger) a product runs the exact emulation instead.
SMALL_DOT_ELEMENTS = 16384


def is_small_dot(m, k, n):
    """Whether XLA would multiply an `(m, k) @ (k, n)` FP8 product in FP8
    (see `SMALL_DOT_ELEMENTS`). Symbolic sizes (Keras's shape inference)
    are not small: the output spec is the same either way."""
    if recipes.gemm_size((m, k, n)) is None:
        return False
    return m * k + k * n < max(SMALL_DOT_ELEMENTS, _rewrite_size_threshold())


def _has_small_dot(m, k, n, block):
    """Whether any of the call's three products (`(m, k) @ (k, n)`, dx
    `(m, n) @ (n, k)`, dkernel `(k, m) @ (m, n)`) is a small dot; a
    block-scaled product is a sum of dots over at most `numerics.BLOCK` of
    its contraction."""
    def contraction(length):
        return min(length, numerics.BLOCK) if block and isinstance(length, int) else length

    return any(is_small_dot(rows, contraction(inner), cols)
               for rows, inner, cols in ((m, k, n), (m, n, k), (k, m, n)))


def _custom_calls_allowed():
    """Whether `jax_gemm`'s custom calls may run here: enabled, an FP8 GPU,
    and no Keras distribution (XLA's SPMD partitioner knows how to split its
    own dot, not a custom call: it would gather the operands)."""
    return jax_gemm.enabled() and fp8_gemm_supported() and keras.distribution.distribution() is None


_CUSTOM_CALL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _output_dim(kernel, kernel_layout):
    """N of a kernel stored `(K, N)` (`"in_out"`) or `(N, K)` (`"out_in"`)."""
    return kernel.shape[1] if kernel_layout == IN_OUT else kernel.shape[0]


def _custom_calls_apply(x, kernel, recipe, kernel_layout=None):
    """Whether a call takes the `FUSED` route: the custom calls allowed
    (`_custom_calls_allowed`) and available, a per-tensor recipe without
    E5M2 x E5M2 products, M, K and N positive multiples of 16 (each is the
    contraction of one of the three GEMMs), not a small dot, and 16- or
    32-bit float operands."""
    if not _custom_calls_allowed():
        return False
    if isinstance(recipe, recipes.BlockScaling) or recipes.E5M2 == recipe.forward_format:
        return False
    m, k = x.shape
    n = _output_dim(kernel, kernel_layout or IN_OUT)
    if not all(isinstance(v, int) and v > 0 and v % 16 == 0 for v in (m, k, n)) or is_small_dot(m, k, n):
        return False
    if jnp.dtype(x.dtype) not in _CUSTOM_CALL_DTYPES or jnp.dtype(kernel.dtype) not in _CUSTOM_CALL_DTYPES:
        return False
    return jax_gemm.available() and jax_gemm.quantize_available()


def route(x, kernel, recipe, kernel_layout=None):
    """The route of one FP8 layer call's three products (see the module
    docstring), for `x @ kernel` under `recipe`.

    Args:
        x: The `(M, K)` input.
        kernel: The `(K, N)` kernel, or `(N, K)` for `kernel_layout="out_in"`.
        recipe: The call's recipe.
        kernel_layout: `"in_out"` (None: the same) or `"out_in"`.

    Returns:
        `FUSED`, `XLA` or `EMULATION`.
    """
    if not fp8_gemm_supported():
        return EMULATION
    if _custom_calls_apply(x, kernel, recipe, kernel_layout):
        return FUSED
    m, k = x.shape
    if _has_small_dot(m, k, _output_dim(kernel, kernel_layout or IN_OUT), isinstance(recipe, recipes.BlockScaling)):
        return EMULATION
    return XLA


# --------------------------------------------------------------------------- quantize and multiply, by route
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


def _amax(x):
    """`numerics.compute_amax(x)`, NaN wherever `x` holds a NaN. XLA's CPU
    max-reduction of a large array can drop a NaN (and return a finite
    amax or -inf); a NaN amax must stay NaN, which is never recorded
    (docs/numerics.md), as the custom calls and torch_ops compute it."""
    return jnp.where(jnp.any(jnp.isnan(x)), jnp.float32(jnp.nan), numerics.compute_amax(x))


class _Quantized(NamedTuple):
    """A quantized operand: `q`, its transpose `q_t` where the route wrote
    it (the fused quantize writes both; None elsewhere, or where the
    backward does not read it), its amax and the scale it was quantized
    with."""

    q: object
    q_t: object
    amax: object
    scale: object


def _quantize(route_name, t, scale, history, fmt, recipe, gradient=False):
    """`t` quantized with the scale the recipe picks from the state
    (`scale`, `history`) and `t`'s amax (`numerics.operand_scale`, or
    `numerics.backward_scale` for an output `gradient`); records nothing.

    Returns:
        A `_Quantized`.
    """
    if route_name == FUSED:
        mode = "current" if isinstance(recipe, recipes.CurrentScaling) else "delayed"
        return _Quantized(*jax_gemm.quantize(t, scale, fmt, mode, history, recipe.margin))
    amax = _amax(t)
    if gradient:
        used = numerics.backward_scale(amax, history, scale, fmt, recipe)
    else:
        used, _, _ = numerics.operand_scale(amax, history, scale, fmt, recipe, record=False)
    return _Quantized(numerics.quantize(t, used, fmt), None, amax, used)


def _transposed(route_name, op):
    """`op` as the transpose of its tensor: on the `FUSED` route the two
    layouts the quantize wrote swap (nothing is transposed in the program);
    elsewhere the transpose is computed."""
    if route_name == FUSED:
        return op._replace(q=op.q_t, q_t=op.q)
    return op._replace(q=ops.transpose(op.q), q_t=None)


def _xla_dot(a_q, b_q, scale, out_dtype, bias=None, precision=None):
    """`(a_q @ b_q) * scale (+ bias)` by XLA's FP8 `dot_general`: the GEMM
    writes the output dtype; the scale and bias are applied to that in
    float32 (one fused pass). `precision=None` lets cuBLASLt accumulate in
    its fast FP8 mode; `Precision.HIGHEST` turns that off."""
    out_dtype = jnp.dtype(out_dtype)
    product = jax.lax.dot_general(
        a_q, b_q, dimension_numbers=(((1,), (0,)), ((), ())), precision=precision,
        preferred_element_type=out_dtype if out_dtype.itemsize < 4 else jnp.float32,
    )
    y = product.astype(jnp.float32) * scale
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def _product(route_name, a, b, out_dtype, bias=None, backward=False):
    """`(a @ b) * (a.scale * b.scale) (+ bias)` of two `_Quantized`, float32
    accumulation, by the route. The forward may accumulate in cuBLASLt's
    fast FP8 mode; the `backward`'s products accumulate in full (the
    custom call without fast accumulation; XLA's dot at
    `Precision.HIGHEST`, which keeps the FP8 GEMM: XLA turns fast
    accumulation on for every FP8 dot at the default precision)."""
    scale = ops.multiply(a.scale, b.scale)
    if route_name == FUSED:
        return jax_gemm.scaled_matmul_nt(a.q, b.q_t, scale, out_dtype, bias, fast_accum=not backward)
    if route_name == XLA:
        return _xla_dot(a.q, b.q, scale, out_dtype, bias, jax.lax.Precision.HIGHEST if backward else None)
    return numerics.scaled_matmul(a.q, b.q, scale, out_dtype, bias)


def _block_matmul(route_name):
    """The block-scaled product of the route (`numerics.block_matmul`'s
    signature)."""
    if route_name == XLA:
        from keras_fp8.backends import jax_block

        return jax_block.gpu_block_matmul
    return numerics.block_matmul


def _bias_grad(grad, has_bias, bias_proto):
    """The bias gradient: summed in float32, rounded to the output's dtype
    (as the torch backend's fused bias rounds it); a placeholder without
    a bias."""
    if not has_bias:
        return jnp.zeros((), bias_proto.dtype)
    return _as_stored(jnp.sum(grad.astype(jnp.float32), axis=0).astype(grad.dtype)).astype(bias_proto.dtype)


def _protos(x, kernel, bias):
    """Zero-size stand-ins carrying the dtypes the backward returns."""
    return jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype), jnp.zeros((), bias.dtype)


# --------------------------------------------------------------------------- per-tensor scaling
def _per_tensor_forward(route_name, x_op, kernel, bias, kernel_scale, kernel_history, recipe, has_bias, out_dtype,
                        out_in):
    # An `(N, K)` kernel is quantized as stored (the same elements, so the
    # same amax and bytes) and read transposed: on the FUSED route the
    # quantize wrote that layout too; elsewhere its FP8 bytes are transposed.
    kernel_op = _quantize(route_name, kernel, kernel_scale, kernel_history, recipe.forward_format, recipe)
    y = _product(route_name, x_op, _transposed(route_name, kernel_op) if out_in else kernel_op, out_dtype,
                 bias if has_bias else None)
    return (y, kernel_op.amax, kernel_op.scale), kernel_op


# A per-tensor-scaled layer product by one route: `numerics`' quantize and
# scale rules, `docs/numerics.md`'s three GEMMs. x arrives quantized
# (`x_q`, its transpose `x_q_t` where the route wrote it, `x_scale` the
# scale it used: `_quantize_input`, perhaps another layer's copy of the
# same tensor); `x` itself only receives its gradient. `bias` is a `(N,)`
# tensor where `has_bias`, else an unused placeholder; the kernel is
# `(K, N)`, or `(N, K)` where `out_in` (its gradient then `(N, K)` too).
# Returns `(y, kernel_amax, kernel_scale_used)`; the caller records the
# amaxes (`_record_scale`).
@functools.partial(jax.custom_vjp, nondiff_argnums=(12, 13, 14, 15))
def _per_tensor_product(x, x_q, x_q_t, x_scale, kernel, bias, pending, kernel_scale, kernel_history, grad_scale,
                        grad_history, emit_token, route_name, recipe, has_bias, out_in):
    x_op = _Quantized(x_q, x_q_t, None, x_scale)
    outputs, _ = _per_tensor_forward(route_name, x_op, kernel, bias, kernel_scale, kernel_history, recipe, has_bias,
                                     x.dtype, out_in)
    return outputs


def _per_tensor_product_fwd(x, x_q, x_q_t, x_scale, kernel, bias, pending, kernel_scale, kernel_history, grad_scale,
                            grad_history, emit_token, route_name, recipe, has_bias, out_in):
    x_op = _Quantized(x_q, x_q_t, None, x_scale)
    outputs, kernel_op = _per_tensor_forward(route_name, x_op, kernel, bias, kernel_scale, kernel_history, recipe,
                                             has_bias, x.dtype, out_in)
    # On the FUSED route the backward's GEMMs read x's transposed layout
    # (dkernel) and, for dx, a `(K, N)` kernel's own layout or an `(N, K)`
    # one's transpose: only those are kept. Elsewhere the backward
    # transposes the saved operands.
    if route_name == FUSED:
        x_op = x_op._replace(q=None)
        kernel_op = kernel_op._replace(q=None) if out_in else kernel_op._replace(q_t=None)
    # requantize_weight_in_backward: the kernel itself is kept (the step's
    # input, alive anyway), not its FP8 copy; the backward quantizes it again
    # from the same state, so the same bytes.
    kept_kernel = kernel_op._replace(amax=None)
    if recipe.requantize_weight_in_backward:
        kept_kernel = kernel
    saved = (x_op, kept_kernel)
    state = (kernel_scale, kernel_history, grad_scale, grad_history, emit_token)
    return outputs, (saved, state, _protos(x, kernel, bias))


def _kernel_again(route_name, kernel, grad, state, recipe):
    """The forward's quantized kernel, made again in the backward from the
    same kernel and state (requantize_weight_in_backward). The optimization
    barrier ties it to the gradient, so XLA neither merges it with the
    forward's quantize nor schedules it before the backward."""
    kernel, _ = jax.lax.optimization_barrier((kernel, grad))
    return _quantize(route_name, kernel, state[0], state[1], recipe.forward_format, recipe)


def _per_tensor_product_bwd(route_name, recipe, has_bias, out_in, residuals, cotangents):
    grad = _as_stored(cotangents[0])
    (x_op, kernel_op), state, (x_proto, kernel_proto, bias_proto) = residuals
    grad_scale, grad_history, emit_token = state[2:]
    if recipe.requantize_weight_in_backward:
        kernel_op = _kernel_again(route_name, kernel_op, grad, state, recipe)
    grad_op = _quantize(route_name, grad, grad_scale, grad_history, recipe.backward_format, recipe, gradient=True)
    if out_in:  # dx = g @ W, dW = g^T @ x: `(N, K)` as the kernel
        dx = _product(route_name, grad_op, kernel_op, x_proto.dtype, backward=True)
        dkernel = _product(route_name, _transposed(route_name, grad_op), x_op, kernel_proto.dtype, backward=True)
    else:
        dx = _product(route_name, grad_op, _transposed(route_name, kernel_op), x_proto.dtype, backward=True)
        dkernel = _product(route_name, _transposed(route_name, x_op), grad_op, kernel_proto.dtype, backward=True)
    dpending = numerics.pending_cotangent(grad_op.amax, emit_token)
    # x's quantized copy gets no cotangent (None: a symbolic zero): it is
    # made from x without a gradient, which reaches x as dx.
    return ((dx, None, None, None, dkernel, _bias_grad(grad, has_bias, bias_proto), dpending)
            + tuple(jnp.zeros_like(v) for v in state))


_per_tensor_product.defvjp(_per_tensor_product_fwd, _per_tensor_product_bwd)


def _record_scale(layer, role, amax, fmt, recipe):
    """Records operand `role`'s `amax` in the layer's state
    (`numerics.operand_scale`)."""
    history = getattr(layer, f"{role}_amax_history")
    scale = getattr(layer, f"{role}_scale")
    _, new_history, new_scale = numerics.operand_scale(ops.stop_gradient(amax), history.value, scale.value, fmt,
                                                       recipe, record=True)
    history.assign(new_history)
    scale.assign(new_scale)


# --------------------------------------------------------------------------- block scaling
# A block-scaled layer product by one route (`numerics.block_forward` and
# `block_backward`): no input or kernel state; the gradient channel still
# carries the output gradient's amax.
# x arrives quantized (`x_tiles`: `numerics.block_quantize_input`'s, perhaps
# another layer's copy of the same tensor); `x` only receives its gradient.
# The kernel is `(K, N)`, or `(N, K)` where `out_in`.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _block_product(x, x_tiles, kernel, bias, pending, emit_token, route_name, recipe, has_bias, out_in):
    y, _ = numerics.block_forward(x, kernel, recipe, bias if has_bias else None, matmul=_block_matmul(route_name),
                                  kernel_out_in=out_in, x_tiles=x_tiles)
    return y


def _block_product_fwd(x, x_tiles, kernel, bias, pending, emit_token, route_name, recipe, has_bias, out_in):
    y, residuals = numerics.block_forward(x, kernel, recipe, bias if has_bias else None,
                                          matmul=_block_matmul(route_name), kernel_out_in=out_in, x_tiles=x_tiles)
    return y, (residuals, emit_token, _protos(x, kernel, bias))


def _block_product_bwd(route_name, recipe, has_bias, out_in, saved, grad):
    grad = _as_stored(grad)
    residuals, emit_token, (x_proto, kernel_proto, bias_proto) = saved
    dx, dkernel, _ = numerics.block_backward(grad, residuals, emit_token, recipe, x_proto.dtype, kernel_proto.dtype,
                                             matmul=_block_matmul(route_name), kernel_out_in=out_in)
    dpending = numerics.pending_cotangent(_amax(grad), emit_token)
    return dx, None, dkernel, _bias_grad(grad, has_bias, bias_proto), dpending, jnp.zeros_like(emit_token)


_block_product.defvjp(_block_product_fwd, _block_product_bwd)


# --------------------------------------------------------------------------- the layer's call
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


def fold_pending_grad_amax(layer, recipe):
    """See `keras_fp8.backends`: a training call of an FP8 layer that runs
    in the compute dtype folds the pending gradient amax, as a training
    FP8 call does. Keras's JAX optimizer overwrites `grad_amax_pending` with
    every step's gradient, zero where no FP8 backward ran: an amax still
    pending would be lost."""
    _fold_grad_state(layer, recipe, True)


# --------------------------------------------------------------------------- one quantize per tensor
def _quantize_input(layer, route_name, x, recipe, source):
    """x quantized for the layer's products: `_Quantized` (per-tensor
    recipes) or `numerics.block_quantize_input`'s tiles. Taken from an
    earlier layer of this trace that quantized the same tensor the same way
    with the same settings (`jax_sharing`; docs/numerics.md, "One quantize
    per tensor"), else made here (without a gradient: x's reaches it as dx)
    and left for the next."""
    share = recipe.share_quantized_inputs and source is not None
    block = isinstance(recipe, recipes.BlockScaling)
    settings = (recipe.name, route_name, recipe.forward_format, recipe.margin, tuple(x.shape), jnp.dtype(x.dtype))
    if block:
        settings += (recipe.power_of_two,)
    else:
        settings += (getattr(recipe, "amax_compute_algo", None), tuple(layer.input_amax_history.shape))
    consumer = None if block else layer
    if share:
        shared = jax_sharing.lookup(source, settings, consumer)
        if shared is not None:
            return shared
    x = jax.lax.stop_gradient(x)
    if block:
        made = numerics.block_quantize_input(x, recipe)
    else:
        made = _quantize(route_name, x, layer.input_scale.value, layer.input_amax_history.value,
                         recipe.forward_format, recipe)
    if share:
        jax_sharing.store(source, settings, consumer, made)
    return made


def fp8_matmul(layer, x, kernel, bias, recipe, training, kernel_layout=IN_OUT, source=None):
    """See `keras_fp8.backends`."""
    x = _as_stored(x)
    out_in = kernel_layout == OUT_IN
    route_name = route(x, kernel, recipe, kernel_layout)
    grad_history, grad_scale, emit_token = _fold_grad_state(layer, recipe, training)
    has_bias = bias is not None
    bias_value = ops.cast(bias, x.dtype) if has_bias else jnp.zeros((), x.dtype)
    pending = compat.raw_value(layer.grad_amax_pending)
    emit_token = ops.stop_gradient(emit_token)
    x_fp8 = _quantize_input(layer, route_name, x, recipe, source)
    if isinstance(recipe, recipes.BlockScaling):
        return _block_product(x, x_fp8, kernel, bias_value, pending, emit_token, route_name, recipe, has_bias,
                              out_in)
    y, kernel_amax, _ = _per_tensor_product(
        x, x_fp8.q, x_fp8.q_t, x_fp8.scale, kernel, bias_value, pending, layer.kernel_scale.value,
        layer.kernel_amax_history.value, ops.stop_gradient(grad_scale), ops.stop_gradient(grad_history), emit_token,
        route_name, recipe, has_bias, out_in)
    if training:
        for role, amax in (("input", x_fp8.amax), ("kernel", kernel_amax)):
            _record_scale(layer, role, amax, recipe.forward_format, recipe)
    return y



# --------------------------------------------------------------------------- what the backward keeps
def _scope_path(eqn):
    """The layer-call path of an equation's name stack, its transformations
    left out: `transpose(jvp(model/block/up))` -> `model/block/up`."""
    return re.sub(r"[A-Za-z_]\w*\(", "", str(eqn.source_info.name_stack)).replace(")", "")


def _is_backward(eqn):
    """Whether an equation of a gradient's program belongs to the backward
    pass: JAX names the equations it transposes `transpose(...)`."""
    return "transpose(" in str(eqn.source_info.name_stack)


def _op_name(eqn):
    """An equation's op: its primitive, or the function a `jit` names."""
    name = eqn.params.get("name") if eqn.primitive.name in ("pjit", "jit", "closed_call") else None
    return name or eqn.primitive.name


# Primitives whose output holds the elements of their (first) input in the
# same order and dtype: XLA writes no new buffer for them (a reshape is a
# bitcast of a row-major array, a copy is elided), so an op that saves their
# output keeps the input's memory. A transpose or a cast may write one: not
# followed.
_SAME_ELEMENTS = ("reshape", "squeeze", "expand_dims", "reduce_precision", "copy")


def _same_elements(eqn):
    """Whether an equation's output holds its input's elements as they are
    (`_SAME_ELEMENTS`; a cast to the same dtype too)."""
    name = eqn.primitive.name
    if name == "convert_element_type":
        return eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype
    return name in _SAME_ELEMENTS and len(eqn.outvars) == 1


def _is_var(atom):
    """Whether a jaxpr atom is a variable (not a literal constant)."""
    return isinstance(atom, jax_core.Var) and not isinstance(atom, jax_core.Literal)


def saved_for_backward(loss_fn, trainable_values, other_values):
    """See `keras_fp8.backends`: the gradient of the loss with respect to
    the trainable values, traced into one program (`jax.make_jaxpr`, nothing
    runs), with `inputs` returned beside it so that each is a variable of
    the program. A value the backward's equations read is a residual of the
    forward: kept from the forward pass to the backward; so is a reshape or
    copy of it (`_SAME_ELEMENTS`: its buffer). Each is reported
    with the layer-call path of the equation that reads it (Keras's name
    scopes are JAX name scopes) and its primitive. This is the program XLA
    compiles; XLA may still rematerialize or alias buffers."""
    counts = []

    def loss_and_inputs(trainable, others):
        loss, inputs = loss_fn(trainable, others)
        counts.append(len(inputs))
        return loss, list(inputs)

    traced = jax.make_jaxpr(jax.grad(loss_and_inputs, has_aux=True))(list(trainable_values), list(other_values))
    jaxpr = traced.jaxpr
    input_vars = jaxpr.outvars[len(jaxpr.outvars) - counts[-1]:] if counts[-1] else []
    # Each input's variable and the variables that hold its elements as
    # they are (`_SAME_ELEMENTS`), which XLA keeps in the input's buffer.
    owners = {}
    for v in input_vars:
        if _is_var(v):
            owners.setdefault(v, set()).add(v)
    savers = {v: set() for v in owners}
    for eqn in jaxpr.eqns:
        if _is_backward(eqn):
            for v in eqn.invars:
                for owner in owners.get(v, ()) if _is_var(v) else ():
                    savers[owner].add((_scope_path(eqn), _op_name(eqn)))
        elif _same_elements(eqn) and _is_var(eqn.invars[0]) and eqn.invars[0] in owners:
            owners.setdefault(eqn.outvars[0], set()).update(owners[eqn.invars[0]])
    report = []
    for v in input_vars:
        aval = v.aval
        report.append((tuple(aval.shape), str(aval.dtype), int(aval.size) * jnp.dtype(aval.dtype).itemsize,
                       sorted(savers.get(v, ())) if _is_var(v) else []))
    return report
