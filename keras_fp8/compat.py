"""Every place keras-fp8 touches Keras's internals, each with the reason.

Keras's public API has no hook for the thirteen things below that keras-fp8
needs, so this module patches them (at `import keras_fp8`, idempotently; 7 to
10, 12 and 13 on the torch backend only; 11 on the optimizers `keras_fp8.compile_optimizer`
is given, only; each is harmless to code that keeps to Keras's public API),
and it holds every
private Keras name the package uses, so that a Keras upgrade is checked here
and nowhere else. Written for the Keras versions in `TESTED_KERAS`; another
version gets a one-time warning naming what to check.

The patches:

1. `DTypePolicy.__new__`: Keras builds `DTypePolicy(name)` for every policy
   name outside its own quantization prefixes and has no registry of policy
   names; routing the FP8 names to `FP8DTypePolicy` here covers
   `set_global_policy`, `dtype_policies.get`, `Layer(dtype=...)` and
   deserialization in one place.
2. The global dtype-policy getter: layers built inside `keras_fp8.autocast`
   get the scope's policy (Keras has global policies only, no scopes).
3. `Trainer.compile`: Keras wraps the optimizer in a `LossScaleOptimizer` only
   for the policy named exactly `"mixed_float16"`; the FP8 float16 policies
   need keras-fp8's wrapper, whatever made the model FP8.
4. `Dense.build` / `EinsumDense.build` / `ReversibleEmbedding.build` and
   their `load_own_variables`: an FP8 policy must make Keras's own
   projection layers FP8 (model zoos build theirs from these classes; a
   language model's vocabulary projection is a `ReversibleEmbedding` called
   with `reverse=True`), and their plain form must read an FP8 checkpoint.
   Keras's quantization hook (`quantization_mode`, `quantized_build`,
   `quantized_call`) cannot carry it: a policy whose
   `quantization_mode` is set sends every layer under it (LayerNormalization,
   Embedding, ...) to `quantized_call`, the modes are a closed list
   (`QUANTIZATION_MODES`) checked throughout Keras, and Keras's setter of a
   quantized policy calls `quantize()` on built layers. The build hook makes
   the layer an instance of the FP8 class instead (`keras_fp8/layers/swap.py`),
   so the FP8 layers' own code runs (`keras_fp8/policy_layers.py`).
5. `Model.quantize` and the check every `layer.quantize` makes first
   (`Layer._check_quantize_args`): Keras's quantization cannot take FP8
   layers or layers under FP8 policies (it builds `"int8_from_<policy
   name>"`, which it cannot parse for an FP8 name, or skips FP8 layers with
   a warning), and it changes a layer before that fails: `model.quantize`
   quantizes layer by layer, so an error at the first FP8 layer would leave
   a half-quantized model, and a layer's `quantize` (an `Embedding`, or a
   `Dense` kept plain, under an FP8 policy) replaces the kernel with int8
   before Keras fails on the policy name. Both checks run before anything
   changes. The layer's check is Keras's own argument check, which Keras's
   per-instance `quantize` wrapper runs first for every layer class (it
   binds the class's `quantize` when the layer is created, so patching the
   classes' `quantize` would miss layers created before `import keras_fp8`
   and classes patched nowhere, such as `Embedding`).
6. The names weight files give layers held in lists (the layers of a
   Functional or Sequential model): Keras derives them from the class name
   (`layers/dense`, `layers/fp8_dense`), so the plain and the FP8 form of the
   same model would address the same layer differently and their
   `.weights.h5` files could not move between them. `saving_lib` sees
   `naming` through a view that names `FP8Dense` as `Dense` and
   `FP8EinsumDense` as `EinsumDense`.

Compiled training on torch (`jit_compile=True`, `keras_fp8.compile_blocks`):

7. `Layer._open_name_scope`: a built layer opens no name scope while
   torch.compile traces it. The scope only names the variables a layer
   creates (a built layer creates none), but tracing it makes dynamo guard
   every layer on its `_parent_path`, which holds the name of the block the
   layer sits in: each transformer block of a model then compiles anew (and
   dynamo stops compiling at its recompile limit, 8 by default).
8. The torch backend's `_can_use_flash_attention`: it builds a
   `torch.backends.cuda.SDPAParams`, a C++ object dynamo cannot trace (a
   graph break in every attention layer). While compiling, it answers False
   for a call that did not ask for flash attention explicitly: Keras then
   calls `scaled_dot_product_attention` without restricting its kernels, and
   torch picks the flash kernel itself where it applies.
9. The torch backend's `sparse_categorical_crossentropy` (every policy,
   eager or compiled): for logits of rank 3 or more with the classes last,
   Keras moves the class axis to position 1 for `cross_entropy`, whose
   log-softmax then runs over a strided axis of a permuted tensor (a slow
   "spatial" kernel, on a GPU a large share of a language model's step);
   the same loss on the logits flattened to `(rows, classes)` is the
   row-wise kernel, with the same values and gradients.
10. The torch trainer's compiled train function. Keras compiles a function
   that calls `train_step`, whose `loss.backward()` dynamo cannot trace: a
   graph break inside an inlined call, after which dynamo traces the
   function again, then `train_step` as a frame of its own, twice (once to
   find the break, once to compile up to it). Compiling `train_step` itself
   saves one of those three traces of the model's forward pass. Before each
   step every gradient is set to None, and before the first one the
   optimizer's weight-decay cache is filled: Keras's step calls
   `zero_grad()` inside the compiled function, where dynamo guards on
   whether each gradient is None (None at the first step, a tensor at the
   next: the whole step compiled twice), and the optimizer fills its cache
   of which variables take weight decay in its first `apply`, on which
   dynamo guards too (its part of the step compiled twice). The step
   computes the same: the gradients are cleared before the backward pass
   either way, and the cache holds what the first step would put there.
11. An optimizer's `_backend_apply_gradients` and `_get_current_learning_rate`,
   on the optimizer instances given to `keras_fp8.compile_optimizer` (torch).
   Keras's step after the gradients are filtered and unscaled (clipping,
   weight decay, the variable update, EMA) is that one method, and Keras has
   no hook to compile it: its torch Adam runs a chain of `torch._foreach_*`
   ops, each a pass over every weight, gradient and moment. The method runs
   through `torch.compile` instead, which fuses the chain. The learning rate
   is computed eagerly before, by Keras's own method, and
   `_get_current_learning_rate` returns that value while the compiled method
   runs: a schedule may branch on a tensor (`ops.cond`, e.g. `CosineDecay`
   with warmup), which dynamo cannot trace into one graph, and a Python
   number would be a constant of the compiled code (a recompilation at every
   change). Both methods are Keras's own where the update is traced by an
   enclosing compilation (`jit_compile=True`) or runs in a stateless scope.
12. keras_hub's `LlamaLayerNorm.call`, `LlamaTransformerDecoder.call` and
   the `ops` its decoder module calls (torch only; where keras_hub is
   installed). The norm before Q, K and V and the gated FFN's product before
   the down projection are plain keras.ops code inside keras_hub's layers,
   with no hook: to write their output and the FP8 layer's input in one pass
   (fused producers, docs/numerics.md) the norm's call and the decoder
   module's `ops.multiply` (its only use: the FFN's `up * act(gate)`) are
   routed through `keras_fp8.backends.torch_producers` (applied when an FP8
   layer builds on torch, once keras_hub is imported), which runs
   keras_hub's own code wherever no FP8 layer has linked itself, and the
   same bits where one has. The decoder's call only marks, per thread, which
   decoder's FFN the product belongs to. Gemma the same way: its
   `RMSNormalization.call` and `GemmaDecoderBlock.call`, and the
   `keras.activations.gelu` its decoder block module calls, whose result
   the block multiplies by the up projection at once
   (`gelu(gate) * up`, a Python `*` no module attribute reaches): the hook
   returns Keras's own GELU in a stand-in whose `*` is the product, applied
   only where the block's source has that exact line.
13. `keras.layers.LayerNormalization.call` (torch only): torch computes the
   norm in float32 (`F.layer_norm`, the statistics and the affine in one
   kernel) and Keras casts the output to the 16-bit compute dtype; that cast
   is the part that can write the next FP8 layer's input in the same pass
   (fused producers), through `keras_fp8.backends.torch_producers`, which
   runs Keras's own call wherever no FP8 layer has linked itself and Keras's
   own norm, then the fused cast, where one has.

Besides the patches, `calls_through` stands in for one layer instance's
`call` while a block runs (`keras_fp8.inspection.kept_inputs` sees each FP8
layer's input this way), and `current_scope_path` reads Keras's name-scope
stack (which layer calls are running); their docstrings give the reasons.
"""

