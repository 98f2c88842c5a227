"""`keras_fp8.compile_optimizer`: the optimizer's update through
torch.compile, against Keras's eager update (tiny models, CPU).

| case | expected outcome |
|---|---|
| `model.fit`, AdamW (weight decay, one kernel excluded, the learning rate changed by a callback) and FP8AdamW (a warmup schedule), `backend="aot_eager"` | every weight and optimizer variable bit-identical to eager training; one graph (AdamW) or one per variable shape (FP8AdamW); no recompilation in the 2nd epoch |
| the same with torch.compile's default backend (inductor) | FP8 payloads identical; float32 values within 4 float32 ulps of each tensor's largest value (see `_assert_close`) |
| `fp8_hybrid_float16` (keras_fp8's LossScaleOptimizer around it), global gradient clipping, EMA | bit-identical to eager (aot_eager) |
| `model.compile(jit_compile=True)` with a compiled optimizer | the update traced with the step: the same graphs as without it |
| `.keras` round trip after compiled training | every variable restored; the loaded optimizer is Keras's own, compiled again on request |
| bad arguments, gradient accumulation, EMA overwrite frequency, JAX | clear errors naming the argument (JAX: XLA already compiles the step) |
"""

import keras
import numpy as np
import pytest

import keras_fp8
from keras_fp8 import compat

pytestmark = pytest.mark.usefixtures("fp8_at_every_size")
torch_only = pytest.mark.skipif(keras.backend.backend() != "torch",
                                reason="torch.compile: the torch backend's optimizer update")

FEATURES, BATCH, SAMPLES = 12, 8, 40  # 12 x 12 kernels: one full block of 128 moments and a shorter one


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(FEATURES, use_bias=False, activation="relu", name="first"),
        keras.layers.Dense(FEATURES, use_bias=False, name="second"),
    ], name="tiny")


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(SAMPLES, FEATURES)).astype("float32"),
            rng.normal(size=(SAMPLES, FEATURES)).astype("float32"))


def _optimizer(kind, model):
    if kind == "adamw":
        optimizer = keras.optimizers.AdamW(1e-2, weight_decay=0.1)
        optimizer.exclude_from_weight_decay(var_list=[model.get_layer("second").kernel])
        return optimizer
    schedule = keras.optimizers.schedules.CosineDecay(0.0, 10, warmup_target=1e-2, warmup_steps=3)
    return keras_fp8.optimizers.FP8AdamW(schedule, weight_decay=0.1)


