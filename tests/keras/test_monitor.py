"""FP8Monitor (keras_fp8.monitor), the probe, numerics.quantization_stats and
keras_fp8.summary."""

import csv
import math
import warnings

import keras
import numpy as np
import pytest

import keras_fp8
from keras_fp8 import backends
from keras_fp8 import inspection
from keras_fp8 import numerics
from keras_fp8.monitor import probe
from keras_fp8.monitor import statistics
from tests.support import numpy_reference as reference
from tests.support.backend_utils import real_fp8_gemm
from tests.support.backend_utils import to_numpy

# The monitor's logic is the same on every backend; what differs (the
# probe's autodiff, the compiled statistics: `probe_function`,
# `compile_function` in keras_fp8/monitor/<backend>_statistics.py) runs under
# JAX in the tests not marked with this (each JAX test compiles a probe and a
# training step).
torch_only = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="backend-agnostic monitor logic, tested once (under torch)")


def _stats_numpy(x, scale, fmt):
    """Independent NumPy statistics (tests/support/numpy_reference.py's quantize)."""
    x = np.asarray(x, np.float32)
    finite = np.isfinite(x)
    q = reference.quantize(x, scale, fmt)
    deq = reference.dequantize(q, scale)
    fmt_max = reference.FMT[fmt][1]
    n = max(finite.sum(), 1)
    with np.errstate(invalid="ignore", over="ignore"):
        saturation = (finite & (np.abs(x) * (np.float32(1) / np.float32(scale)) > fmt_max)).sum() / n
    underflow = (finite & (x != 0) & (q.astype(np.float32) == 0)).sum() / n
    xs, err = x[finite].astype(np.float64), (x - deq)[finite].astype(np.float64)
    return saturation, underflow, 10 * np.log10((xs**2).sum() / (err**2).sum())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantization_stats_matches_numpy(fmt):
    rng = np.random.default_rng(0)
    low = -12 if fmt == "e4m3" else -30
    x = (rng.standard_normal(4096) * np.exp(rng.uniform(low, 3, 4096))).astype(np.float32)
    x[:3] = [0.0, np.nan, np.inf]
    scale = np.float32(np.nanmax(np.abs(x[np.isfinite(x)])) / reference.FMT[fmt][1] / 8)  # saturates
    stats = {k: float(to_numpy(v)) for k, v in numerics.quantization_stats(x, scale, fmt).items()}
    saturation, underflow, sqnr = _stats_numpy(x, scale, fmt)
    assert stats["saturation"] == pytest.approx(saturation, abs=1e-7) and saturation > 0
    assert stats["underflow"] == pytest.approx(underflow, abs=1e-7) and underflow > 0
    assert stats["sqnr_db"] == pytest.approx(sqnr, abs=1e-3)
    assert stats["scale"] == pytest.approx(float(scale))
    assert not math.isfinite(stats["amax"])  # the NaN and inf elements


def test_quantization_stats_exact_tensor():
    stats = numerics.quantization_stats(np.array([0.5, -2.0, 0.0], np.float32), 1.0, "e4m3")
    assert float(to_numpy(stats["sqnr_db"])) == math.inf
    assert float(to_numpy(stats["saturation"])) == 0 and float(to_numpy(stats["underflow"])) == 0


def _data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 16)).astype("float32"), rng.integers(0, 4, n).astype("int32")


def _model(policy="fp8_hybrid", min_gemm_size=0):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras_fp8.layers.FP8Dense(32, activation="relu", name="up", min_gemm_size=min_gemm_size)(inputs)
    h = keras.ops.expand_dims(h, 1)
    h = keras_fp8.layers.FP8EinsumDense("abc,cd->abd", (1, 32), name="mix", min_gemm_size=min_gemm_size)(h)
    h = keras.ops.squeeze(h, 1)
    outputs = keras_fp8.layers.FP8Dense(4, name="head", min_gemm_size=min_gemm_size)(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_monitor_records_logs_and_csv(tmp_path):
    x, y = _data()
    model = _model()
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=2, probe=(x[:32], y[:32]), logs="all")
    csv_path = str(tmp_path / "log.csv")
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0,
                        callbacks=[monitor, keras.callbacks.CSVLogger(csv_path)])
    # 6 steps, monitored at 1, 3, 5: 3 layers x 3 roles each.
    assert sorted({r["step"] for r in monitor.records}) == [1, 3, 5]
    assert len(monitor.records) == 3 * 3 * 3
    assert monitor.layer_names == ["up", "mix", "head"]
    key = "fp8/head/grad/sqnr_db"
    assert len(history.history[key]) == 2 and np.isfinite(history.history[key]).all()
    # `logs="all"`: the summary values and every layer's.
    keys = [k for k in history.history if k.startswith("fp8/")]
    assert len(keys) == 4 + 3 * 3 * len(statistics.STATS)
    assert "fp8/sqnr_db_min" in keys and "fp8/nonfinite_layers" in keys and "fp8/mix/grad/nonfinite" in keys
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and float(rows[-1]["fp8/mix/input/saturation"]) >= 0
    for r in monitor.records:
        assert all(np.isfinite(r[k]) for k in ("amax", "scale", "saturation", "underflow")), r
        assert r["sqnr_db"] > 15 and r["nonfinite"] == 0, r
    steps, values = monitor.series("up", "kernel", "amax")
    assert steps.tolist() == [1, 3, 5] and (values > 0).all()
    assert "FP8 health at step 5 (3 layers)" in monitor.health_summary()


