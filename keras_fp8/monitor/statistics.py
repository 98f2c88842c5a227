"""The monitor's statistics: one table per measurement, every layer and role.

`tensor_stats` is what the monitor reports of one tensor:
`numerics.quantization_stats` (the layers' own quantization rule) and the
number of its non-finite elements. `stats_table` builds the function that
computes them for every watched layer and role (`input`, `kernel`, `grad`)
at once, from the layers' state (`layer_state`) and the tensors a probe
captured; the running backend's module (`backend_functions`:
`torch_statistics`, `jax_statistics`) says how that function runs.
"""

import importlib

import keras
from keras import ops

from keras_fp8 import compat
from keras_fp8 import numerics
from keras_fp8 import recipes

# The statistics of each layer and role, in the table's order.
STATS = ("amax", "scale", "saturation", "underflow", "sqnr_db", "nonfinite")
# The backends with a statistics module (`keras_fp8/monitor/<name>_statistics.py`).
_BACKENDS = ("jax", "torch")
_PER_TENSOR = (recipes.DelayedScaling, recipes.CurrentScaling)
_STATE_NAMES = ("input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history", "grad_scale",
                "grad_amax_history", "grad_amax_pending", "grad_fold_state")


def backend_functions():
    """The running Keras backend's statistics module: `probe_function`,
    `compile_function` and `tensor_stats_function` (see
    `keras_fp8/monitor/torch_statistics.py`, `jax_statistics.py`)."""
    name = keras.backend.backend()
    if name not in _BACKENDS:
        raise NotImplementedError(
            f"FP8Monitor supports the Keras backends {list(_BACKENDS)}; the current backend is {name!r}.")
    return importlib.import_module(f"keras_fp8.monitor.{name}_statistics")


def count_nonfinite(x):
    """The number of NaN and inf elements of `x`, a float32 scalar."""
    return ops.sum(ops.cast(ops.logical_not(ops.isfinite(x)), "float32"))


def tensor_stats(x, scale, fmt):
    """`numerics.quantization_stats(x, scale, fmt)` and `nonfinite`, the
    number of NaN and inf elements of `x` (which the fractions and the SQNR
    leave out)."""
    stats = numerics.quantization_stats(x, scale, fmt)
    stats["nonfinite"] = count_nonfinite(ops.cast(x, "float32"))
    return stats


def joined(tensors):
    """The tensors of a layer's GEMM calls as one (a layer called twice has
    two inputs and two gradients); None for none."""
    if not tensors:
        return None
    return tensors[0] if len(tensors) == 1 else ops.concatenate(tensors, axis=0)


def layer_state(layer):
    """The values the statistics of one layer read: its FP8 state and its kernel."""
    state = {name: compat.raw_value(getattr(layer, name)) for name in _STATE_NAMES}
    state["kernel"] = compat.raw_value(layer.fp8_kernel())
    return state


def _not_measured(amax, scale, x):
    """The row of a role whose quantization statistics do not apply (no
    tensor, or a block-scaled recipe): the amax and the scale, the tensor's
    non-finite count where there is a tensor, NaN for the rest."""
    nan = ops.convert_to_tensor(float("nan"), "float32")
    nonfinite = nan if x is None else count_nonfinite(ops.cast(x, "float32"))
    return {"amax": amax, "scale": scale, "saturation": nan, "underflow": nan, "sqnr_db": nan,
            "nonfinite": nonfinite}


def _forward_stats(recipe, state, role, x, stats_fn):
    history, scale = state[f"{role}_amax_history"], state[f"{role}_scale"]
    if x is None or not isinstance(recipe, _PER_TENSOR):
        return _not_measured(history[0], scale, x)
    fmt = recipe.forward_format
    scale_used, _, _ = numerics.operand_scale(numerics.compute_amax(x), history, scale, fmt, recipe, record=False)
    return stats_fn(x, scale_used, fmt)


def _grad_stats(recipe, state, grad, stats_fn):
    # The gradient state as the next training forward leaves it (the pending
    # amax folded): the scale is the one the next backward uses.
    fmt = recipe.backward_format
    pending = state["grad_amax_pending"]
    history, scale, _, _ = numerics.fold_pending_grad_amax(
        pending, state["grad_fold_state"], state["grad_amax_history"], state["grad_scale"], fmt, recipe)
    if grad is None or not isinstance(recipe, _PER_TENSOR):
        amax = ops.maximum(pending[0], history[0]) if grad is None else numerics.compute_amax(grad)
        return _not_measured(amax, scale, grad)
    grad_scale = numerics.backward_scale(numerics.compute_amax(grad), history, scale, fmt, recipe)
    return stats_fn(grad, grad_scale, fmt)


def stats_table(layer_recipes, stats_fn):
    """`table(states, inputs, grads)` -> `(layers, roles, stats)` float32,
    `STATS` of every layer (one recipe each in `layer_recipes`, one
    `layer_state` each in `states`) and role; `inputs` and `grads` hold each
    layer's captured tensor or None. `stats_fn` is `tensor_stats` as the
    backend runs it (`tensor_stats_function`)."""

    def table(states, inputs, grads):
        rows = []
        for recipe, state, x, grad in zip(layer_recipes, states, inputs, grads):
            per_role = (
                _forward_stats(recipe, state, "input", x, stats_fn),
                _forward_stats(recipe, state, "kernel", state["kernel"], stats_fn),
                _grad_stats(recipe, state, grad, stats_fn),
            )
            rows.append(ops.stack([ops.stack([ops.cast(stats[k], "float32") for k in STATS]) for stats in per_role]))
        return ops.stack(rows)

    return table
