"""JAX on an FP8 GPU: XLA fuses the producer into the quantize (compiled HLO).

A one-block keras_hub Llama backbone's training step under `fp8_hybrid`,
compiled on the XLA route (`jax_gemm` custom calls off: their quantize is a
custom call, which no XLA fusion can enter), and the compiled HLO read: the
conversion to FP8 of Q's input (the RMSNorm's output) must sit in one fusion
with the norm's `rsqrt`, and that of the down projection's input (the
SwiGLU product) in one fusion with the activation's exponential or logistic.
XLA's CPU backend leaves these conversions unfused (no check on CPU).
"""

import re

import keras
import pytest

from tests.support.backend_utils import needs_jax_fp8_gpu

keras_hub = pytest.importorskip("keras_hub")


pytestmark = needs_jax_fp8_gpu


def _computations(hlo_text):
    """name -> body of every computation in compiled HLO text."""
    out, name, lines = {}, None, []
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head:
            name, lines = head.group(1), []
        elif line.startswith("}") and name:
            out[name] = "\n".join(lines)
            name = None
        elif name:
            lines.append(line)
    return out


def _fusions_converting(computations, layer):
    """The fused computations holding the FP8 conversion of `layer`'s input
    (by the conversion's op name)."""
    pattern = re.compile(r"f8e4m3fn\[[^\]]*\][^\n]*convert\([^\n]*op_name=\"[^\"]*" + re.escape(layer))
    return {name: body for name, body in computations.items()
            if name.startswith("fused") or "fusion" in name if pattern.search(body)}


def test_llama_block_norm_and_swiglu_fuse_into_their_quantize():
    import jax
    import jax.numpy as jnp

    import keras_fp8  # noqa: F401 (the FP8 policy names)
    from keras_fp8.backends import jax_gemm

    previous_policy = keras.config.dtype_policy()
    previous_enabled = jax_gemm.enabled()
    keras.config.set_dtype_policy("fp8_hybrid[history_len=4]")
    jax_gemm.set_enabled(False)
    try:
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=256, num_query_heads=4, num_key_value_heads=2, hidden_dim=256, intermediate_dim=512,
            num_layers=1, dropout=0.0, tie_word_embeddings=False)
        x = {"token_ids": jnp.ones((4, 128), "int32"), "padding_mask": jnp.ones((4, 128), "int32")}
        trainable = [v.value for v in backbone.trainable_variables]
        non_trainable = [v.value for v in backbone.non_trainable_variables]

        def loss(trainable, non_trainable, x):
            y, _ = backbone.stateless_call(trainable, non_trainable, x, training=True)
            return jnp.sum(jnp.square(y.astype("float32")))

        hlo = jax.jit(jax.grad(loss)).lower(trainable, non_trainable, x).compile().as_text()
    finally:
        jax_gemm.set_enabled(previous_enabled)
        keras.config.set_dtype_policy(previous_policy)
    computations = _computations(hlo)
    query = _fusions_converting(computations, "self_attention/query")
    assert any("rsqrt" in body for body in query.values()), (
        "Q's FP8 input is not converted in the RMSNorm's fusion: " + ", ".join(query) or "no fusion converts it")
    down = _fusions_converting(computations, "feedforward_output_dense")
    assert any(re.search(r"exponential|logistic", body) for body in down.values()), (
        "the down projection's FP8 input is not converted in the SwiGLU's fusion: " + ", ".join(down)
        or "no fusion converts it")
