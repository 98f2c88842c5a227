"""FP8 formats and scaling recipes: plain data, no tensors.

A recipe says how a layer picks the scale of each FP8 operand. It is separate
from the layers that use it (as in TransformerEngine), serializable with
`get_config`, and the same on every backend.
"""

import dataclasses
import math
import numbers

from keras.saving import register_keras_serializable

E4M3 = "e4m3"
E5M2 = "e5m2"

# Largest finite value of each FP8 format (float8_e4m3fn and float8_e5m2).
FORMAT_MAX = {E4M3: 448.0, E5M2: 57344.0}
# The element dtype name of each format, as `keras.ops` and ml_dtypes spell it.
FORMAT_DTYPE = {E4M3: "float8_e4m3fn", E5M2: "float8_e5m2"}

# fp8_format -> (forward format, backward format). HYBRID follows
# TransformerEngine: E4M3's extra mantissa bit for activations and weights,
# E5M2's range for gradients.
FP8_FORMATS = {
    "hybrid": (E4M3, E5M2),
    "e4m3": (E4M3, E4M3),
}
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The window's amax maps to fmt_max / 2**margin; past 8 the top of E4M3 is
# below 2 and the format no longer holds a tensor.
MAX_MARGIN = 8.0
# The longest amax history (2**20 entries: 4 MB per operand).
MAX_HISTORY_LEN = 2**20
# The smallest scale (before the margin): the smallest normal float32. Its
# reciprocal, 2**126, is finite; and no intermediate is subnormal, which
# XLA's CPU backend would flush to zero.
MIN_SCALE = 2.0**-126
# Fold counts wrap here, so that fold tokens stay exact in float32.
FOLD_COUNT_PERIOD = 2.0**20
# Below this M*K*N, an FP8 layer on a GPU with real FP8 GEMMs runs what the
# compute-dtype layer runs on JAX: the GEMM is too small for FP8 to win back
# its quantizes. Equal to `torch_ops.DEFAULT_MIN_GEMM_SIZE` (ConstantsTest).
DEFAULT_MIN_GEMM_SIZE = 8192 * 2048 * 2048


def _check_fp8_format(fp8_format):
    if fp8_format not in FP8_FORMATS:
        raise ValueError(
            "Invalid `fp8_format`. Expected one of "
            f"{sorted(FP8_FORMATS)}. Received: fp8_format={fp8_format!r}"
        )


def _check_margin(margin):
    if (
        isinstance(margin, bool)
        or not isinstance(margin, (int, float))
        or not 0 <= margin <= MAX_MARGIN
    ):
        raise ValueError(
            f"Invalid `margin`. Expected a number from 0 to {MAX_MARGIN:g} "
            "(the window's amax maps to fmt_max / 2**margin). "
            f"Received: margin={margin!r}"
        )


def _check_share_quantized_inputs(value):
    if not isinstance(value, bool):
        raise ValueError(
            "Invalid `share_quantized_inputs`. Expected a bool. "
            f"Received: share_quantized_inputs={value!r}"
        )


def _check_bool_field(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"Invalid `{name}`. Expected a bool. Received: {name}={value!r}")


def check_min_gemm_size(min_gemm_size):
    """Validates a `min_gemm_size` setting (None or an integer >= 0).

    Returns:
        The value, unchanged.
    """
    if min_gemm_size is not None and (
        isinstance(min_gemm_size, bool)
        or not isinstance(min_gemm_size, int)
        or min_gemm_size < 0
    ):
        raise ValueError(
            "Invalid `min_gemm_size`. Expected None or an integer >= 0. "
            f"Received: min_gemm_size={min_gemm_size!r}"
        )
    return min_gemm_size


def gemm_size(dims):
    """`M*N*K` of a GEMM's `dims` `(M, K, N)`, or None where a size is not
    known: no call yet, or a symbol (Keras's shape inference on JAX traces
    the batch as one, which no comparison may touch). A call of unknown
    size takes the FP8 path: its output spec is the same either way."""
    if dims is None:
        return None
    for d in dims:  # `type(d) is int` first: an ABC check per call costs host time
        if type(d) is not int and not isinstance(d, numbers.Integral):
            return None
    return math.prod(dims)