def test_probe_changes_no_variable_and_captures_the_output_gradient():
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    before = [to_numpy(v).copy() for v in model.variables]
    loss, calls = probe.run(model, x[:32], y[:32])
    assert [layer.name for layer, _, _ in calls] == ["up", "mix", "head"]
    assert all(np.array_equal(a, to_numpy(v)) for a, v in zip(before, model.variables))
    assert not any("_gemm_observer" in layer.__dict__ for layer in inspection.fp8_layers(model))
    # The head's output gradient of a mean cross-entropy: (softmax - onehot) / B.
    logits = to_numpy(model(x[:32], training=False))
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    expected = (p - np.eye(4)[y[:32]]) / 32
    _, head_x, head_g = calls[-1]
    np.testing.assert_allclose(to_numpy(head_g), expected, atol=2e-3)
    assert to_numpy(head_x).shape == (32, 32)
    assert float(to_numpy(loss)) > 0


@torch_only
def test_monitor_statistics_record_no_autograd_graph():
    # The kernels are parameters that require a gradient: statistics run with
    # autograd on would hold every intermediate until the table goes.
    x, y = _data()
    model = _model()
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=1, probe=(x[:32], y[:32]))
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    layers = [layer for layer in model.layers if hasattr(layer, "active_recipe")]
    states = [statistics.layer_state(layer) for layer in layers]
    assert all(state["kernel"].requires_grad for state in states)
    table = monitor._table(states, [None] * len(layers), [None] * len(layers))
    assert not table.requires_grad and table.grad_fn is None


@torch_only
def test_monitor_without_probe_reports_state_and_kernel():
    x, y = _data()
    model = _model()
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=1, logs=None)
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    assert not any(k.startswith("fp8/") for k in history.history)
    last = {(r["layer"], r["role"]): r for r in monitor.records if r["step"] == 3}
    assert np.isfinite(last[("up", "kernel")]["sqnr_db"])
    assert math.isnan(last[("up", "input")]["saturation"]) and last[("up", "input")]["amax"] > 0
    assert last[("head", "grad")]["amax"] > 0
    assert "amax and scales only" not in monitor.health_summary()  # kernel stats exist


def test_monitor_logs_the_summary_by_default():
    # A progress bar shows every log value: by default four, not every
    # layer's statistics; `logs="all"` adds those.
    x, y = _data()
    model = _model()
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=2, probe=(x[:32], y[:32]))
    assert monitor.logs == "summary"
    batch_logs = []
    recorder = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs)))
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor, recorder])
    summary = ["fp8/nonfinite_layers", "fp8/saturation_max", "fp8/sqnr_db_min", "fp8/underflow_max"]
    assert sorted(k for k in history.history if k.startswith("fp8/")) == summary
    assert sorted(k for k in batch_logs[0] if k.startswith("fp8/")) == summary
    assert not any(k.startswith("fp8/") for k in batch_logs[1])  # step 2 is not monitored
    latest = [r for r in monitor.records if r["step"] == 3]
    assert history.history["fp8/sqnr_db_min"][0] == min(r["sqnr_db"] for r in latest)
    assert history.history["fp8/saturation_max"][0] == max(r["saturation"] for r in latest)
    assert history.history["fp8/nonfinite_layers"][0] == 0
    with pytest.raises(ValueError, match="logs"):
        keras_fp8.callbacks.FP8Monitor(logs="some")


