"""Compiled training on torch: `compile_blocks` (regional compilation).

Keras's `model.compile(jit_compile=True)` on torch compiles the whole train
step with `torch.compile`; dynamo then traces every layer call of the model
through Keras's generic `Layer.__call__`, and its compile time grows with
the depth of the model. `compile_blocks` compiles the repeated blocks instead
(each transformer block's `call`, as torchtitan does): one compilation serves
every block of a class, whatever the depth, and the layer calls inside a
block cost no host time per step. The rest of the step (embedding, head,
loss, optimizer) runs eagerly. docs/guide.md, "Compiled training on torch",
compares the two.
"""

import keras

from keras_fp8 import compat


def repeated_blocks(model):
    """The repeated blocks of `model`: the layers whose class has at least
    two instances in `model`, each holding layers of its own (a block inside
    another such block is left to the outer one; models are never blocks).

    Args:
        model: A Keras model or layer.

    Returns:
        The blocks, in Keras's layer order (e.g. keras_hub's transformer
        decoder layers).
    """
    layers = [layer for layer in compat.sublayers(model, include_self=False) if not isinstance(layer, keras.Model)]
    counts = {}
    for layer in layers:
        counts[type(layer)] = counts.get(type(layer), 0) + 1
    candidates = [
        layer for layer in layers
        if counts[type(layer)] >= 2 and compat.sublayers(layer, include_self=False)
    ]
    inner = {id(sub) for block in candidates for sub in compat.sublayers(block, include_self=False)}
    return [block for block in candidates if id(block) not in inner]


def compile_blocks(model, blocks=None, **options):
    """Compiles each repeated block of `model` with `torch.compile` (torch
    backend): regional compilation.

    Each block's `call` runs compiled from its next call on; its
    `Layer.__call__` (and everything outside the blocks: embedding, head,
    loss, optimizer) stays eager. The blocks of one class share one
    compilation: the first block's first training call compiles (once per
    `training` value, and once more where input shapes change, e.g. a
    smaller last batch), every later call and block reuses it. FP8 layers
    inside run the same FP8 ops on the same state variables as eagerly.

    Use it instead of `model.compile(jit_compile=True)` (not with it): that
    compiles the whole step, at a compile time that grows with the number of
    blocks.

    Args:
        model: A Keras model or layer.
        blocks: The layers to compile: None for `repeated_blocks(model)`, a
            layer class (its instances in `model`), or a list of layers.
        **options: Passed to `torch.compile`, e.g. `mode=`, `backend=`,
            `dynamic=`, `fullgraph=True`.

    Returns:
        The list of layers compiled.

    Example:

    >>> keras.mixed_precision.set_global_policy("fp8_hybrid")
    >>> model = keras_hub.models.LlamaCausalLM(backbone=..., preprocessor=None)
    >>> keras_fp8.compile_blocks(model)  # the transformer decoder layers
    >>> model.compile(optimizer="adamw", loss=...)
    >>> model.fit(x, y)
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"compile_blocks: `model` must be a Keras model or layer; got {type(model).__name__}.")
    backend = keras.backend.backend()
    if backend != "torch":
        raise NotImplementedError(
            "keras_fp8.compile_blocks compiles with torch.compile (the torch backend); the Keras backend "
            f"is {backend!r}. On JAX, `model.compile(jit_compile=True)` (Keras's default there) compiles "
            "the whole step with XLA."
        )
    layers = _resolve_blocks(model, blocks)
    from keras_fp8.backends import torch_step

    torch_step.compile_blocks(layers, options)
    return layers


def _resolve_blocks(model, blocks):
    if blocks is None:
        layers = repeated_blocks(model)
        if not layers:
            raise ValueError(
                f"compile_blocks: found no repeated blocks in {model.name!r} (layers of one class, at least "
                "two, each holding layers). Pass `blocks=` a layer class or a list of layers."
            )
        return layers
    if isinstance(blocks, type):
        if not issubclass(blocks, keras.layers.Layer):
            raise TypeError(f"compile_blocks: `blocks` must be a Keras layer class or a list of layers; "
                            f"got the class {blocks.__name__}.")
        layers = [layer for layer in compat.sublayers(model) if type(layer) is blocks]
        if not layers:
            raise ValueError(f"compile_blocks: {model.name!r} holds no layer of class {blocks.__name__} (`blocks`).")
        return layers
    if isinstance(blocks, (list, tuple)) and blocks:
        wrong = [b for b in blocks if not isinstance(b, keras.layers.Layer)]
        if wrong:
            raise TypeError(f"compile_blocks: every entry of `blocks` must be a Keras layer; got "
                            f"{type(wrong[0]).__name__}.")
        return list(blocks)
    raise TypeError(f"compile_blocks: `blocks` must be None, a Keras layer class or a non-empty list of layers; "
                    f"got {blocks!r}.")


def register():
    """At `import keras_fp8`: the torch backend's step patches
    (`keras_fp8.backends.torch_step.configure`)."""
    if keras.backend.backend() == "torch":
        from keras_fp8.backends import torch_step

        torch_step.configure()
