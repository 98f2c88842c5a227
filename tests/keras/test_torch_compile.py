"""Compiled training on torch: `keras_fp8.compile_blocks` and Keras's
`jit_compile=True`, against eager training (tiny models, CPU).

| case | expected outcome |
|---|---|
| tiny keras_hub Llama, `compile_blocks` (aot_eager), `fp8_hybrid` / `mixed_bfloat16`, 2 epochs, smaller last batch | FP8 state and weights bit-identical to eager training; both blocks share one compilation per input shape; no graph and no recompilation in the 2nd epoch |
| the same with `torch.compile`'s default backend (inductor) | every FP8 state update made as eagerly (same history entries), scales and weights close (inductor fuses the ops around the FP8 layers, which may round an activation differently) |
| the same Llama, `model.compile(jit_compile=True)` (aot_eager; the heavy test, run once) | bit-identical to eager; the one graph break is Keras's `loss.backward()`; no recompilation in the 2nd epoch |
| blocks of a custom model, found and compiled | one compilation for all blocks; the layers in them traced without graph breaks |
| `FP8Monitor` with a probe on a model with compiled blocks | the same measurements as eagerly (the probe runs the blocks uncompiled) |
| `compile_blocks` on bad input, on JAX | clear errors naming the argument (JAX: use `jit_compile`) |
| `keras.ops.dot_product_attention` compiled (`fullgraph=True`) | no graph break (the flash-attention check) |
| `keras_fp8.summary` of a model with float32 matmuls under a 16-bit policy | a note naming them, unless TF32 is on |
"""

import functools

import keras
import numpy as np
import pytest

import keras_fp8
from keras_fp8.inspection import fp8_layers
from tests.support.composite_layers import Block

pytestmark = pytest.mark.usefixtures("fp8_at_every_size")
torch_only = pytest.mark.skipif(keras.backend.backend() != "torch",
                                reason="torch.compile: the torch backend's compiled step")

VOCAB, SEQ, BATCH = 96, 6, 8
# 2 full batches and a smaller last one: the first epoch compiles for both
# shapes, the second compiles nothing.
SAMPLES = 2 * BATCH + 4


def _llama(num_layers=2):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=num_layers, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
        intermediate_dim=32, dropout=0.0,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _data(samples=SAMPLES):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, (samples, SEQ + 1)).astype("int32")
    x = {"token_ids": tokens[:, :SEQ], "padding_mask": np.ones((samples, SEQ), "int32")}
    return x, tokens[:, 1:]


def _train(model, optimizer="adamw", samples=SAMPLES):
    """Two epochs of `keras.Model.fit` (Keras's sparse cross-entropy on the
    3-D logits); returns the dynamo graph counts after each."""
    from torch._dynamo.utils import counters

    optimizer = keras.optimizers.AdamW(1e-2) if optimizer == "adamw" else keras.optimizers.SGD(0.1)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(samples)
    graphs = []
    for _ in range(2):
        keras.Model.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def _fresh_dynamo():
    import torch

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _assert_same_training(eager, compiled, exact=True):
    """The compiled model's FP8 state and weights against the eager one's."""
    layers = list(zip(fp8_layers(eager), fp8_layers(compiled)))
    if eager.dtype_policy.name.startswith("fp8"):
        # Seven projections a block, and the vocabulary projection.
        assert len(layers) == 7 * eager.backbone.num_layers + 1
    for a, b in layers:
        # What the last call ran (the smaller last batch: plain ints, also
        # where it was compiled for dynamic shapes).
        assert b.fp8_execution() == a.fp8_execution()
        assert all(type(d) is int for d in b.fp8_execution()[1])
        for va, vb in zip(a.fp8_state_variables, b.fp8_state_variables):
            want, got = va.numpy(), vb.numpy()
            if exact:
                np.testing.assert_array_equal(got, want, err_msg=va.path)
            elif "history" in va.path or "scale" in va.path:
                # The same updates recorded (the same entries set), with
                # amaxes within two E4M3 steps (1/8 each): an activation
                # rounded differently before an FP8 cast may land one FP8
                # step away, and every layer after it sees that.
                np.testing.assert_array_equal(got != 0, want != 0, err_msg=va.path)
                np.testing.assert_allclose(got, want, rtol=0.25, err_msg=va.path)
            elif "fold_state" in va.path:  # [folds, last token, loss scale]: counts
                np.testing.assert_array_equal(got, want, err_msg=va.path)
            else:  # grad_amax_pending: [amax, token, 0]
                np.testing.assert_array_equal(got[1:], want[1:], err_msg=va.path)
                np.testing.assert_allclose(got[0], want[0], rtol=0.25, err_msg=va.path)
    for va, vb in zip(eager.weights, compiled.weights):
        if exact:
            np.testing.assert_array_equal(vb.numpy(), va.numpy(), err_msg=va.path)
        elif va.trainable and not va.path.endswith("grad_amax_pending"):
            np.testing.assert_allclose(vb.numpy(), va.numpy(), rtol=0.02, atol=2e-3, err_msg=va.path)


