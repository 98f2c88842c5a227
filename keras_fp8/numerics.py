"""The FP8 numerics of keras-fp8 in `keras.ops`: the reference of every rule.

One module, every rule (docs/design.md, "Numerics"; docs/numerics.md has the
exact float32 operations): quantizing, the scale rules, the history update,
the fold of the gradient channel, and the exact emulation of an FP8 matmul.
The JAX backend runs these functions; the torch backend runs `torch_ops`,
whose reference (`torch_ops/reference.py`) is tested bit for bit against
this one.

Conventions:

- `scale` is the dequantization step: `q = cast(clip(x * (1 / scale)))`,
  clipped to the format's range, and `x ~= q * scale`. Why a reciprocal, not
  a division: XLA rewrites a division by a scalar into a multiplication by its
  reciprocal, so `x / scale` is not bit-reproducible across backends, while a
  correctly rounded scalar reciprocal followed by a product rounds the same
  way in NumPy, torch, XLA and the CUDA kernels.
- `scale = max(amax_window * f32(1 / fmt_max), 2**-126) * f32(2**margin)`:
  the window's amax maps to `fmt_max / 2**margin` (margin is headroom), and
  no scale is below the smallest normal float32, so `1 / scale` and
  `x * (1 / scale)` stay finite; a zero or non-finite window keeps the
  previous scale.
- A non-finite input element quantizes to NaN (+-inf as well), so a
  non-finite input gives a non-finite output, as a plain matmul would.
- `history[0]` is the newest amax; recording shifts by one and writes slot 0.
  A non-finite amax is never recorded.
- One quantize per tensor: layers reading the same tensor with the same
  forward format and recipe share the first reader's FP8 copy, the scale it
  used and its amax; each records that amax in its own state (`operand_scale`
  on its own history and scale), so states never differ from unshared ones,
  and outputs do not wherever the readers' input scales are equal
  (docs/numerics.md, "One quantize per tensor"; `block_quantize_input` is
  block scaling's shareable copy).
"""

import numpy as np
from keras import ops

from keras_fp8 import compat
from keras_fp8 import recipes
from keras_fp8.recipes import FOLD_COUNT_PERIOD
from keras_fp8.recipes import MIN_SCALE


def _float32_constant(value):
    """`value` rounded to float32, as a float32 tensor.

    Converted from a Python float (exact in float32), not a NumPy scalar:
    torch.compile cannot trace Keras's conversion of a NumPy scalar (a graph
    break per use). The dtype is explicit, whatever `keras.config.floatx()`.
    """
    return ops.convert_to_tensor(float(np.float32(value)), dtype="float32")


def reciprocal(scale):
    """`1 / scale` in float32 (one correctly rounded scalar division)."""
    return ops.divide(1.0, ops.cast(scale, "float32"))


def quantize(x, scale, fmt):
    """Quantizes `x` to FP8 with a saturating cast.

    Args:
        x: A floating-point tensor.
        scale: A float32 scalar tensor, the dequantization step.
        fmt: `"e4m3"` or `"e5m2"`.

    Returns:
        A tensor of dtype `float8_e4m3fn` or `float8_e5m2`, shaped like `x`.
        NaN stays NaN (clipping keeps it) and +-inf becomes NaN: a
        non-finite input must not turn into a finite, saturated value.
    """
    fmt_max = recipes.FORMAT_MAX[fmt]
    x = ops.cast(x, "float32")
    scaled = ops.where(ops.isinf(x), float("nan"), ops.multiply(x, reciprocal(scale)))
    return ops.cast(ops.clip(scaled, -fmt_max, fmt_max), recipes.FORMAT_DTYPE[fmt])


def widen(q):
    """Returns the FP8 tensor `q`'s values in float32 (exact).

    Every widening of a quantized tensor goes through here: within one
    compiled function a compiler may fold the conversion to FP8 and this
    one into a single conversion, which would skip the FP8 rounding
    (`keras_fp8.compat.optimization_barrier` keeps them apart).

    Args:
        q: A `float8_e4m3fn` or `float8_e5m2` tensor.

    Returns:
        A float32 tensor shaped like `q`.
    """
    return ops.cast(compat.optimization_barrier(q), "float32")


def dequantize(q, scale, dtype="float32"):
    """Returns `q * scale` in `dtype` (exact in float32 for scalar scales)."""
    return ops.cast(ops.multiply(widen(q), scale), dtype)


def compute_amax(x):
    """Returns `max(|x|)` as a float32 scalar; NaN or inf if `x` has one."""
    return ops.amax(ops.abs(ops.cast(x, "float32")))


