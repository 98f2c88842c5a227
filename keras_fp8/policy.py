"""FP8 dtype policies and their registration with Keras.

After `import keras_fp8`, the names below work wherever Keras takes a dtype
policy name (`keras.mixed_precision.set_global_policy`, `Layer(dtype=...)`,
`keras.dtype_policies.get`, and `.keras` reloads):

| name                  | compute  | variables | formats (fwd / grad) |
|-----------------------|----------|-----------|----------------------|
| `fp8_hybrid`          | bfloat16 | float32   | E4M3 / E5M2          |
| `fp8_hybrid_float16`  | float16  | float32   | E4M3 / E5M2          |
| `fp8_e4m3`            | bfloat16 | float32   | E4M3 / E4M3          |
| `fp8_e4m3_float16`    | float16  | float32   | E4M3 / E4M3          |

Under an FP8 policy every `keras.layers.Dense` and `keras.layers.EinsumDense`
becomes an FP8 layer when it builds (`keras_fp8/policy_layers.py`), unless the
policy's `exclude` names it; every other layer runs exactly as under
`mixed_bfloat16` (or `mixed_float16`): the policy's `quantization_mode` is
None, so Keras never routes a layer to a quantized call.

Non-default settings are part of the policy name, e.g.
`"fp8_hybrid[history_len=16,amax_compute_algo=most_recent]"`,
`"fp8_hybrid[scaling=current,margin=1.0]"` or `"fp8_hybrid[exclude=logits]"`,
because Keras rebuilds a deserialized policy from its name alone.
"""

import dataclasses
import difflib
import re

import keras
from keras.saving import register_keras_serializable

from keras_fp8 import compat
from keras_fp8 import recipes

_DTypePolicyMap = keras.dtype_policies.DTypePolicyMap

# name -> (compute dtype, fp8_format)
POLICY_NAMES = {
    "fp8_hybrid": ("bfloat16", "hybrid"),
    "fp8_hybrid_float16": ("float16", "hybrid"),
    "fp8_e4m3": ("bfloat16", "e4m3"),
    "fp8_e4m3_float16": ("float16", "e4m3"),
}
_PREFIX = "fp8"


def is_fp8_policy_name(name):
    """True for names keras_fp8 owns: `"fp8"` and anything starting `"fp8_"`
    or `"fp8["`, in any case."""
    if not isinstance(name, str):
        return False
    name = name.lower()
    return name == _PREFIX or name.startswith((_PREFIX + "_", _PREFIX + "["))


def _format_value(value):
    return repr(value) if isinstance(value, float) else str(value)


def _encode_recipe(recipe):
    """Encodes the non-default fields of `recipe` (fp8_format excluded)."""
    default = type(recipe)(fp8_format=recipe.fp8_format)
    items = []
    if not isinstance(recipe, recipes.DelayedScaling):
        items.append(f"scaling={recipe.name}")
    for key, value in recipe.get_config().items():
        if key != "fp8_format" and value != getattr(default, key):
            items.append(f"{key}={_format_value(value)}")
    return f"[{','.join(items)}]" if items else ""


def _parse_value(key, text):
    if key == "history_len":
        return int(text)
    if key == "margin":
        return float(text)
    if key in ("power_of_two", "share_quantized_inputs", "fuse_producers", "requantize_weight_in_backward"):
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    return text


# Settings every policy name takes besides its recipe's fields.
_POLICY_KEYS = ("scaling", "min_gemm_size", "exclude")


def _recipe_keys(recipe_class):
    """The settings of `recipe_class` a policy name may hold (its fields
    but `fp8_format`, which the base name gives)."""
    return [f.name for f in dataclasses.fields(recipe_class) if f.name != "fp8_format"]


def _check_setting_keys(name, scaling, keys):
    """Raises for a key in `keys` that the policy name's `scaling` does not
    take, listing the keys it does take."""
    valid = list(_POLICY_KEYS) + _recipe_keys(recipes.RECIPES[scaling])
    for key in keys:
        if key in valid:
            continue
        if key == "fp8_format":
            hint = (
                " The format comes from the base name: 'fp8_hybrid' (E4M3 "
                "forward, E5M2 gradients) or 'fp8_e4m3'."
            )
        elif any(key in _recipe_keys(cls) for cls in recipes.RECIPES.values()):
            hint = f" {key!r} does not apply to scaling={scaling!r}."
        else:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown setting {key!r} in FP8 dtype policy name {name!r}.{hint} "
            f"Valid settings with scaling={scaling!r}: {', '.join(valid)}."
        )


