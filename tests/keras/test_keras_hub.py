"""keras_hub models under the FP8 policy alone (tiny configs, random weights,
no downloads, no preprocessors).

| case | expected outcome |
|---|---|
| GPT-2 and Llama causal LMs, a BERT classifier, built under the global `fp8_hybrid` | every `Dense`/`EinsumDense` an FP8 layer; a few steps' losses within 2% of `mixed_bfloat16`'s |
| saved to `.keras`, loaded under `float32`, trained on | FP8 again with identical weights, FP8 state and predictions; the histories continue |
| `fp8_hybrid[exclude=logits]` | the classifier head stays plain, after reloading too |
| a bf16 model made FP8 by `convert(policy=...)` | reloads FP8 (the backbone's `DTypePolicyMap`) |
| `.weights.h5` between the bf16 and the FP8 model, both ways | kernels load; FP8 state fresh (plain -> FP8) or left out (FP8 -> plain) |
| `unconvert` | no FP8 layer or policy left; the `.keras` file names no keras_fp8 object |
| `.keras` saved under the other backend | FP8 layers, identical state |
| `fp8_hybrid_float16` | the task's optimizer is keras_fp8's `LossScaleOptimizer` |
| the vocabulary projection (`ReversibleEmbedding(reverse=True)`), untied and tied, training calls | `FP8ReversibleEmbedding`: outputs, gradients and state equal the `keras_fp8.numerics` reference; the lookup unchanged |
| the projection below `min_gemm_size` / with FP8 off | the compute dtype (bfloat16 logits) / exactly Keras's layer (float32) |
| Llama (untied) and GPT-2 (tied) causal LMs under `fp8_hybrid` | the head is FP8, its state saved, reloaded and trained on |
| `fp8_hybrid[exclude=token_embedding]`; `reverse_dtype` set | the head stays a plain `ReversibleEmbedding` (after reloading too); a warning names the second |
| `convert` / `unconvert` of the head; `layer.quantize` on it | FP8 and back with the same weights; Keras's quantization refused |
| `keras_fp8.summary(task, x=..., y=...)` of a Llama causal LM under `fp8_hybrid` | every FP8 layer in the report on the inputs kept; the projections after a norm, the FFN's output projection and the head keep only their FP8 copy; no variable changed |
"""

import math
import os
import tempfile
import zipfile

import keras
import numpy as np
import pytest

import keras_fp8
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from keras_fp8.layers import FP8ReversibleEmbedding
from tests.support.backend_utils import rng_normal
from tests.support.composite_layers import Head
from tests.support.backend_utils import run_under_other_backend
from tests.support.backend_utils import to_numpy
from tests.support.backend_utils import train_call_with_grads
from tests.support.keras_reference import ReferenceSteps
from tests.support.keras_reference import assert_same_state
from tests.support.keras_reference import layer_state

keras_hub = pytest.importorskip("keras_hub")

# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")

_FP8 = (FP8Dense, FP8EinsumDense)
# Token batches of (8, 6) and 16 features: the activation shapes of
# tests/keras/test_round_trips.py, whose FP8 programs JAX has then compiled already.
VOCAB, SEQ, BATCH = 96, 6, 8
SIZES = dict(hidden_dim=16, intermediate_dim=16, num_layers=2)


def gpt2():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_heads=2, max_sequence_length=SEQ, dropout=0.0, **SIZES
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def llama():
    # Untied head (keras_hub's default for Llama): `reverse_embeddings`.
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_query_heads=2, num_key_value_heads=1, dropout=0.0,
        tie_word_embeddings=False, **SIZES
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def bert():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_heads=2, max_sequence_length=SEQ, dropout=0.0, **SIZES
    )
    return keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0
    )


# model -> (builder, FP8 layers: 6 or 7 per block (4 EinsumDense, 2 or 3
# Dense), plus BERT's pooler and head). (intermediate_dim = hidden_dim: fewer
# distinct GEMM shapes, fewer programs for JAX to compile.)
MODELS = {"gpt2": (gpt2, 12), "llama": (llama, 14), "bert": (bert, 14)}