import contextlib
import functools
import inspect
import re
import sys
import warnings

import keras
from keras.src.backend import numpy as _backend_numpy
from keras.src.backend.common import global_state as _global_state
from keras.src.backend.common.stateless_scope import in_stateless_scope as _in_stateless_scope
from keras.src.backend.common.variables import AutocastScope as _AutocastScope
from keras.src.distribution import distribution_lib as _distribution_lib
from keras.src.dtype_policies import dtype_policy as _dtype_policy_module
from keras.src.layers.layer import Layer as _KerasLayer
from keras.src.saving import saving_lib as _saving_lib
from keras.src.trainers import trainer as _trainer_module
from keras.src.utils import naming as _naming

# (major, minor) versions of Keras this module was written and tested for.
TESTED_KERAS = ((3, 15),)

_warned_version = []


def keras_version():
    """Keras's `(major, minor)` version."""
    major, minor = keras.__version__.split(".")[:2]
    digits = re.match(r"[0-9]*", minor).group()  # "16rc0" -> 16; ASCII digits only
    return int(major), int(digits or 0)


def check_keras_version():
    """Warns once when Keras is not a version this module was tested with.

    Returns:
        True when the version is a tested one.
    """
    if keras_version() in TESTED_KERAS:
        return True
    if not _warned_version:
        _warned_version.append(True)
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_KERAS)
        warnings.warn(
            f"keras_fp8 was tested with Keras {tested}; this is Keras {keras.__version__}. "
            "keras_fp8/compat.py lists the Keras internals it relies on: check them if FP8 layers, "
            "policies or loss scaling misbehave.",
            stacklevel=3,
        )
    return False