def _decode_name(name):
    """Splits `"fp8_hybrid[history_len=16]"` into its base and its recipe."""
    base, _, settings = name.partition("[")
    base = base.strip().lower()
    if base not in POLICY_NAMES:
        raise ValueError(
            f"Unknown FP8 dtype policy name {name!r}. Valid names: "
            f"{sorted(POLICY_NAMES)}, optionally followed by recipe settings "
            "such as '[history_len=16,margin=1.0]'."
        )
    fp8_format = POLICY_NAMES[base][1]
    texts = {}
    scaling = "delayed"
    min_gemm_size = None
    exclude = None
    if settings:
        if not settings.endswith("]"):
            raise ValueError(
                f"Malformed FP8 dtype policy name {name!r}: expected settings "
                "of the form '[key=value,...]'."
            )
        seen = set()
        for item in filter(None, settings[:-1].split(",")):
            key, sep, text = item.partition("=")
            if not sep:
                raise ValueError(
                    f"Malformed setting {item!r} in FP8 dtype policy name "
                    f"{name!r}: expected 'key=value'."
                )
            key = key.strip()
            if key in seen:
                raise ValueError(
                    f"Duplicate setting {key!r} in FP8 dtype policy name "
                    f"{name!r}: give each setting once."
                )
            seen.add(key)
            if key == "scaling":
                scaling = text.strip()
                continue
            if key == "min_gemm_size":
                try:
                    min_gemm_size = int(text)
                except ValueError:
                    raise ValueError(
                        f"Invalid value {text!r} for 'min_gemm_size' in FP8 "
                        f"dtype policy name {name!r}: expected an integer."
                    ) from None
                recipes.check_min_gemm_size(min_gemm_size)
                continue
            if key == "exclude":
                exclude = check_exclude(text.strip())
                continue
            texts[key] = text
    if scaling not in recipes.RECIPES:
        raise ValueError(
            f"Invalid scaling {scaling!r} in FP8 dtype policy name {name!r}. "
            f"Expected one of {sorted(recipes.RECIPES)}."
        )
    # Checked once `scaling` is known: it may come after the recipe's keys.
    _check_setting_keys(name, scaling, texts)
    kwargs = {}
    for key, text in texts.items():
        try:
            kwargs[key] = _parse_value(key, text.strip())
        except ValueError:
            raise ValueError(
                f"Invalid value {text!r} for {key!r} in FP8 dtype policy "
                f"name {name!r}."
            ) from None
    try:
        recipe = recipes.RECIPES[scaling](fp8_format=fp8_format, **kwargs)
    except TypeError as e:
        raise ValueError(
            f"Invalid settings in FP8 dtype policy name {name!r}: {e}"
        ) from None
    return base, recipe, min_gemm_size, exclude


# Characters the name encoding uses around and between settings.
_RESERVED = ",[]"


def check_exclude(exclude):
    """Validates an `exclude` pattern (None, or a regular expression).

    Returns:
        `exclude`, unchanged.

    Raises:
        ValueError: If it is not None or a non-empty string, holds one of the
            name encoding's characters `,[]`, is not a regular expression, or
            matches the empty string.
    """
    if exclude is None:
        return None
    if not isinstance(exclude, str) or not exclude:
        raise ValueError(
            "Invalid `exclude`: expected a regular expression (a non-empty "
            f"string) or None. Received: exclude={exclude!r}"
        )
    bad = [c for c in _RESERVED if c in exclude]
    if bad:
        raise ValueError(
            f"Invalid `exclude` {exclude!r}: it is encoded into the policy "
            f"name, where {' '.join(repr(c) for c in _RESERVED)} separate "
            "settings; write alternatives with '|' (e.g. 'head|logits') and "
            "avoid character classes and {m,n} repeats."
        )
    compile_exclusion(exclude, "exclude")
    return exclude


