"""Converts the Dense/EinsumDense layers of a built model to FP8, in place.

```python
model = keras.models.load_model("bf16_model.keras")  # any built model
converted = keras_fp8.convert(model, exclude="head", policy="fp8_hybrid")
model.compile(optimizer="adam", loss=...)   # (re)compile after converting
model.fit(...)
```

Each converted layer keeps its identity (the same Python object, the same
kernel and bias variables, name and path): its class becomes `FP8Dense` /
`FP8EinsumDense` and it gains the FP8 state variables. Under a non-FP8 policy
(or inside `keras_fp8.autocast(enabled=False)`) it computes exactly what it
computed before.

When FP8 is on after converting: a layer's dtype policy is fixed at
construction, so `set_global_policy("fp8_hybrid")` after building the model
does not reach its layers. FP8 runs where the converted layer's own policy is
an FP8 policy (pass `policy="fp8_hybrid"` to `convert`, which also makes the
converted layers compute in bfloat16), or inside `keras_fp8.autocast(...)`.

Saving: Sequential and Functional models whose converted layers are their
own layers serialize the FP8 classes, so `model.save` /
`keras.models.load_model` rebuild FP8 layers with their state. Layers created
by their parent's code (subclassed models, custom layers,
`MultiHeadAttention`'s projections) come back as `Dense`/`EinsumDense` when
the parent is rebuilt from its config: rebuild the model, `convert` it the
same way, then `model.load_weights(path)` (`path` may be the `.keras` archive
itself, or a `.weights.h5` file).
"""

import re
import warnings

import keras

from keras_fp8 import compat
from keras_fp8 import recipes
from keras_fp8.layers.fp8_dense import FP8Dense
from keras_fp8.layers.fp8_einsum_dense import FP8EinsumDense
from keras_fp8.layers.fp8_einsum_dense import MatmulPlan

# Exact source class -> FP8 class. Subclasses of Dense/EinsumDense are not
# converted: swapping their class would drop their own overrides.
_CONVERSIONS = (
    (keras.layers.Dense, FP8Dense),
    (keras.layers.EinsumDense, FP8EinsumDense),
)
_FP8_CLASSES = (FP8Dense, FP8EinsumDense)