def batches(name, n, seed=0):
    """`n` batches `(x, y, sample_weight)` of random token ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(1, VOCAB, (BATCH, SEQ + 1)).astype("int32")
        mask = np.ones((BATCH, SEQ), "int32")
        if name == "bert":
            x = {"token_ids": tokens[:, :SEQ], "segment_ids": np.zeros_like(mask), "padding_mask": mask}
            out.append((x, rng.integers(0, 3, (BATCH,)).astype("int32"), None))
        else:
            x = {"token_ids": tokens[:, :SEQ], "padding_mask": mask}
            out.append((x, tokens[:, 1:], mask.astype("float32")))
    return out


def compile_task(task):
    # Eager: these few tiny steps cost less than compiling a train function.
    task.compile(optimizer=keras.optimizers.Adam(1e-3), run_eagerly=True)


def fp8_layers(model):
    return [l for l in model._flatten_layers() if isinstance(l, _FP8)]


def values(model):
    return {v.path: to_numpy(v) for v in model.weights}


def predict(task, x):
    return to_numpy(task.predict_on_batch(x))


def train_save_resume(name, policy, steps=(3, 2), compare=True):
    """Builds under `policy`, trains `steps[0]` steps, saves, reloads under
    `float32`, trains `steps[1]` more. Returns the losses, the model, the
    reloaded model, and (with `compare`) the values and predictions of both
    just after loading."""
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    task = MODELS[name][0]()
    compile_task(task)
    data = batches(name, sum(steps))
    losses = [task.train_on_batch(x, y, w)[0] for x, y, w in data[: steps[0]]]
    path = os.path.join(tempfile.mkdtemp(), f"{name}.keras")
    task.save(path)
    keras.mixed_precision.set_global_policy("float32")
    loaded = keras.models.load_model(path)
    # keras_hub tasks override `compile`, so Keras does not restore their
    # optimizer from the file (for bf16 models as well): compile again.
    compile_task(loaded)
    before = after_load = None
    if compare:
        before = (values(task), predict(task, data[0][0]))
        after_load = (values(loaded), predict(loaded, data[0][0]))
    losses += [loaded.train_on_batch(x, y, w)[0] for x, y, w in data[steps[0]:]]
    return losses, task, loaded, before, after_load


@pytest.mark.parametrize("name", sorted(MODELS))
def test_policy_alone_trains_saves_and_resumes_like_bf16(name):
    n_fp8 = MODELS[name][1]
    losses, task, loaded, before, after_load = train_save_resume(name, "fp8_hybrid")
    bf16_losses, bf16_task, _, _, _ = train_save_resume(name, "mixed_bfloat16", compare=False)

    projections = [l for l in task._flatten_layers()
                   if isinstance(l, (keras.layers.Dense, keras.layers.EinsumDense))]
    assert len(fp8_layers(task)) == len(projections) == n_fp8
    assert fp8_layers(bf16_task) == []
    # Reloaded under float32: FP8 again, nothing changed.
    assert len(fp8_layers(loaded)) == n_fp8
    assert isinstance(loaded.backbone.dtype_policy, keras_fp8.FP8DTypePolicy)
    saved, saved_pred = before
    got, got_pred = after_load
    assert sorted(got) == sorted(saved)
    for path in saved:
        if "seed_generator" not in path:
            np.testing.assert_array_equal(got[path], saved[path], err_msg=path)
    np.testing.assert_array_equal(got_pred, saved_pred)
    # Trained on with the state intact: 3 + 2 input amaxes recorded.
    for layer in fp8_layers(loaded):
        assert np.count_nonzero(to_numpy(layer.input_amax_history)) == 5, layer.path
        assert np.count_nonzero(to_numpy(layer.grad_amax_history)) == 4, layer.path
    # The token embedding is FP8 too; a language model's head (its reverse
    # call) recorded as the projections did, a classifier's never ran.
    head = loaded.backbone.token_embedding
    assert type(head) is FP8ReversibleEmbedding
    assert type(bf16_task.backbone.token_embedding) is keras.layers.ReversibleEmbedding
    calls = (0, 0) if name == "bert" else (5, 4)
    assert np.count_nonzero(to_numpy(head.input_amax_history)) == calls[0]
    assert np.count_nonzero(to_numpy(head.grad_amax_history)) == calls[1]
    # Against mixed_bfloat16, step by step.
    losses, bf16_losses = np.array(losses), np.array(bf16_losses)
    assert np.isfinite(losses).all()
    relative = np.abs(losses - bf16_losses) / np.abs(bf16_losses)
    assert relative.max() < 2e-2, (losses, bf16_losses)


def test_exclusion_survives_reloading():
    keras.mixed_precision.set_global_policy("fp8_hybrid[exclude=logits]")
    task = bert()
    head = task.get_layer("logits")
    assert type(head) is keras.layers.Dense and head.compute_dtype == "bfloat16"
    assert len(fp8_layers(task)) == 13
    path = os.path.join(tempfile.mkdtemp(), "bert.keras")
    task.save(path)
    keras.mixed_precision.set_global_policy("float32")
    loaded = keras.models.load_model(path)
    assert type(loaded.get_layer("logits")) is keras.layers.Dense
    assert len(fp8_layers(loaded)) == 13


def test_convert_round_trip():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    task = bert()
    converted = keras_fp8.convert(task, policy="fp8_hybrid", exclude="logits")
    assert len(converted) == 14  # 13 projections and the token embedding
    compile_task(task)
    x, y, w = batches("bert", 1)[0]
    task.train_on_batch(x, y, w)
    path = os.path.join(tempfile.mkdtemp(), "bert.keras")
    task.save(path)
    keras.mixed_precision.set_global_policy("float32")
    loaded = keras.models.load_model(path)
    compile_task(loaded)  # eager, as `task` (XLA's fusions round differently)
    assert [l.path for l in fp8_layers(loaded)] == [l.path for l in fp8_layers(task)]
    assert type(loaded.get_layer("logits")) is keras.layers.Dense
    saved = values(task)
    for path, value in values(loaded).items():
        if "seed_generator" not in path:
            np.testing.assert_array_equal(value, saved[path], err_msg=path)
    np.testing.assert_array_equal(predict(loaded, x), predict(task, x))


def test_weights_files_between_bf16_and_fp8():
    x, y, w = batches("bert", 1)[0]
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    plain = bert()
    workdir = tempfile.mkdtemp()
    plain.save_weights(os.path.join(workdir, "plain.weights.h5"))
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    fp8 = bert()
    compile_task(fp8)
    fp8.train_on_batch(x, y, w)
    fp8.load_weights(os.path.join(workdir, "plain.weights.h5"))
    plain_values = values(plain)
    for path, value in values(fp8).items():
        if path in plain_values:
            np.testing.assert_array_equal(value, plain_values[path], err_msg=path)
    for layer in fp8_layers(fp8):
        assert np.count_nonzero(to_numpy(layer.input_amax_history)) == 0  # fresh
    fp8.train_on_batch(x, y, w)
    fp8.save_weights(os.path.join(workdir, "fp8.weights.h5"))
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    back = bert()
    back.load_weights(os.path.join(workdir, "fp8.weights.h5"))
    fp8_values = values(fp8)
    for path, value in values(back).items():
        np.testing.assert_array_equal(value, fp8_values[path], err_msg=path)


def test_unconvert():
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    task = gpt2()
    x = batches("gpt2", 1)[0][0]
    with keras_fp8.autocast(enabled=False):
        expected = predict(task, x)
    assert len(keras_fp8.unconvert(task)) == 13  # 12 projections and the head
    assert fp8_layers(task) == []
    assert type(task.backbone.token_embedding) is keras.layers.ReversibleEmbedding
    assert all(not isinstance(l.dtype_policy, keras_fp8.FP8DTypePolicy) for l in task._flatten_layers())
    np.testing.assert_array_equal(predict(task, x), expected)
    path = os.path.join(tempfile.mkdtemp(), "plain.keras")
    task.save(path)
    with zipfile.ZipFile(path) as archive:
        assert "keras_fp8" not in archive.read("config.json").decode()


def test_float16_policy_gets_keras_fp8_loss_scaling():
    keras.mixed_precision.set_global_policy("fp8_hybrid_float16")
    task = gpt2()  # keras_hub tasks compile at construction
    assert isinstance(task.optimizer, keras_fp8.optimizers.LossScaleOptimizer)
    compile_task(task)
    assert isinstance(task.optimizer, keras_fp8.optimizers.LossScaleOptimizer)
    # (What the optimizer then does: tests/keras/test_loss_scaling.py.)


def test_keras_file_from_the_other_backend():
    # (In CI this runs under both backends: both directions.)
    workdir = tempfile.mkdtemp()
    script = (
        "import numpy as np, keras, keras_fp8\n"
        "from tests.keras.test_keras_hub import gpt2, batches, compile_task\n"
        "keras.mixed_precision.set_global_policy('fp8_hybrid[min_gemm_size=0]')\n"
        "keras.utils.set_random_seed(0)\n"
        # Compiled: one program costs less than the eager steps' many.
        "task = gpt2(); task.compile(optimizer=keras.optimizers.Adam(1e-3))\n"
        "for x, y, w in batches('gpt2', 2): task.train_on_batch(x, y, w)\n"
        f"task.save({os.path.join(workdir, 'gpt2.keras')!r})\n"
        f"np.savez({os.path.join(workdir, 'values.npz')!r}, "
        "**{v.path: keras.ops.convert_to_numpy(v) for v in task.weights})\n"
    )
    run_under_other_backend(script)
    keras.mixed_precision.set_global_policy("float32")
    loaded = keras.models.load_model(os.path.join(workdir, "gpt2.keras"), compile=False)
    assert len(fp8_layers(loaded)) == 12
    saved = dict(np.load(os.path.join(workdir, "values.npz")))
    for path, value in values(loaded).items():
        if "seed_generator" not in path:
            np.testing.assert_array_equal(value, saved[path], err_msg=path)
    compile_task(loaded)
    x, y, w = batches("gpt2", 3)[2]
    loaded.train_on_batch(x, y, w)
    for layer in fp8_layers(loaded):
        assert np.count_nonzero(to_numpy(layer.input_amax_history)) == 3, layer.path


# --------------------------------------------------------------------------- the vocabulary projection
def _assert_close(actual, expected, msg=""):
    """Element by element, within bfloat16's rounding of the output."""
    rtol = 2**-7
    atol = rtol * 1e-2 * max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=msg)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_projection_training_calls_equal_the_reference(tied):
    policy = "fp8_hybrid[history_len=4]"
    embedding = FP8ReversibleEmbedding(40, 16, tie_weights=tied, dtype=policy, min_gemm_size=0)
    embedding.build()
    head = Head(embedding, dtype=policy)
    ref = ReferenceSteps(layer_state(embedding), embedding.dtype_policy.recipe, embedding.compute_dtype)
    weights = to_numpy(embedding.embeddings if tied else embedding.reverse_embeddings)
    kernel = weights.T if tied else weights  # (hidden, vocabulary)
    pending = embedding.grad_amax_pending
    for step in range(3):
        x = rng_normal((2, 5, 16), 10 + step, 1.0 + step)
        up = rng_normal((2, 5, 40), 20 + step, 10.0**-step)
        y, dx, grads = train_call_with_grads(head, x, up)
        ry, rdx, rdk, _ = ref.step(x.reshape(10, 16), kernel, up.reshape(10, 40))
        _assert_close(y.reshape(10, 40), ry, f"logits, step {step}")
        _assert_close(dx.reshape(10, 16), rdx, f"dx, step {step}")
        dk = grads[(embedding.embeddings if tied else embedding.reverse_embeddings).path]
        _assert_close(dk.T if tied else dk, rdk, f"dkernel, step {step}")
        pending.assign(grads[pending.path])  # the optimizer's overwrite
        assert_same_state(embedding, ref.state)