@torch_only
def test_monitor_warns_once_naming_the_layer():
    x, y = _data()
    model = _model()
    # Trained on unit-scale data, probed with inputs 1000x larger: the input
    # scales (delayed scaling) saturate most of the probe.
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=1, probe=(1000 * x[:32], y[:32]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    messages = [str(w.message) for w in caught if "FP8Monitor" in str(w.message)]
    assert any("layer 'up' (input)" in m and "saturate" in m for m in messages), messages
    assert sum("layer 'up' (input)" in m and "saturate" in m for m in messages) == 1
    assert monitor.warnings and "warning(s)" in monitor.health_summary()


@torch_only
def test_monitor_bad_arguments():
    with pytest.raises(ValueError, match="every_n_steps"):
        keras_fp8.callbacks.FP8Monitor(every_n_steps=0)
    with pytest.raises(ValueError, match="saturation_threshold"):
        keras_fp8.callbacks.FP8Monitor(saturation_threshold=2)
    with pytest.raises(ValueError, match="probe"):
        keras_fp8.callbacks.FP8Monitor(probe=(1, 2, 3, 4))
    model = _model()
    monitor = keras_fp8.callbacks.FP8Monitor(layers=["nope"])
    with pytest.raises(ValueError, match="no FP8 layer named"):
        monitor.measure(model)


def _observers(model):
    return [layer.name for layer in inspection.fp8_layers(model) if "_gemm_observer" in layer.__dict__]


def test_monitor_lives_in_its_own_package():
    # The backends know nothing of the monitor; the layers' one hook for it
    # is `observe_gemms`; the old public names still reach it.
    import keras_fp8.probe
    from keras_fp8.layers import fp8_state

    for name in ("probe_function", "compile_function", "tensor_stats_function"):
        assert not hasattr(backends.get(), name), name
        assert hasattr(statistics.backend_functions(), name), name
    assert not hasattr(fp8_state, "probe")
    assert keras_fp8.callbacks.FP8Monitor is keras_fp8.monitor.FP8Monitor
    assert keras_fp8.probe.Probe is keras_fp8.monitor.Probe and keras_fp8.probe.run is probe.run


def test_probe_observes_the_watched_layers_while_it_runs():
    x, y = _data()
    model = _model()
    up = model.get_layer("up")
    seen = []
    with probe.capturing([up], lambda key, out: seen.append(key) or out):
        assert _observers(model) == ["up"]
        with pytest.raises(RuntimeError, match="'up' has a GEMM observer already"):
            up.observe_gemms(lambda layer, a, b: b)
        model(x[:8], training=False)
    assert seen == [0] and _observers(model) == []
    _, calls = probe.Probe(model, layers=[up])(x[:32], y[:32])
    assert [layer.name for layer, _, _ in calls] == ["up"] and calls[0][2] is not None
    assert _observers(model) == []


def _nan_batch_fit(monitor, logs=None):
    x, y = _data()
    x[40, 3] = np.nan  # in the second batch
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False, callbacks=[monitor])
    return history, [str(w.message) for w in caught if "FP8Monitor" in str(w.message)]


def test_monitor_counts_names_and_warns_about_non_finite_values():
    # A NaN in one batch turns the loss, the gradients and (through the
    # optimizer) the kernels NaN: the monitor must not call the model healthy.
    x, y = _data()
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=1, probe=(x[:32], y[:32]))
    history, messages = _nan_batch_fit(monitor)
    assert not np.isfinite(history.history["loss"][0])
    first = [r for r in monitor.records if r["step"] == 1]
    assert all(r["nonfinite"] == 0 for r in first)  # before the NaN batch
    last = {(r["layer"], r["role"]): r for r in monitor.records if r["step"] == 3}
    for name in ("up", "mix", "head"):
        assert last[(name, "kernel")]["nonfinite"] > 0 and not np.isfinite(last[(name, "kernel")]["amax"])
    assert last[("head", "input")]["nonfinite"] == 32 * 32
    summary = monitor.health_summary()
    assert "NON-FINITE values in 3 layer(s): up (kernel: " in summary, summary
    assert "mix (" in summary and "head (input: 1024 non-finite elements" in summary, summary
    nonfinite = [m for m in messages if "non-finite values" in m]
    assert len(nonfinite) == 1 and "at step 2" in nonfinite[0] and "'up' (" in nonfinite[0], messages
    assert history.history["fp8/nonfinite_layers"] == [3.0]


