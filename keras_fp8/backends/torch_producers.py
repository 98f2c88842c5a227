"""Fused producers in keras_hub's models on torch (`torch_ops.producers`).

The ops whose outputs the FP8 layers quantize next, in keras_hub's models:

- Llama: its RMSNorm (`LlamaLayerNorm`, before Q, K and V, the gated FFN
  and the vocabulary projection) and the gated FFN's product
  (`up * act(gate)`, before the down projection);
- Gemma: its RMSNorm (`RMSNormalization`, weight `1 + scale`) and the
  GeGLU product (`gelu(gate) * up`, before the down projection);
- Keras's `LayerNormalization` (GPT-2's and BERT's norms): torch computes
  it in one `F.layer_norm` kernel, statistics and affine together, in
  float32; only the cast to the 16-bit compute dtype after it fuses.

Through `keras_fp8.compat`'s patches 12 and 13 they run here: where the FP8 layer
reading their output has linked itself (`torch_ops.producers.link`:
delayed scaling with `share_quantized_inputs` and `fuse_producers`), the
output is written together with that layer's FP8 input in one pass;
otherwise keras_hub's own code runs. What fuses is the elementwise tail
only: the norms' reductions (`mean(x**2)`, `rsqrt` or `1 / sqrt`) and the
activations are keras_hub's and Keras's own ops either way, and the fused
op's output and gradients are the unfused ops' bit for bit
(docs/numerics.md, "Fused producers"). Eager calls only: compiled code and
Keras's stateless calls run keras_hub's code.
"""

import threading

import torch
from keras import ops
from torch_ops import producers

from keras_fp8 import compat

# The decoder layer whose call is running on this thread (its gated FFN's
# product is the one `llama_ffn_multiply` and `gemma_ffn_gelu` see).
_CURRENT = threading.local()


def _eager(*tensors):
    return (not torch.compiler.is_compiling() and not compat.in_stateless_scope()
            and all(isinstance(t, torch.Tensor) for t in tensors))


def _producer(layer, attribute):
    """The layer's `torch_ops.producers.Producer` (made on first use; kept in
    the instance dict, outside Keras's and torch's attribute tracking)."""
    producer = layer.__dict__.get(attribute)
    if producer is None:
        producer = layer.__dict__[attribute] = producers.Producer()
    return producer


def llama_norm_call(layer, x, keras_call):
    """`LlamaLayerNorm.call`: keras_hub's own, or its last step fused with
    the linked FP8 layer's quantize."""
    if not _eager(x):
        return keras_call(layer, x)
    producer = _producer(layer, "_fp8_producer")
    if not producer.linked:
        return producers.note(keras_call(layer, x), producer)
    # keras_hub's reduction, op for op; then (x * rsqrt) * scale, fused.
    x32 = ops.cast(x, "float32")
    var = ops.mean(ops.power(x32, 2), axis=-1, keepdims=True)
    inv = ops.rsqrt(var + layer.epsilon)
    out_dtype = getattr(torch, layer.compute_dtype)
    return producers.scaled_rows(x32, inv, layer.scale.value, out_dtype, producer)


def decoder_call(layer, args, kwargs, keras_call):
    """`LlamaTransformerDecoder.call` and `GemmaDecoderBlock.call`, with the
    layer known to its FFN's product on this thread."""
    if torch.compiler.is_compiling():
        return keras_call(layer, *args, **kwargs)
    previous = getattr(_CURRENT, "decoder", None)
    _CURRENT.decoder = layer
    try:
        return keras_call(layer, *args, **kwargs)
    finally:
        _CURRENT.decoder = previous


def llama_ffn_multiply(x1, x2, keras_multiply):
    """The decoder module's `ops.multiply(up, act(gate))`: Keras's own, or
    fused with the down projection's quantize where it is linked."""
    layer = getattr(_CURRENT, "decoder", None)
    if layer is None or not _eager(x1, x2) or x1.shape != x2.shape or x1.dtype != x2.dtype:
        return keras_multiply(x1, x2)
    producer = _producer(layer, "_fp8_ffn_producer")
    if not producer.linked:
        return producers.note(keras_multiply(x1, x2), producer)
    return producers.gated(x2, x1, "identity", producer)


