"""Converts the Dense/EinsumDense layers of a built model to FP8, and back.

Under an FP8 policy a model needs neither: its `Dense`/`EinsumDense` layers
become FP8 layers when they build (`keras_fp8/policy_layers.py`). `convert`
is for a model that is already built (e.g. loaded from a plain checkpoint);
`unconvert` returns any model to plain Keras layers and policies (export,
serving, Keras's own quantization).

```python
model = keras.models.load_model("bf16_model.keras")  # any built model
converted = keras_fp8.convert(model, exclude="head", policy="fp8_hybrid")
model.compile(optimizer="adam", loss=...)   # (re)compile after converting
model.fit(...)
keras_fp8.unconvert(model)                  # plain Dense/EinsumDense again
```

Each converted layer keeps its identity (the same Python object, the same
kernel and bias variables, name and path): its class becomes `FP8Dense` /
`FP8EinsumDense` and it gains the FP8 state variables. With FP8 off (inside
`keras_fp8.autocast(enabled=False)`, or converted with a non-FP8 `policy=`)
it computes exactly what the plain layer computes under its policy: with
`policy=` its old policy (e.g. `"float32"`), what it computed before.

When FP8 is on after converting: a layer's dtype policy is fixed at
construction, so `set_global_policy("fp8_hybrid")` after building the model
does not reach its layers. `convert` therefore gives each converted layer an
FP8 policy: `policy=`, by default `"fp8_hybrid"` (its own policy where that
is an FP8 policy already), which also makes the converted layers compute in
bfloat16. A non-FP8 `policy=` (e.g. `"float32"`) converts without turning
FP8 on: the layers then run FP8 only inside `keras_fp8.autocast(...)`.

Saving: with an FP8 policy (the default), `model.save` / `keras.models.load_model`
bring the model back FP8 with its state. Sequential and Functional models
serialize their own layers' FP8 classes and policies; layers that their
parent's code creates (keras_hub backbones and tasks, `MultiHeadAttention`'s
projections, custom layers that pass `dtype=self.dtype_policy` on) come back
through their parents' dtype policy: `convert` records each converted
layer's path and policy in a `keras.dtype_policies.DTypePolicyMap` on every
layer that holds sublayers (the mechanism keras_hub uses for quantized
layers), and the rebuilt layers build FP8 from it. A subclassed model whose
code creates its layers without a `dtype` rebuilds them under the global
policy in effect when it loads: load it under the FP8 policy, or rebuild it,
convert it the same way and `model.load_weights(path)`.
"""

import warnings

import keras