@torch_only
def test_monitor_names_a_non_finite_scale_or_kernel_without_a_probe():
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.get_layer("up").input_scale.assign(float("nan"))
    kernel = to_numpy(model.get_layer("head").kernel).copy()
    kernel[0, 0] = np.inf
    model.get_layer("head").kernel.assign(kernel)
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=1)
    with pytest.warns(UserWarning, match="non-finite values at step 0 in 2 layer"):
        monitor.measure(model)
    summary = monitor.health_summary()
    assert "up (input scale nan)" in summary and "head (kernel: 1 non-finite elements, kernel amax inf)" in summary
    assert math.isnan(monitor.latest["fp8/up/input/nonfinite"])  # no probe: the input is not measured
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.measure(model)
    assert not [w for w in caught if "non-finite" in str(w.message)]  # warned once
    assert sum("non-finite" in m for m in monitor.warnings) == 1


def _labels_free_model():
    """A model whose loss needs no labels (a custom `compute_loss`)."""

    class Reconstruction(keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return keras.ops.mean(keras.ops.square(keras.ops.cast(y_pred, "float32") - x))

    keras.mixed_precision.set_global_policy("fp8_hybrid")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras_fp8.layers.FP8Dense(32, activation="relu", name="up", min_gemm_size=0)(inputs)
    model = Reconstruction(inputs, keras_fp8.layers.FP8Dense(16, name="head", min_gemm_size=0)(h))
    model.compile(optimizer="adam")
    return model


def test_monitor_probe_of_x_alone():
    x, y = _data()
    for form in (x[:32], (x[:32],)):
        assert [type(part) for part in probe.check_batch(form)] == [np.ndarray, type(None), type(None)]
    # A loss without labels: the whole probe, gradients included.
    model = _labels_free_model()
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=2, probe=x[:32])
    model.fit(x, batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    last = {(r["layer"], r["role"]): r for r in monitor.records if r["step"] == 3}
    assert np.isfinite(last[("up", "input")]["sqnr_db"]) and np.isfinite(last[("head", "grad")]["sqnr_db"])
    assert not monitor.warnings
    # A compiled loss needs labels: the inputs are measured, the gradient rows
    # hold the state, and one warning says so.
    model = _model()
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=2, probe=(x[:32],))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    last = {(r["layer"], r["role"]): r for r in monitor.records if r["step"] == 3}
    assert np.isfinite(last[("mix", "input")]["sqnr_db"]) and math.isnan(last[("head", "grad")]["sqnr_db"])
    assert last[("head", "grad")]["amax"] > 0
    assert sum("`probe` has no labels" in str(w.message) for w in caught) == 1
    assert _observers(model) == []


def test_monitor_refuses_a_bad_probe_naming_it():
    x, y = _data()
    with pytest.raises(ValueError, match=r"Invalid `probe`. Expected a batch of at least one example. "
                                         r"Received: x of shape \(0, 16\)"):
        keras_fp8.callbacks.FP8Monitor(probe=(x[:0], y[:0]))
    with pytest.raises(ValueError, match=r"Invalid `probe`. Expected x, y and sample_weight with the same number "
                                         r"of examples .* x of shape \(32, 16\), y of shape \(16,\)"):
        keras_fp8.callbacks.FP8Monitor(probe=(x[:32], y[:16]))
    with pytest.raises(ValueError, match="Invalid `probe`.* x=None"):
        keras_fp8.callbacks.FP8Monitor(probe=(None, y[:32]))
    with pytest.raises(ValueError, match="Invalid `probe`.* a batch dimension"):
        keras_fp8.callbacks.FP8Monitor(probe=(1.0, 2.0))
    # Labels the loss cannot take (one class too few): named at first use.
    model = _model()
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=1, probe=(x[:32], np.eye(3, dtype="float32")[y[:32] % 3]))
    model.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"Invalid `probe`: the model's loss failed on it.*y \(32, 3\).*"
                                         r"the model's output \(32, 4\)"):
        model.fit(x, np.eye(4, dtype="float32")[y], batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    assert _observers(model) == []


@torch_only
def test_monitor_plot(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    x, y = _data()
    model = _model()
    monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=1, probe=(x[:32], y[:32]))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor])
    path = tmp_path / "monitor.png"
    fig = monitor.plot(path=str(path))
    assert path.stat().st_size > 10_000
    assert len(fig.axes) == 15


