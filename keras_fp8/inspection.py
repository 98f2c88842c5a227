"""Looking at a model's FP8 layers: `fp8_layers`, `excluded_layers`,
`summary`, `float32_matmul_layers`, `kept_inputs`."""

import keras
from keras import ops

from keras_fp8 import compat
from keras_fp8 import policy as policy_lib
from keras_fp8.kept_inputs import KeptInput  # noqa: F401 (public here)
from keras_fp8.kept_inputs import kept_inputs
from keras_fp8 import recipes
from keras_fp8.layers import swap
from keras_fp8.layers.fp8_state import ROLES
from keras_fp8.layers.fp8_state import FP8StateMixin


def fp8_layers(model):
    """The FP8 layers (`FP8Dense`, `FP8EinsumDense`) in `model`, nested
    ones included, in Keras's layer order; `model` itself if it is one."""
    return [layer for layer in compat.sublayers(model) if isinstance(layer, FP8StateMixin)]


def excluded_layers(model):
    """The `Dense`/`EinsumDense` layers of `model` that an FP8 policy's
    `exclude` pattern keeps plain.

    Returns:
        `(layer, pattern)` pairs in Keras's layer order: each plain layer
        (exactly `keras.layers.Dense` / `EinsumDense`) under an FP8 policy
        whose `exclude` matches it, with that pattern. The pattern is searched
        in the layer's path below `model` (`keras_fp8.policy.exclusion_path`).
    """
    found = []
    models = policy_lib.model_names(model)
    for layer in compat.sublayers(model):
        if type(layer) not in swap.PLAIN_CLASSES:
            continue
        policy = policy_lib.layer_policy(layer)
        if isinstance(policy, policy_lib.FP8DTypePolicy) and policy.excludes(layer, models):
            found.append((layer, policy.exclude))
    return found


def layer_names(layers):
    """A unique display name per layer: its name, or its path where two
    layers share a name (nested models)."""
    names = [layer.name for layer in layers]
    return [
        layer.name if names.count(layer.name) == 1 else layer.path
        for layer in layers
    ]


def describe_recipe(recipe):
    """A short description of a recipe, e.g. `delayed hybrid h=1024`."""
    if recipe is None:
        return "off"
    parts = [recipe.name, recipe.fp8_format]
    if isinstance(recipe, recipes.DelayedScaling):
        parts.append(f"h={recipe.history_len}")
        if recipe.amax_compute_algo != "max":
            parts.append(recipe.amax_compute_algo)
    if recipe.margin:
        parts.append(f"margin={recipe.margin:g}")
    return " ".join(parts)


def _format_table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = "  ".join(f"{h:<{w}}" for h, w in zip(header, widths))
    rule = "-" * len(line)
    body = ["  ".join(f"{str(c):<{w}}" for c, w in zip(row, widths)) for row in rows]
    return "\n".join([rule, line, rule] + body + [rule])


def summary(model, print_fn=None, *, x=None, y=None, sample_weight=None, loss=None):
    """Prints one table of every FP8 layer of `model`.

    Per layer: its recipe (the one its next call uses), its kernel shape, the
    `M x K x N` GEMM of its last call, whether that call ran FP8 or the
    compute dtype (below `min_gemm_size`, or FP8 off under the layer's
    policy), the `min_gemm_size` in force, and its current scales. Then the
    `Dense`/`EinsumDense` layers that an FP8 policy's `exclude` pattern kept
    plain, each with the pattern (`excluded_layers`). Given a sample batch
    `x`, then which FP8 layers' compute-dtype inputs stay alive for the
    backward because another layer saves them too (so their FP8 copy saves
    no memory there), naming those layers and ops, with the bytes kept
    (`kept_inputs`: one training forward pass on `x`, no variable changed).
    Then, on torch, a note naming the layers that multiply in float32
    without tensor cores (`float32_matmul_layers`), unless the user lowered
    torch's float32 matmul precision (TF32).

    Args:
        model: A Keras model or layer.
        print_fn: Called with the table (a string), then with the report on
            the inputs kept (with `x`), then with the note if any; `print`
            by default.
        x: Optional sample batch of the model's inputs, for the report on
            the inputs kept (a few examples suffice; the bytes are this
            batch's).
        y: Optional targets, for the loss of that pass: the model's
            compiled loss, or `loss`. Without them the pass's loss is the
            sum of the outputs, which keeps nothing itself.
        sample_weight: Optional sample weights for the loss (with `y`).
        loss: Optional loss instead of the compiled one (a
            `keras.losses.Loss`, a name, or `fn(y_true, y_pred)`); needs
            `y`.

    Example:

    >>> model.fit(x, y, epochs=1)
    >>> keras_fp8.summary(model)
    >>> keras_fp8.summary(model, x=x[:8], y=y[:8])  # and the inputs kept
    """
    if x is None and any(v is not None for v in (y, sample_weight, loss)):
        raise ValueError("Invalid `x`. Expected a sample batch with `y`, `sample_weight` or `loss` (they serve "
                         "the pass on `x` that finds the inputs kept). Received: x=None")
    kept = None if x is None else kept_inputs(model, x, y=y, sample_weight=sample_weight, loss=loss)
    layers = fp8_layers(model)
    header = ["layer", "type", "recipe", "kernel", "last GEMM (MxKxN)", "runs", "min_gemm_size"]
    header += [f"{role}_scale" for role in ROLES]
    rows = []
    for name, layer in zip(layer_names(layers), layers):
        runs, dims, limit = layer.fp8_execution()
        recipe = layer.active_recipe()
        kernel = "x".join(str(d) for d in layer.fp8_kernel().shape) if layer.built else "-"
        gemm = "-" if dims is None else "x".join("?" if d is None else str(d) for d in dims)
        scales = (
            [f"{float(ops.convert_to_numpy(getattr(layer, f'{role}_scale'))):.3e}" for role in ROLES]
            if layer.built else ["-"] * len(ROLES)
        )
        rows.append([name, type(layer).__name__, describe_recipe(recipe), kernel, gemm, runs,
                     "-" if limit is None else f"{limit:,}"] + scales)
    if not rows:
        text = f"{model.name}: no FP8 layers."
    else:
        text = f"FP8 layers of {model.name!r}\n" + _format_table(header, rows)
    excluded = excluded_layers(model)
    if excluded:
        names = layer_names([layer for layer, _ in excluded])
        text += f"\nKept plain by an `exclude` pattern ({len(excluded)}):\n" + "\n".join(
            f"  {name}  (exclude={pattern!r})" for name, (_, pattern) in zip(names, excluded)
        )
    (print_fn or print)(text)
    if kept is not None and rows:
        (print_fn or print)(_kept_inputs_report(model, layers, kept))
    note = _float32_matmul_note(model)
    if note:
        (print_fn or print)(note)


