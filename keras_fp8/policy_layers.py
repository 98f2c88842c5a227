"""What an FP8 policy does to Keras's own `Dense`, `EinsumDense` and
`ReversibleEmbedding`.

Keras model zoos (keras_hub included) build their projections from
`keras.layers.Dense` / `EinsumDense`. After `import keras_fp8` such a layer
that builds under an FP8 policy (its own, the global one, the one an
`autocast` scope gives, or its entry in a `DTypePolicyMap`) becomes the FP8
layer (`FP8Dense` / `FP8EinsumDense`) at the start of its `build`: the same
object, the same kernel and bias, plus the FP8 state, running exactly the FP8
layers' code. Exceptions, which build as plain layers:

- layers the policy's `exclude` matches in their path below the model (no
  warning: asked for; `keras_fp8.summary` lists them);
- with a one-time warning naming the layer: a `ReversibleEmbedding` (the
  token embedding whose reverse direction is the vocabulary projection of
  keras_hub's language models; it becomes `FP8ReversibleEmbedding`) whose
  `reverse_dtype` is set;
- with a one-time warning naming the layer: a subclass of `Dense` /
  `EinsumDense` (its own methods would be lost), LoRA at build
  (`lora_rank=`), a Keras-quantized layer, and an equation `FP8EinsumDense`
  does not support.

The reverse direction: a plain `Dense`/`EinsumDense` given an FP8 checkpoint
of itself (`.weights.h5` of the FP8 form, or a `.keras` file whose layer is
rebuilt plain) loads the kernel and bias and leaves the FP8 state out, with a
one-time warning.

Weight files address an FP8 layer as its plain class (`layers/dense`, not
`layers/fp8_dense`), so the plain and the FP8 form of a model read each
other's `.weights.h5`.

Keras's quantization (`model.quantize`, and `layer.quantize` on any layer)
refuses FP8 layers and layers under FP8 policies with a ValueError before it
changes anything (`keras_fp8.unconvert` first). The hooks are installed by
`keras_fp8/compat.py` (patches 4 to 6).
"""

import warnings

from keras_fp8 import compat
from keras_fp8 import policy as policy_lib
from keras_fp8.layers import fp8_state
from keras_fp8.layers import swap


def build(layer, input_shape, keras_build):
    """`Dense.build` / `EinsumDense.build` under keras_fp8.

    Args:
        layer: The layer being built (its path is set: Keras's build wrapper
            sets it before calling `build`).
        input_shape: The argument of `build`.
        keras_build: Keras's own `build` of the layer's plain class.
    """
    if isinstance(layer, swap.FP8_CLASSES):
        return keras_build(layer, input_shape)
    policy = policy_lib.layer_policy(layer)
    if not isinstance(policy, policy_lib.FP8DTypePolicy) or policy.excludes(layer):
        return keras_build(layer, input_shape)
    ndim = len(input_shape) if isinstance(input_shape, (tuple, list)) else None
    reason = swap.why_not_fp8(layer, ndim)
    if reason is not None:
        fp8_state.warn_runs_without_fp8(layer, reason, what="is built as a plain layer, computing")
        return keras_build(layer, input_shape)
    swap.to_fp8(layer)
    return type(layer).build(layer, input_shape)


_warned_dropped_state = []


def load_own_variables(layer, store, keras_load):
    """`Dense.load_own_variables` / `EinsumDense.load_own_variables` under
    keras_fp8: an FP8 checkpoint of the layer loads its kernel and bias."""
    if type(layer) in swap.PLAIN_CLASSES and layer.built and layer.quantization_mode is None:
        own_count = swap.plain_variable_count(layer)
        if fp8_state.is_fp8_checkpoint(store, own_count):
            if not _warned_dropped_state:
                _warned_dropped_state.append(True)
                warnings.warn(
                    f"keras_fp8: layer '{layer.path or layer.name}' "
                    f"({type(layer).__name__}, policy "
                    f"'{policy_lib.layer_policy(layer).name}') loads the kernel "
                    "and bias of an FP8 checkpoint and leaves its FP8 state "
                    "out (this warning is shown once, for the first such "
                    "layer). That is expected when loading into the plain "
                    "model; to resume FP8 training, build the layers under an "
                    "FP8 policy (a subclassed model's layers take the global "
                    "policy in effect at load time).",
                    stacklevel=3,
                )
            store = {str(i): store[str(i)] for i in range(own_count)}
    return keras_load(layer, store)


def check_quantize(model, mode):
    """Raises before Keras's `quantize(mode)` of `model` (a model or a single
    layer) changes anything when `model` is or holds FP8 layers or layers
    with weights under FP8 policies (an `Embedding`, a `Dense` that
    `exclude` keeps plain, a `Dense` subclass: Keras would replace the
    kernel, then fail on the policy name). Layers without weights have
    nothing to quantize (Keras's `model.quantize` skips them)."""
    # FP8 layers, and layers with weights of their own under FP8 policies
    # (Keras would quantize them from a policy name it cannot parse).
    fp8 = [
        layer
        for layer in compat.sublayers(model)
        if isinstance(layer, swap.FP8_CLASSES)
        or (isinstance(policy_lib.layer_policy(layer), policy_lib.FP8DTypePolicy)
            and layer.weights
            and not compat.sublayers(layer, include_self=False))
    ]
    if fp8:
        raise fp8_state.quantize_error(fp8, mode)


def register():
    """Installs the hooks (idempotent; done at `import keras_fp8`:
    `keras_fp8/compat.py`, patches 4 to 6)."""
    compat.hook_dense_layers(build, load_own_variables)
    compat.check_before_quantize(check_quantize)
    compat.name_in_weight_files_as(
        {fp8.__name__: plain.__name__ for fp8, plain in swap.PLAIN_CLASS.items()}
    )