def compile_pattern(pattern, arg_name):
    """Compiles a regular expression given as `arg_name`, or raises a
    ValueError naming the argument."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(
            f"Invalid `{arg_name}`: not a regular expression ({e}). "
            f"Received: {arg_name}={pattern!r}"
        ) from None


def compile_exclusion(pattern, arg_name):
    """Compiles a regular expression naming layers to leave out.

    Args:
        pattern: The regular expression (a string).
        arg_name: The argument's name in error messages.

    Returns:
        The compiled pattern.

    Raises:
        ValueError: If `pattern` is not a regular expression, or matches the
            empty string: searched in every layer's path, such a pattern
            (an empty alternative, `"logits|"`; `"x*"`) matches every layer.
    """
    compiled = compile_pattern(pattern, arg_name)
    if compiled.search("") is not None:
        raise ValueError(
            f"Invalid `{arg_name}`: the pattern matches the empty string, so it "
            "would match every layer (e.g. an empty alternative 'logits|', or "
            "'x*'). Name the layers, e.g. 'logits' or 'head|logits' ('.+' "
            f"names every layer). Received: {arg_name}={pattern!r}"
        )
    return compiled


def model_names(model):
    """The names of the models in `model` (itself included): what
    `exclusion_path` leaves out of the paths of its layers."""
    return {layer.name for layer in compat.sublayers(model) if isinstance(layer, keras.Model)}


def exclusion_path(layer, models=None):
    """The text an `exclude` pattern is searched in (`re.search`): the
    layer's path below its model.

    A layer's path starts with the layers it was built inside
    (`my_net/block/up` for the layer `up` of the layer `block` of the
    subclassed model `my_net`). When the outermost of them is a model (a
    subclassed model called on data, a `Sequential`), its name is left
    out (`block/up`): a pattern names layers within the model, and
    `exclude="head"` does not match every layer of a model named
    `multihead_net`. The names of the layers in between stay (`block`).
    The layers of a Functional model (keras_hub's included) are built
    outside it, so their paths hold no model name to begin with.

    Args:
        layer: The layer.
        models: The names of the models `layer` is looked at in
            (`model_names(model)`: `keras_fp8.convert`, `keras_fp8.summary`);
            None while `layer` builds, when they are the models whose name
            scopes are open.

    Returns:
        The path below the model (the layer's name when it has no path).
    """
    path = layer.path or layer.name
    root, sep, rest = path.partition("/")
    if not sep:
        return path
    if models is None:
        models = compat.open_model_scopes()
    return rest if root in models else path


def layer_policy(layer):
    """The dtype policy `layer` runs under.

    A `keras.dtype_policies.DTypePolicyMap` (as keras_hub models pass to
    their layers) is resolved by the layer's path, as Keras resolves the
    compute dtype; a map asked before the layer has a path answers with its
    default policy.
    """
    policy = layer.dtype_policy
    if isinstance(policy, _DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


@register_keras_serializable(package="keras_fp8")
class FP8DTypePolicy(keras.DTypePolicy):
    """A dtype policy that runs FP8 layers in FP8 and the rest in mixed precision.

    Compute dtype bfloat16 (or float16 for the `*_float16` names), variables
    float32. `FP8Dense` and `FP8EinsumDense` layers under this policy quantize
    their matmul operands to FP8 following `recipe`; every other layer behaves
    as under `mixed_bfloat16` / `mixed_float16`.

    Args:
        name: One of `"fp8_hybrid"`, `"fp8_hybrid_float16"`, `"fp8_e4m3"`,
            `"fp8_e4m3_float16"`, optionally with encoded recipe settings
            (the `name` of another `FP8DTypePolicy`).
        recipe: Optional `DelayedScaling` or `CurrentScaling`. Its
            `fp8_format` must agree with the name; its other settings are
            encoded into the policy's `name`.
        min_gemm_size: Optional integer: FP8 layers whose `M*N*K` is below
            it run exactly what their compute-dtype counterpart runs (FP8
            cannot win at small shapes) and leave their FP8 state alone.
            Encoded into the name as well.
        exclude: Optional regular expression: a `keras.layers.Dense` or
            `keras.layers.EinsumDense` whose path below its model it matches
            (`re.search` in e.g. `block/up` for the path `my_net/block/up`
            of a subclassed model `my_net`: the model's own name is left
            out, see `exclusion_path`) stays a plain layer under this policy
            (computing in the compute dtype, as under `mixed_bfloat16`),
            e.g. `"logits"` for a classifier head. `keras_fp8.summary` lists
            the layers it kept plain. It does not reach explicit `FP8Dense`
            / `FP8EinsumDense` layers. Encoded into the name as well, so it
            is saved with the model; it may not hold `,`, `[` or `]`, nor
            match the empty string (`"logits|"`, `"x*"`: every layer).

    Example:

    >>> import keras_fp8
    >>> keras.mixed_precision.set_global_policy("fp8_hybrid")
    >>> policy = keras_fp8.FP8DTypePolicy(
    ...     "fp8_hybrid", recipe=keras_fp8.DelayedScaling(history_len=16))
    >>> policy.name
    'fp8_hybrid[history_len=16]'
    >>> keras_fp8.FP8DTypePolicy("fp8_hybrid", exclude="logits").name
    'fp8_hybrid[exclude=logits]'
    """

    def __init__(self, name=None, recipe=None, min_gemm_size=None, exclude=None):
        if name is None:
            name = "fp8_hybrid"
        base, name_recipe, name_min_gemm_size, name_exclude = _decode_name(name)
        if min_gemm_size is None:
            min_gemm_size = name_min_gemm_size
        recipes.check_min_gemm_size(min_gemm_size)
        exclude = check_exclude(exclude)
        if exclude is not None and name_exclude not in (None, exclude):
            raise ValueError(
                f"Conflicting settings: the policy name {name!r} encodes "
                f"exclude={name_exclude!r}, but exclude={exclude!r} was also "
                "given."
            )
        exclude = exclude if exclude is not None else name_exclude
        if recipe is not None:
            recipe = recipes.get(recipe)
            if recipe.fp8_format != name_recipe.fp8_format:
                raise ValueError(
                    f"The recipe's fp8_format={recipe.fp8_format!r} does not "
                    f"match the policy {base!r} (fp8_format="
                    f"{name_recipe.fp8_format!r})."
                )
            name_has_recipe = name_recipe != recipes.DelayedScaling(
                fp8_format=name_recipe.fp8_format
            )
            if name_has_recipe and recipe != name_recipe:
                raise ValueError(
                    f"Conflicting settings: the policy name {name!r} encodes "
                    f"{name_recipe}, but recipe={recipe} was also given."
                )
        else:
            recipe = name_recipe
        self._base_name = base
        self._recipe = recipe
        self._min_gemm_size = min_gemm_size
        self._exclude = exclude
        self._exclude_pattern = re.compile(exclude) if exclude is not None else None
        items = [_encode_recipe(recipe)[1:-1]]
        if min_gemm_size is not None:
            items.append(f"min_gemm_size={min_gemm_size}")
        if exclude is not None:
            items.append(f"exclude={exclude}")
        settings = ",".join(item for item in items if item)
        self._name = base + (f"[{settings}]" if settings else "")
        self._compute_dtype = POLICY_NAMES[base][0]
        self._variable_dtype = "float32"
        self._quantization_mode = None

    @property
    def recipe(self):
        """The scaling recipe FP8 layers use under this policy."""
        return self._recipe

    @property
    def min_gemm_size(self):
        """`M*N*K` below which compiled FP8 layers run their GEMMs in the
        compute dtype (None: the library default)."""
        return self._min_gemm_size

    @property
    def exclude(self):
        """The regular expression naming the `Dense`/`EinsumDense` layers
        that stay plain under this policy (None: none)."""
        return self._exclude

    def excludes(self, layer, models=None):
        """Whether `exclude` matches `layer`: searched (`re.search`) in its
        path below its model (`exclusion_path(layer, models)`)."""
        if self._exclude_pattern is None:
            return False
        return self._exclude_pattern.search(exclusion_path(layer, models)) is not None

    @property
    def fp8_format(self):
        return self._recipe.fp8_format

    @property
    def base_name(self):
        """The name without recipe settings, e.g. `"fp8_hybrid"`."""
        return self._base_name

    @property
    def mixed_precision_name(self):
        """The Keras policy non-FP8 layers behave as (`mixed_bfloat16`...)."""
        return "mixed_" + self._compute_dtype

    def __eq__(self, other):
        return isinstance(other, FP8DTypePolicy) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return f'<FP8DTypePolicy "{self._name}">'


def register():
    """Routes the FP8 policy names to `FP8DTypePolicy` (idempotent; done at
    import: `keras_fp8/compat.py`, patch 1)."""
    compat.route_policy_names(is_fp8_policy_name, FP8DTypePolicy)


def get(identifier):
    """Returns the FP8 policy for `identifier` (a name, policy or None).

    Args:
        identifier: An `FP8DTypePolicy`, an FP8 policy name, or None for the
            current global policy (which must then be an FP8 policy).

    Returns:
        An `FP8DTypePolicy`.
    """
    if identifier is None:
        identifier = keras.config.dtype_policy()
    if isinstance(identifier, FP8DTypePolicy):
        return identifier
    if isinstance(identifier, str):
        if not is_fp8_policy_name(identifier):
            raise ValueError(
                f"Expected an FP8 dtype policy name, one of "
                f"{sorted(POLICY_NAMES)}. Received: policy={identifier!r}"
            )
        return FP8DTypePolicy(identifier)
    raise ValueError(
        "Expected an FP8 dtype policy (name or FP8DTypePolicy). "
        f"Received: policy={identifier!r}"
    )