def _fresh_dynamo():
    import torch

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _train(kind, compile_options=None, policy="fp8_hybrid", optimizer=None, **compile_kwargs):
    """Two epochs of `model.fit`; returns the model and dynamo's graph
    counts after each epoch (the second one must compile nothing)."""
    import torch
    from torch._dynamo.utils import counters

    keras.mixed_precision.set_global_policy(policy)
    model = _model()
    optimizer = optimizer or _optimizer(kind, model)
    if compile_options is not None:
        assert keras_fp8.compile_optimizer(optimizer, **compile_options) is optimizer
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    x, y = _data()
    # The learning-rate variable changes every epoch (AdamW; FP8AdamW's
    # schedule changes it every step): a graph input, not a constant.
    callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch: 1e-2 / (epoch + 1))] if kind == "adamw" else []
    graphs = []
    keras.Model.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    graphs.append(counters["stats"]["unique_graphs"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        keras.Model.fit(model, x, y, batch_size=BATCH, epochs=2, initial_epoch=1, shuffle=False, verbose=0,
                        callbacks=callbacks)
    graphs.append(counters["stats"]["unique_graphs"])
    return model, graphs


def _state(model):
    return {v.path: v.numpy() for v in model.weights + model.optimizer.variables}


@pytest.fixture(scope="module")
def eager_states():
    """Eagerly trained state per (optimizer, policy), computed on first use."""
    trained = {}

    def get(kind, policy="fp8_hybrid"):
        if (kind, policy) not in trained:
            model, _ = _train(kind, policy=policy)
            trained[kind, policy] = _state(model)
        return trained[kind, policy]

    yield get
    keras.mixed_precision.set_global_policy("float32")


def _assert_same_names(got, want):
    # Fresh models get fresh names: compare in creation order.
    assert len(got) == len(want)
    return zip(got.items(), want.values())


@torch_only
@pytest.mark.parametrize("kind", ["adamw", "fp8_adamw"])
def test_compiled_update_is_keras_update(eager_states, kind):
    want = eager_states(kind)
    _fresh_dynamo()
    model, graphs = _train(kind, {"backend": "aot_eager"})
    # AdamW: one graph for the whole update; FP8AdamW: one per variable
    # shape (both kernels are 12 x 12).
    assert graphs == [1, 1]
    assert compat.has_compiled_update(model.optimizer) == (kind == "adamw")
    for (path, got), expected in _assert_same_names(_state(model), want):
        np.testing.assert_array_equal(got, expected, err_msg=path)


def _assert_close(path, got, expected):
    """Compiled by inductor against eager: payloads (FP8 bytes, float16,
    counters) identical, float32 values within 4 float32 ulps of the
    tensor's largest magnitude. Why not exact: on a CPU, eager torch's
    vectorized `sqrt` is not correctly rounded on every element and its
    add-with-alpha (Keras's `m + (1 - beta_1) * g`) is a fused multiply-add,
    where inductor's C++ rounds `sqrt` correctly and the product and the sum
    separately: one float32 rounding apart in a step, which Adam's
    normalized update keeps at that scale from step to step."""
    if got.dtype != np.float32:
        np.testing.assert_array_equal(got, expected, err_msg=path)
        return
    ulp = np.spacing(np.max(np.abs(expected)).astype(np.float32))
    np.testing.assert_allclose(got, expected, rtol=0, atol=4 * ulp, err_msg=path)


@torch_only
@pytest.mark.parametrize("kind", ["adamw", "fp8_adamw"])
def test_compiled_update_with_inductor(eager_states, kind):
    want = eager_states(kind)
    _fresh_dynamo()
    model, graphs = _train(kind, {})  # torch.compile's defaults, as users get them
    assert graphs == [1, 1]
    for (path, got), expected in _assert_same_names(_state(model), want):
        _assert_close(path, got, expected)


@torch_only
def test_loss_scaling_clipping_and_ema():
    # fp8_hybrid_float16: `model.compile` wraps the compiled optimizer in
    # keras_fp8's LossScaleOptimizer, whose finite check stays eager.
    def optimizer():
        return keras.optimizers.AdamW(1e-2, global_clipnorm=0.5, use_ema=True)

    policy = "fp8_hybrid_float16"
    eager, _ = _train("clip_ema", policy=policy, optimizer=optimizer())
    _fresh_dynamo()
    model, graphs = _train("clip_ema", {"backend": "aot_eager"}, policy=policy, optimizer=optimizer())
    assert isinstance(model.optimizer, keras_fp8.optimizers.LossScaleOptimizer)
    assert compat.has_compiled_update(model.optimizer.inner_optimizer)
    assert graphs == [1, 1]
    for (path, got), expected in _assert_same_names(_state(model), _state(eager)):
        np.testing.assert_array_equal(got, expected, err_msg=path)


@torch_only
def test_jit_compile_traces_the_update_once(monkeypatch):
    import functools

    import torch
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    graphs = {}
    for compiled in (False, True):
        _fresh_dynamo()
        keras.mixed_precision.set_global_policy("float32")
        model = _model()
        optimizer = keras.optimizers.AdamW(1e-2)
        if compiled:
            keras_fp8.compile_optimizer(optimizer)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
        x, y = _data()
        keras.Model.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        graphs[compiled] = counters["stats"]["unique_graphs"]
    # Keras's step: the forward pass up to `loss.backward()`, then the
    # optimizer's update; the compiled optimizer adds no graph of its own.
    assert graphs[True] == graphs[False] == 2


@torch_only
def test_keras_file_round_trip(tmp_path):
    _fresh_dynamo()
    model, _ = _train("fp8_adamw", {"backend": "aot_eager"}, policy="float32")
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    for (name, got), expected in _assert_same_names(_state(loaded), _state(model)):
        np.testing.assert_array_equal(got, expected, err_msg=name)
    assert type(loaded.optimizer) is keras_fp8.optimizers.FP8AdamW
    assert "_update_variable" not in loaded.optimizer.__dict__  # a new optimizer: eager until compiled
    keras_fp8.compile_optimizer(loaded.optimizer, backend="aot_eager")
    x, y = _data()
    for trained in (model, loaded):
        keras.Model.fit(trained, x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for (name, got), expected in _assert_same_names(_state(loaded), _state(model)):
        np.testing.assert_array_equal(got, expected, err_msg=name)


@torch_only
def test_compile_optimizer_arguments():
    # Identifiers resolve; a LossScaleOptimizer is returned with its inner
    # optimizer compiled.
    adamw = keras_fp8.compile_optimizer("adamw")
    assert isinstance(adamw, keras.optimizers.AdamW) and compat.has_compiled_update(adamw)
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    assert keras_fp8.compile_optimizer(scaled) is scaled
    assert compat.has_compiled_update(scaled.inner_optimizer)

    import torch

    with pytest.raises(TypeError, match=r"`optimizer` must be a Keras optimizer .*got torch.optim.adamw.AdamW"):
        keras_fp8.compile_optimizer(torch.optim.AdamW([torch.zeros(2, requires_grad=True)]))
    with pytest.raises(TypeError, match=r"`optimizer` must be a Keras optimizer .*got builtins.int"):
        keras_fp8.compile_optimizer(3)
    with pytest.raises(TypeError, match=r"'fused' is not an argument of torch.compile; expected keyword arguments "
                                        r"among \[.*'backend'.*\], got \['fused'\]"):
        keras_fp8.compile_optimizer(keras.optimizers.Adam(), fused=True)
    with pytest.raises(ValueError, match=r"`gradient_accumulation_steps` is not supported \(AdamW has "
                                         r"gradient_accumulation_steps=4\).*Expected gradient_accumulation_steps=None"):
        keras_fp8.compile_optimizer(keras.optimizers.AdamW(gradient_accumulation_steps=4))
    with pytest.raises(ValueError, match=r"`ema_overwrite_frequency` is not supported"):
        keras_fp8.compile_optimizer(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(use_ema=True, ema_overwrite_frequency=10)))
    # Set after compiling: refused at the step, before anything changes.
    optimizer = keras_fp8.compile_optimizer(keras.optimizers.SGD(0.1))
    optimizer.gradient_accumulation_steps = 2
    variable = keras.Variable(np.ones(3, "float32"))
    with pytest.raises(ValueError, match="`gradient_accumulation_steps` is not supported"):
        optimizer.apply([keras.ops.ones(3)], [variable])
    np.testing.assert_array_equal(variable.numpy(), np.ones(3, "float32"))


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the error on a backend other than torch")
def test_compile_optimizer_on_jax_raises():
    with pytest.raises(NotImplementedError, match=r"the Keras backend is 'jax'\. On JAX, Keras compiles the whole "
                                                  r"train step with XLA, the optimizer's update included"):
        keras_fp8.compile_optimizer(keras.optimizers.AdamW())
