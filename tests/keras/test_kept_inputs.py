"""keras_fp8.inspection.kept_inputs and `keras_fp8.summary(model, x=...)`:
which FP8 layers' compute-dtype inputs another layer keeps for the backward.

| case | expected outcome |
|---|---|
| one tensor feeds an FP8 Dense and a `Multiply` with another tensor | that FP8 layer's input kept by the `Multiply` (`mul`), its bytes; the summary names it |
| one tensor feeds an FP8 Dense and a bfloat16 `Dense` | kept by that Dense (its matmul) |
| norm -> three FP8 Dense (q, k, v as in attention) | nothing kept; the summary says each keeps only its FP8 copy |
| an FP8 layer below `min_gemm_size` | left out (it runs as the plain layer) |
| the compiled loss with `y`, a `loss=` | the same answer; no variable changed (FP8 state, BatchNormalization statistics, seeds), the layers' last GEMM neither |
| `y`, `loss` or `sample_weight` without what they need | a ValueError naming the argument |
"""

import keras
import numpy as np
import pytest

import keras_fp8
from keras_fp8 import inspection
from tests.support.backend_utils import to_numpy

# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")

BATCH, SEQ, FEATURES = 4, 8, 32
# A bfloat16 activation of the sample batch.
ACTIVATION_BYTES = BATCH * SEQ * FEATURES * 2


def _sample(seed=0):
    return np.random.default_rng(seed).normal(size=(BATCH, SEQ, FEATURES)).astype("float32")


def _shared_input_model(other):
    """norm -> (FP8 Dense `fp8_a`, `other`), then an FP8 Dense `fp8_b` on
    `other`'s output: `fp8_a`'s input is `other`'s too."""
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    inputs = keras.Input((SEQ, FEATURES))
    normed = keras.layers.LayerNormalization(name="norm")(inputs)
    a = keras.layers.Dense(FEATURES, name="fp8_a")(normed)
    if other == "multiply":
        gate = keras.layers.Dense(FEATURES, name="gate")(inputs)
        mixed = keras.layers.Multiply(name="mix")([normed, gate])
    else:
        mixed = keras.layers.Dense(FEATURES, name="plain", dtype="mixed_bfloat16")(normed)
    b = keras.layers.Dense(FEATURES, name="fp8_b")(mixed)
    return keras.Model(inputs, [a, b])


def _by_name(found):
    return {entry.layer.name: entry for entry in found}


@pytest.mark.parametrize("other, saver, ops", [
    ("multiply", "mix", {"Mul", "mul"}),
    ("bf16_dense", "plain", {"Mm", "MatMul", "Matmul", "dot_general"}),
])
def test_a_layer_that_saves_the_input_is_named(other, saver, ops):
    model = _shared_input_model(other)
    found = _by_name(inspection.kept_inputs(model, _sample()))
    assert found["fp8_a"].kept, found
    paths = [path for path, _ in found["fp8_a"].kept_by]
    assert paths == [saver], found["fp8_a"]
    assert found["fp8_a"].kept_by[0][1] in ops, found["fp8_a"]
    assert found["fp8_a"].dtype == "bfloat16" and found["fp8_a"].shape == (BATCH, SEQ, FEATURES)
    assert found["fp8_a"].nbytes == ACTIVATION_BYTES
    # fp8_b's input is read by fp8_b alone (and `gate`'s by `gate`).
    assert not found["fp8_b"].kept, found["fp8_b"]
    assert not found.get("gate", found["fp8_b"]).kept

    lines = []
    keras_fp8.summary(model, print_fn=lines.append, x=_sample())
    report = lines[1]
    assert "by other layers too, so that the FP8 copy saves no memory there (1 FP8 layer(s), 2,048 bytes" in report
    row = next(line for line in report.splitlines() if line.startswith("fp8_a "))
    assert f"bfloat16 {BATCH}x{SEQ}x{FEATURES}" in row and "2,048" in row and f"{saver} (" in row, row
    assert "Keeping only their FP8 copy" in report and "fp8_b" in report.splitlines()[-1]