@pytest.fixture(scope="module")
def eager_models():
    """Eagerly trained Llamas, one per policy and optimizer, built on first use."""
    trained = {}

    def get(policy, optimizer="adamw", num_layers=2, samples=SAMPLES):
        key = policy, optimizer, num_layers, samples
        if key not in trained:
            keras.mixed_precision.set_global_policy(policy)
            model = _llama(num_layers)
            _train(model, optimizer, samples)
            trained[key] = model
        return trained[key]

    yield get
    keras.mixed_precision.set_global_policy("float32")


@torch_only
@pytest.mark.parametrize("policy", ["fp8_hybrid", "mixed_bfloat16"])
def test_compiled_blocks_train_as_eager(eager_models, policy):
    eager = eager_models(policy)
    keras.mixed_precision.set_global_policy(policy)
    model = _llama()
    _fresh_dynamo()
    blocks = keras_fp8.compile_blocks(model, backend="aot_eager")
    assert sorted(b.name for b in blocks) == ["transformer_layer_0", "transformer_layer_1"]
    first_epoch, second_epoch = _train(model)
    # One graph per batch shape (the full batches, the smaller last one),
    # shared by both blocks; nothing new in the second epoch.
    assert first_epoch == second_epoch == 2
    _assert_same_training(eager, model)


@torch_only
def test_compiled_blocks_with_inductor(eager_models):
    # SGD: Adam's first steps move every weight by about the learning rate
    # whatever the size of its gradient, so a gradient near zero rounded
    # differently moves a weight the other way.
    eager = eager_models("fp8_hybrid", "sgd")
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    model = _llama()
    _fresh_dynamo()
    keras_fp8.compile_blocks(model)  # torch.compile's defaults, as users get them
    first_epoch, second_epoch = _train(model, "sgd")
    assert first_epoch == second_epoch == 2
    _assert_same_training(eager, model, exact=False)


@torch_only
def test_jit_compile_trains_as_eager(eager_models, monkeypatch):
    # The heavy test (dynamo traces the whole model's step, twice: once to
    # find `loss.backward()`, once up to it): one block, no smaller last
    # batch (the shape change is covered by the tests above), once.
    import torch
    from torch._dynamo.utils import counters

    samples = 2 * BATCH
    eager = eager_models("fp8_hybrid", num_layers=1, samples=samples)
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    model = _llama(num_layers=1)
    _fresh_dynamo()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    model.compile(optimizer=keras.optimizers.AdamW(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    x, y = _data(samples)
    keras.Model.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    first_epoch = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        keras.Model.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    # One graph up to `loss.backward()`, one for the optimizer's update.
    assert counters["stats"]["unique_graphs"] == first_epoch == 2
    breaks = [reason for reason in counters["graph_break"]]
    assert len(breaks) == 1 and "Tensor.backward()" in breaks[0]
    _assert_same_training(eager, model)


# ---------------------------------------------------------------- compile_blocks on a custom model
def _block_model(blocks=3):
    keras.utils.set_random_seed(1)
    # A projection first: every block's input then requires a gradient (a
    # block fed the model's input directly would compile once more).
    layers = [keras.Input((6, 16)), keras.layers.Dense(16, name="proj")]
    layers += [Block(16, name=f"block_{i}") for i in range(blocks)]
    layers += [keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(4, name="head")]
    return keras.Sequential(layers, name="blocks")


@torch_only
def test_compile_blocks_finds_repeated_blocks_and_compiles_once():
    import torch
    from torch._dynamo.utils import counters

    keras.mixed_precision.set_global_policy("fp8_hybrid")
    model = _block_model()
    reference = _block_model()
    assert keras_fp8.compilation.repeated_blocks(model) == model.layers[1:4]
    _fresh_dynamo()
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompilation would be per block
        compiled = keras_fp8.compile_blocks(model, backend="eager", fullgraph=True)
        assert compiled == model.layers[1:4]
        x = np.random.default_rng(2).normal(size=(4, 6, 16)).astype("float32")
        for _ in range(2):
            y = model(x, training=True)
            want = reference(x, training=True)
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(y), keras.ops.convert_to_numpy(want))
    assert counters["stats"]["unique_graphs"] == 1
    # Keras's shape inference (meta tensors) runs the blocks uncompiled.
    spec = model.compute_output_spec(keras.KerasTensor((2, 6, 16)))
    assert spec.shape == (2, 4)
    assert counters["stats"]["unique_graphs"] == 1
    for a, b in zip(fp8_layers(reference), fp8_layers(model)):
        for va, vb in zip(a.fp8_state_variables, b.fp8_state_variables):
            np.testing.assert_array_equal(vb.numpy(), va.numpy())


@torch_only
def test_monitor_probe_on_compiled_blocks():
    # The monitor's probe runs in a Keras stateless scope: the blocks run
    # uncompiled there, and it measures what it measures eagerly.
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(32, 6, 16)).astype("float32"), rng.integers(0, 4, 32)

    def measured(compiled):
        model = _block_model()
        if compiled:
            _fresh_dynamo()
            keras_fp8.compile_blocks(model, backend="aot_eager")
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        monitor = keras_fp8.callbacks.FP8Monitor(every_n_steps=2, probe=(x[:8], y[:8]))
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
        return monitor.latest

    eager, compiled = measured(False), measured(True)
    assert sorted(compiled) == sorted(eager) and any("/grad/" in key for key in eager)
    for key in eager:
        np.testing.assert_array_equal(np.asarray(compiled[key]), np.asarray(eager[key]), err_msg=key)