# --------------------------------------------------------------------------- patches
def route_policy_names(is_own_name, policy_class):
    """Patch 1: `DTypePolicy(name)` builds `policy_class` where `is_own_name(name)`.

    Python then runs `policy_class.__init__` with the same arguments.
    """
    base_classes = (_dtype_policy_module.DTypePolicy, _dtype_policy_module.FloatDTypePolicy)

    def dtype_policy_new(cls, *args, **kwargs):
        if cls in base_classes:
            name = args[0] if args else kwargs.get("name")
            if is_own_name(name):
                return object.__new__(policy_class)
        return object.__new__(cls)

    _dtype_policy_module.DTypePolicy.__new__ = staticmethod(dtype_policy_new)


_keras_global_policy = _dtype_policy_module.dtype_policy


def answer_global_policy_first(scoped_policy):
    """Patch 2: Keras's global-policy getter returns `scoped_policy()` when it
    is not None (the active autocast scope's policy), else the global one."""

    def dtype_policy():
        policy = scoped_policy()
        return policy if policy is not None else _keras_global_policy()

    _dtype_policy_module.dtype_policy = dtype_policy


_keras_compile = _trainer_module.Trainer.compile


def wrap_compile_optimizer(wrap):
    """Patch 3: `Model.compile(optimizer, ...)` first passes the optimizer
    through `wrap(model, optimizer, auto_scale_loss)`."""

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        optimizer = wrap(self, optimizer, kwargs.get("auto_scale_loss", True))
        return _keras_compile(self, optimizer, *args, **kwargs)

    compile.__doc__ = _keras_compile.__doc__
    _trainer_module.Trainer.compile = compile


_KERAS_DENSE_METHODS = {
    cls: (cls.build, cls.load_own_variables)
    # ReversibleEmbedding: the vocabulary projection of keras_hub's language
    # models is its reverse call, outside Dense/EinsumDense.
    for cls in (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.ReversibleEmbedding)
}


def hook_dense_layers(build_hook, load_hook):
    """Patch 4: on `Dense`, `EinsumDense` and `ReversibleEmbedding`,
    `build(input_shape)` becomes
    `build_hook(layer, input_shape, keras_build)` and
    `load_own_variables(store)` becomes `load_hook(layer, store, keras_load)`.

    Keras's `Layer.__new__` wraps the `build` an instance has when it is
    created, so layers created after the patch get it.
    """
    for cls, (keras_build, keras_load) in _KERAS_DENSE_METHODS.items():

        def make(keras_build=keras_build, keras_load=keras_load):
            # `functools.wraps` keeps `build`'s signature: Keras's build
            # wrapper binds its arguments to record the build config.
            @functools.wraps(keras_build)
            def build(self, input_shape=None):
                return build_hook(self, input_shape, keras_build)

            @functools.wraps(keras_load)
            def load_own_variables(self, store):
                return load_hook(self, store, keras_load)

            return build, load_own_variables

        cls.build, cls.load_own_variables = make()


_keras_model_quantize = keras.Model.quantize
_keras_check_quantize_args = keras.layers.Layer._check_quantize_args


