"""Turning a Keras `Dense`/`EinsumDense`/`ReversibleEmbedding` into its FP8
layer and back, in place.

The FP8 classes are the plain classes plus `FP8StateMixin`: an instance
changes class by `__class__` assignment and keeps its identity, its kernel
and bias variables, its name and its path. Used when a layer builds under an
FP8 policy (`keras_fp8/policy_layers.py`), by `keras_fp8.convert` and by
`keras_fp8.unconvert`.
"""

import keras

from keras_fp8 import compat
from keras_fp8.layers.fp8_dense import FP8Dense
from keras_fp8.layers.fp8_einsum_dense import FP8EinsumDense
from keras_fp8.layers.fp8_einsum_dense import MatmulPlan
from keras_fp8.layers.fp8_reversible_embedding import FP8ReversibleEmbedding
from keras_fp8.layers.fp8_state import STATE_VARIABLE_NAMES

# Exact plain class -> FP8 class. Subclasses of Dense/EinsumDense are not
# swapped: their own methods would be lost.
FP8_CLASS = {
    keras.layers.Dense: FP8Dense,
    keras.layers.EinsumDense: FP8EinsumDense,
    # The token embedding of keras_hub's language models: its reverse
    # direction is the vocabulary projection.
    keras.layers.ReversibleEmbedding: FP8ReversibleEmbedding,
}
PLAIN_CLASS = {fp8: plain for plain, fp8 in FP8_CLASS.items()}
FP8_CLASSES = tuple(PLAIN_CLASS)
PLAIN_CLASSES = tuple(FP8_CLASS)


def plain_base(layer):
    """The plain class of `FP8_CLASS` (`keras.layers.Dense`, `EinsumDense`,
    `ReversibleEmbedding`) that `layer` is an instance of, else None."""
    for plain in PLAIN_CLASSES:
        if isinstance(layer, plain):
            return plain
    return None


def why_not_fp8(layer, input_ndim):
    """Why `layer`, a plain layer of `FP8_CLASS` that is not FP8 yet, cannot
    become an FP8 layer (None: it can).

    Args:
        layer: The layer, built or about to build.
        input_ndim: The rank of its input (an ellipsis equation needs it),
            or None when unknown.

    Returns:
        A reason, worded to follow "is not FP8:", or None.
    """
    plain = plain_base(layer)
    if plain is None:
        return "it is not a Dense, EinsumDense or ReversibleEmbedding layer"
    if type(layer) is not plain:
        return (
            f"its class {type(layer).__name__} is a subclass of "
            f"{plain.__name__}; converting it would drop its own methods"
        )
    if layer.lora_enabled or (not layer.built and layer.lora_rank):
        return "LoRA is enabled (FP8 layers do not support LoRA)"
    if layer.quantization_mode is not None:
        return f"it is quantized (quantization_mode='{layer.quantization_mode}')"
    if plain is keras.layers.ReversibleEmbedding and layer.reverse_dtype is not None:
        return (
            f"its reverse_dtype is set ({layer.reverse_dtype!r}): its "
            "projection runs in that dtype, as asked"
        )
    if plain is keras.layers.EinsumDense:
        if input_ndim is None:
            if "..." in layer.equation:
                return (
                    "the input rank of its ellipsis equation "
                    f"{layer.equation!r} is unknown"
                )
            # MatmulPlan only needs the rank for an ellipsis equation.
            input_ndim = len(layer.equation.partition(",")[0])
        try:
            MatmulPlan(layer.equation, input_ndim)
        except ValueError as e:
            return str(e)
    return None


def plain_variable_count(layer):
    """How many variables a plain, unquantized layer of `FP8_CLASS` saves
    (what precedes the FP8 state in an FP8 checkpoint of it)."""
    if isinstance(layer, keras.layers.ReversibleEmbedding):
        return 1 if layer.tie_weights else 2
    return 2 if layer.bias is not None else 1


def to_fp8(layer, recipe=None, min_gemm_size=None):
    """Makes `layer` (an exact `Dense`/`EinsumDense`) an instance of its FP8
    class, with the FP8 arguments `recipe` and `min_gemm_size`. A built
    layer still needs its FP8 state (`build_fp8_state`); an unbuilt one gets
    it from the FP8 class's `build`."""
    fp8_class = FP8_CLASS[type(layer)]
    # `__class__` assignment bypasses Layer.__setattr__ (the tracker and, on
    # torch, nn.Module's registration) on purpose: it is not state.
    object.__setattr__(layer, "__class__", fp8_class)
    compat.refresh_call_signature(layer)  # FP8ReversibleEmbedding's takes `training`
    layer.init_fp8(recipe, min_gemm_size)


def to_plain(layer):
    """Makes an FP8 layer (an exact `FP8Dense`/`FP8EinsumDense`) a plain
    `Dense`/`EinsumDense` again: its FP8 state variables are untracked and
    deleted, its kernel and bias stay."""
    for name in STATE_VARIABLE_NAMES:
        if name in vars(layer):
            compat.remove_variable(layer, name)
    for name in ("recipe", "min_gemm_size", "_plan"):
        if name in vars(layer):
            delattr(layer, name)
    for name in ("_last_gemm", "_fp8_backend_config", "_bias_columns"):  # set outside Keras's tracking
        layer.__dict__.pop(name, None)
    object.__setattr__(layer, "__class__", PLAIN_CLASS[type(layer)])
    compat.refresh_call_signature(layer)