@torch_only
def test_summary_table():
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    lines = []
    keras_fp8.summary(model, print_fn=lines.append)
    table = lines[0]
    for name in ("up", "mix", "head"):
        assert f"\n{name} " in table
    assert "delayed hybrid h=1024" in table and "32x16x32" in table and " FP8 " in table

    big = _model(min_gemm_size=10**9)
    big.fit(x, y, batch_size=32, epochs=1, verbose=0)
    lines = []
    keras_fp8.summary(big, print_fn=lines.append)
    assert "bfloat16 (< min_gemm_size)" in lines[0] and "1,000,000,000" in lines[0]

    keras.mixed_precision.set_global_policy("float32")
    plain = keras.Sequential([keras.Input((4,)), keras_fp8.layers.FP8Dense(2)])
    lines = []
    keras_fp8.summary(plain, print_fn=lines.append)
    assert "float32 (FP8 off)" in lines[0] and "not called" not in lines[0]


def test_layers_say_what_they_run():
    keras.mixed_precision.set_global_policy("float32")
    layer = keras_fp8.layers.FP8Dense(2)
    keras.Sequential([keras.Input((4,)), layer])
    assert layer.active_recipe() is None  # FP8 off under a float policy
    assert isinstance(layer.active_recipe(or_built=True), keras_fp8.DelayedScaling)
    assert layer.fp8_execution()[0] == "float32 (FP8 off)"
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    layer = keras_fp8.layers.FP8Dense(2, min_gemm_size=0)
    model = keras.Sequential([keras.Input((4,)), layer])
    assert layer.fp8_execution()[0] == "not called"
    model(np.ones((3, 4), "float32"))
    assert layer.fp8_execution() == ("FP8", (3, 4, 2), 0)
    assert layer.active_recipe() == keras_fp8.DelayedScaling()
    with pytest.raises(TypeError, match="or_built: expected a bool, got 'yes'"):
        layer.active_recipe(or_built="yes")


def _stats_cases(device):
    """Fresh random tensors (never zeros), ragged and aligned, tiny and huge
    magnitudes, with scales that saturate, fit and flush to zero, some with
    non-finite elements."""
    import torch

    shapes = [(37, 53), (256, 64)] + ([(4099, 4097)] if device == "cuda" else [])
    rng = np.random.default_rng(11)
    for i, shape in enumerate(shapes):
        for fmt, magnitude in (("e4m3", 1e3), ("e5m2", 1e-6)):
            for dtype in (torch.bfloat16, torch.float32):
                x = rng.standard_normal(shape).astype(np.float32) * magnitude
                if i == 0:
                    x[0, 0], x[1, 2] = np.nan, -np.inf
                x = torch.tensor(x, device=device).to(dtype)
                amax = float(x.float().nan_to_num(0, 0, 0).abs().max())
                fmt_max = reference.FMT[fmt][1]
                for scale in (amax / fmt_max * 0.25, amax / fmt_max, amax * 1e3):
                    yield x, torch.tensor(scale, dtype=torch.float32, device=device), fmt


@torch_only
def test_monitor_compiled_statistics_match_eager():
    # On torch the monitor compiles the statistics of large GPU tensors; the
    # compiled function is checked here on this machine's device (the CPU in CI).
    import torch

    from keras_fp8.monitor import torch_statistics

    device = "cuda" if torch.cuda.is_available() else "cpu"
    run = torch_statistics._compiled_tensor_stats
    kernel = torch.nn.Parameter(torch.randn(48, 80, device=device))
    with torch.no_grad():
        cases = list(_stats_cases(device)) + [(kernel, torch.tensor(0.01, device=device), "e4m3")]
        for x, scale, fmt in cases:
            want = statistics.tensor_stats(x, scale, fmt)
            got = run(x, scale, fmt)
            for key in statistics.STATS:
                # float32 sums in another order; a dB value's error is absolute.
                np.testing.assert_allclose(
                    float(got[key]), float(want[key]), rtol=1e-5, atol=1e-4 if key == "sqnr_db" else 0,
                    err_msg=f"{key}: {tuple(x.shape)} {x.dtype} {fmt} scale {float(scale):g}")
    assert torch_statistics._stats_compile_failure is None