def test_inputs_read_only_by_fp8_layers_are_not_kept():
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    inputs = keras.Input((SEQ, FEATURES))
    normed = keras.layers.LayerNormalization(name="norm")(inputs)
    q, k, v = (keras.layers.Dense(FEATURES, name=name)(normed) for name in ("query", "key", "value"))
    model = keras.Model(inputs, keras.layers.Add()([q, k, v]))
    found = inspection.kept_inputs(model, _sample())
    assert sorted(entry.layer.name for entry in found) == ["key", "query", "value"]
    assert all(not entry.kept and entry.kept_by == () for entry in found), found

    lines = []
    keras_fp8.summary(model, print_fn=lines.append, x=_sample())
    assert lines[1] == ("Inputs kept for the backward: each of the 3 FP8 layer(s) that ran FP8 keeps only "
                        "its FP8 copy of its input."), lines


def test_layers_below_min_gemm_size_are_left_out():
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    inputs = keras.Input((SEQ, FEATURES))
    small = keras.layers.Dense(FEATURES, name="small", dtype=f"fp8_hybrid[min_gemm_size={10**9}]")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(FEATURES, name="fp8")(small))
    assert [entry.layer.name for entry in inspection.kept_inputs(model, _sample())] == ["fp8"]


def _compiled_model():
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    inputs = keras.Input((SEQ, FEATURES))
    normed = keras.layers.BatchNormalization(name="bn")(inputs)
    hidden = keras.layers.Dense(FEATURES, name="up")(normed)
    mixed = keras.layers.Multiply(name="mix")([hidden, keras.layers.Dropout(0.5, name="drop")(hidden)])
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(keras.layers.Dense(FEATURES, name="mid")(mixed)))
    model.compile(optimizer="adam", loss="mse")
    return model


def test_losses_and_no_variable_changes():
    model = _compiled_model()
    x, y = _sample(), np.random.default_rng(1).normal(size=(BATCH, SEQ, 3)).astype("float32")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # FP8 state away from its initial values
    before = [to_numpy(v).copy() for v in model.variables]
    answers = [
        inspection.kept_inputs(model, x),
        inspection.kept_inputs(model, x, y),
        inspection.kept_inputs(model, x, y, sample_weight=np.ones((BATCH, SEQ), "float32")),
        inspection.kept_inputs(model, x, y, loss=keras.losses.MeanAbsoluteError()),
        inspection.kept_inputs(model, x, y, loss=lambda t, p: keras.ops.mean(keras.ops.square(t - p), axis=-1)),
    ]
    for found in answers:
        by_name = _by_name(found)
        assert sorted(by_name) == ["head", "mid", "up"]
        # `up`'s input (BatchNormalization's output) is read by `up` alone;
        # `mid`'s (the product) too; `head`'s by `head` alone.
        assert not any(entry.kept for entry in found), found
    for variable, value in zip(model.variables, before):
        np.testing.assert_array_equal(to_numpy(variable), value, err_msg=variable.path)
    # The layers' last GEMM (what the summary's table shows) stays fit's.
    last = {layer.name: layer.fp8_execution()[1] for layer in inspection.fp8_layers(model)}
    assert last["up"] == (BATCH * SEQ, FEATURES, FEATURES)
    inspection.kept_inputs(model, x[:1])
    assert {layer.name: layer.fp8_execution()[1] for layer in inspection.fp8_layers(model)} == last


def test_arguments_are_checked():
    model = _shared_input_model("multiply")
    x = _sample()
    with pytest.raises(ValueError, match="Invalid `y`.*no compiled loss"):
        inspection.kept_inputs(model, x, np.zeros((BATCH, SEQ, FEATURES), "float32"))
    with pytest.raises(ValueError, match="Invalid `loss`.*Received: y=None"):
        inspection.kept_inputs(model, x, loss="mse")
    with pytest.raises(ValueError, match="Invalid `sample_weight`.*Received: y=None"):
        inspection.kept_inputs(model, x, sample_weight=np.ones(BATCH))
    with pytest.raises(ValueError, match="Invalid `x`.*Received: x=None"):
        keras_fp8.summary(model, print_fn=lambda _: None, y=np.zeros((BATCH, SEQ, FEATURES), "float32"))
    with pytest.raises(ValueError, match="Invalid `loss`"):
        inspection.kept_inputs(model, x, [np.zeros((BATCH, SEQ, FEATURES), "float32")] * 2, loss=42)