def is_usable_amax(amax):
    """True where `amax` is finite and positive (it can define a scale)."""
    return ops.logical_and(ops.isfinite(amax), ops.greater(amax, 0.0))


def inverse_format_max(fmt):
    """`1 / fmt_max` rounded to float32: the constant scales are built from."""
    return _float32_constant(1.0 / recipes.FORMAT_MAX[fmt])


def margin_multiplier(margin):
    """`2**margin` rounded to float32, the factor of every scale."""
    return _float32_constant(2.0 ** float(margin))


def compute_scale(amax_window, previous_scale, fmt, margin=0.0):
    """Returns the scale for `amax_window`, or `previous_scale` if unusable.

    Args:
        amax_window: float32 scalar, the amax the scale should cover.
        previous_scale: float32 scalar, kept when the window is zero or not
            finite.
        fmt: `"e4m3"` or `"e5m2"`.
        margin: Scale margin (docs/numerics.md).

    Returns:
        A float32 scalar tensor.
    """
    base = ops.maximum(ops.multiply(amax_window, inverse_format_max(fmt)), _float32_constant(MIN_SCALE))
    scale = ops.multiply(base, margin_multiplier(margin))
    return ops.where(is_usable_amax(amax_window), scale, previous_scale)


def amax_window(history, amax_compute_algo="max", history_len=None):
    """Reduces an amax history to the amax that defines the next scale.

    Args:
        history: float32 tensor of shape `(H,)`, newest first.
        amax_compute_algo: `"max"` or `"most_recent"`.
        history_len: Only the newest `history_len` entries count (all if None
            or larger than `H`).

    Returns:
        A float32 scalar tensor.
    """
    if amax_compute_algo == "most_recent":
        return history[0]
    if history_len is not None and history_len < history.shape[0]:
        history = history[:history_len]
    return ops.amax(history)


def record_amax(history, amax, skip_zero=False):
    """Returns `history` with `amax` recorded in slot 0 (unless not finite).

    Args:
        history: float32 tensor of shape `(H,)`, newest first.
        amax: float32 scalar tensor.
        skip_zero: Also leave the history unchanged when `amax <= 0`.

    Returns:
        The new history, same shape.
    """
    amax = ops.cast(amax, "float32")
    shifted = ops.concatenate([ops.reshape(amax, (1,)), history[:-1]], axis=0)
    keep = is_usable_amax(amax) if skip_zero else ops.isfinite(amax)
    return ops.where(keep, shifted, history)


def history_is_empty(history):
    """True while nothing non-zero has been recorded in `history`."""
    return ops.equal(ops.amax(history), 0.0)


def delayed_scale_update(amax, history, scale, fmt, recipe, record=True):
    """One delayed-scaling step for one operand.

    Args:
        amax: float32 scalar, the amax of the tensor quantized by this call.
        history: float32 `(H,)` amax history before this call.
        scale: float32 scalar, the scale computed after the previous call.
        fmt: The operand's FP8 format.
        recipe: A `DelayedScaling` recipe.
        record: Whether this call's amax is recorded (training) or not.

    Returns:
        `(scale_used, new_history, new_scale)`: the scale to quantize this
        call's tensor with (seeded from `amax` while the history is empty),
        and the state after the call (unchanged when `record` is False).
    """
    seeded = compute_scale(amax, scale, fmt, recipe.margin)
    scale_used = ops.where(history_is_empty(history), seeded, scale)
    if not record:
        return scale_used, history, scale
    new_history = record_amax(history, amax)
    window = amax_window(new_history, recipe.amax_compute_algo, recipe.history_len)
    new_scale = compute_scale(window, scale_used, fmt, recipe.margin)
    return scale_used, new_history, new_scale


def operand_scale(amax, history, scale, fmt, recipe, record=True):
    """The scale step of any recipe for a forward operand.

    Current scaling uses `compute_scale(amax, scale)`, leaves the history
    unchanged and (when recording) stores the scale it used.

    Returns:
        `(scale_used, new_history, new_scale)`.
    """
    if isinstance(recipe, recipes.CurrentScaling):
        scale_used = compute_scale(amax, scale, fmt, recipe.margin)
        return scale_used, history, (scale_used if record else scale)
    return delayed_scale_update(amax, history, scale, fmt, recipe, record)