@torch_only
def test_monitor_compiled_statistics_bypass_the_fx_graph_cache(monkeypatch):
    # Inductor splits a reduction according to the sizes it compiles for and
    # its FX graph cache key leaves them out: an entry cached for a small
    # tensor (as here) would run a later process's large tensors unsplit.
    import torch
    from torch._dynamo.utils import counters

    from keras_fp8.monitor import torch_statistics

    monkeypatch.setattr(torch_statistics, "_compiled_stats", None)
    monkeypatch.setattr(torch_statistics, "_stats_compile_failure", None)
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inductor, aot = dict(counters["inductor"]), dict(counters["aot_autograd"])
    x = torch.tensor(np.random.default_rng(7).standard_normal((40, 56)).astype(np.float32), device=device)
    torch_statistics._compiled_tensor_stats(x, torch.tensor(0.01, device=device), "e5m2")
    assert torch_statistics._stats_compile_failure is None
    for key in ("fxgraph_cache_hit", "fxgraph_cache_miss"):
        assert counters["inductor"][key] == inductor.get(key, 0), key
    assert counters["aot_autograd"]["autograd_cache_bypass"] > aot.get("autograd_cache_bypass", 0)


@torch_only
def test_monitor_compiles_with_correctly_rounded_division():
    # Triton's float32 division is approximate; the statistics' reciprocal
    # must round as eager's does (an element at the format's edge otherwise
    # flips its saturation on a GPU).
    from keras_fp8.monitor import torch_statistics

    assert torch_statistics._eager_division(), "this torch has no inductor option for correctly rounded division"


@torch_only
def test_monitor_compile_failure_warns_once_and_runs_eagerly(monkeypatch):
    import torch

    from keras_fp8.monitor import torch_statistics

    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("no compiler here\nsecond line")

    monkeypatch.setattr(torch_statistics, "_compiled_stats", broken)
    monkeypatch.setattr(torch_statistics, "_stats_compile_failure", None)
    x = torch.tensor(np.random.default_rng(3).standard_normal((40, 24)).astype(np.float32))
    scale = torch.tensor(0.01)
    want = statistics.tensor_stats(x, scale, "e4m3")
    with pytest.warns(UserWarning, match="torch.compile of the statistics failed.*RuntimeError: no compiler here$"):
        got = torch_statistics._compiled_tensor_stats(x, scale, "e4m3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = torch_statistics._compiled_tensor_stats(x, scale, "e4m3")
    assert len(calls) == 1
    for key in want:
        assert float(got[key]) == float(want[key]) == float(again[key])


@torch_only
def test_monitor_table_compiles_in_its_first_run_only(monkeypatch):
    # A measurement in the middle of training must not stop for a
    # compilation: after a table's first run, what would need one runs eagerly.
    import torch
    from torch._dynamo.utils import counters

    from keras_fp8.monitor import torch_statistics

    monkeypatch.setattr(torch_statistics, "_tensor_stats", torch_statistics._compiled_tensor_stats)  # any device
    monkeypatch.setattr(torch_statistics, "_compiled_stats", None)
    monkeypatch.setattr(torch_statistics, "_stats_compile_failure", None)
    torch._dynamo.reset()
    stats = torch_statistics.tensor_stats_function()
    scale = torch.tensor(0.01)
    table = torch_statistics.compile_function(lambda x, fmt: stats(x, scale, fmt))
    x = torch.tensor(np.random.default_rng(5).standard_normal((48, 40)).astype(np.float32))
    graphs = counters["stats"]["unique_graphs"]
    table(x, "e4m3")
    assert counters["stats"]["unique_graphs"] > graphs
    graphs = counters["stats"]["unique_graphs"]
    got = table(x, "e5m2")  # another format would compile again
    assert counters["stats"]["unique_graphs"] == graphs
    want = statistics.tensor_stats(x, scale, "e5m2")
    for key in want:
        assert float(got[key]) == float(want[key]), key
    table(x, "e4m3")  # the first run's code still serves
    assert counters["stats"]["unique_graphs"] == graphs


@torch_only
@pytest.mark.skipif(not real_fp8_gemm(), reason="needs an FP8 GPU (torch_ops kernels)")
def test_monitor_compiles_the_statistics_of_large_gpu_tensors_only(monkeypatch):
    import torch

    from keras_fp8.monitor import torch_statistics

    compiled = []
    monkeypatch.setattr(torch_statistics, "_compiled_tensor_stats", lambda x, scale, fmt: compiled.append(x.shape))
    stats = torch_statistics.tensor_stats_function()
    scale = torch.tensor(0.01, device="cuda")
    large = 1 + torch_statistics.STATS_COMPILE_MIN_ELEMENTS // 4096
    for shape in ((64, 48), (large, 4096)):
        stats(torch.randn(shape, device="cuda", dtype=torch.bfloat16), scale, "e4m3")
    stats(torch.randn(large, 4096, dtype=torch.bfloat16), scale.cpu(), "e4m3")
    assert compiled == [(large, 4096)]