def _describe_savers(kept_by):
    return ", ".join(f"{path or '(outside its layers)'} ({op})" for path, op in kept_by)


def _kept_inputs_report(model, layers, kept):
    """What `summary` says about `kept_inputs`: per FP8 layer whose input
    another op keeps, who keeps it and the bytes (summed over the layer's
    calls), then how many keep only their FP8 copy."""
    if not kept:
        return ("Inputs kept for the backward: no FP8 GEMM ran on the sample "
                "(every FP8 layer ran in the compute dtype, or none was called).")
    names = dict(zip((id(layer) for layer in layers), layer_names(layers)))
    by_layer = {}
    for entry in kept:
        by_layer.setdefault(id(entry.layer), []).append(entry)
    rows, only_fp8 = [], []
    total = 0
    for key, entries in by_layer.items():
        kept_calls = [e for e in entries if e.kept]
        if not kept_calls:
            only_fp8.append(names[key])
            continue
        nbytes = sum(e.nbytes for e in kept_calls)
        total += nbytes
        savers = sorted({saver for e in kept_calls for saver in e.kept_by})
        first = kept_calls[0]
        rows.append([names[key], f"{first.dtype} {'x'.join(str(d) for d in first.shape)}", f"{nbytes:,}",
                     _describe_savers(savers)])
    if not rows:
        return (f"Inputs kept for the backward: each of the {len(only_fp8)} FP8 layer(s) that ran FP8 "
                "keeps only its FP8 copy of its input.")
    text = ("Inputs kept for the backward in the compute dtype by other layers too, so that the FP8 copy "
            f"saves no memory there ({len(rows)} FP8 layer(s), {total:,} bytes on this sample):\n"
            + _format_table(["layer", "input", "bytes", "also saved by: layer (op)"], rows))
    if only_fp8:
        text += f"\nKeeping only their FP8 copy ({len(only_fp8)}): " + ", ".join(only_fp8)
    return text


# Layers whose call is a matmul of their input and a weight (ReversibleEmbedding:
# its `reverse=True` call, the output projection of language models).
_MATMUL_LAYERS = tuple(
    cls for cls in (keras.layers.Dense, keras.layers.EinsumDense, getattr(keras.layers, "ReversibleEmbedding", None))
    if cls is not None
)


def float32_matmul_layers(model):
    """The layers of `model` that multiply in float32 while others compute in
    16 bits (under a mixed or FP8 policy): `Dense`, `EinsumDense` and
    `ReversibleEmbedding` layers whose compute dtype (or a
    `ReversibleEmbedding`'s `reverse_dtype`) is float32.

    Args:
        model: A Keras model or layer.

    Returns:
        The layers, in Keras's layer order; empty where no layer of `model`
        computes in 16 bits.
    """
    layers = compat.sublayers(model)
    if not any(layer.compute_dtype in ("bfloat16", "float16") for layer in layers):
        return []
    return [
        layer for layer in layers
        if isinstance(layer, _MATMUL_LAYERS)
        and "float32" in (layer.compute_dtype, getattr(layer, "reverse_dtype", None))
    ]


def _float32_matmul_note(model):
    """What `summary` says about `float32_matmul_layers`, where the backend
    runs them without tensor cores (torch, unless the user lowered its
    float32 matmul precision), else None."""
    if keras.backend.backend() != "torch":
        return None
    from keras_fp8.backends import torch_step

    if torch_step.float32_matmuls_use_tensor_cores():
        return None
    layers = float32_matmul_layers(model)
    if not layers:
        return None
    names = ", ".join(f"'{name}'" for name in layer_names(layers))
    return (
        f"Note: {len(layers)} layer(s) of {model.name!r} multiply in float32 outside the 16-bit policy: {names}. "
        "torch runs float32 matmuls without tensor cores unless asked (its float32 matmul precision is "
        "'highest'): on a GPU each takes several times as long as in bfloat16. "
        "`torch.set_float32_matmul_precision('high')` runs them in TF32, or give the layers a 16-bit dtype."
    )
