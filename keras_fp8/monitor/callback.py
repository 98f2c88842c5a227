"""`FP8Monitor`, the Keras callback that watches FP8 training."""

import warnings

import keras
import numpy as np
from keras import ops

from keras_fp8 import inspection
from keras_fp8.layers.fp8_state import ROLES
from keras_fp8.monitor import health
from keras_fp8.monitor import plot as plot_lib
from keras_fp8.monitor import probe as probe_lib
from keras_fp8.monitor import statistics

STATS = statistics.STATS
# What `plot` draws by default: the quantization statistics.
PLOT_STATS = ("amax", "scale", "saturation", "underflow", "sqnr_db")
LOG_MODES = ("summary", "all", None)


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
    - `sqnr_db`: the signal-to-quantization-noise ratio, in dB;
    - `nonfinite`: the number of NaN and inf elements of the tensor (which
      the fractions and the SQNR leave out).

    The statistics are `keras_fp8.numerics.quantization_stats`, the layers'
    own quantization rule. The kernel is always at hand. The input and the
    output gradient exist only inside a training step, so with `probe=` a
    batch, the monitor runs a probe on it at each monitored step: a forward
    pass with `training=False` and the gradient of the compiled loss, which
    changes no variable (`keras_fp8.monitor.Probe`). Without a probe batch
    the input and gradient rows hold the amax the layer last recorded and
    the scale, and NaN for the rest.

    By default (`logs="summary"`) four values go into `logs`:
    `fp8/saturation_max`, `fp8/underflow_max`, `fp8/sqnr_db_min` over every
    layer and role, and `fp8/nonfinite_layers` (the batch logs of each
    monitored step, and the latest values into each epoch's logs), so a
    progress bar, `History`, `CSVLogger` and `TensorBoard` show them.
    `logs="all"` adds every layer's values as `fp8/<layer>/<role>/<stat>`.
    `records` keeps every value in memory, `series()` returns one curve,
    `plot()` draws them and `health_summary()` says it in one line. When a
    role's saturation or underflow passes its threshold, a warning names
    the layer, once per layer and role; the first non-finite value (a NaN
    or inf amax, scale, kernel element, input or gradient) gets one warning
    naming the layers, and `health_summary()` names them at every step that
    has them.

    Steps the monitor does not monitor cost one counter increment, and
    without a probe running the layers hold nothing of it (one attribute
    read per eager FP8 call; none in compiled steps). A monitored step
    costs a forward and backward pass on the probe batch, run eagerly
    (docs/monitor.md).

    Args:
        every_n_steps: Monitor every this many training steps (>= 1).
        probe: Optional batch `x`, `(x, y)` or `(x, y, sample_weight)`, as
            the model's `train_step` takes it (after any preprocessing),
            with at least one example. A batch of the training batch size
            gives representative gradients (the compiled loss is a mean over
            the batch). `x` alone on a model compiled with a `loss` (which
            needs labels) measures the inputs only, with a one-time warning.
        saturation_threshold: The saturated fraction past which a layer and
            role get a warning.
        underflow_threshold: The underflowing fraction past which a layer
            and role get a warning.
        logs: What goes into `logs`: `"summary"` (the four values above),
            `"all"` (those and every layer's values) or None.
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
        logs="summary",
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
        self._probe_batch = None if probe is None else probe_lib.check_batch(probe)
        self._probe_tensors = None
        self._probe = None
        self._table = None
        self._table_key = None
        self.step = 0
        self.records = []
        self.latest = {}
        self._latest_records = []
        self.warnings = []
        self._warned = set()
        self._layers = None
        self._names = None
        self._epoch = 0

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
            logs.update(self._for_logs(values, self._latest_records))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self._for_logs(self.latest, self._latest_records))

    def _for_logs(self, values, records):
        if self.logs is None:
            return {}
        logs = health.summary_logs(records)
        if self.logs == "all":
            logs.update(values)
        return logs

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
            self.latest, self._latest_records = {}, []
            return {}
        captured = self._run_probe(model, [layer for _, layer in built]) if self._probe_batch is not None else {}
        layer_recipes = tuple(layer.active_recipe(or_built=True) for _, layer in built)
        if self._table_key != layer_recipes:
            self._table_key = layer_recipes
            functions = statistics.backend_functions()
            self._table = functions.compile_function(
                statistics.stats_table(layer_recipes, functions.tensor_stats_function()))
        states = [statistics.layer_state(layer) for _, layer in built]
        inputs = [statistics.joined(captured.get(id(layer), {}).get("input")) for _, layer in built]
        grads = [statistics.joined(captured.get(id(layer), {}).get("grad")) for _, layer in built]
        # One function (compiled under JAX) and one transfer to the host.
        table = ops.convert_to_numpy(self._table(states, inputs, grads)).astype(np.float64)
        thresholds = {"saturation": self.saturation_threshold, "underflow": self.underflow_threshold}
        values, records, messages = {}, [], []
        for i, (name, _) in enumerate(built):
            for j, role in enumerate(ROLES):
                record = {"step": self.step, "epoch": self._epoch, "layer": name, "role": role}
                record.update({k: float(v) for k, v in zip(STATS, table[i, j])})
                records.append(record)
                for k in STATS:
                    values[f"fp8/{name}/{role}/{k}"] = record[k]
                messages += health.threshold_messages(record, thresholds, self._warned)
        findings = health.nonfinite_findings(records)
        if findings and "nonfinite" not in self._warned:
            self._warned.add("nonfinite")
            messages.append(health.nonfinite_message(self.step, findings))
        self.records += records
        self.latest, self._latest_records = dict(values), records
        self._warn(messages)
        return values

    def _warn(self, messages):
        for message in messages:
            self.warnings.append(message)
            warnings.warn(message, stacklevel=2)

    def _run_probe(self, model, layers):
        if self._probe_tensors is None:
            self._probe_tensors = keras.tree.map_structure(
                lambda t: t if t is None else ops.convert_to_tensor(t), self._probe_batch)
        x, y, sample_weight = self._probe_tensors
        if self._probe is None or self._probe.model is not model or self._probe.layers != layers:
            self._probe = probe_lib.Probe(model, layers)
            if y is None and probe_lib.loss_needs_labels(model) and "labels" not in self._warned:
                self._warned.add("labels")
                self._warn([
                    "FP8Monitor: `probe` has no labels (y) and the model's compiled loss needs them: the probe "
                    "measures the layers' inputs only, and the gradient rows hold the state's amax and scale. "
                    "Pass probe=(x, y) to measure the output gradients too."])
        _, calls = self._probe(x, y, sample_weight)
        captured = {}
        for layer, x2d, g2d in calls:
            entry = captured.setdefault(id(layer), {"input": [], "grad": []})
            entry["input"].append(x2d)
            if g2d is not None:
                entry["grad"].append(g2d)
        return captured

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
        """One line: the layers with non-finite values (named, with what is
        non-finite), the worst saturation, underflow and SQNR of the latest
        monitored step, and the warnings so far."""
        return health.summary(self.records, self.warnings)

    def plot(self, stats=PLOT_STATS, roles=ROLES, layers=None, path=None):
        """Draws the curves: one panel per statistic and role, one line per
        layer. Needs matplotlib (`pip install "keras-fp8[plot]"`).

        Args:
            stats: The statistics to draw (rows; `nonfinite` too on request).
            roles: The roles to draw (columns).
            layers: The layers to draw (default: all watched).
            path: Optional file to save the figure to.

        Returns:
            The matplotlib `Figure`.
        """
        return plot_lib.plot(self, stats, roles, layers, path)