class Recipe:
    """Base class of the scaling recipes.

    Subclasses are frozen dataclasses; `forward_format` and `backward_format`
    name the FP8 element format of the forward operands (input, kernel) and of
    the output gradient.
    """

    name = None

    @property
    def forward_format(self):
        return FP8_FORMATS[self.fp8_format][0]

    @property
    def backward_format(self):
        return FP8_FORMATS[self.fp8_format][1]

    def get_config(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def replace(self, **changes):
        """Returns a copy of this recipe with `changes` applied."""
        return dataclasses.replace(self, **changes)


@register_keras_serializable(package="keras_fp8")
@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Delayed scaling: each call uses a scale computed from earlier amaxes.

    The scale used at call `t` comes only from the amaxes recorded before call
    `t` (the first call seeds the history with its own amax); after quantizing,
    the call's amax is recorded in a history of `history_len` entries, newest
    first. This is TransformerEngine's default recipe: no extra pass over the
    tensor before quantizing.

    Args:
        history_len: Number of amaxes kept per operand, 1 to 2**20.
        margin: Headroom, 0 to 8: the window's amax maps to
            `fmt_max / 2**margin`, so a tensor whose amax grows by up to
            `2**margin` over the window's still does not saturate.
        amax_compute_algo: `"max"` (max over the history) or `"most_recent"`
            (the newest entry).
        fp8_format: `"hybrid"` (E4M3 forward, E5M2 output gradient) or
            `"e4m3"` (E4M3 both ways).
        share_quantized_inputs: Whether layers that read the same input
            tensor (Q, K and V; gate and up) with the same recipe quantize it
            once and share the FP8 copy, its scale and its amax; each layer
            still records the amax in its own history. Exactly the unshared
            results wherever the layers' input scales are equal (layers
            trained together have equal histories); docs/numerics.md, "One
            quantize per tensor". False: every layer quantizes its input.
        fuse_producers: Whether the op before a layer (keras_hub's Llama
            RMSNorm before Q, K and V, its gated FFN's product before the
            down projection) writes the layer's FP8 input in the same pass,
            quantized with the layer's own scale, on torch, with
            `share_quantized_inputs`. The same bits either way;
            docs/numerics.md, "Fused producers". On JAX, XLA fuses the
            quantize into the producer itself and this has no effect.
        requantize_weight_in_backward: Whether the backward quantizes
            the kernel again, with the scale the forward used (the same
            bytes), instead of keeping its FP8 copy from the forward: one
            byte per kernel element less held from the forward to the
            backward, one more kernel quantize per backward. The same bits
            either way; docs/numerics.md, "Weights in the backward".

    Example:

    >>> recipe = DelayedScaling(history_len=16, amax_compute_algo="max")
    >>> recipe.forward_format, recipe.backward_format
    ('e4m3', 'e5m2')
    """

    history_len: int = 1024
    margin: float = 0.0
    amax_compute_algo: str = "max"
    fp8_format: str = "hybrid"
    share_quantized_inputs: bool = True
    fuse_producers: bool = True
    requantize_weight_in_backward: bool = False

    name = "delayed"

    def __post_init__(self):
        if (
            isinstance(self.history_len, bool)
            or not isinstance(self.history_len, int)
            or not 1 <= self.history_len <= MAX_HISTORY_LEN
        ):
            raise ValueError(
                f"Invalid `history_len`. Expected an integer from 1 to {MAX_HISTORY_LEN}. "
                f"Received: history_len={self.history_len!r}"
            )
        _check_margin(self.margin)
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                "Invalid `amax_compute_algo`. Expected one of "
                f"{list(AMAX_COMPUTE_ALGOS)}. "
                f"Received: amax_compute_algo={self.amax_compute_algo!r}"
            )
        _check_fp8_format(self.fp8_format)
        _check_share_quantized_inputs(self.share_quantized_inputs)
        _check_bool_field("fuse_producers", self.fuse_producers)
        _check_bool_field("requantize_weight_in_backward", self.requantize_weight_in_backward)


@register_keras_serializable(package="keras_fp8")
@dataclasses.dataclass(frozen=True)
class CurrentScaling(Recipe):
    """Current (dynamic) scaling: the scale comes from the tensor itself.

    Each call computes the amax of the tensor it is about to quantize and
    derives the scale from it in the same call. No history is used; the layer
    still records the scale it used in its `{role}_scale` variable.

    Args:
        margin: Headroom, 0 to 8: the tensor's amax maps to
            `fmt_max / 2**margin`.
        fp8_format: `"hybrid"` or `"e4m3"`.
        share_quantized_inputs: As for `DelayedScaling` (the scale comes
            from the tensor, so sharing never changes a result).
        requantize_weight_in_backward: As for `DelayedScaling`.

    Example:

    >>> CurrentScaling(margin=1).get_config()["margin"]
    1
    """

    margin: float = 0.0
    fp8_format: str = "hybrid"
    share_quantized_inputs: bool = True
    requantize_weight_in_backward: bool = False

    name = "current"

    def __post_init__(self):
        _check_margin(self.margin)
        _check_fp8_format(self.fp8_format)
        _check_share_quantized_inputs(self.share_quantized_inputs)
        _check_bool_field("requantize_weight_in_backward", self.requantize_weight_in_backward)


@register_keras_serializable(package="keras_fp8")
@dataclasses.dataclass(frozen=True)
class BlockScaling(Recipe):
    """Block scaling: a scale per tile, from the tile's own values.

    Activations and output gradients get one scale per 1 x 128 tile along
    the contraction dimension, weights one per 128 x 128 block (DeepSeek-V3's
    fine-grained recipe); no history. Finer scales follow outliers locally: a
    large value saturates nothing outside its tile. The layers keep the
    per-tensor state variables (histories of one entry) for a uniform
    checkpoint layout; the tile scales are computed in every call and not
    stored (docs/design.md, "State").

    Args:
        margin: Headroom, 0 to 8: each tile's amax maps to
            `fmt_max / 2**margin`.
        fp8_format: `"e4m3"` (E4M3 everywhere, the recipe's usual form) or
            `"hybrid"` (E5M2 output gradients).
        power_of_two: Round each scale up to a power of two (exact
            multiplications; no saturation).
        share_quantized_inputs: As for `DelayedScaling` (the tile scales
            come from the tensor, so sharing never changes a result).
        requantize_weight_in_backward: As for `DelayedScaling` (the
            kernel's block scales come from its values alone).

    Example:

    >>> BlockScaling(power_of_two=True).name
    'block'
    """

    margin: float = 0.0
    fp8_format: str = "e4m3"
    power_of_two: bool = False
    share_quantized_inputs: bool = True
    requantize_weight_in_backward: bool = False

    name = "block"
    block_size = 128

    def __post_init__(self):
        _check_margin(self.margin)
        _check_fp8_format(self.fp8_format)
        if not isinstance(self.power_of_two, bool):
            raise ValueError(
                "Invalid `power_of_two`. Expected a bool. "
                f"Received: power_of_two={self.power_of_two!r}"
            )
        _check_share_quantized_inputs(self.share_quantized_inputs)
        _check_bool_field("requantize_weight_in_backward", self.requantize_weight_in_backward)


RECIPES = {"delayed": DelayedScaling, "current": CurrentScaling, "block": BlockScaling}


def get(identifier):
    """Returns a recipe from a recipe, a config dict, a name, or None.

    Args:
        identifier: A `Recipe`, `None` (the default `DelayedScaling()`), one of
            `"delayed"`/`"current"`/`"block"`, or a dict as returned by
            `keras.saving.serialize_keras_object(recipe)`.

    Returns:
        A `Recipe` instance.
    """
    if identifier is None:
        return DelayedScaling()
    if isinstance(identifier, Recipe):
        return identifier
    if isinstance(identifier, str) and identifier in RECIPES:
        return RECIPES[identifier]()
    if isinstance(identifier, dict):
        from keras.saving import deserialize_keras_object

        recipe = deserialize_keras_object(identifier)
        if isinstance(recipe, Recipe):
            return recipe
    raise ValueError(
        "Invalid `recipe`. Expected a keras_fp8.recipes.DelayedScaling or "
        "CurrentScaling instance, one of "
        f"{sorted(RECIPES)}, or None. Received: recipe={identifier!r}"
    )
