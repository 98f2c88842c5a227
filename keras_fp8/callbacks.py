"""Keras callbacks: `FP8Monitor`, which watches FP8 training."""

import math
import warnings

import keras
import numpy as np
from keras import ops

from keras_fp8 import backends
from keras_fp8 import compat
from keras_fp8 import inspection
from keras_fp8 import numerics
from keras_fp8 import probe as probe_lib
from keras_fp8 import recipes
from keras_fp8.layers.fp8_state import ROLES

STATS = ("amax", "scale", "saturation", "underflow", "sqnr_db")
LOG_MODES = ("all", "summary", None)
_PER_TENSOR = (recipes.DelayedScaling, recipes.CurrentScaling)


class FP8Monitor(keras.callbacks.Callback):
    """Watches every FP8 layer while a model trains.

    At training steps 1, 1 + n, 1 + 2n, ... (`every_n_steps=n`, counted over
    every `fit` the monitor is passed to), it computes, per FP8 layer and per
    operand role (`input`, `kernel`, `grad`: the output gradient), with the
    scale that role's next quantization uses:

    - `amax`: the tensor's largest magnitude;
    - `scale`: the dequantization step;
    - `saturation`: the fraction of elements the clip changes (past the
      format's largest value);
    - `underflow`: the fraction of nonzero elements that quantize to zero;
    - `sqnr_db`: the signal-to-quantization-noise ratio, in dB.

    The statistics are `keras_fp8.numerics.quantization_stats`, the layers'
    own quantization rule. The kernel is always at hand. The input and the
    output gradient exist only inside a training step, so with `probe=` a
    batch, the monitor runs a probe on it at each monitored step: a forward
    pass with `training=False` and the gradient of the compiled loss, which
    changes no variable (`keras_fp8.probe`). Without a probe batch the input
    and gradient rows hold the amax the layer last recorded and the scale,
    and NaN for the rest.

    The values go into `logs` as `fp8/<layer>/<role>/<stat>` (the batch logs
    of each monitored step, and the latest values into each epoch's logs),
    so `History`, `CSVLogger` and `TensorBoard` record them (a progress bar
    shows them too: `logs="summary"` keeps it to three); `records` keeps
    every value in memory, `series()` returns one curve, `plot()` draws them
    and `health_summary()` says it in one line. When a role's saturation or
    underflow passes its threshold, a warning names the layer, once per layer
    and role.

    Steps the monitor does not monitor cost one counter increment, and
    without the monitor the layers hold nothing of it (one global read per
    eager FP8 call; none in compiled steps). A monitored step costs a
    forward and backward pass on the probe batch, run eagerly
    (docs/monitor.md).

    Args:
        every_n_steps: Monitor every this many training steps (>= 1).
        probe: Optional batch `x`, `(x, y)` or `(x, y, sample_weight)`, as
            the model's `train_step` takes it (after any preprocessing). A
            batch of the training batch size gives representative gradients
            (the compiled loss is a mean over the batch).
        saturation_threshold: The saturated fraction past which a layer and
            role get a warning.
        underflow_threshold: The underflowing fraction past which a layer
            and role get a warning.
        logs: What goes into `logs`: `"all"` (every value, as above),
            `"summary"` (three values: `fp8/saturation_max`,
            `fp8/underflow_max`, `fp8/sqnr_db_min` over every layer and
            role; readable in a progress bar) or None.
        layers: Optional names of the FP8 layers to watch (default: all).

    Example:

    >>> monitor = keras_fp8.callbacks.FP8Monitor(
    ...     every_n_steps=20, probe=(x_train[:64], y_train[:64]))
    >>> model.fit(x_train, y_train, batch_size=64, callbacks=[monitor])
    >>> print(monitor.health_summary())
    >>> monitor.plot()
    """

    def __init__(
        self,
        every_n_steps=50,
        probe=None,
        saturation_threshold=1e-2,
        underflow_threshold=1e-2,
        logs="all",
        layers=None,
    ):
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(
                "Invalid `every_n_steps`. Expected an integer >= 1. "
                f"Received: every_n_steps={every_n_steps!r}"
            )
        for name, value in (("saturation_threshold", saturation_threshold),
                            ("underflow_threshold", underflow_threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(
                    f"Invalid `{name}`. Expected a fraction from 0 to 1. "
                    f"Received: {name}={value!r}"
                )
        self.every_n_steps = every_n_steps
        self.saturation_threshold = float(saturation_threshold)
        self.underflow_threshold = float(underflow_threshold)
        if logs not in LOG_MODES:
            raise ValueError(
                f"Invalid `logs`. Expected one of {list(LOG_MODES)}. Received: logs={logs!r}")
        self.logs = logs
        self._layer_filter = None if layers is None else list(layers)
        self._probe_batch = self._unpack_probe(probe)
        self._probe_tensors = None
        self._probe = None
        self._table = None
        self._table_key = None
        self.step = 0
        self.records = []
        self.latest = {}
        self.warnings = []
        self._warned = set()
        self._layers = None
        self._names = None
        self._epoch = 0

    @staticmethod
    def _unpack_probe(probe):
        if probe is None:
            return None
        if isinstance(probe, tuple):
            if not 1 <= len(probe) <= 3:
                raise ValueError(
                    "Invalid `probe`. Expected x, (x, y) or (x, y, sample_weight). "
                    f"Received: a tuple of {len(probe)} elements"
                )
            return tuple(probe) + (None,) * (3 - len(probe))
        return (probe, None, None)

    # ------------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None):
        self._layers = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if (self.step - 1) % self.every_n_steps:
            return
        values = self.measure(self.model)
        if logs is not None:
            logs.update(self._for_logs(values))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self._for_logs(self.latest))

    def _for_logs(self, values):
        if self.logs == "all":
            return values
        if self.logs is None or not values:
            return {}
        summary = {}
        for stat, pick in (("saturation", max), ("underflow", max), ("sqnr_db", min)):
            found = [v for k, v in values.items() if k.endswith("/" + stat) and not math.isnan(v)]
            if found:
                summary[f"fp8/{stat}_{pick.__name__}"] = pick(found)
        return summary

    # ------------------------------------------------------------------ measuring
    def _watched(self, model):
        if self._layers is None:
            layers = inspection.fp8_layers(model)
            names = inspection.layer_names(layers)
            if self._layer_filter is not None:
                unknown = sorted(set(self._layer_filter) - set(names))
                if unknown:
                    raise ValueError(
                        f"FP8Monitor: no FP8 layer named {unknown} in the model. "
                        f"Its FP8 layers: {names}"
                    )
                kept = [(n, layer) for n, layer in zip(names, layers) if n in self._layer_filter]
                names, layers = [n for n, _ in kept], [layer for _, layer in kept]
            self._layers, self._names = layers, names
        return self._layers, self._names

    def measure(self, model):
        """Measures every watched layer now (at `self.step`), keeps the
        values in `records` and returns them as `{log key: value}`."""
        layers, names = self._watched(model)
        built = [(name, layer) for name, layer in zip(names, layers) if layer.built]
        if not built:
            self.latest = {}
            return {}
        captured = self._run_probe(model) if self._probe_batch is not None else {}
        layer_recipes = tuple(layer.active_recipe(or_built=True) for _, layer in built)
        if self._table_key != layer_recipes:
            self._table_key = layer_recipes
            backend = backends.get()
            self._table = backend.compile_function(_stats_table(layer_recipes, backend.tensor_stats_function()))
        states = [_state(layer) for _, layer in built]
        inputs = [_joined(captured.get(id(layer), {}).get("input")) for _, layer in built]
        grads = [_joined(captured.get(id(layer), {}).get("grad")) for _, layer in built]
        # One function (compiled under JAX) and one transfer to the host.
        table = ops.convert_to_numpy(self._table(states, inputs, grads)).astype(np.float64)
        values = {}
        for i, (name, _) in enumerate(built):
            for j, role in enumerate(ROLES):
                record = {"step": self.step, "epoch": self._epoch, "layer": name, "role": role}
                record.update({k: float(v) for k, v in zip(STATS, table[i, j])})
                self.records.append(record)
                for k in STATS:
                    values[f"fp8/{name}/{role}/{k}"] = record[k]
                self._check(record)
        self.latest = dict(values)
        return values

    def _run_probe(self, model):
        if self._probe_tensors is None:
            self._probe_tensors = keras.tree.map_structure(
                lambda t: t if t is None else ops.convert_to_tensor(t), self._probe_batch)
        if self._probe is None or self._probe.model is not model:
            self._probe = probe_lib.Probe(model)
        x, y, sample_weight = self._probe_tensors
        _, calls = self._probe(x, y, sample_weight)
        captured = {}
        for layer, x2d, g2d in calls:
            entry = captured.setdefault(id(layer), {"input": [], "grad": []})
            entry["input"].append(x2d)
            if g2d is not None:
                entry["grad"].append(g2d)
        return captured

    def _check(self, record):
        for stat, threshold, advice in (
            ("saturation", self.saturation_threshold,
             "the scale lags the tensor's growth; a margin (DelayedScaling(margin=1)), a shorter "
             "history or CurrentScaling() gives it headroom"),
            ("underflow", self.underflow_threshold,
             "the scale is large for most of the tensor (an outlier in the amax history?); a shorter "
             "history_len or amax_compute_algo='most_recent' lets it follow the tensor"),
        ):
            value = record[stat]
            key = (record["layer"], record["role"], stat)
            if math.isnan(value) or value <= threshold or key in self._warned:
                continue
            self._warned.add(key)
            message = (
                f"FP8Monitor: layer '{record['layer']}' ({record['role']}): {value:.2%} of the "
                f"elements {'saturate' if stat == 'saturation' else 'underflow to zero'} at step "
                f"{record['step']} (threshold {threshold:.2%}): {advice}."
            )
            self.warnings.append(message)
            warnings.warn(message, stacklevel=2)

    # ------------------------------------------------------------------ reading
    def series(self, layer, role, stat):
        """One curve: `(steps, values)` as NumPy arrays."""
        if stat not in STATS or role not in ROLES:
            raise ValueError(
                f"Invalid `role`/`stat`. Expected a role in {list(ROLES)} and a stat in {list(STATS)}. "
                f"Received: role={role!r}, stat={stat!r}"
            )
        rows = [r for r in self.records if r["layer"] == layer and r["role"] == role]
        return np.array([r["step"] for r in rows]), np.array([r[stat] for r in rows])

    @property
    def layer_names(self):
        """The watched layers' names, in model order."""
        seen = []
        for r in self.records:
            if r["layer"] not in seen:
                seen.append(r["layer"])
        return seen

    def health_summary(self):
        """One line: the worst saturation, underflow and SQNR of the latest
        monitored step, and the warnings so far."""
        if not self.records:
            return "FP8 health: nothing measured yet."
        step = self.records[-1]["step"]
        latest = [r for r in self.records if r["step"] == step]

        def worst(stat, pick):
            rows = [r for r in latest if not math.isnan(r[stat])]
            if not rows:
                return None
            row = pick(rows, key=lambda r: r[stat])
            return row[stat], f"{row['layer']}/{row['role']}"

        parts = []
        for label, stat, pick, fmt in (("saturation max", "saturation", max, "{:.2%}"),
                                       ("underflow max", "underflow", max, "{:.2%}"),
                                       ("SQNR min", "sqnr_db", min, "{:.1f} dB")):
            found = worst(stat, pick)
            if found is not None:
                parts.append(f"{label} {fmt.format(found[0])} ({found[1]})")
        n_layers = len({r["layer"] for r in latest})
        warned = f"{len(self.warnings)} warning(s)" if self.warnings else "no warnings"
        if not parts:
            parts.append("amax and scales only (no probe batch)")
        return f"FP8 health at step {step} ({n_layers} layers): " + ", ".join(parts) + f"; {warned}."

    def plot(self, stats=STATS, roles=ROLES, layers=None, path=None):
        """Draws the curves: one panel per statistic and role, one line per
        layer. Needs matplotlib (`pip install "keras-fp8[plot]"`).

        Args:
            stats: The statistics to draw (rows).
            roles: The roles to draw (columns).
            layers: The layers to draw (default: all watched).
            path: Optional file to save the figure to.

        Returns:
            The matplotlib `Figure`.
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as error:
            raise ImportError(
                "FP8Monitor.plot needs matplotlib: pip install \"keras-fp8[plot]\" (or matplotlib)."
            ) from error
        layers = self.layer_names if layers is None else list(layers)
        if not layers:
            raise ValueError("FP8Monitor.plot: no layer to draw (nothing measured yet, or `layers` is empty).")
        labels = {"amax": "amax", "scale": "scale", "saturation": "saturated (%)",
                  "underflow": "underflow (%)", "sqnr_db": "SQNR (dB)"}
        fig, axes = plt.subplots(len(stats), len(roles), figsize=(4.2 * len(roles), 2.3 * len(stats)),
                                 sharex=True, squeeze=False)
        for i, stat in enumerate(stats):
            for j, role in enumerate(roles):
                ax = axes[i][j]
                for name in layers:
                    steps, values = self.series(name, role, stat)
                    if stat in ("saturation", "underflow"):
                        values = 100 * values
                    ax.plot(steps, values, marker=".", markersize=3, linewidth=1, label=name)
                if stat in ("amax", "scale"):
                    ax.set_yscale("log")
                if i == 0:
                    ax.set_title(role)
                if j == 0:
                    ax.set_ylabel(labels[stat])
                if i == len(stats) - 1:
                    ax.set_xlabel("step")
                ax.grid(True, alpha=0.3)
        handles, names = axes[0][0].get_legend_handles_labels()
        # As many legend columns as the figure's width holds, the rows above the panels.
        width_chars = 14 * len(roles)
        columns = max(1, min(len(names), width_chars // (max(len(n) for n in names) + 6)))
        rows = -(-len(names) // columns)
        fig.legend(handles, names, loc="upper center", ncol=columns, frameon=False)
        height = fig.get_figheight()
        fig.tight_layout(rect=(0, 0, 1, 1 - (0.28 * rows + 0.15) / height))
        if path is not None:
            fig.savefig(path, dpi=110)
        return fig


def _joined(tensors):
    """The tensors of a layer's GEMM calls as one (a layer called twice has
    two inputs and two gradients); None for none."""
    if not tensors:
        return None
    return tensors[0] if len(tensors) == 1 else ops.concatenate(tensors, axis=0)


def _state(layer):
    """The values the statistics of one layer read."""
    names = ("input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history", "grad_scale",
             "grad_amax_history", "grad_amax_pending", "grad_fold_state")
    state = {name: compat.raw_value(getattr(layer, name)) for name in names}
    state["kernel"] = compat.raw_value(layer._kernel)
    return state


def _forward_stats(recipe, state, role, x, tensor_stats):
    history, scale = state[f"{role}_amax_history"], state[f"{role}_scale"]
    if x is None or not isinstance(recipe, _PER_TENSOR):
        nan = ops.convert_to_tensor(float("nan"), "float32")
        return {"amax": history[0], "scale": scale, "saturation": nan, "underflow": nan, "sqnr_db": nan}
    fmt = recipe.forward_format
    scale_used, _, _ = numerics.operand_scale(numerics.compute_amax(x), history, scale, fmt, recipe, record=False)
    return tensor_stats(x, scale_used, fmt)


def _grad_stats(recipe, state, grad, tensor_stats):
    # The gradient state as the next training forward leaves it (the pending
    # amax folded): the scale is the one the next backward uses.
    fmt = recipe.backward_format
    pending = state["grad_amax_pending"]
    history, scale, _, _ = numerics.fold_pending_grad_amax(
        pending, state["grad_fold_state"], state["grad_amax_history"], state["grad_scale"], fmt, recipe)
    if grad is None or not isinstance(recipe, _PER_TENSOR):
        nan = ops.convert_to_tensor(float("nan"), "float32")
        amax = ops.maximum(pending[0], history[0]) if grad is None else numerics.compute_amax(grad)
        return {"amax": amax, "scale": scale, "saturation": nan, "underflow": nan, "sqnr_db": nan}
    grad_scale = numerics.backward_scale(numerics.compute_amax(grad), history, scale, fmt, recipe)
    return tensor_stats(grad, grad_scale, fmt)


def _stats_table(layer_recipes, tensor_stats):
    """`table(states, inputs, grads)` -> `(layers, roles, stats)` float32;
    `tensor_stats` is `numerics.quantization_stats` as the backend runs it
    (`tensor_stats_function` in keras_fp8/backends/)."""

    def table(states, inputs, grads):
        rows = []
        for recipe, state, x, grad in zip(layer_recipes, states, inputs, grads):
            per_role = (
                _forward_stats(recipe, state, "input", x, tensor_stats),
                _forward_stats(recipe, state, "kernel", state["kernel"], tensor_stats),
                _grad_stats(recipe, state, grad, tensor_stats),
            )
            rows.append(ops.stack([ops.stack([ops.cast(stats[k], "float32") for k in STATS]) for stats in per_role]))
        return ops.stack(rows)

    return table