def check_before_quantize(check):
    """Patch 5: `Model.quantize(mode, ...)` and every layer's `quantize(mode,
    ...)` first call `check(model_or_layer, mode)` (a layer's before Keras's
    own argument check), which may raise."""

    @functools.wraps(_keras_model_quantize)
    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        check(self, mode)
        return _keras_model_quantize(self, mode, config=config, filters=filters, **kwargs)

    @functools.wraps(_keras_check_quantize_args)
    def check_quantize_args(self, mode, compute_dtype):
        check(self, mode)
        return _keras_check_quantize_args(self, mode, compute_dtype)

    keras.Model.quantize = quantize
    keras.layers.Layer._check_quantize_args = check_quantize_args


class _CheckpointNaming:
    """`keras.src.utils.naming` as `saving_lib` sees it (patch 6): class
    names in `aliases` are named as their alias."""

    def __init__(self, aliases):
        self._aliases = dict(aliases)

    def __getattr__(self, name):
        return getattr(_naming, name)

    def to_snake_case(self, name):
        return _naming.to_snake_case(self._aliases.get(name, name))


def name_in_weight_files_as(aliases):
    """Patch 6: in weight files, an object of a class named `k` (a key of
    `aliases`) is addressed as one of class `aliases[k]` would be."""
    _saving_lib.naming = _CheckpointNaming(aliases)


# --------------------------------------------------------------------------- patches: torch.compile
_keras_open_name_scope = _KerasLayer._open_name_scope


def skip_name_scopes_while(is_tracing):
    """Patch 7: `Layer._open_name_scope()` of a built layer returns a scope
    that does nothing while `is_tracing()` is true."""

    def _open_name_scope(self):
        # Under a keras.distribution the scope also names the layer's output
        # (its layout is looked up by that path): kept there.
        if self.built and is_tracing() and _distribution_lib.distribution() is None:
            return contextlib.nullcontext()
        return _keras_open_name_scope(self)

    _KerasLayer._open_name_scope = _open_name_scope


def torch_flash_attention_check_while(is_tracing):
    """Patch 8: the torch backend's `_can_use_flash_attention(...,
    raise_error=False)` answers False while `is_tracing()` is true."""
    from keras.src.backend.torch import nn as torch_nn

    keras_check = _keras_torch_function(torch_nn, "_can_use_flash_attention")

    @functools.wraps(keras_check)
    def _can_use_flash_attention(query, key, value, mask=None, is_causal=False, raise_error=False):
        if not raise_error and is_tracing():
            return False
        return keras_check(query, key, value, mask, is_causal, raise_error)

    _can_use_flash_attention._keras_original = keras_check
    torch_nn._can_use_flash_attention = _can_use_flash_attention


def torch_crossentropy_on_rows():
    """Patch 9: the torch backend's `sparse_categorical_crossentropy` on
    logits of rank 3 or more, classes last, runs Keras's own function on the
    `(rows, classes)` view of the logits and reshapes the loss back."""
    from keras.src.backend.torch import nn as torch_nn

    keras_loss = _keras_torch_function(torch_nn, "sparse_categorical_crossentropy")

    @functools.wraps(keras_loss)
    def sparse_categorical_crossentropy(target, output, from_logits=False, axis=-1):
        target = torch_nn.convert_to_tensor(target)
        output = torch_nn.convert_to_tensor(output)
        rows = _crossentropy_rows(target, output, axis)
        if rows is None:
            return keras_loss(target, output, from_logits=from_logits, axis=axis)
        target_rows, output_rows, loss_shape = rows
        loss = keras_loss(target_rows, output_rows, from_logits=from_logits, axis=-1)
        return loss.reshape(loss_shape)

    sparse_categorical_crossentropy._keras_original = keras_loss
    torch_nn.sparse_categorical_crossentropy = sparse_categorical_crossentropy


class _DecoderOps:
    """keras.ops as keras_hub's decoder module sees it (patch 12): every
    function Keras's own but `multiply`, which goes through the hook."""

    def __init__(self, keras_ops, multiply):
        self._keras_ops = keras_ops
        self._multiply = multiply

    def __getattr__(self, name):
        return getattr(self._keras_ops, name)

    def multiply(self, x1, x2):
        return self._multiply(x1, x2, self._keras_ops.multiply)


