"""FP8 matmul for the torch backend.

On a CUDA GPU with FP8 tensor cores (sm_89+) and the compiled `torch_ops`
kernels available, the quantize and GEMM steps run there; elsewhere the exact
emulation of `emulation.py` runs (with a one-time warning on a CUDA GPU that
lacks FP8 or the compiled kernels). `torch_ops` is imported lazily, here only.
"""

import os
import warnings
import weakref

import keras
import torch
from keras import activations
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.common.variables import AutocastScope
from keras.src.distribution import distribution_lib

from keras_fp8 import recipes
from keras_fp8.backends import emulation
from keras_fp8.layers.fp8_dense import FP8Dense


def _torch_ops_if_usable(device_index):
    """Returns the `torch_ops` module if it can run on this CUDA device
    (warns once per device otherwise: `_kernels_for` caches the answer)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    reason = None
    if (major, minor) < (8, 9):
        reason = f"compute capability {major}.{minor} has no FP8 tensor cores"
    else:
        try:
            import torch_ops
        except ImportError as e:
            reason = f"torch_ops could not be imported ({e})"
        else:
            if torch_ops.is_available():
                return torch_ops
            reason = torch_ops.unavailable_reason()
    warnings.warn(
        "keras_fp8: running the exact FP8 emulation on "
        f"{torch.cuda.get_device_name(device_index)}: {reason}.",
        stacklevel=3,
    )
    return None


# device index -> torch_ops or None. A plain dict (not functools.lru_cache)
# is what torch.compile can trace without a graph break.
_USABLE_BY_DEVICE = {}


def _kernels_for(tensor):
    if tensor.device.type != "cuda":
        return None
    index = tensor.device.index or 0
    if index not in _USABLE_BY_DEVICE:
        _USABLE_BY_DEVICE[index] = _torch_ops_if_usable(index)
    return _USABLE_BY_DEVICE[index]


def prepare_device(tensor):
    """Decides (and caches) whether the compiled kernels serve `tensor`'s
    device: the import, the capability check and the one-time warning run
    here, when a layer builds, and not inside a call torch.compile traces."""
    _kernels_for(tensor)


def _cuda_scaled_matmul(torch_ops):
    def matmul(a_q, b_q, scale, out_dtype):
        # cuBLASLt wants both operands K-contiguous: b as (N, K).
        one = torch.ones((), dtype=torch.float32, device=a_q.device)
        out = torch_ops.fp8_gemm(
            a_q.contiguous(), b_q.t().contiguous(), scale, one,
            out_dtype=_torch_dtype(out_dtype),
        )
        return out

    return matmul


def _torch_dtype(dtype):
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, str(dtype))


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, kernel, pending, x_scale, kernel_scale, grad_scale,
        grad_history, emit_token, recipe, matmul,
    ):
        y, x_q, kernel_q = emulation.forward(
            x, kernel, x_scale, kernel_scale, recipe, matmul=matmul
        )
        ctx.save_for_backward(
            x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history,
            emit_token,
        )
        ctx.recipe = recipe
        ctx.matmul = matmul
        ctx.dtypes = (x.dtype, kernel.dtype)
        return y

    @staticmethod
    def backward(ctx, grad):
        (x_q, kernel_q, x_scale, kernel_scale, grad_scale, grad_history,
         emit_token) = ctx.saved_tensors
        dx, dkernel, dpending = emulation.backward(
            grad.contiguous(), x_q, kernel_q, x_scale, kernel_scale,
            grad_scale, grad_history, emit_token, ctx.recipe, *ctx.dtypes,
            matmul=ctx.matmul,
        )
        return (dx, dkernel, dpending) + (None,) * 7


def _read_value(variable):
    return variable._value


def _variable_reader():
    """How to read the layer's variables in this call, in their own dtype.

    Outside a stateless scope a Keras torch variable's value is its
    `_value` tensor, cast by `.value` only when it autocasts; reading it
    directly skips `.value`'s checks (host time). Inside one (e.g.
    `stateless_call`), the scope holds the values.
    """
    if in_stateless_scope():
        def read(variable):
            with AutocastScope(None):
                return variable.value

        return read
    return _read_value


def fused_fp8_matmul(layer, x, kernel, bias, recipe, training, min_gemm_size):
    """`x @ kernel (+ bias)` through `torch_ops.linear.fp8_linear_folded`, or None.

    Runs when the compiled kernels can serve `x`'s device. The layer's Keras
    variables are the kernels' state buffers: the fused quantize kernels
    update the input and kernel histories and scales in place (no copies, no
    host sync); a training call first folds the last backward's pending
    gradient amax into the gradient history and scale (one launch, the same
    float32 operations as `FP8StateMixin._fold_pending_grad_amax`), and the
    output gradient's amax and the fold token return through the gradient of
    `grad_amax_pending`, exactly as on the emulated path. In eager mode on
    plain CUDA tensors all of it is one C++ call.

    Args:
        layer: The FP8 layer (its state variables are used).
        x: `(M, K)` tensor in the compute dtype.
        kernel: `(K, N)` float32 kernel (the variable's own tensor).
        bias: Optional `(N,)` bias variable, added in the compute dtype
            (fused in the GEMM).
        recipe: The call's recipe.
        training: Whether amaxes are recorded.
        min_gemm_size: `M*N*K` below which the GEMMs run in the compute dtype
            (None: `torch_ops.DEFAULT_MIN_GEMM_SIZE`).

    Returns:
        The `(M, N)` output, or None when the kernels cannot run here.
    """
    torch_ops = _kernels_for(x)
    if torch_ops is None or isinstance(recipe, recipes.CurrentScaling):
        # torch_ops does not publish current-scaling scales; the generic path
        # (torch_ops GEMMs, keras.ops state) keeps the Keras semantics.
        return None
    return _linear_folded(
        torch_ops, layer, x, kernel, bias, recipe, training, min_gemm_size,
        _variable_reader(),
    )


def _linear_folded(
    torch_ops, layer, x, kernel, bias, recipe, training, min_gemm_size, value
):
    """`fused_fp8_matmul` once the kernels are chosen (`x` of any rank)."""
    prequantized = _PREQUANTIZED.pop(layer, None)
    y = torch_ops.linear.fp8_linear_folded(
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
        margin=float(recipe.margin),
        amax_compute_algo=recipe.amax_compute_algo,
        window=recipe.history_len,
        weight_layout="in_out",
        training=bool(training),
        min_gemm_size=min_gemm_size,
        prequantized_weight=prequantized,
    )
    if prequantized is not None and training and not prequantized.used:
        # Its kernel reaches the matmul as another tensor (or the GEMMs run
        # in the compute dtype): quantizing it ahead only costs.
        _NOT_PREQUANTIZED.add(layer)
    return y


# Quantizing the kernels ahead. After a training step's optimizer update the
# host still has the step's end and the next step's start to run (logs,
# callbacks, the next batch: several milliseconds in which the GPU waits).
# The FP8 layers' kernel quantizes for the next forward run then, on a side
# stream, and the forward records their amaxes instead (torch_ops.linear.
# prequantize_weight: the same state, one kernel fewer on the step's path).
# KERAS_FP8_PREQUANTIZE=0 turns it off.
PREQUANTIZE = os.environ.get("KERAS_FP8_PREQUANTIZE", "1") not in ("0", "")
_PREQUANTIZED = weakref.WeakKeyDictionary()  # layer -> PrequantizedWeight
_NOT_PREQUANTIZED = weakref.WeakSet()


def _fp8_layers(model):
    """`model`'s FP8 layers with a kernel (`model` itself included). The
    model's layers are listed once per model (weakly: the list must not keep
    the model alive); which of them are FP8 layers is checked on every call,
    so that layers converted in place later (`keras_fp8.convert`) count."""
    from keras_fp8.layers.fp8_state import FP8StateMixin

    refs = _MODEL_LAYERS.get(model)
    if refs is None:
        refs = [
            weakref.ref(layer)
            for layer in model._flatten_layers(include_self=False, recursive=True)
        ]
        _MODEL_LAYERS[model] = refs
    layers = [model] + [ref() for ref in refs]
    return [
        layer for layer in layers
        if isinstance(layer, FP8StateMixin) and hasattr(layer, "_kernel")
    ]


_MODEL_LAYERS = weakref.WeakKeyDictionary()  # model -> its layers, flattened


def prequantize_kernels(model):
    """Quantizes the kernels of `model`'s FP8 layers for their next training
    call (delayed scaling, compiled kernels, eager mode), on a side stream,
    in one launch sequence per recipe.

    Args:
        model: A Keras model (or layer) whose FP8 layers to visit.

    Returns:
        How many kernels were quantized ahead.

    Raises:
        TypeError: `model` is not a Keras layer or model.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"model: expected a Keras model or layer, got {type(model).__name__}")
    if not PREQUANTIZE or torch.compiler.is_compiling() or in_stateless_scope():
        return 0
    groups = {}
    for layer in _fp8_layers(model):
        if not layer.built or layer in _NOT_PREQUANTIZED:
            continue
        recipe = layer._fp8_recipe()
        if not isinstance(recipe, recipes.DelayedScaling):
            continue
        kernel = layer._kernel._value
        if _kernels_for(kernel) is None:
            continue
        key = (kernel.device, float(recipe.margin), recipe.amax_compute_algo)
        groups.setdefault(key, []).append((
            layer,
            (kernel, _read_value(layer.kernel_scale),
             _read_value(layer.kernel_amax_history)),
        ))
    count = 0
    for (_, margin, algo), entries in groups.items():
        torch_ops = _kernels_for(entries[0][1][0])
        prequantized = torch_ops.linear.prequantize_weights(
            [item for _, item in entries], margin=margin, amax_compute_algo=algo
        )
        for (layer, _), pre in zip(entries, prequantized):
            if pre is None:
                _NOT_PREQUANTIZED.add(layer)
            else:
                _PREQUANTIZED[layer] = pre
                count += 1
    return count


