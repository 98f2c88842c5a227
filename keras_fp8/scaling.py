"""The scale/amax math in `keras.ops`: the reference semantics of keras-fp8.

Every backend and every compiled kernel must reproduce these functions bit for
bit (for the same inputs and scale). Conventions, from DESIGN.md:

- `scale` is the dequantization step: `q = cast(clip(x * (1 / scale)))`,
  clipped to the format's range, and `x ~= q * scale`.
- `scale = (amax_window * f32(1 / fmt_max)) * f32(2**-margin)`; a zero or
  non-finite window keeps the previous scale.

Why reciprocals, not divisions: XLA rewrites a division by a broadcast scalar
or a constant into a multiplication by its reciprocal (on CPU and GPU), so
`x / scale` is not bit-reproducible across backends, while a scalar
reciprocal followed by an elementwise product rounds the same way in NumPy,
torch, XLA and the CUDA kernels. (DESIGN.md writes `x / scale`; this is the
bit-exact form of it, recorded in docs/numerics.md.)
- `history[0]` is the newest amax; recording shifts by one and writes slot 0.
  A non-finite amax is never recorded.
"""

import numpy as np
from keras import ops

from keras_fp8 import recipes


def quantize(x, scale, fmt):
    """Quantizes `x` to FP8 with a saturating cast.

    `x` is multiplied by `reciprocal(scale)` in float32 and the result is
    clipped to the format's range before the cast: JAX/ml_dtypes turn E4M3 overflow into NaN and every
    backend turns E5M2 overflow into inf, while FP8 training wants saturation.
    NaN stays NaN (clipping keeps it).

    Args:
        x: A floating-point tensor.
        scale: A float32 scalar tensor, the dequantization step.
        fmt: `"e4m3"` or `"e5m2"`.

    Returns:
        A tensor of dtype `float8_e4m3fn` or `float8_e5m2`, shaped like `x`.
    """
    fmt_max = recipes.FORMAT_MAX[fmt]
    scaled = ops.multiply(ops.cast(x, "float32"), reciprocal(scale))
    return ops.cast(
        ops.clip(scaled, -fmt_max, fmt_max), recipes.FORMAT_DTYPE[fmt]
    )


def reciprocal(scale):
    """`1 / scale` in float32 (one correctly rounded scalar division)."""
    return ops.divide(1.0, ops.cast(scale, "float32"))


def dequantize(q, scale, dtype="float32"):
    """Returns `q * scale` in `dtype` (exact in float32 for scalar scales)."""
    return ops.cast(ops.multiply(ops.cast(q, "float32"), scale), dtype)


def compute_amax(x):
    """Returns `max(|x|)` as a float32 scalar; NaN or inf if `x` has one."""
    return ops.amax(ops.abs(ops.cast(x, "float32")))


def is_usable_amax(amax):
    """True where `amax` is finite and positive (it can define a scale)."""
    return ops.logical_and(ops.isfinite(amax), ops.greater(amax, 0.0))


def _float32_constant(value):
    """`value` rounded to float32, as a float32 tensor.

    Converted from a Python float (exact in float32), not a NumPy scalar:
    torch.compile cannot trace Keras's conversion of a NumPy scalar (a graph
    break per use). The dtype is explicit, whatever `keras.config.floatx()`.
    """
    return ops.convert_to_tensor(float(np.float32(value)), dtype="float32")


def inverse_format_max(fmt):
    """`1 / fmt_max` rounded to float32: the constant scales are built from."""
    return _float32_constant(1.0 / recipes.FORMAT_MAX[fmt])


def compute_scale(amax_window, previous_scale, fmt, margin=0.0):
    """Returns the scale for `amax_window`, or `previous_scale` if unusable.

    Args:
        amax_window: float32 scalar, the amax the scale should cover.
        previous_scale: float32 scalar, kept when the window is zero or not
            finite.
        fmt: `"e4m3"` or `"e5m2"`.
        margin: The scale is divided by `2**margin`.

    Returns:
        A float32 scalar tensor.
    """
    scale = ops.multiply(
        ops.multiply(amax_window, inverse_format_max(fmt)),
        _float32_constant(2.0 ** -float(margin)),
    )
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
        call's tensor with (seeded from `amax` when the history is empty), and
        the state after the call (unchanged when `record` is False).
    """
    seeded = compute_scale(amax, scale, fmt, recipe.margin)
    scale_used = ops.where(history_is_empty(history), seeded, scale)
    if not record:
        return scale_used, history, scale
    new_history = record_amax(history, amax)
    window = amax_window(
        new_history, recipe.amax_compute_algo, recipe.history_len
    )
    new_scale = compute_scale(window, scale_used, fmt, recipe.margin)
    return scale_used, new_history, new_scale


def operand_scale(amax, history, scale, fmt, recipe, record=True):
    """Scale step for any recipe: delayed or current.

    Current scaling uses `compute_scale(amax, scale)` and leaves the history
    unchanged; `new_scale` is the scale it used.

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