def convert(
    model,
    *,
    include=None,
    exclude=None,
    recipe=None,
    min_gemm_size=None,
    policy=None,
):
    """Turns the `Dense`/`EinsumDense` layers of a built model into FP8 layers.

    Walks `model` and every layer nested in it (Sequential, Functional and
    subclassed models, custom layers, layers held as attributes, e.g. the
    projections of `keras.layers.MultiHeadAttention`) and converts, in place,
    each layer whose class is exactly `keras.layers.Dense` (to `FP8Dense`)
    or `keras.layers.EinsumDense` (to `FP8EinsumDense`). The layer stays the
    same object with the same variables, name and path, and gains the FP8
    state variables (`input_scale`, `input_amax_history`, ...).

    Compile the model after converting (an optimizer or a compiled train
    function built before does not know the new variables).

    Layers that are left alone:
    - FP8 layers (already converted);
    - with a warning: a layer with LoRA enabled or a quantized layer
      (`quantization_mode` set: int8, float8, ...), since FP8 layers support
      neither; a strict subclass of `Dense`/`EinsumDense` (its own `call`
      would be lost); an `EinsumDense` whose equation is not a single matmul
      (a batched contraction); a layer that is not built (never called).

    Args:
        model: A built `keras.Model` or `keras.layers.Layer`.
        include: Which candidate layers to convert (default: all). A callable
            `(layer) -> bool`, a regular expression searched in the layer's
            path and in its name, or a list/tuple/set of layer names or paths.
        exclude: Candidate layers to skip, in the same forms as `include`;
            e.g. `exclude="head"` keeps a final `head` classifier as it is.
            Applied after `include`.
        recipe: Optional `keras_fp8.DelayedScaling` / `CurrentScaling` (or its
            name) set as each converted layer's `recipe` (None: the policy's).
        min_gemm_size: Optional `min_gemm_size` of each converted layer.
        policy: Optional dtype policy (name or policy) for the converted
            layers, e.g. `"fp8_hybrid"`; None keeps each layer's own policy.
            The converted layers run in FP8 only when their policy is an FP8
            policy or inside an enabled `keras_fp8.autocast` scope.

    Returns:
        The paths (`layer.path`) of the converted layers, in traversal order.

    Raises:
        TypeError: If `model` is not a Keras layer/model, or `include` /
            `exclude` has an unsupported type.
        ValueError: If `model` is not built, or a regular expression,
            `recipe`, `min_gemm_size` or `policy` is invalid.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "Argument `model` must be a Keras model or layer (a "
            "`keras.Model` or `keras.layers.Layer`). Received: "
            f"model={model!r} of type {type(model).__name__}"
        )
    include_fn = _selector(include, "include", default=True)
    exclude_fn = _selector(exclude, "exclude", default=False)
    if recipe is not None:
        recipe = recipes.get(recipe)
    recipes.check_min_gemm_size(min_gemm_size)
    if policy is not None:
        policy = _check_policy(policy)
    if not model.built:
        raise ValueError(
            f"Argument `model` ('{model.name}') must be built before "
            "conversion: call it on data or call `model.build(input_shape)` "
            "first, so that the kernels exist and keep their values."
        )

    # Plan first, so that nothing changes when a layer cannot be converted.
    plan = []
    for layer in compat.sublayers(model):
        if isinstance(layer, _FP8_CLASSES):
            continue
        target = _target_class(layer)
        if target is None:
            continue
        if not (include_fn(layer) and not exclude_fn(layer)):
            continue
        path = layer.path or layer.name
        if type(layer) is not _source_class(layer):
            _warn_skip(
                layer,
                f"its class {type(layer).__name__} is a subclass of "
                f"{_source_class(layer).__name__}; converting it would drop "
                "its own methods",
            )
            continue
        if getattr(layer, "lora_enabled", False):
            _warn_skip(
                layer, "LoRA is enabled (FP8 layers do not support LoRA)"
            )
            continue
        if layer.quantization_mode is not None:
            _warn_skip(
                layer,
                f"it is quantized (quantization_mode="
                f"'{layer.quantization_mode}')",
            )
            continue
        if not layer.built:
            _warn_skip(layer, "it is not built (never called)")
            continue
        matmul_plan = None
        if target is FP8EinsumDense:
            try:
                matmul_plan = MatmulPlan(layer.equation, _input_ndim(layer))
            except ValueError as e:
                _warn_skip(layer, str(e))
                continue
        plan.append((layer, target, matmul_plan, path))

    converted = []
    for layer, target, matmul_plan, path in plan:
        _convert_layer(
            layer, target, matmul_plan, recipe, min_gemm_size, policy
        )
        converted.append(path)
    if converted:
        _retrack_torch_parameters(model)
        _reset_compiled_functions(model)
    return converted


def _reset_compiled_functions(model):
    """Drops cached train/test/predict functions built for the old layers.

    They were traced over the old variable lists; `fit`/`predict` rebuild
    them. The optimizer, though, was built for the old trainable variables:
    a compiled model must be compiled again before training.
    """
    for layer in compat.sublayers(model):
        if not isinstance(layer, keras.Model):
            continue
        for name in ("train_function", "test_function", "predict_function"):
            if getattr(layer, name, None) is not None:
                setattr(layer, name, None)
    optimizer = getattr(model, "optimizer", None)
    if getattr(model, "compiled", False) and optimizer is not None:
        warnings.warn(
            f"keras_fp8.convert: model '{model.name}' was compiled before "
            "conversion; call `model.compile(...)` again before training, so "
            "that the optimizer sees the new FP8 state variables.",
            stacklevel=3,
        )


def _retrack_torch_parameters(model):
    """torch: refreshes the parameter dicts that snapshot `variables`.

    A torch-backend layer registers its variables (sublayers' included) as
    `torch.nn.Parameter`s once, after its build. A converted layer adds its
    new variables to its own dict, but its ancestors' snapshots predate them:
    rebuild those, so that `model.parameters()` sees the FP8 state too.
    """
    for layer in compat.sublayers(model):
        compat.retrack_torch_parameters(layer)


def _convert_layer(layer, target, matmul_plan, recipe, min_gemm_size, policy):
    # `__class__` assignment bypasses Layer.__setattr__ (the tracker and, on
    # torch, nn.Module's registration) on purpose: it is not state.
    object.__setattr__(layer, "__class__", target)
    layer._init_fp8(recipe, min_gemm_size)
    if matmul_plan is not None:
        layer._plan = matmul_plan
    if policy is not None:
        # Before the state: its history length comes from the policy's recipe.
        layer.dtype_policy = policy
    # The layer's own name scope (with its recorded parent path) gives the
    # new variables the paths `build` would have given them; `add_weight`
    # tracks them (and on torch registers them in the module's parameters).
    with compat.layer_name_scope(layer):
        layer._build_fp8_state()


def _source_class(layer):
    for source, _ in _CONVERSIONS:
        if isinstance(layer, source):
            return source
    return None


def _target_class(layer):
    for source, target in _CONVERSIONS:
        if isinstance(layer, source):
            return target
    return None


def _input_ndim(layer):
    shape = compat.build_input_shape(layer)
    if shape is None:
        # MatmulPlan only needs the rank for an ellipsis equation.
        if "..." in layer.equation:
            raise ValueError(
                "the input rank of its ellipsis equation "
                f"{layer.equation!r} is unknown"
            )
        return len(layer.equation.partition(",")[0])
    return len(shape)


def _warn_skip(layer, reason):
    warnings.warn(
        f"keras_fp8.convert: layer '{layer.path or layer.name}' "
        f"({type(layer).__name__}) is not converted: {reason}.",
        stacklevel=3,
    )


def _check_policy(policy):
    try:
        policy = keras.dtype_policies.get(policy)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"Invalid `policy`. Expected a dtype policy or its name (e.g. "
            f"'fp8_hybrid'). Received: policy={policy!r} ({e})"
        ) from None
    if policy.quantization_mode is not None:
        raise ValueError(
            "Invalid `policy`: a quantized policy (quantization_mode="
            f"'{policy.quantization_mode}') cannot be set on FP8 layers; use "
            f"an FP8 policy such as 'fp8_hybrid'. Received: policy={policy!r}"
        )
    return policy


def _selector(spec, arg_name, default):
    """`(layer) -> bool` for an `include`/`exclude` argument."""
    if spec is None:
        return lambda layer: default
    if isinstance(spec, str):
        try:
            pattern = re.compile(spec)
        except re.error as e:
            raise ValueError(
                f"Invalid regular expression in `{arg_name}`: {e}. "
                f"Received: {arg_name}={spec!r}"
            ) from None
        return lambda layer: bool(
            pattern.search(layer.path or "") or pattern.search(layer.name)
        )
    if isinstance(spec, (list, tuple, set, frozenset)):
        bad = [item for item in spec if not isinstance(item, str)]
        if bad:
            raise TypeError(
                f"Argument `{arg_name}` as a list must hold layer names or "
                f"paths (strings). Received: {arg_name}={spec!r}"
            )
        names = set(spec)
        return lambda layer: layer.name in names or layer.path in names
    if callable(spec):
        return lambda layer: bool(spec(layer))
    raise TypeError(
        f"Argument `{arg_name}` must be None, a callable `(layer) -> bool`, a "
        "regular expression string or a list of layer names. Received: "
        f"{arg_name}={spec!r} of type {type(spec).__name__}"
    )