def keras_hub_fused_producers(norm_call, decoder_call, ffn_multiply):
    """Patch 12: keras_hub's `LlamaLayerNorm.call(x)` becomes
    `norm_call(layer, x, keras_call)`, `LlamaTransformerDecoder.call` becomes
    `decoder_call(layer, args, kwargs, keras_call)`, and the decoder module's
    `ops.multiply(x1, x2)` becomes `ffn_multiply(x1, x2, keras_multiply)`.
    Nothing where keras_hub has not been imported (importing it here would
    cost every program its import time)."""
    if "keras_hub" not in sys.modules:
        return
    try:
        from keras_hub.src.models.llama import llama_decoder
        from keras_hub.src.models.llama import llama_layernorm
    except ImportError:
        return
    _wrap_call(llama_layernorm.LlamaLayerNorm, _norm_hook(norm_call))
    _wrap_call(llama_decoder.LlamaTransformerDecoder, decoder_call)
    if not isinstance(llama_decoder.ops, _DecoderOps):
        llama_decoder.ops = _DecoderOps(llama_decoder.ops, ffn_multiply)


class _Overlay:
    """A module as one keras_hub module sees it (patch 12): every attribute
    the module's own but those given."""

    def __init__(self, module, **overrides):
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._module, name)


# The line of `GemmaDecoderBlock.call` the GeGLU hook stands in for: the
# hook's `gelu` returns a stand-in whose `*` is the fused product, so it
# applies only where keras_hub multiplies `gelu(gate)` straight away.
_GEMMA_GEGLU_LINE = "keras.activations.gelu(x1, approximate=True) * x2"


def _wrap_call(cls, hook):
    """`cls.call(self, *args, **kwargs)` becomes `hook(self, args, kwargs,
    keras_call)` (once; `functools.wraps` keeps the signature Keras inspects,
    such as `training`)."""
    if hasattr(cls.call, "_keras_original"):
        return
    keras_call = cls.call

    @functools.wraps(keras_call)
    def call(self, *args, **kwargs):
        return hook(self, args, kwargs, keras_call)

    call._keras_original = keras_call
    cls.call = call


def _norm_hook(norm_call):
    """A `_wrap_call` hook for a norm whose call takes its input alone:
    `norm_call(layer, x, keras_call)`."""

    def hook(layer, args, kwargs, keras_call):
        (x,) = args  # keras_hub's norms: `call(self, x)`
        return norm_call(layer, x, keras_call, **kwargs)

    return hook


def keras_hub_gemma_fused_producers(norm_call, decoder_call, ffn_gelu):
    """Patch 12, Gemma: keras_hub's Gemma `RMSNormalization.call(x)` becomes
    `norm_call(layer, x, keras_call)`, `GemmaDecoderBlock.call` becomes
    `decoder_call(layer, args, kwargs, keras_call)`, and the decoder block
    module's `keras.activations.gelu(x, approximate)` becomes
    `ffn_gelu(x, approximate, keras_gelu)` (only where the block's call
    multiplies it by the up projection at once, `_GEMMA_GEGLU_LINE`).
    Nothing where keras_hub has not been imported."""
    if "keras_hub" not in sys.modules:
        return
    try:
        from keras_hub.src.models.gemma import gemma_decoder_block
        from keras_hub.src.models.gemma import rms_normalization
    except ImportError:
        return
    _wrap_call(rms_normalization.RMSNormalization, _norm_hook(norm_call))
    block_cls = gemma_decoder_block.GemmaDecoderBlock
    if isinstance(gemma_decoder_block.keras, _Overlay):
        return
    try:
        source = inspect.getsource(block_cls.call)
    except (OSError, TypeError):
        return
    if _GEMMA_GEGLU_LINE not in source:
        return
    _wrap_call(block_cls, decoder_call)
    keras_activations = gemma_decoder_block.keras.activations

    def gelu(x, approximate=False):
        return ffn_gelu(x, approximate, keras_activations.gelu)

    gemma_decoder_block.keras = _Overlay(gemma_decoder_block.keras,
                                         activations=_Overlay(keras_activations, gelu=gelu))


def layer_norm_fused_producer(norm_call):
    """Patch 13: `keras.layers.LayerNormalization.call` becomes
    `norm_call(layer, args, kwargs, keras_call)`."""
    _wrap_call(keras.layers.LayerNormalization, norm_call)


def _keras_torch_function(module, name):
    """`module.name` as Keras defines it (unwrapping an earlier patch)."""
    function = getattr(module, name)
    return getattr(function, "_keras_original", function)