def gemma_norm_call(layer, x, keras_call):
    """Gemma's `RMSNormalization.call`: keras_hub's own, or its last step
    fused with the linked FP8 layer's quantize."""
    if not _eager(x):
        return keras_call(layer, x)
    producer = _producer(layer, "_fp8_producer")
    if not producer.linked:
        return producers.note(keras_call(layer, x), producer)
    # keras_hub's reduction and `1 + scale`, op for op; then
    # (x * (1 / sqrt(var + eps))) * (1 + scale), fused.
    x32 = ops.cast(x, "float32")
    scale = ops.cast(layer.scale, "float32")
    var = ops.mean(ops.square(x32), axis=-1, keepdims=True)
    inv = ops.reciprocal(ops.sqrt(var + layer.epsilon))
    out_dtype = getattr(torch, layer.compute_dtype)
    return producers.scaled_rows(x32, inv, 1 + scale, out_dtype, producer)


class _Activated:
    """Gemma's `gelu(gate)` (Keras's own) until keras_hub multiplies it by
    the up projection, the one use `compat` lets it reach: the product is
    Keras's own, noted for the down projection, or fused with its quantize."""

    __slots__ = ("value", "producer")

    def __init__(self, value, producer):
        self.value = value
        self.producer = producer

    def __mul__(self, up):
        a = self.value
        if not isinstance(up, torch.Tensor) or up.shape != a.shape or up.dtype != a.dtype or not _eager(up):
            return a * up
        if not self.producer.linked:
            return producers.note(a * up, self.producer)
        return producers.gated(a, up, "identity", self.producer)

    __rmul__ = __mul__


def gemma_ffn_gelu(x, approximate, keras_gelu):
    """The Gemma decoder block module's `keras.activations.gelu`: Keras's
    own; inside a block's call, in a stand-in whose product with the up
    projection is the fused producer."""
    a = keras_gelu(x, approximate=approximate)
    layer = getattr(_CURRENT, "decoder", None)
    if layer is None or not _eager(a):
        return a
    return _Activated(a, _producer(layer, "_fp8_ffn_producer"))


_HALF = ("bfloat16", "float16")


def layer_norm_call(layer, args, kwargs, keras_call):
    """`keras.layers.LayerNormalization.call`: Keras's own, or Keras's own
    norm in float32 with the cast to the compute dtype fused with the linked
    FP8 layer's quantize (16-bit inputs in the compute dtype; no
    `rms_scaling`)."""
    inputs = args[0] if args else kwargs.get("inputs")
    if (len(args) + len(kwargs) != 1 or not _eager(inputs) or layer.rms_scaling
            or layer.compute_dtype not in _HALF or inputs.dtype != getattr(torch, layer.compute_dtype)):
        return keras_call(layer, *args, **kwargs)
    producer = _producer(layer, "_fp8_producer")
    if not producer.linked:
        return producers.note(keras_call(layer, *args, **kwargs), producer)
    # Keras's own op on the float32 input (what it computes in: the same
    # kernel, the same bits), then its cast to the input's dtype, fused.
    out32 = ops.layer_normalization(ops.cast(inputs, "float32"), layer.gamma, layer.beta, layer.axis,
                                    layer.epsilon)
    return producers.cast(out32, inputs.dtype, producer)


def install():
    """Applies compat's patches 12 and 13 (idempotent; patch 12 nothing
    before keras_hub is imported)."""
    compat.keras_hub_fused_producers(llama_norm_call, decoder_call, llama_ffn_multiply)
    compat.keras_hub_gemma_fused_producers(gemma_norm_call, decoder_call, gemma_ffn_gelu)
    compat.layer_norm_fused_producer(layer_norm_call)