def backward_scale(amax, history, scale, fmt, recipe):
    """The scale that quantizes an output gradient (nothing recorded here).

    Delayed scaling uses `scale` unless the history is empty, in which case the
    gradient seeds it from its own amax; current scaling always uses the amax.
    """
    seeded = compute_scale(amax, scale, fmt, recipe.margin)
    if isinstance(recipe, recipes.CurrentScaling):
        return seeded
    return ops.where(history_is_empty(history), seeded, scale)


def fold_pending_grad_amax(pending, fold_state, history, scale, fmt, recipe):
    """Folds the gradient channel's pending amax into the gradient state.

    `pending = [amax, token, loss_scale]` is what the last backward returned
    through the gradient of `grad_amax_pending`; `fold_state = [folds,
    last_token, last_loss_scale]` tells a fresh value (token > 0 and new) from
    one already folded (a skipped fp16 step never overwrites `pending`; a
    layer called twice in a step folds once). A changed fp16 loss scale first
    rescales the history and the scale by `loss_scale / last_loss_scale`
    (powers of two: exact; the scale no lower than `MIN_SCALE`). A fresh,
    positive, finite amax is recorded; under
    delayed scaling the scale follows the window.

    Returns:
        `(new_history, new_scale, new_fold_state, emit_token)`: the gradient
        state after the fold, and the token this call's backward emits.
    """
    amax, token, loss_scale = pending[0], pending[1], pending[2]
    folds, last_token, last_loss_scale = fold_state[0], fold_state[1], fold_state[2]
    rescale = ops.where(
        ops.logical_and(ops.greater(loss_scale, 0.0), ops.greater(last_loss_scale, 0.0)),
        ops.divide(loss_scale, ops.maximum(last_loss_scale, 1e-30)),
        1.0,
    )
    history = ops.multiply(history, rescale)
    scale = ops.maximum(ops.multiply(scale, rescale), _float32_constant(MIN_SCALE))
    new_last_loss_scale = ops.where(ops.greater(loss_scale, 0.0), loss_scale, last_loss_scale)
    fresh = ops.logical_and(ops.greater(token, 0.0), ops.not_equal(token, last_token))
    new_history = ops.where(fresh, record_amax(history, amax, skip_zero=True), history)
    if not isinstance(recipe, recipes.DelayedScaling):
        new_scale = scale
    else:
        window = amax_window(new_history, recipe.amax_compute_algo, recipe.history_len)
        new_scale = ops.where(fresh, compute_scale(window, scale, fmt, recipe.margin), scale)
    new_folds = ops.where(fresh, ops.mod(folds + 1.0, FOLD_COUNT_PERIOD), folds)
    new_last_token = ops.where(fresh, token, last_token)
    new_fold_state = ops.stack([new_folds, new_last_token, new_last_loss_scale])
    return new_history, new_scale, new_fold_state, new_folds + 1.0


# --------------------------------------------------------------------------- statistics
def quantization_stats(x, scale, fmt):
    """What quantizing `x` with `scale` does to it, by `quantize` itself.

    The statistics `keras_fp8.callbacks.FP8Monitor` reports. Non-finite
    elements of `x` are left out of every fraction and of the SQNR (they
    quantize to NaN whatever the scale).

    Args:
        x: A floating-point tensor.
        scale: float32 scalar, the dequantization step it is quantized with.
        fmt: `"e4m3"` or `"e5m2"`.

    Returns:
        A dict of float32 scalar tensors:
        `amax` (`compute_amax(x)`), `scale`, `saturation` (the fraction of
        the finite elements that the clip changes: `|x| * (1 / scale)` past
        the format's largest value), `underflow` (the fraction of the
        finite elements that are nonzero and quantize to zero) and `sqnr_db`
        (the signal-to-quantization-noise ratio `10 * log10(sum(x**2) /
        sum((x - dequantize(q))**2))`, in dB; inf when quantizing is exact).

    Example:

    >>> stats = quantization_stats(np.array([1.0, 500.0, 1e-9]), 1.0, "e4m3")
    >>> [float(stats[k]) for k in ("saturation", "underflow")]
    [0.3333333432674408, 0.3333333432674408]
    """
    x = ops.cast(x, "float32")
    scale = ops.cast(scale, "float32")
    q = widen(quantize(x, scale, fmt))
    error = ops.subtract(x, ops.multiply(q, scale))
    finite = ops.isfinite(x)
    count = ops.maximum(ops.sum(ops.cast(finite, "float32")), 1.0)

    def fraction(mask):
        return ops.divide(ops.sum(ops.cast(ops.logical_and(finite, mask), "float32")), count)

    clipped = ops.greater(ops.abs(ops.multiply(x, reciprocal(scale))), recipes.FORMAT_MAX[fmt])
    flushed = ops.logical_and(ops.not_equal(x, 0.0), ops.equal(q, 0.0))
    # Powers relative to the amax, so that tiny tensors (gradients) do not
    # underflow float32 when squared; the ratio is the same.
    amax = compute_amax(ops.where(finite, x, ops.zeros_like(x)))
    unit = ops.where(is_usable_amax(amax), reciprocal(amax), ops.ones_like(amax))
    zero = ops.zeros_like(x)
    signal = ops.sum(ops.square(ops.where(finite, ops.multiply(x, unit), zero)))
    noise = ops.sum(ops.square(ops.where(finite, ops.multiply(error, unit), zero)))
    sqnr_db = ops.multiply(10.0, ops.log10(ops.divide(signal, noise)))
    return {
        "amax": compute_amax(x),
        "scale": scale,
        "saturation": fraction(clipped),
        "underflow": fraction(flushed),
        "sqnr_db": sqnr_db,
    }