@pytest.mark.parametrize("policy", ["fp8_hybrid[history_len=4]", "fp8_hybrid[scaling=current]",
                                    "fp8_e4m3[scaling=block]"])
def test_tied_projection_reads_the_embeddings_as_stored(monkeypatch, policy):
    """With tied weights the FP8 matmul reads the `(vocabulary, hidden)`
    embeddings as stored (no transposed copy per call: torch_ops's and the
    JAX backend's "out_in" layout), and computes, bit for bit, what an
    `FP8Dense` on their transpose computes: outputs, gradients, state. (One
    exception: block scaling's weight gradient on torch, where torch_ops
    multiplies each stretch's product by the two tile scales in the other
    order for an `(N, K)` weight: within a float32 rounding.)"""
    from keras_fp8 import backends
    from tests.support.backend_utils import rng_window

    embedding = FP8ReversibleEmbedding(40, 16, tie_weights=True, dtype=policy, min_gemm_size=0)
    embedding.build()
    embedding.embeddings.assign(rng_window((40, 16), 0, 64.0, 100.0))
    head = Head(embedding, dtype=policy)
    dense = FP8Dense(40, use_bias=False, dtype=policy, min_gemm_size=0)
    dense.build((None, 16))
    dense.kernel.assign(to_numpy(embedding.embeddings).T)

    module = backends.get()
    calls = []
    fp8_matmul = module.fp8_matmul

    def recording(layer, x, kernel, bias, config, training, *layout):
        if layer is embedding:
            calls.append((kernel, config, layout[0] if layout else "in_out"))
        return fp8_matmul(layer, x, kernel, bias, config, training, *layout)

    monkeypatch.setattr(module, "fp8_matmul", recording)
    for step in range(3):
        x = rng_window((2, 5, 16), 10 + step, 64.0, 100.0)
        up = rng_window((2, 5, 40), 20 + step, 0.6, 1.0)
        y, dx, grads = train_call_with_grads(head, x, up)
        want_y, want_dx, want_grads = train_call_with_grads(dense, x.reshape(10, 16), up.reshape(10, 40))
        np.testing.assert_array_equal(y.reshape(10, 40), want_y)
        np.testing.assert_array_equal(dx.reshape(10, 16), want_dx)
        if "block" in policy and keras.backend.backend() == "torch":
            np.testing.assert_allclose(grads[embedding.embeddings.path], want_grads[dense.kernel.path].T,
                                       rtol=2.0**-22)
        else:
            np.testing.assert_array_equal(grads[embedding.embeddings.path], want_grads[dense.kernel.path].T)
        np.testing.assert_array_equal(grads[embedding.grad_amax_pending.path],
                                      want_grads[dense.grad_amax_pending.path])
        embedding.grad_amax_pending.assign(grads[embedding.grad_amax_pending.path])
        dense.grad_amax_pending.assign(want_grads[dense.grad_amax_pending.path])
        assert_same_state(embedding, layer_state(dense))
    kernel, config, layout = calls[-1]
    assert layout == "out_in" and tuple(kernel.shape) == (40, 16)
    if keras.backend.backend() == "torch":
        assert config.weight_layout == "out_in"
        assert kernel is embedding.embeddings.value  # the variable's own tensor