from keras_fp8 import compat
from keras_fp8 import policy as policy_lib
from keras_fp8 import recipes
from keras_fp8.layers import swap


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
    each layer whose class is exactly `keras.layers.Dense` (to `FP8Dense`),
    `keras.layers.EinsumDense` (to `FP8EinsumDense`) or
    `keras.layers.ReversibleEmbedding` (to `FP8ReversibleEmbedding`: the
    token embedding whose reverse call is a language model's vocabulary
    projection). The layer stays the
    same object with the same variables, name and path, and gains the FP8
    state variables (`input_scale`, `input_amax_history`, ...).

    Compile the model after converting (an optimizer or a compiled train
    function built before does not know the new variables).

    Each converted layer gets an FP8 policy, so that it runs FP8: `policy`,
    by default `"fp8_hybrid"` (bfloat16 compute, E4M3 forward, E5M2
    gradients), or its own policy where that is an FP8 policy already.

    Layers that are left alone:
    - FP8 layers (already converted);
    - layers that the `exclude` of their FP8 policy (`policy`, else their
      own) matches (no warning; `keras_fp8.summary` lists them);
    - with a warning: a layer with LoRA enabled or a quantized layer
      (`quantization_mode` set: int8, float8, ...), since FP8 layers support
      neither; a strict subclass of `Dense`/`EinsumDense` (its own `call`
      would be lost); an `EinsumDense` whose equation is not a single matmul
      (a batched contraction); a layer that is not built (never called).

    Args:
        model: A built `keras.Model` or `keras.layers.Layer`.
        include: Which candidate layers to convert (default: all). A callable
            `(layer) -> bool`, a regular expression searched (`re.search`)
            in the layer's path below `model` (`model`'s own name left out:
            `block/up` for the path `net/block/up` of the subclassed model
            `net`; see `keras_fp8.policy.exclusion_path`), or a
            list/tuple/set of layer names or paths (full or below `model`).
        exclude: Candidate layers to skip, in the same forms as `include`;
            e.g. `exclude="head"` keeps a final `head` classifier as it is.
            Applied after `include`. A regular expression that matches the
            empty string (`"head|"`, `"x*"`: every layer) is refused.
        recipe: Optional `keras_fp8.DelayedScaling` / `CurrentScaling` (or its
            name) set as each converted layer's `recipe` (None: the policy's).
        min_gemm_size: Optional `min_gemm_size` of each converted layer.
        policy: Dtype policy (name or policy) for the converted layers.
            None (the default): `"fp8_hybrid"`, except for a layer whose own
            policy is an FP8 policy already, which keeps it. A non-FP8 policy
            (e.g. `"float32"`) converts without turning FP8 on: the layers
            then compute as under that policy, and in FP8 only inside an
            enabled `keras_fp8.autocast` scope. The FP8 policies are also
            recorded where the model's layers rebuild their sublayers from
            (see the module docstring), so that `.keras` files reload FP8.

    Returns:
        The paths (`layer.path`) of the converted layers, in traversal order.

    Raises:
        TypeError: If `model` is not a Keras layer/model, or `include` /
            `exclude` has an unsupported type.
        ValueError: If `model` is not built, or a regular expression,
            `recipe`, `min_gemm_size` or `policy` is invalid.
    """
    _check_model(model)
    # What the patterns leave out of the layers' paths.
    models = policy_lib.model_names(model)
    include_fn = _selector(include, "include", models, default=True)
    exclude_fn = _selector(exclude, "exclude", models, default=False)
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
        if isinstance(layer, swap.FP8_CLASSES) or swap.plain_base(layer) is None:
            continue
        if not (include_fn(layer) and not exclude_fn(layer)):
            continue
        target = _target_policy(layer, policy)
        if isinstance(target, policy_lib.FP8DTypePolicy) and target.excludes(layer, models):
            continue
        reason = None if layer.built else "it is not built (never called)"
        if reason is None:
            reason = swap.why_not_fp8(layer, _input_ndim(layer))
        if reason is not None:
            _warn_skip(layer, reason)
            continue
        plan.append((layer, target))

    converted = []
    for layer, target in plan:
        _convert_layer(layer, recipe, min_gemm_size, target)
        converted.append(layer.path or layer.name)
    fp8 = [(layer, target) for layer, target in plan if isinstance(target, policy_lib.FP8DTypePolicy)]
    if fp8:
        _record_in_policy_maps(model, fp8)
    if converted:
        _retrack_torch_parameters(model)
        _reset_compiled_functions(model, "convert", "the new FP8 state variables")
    return converted


def unconvert(model, *, policy=None):
    """Returns a model to plain Keras layers and policies, in place.

    Every `FP8Dense` / `FP8EinsumDense` in `model` (made by a policy, by
    `convert` or written as such) becomes a `keras.layers.Dense` /
    `EinsumDense` again: the same object with the same kernel and bias,
    without the FP8 state variables. Every FP8 dtype policy in the model
    (layers' own, and the entries and defaults of `DTypePolicyMap`s) is
    replaced by `policy`, or by its mixed-precision counterpart
    (`"fp8_hybrid"` -> `"mixed_bfloat16"`, `"fp8_hybrid_float16"` ->
    `"mixed_float16"`): the model then computes as under that policy, saves
    without any keras_fp8 object (it loads where keras_fp8 is not installed),
    and can go through Keras's own `model.quantize(...)`.

    Compile again before training (the variables changed).

    Args:
        model: A `keras.Model` or `keras.layers.Layer`.
        policy: Optional dtype policy (name or policy, not an FP8 or
            quantized one) for what ran under FP8 policies; None: each FP8
            policy's `mixed_precision_name`.

    Returns:
        The paths (`layer.path`) of the layers that were FP8 layers.

    Raises:
        TypeError: If `model` is not a Keras layer/model.
        ValueError: If `policy` is invalid, an FP8 or a quantized policy.

    Example:

    ```python
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    model = build_model()
    model.fit(...)
    keras_fp8.unconvert(model)       # Dense/EinsumDense, mixed_bfloat16
    model.save("serving.keras")      # loads without keras_fp8
    ```
    """
    _check_model(model)
    if policy is not None:
        policy = _check_policy(policy)
        if isinstance(policy, policy_lib.FP8DTypePolicy):
            raise ValueError(
                "Invalid `policy`: unconvert needs a policy that is not an FP8 "
                f"policy (e.g. 'mixed_bfloat16'). Received: policy={policy!r}"
            )
    layers = compat.sublayers(model)
    unconverted = []
    for layer in layers:
        if type(layer) in swap.PLAIN_CLASS:
            swap.to_plain(layer)
            unconverted.append(layer.path or layer.name)
    replaced = {}
    for layer in layers:
        current = layer.dtype_policy
        if id(current) not in replaced:
            replaced[id(current)] = _without_fp8(current, policy)
        new = replaced[id(current)]
        if new is not current:
            compat.set_policy_object(layer, new)
    _retrack_torch_parameters(model)
    if unconverted:
        _reset_compiled_functions(model, "unconvert", "the variables left")
    return unconverted


# The policy of converted layers when `convert` is given none.
DEFAULT_POLICY = "fp8_hybrid"


def _target_policy(layer, policy):
    """The policy `layer` gets when converted: `policy`, else its own where
    that is an FP8 policy, else `DEFAULT_POLICY`."""
    if policy is not None:
        return policy
    own = policy_lib.layer_policy(layer)
    if isinstance(own, policy_lib.FP8DTypePolicy):
        return own
    return policy_lib.FP8DTypePolicy(DEFAULT_POLICY)


def _without_fp8(policy, replacement):
    """`policy` with every FP8 policy in it replaced (`policy` itself when it
    holds none)."""

    def plain(p):
        if not isinstance(p, policy_lib.FP8DTypePolicy):
            return p
        return replacement if replacement is not None else keras.dtype_policies.get(
            p.mixed_precision_name
        )

    if not isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return plain(policy)
    default = policy.default_policy
    entries = {key: policy[key] for key in policy}
    if not any(isinstance(p, policy_lib.FP8DTypePolicy) for p in [default, *entries.values()]):
        return policy
    default = plain(default)
    entries = {key: plain(p) for key, p in entries.items()}
    if all(p == default for p in entries.values()):
        return default
    return keras.dtype_policies.DTypePolicyMap(default_policy=default, policy_map=entries)


def _record_in_policy_maps(model, converted):
    """Records `path -> policy` of the converted layers (`(layer, policy)`
    pairs) in a `DTypePolicyMap` on every layer of `model` that holds
    sublayers.

    Layers that create their sublayers in their own code pass their dtype
    policy on to them (keras_hub backbones pass theirs to every block and to
    a task's head, `MultiHeadAttention` to its projections), and a sublayer
    under a `DTypePolicyMap` takes the entry of its path: reloaded, the
    converted layers build under their policy, hence FP8. The map's default
    is the layer's own policy, so nothing else changes.

    Each path is recorded as it is and without the model's name in front: a
    subclassed model called on data builds its layers inside its own name
    (`net/block/up`), but rebuilt from a file, outside it (`block/up`).
    """
    entries = {}
    prefix = model.name + "/"
    for layer, policy in converted:
        if layer.path:
            entries[layer.path] = policy
            if layer.path.startswith(prefix):
                entries[layer.path[len(prefix):]] = policy
    for holder in compat.sublayers(model):
        if isinstance(holder, swap.FP8_CLASSES) or not compat.sublayers(holder, include_self=False):
            continue
        current = holder.dtype_policy
        if current.quantization_mode is not None:
            continue
        if isinstance(current, keras.dtype_policies.DTypePolicyMap):
            policy_map = current
        else:
            policy_map = keras.dtype_policies.DTypePolicyMap(default_policy=current)
            compat.set_policy_object(holder, policy_map)
        for path in sorted(entries):
            if path in policy_map:
                del policy_map[path]
            policy_map[path] = entries[path]


def _check_model(model):
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "Argument `model` must be a Keras model or layer (a "
            "`keras.Model` or `keras.layers.Layer`). Received: "
            f"model={model!r} of type {type(model).__name__}"
        )


def _reset_compiled_functions(model, what, new_variables):
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
            f"keras_fp8.{what}: model '{model.name}' was compiled before; call "
            "`model.compile(...)` again before training, so that the "
            f"optimizer sees {new_variables}.",
            stacklevel=3,
        )


def _retrack_torch_parameters(model):
    """torch: refreshes the parameter dicts that snapshot `variables`.

    A torch-backend layer registers its variables (sublayers' included) as
    `torch.nn.Parameter`s once, after its build. A converted layer adds its
    new variables to its own dict, but its ancestors' snapshots predate them:
    rebuild those, so that `model.parameters()` sees the FP8 state too (or,
    after `unconvert`, no longer holds it).
    """
    for layer in compat.sublayers(model):
        compat.retrack_torch_parameters(layer)


def _convert_layer(layer, recipe, min_gemm_size, policy):
    swap.to_fp8(layer, recipe, min_gemm_size)
    if policy is not policy_lib.layer_policy(layer):
        # Before the state: its history length comes from the policy's recipe.
        layer.dtype_policy = policy
    # The layer's own name scope (with its recorded parent path) gives the
    # new variables the paths `build` would have given them; `add_weight`
    # tracks them (and on torch registers them in the module's parameters).
    with compat.layer_name_scope(layer):
        layer.build_fp8_state()


def _input_ndim(layer):
    """The rank of the input `layer` was built with (None: unknown)."""
    shape = compat.build_input_shape(layer)
    return None if shape is None else len(shape)


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


def _selector(spec, arg_name, models, default):
    """`(layer) -> bool` for an `include`/`exclude` argument."""
    if spec is None:
        return lambda layer: default
    if isinstance(spec, str):
        if arg_name == "exclude":
            pattern = policy_lib.compile_exclusion(spec, arg_name)
        else:
            pattern = policy_lib.compile_pattern(spec, arg_name)
        return lambda layer: pattern.search(policy_lib.exclusion_path(layer, models)) is not None
    if isinstance(spec, (list, tuple, set, frozenset)):
        bad = [item for item in spec if not isinstance(item, str)]
        if bad:
            raise TypeError(
                f"Argument `{arg_name}` as a list must hold layer names or "
                f"paths (strings). Received: {arg_name}={spec!r}"
            )
        names = set(spec)
        return lambda layer: bool(
            {layer.name, layer.path, policy_lib.exclusion_path(layer, models)} & names
        )
    if callable(spec):
        return lambda layer: bool(spec(layer))
    raise TypeError(
        f"Argument `{arg_name}` must be None, a callable `(layer) -> bool`, a "
        "regular expression string or a list of layer names. Received: "
        f"{arg_name}={spec!r} of type {type(spec).__name__}"
    )