@torch_only
def test_compile_blocks_takes_a_class_or_layers():
    model = _block_model(blocks=1)
    assert keras_fp8.compile_blocks(model, blocks=Block, backend="eager") == [model.layers[1]]
    assert keras_fp8.compile_blocks(model, blocks=[model.layers[-1]], backend="eager") == [model.layers[-1]]
    # The instance's `call` keeps the layer's signature.
    import inspect

    assert list(inspect.signature(model.layers[1].call).parameters) == ["x", "training"]


@torch_only
def test_compile_blocks_bad_input():
    model = _block_model(blocks=1)
    with pytest.raises(ValueError, match=r"found no repeated blocks in 'blocks'.*Pass `blocks=`"):
        keras_fp8.compile_blocks(model)
    with pytest.raises(ValueError, match=r"holds no layer of class Conv1D \(`blocks`\)"):
        keras_fp8.compile_blocks(model, blocks=keras.layers.Conv1D)
    with pytest.raises(TypeError, match=r"`blocks` must be a Keras layer class .*got the class int"):
        keras_fp8.compile_blocks(model, blocks=int)
    with pytest.raises(TypeError, match="every entry of `blocks` must be a Keras layer; got str"):
        keras_fp8.compile_blocks(model, blocks=["block_0"])
    with pytest.raises(TypeError, match=r"`blocks` must be None, .*got 'block_0'"):
        keras_fp8.compile_blocks(model, blocks="block_0")
    with pytest.raises(TypeError, match="`model` must be a Keras model or layer; got str"):
        keras_fp8.compile_blocks("model")


@torch_only
def test_dot_product_attention_compiles_without_graph_break():
    import torch

    rng = np.random.default_rng(3)
    q, k, v = (torch.tensor(rng.normal(size=(2, 5, 4, 8)).astype("float32")) for _ in range(3))
    mask = torch.tensor(rng.integers(0, 2, (2, 4, 5, 5)).astype(bool))
    _fresh_dynamo()
    attention = functools.partial(keras.ops.dot_product_attention, is_causal=True)
    compiled = torch.compile(attention, fullgraph=True, backend="eager")
    for kwargs in ({}, {"mask": mask}):
        np.testing.assert_allclose(compiled(q, k, v, **kwargs).numpy(), attention(q, k, v, **kwargs).numpy(),
                                   rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- float32 matmuls
@torch_only
def test_summary_names_float32_matmuls(monkeypatch):
    import torch

    keras.mixed_precision.set_global_policy("fp8_hybrid")
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(8, name="fp8"),
        keras.layers.Dense(4, dtype="float32", name="head32"),
    ], name="mixed")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    lines = []
    keras_fp8.summary(model, print_fn=lines.append)
    assert len(lines) == 2
    assert "1 layer(s) of 'mixed' multiply in float32" in lines[1] and "'head32'" in lines[1]
    assert "'fp8'" not in lines[1] and "set_float32_matmul_precision('high')" in lines[1]
    assert keras_fp8.inspection.float32_matmul_layers(model) == [model.layers[1]]
    # TF32 asked for: no note.
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    lines = []
    keras_fp8.summary(model, print_fn=lines.append)
    assert len(lines) == 1
    # A float32 model: float32 is what it asked for.
    keras.mixed_precision.set_global_policy("float32")
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    assert keras_fp8.inspection.float32_matmul_layers(plain) == []


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the error on a backend other than torch")
def test_compile_blocks_on_jax_raises():
    model = _block_model()
    with pytest.raises(NotImplementedError, match=r"torch.compile \(the torch backend\); the Keras backend is 'jax'"):
        keras_fp8.compile_blocks(model)
