"""Compiled training on torch: `compile_blocks` (regional compilation) and
`compile_optimizer` (the optimizer's per-step update).

Keras's `model.compile(jit_compile=True)` on torch compiles the whole train
step with `torch.compile`; dynamo then traces every layer call of the model
through Keras's generic `Layer.__call__`, and its compile time grows with
the depth of the model. `compile_blocks` compiles the repeated blocks instead
(each transformer block's `call`, as torchtitan does): one compilation serves
every block of a class, whatever the depth, and the layer calls inside a
block cost no host time per step. The rest of the step (embedding, head,
loss, optimizer) runs eagerly; `compile_optimizer` compiles the optimizer's
update. docs/guide.md, "Compiled training on torch", compares the ways.
"""

import keras

from keras_fp8 import compat
from keras_fp8 import moments


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


def compile_optimizer(optimizer, **options):
    """Runs the optimizer's per-step update through `torch.compile` (torch
    backend).

    Keras's torch optimizers update the weights with a chain of
    `torch._foreach_*` ops (Adam: about ten passes over every weight,
    gradient and moment); `FP8Adam` / `FP8AdamW` with a chain of eager ops
    per variable. Compiled, the compiler fuses the element-wise chain:

    - Keras's optimizers: the whole update (gradient clipping, weight decay,
      the update of every variable and its moments, EMA) is one graph.
    - `FP8Adam` / `FP8AdamW`: each variable's step (dequantize the moments,
      update, quantize) is a graph, one compilation per variable shape
      shared by all the variables of that shape (one graph of every
      variable's block quantization would take minutes to compile);
      clipping, weight decay and EMA stay Keras's eager ops.

    The update is the optimizer's own code, traced: the same operations on
    the same variables, the same state, `.keras` files and checkpoints. It
    compiles at the first step; the learning rate and the iteration counter
    are tensors of the graphs, so a changing learning rate (a schedule, a
    callback) compiles nothing new.

    Any Keras optimizer (`Adam`, `AdamW`, `SGD`, `FP8AdamW`, ...). For a
    `LossScaleOptimizer` the optimizer it wraps is compiled (its loss-scale
    check and skip of non-finite steps stay eager, as Keras runs them).
    Not supported (a ValueError): `gradient_accumulation_steps` and
    `ema_overwrite_frequency`, under which Keras's update branches on a
    tensor at every step. Inside `model.compile(jit_compile=True)` the
    update is already part of the compiled step and is traced with it
    (compiled once, not twice). A loaded model's optimizer is a new one:
    compile it again.

    Args:
        optimizer: A Keras optimizer instance, or an identifier
            `keras.optimizers.get` takes (`"adamw"`, a config dict).
        **options: Passed to `torch.compile`, e.g. `mode=`, `backend=`,
            `fullgraph=True`.

    Returns:
        The optimizer (the instance given, or the one the identifier names),
        its update compiled from its next step on.

    Example:

    >>> model.compile(optimizer=keras_fp8.compile_optimizer(keras.optimizers.AdamW(1e-3)), loss=...)
    >>> optimizer = keras_fp8.compile_optimizer(keras_fp8.optimizers.FP8AdamW(1e-3))
    """
    backend = keras.backend.backend()
    if backend != "torch":
        raise NotImplementedError(
            "keras_fp8.compile_optimizer compiles with torch.compile (the torch backend); the Keras backend is "
            f"{backend!r}. On JAX, Keras compiles the whole train step with XLA, the optimizer's update included "
            "(`jit_compile=True`, its default there): there is nothing to add."
        )
    if isinstance(optimizer, (str, dict)):
        optimizer = keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "compile_optimizer: `optimizer` must be a Keras optimizer (keras.optimizers.Optimizer) or an identifier "
            f"such as 'adamw'; got {type(optimizer).__module__}.{type(optimizer).__name__}."
        )
    updating = optimizer
    while isinstance(updating, keras.optimizers.LossScaleOptimizer):
        updating = updating.inner_optimizer
    compat.check_compilable_update(updating)
    from keras_fp8.backends import torch_step

    if moments.has_fp8_moments(updating):
        torch_step.compile_variable_updates(updating, options)
    else:
        torch_step.compile_optimizer(updating, options)
    return optimizer


def register():
    """At `import keras_fp8`: the torch backend's step patches
    (`keras_fp8.backends.torch_step.configure`)."""
    if keras.backend.backend() == "torch":
        from keras_fp8.backends import torch_step

        torch_step.configure()
