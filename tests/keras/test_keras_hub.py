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
"""

import os
import tempfile
import zipfile

import keras
import numpy as np
import pytest

import keras_fp8
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from tests.support.backend_utils import run_under_other_backend
from tests.support.backend_utils import to_numpy

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
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_query_heads=2, num_key_value_heads=1, dropout=0.0, **SIZES
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
    assert len(converted) == 13
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
    assert len(keras_fp8.unconvert(task)) == 12
    assert fp8_layers(task) == []
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