# --------------------------------------------------------------------------- the exact FP8 matmul
def scaled_matmul(a_q, b_q, scale, out_dtype, bias=None):
    """Returns `(a_q @ b_q) * scale (+ bias)` in `out_dtype`, accumulated in
    float32 and rounded once.

    FP8 values dequantize exactly to float32 and float32 products of two FP8
    values are exact, so this is what an FP8 GEMM with float32 accumulation
    and a fused bias computes (up to the order of the sums).

    Args:
        a_q: `(M, K)` FP8 tensor.
        b_q: `(K, N)` FP8 tensor.
        scale: float32 scalar, the product of the two operands' scales.
        out_dtype: Output dtype.
        bias: Optional `(N,)` bias, added in float32 before the rounding.
    """
    product = ops.multiply(ops.matmul(widen(a_q), widen(b_q)), scale)
    if bias is not None:
        product = ops.add(product, ops.cast(bias, "float32"))
    return ops.cast(product, out_dtype)


def fp8_forward(x, kernel, x_scale, kernel_scale, recipe, bias=None, matmul=scaled_matmul):
    """Quantizes both operands and multiplies them (the bias fused).

    Returns:
        `(y, x_q, kernel_q)`.
    """
    fmt = recipe.forward_format
    x_q = quantize(x, x_scale, fmt)
    kernel_q = quantize(kernel, kernel_scale, fmt)
    y = matmul(x_q, kernel_q, ops.multiply(x_scale, kernel_scale), x.dtype, bias)
    return y, x_q, kernel_q


def pending_cotangent(amax, emit_token):
    """The gradient channel's value a backward pass returns for the output
    gradient's `amax`: `[amax (0 where not finite), emit_token, 0]`."""
    finite_amax = ops.where(ops.isfinite(amax), amax, ops.zeros_like(amax))
    return ops.stack([finite_amax, ops.cast(emit_token, "float32"), ops.zeros_like(amax)])


def fp8_backward(grad, x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history, emit_token, recipe, x_dtype,
                 kernel_dtype, matmul=scaled_matmul):
    """The backward pass: one quantized gradient for both gradient matmuls.

    Returns:
        `(dx, dkernel, dpending)`, `dpending` the gradient channel's value
        (`pending_cotangent`).
    """
    fmt = recipe.backward_format
    amax = compute_amax(grad)
    scale = backward_scale(amax, grad_history, grad_scale, fmt, recipe)
    grad_q = quantize(grad, scale, fmt)
    dx = matmul(grad_q, ops.transpose(kernel_q), ops.multiply(scale, kernel_scale), x_dtype)
    dkernel = matmul(ops.transpose(x_q), grad_q, ops.multiply(x_scale, scale), kernel_dtype)
    return dx, dkernel, pending_cotangent(amax, emit_token)


# --------------------------------------------------------------------------- block scaling
# Block scaling (`recipes.BlockScaling`): a scale per 1 x 128 tile along the
# contraction dimension for activations and output gradients, per 128 x 128
# block for weights, from the tile's own values (no history).
BLOCK = 128
# Every power of two float32 holds, 2**-149 .. 2**127: exact, whatever a
# backend's `log2` or `power` rounds.
_POWERS_OF_TWO = np.array([2.0**e for e in range(-149, 128)], np.float32)


