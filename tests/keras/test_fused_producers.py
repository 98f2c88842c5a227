"""Fused producers in keras_hub models on torch (compat patches 12 and 13).

Small keras_hub models from configs (`LlamaCausalLM`, `GemmaCausalLM`,
`GPT2CausalLM`, `BertMaskedLM`),
trained under `fp8_hybrid` with fusion on against the same model with
`fuse_producers=false`: every variable (weights, optimizer moments, FP8
state) and the predictions bit for bit; the fused ops counted from the
second step on, after the first links them (`FUSED_PER_PASS`). On CPU the fused ops run torch_ops's reference; on an FP8 GPU
the CUDA kernels.
"""

from unittest import mock

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

if keras.backend.backend() != "torch":
    pytest.skip("fused producers are torch_ops kernels (JAX: tests/keras/test_jax_fusion.py)",
                allow_module_level=True)

import keras_fp8  # noqa: E402,F401 (the FP8 policy names)
import torch_ops  # noqa: E402
from torch_ops import ops  # noqa: E402
from torch_ops import sharing  # noqa: E402

pytestmark = pytest.mark.usefixtures("fp8_at_every_size")

VOCAB, SEQ, BATCH, LAYERS = 96, 6, 8, 2


def _llama():
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_query_heads=2, num_key_value_heads=1, hidden_dim=32, intermediate_dim=48,
        num_layers=LAYERS, dropout=0.0, tie_word_embeddings=False)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _gemma():
    # Random norm scales: Gemma's start at zero (a weight of exactly 1).
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=LAYERS, num_query_heads=2, num_key_value_heads=1, hidden_dim=32,
        intermediate_dim=96, head_dim=16, dropout=0.0)
    for v in backbone.weights:
        if v.path.endswith("/scale"):
            v.assign(keras.random.normal(v.shape, stddev=0.3, seed=len(v.path)))
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _gpt2():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=2, hidden_dim=32, intermediate_dim=48, dropout=0.0,
        max_sequence_length=SEQ)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _bert():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=2, hidden_dim=32, intermediate_dim=48, dropout=0.0,
        max_sequence_length=SEQ)
    return keras_hub.models.BertMaskedLM(backbone=backbone, preprocessor=None)


MODELS = {"llama": _llama, "gemma": _gemma, "gpt2": _gpt2, "bert": _bert}


def _model(name, policy):
    keras.utils.set_random_seed(0)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        task = MODELS[name]()
    finally:
        keras.config.set_dtype_policy(previous)
    task.compile(optimizer=keras.optimizers.Adam(1e-2), run_eagerly=True)
    return task


def _batches(n, model="llama"):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(1, VOCAB, (BATCH, SEQ + 1)).astype("int32")
        x = {"token_ids": tokens[:, :SEQ], "padding_mask": np.ones((BATCH, SEQ), "int32")}
        if model != "bert":
            out.append((x, tokens[:, 1:]))
            continue
        # A masked LM: two positions per sequence, their original tokens the targets.
        x["segment_ids"] = np.zeros((BATCH, SEQ), "int32")
        x["mask_positions"] = np.stack([rng.choice(SEQ, 2, replace=False) for _ in range(BATCH)]).astype("int32")
        out.append((x, np.take_along_axis(tokens[:, :SEQ], x["mask_positions"], axis=1)))
    return out


class _Counter:
    def __init__(self, name):
        self.calls, self._fn = 0, getattr(ops, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._fn(*args, **kwargs)


def _train(policy, steps=4, model="llama"):
    sharing.clear()
    task = _model(model, policy)
    norms, products = _Counter("scaled_rows_quantize"), _Counter("gated_quantize")
    with mock.patch.object(ops, "scaled_rows_quantize", norms), mock.patch.object(ops, "gated_quantize", products):
        for x, y in _batches(steps, model):
            task.train_on_batch(x, y)
        predictions = keras.ops.convert_to_numpy(task(_batches(1, model)[0][0], training=False))
    variables = [keras.ops.convert_to_numpy(v.value) for v in task.variables + task.optimizer.variables]
    return variables, predictions, norms.calls, products.calls


# Fused calls per forward pass: (norms, gated products). Llama and Gemma:
# each decoder's two RMSNorms and its gated FFN's product, and the last norm
# (before the FP8 vocabulary projection, Gemma's tied). GPT-2 (norms first):
# each decoder's two LayerNorms and the last one. BERT (norms after the
# residual): the embeddings' LayerNorm, each layer's two but the last's
# output norm, which only the pooler's first-token slice and the masked-LM
# head's gathered rows read (a slice never links), and the masked-LM head's
# norm before the tied vocabulary projection.
FUSED_PER_PASS = {"llama": (2 * LAYERS + 1, LAYERS), "gemma": (2 * LAYERS + 1, LAYERS),
                  "gpt2": (2 * LAYERS + 1, 0), "bert": (2 * LAYERS + 1, 0)}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_model_trains_bit_identically_with_fusion_on_and_off(model):
    on, on_pred, norms, products = _train("fp8_hybrid[history_len=4]", model=model)
    off, off_pred, none_n, none_p = _train("fp8_hybrid[history_len=4,fuse_producers=false]", model=model)
    assert len(on) == len(off)
    for i, (a, b) in enumerate(zip(on, off)):
        np.testing.assert_array_equal(a, b, err_msg=f"variable {i}")
    np.testing.assert_array_equal(on_pred, off_pred)
    # Steps 2-4 and the prediction (the first step links).
    per_norm, per_product = FUSED_PER_PASS[model]
    assert (norms, products) == (4 * per_norm, 4 * per_product)
    assert (none_n, none_p) == (0, 0)


def test_fusion_setting_round_trips_in_the_policy_name():
    policy = keras.dtype_policies.get("fp8_hybrid[fuse_producers=false]")
    assert policy.recipe.fuse_producers is False
    assert keras.dtype_policies.get(policy.name).recipe.fuse_producers is False
    with pytest.raises(ValueError, match="fuse_producers"):
        from keras_fp8 import recipes

        recipes.DelayedScaling(fuse_producers="no")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_keras_hub_code_runs_where_nothing_is_fp8(model):
    """Under a plain policy the patched layers run keras_hub's own code."""
    on, on_pred, norms, products = _train("mixed_bfloat16", steps=2, model=model)
    assert (norms, products) == (0, 0)
    assert torch_ops.producers.Producer is not None