def test_lookup_is_unchanged_and_fp8_off_is_keras():
    keras.utils.set_random_seed(0)
    plain = keras.layers.ReversibleEmbedding(40, 16, tie_weights=False, dtype="mixed_bfloat16")
    plain.build()
    fp8 = FP8ReversibleEmbedding(40, 16, tie_weights=False, dtype="fp8_hybrid", min_gemm_size=0)
    fp8.build()
    fp8.embeddings.assign(plain.embeddings)
    fp8.reverse_embeddings.assign(plain.reverse_embeddings)
    tokens = np.random.default_rng(0).integers(0, 40, (3, 7)).astype("int32")
    np.testing.assert_array_equal(to_numpy(fp8(tokens)), to_numpy(plain(tokens)))
    h = rng_normal((3, 7, 16), 1)
    with keras_fp8.autocast(enabled=False):
        off = fp8(h, reverse=True)
    expected = plain(h, reverse=True)
    assert keras.backend.standardize_dtype(expected.dtype) == "float32"  # Keras's head
    assert keras.backend.standardize_dtype(off.dtype) == "float32"
    np.testing.assert_array_equal(to_numpy(off), to_numpy(expected))
    assert np.count_nonzero(to_numpy(fp8.input_amax_history)) == 0


def test_below_min_gemm_size_the_projection_runs_the_compute_dtype():
    embedding = FP8ReversibleEmbedding(40, 16, dtype="fp8_hybrid", min_gemm_size=10**9, logit_soft_cap=3.0)
    embedding.build()
    h = rng_normal((3, 7, 16), 2)
    logits = embedding(h, reverse=True, training=True)
    assert keras.backend.standardize_dtype(logits.dtype) == "bfloat16"
    x = keras.ops.cast(h, "bfloat16")
    kernel = keras.ops.cast(keras.ops.transpose(keras.ops.convert_to_tensor(to_numpy(embedding.embeddings))), "bfloat16")
    expected = keras.ops.matmul(x, kernel)
    expected = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(expected, 3.0)), 3.0)
    np.testing.assert_array_equal(to_numpy(logits), to_numpy(expected))
    assert embedding.fp8_execution()[0] == "bfloat16 (< min_gemm_size)"
    assert np.count_nonzero(to_numpy(embedding.input_amax_history)) == 0