def _power_of_two_ceil(s):
    """The smallest power of two >= `s` (positive, finite), exactly: `log2`
    proposes the exponent, a table of exact powers corrects it by one."""
    table = ops.convert_to_tensor(_POWERS_OF_TWO)
    last = len(_POWERS_OF_TWO) - 1
    index = ops.clip(ops.cast(ops.ceil(ops.log2(s)), "int32") + 149, 1, last - 1)
    p = ops.take(table, index)
    lower = ops.take(table, index - 1)
    p = ops.where(ops.greater_equal(lower, s), lower, p)
    return ops.where(ops.less(p, s), ops.take(table, ops.minimum(index + 1, last)), p)


def block_scale(amax, fmt, margin=0.0, power_of_two=False):
    """The scale of each tile from its amax: `compute_scale`'s rule (the
    floor, the margin), rounded up to a power of two with `power_of_two`; 1 for
    a tile of zeros or with a non-finite value."""
    amax = ops.cast(amax, "float32")
    base = ops.maximum(ops.multiply(amax, inverse_format_max(fmt)), _float32_constant(MIN_SCALE))
    scale = ops.multiply(base, margin_multiplier(margin))
    if power_of_two:
        scale = _power_of_two_ceil(scale)
    return ops.where(is_usable_amax(amax), scale, ops.ones_like(scale))


