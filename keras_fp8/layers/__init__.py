"""FP8 Keras layers."""

from keras_fp8.layers.fp8_dense import FP8Dense
from keras_fp8.layers.fp8_einsum_dense import FP8EinsumDense
from keras_fp8.layers.fp8_reversible_embedding import FP8ReversibleEmbedding

__all__ = ["FP8Dense", "FP8EinsumDense", "FP8ReversibleEmbedding"]