_keras_train_step = None


def install():
    """Makes the torch trainer's `train_step` quantize the FP8 kernels ahead
    after its optimizer update (`prequantize_kernels`). Idempotent."""
    global _keras_train_step
    if _keras_train_step is not None:
        return
    from keras.src.backend.torch import trainer as torch_trainer

    _keras_train_step = torch_trainer.TorchTrainer.train_step

    def train_step(self, data):
        logs = _keras_train_step(self, data)
        prequantize_kernels(self)
        return logs

    train_step.__doc__ = _keras_train_step.__doc__
    torch_trainer.TorchTrainer.train_step = train_step


# `Dense(activation=None)` stores this identity function.
_IDENTITY = activations.linear


def fast_layer_call(layer, args, kwargs):
    """An FP8 layer's `__call__` without Keras's generic machinery, or None.

    Keras's `Layer.__call__` costs about 0.4 ms of host time per call on the
    H200 machine (argument binding, masks, scopes), more than the whole FP8
    linear. For the one case that dominates training, an eager call with a
    plain CUDA tensor already in the compute dtype, no mask, and the compiled
    kernels serving a delayed-scaling recipe, this does what `__call__` would
    do and nothing else: resolve `training` from the argument or the outer
    call (and pass it on to later layers, as Keras does), enter the layer's
    autocast scope, and run `layer.call`. Every other case returns None and
    goes through `Layer.__call__`.

    An `FP8Dense` (whose `call` is not overridden, without LoRA, outside a
    stateless scope) goes one step further: its `call` is the FP8 linear on
    the variables' own tensors (`x` of any rank, bias fused), then the
    activation inside the autocast scope; `FP8Dense.call` computes the same.
    """
    if len(args) != 1 or (kwargs and (len(kwargs) != 1 or "training" not in kwargs)):
        return None
    x = args[0]
    if type(x) is not torch.Tensor or getattr(x, "_keras_mask", None) is not None:
        return None
    if (
        not layer.built
        or layer.activity_regularizer is not None
        or layer._forward_hooks
        or layer._forward_pre_hooks
        or torch.compiler.is_compiling()
        or x.dtype != _torch_dtype(layer.input_dtype)
        or not layer._fast_call_accepts(x)
        or distribution_lib.distribution() is not None
    ):
        return None
    recipe = layer._fp8_recipe()
    if recipe is None or isinstance(recipe, recipes.CurrentScaling):
        return None
    torch_ops = _kernels_for(x)
    if torch_ops is None:
        return None
    context = global_state.get_global_attribute("current_call_ctx")
    if "training" in kwargs:
        training = kwargs["training"]
    else:
        training = None if context is None else context.get_value("training")
    if context is not None:
        context.set_value("training", training)
    if (
        type(layer).call is FP8Dense.call
        and not layer.lora_enabled
        and not in_stateless_scope()
    ):
        y = _linear_folded(
            torch_ops, layer, x, layer._kernel._value, layer.bias, recipe,
            training, layer._min_gemm_size(), _read_value,
        )
        activation = layer.activation
        if activation is None or activation is _IDENTITY:
            return y
        with AutocastScope(_autocast_dtype(layer)):
            return activation(y)
    with AutocastScope(_autocast_dtype(layer)):
        return layer.call(x, training=training)


def _autocast_dtype(layer):
    """The dtype of the autocast scope `Layer.__call__` enters (or None)."""
    compute_dtype = layer.compute_dtype
    return compute_dtype if compute_dtype != layer.variable_dtype else None


def fp8_matmul(
    x, kernel, grad_amax_pending, x_scale, kernel_scale, grad_scale,
    grad_history, emit_token, *, recipe,
):
    """See `keras_fp8.backends`."""
    kernels = _kernels_for(x)
    matmul = (
        emulation.scaled_matmul if kernels is None
        else _cuda_scaled_matmul(kernels)
    )
    return _FP8Matmul.apply(
        x, kernel, grad_amax_pending, x_scale, kernel_scale, grad_scale,
        grad_history, emit_token, recipe, matmul,
    )