def _tiles(x2d, axis):
    """`x2d` (float32) as (lines, tiles, BLOCK) tiles of BLOCK along `axis`
    (zero padded), and the unpadded length."""
    t = ops.cast(x2d, "float32")
    if axis == 0:
        t = ops.transpose(t)
    lines, n = t.shape
    tiles = -(-n // BLOCK)
    if tiles * BLOCK != n:
        t = compat.pad_with_zeros(t, ((0, 0), (0, tiles * BLOCK - n)))
    return ops.reshape(t, (lines, tiles, BLOCK)), n


def _tile_amax(t, axis):
    """The amax of each tile, inf for a tile holding NaN (which `block_scale`
    treats as it treats NaN). XLA on CPU drops NaN from max-reductions over
    an axis that is not the innermost, so NaN is made inf before reducing."""
    magnitude = ops.abs(t)
    return ops.amax(ops.where(ops.isnan(magnitude), float("inf"), magnitude), axis=axis)


def _quantize_scaled(t, scales, fmt):
    fmt_max = recipes.FORMAT_MAX[fmt]
    scaled = ops.where(ops.isinf(t), float("nan"), ops.multiply(t, reciprocal(scales)))
    return ops.cast(ops.clip(scaled, -fmt_max, fmt_max), recipes.FORMAT_DTYPE[fmt])


def quantize_tiles(x2d, fmt, axis=1, margin=0.0, power_of_two=False):
    """Quantizes a 2-D tensor per tile of 128 along `axis` (1: 1 x 128 tiles
    of each row; 0: 128 x 1 tiles of each column).

    Returns:
        `(q, scales)`: `q` shaped like `x2d`; float32 `scales` of shape
        `(rows, ceil(cols / 128))` for axis 1, `(ceil(rows / 128), cols)`
        for axis 0.
    """
    t, n = _tiles(x2d, axis)
    scales = block_scale(_tile_amax(t, 2), fmt, margin, power_of_two)
    q = _quantize_scaled(t, ops.expand_dims(scales, -1), fmt)
    q = ops.reshape(q, (t.shape[0], -1))[:, :n]
    if axis == 0:
        return ops.transpose(q), ops.transpose(scales)
    return q, scales


def quantize_blocks(w2d, fmt, margin=0.0, power_of_two=False):
    """Quantizes a 2-D tensor per 128 x 128 block.

    Returns:
        `(q, scales)`: `q` shaped like `w2d`; float32 `scales` of shape
        `(ceil(rows / 128), ceil(cols / 128))`.
    """
    w = ops.cast(w2d, "float32")
    r, c = w.shape
    rb, cb = -(-r // BLOCK), -(-c // BLOCK)
    if (rb * BLOCK, cb * BLOCK) != (r, c):
        w = compat.pad_with_zeros(w, ((0, rb * BLOCK - r), (0, cb * BLOCK - c)))
    blocks = ops.transpose(ops.reshape(w, (rb, BLOCK, cb, BLOCK)), (0, 2, 1, 3))
    scales = block_scale(_tile_amax(blocks, (2, 3)), fmt, margin, power_of_two)
    q = _quantize_scaled(blocks, ops.reshape(scales, (rb, cb, 1, 1)), fmt)
    q = ops.reshape(ops.transpose(q, (0, 2, 1, 3)), (rb * BLOCK, cb * BLOCK))[:r, :c]
    return q, scales


def block_matmul(a_q, a_scales, b_q, b_scales, out_dtype, bias=None, b_tiles=False):
    """`a @ b` of block-scaled FP8 operands, each 128-long stretch of the
    contraction summed in float32 and multiplied by its two scales.

    Args:
        a_q: `(M, K)` FP8, 1 x 128 tiles along K: `a_scales` `(M, ceil(K/128))`.
        b_q: `(K, N)` FP8: 128 x 128 blocks (`b_scales` `(ceil(K/128),
            ceil(N/128))`) or, with `b_tiles`, 128 x 1 tiles along K
            (`b_scales` `(ceil(K/128), N)`).
        out_dtype: Output dtype (one rounding, after the bias).
        bias: Optional `(N,)`, added in float32.
    """
    k = a_q.shape[1]
    n = b_q.shape[1]
    a = widen(a_q)
    b = widen(b_q)
    out = None
    for kb in range(-(-k // BLOCK)):
        lo, hi = kb * BLOCK, min(k, (kb + 1) * BLOCK)
        part = ops.matmul(a[:, lo:hi], b[lo:hi, :])
        sb = b_scales[kb] if b_tiles else ops.repeat(b_scales[kb], BLOCK)[:n]
        part = ops.multiply(ops.multiply(part, a_scales[:, kb:kb + 1]), ops.expand_dims(sb, 0))
        out = part if out is None else ops.add(out, part)
    if bias is not None:
        out = ops.add(out, ops.cast(bias, "float32"))
    return ops.cast(out, out_dtype)


def block_quantize_input(x, recipe):
    """x's block-scaled copies: `(x_q, x_s)` in 1 x 128 tiles along K (the
    forward) and `(x_qc, x_sc)` in 128 x 1 tiles along M (the kernel's
    gradient), as a tuple `(x_q, x_s, x_qc, x_sc)`. They depend on x alone,
    so layers reading the same x may share them ("One quantize per tensor")."""
    fmt, margin, pow2 = recipe.forward_format, recipe.margin, recipe.power_of_two
    return quantize_tiles(x, fmt, 1, margin, pow2) + quantize_tiles(x, fmt, 0, margin, pow2)


def block_forward(x, kernel, recipe, bias=None, matmul=block_matmul, kernel_out_in=False, x_tiles=None):
    """The block-scaled forward: x in 1 x 128 tiles, the kernel in 128 x 128
    blocks; also x's 128 x 1 tiles, for the kernel's gradient.

    Args:
        kernel: `(K, N)`, or `(N, K)` with `kernel_out_in`: quantized as
            stored (a block's elements, so its scale, are the same either
            way) and read transposed.
        x_tiles: x's copies made already (`block_quantize_input`), or None.

    Returns:
        `(y, residuals)` for `block_backward`.
    """
    fmt, margin, pow2 = recipe.forward_format, recipe.margin, recipe.power_of_two
    x_q, x_s, x_qc, x_sc = block_quantize_input(x, recipe) if x_tiles is None else x_tiles
    k_q, k_s = quantize_blocks(kernel, fmt, margin, pow2)
    if kernel_out_in:
        y = matmul(x_q, x_s, ops.transpose(k_q), ops.transpose(k_s), x.dtype, bias)
    else:
        y = matmul(x_q, x_s, k_q, k_s, x.dtype, bias)
    return y, (x_qc, x_sc, k_q, k_s)


def block_backward(grad, residuals, emit_token, recipe, x_dtype, kernel_dtype, matmul=block_matmul,
                   kernel_out_in=False):
    """The block-scaled backward: the output gradient in 1 x 128 tiles along
    N for dX (against the kernel's blocks, transposed) and in 128 x 1 tiles
    along M for dW (against x's); with `kernel_out_in` (an `(N, K)` kernel)
    dX is `g @ W` and dW is returned `(N, K)`, as the kernel.

    Returns:
        `(dx, dkernel, dpending)`, as `fp8_backward`.
    """
    x_qc, x_sc, k_q, k_s = residuals
    fmt, margin, pow2 = recipe.backward_format, recipe.margin, recipe.power_of_two
    g_q, g_s = quantize_tiles(grad, fmt, 1, margin, pow2)
    if kernel_out_in:
        dx = matmul(g_q, g_s, k_q, k_s, x_dtype)
    else:
        dx = matmul(g_q, g_s, ops.transpose(k_q), ops.transpose(k_s), x_dtype)
    g_qc, g_sc = quantize_tiles(grad, fmt, 0, margin, pow2)
    dkernel = matmul(ops.transpose(x_qc), ops.transpose(x_sc), g_qc, g_sc, kernel_dtype, b_tiles=True)
    if kernel_out_in:
        # `(x^T @ g)^T`, not `g^T @ x`: each stretch's product is multiplied
        # by x's tile scale, then the gradient's, in one order for both
        # layouts (the other order can round the other way).
        dkernel = ops.transpose(dkernel)
    amax = compute_amax(grad)
    return dx, dkernel, pending_cotangent(amax, emit_token)


# --------------------------------------------------------------------------- FP8 optimizer moments
# Adam's state in 3 bytes a parameter instead of 8 (`keras_fp8.optimizers.FP8AdamW`;
# docs/numerics.md, "Optimizer moments"). Both moments are cut into blocks of
# MOMENT_BLOCK contiguous elements of the flattened variable (the last block
# shorter), one float32 scale a block:
# - the first moment `m` in E4M3, the scale from the block's amax as block
#   scaling computes it (`block_scale`);
# - the second moment as its square root `r = sqrt(v)` in float16, the scale
#   the smallest power of two that keeps the block's largest `r` within
#   float16's range. The square root halves `v`'s dynamic range (that of the squared
#   gradients), float16's 11 significant bits keep Adam's slow decay of `v`
#   (1 - sqrt(beta_2) per step, 5e-4 at beta_2 = 0.999, above float16's
#   relative half step of 4.9e-4), which bfloat16's 8 would round away.
MOMENT_BLOCK = 128
FLOAT16_MAX = 65504.0


def _block_amax(x):
    """The amax of each MOMENT_BLOCK-element block of the flattened `x`
    (float32; inf for a block holding NaN, as `_tile_amax`). The last block
    is padded with zeros, which never raise an amax."""
    flat = ops.reshape(ops.cast(x, "float32"), (-1,))
    n = flat.shape[0]
    blocks = -(-n // MOMENT_BLOCK)
    if blocks * MOMENT_BLOCK != n:
        flat = compat.pad_with_zeros(flat, ((0, blocks * MOMENT_BLOCK - n),))
    return _tile_amax(ops.reshape(flat, (blocks, MOMENT_BLOCK)), 1)


def _blockwise(fn, x, scales):
    """`fn(block, scale)` on each MOMENT_BLOCK-element block of the flattened
    `x` with its block's scale, element by element, in `x`'s shape.

    The full blocks are one `(blocks, MOMENT_BLOCK)` view and the shorter
    last block a tensor of its own: no element is computed on a padded
    layout and cut back. (torch.compile's CPU code, writing such a cut-back
    result into a variable, loses the elements past the last full block.)
    """
    flat = ops.reshape(x, (-1,))
    n = flat.shape[0]
    full = n // MOMENT_BLOCK
    head = ops.reshape(flat[: full * MOMENT_BLOCK], (full, MOMENT_BLOCK))
    out = ops.reshape(fn(head, ops.expand_dims(scales[:full], -1)), (-1,))
    if full * MOMENT_BLOCK != n:
        out = ops.concatenate([out, fn(flat[full * MOMENT_BLOCK:], scales[full:])])
    return ops.reshape(out, x.shape)


def moment_blocks(shape):
    """The number of MOMENT_BLOCK-element blocks of a variable of `shape`
    (the length of its moments' scale vectors)."""
    return -(-int(np.prod(shape, dtype=np.int64)) // MOMENT_BLOCK)


def quantize_first_moment(m):
    """Quantizes Adam's first moment to E4M3, one scale per block.

    Args:
        m: A float tensor, any shape.

    Returns:
        `(q, scales)`: `q` a `float8_e4m3fn` tensor shaped like `m`, each
        element `Quantize(m, its block's scale)`; `scales` float32 of shape
        `(moment_blocks(m.shape),)`, `block_scale(amax, "e4m3")` of each
        block (1 for a block of zeros or with a non-finite value).
    """
    m = ops.cast(m, "float32")
    scales = block_scale(_block_amax(m), "e4m3")
    return _blockwise(lambda t, s: _quantize_scaled(t, s, "e4m3"), m, scales), scales


def dequantize_first_moment(q, scales):
    """`q * scale` of each block, float32, shaped like `q` (an E4M3 tensor)."""
    return _blockwise(ops.multiply, widen(q), scales)


def _power_of_two_at_least(s):
    """The smallest power of two `>= s`, for positive, normal, finite float32
    `s` below 2**127: `s` itself when its mantissa bits are zero, else the
    next exponent with a zero mantissa. Exact, from the bits (no `log2`, no
    table to copy to the device)."""
    bits = ops.view(ops.cast(s, "float32"), "int32")
    exponent = ops.bitwise_and(bits, 0x7F800000)
    mantissa = ops.bitwise_and(bits, 0x007FFFFF)
    up = ops.where(ops.equal(mantissa, 0), exponent, ops.add(exponent, 0x00800000))
    return ops.view(up, "float32")


def _root_scale(amax):
    """The power of two `>= max(amax * f32(1 / FLOAT16_MAX), 2**-126)`; 1 for
    a block of zeros or with a non-finite value."""
    base = ops.maximum(
        ops.multiply(amax, _float32_constant(1.0 / FLOAT16_MAX)), _float32_constant(MIN_SCALE)
    )
    usable = is_usable_amax(amax)
    # Unusable blocks (inf, NaN) go through the bits as 1, then get 1.
    base = ops.where(usable, base, ops.ones_like(base))
    return ops.where(usable, _power_of_two_at_least(base), ops.ones_like(base))


def quantize_second_moment(v):
    """Stores Adam's second moment as `sqrt(v)` in float16, one power-of-two
    scale per block.

    Args:
        v: A float tensor (non-negative), any shape.

    Returns:
        `(q, scales)`: `q` a float16 tensor shaped like `v`,
        `cast_RNE(clip(sqrt(v) * (1 / scale), -FLOAT16_MAX, FLOAT16_MAX))`
        (inf becomes NaN, as in `quantize`); `scales` float32 of shape
        `(moment_blocks(v.shape),)`.
    """
    r = ops.sqrt(ops.cast(v, "float32"))
    scales = _root_scale(_block_amax(r))

    def store(t, scale):
        scaled = ops.where(ops.isinf(t), float("nan"), ops.multiply(t, reciprocal(scale)))
        return ops.cast(ops.clip(scaled, -FLOAT16_MAX, FLOAT16_MAX), "float16")

    return _blockwise(store, r, scales), scales


def dequantize_second_moment(q, scales):
    """`(q * scale)**2` of each block, float32, shaped like `q` (a float16
    tensor). Exact: `q * scale` (a power of two) has at most 11 significant
    bits, its square at most 22."""
    # The barrier: a compiler may fold float32 -> float16 -> float32 (where
    # the quantization and this widening meet in one compiled function) into
    # nothing; the stored value is the float16 one.
    def square(t, scale):
        r = ops.multiply(t, scale)
        return ops.multiply(r, r)

    return _blockwise(square, widen(q), scales)


def adam_update_fp8_moments(variable, gradient, m_q, m_scales, v_q, v_scales, learning_rate, iteration,
                            beta_1, beta_2, epsilon):
    """One Adam step on moments stored in FP8 (`m`) and float16 (`sqrt(v)`).

    The moments are dequantized, Keras's Adam update runs in float32 with
    the same operations in the same order, the weight moves by the float32
    (not re-quantized) moments, and the new moments are quantized.
    AdamW's decoupled weight decay is applied before, by the optimizer.

    Args:
        variable: The weight (float32 master weight, or any float dtype).
        gradient: Its gradient.
        m_q, m_scales: The first moment (`quantize_first_moment`).
        v_q, v_scales: The second moment (`quantize_second_moment`).
        learning_rate: Scalar.
        iteration: The number of steps taken before this one (the first
            step is 0).
        beta_1, beta_2, epsilon: Python floats, as for `keras.optimizers.Adam`.

    Returns:
        `(new_variable, m_q, m_scales, v_q, v_scales)`, the variable in
        float32 (the caller rounds it to the variable's dtype).
    """
    lr = ops.cast(learning_rate, "float32")
    g = ops.cast(gradient, "float32")
    w = ops.cast(variable, "float32")
    local_step = ops.cast(iteration + 1, "float32")
    beta_1_power = ops.power(_float32_constant(beta_1), local_step)
    beta_2_power = ops.power(_float32_constant(beta_2), local_step)
    alpha = lr * ops.sqrt(1.0 - beta_2_power) / (1.0 - beta_1_power)
    m = dequantize_first_moment(m_q, m_scales)
    v = dequantize_second_moment(v_q, v_scales)
    m = ops.add(m, ops.multiply(ops.subtract(g, m), _float32_constant(1.0 - beta_1)))
    v = ops.add(v, ops.multiply(ops.subtract(ops.square(g), v), _float32_constant(1.0 - beta_2)))
    w = ops.subtract(w, ops.divide(ops.multiply(m, alpha), ops.add(ops.sqrt(v), _float32_constant(epsilon))))
    return (w,) + quantize_first_moment(m) + quantize_second_moment(v)