def _crossentropy_rows(target, output, axis):
    """`(target rows, logits rows, loss shape)` for a sparse cross-entropy
    that can run on rows, else None (Keras's function then runs as it is,
    with its own errors for shapes that do not match)."""
    rank = len(output.shape)
    if rank < 3 or axis not in (-1, rank - 1):
        return None
    classes = output.shape[-1]
    loss_shape = tuple(output.shape[:-1])
    target_shape = tuple(target.shape)
    if target_shape == loss_shape + (1,):
        target_shape = loss_shape
    if target_shape != loss_shape or classes == 0:
        return None
    return target.reshape(-1), output.reshape(-1, classes), loss_shape


def torch_compiled_train_step():
    """Patch 10: the torch trainer's compiled `train_function(data)` runs
    `torch.compile(type(model).train_step)(model, data[0])`, after setting
    the gradient of every tensor that takes one to None (and, before the
    first step, filling the optimizer's weight-decay cache)."""
    import torch
    from keras.src.backend.torch import trainer as torch_trainer

    trainer_class = torch_trainer.TorchTrainer
    keras_make = getattr(trainer_class.make_train_function, "_keras_original",
                         trainer_class.make_train_function)

    @functools.wraps(keras_make)
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        keras_make(self, force=force)  # its checks, and `jit_compile` settled
        if not self.jit_compile:
            return self.train_function
        compiled_step = torch.compile(type(self).train_step)
        # The tensors that take gradients, listed at the first step (a
        # variable added later is still cleared by Keras's own `zero_grad`,
        # at the cost of a recompilation).
        trained = None

        def train_function(data):
            nonlocal trained
            if trained is None:
                _fill_weight_decay_cache(self.optimizer, self.trainable_variables)
                trained = [p for p in self.parameters() if p.requires_grad]
            for tensor in trained:
                tensor.grad = None
            return compiled_step(self, data[0])

        self.train_function = train_function
        return train_function

    make_train_function._keras_original = keras_make
    trainer_class.make_train_function = make_train_function


def _fill_weight_decay_cache(optimizer, variables):
    """Asks `optimizer` (and the one it wraps, for a loss-scale optimizer)
    whether each variable takes weight decay: Keras's optimizers cache the
    answers (`_use_weight_decay`)."""
    while optimizer is not None:
        if getattr(optimizer, "weight_decay", None) is not None and hasattr(optimizer, "_use_weight_decay"):
            for variable in variables:
                optimizer._use_weight_decay(variable)
        optimizer = getattr(optimizer, "inner_optimizer", None)


def compile_optimizer_update(optimizer, compile_fn, is_tracing):
    """Patch 11: `optimizer._backend_apply_gradients(grads, variables)` runs
    `compile_fn(keras_method)(optimizer, grads, variables)` (outside
    `is_tracing()` and stateless scopes), with the learning rate computed
    eagerly first. Calling it again replaces the previous compiled method."""
    keras_apply = type(optimizer)._backend_apply_gradients
    keras_learning_rate = type(optimizer)._get_current_learning_rate
    compiled = compile_fn(keras_apply)
    current = _CurrentLearningRate()

    def _get_current_learning_rate():
        if current.value is not None:
            return current.value
        return keras_learning_rate(optimizer)

    def _backend_apply_gradients(grads, trainable_variables):
        if is_tracing() or _in_stateless_scope():
            return keras_apply(optimizer, grads, trainable_variables)
        check_compilable_update(optimizer)
        _fill_weight_decay_cache(optimizer, trainable_variables)
        current.value = learning_rate_tensor(keras_learning_rate(optimizer))
        try:
            return compiled(optimizer, grads, trainable_variables)
        finally:
            current.value = None

    _backend_apply_gradients.compiled_update = True
    # The instance dict: Keras's attribute tracking does not see them.
    optimizer.__dict__["_get_current_learning_rate"] = _get_current_learning_rate
    optimizer.__dict__["_backend_apply_gradients"] = _backend_apply_gradients


def has_compiled_update(optimizer):
    """Whether patch 11 compiles `optimizer`'s update."""
    method = optimizer.__dict__.get("_backend_apply_gradients")
    return getattr(method, "compiled_update", False)


def check_compilable_update(optimizer):
    """Raises for the options under which Keras's update branches on a
    tensor at every step (`ops.cond`), which torch.compile cannot trace
    into one graph: gradient accumulation and EMA's overwrite frequency."""
    for option in ("gradient_accumulation_steps", "ema_overwrite_frequency"):
        value = getattr(optimizer, option, None)
        if value:
            raise ValueError(
                f"compile_optimizer: `{option}` is not supported ({type(optimizer).__name__} has {option}={value!r}): "
                "Keras's update then branches on a tensor at every step, which torch.compile cannot trace into "
                f"one graph. Expected {option}=None; or leave this optimizer eager."
            )


