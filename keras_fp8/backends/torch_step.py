"""The torch training step around the layers: compiled blocks, Keras's step
under torch.compile, float32 matmul precision.

`configure()` (at `import keras_fp8` on the torch backend) applies the
patches of `keras_fp8.compat` that let torch.compile trace Keras's step
(patches 7, 8 and 10: name scopes, the flash-attention check, the compiled
train step) and the row-wise sparse cross-entropy (patch
9). `compile_blocks` compiles a model's repeated blocks one by one
(`keras_fp8.compile_blocks`); `compile_optimizer` an optimizer's per-step
update (`keras_fp8.compile_optimizer`, compat patch 11).
"""

import functools
import inspect
import types

import torch

from keras_fp8 import compat


def configure():
    """Applies the torch-only patches of `keras_fp8.compat`."""
    is_tracing = torch.compiler.is_compiling
    compat.skip_name_scopes_while(is_tracing)
    compat.torch_flash_attention_check_while(is_tracing)
    compat.torch_crossentropy_on_rows()
    compat.torch_compiled_train_step()


def float32_matmuls_use_tensor_cores():
    """Whether torch runs float32 matmuls on tensor cores (TF32 or bf16
    passes): only where the user lowered `torch.set_float32_matmul_precision`
    from its default, "highest"."""
    return torch.get_float32_matmul_precision() != "highest"


def compile_blocks(blocks, options):
    """See `keras_fp8.compile_blocks`: each layer of `blocks` gets an
    instance `call` that runs its class's `call` through one
    `torch.compile(..., **options)` per class.

    All blocks of a class share that compiled function, and dynamo keeps its
    code per code object (the class's `call`): the blocks of a model reuse
    one compilation, as long as nothing the trace reads differs between them
    (`compat.skip_name_scopes_while` keeps Keras's name scopes out of it).
    Calls inside a Keras stateless scope (Keras's shape inference on meta
    tensors, `stateless_call`) run the class's `call` uncompiled.
    """
    compiled = {}
    for layer in blocks:
        keras_call = type(layer).call
        if keras_call not in compiled:
            compiled[keras_call] = torch.compile(keras_call, **options)
        # The instance dict: neither Keras's attribute tracking nor
        # torch.nn.Module's sees a function.
        layer.__dict__["call"] = _compiled_call(layer, keras_call, compiled[keras_call])


def _compiled_call(layer, keras_call, compiled):
    def call(*args, **kwargs):
        if compat.in_stateless_scope():
            return keras_call(layer, *args, **kwargs)
        return compiled(layer, *args, **kwargs)

    # `inspect.signature(layer.call)` stays the layer's own.
    call.__wrapped__ = keras_call.__get__(layer)
    call.__doc__ = keras_call.__doc__
    call.compiled_block = True
    return call


def is_compiled_block(layer):
    """Whether `compile_blocks` compiled `layer`'s `call`."""
    return getattr(layer.__dict__.get("call"), "compiled_block", False)


def compile_optimizer(optimizer, options):
    """See `keras_fp8.compile_optimizer`: `optimizer`'s per-step update
    (Keras's `_backend_apply_gradients`) runs through
    `torch.compile(..., **options)`; inside a compiled train step
    (`jit_compile=True`) it is traced with the step instead."""
    check_compile_options(options)
    compat.compile_optimizer_update(optimizer, functools.partial(_compile_copy, options=options),
                                    torch.compiler.is_compiling)


def compile_variable_updates(optimizer, options):
    """`optimizer._update_variable(variable, gradient, learning_rate,
    *state)` (FP8 moments: one variable's step) runs compiled, one
    compilation per variable shape and dtypes, shared by every variable of
    that shape. One graph of every variable's block quantization would
    take minutes to trace; these are a few small graphs."""
    check_compile_options(options)
    method = type(optimizer)._update_variable
    compiled = {}

    def _update_variable(variable, gradient, learning_rate, *state):
        if torch.compiler.is_compiling() or compat.in_stateless_scope():
            return method(optimizer, variable, gradient, learning_rate, *state)
        key = (tuple(variable.shape), str(variable.dtype), tuple(gradient.shape), str(gradient.dtype))
        if key not in compiled:
            compiled[key] = _compile_copy(method, options)
        return compiled[key](optimizer, variable, gradient, compat.learning_rate_tensor(learning_rate), *state)

    _update_variable.compiled_update = True
    optimizer.__dict__["_update_variable"] = _update_variable


def _compile_copy(function, options):
    """`torch.compile(function, **options)` on a copy of `function` with a
    code object of its own. Dynamo keeps compiled code per code object,
    with a recompile limit per code object: the optimizers of one process
    (a sweep, a test suite), or one optimizer's variable shapes, would
    otherwise share that limit and fall back to eager past it."""
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    return torch.compile(copy, **options)


def check_compile_options(options):
    """Raises TypeError for a keyword argument `torch.compile` does not take."""
    accepted = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = [name for name in options if name not in accepted]
    if unknown:
        raise TypeError(
            f"compile_optimizer: {unknown[0]!r} is not an argument of torch.compile; expected keyword arguments "
            f"among {accepted}, got {sorted(options)}."
        )