def test_excluded_head_stays_keras_after_reloading():
    keras.mixed_precision.set_global_policy("fp8_hybrid[exclude=token_embedding]")
    task = gpt2()
    assert type(task.backbone.token_embedding) is keras.layers.ReversibleEmbedding
    assert len(fp8_layers(task)) == 12
    path = os.path.join(tempfile.mkdtemp(), "gpt2.keras")
    task.save(path)
    keras.mixed_precision.set_global_policy("float32")
    loaded = keras.models.load_model(path, compile=False)
    assert type(loaded.backbone.token_embedding) is keras.layers.ReversibleEmbedding
    assert len(fp8_layers(loaded)) == 12


def test_reverse_dtype_keeps_the_layer_plain_with_a_warning():
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    layer = keras.layers.ReversibleEmbedding(40, 16, reverse_dtype="float32", name="asked_float32")
    with pytest.warns(UserWarning, match="asked_float32.*reverse_dtype"):
        layer.build()
    assert type(layer) is keras.layers.ReversibleEmbedding
    with pytest.raises(ValueError, match="reverse_dtype"):
        FP8ReversibleEmbedding(40, 16, reverse_dtype="float32")


def test_convert_unconvert_and_quantize_of_the_head():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    task = llama()
    x = batches("llama", 1)[0][0]
    expected = predict(task, x)
    head = task.backbone.token_embedding
    converted = keras_fp8.convert(task, include="token_embedding", policy="fp8_hybrid")
    assert converted == [head.path] and type(head) is FP8ReversibleEmbedding
    with pytest.raises(ValueError, match="unconvert"):
        head.quantize("int8")
    path = os.path.join(tempfile.mkdtemp(), "llama.keras")
    task.save(path)
    keras.mixed_precision.set_global_policy("float32")
    loaded = keras.models.load_model(path, compile=False)
    assert type(loaded.backbone.token_embedding) is FP8ReversibleEmbedding
    assert keras_fp8.unconvert(task) == [head.path]
    assert type(head) is keras.layers.ReversibleEmbedding
    assert not hasattr(head, "input_scale")
    np.testing.assert_array_equal(predict(task, x), expected)


def test_summary_reports_the_inputs_kept_for_the_backward():
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    task = llama()
    compile_task(task)
    (x, y, sample_weight), = batches("llama", 1)
    before = values(task)
    lines = []
    keras_fp8.summary(task, print_fn=lines.append, x=x, y=y, sample_weight=sample_weight)
    report = lines[1]
    assert report.startswith("Inputs kept for the backward"), lines
    found = keras_fp8.inspection.kept_inputs(task, x, y, sample_weight=sample_weight)
    assert {id(entry.layer) for entry in found} == {id(layer) for layer in keras_fp8.inspection.fp8_layers(task)}
    # What a norm's output, the FFN's product and the final norm's output
    # feed is read by FP8 layers alone. (The attention output is the
    # attention kernel's: torch's fused attention saves its output.)
    alone = ("query", "key", "value", "feedforward_gate_dense", "feedforward_intermediate_dense",
             "feedforward_output_dense", "token_embedding")
    for entry in found:
        if entry.layer.name in alone:
            assert not entry.kept, entry
        assert entry.dtype == "bfloat16" and entry.nbytes == math.prod(entry.shape) * 2
    after = values(task)
    for path, value in before.items():
        np.testing.assert_array_equal(after[path], value, err_msg=path)