class _CurrentLearningRate:
    """The learning rate of the compiled update running now (None outside it)."""

    value = None


def learning_rate_tensor(value):
    """A learning rate as a compiled update receives it: a tensor (a Keras
    variable's value, a schedule's result), or a Python number as a float64
    scalar tensor, which Keras's ops round to the variables' dtype as they
    round the Python number. Never a Python number: torch.compile would make
    it a constant of the compiled code and compile again when it changes."""
    if isinstance(value, keras.Variable):
        return value.value
    if isinstance(value, (int, float)):
        return keras.ops.convert_to_tensor(value, dtype="float64")
    return keras.ops.convert_to_tensor(value)


# --------------------------------------------------------------------------- private names, wrapped
def raw_value(variable):
    """A variable's value in its own dtype: no mixed-precision autocast."""
    with _AutocastScope(None):
        return variable.value


def stored_value(variable):
    """The tensor a variable holds (`Variable._value`), read without
    `.value`'s scope checks (host time on the torch backend's per-call
    path); only outside a stateless scope, where that tensor is the value."""
    return variable._value


def in_stateless_scope():
    """Whether a Keras stateless scope (e.g. `stateless_call`) is active."""
    return _in_stateless_scope()


def traced():
    """Whether the code running is being traced into a compiled program
    rather than run: inside a Keras stateless scope (where Keras's JAX
    trainers and `stateless_call` run layers) or under `torch.compile`.
    Python-side effects there (a lock taken, say) happen once at tracing,
    not at each run of the program; under `torch.compile` some break the
    graph."""
    # torch.compile first: it answers True as a constant while tracing.
    return _torch_compiling() or _in_stateless_scope()


if keras.backend.backend() == "torch":
    from torch.compiler import is_compiling as _torch_compiling
else:

    def _torch_compiling():
        return False


def open_model_scopes():
    """The names of the models whose name scopes are open now: the
    subclassed models and `Sequential`s building their layers (a layer's
    path starts with them)."""
    stack = _global_state.get_global_attribute("name_scope_stack") or []
    return {entry.name for entry in stack if isinstance(entry.caller, keras.Model)}


def current_scope_path():
    """The names of the name scopes open now, outermost first, joined by `/`
    (`"model/block/up"`): `Layer.__call__` opens one named after each layer
    it runs, so inside a model's call this is the chain of layer calls that
    leads to the innermost layer running (the JAX backend's `jax.named_scope`
    stack holds the same names). `""` outside every scope."""
    stack = _global_state.get_global_attribute("name_scope_stack") or []
    return "/".join(entry.name for entry in stack)


@contextlib.contextmanager
def calls_through(layer, wrapper):
    """While the block runs, `layer(...)` runs `wrapper(call, *args, **kwargs)`
    where it would run `call(*args, **kwargs)` (`call` being the layer's
    own `call`). Keras's `Operation.__call__` reads `self.call` at each call,
    so an attribute of the instance stands in for the method; Keras offers
    no hook around a layer's call (a torch forward hook does not run: Keras's
    `__call__` replaces torch's). `keras_fp8.kept_inputs` sees each FP8
    layer's input this way."""
    own = layer.call

    def call(*args, **kwargs):
        return wrapper(own, *args, **kwargs)

    # Into the instance dict: Keras's attribute tracking is not needed.
    layer.__dict__["call"] = call
    try:
        yield
    finally:
        layer.__dict__.pop("call", None)


def autocast_scope(dtype):
    """The scope `Layer.__call__` enters to autocast variables to `dtype`."""
    return _AutocastScope(dtype)


def current_call_context():
    """The call context of the outermost `Layer.__call__` running, or None."""
    return _global_state.get_global_attribute("current_call_ctx")


def distribution():
    """The active `keras.distribution` distribution, or None."""
    return _distribution_lib.distribution()


class _ReplicatingDistribution:
    """The active distribution, but for the layout of new variables: replicated."""

    def __init__(self, distribution):
        self._distribution = distribution

    def __getattr__(self, name):
        return getattr(self._distribution, name)

    def get_variable_layout(self, variable):
        return keras.distribution.TensorLayout(
            (None,) * len(variable.shape), self._distribution.device_mesh
        )


