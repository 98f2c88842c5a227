"""FP8 matmuls for the torch backend: `torch_ops`, on every device.

An FP8 layer's matmul is `torch_ops.fp8_linear_folded` on the layer's own
variables (their tensors are the op's state, updated in place: no copies, no
host sync). On the GPUs the compiled kernels serve, an eager call is one C++
call; under torch.compile (`jit_compile=True`) and on every other device the
`torch.library` ops run, over the kernels or over torch_ops's exact reference
(which is tested bit for bit against `keras_fp8.numerics`). Eager and
compiled training therefore run the same ops on the same state.
"""

import torch
import torch_ops
from keras import activations
from torch_ops import extension as torch_ops_extension

from keras_fp8 import compat


def _kernels_for(x):
    """torch_ops's extension where its kernels serve `x`'s device, else None
    (a one-time warning on a CUDA GPU they cannot serve)."""
    return torch_ops_extension.kernels_for(x)


def prepare_device(tensor):
    """Settles (and caches) whether the compiled kernels serve `tensor`'s
    device: the capability check, the build and the one-time warning run
    here, when a layer builds, not inside a call torch.compile traces."""
    _kernels_for(tensor)


def mark_amax_channel(variable):
    """See `keras_fp8.backends`: marks the variable's torch Parameter for
    `torch_ops.distributed.prepare_ddp` (where it exists yet)."""
    value = compat.raw_value(variable)
    if isinstance(value, torch.Tensor):
        torch_ops.distributed.mark_amax_channel(value)


def default_min_gemm_size(x):
    """See `keras_fp8.backends`: torch_ops's setting for `x`'s device."""
    return torch_ops.get_settings().resolved_min_gemm_size(_kernels_for(x) is not None)


def _variable_reader():
    """How to read the layer's variables in this call, in their own dtype.

    Outside a stateless scope a Keras torch variable's value is its `_value`
    tensor, cast by `.value` only when it autocasts; reading it directly skips
    `.value`'s checks (host time). Inside one (e.g. `stateless_call`), the
    scope holds the values.
    """
    return compat.raw_value if compat.in_stateless_scope() else compat.stored_value


def _linear_folded(layer, x, kernel, bias, recipe, training, value):
    return torch_ops.fp8_linear_folded(
        x,
        kernel,
        None if bias is None else value(bias),
        state=(
            value(layer.input_scale),
            value(layer.input_amax_history),
            value(layer.kernel_scale),
            value(layer.kernel_amax_history),
            value(layer.grad_scale),
            value(layer.grad_amax_history),
        ),
        pending=value(layer.grad_amax_pending),
        fold_state=value(layer.grad_fold_state),
        fp8_format=recipe.fp8_format,
        scaling=recipe.name,
        margin=float(recipe.margin),
        amax_compute_algo=getattr(recipe, "amax_compute_algo", "max"),
        window=getattr(recipe, "history_len", None),
        weight_layout="in_out",
        training=bool(training),
        min_gemm_size=0,  # the layer ran its own min_gemm_size check
        power_of_two=bool(getattr(recipe, "power_of_two", False)),
    )


def fp8_matmul(layer, x, kernel, bias, recipe, training):
    """See `keras_fp8.backends`: `torch_ops.fp8_linear_folded`, whose bias is
    added in x's dtype (fused into the GEMM)."""
    return _linear_folded(layer, x, kernel, bias, recipe, training, _variable_reader())


# `Dense(activation=None)` stores this identity function.
_IDENTITY = activations.linear


def fast_layer_call(layer, args, kwargs):
    """An FP8 layer's `__call__` without Keras's generic machinery, or None.

    Keras's `Layer.__call__` costs about 0.4 ms of host time per call (argument
    binding, masks, scopes), more than the whole FP8 linear on a GPU. For the
    one case that dominates eager training, a plain tensor already in the
    compute dtype and no mask, where FP8 runs on the compiled kernels or the
    call runs the compute dtype (below `min_gemm_size`), this does what
    `__call__` would do and nothing else: resolve `training` from the
    argument or the outer call (and pass it on to later layers, as Keras
    does), enter the layer's autocast scope, and run `layer.call`. Every
    other case returns None and goes through `Layer.__call__`.

    A layer whose `call` is exactly the FP8 linear (`_fp8_call_is_linear`)
    goes one step further: the linear on the variables' own tensors (`x` of
    any rank, bias fused; below `min_gemm_size` the compute-dtype matmul
    `Dense.call` runs), then the activation inside the autocast scope.
    """
    if len(args) != 1 or (kwargs and (len(kwargs) != 1 or "training" not in kwargs)):
        return None
    x = args[0]
    if type(x) is not torch.Tensor or not x.is_floating_point() or compat.keras_mask(x) is not None:
        return None
    if (
        not layer.built
        or not layer.autocast
        or layer.activity_regularizer is not None
        or layer._forward_hooks
        or layer._forward_pre_hooks
        or torch.compiler.is_compiling()
        or x.dtype != getattr(torch, layer.input_dtype)
        or not layer._fast_call_accepts(x)
        or compat.distribution() is not None
    ):
        return None
    recipe = layer._fp8_call_recipe(x)
    if recipe is not None and _kernels_for(x) is None:
        return None
    context = compat.current_call_context()
    if "training" in kwargs:
        training = kwargs["training"]
    else:
        training = None if context is None else context.get_value("training")
    if context is not None:
        context.set_value("training", training)
    # Below min_gemm_size a float16 x on a CPU goes to `layer.call`: Keras's
    # matmul computes float16 in float32 there.
    cpu_float16 = recipe is None and x.dtype == torch.float16 and x.device.type == "cpu"
    if layer._fp8_call_is_linear() and not compat.in_stateless_scope() and not cpu_float16:
        if recipe is None:
            y = _compute_dtype_linear(layer, x)
        else:
            y = _linear_folded(layer, x, compat.stored_value(layer._kernel), layer.bias, recipe, training,
                               compat.stored_value)
        activation = layer.activation
        if activation is None or activation is _IDENTITY:
            return y
        with compat.autocast_scope(_autocast_dtype(layer)):
            return activation(y)
    with compat.autocast_scope(_autocast_dtype(layer)):
        return layer.call(x, training=training)


def _compute_dtype_linear(layer, x):
    """`Dense.call` in the compute dtype, as `Layer.__call__` runs it: the
    kernel and bias autocast to the compute dtype (x's), `ops.matmul`, then
    `ops.add` of the bias (tests/keras/test_torch_backend.py checks it bit for
    bit against the generic call)."""
    y = torch.matmul(x, compat.stored_value(layer._kernel).to(x.dtype))
    if layer.bias is not None:
        y = y + compat.stored_value(layer.bias).to(x.dtype)
    return y


def _autocast_dtype(layer):
    """The dtype of the autocast scope `Layer.__call__` enters (or None)."""
    compute_dtype = layer.compute_dtype
    return compute_dtype if compute_dtype != layer.variable_dtype else None