@contextlib.contextmanager
def replicated_variables():
    """Variables created inside get a replicated layout under the active
    `keras.distribution` (nothing changes without one).

    Why: `Layer.add_weight` takes no layout, and the backend variable asks
    the distribution for one (`get_variable_layout`, a `LayoutMap` lookup by
    path) while it is created. A `ModelParallel` `LayoutMap` key such as
    `".*kernel.*"` also matches a layer's `kernel_scale` and
    `kernel_amax_history`, which must be replicated (one scale for the whole
    kernel): a 2-D kernel layout on a scalar fails inside JAX's sharding
    code. So for the variables created in this scope the distribution is
    swapped, on this thread, for one that answers "replicated".
    """
    distribution = _distribution_lib.distribution()
    if distribution is None:
        yield
        return
    _distribution_lib.set_distribution(_ReplicatingDistribution(distribution))
    try:
        yield
    finally:
        _distribution_lib.set_distribution(distribution)


def keras_mask(x):
    """The Keras mask a tensor carries, or None."""
    return getattr(x, "_keras_mask", None)


def sublayers(layer, include_self=True):
    """Every layer nested in `layer` (attributes, lists, models), once each."""
    return list(layer._flatten_layers(include_self=include_self, recursive=True))


@contextlib.contextmanager
def unlocked_tracker(layer):
    """Lets `layer` add weights after its `build` has locked its tracker."""
    layer._tracker.unlock()
    try:
        yield
    finally:
        layer._tracker.lock()


def remove_variable(layer, name):
    """Untracks the variable `layer.<name>` and deletes the attribute.

    Keras's `Layer.__delattr__` does the same plus a `gc.collect()` per
    variable, which costs a fraction of a second each in a large process.
    """
    variable = getattr(layer, name)
    layer._untrack_variable(variable)
    object.__delattr__(layer, name)


def layer_name_scope(layer):
    """The name scope `build` runs in: new variables get the paths `build`
    would have given them."""
    return layer._open_name_scope()


def retrack_torch_parameters(layer):
    """torch backend: refreshes the `torch.nn.Parameter` snapshot a layer
    took of its variables (its own and its sublayers') after build."""
    if hasattr(layer, "_torch_params"):
        layer._track_variables()


def refresh_call_signature(layer):
    """Re-reads what `Layer.__init__` cached of the layer's `call`
    signature, after its class changed (`keras_fp8/layers/swap.py`): a
    class whose `call` takes `training` where the old one did not then gets
    it passed by its parents (a Functional model's `call`), which a
    `stateless_call` runs outside any call context."""
    signature = inspect.signature(layer.call)
    names = [p.name for p in signature.parameters.values()]
    layer._call_signature = signature
    layer.call_signature_parameters = names
    layer._call_has_training_arg = "training" in names
    layer._call_has_mask_arg = "mask" in names
    layer._call_has_context_arg = {arg: arg in names for arg in layer._call_context_args}


def build_input_shape(layer):
    """The input shape `layer` was built with, or None."""
    shapes = getattr(layer, "_build_shapes_dict", None) or {}
    shape = shapes.get("input_shape")
    if shape is None and shapes:
        shape = next(iter(shapes.values()))
    return shape


def set_policy_object(layer, policy):
    """Makes `policy` the layer's dtype policy object. Keras's
    `dtype_policy` setter cannot replace a `DTypePolicyMap`: it writes the
    new policy into the map, under the layer's path."""
    layer._dtype_policy = policy


def check_load_own_variables(layer, store):
    """Keras's check that a store holds as many variables as `layer` has."""
    layer._check_load_own_variables(store)


def pad_with_zeros(x, pad_width):
    """`keras.ops.pad(x, pad_width)` (constant zeros) on a backend tensor,
    without the Keras `Pad` operation `ops.pad` creates at every call,
    eager ones included: a new object named from a global counter, on which
    torch.compile guards, so the function calling it would compile again at
    every call. The backend's own `pad` is what that operation runs."""
    if isinstance(x, keras.KerasTensor):
        return keras.ops.pad(x, pad_width)
    return _backend_numpy.pad(x, pad_width)


def optimization_barrier(x):
    """`x` where no compiler may fold the conversion that made it with the
    one that reads it.

    `keras.ops` has no optimization barrier. On a GPU XLA folds a chain of
    floating-point conversions into one (`SimplifyFPConversions`, with
    `xla_allow_excess_precision` on by default): `float32 -> float8 ->
    float32` inside one compiled function would skip the FP8 rounding. JAX's
    barrier keeps the two apart; torch (eager, or inductor, which keeps
    each conversion) needs none, so `x` is returned as it is there.
    """
    if keras.backend.backend() == "jax":
        import jax  # the running backend's package: already imported by Keras

        return jax.lax.optimization_barrier(x)
    return x
