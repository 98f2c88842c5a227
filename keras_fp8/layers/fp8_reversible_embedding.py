"""FP8ReversibleEmbedding: the vocabulary projection of a language model in FP8."""

import math

import keras
from keras import ops
from keras.saving import register_keras_serializable

from keras_fp8 import compat
from keras_fp8.layers.fp8_state import STATE_VARIABLE_NAMES
from keras_fp8.layers.fp8_state import FP8StateMixin


@register_keras_serializable(package="keras_fp8")
class FP8ReversibleEmbedding(FP8StateMixin, keras.layers.ReversibleEmbedding):
    """`keras.layers.ReversibleEmbedding` whose reverse projection runs in FP8.

    Takes exactly the arguments of `keras.layers.ReversibleEmbedding` (the
    token embedding of keras_hub's language models), plus `recipe` and
    `min_gemm_size`. The forward direction (the lookup) is unchanged. The
    reverse direction (`layer(h, reverse=True)`, the vocabulary projection
    that makes the logits) is a `(M, K) @ (K, N)` matmul with `K` the hidden
    size and `N` the vocabulary; under an FP8 dtype policy or inside an
    enabled `keras_fp8.autocast` scope it runs as `FP8Dense`'s matmul does,
    on the untied `reverse_embeddings` or, with tied weights, on the
    `(N, K)` `embeddings` as stored (read transposed by the FP8 GEMMs, no
    transposed copy; one variable, its gradient summed over the lookup and
    the projection, as in Keras).

    Keras's own layer computes the projection in float32 (its variables do
    not autocast, so a bfloat16 input meets a float32 kernel) and returns
    float32 logits. Under an FP8 policy this layer computes in the policy's
    compute dtype instead: FP8 where the GEMM is at least `min_gemm_size`,
    the compute dtype below it, and the logits come out in the compute dtype
    (bfloat16 under `"fp8_hybrid"`). Where FP8 is off (a policy that is not
    an FP8 policy, or `keras_fp8.autocast(enabled=False)`) it computes
    exactly what `ReversibleEmbedding` computes.

    The FP8 state variables are those of `FP8Dense`, saved after the
    embedding (and the untied reverse embedding).

    Args:
        input_dim, output_dim, tie_weights, embeddings_initializer,
        embeddings_regularizer, embeddings_constraint, mask_zero,
        logit_soft_cap: As in `keras.layers.ReversibleEmbedding`.
        reverse_dtype: As in `keras.layers.ReversibleEmbedding`; must be
            None here (a layer that asks for a dtype of its own for the
            projection is not made FP8 by a policy).
        recipe: Optional `keras_fp8.DelayedScaling` / `CurrentScaling`.
        min_gemm_size: As in `FP8Dense`.
        **kwargs: Base layer keyword arguments, such as `name` and `dtype`.

    Example:

    >>> import keras_fp8
    >>> layer = keras_fp8.layers.FP8ReversibleEmbedding(
    ...     100, 16, tie_weights=False, dtype="fp8_hybrid")
    >>> h = layer(np.random.randint(0, 100, (2, 5)))
    >>> layer(h, reverse=True).shape
    (2, 5, 100)
    """

    def __init__(self, input_dim, output_dim, *, recipe=None, min_gemm_size=None, **kwargs):
        super().__init__(input_dim, output_dim, **kwargs)
        if self.reverse_dtype is not None:
            raise ValueError(
                "FP8ReversibleEmbedding computes its projection in FP8 or in "
                "the compute dtype, so `reverse_dtype` must be None. Received: "
                f"reverse_dtype={self.reverse_dtype!r}"
            )
        self.init_fp8(recipe, min_gemm_size)

    def build(self, input_shape=None):
        super().build(input_shape)
        self.build_fp8_state()

    @property
    def _kernel(self):
        # The variable the projection reads (tied: the embeddings, used
        # transposed); what `keras_fp8.summary` and the monitor show.
        return self._embeddings if self.tie_weights else self.reverse_embeddings

    @property
    def _kernel_layout(self):
        # Tied: the FP8 matmul reads the `(input_dim, output_dim)`
        # embeddings, `(N, K)`, as they are stored (`_fp8_matmul`).
        return "out_in" if self.tie_weights else "in_out"

    def _projection_kernel(self):
        """The kernel of the projection, float32 (not autocast), as stored:
        the untied `(K, N)` `reverse_embeddings`, or the tied `(N, K)`
        `embeddings` (`_kernel_layout` "out_in")."""
        return self._raw_value(self._kernel)

    def _gemm_dims(self, input_shape):
        lead = input_shape[:-1]
        m = None if any(d is None for d in lead) else math.prod(lead)
        return m, self.output_dim, self.input_dim

    def call(self, inputs, reverse=False, training=None):
        if not reverse:
            return super().call(inputs, reverse=False)
        if self._fp8_recipe() is None:
            return super().call(inputs, reverse=True)
        if inputs.shape[-1] != self.output_dim:
            raise ValueError(
                f"inputs: expected a last dimension of {self.output_dim} (the "
                f"layer's output_dim) for reverse=True, got shape {tuple(inputs.shape)}"
            )
        if training is None:
            # A layer that became FP8 by a policy keeps the call signature
            # Keras read from `ReversibleEmbedding` (no `training`), so its
            # parents do not pass it: the call context holds it.
            context = compat.current_call_context()
            training = None if context is None else context.get_value("training")
        config = self._fp8_call_config(inputs, bool(training))
        if config is None:
            logits = self._compute_dtype_projection(inputs)
        else:
            x = ops.reshape(inputs, (-1, self.output_dim))
            logits = self._fp8_matmul(x, self._projection_kernel(), config, bool(training))
            logits = ops.reshape(logits, tuple(ops.shape(inputs)[:-1]) + (self.input_dim,))
        if self.logit_soft_cap is not None:
            cap = self.logit_soft_cap
            logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
        return logits

    def _compute_dtype_projection(self, inputs):
        """The projection in the compute dtype (below `min_gemm_size`, or
        inputs FP8 cannot take), where Keras's layer would run float32."""
        dtype = self.compute_dtype
        if not keras.backend.is_float_dtype(keras.backend.standardize_dtype(inputs.dtype)):
            # As Keras's layer (its matmul on a non-float input).
            dtype = "float32"
        kernel = ops.cast(self._projection_kernel(), dtype)
        if self.tie_weights:
            kernel = ops.transpose(kernel)
        return ops.matmul(ops.cast(inputs, dtype), kernel)

    # Saving: the embedding (and the untied reverse embedding) as Keras saves
    # them, then the FP8 state in STATE_VARIABLE_NAMES order.

    def _own_variable_count(self):
        return 1 if self.tie_weights else 2

    def load_own_variables(self, store):
        """Loads an FP8 checkpoint of the layer, or one of its plain
        `ReversibleEmbedding` form (the FP8 state then reset to a fresh
        layer's)."""
        if not self.built:
            return
        start = self._own_variable_count()
        count = len(store.keys())
        if count not in (start, start + len(STATE_VARIABLE_NAMES)):
            raise ValueError(
                f"Layer '{self.name}' expected {start} or "
                f"{start + len(STATE_VARIABLE_NAMES)} variables, but received "
                f"{count} variables during loading."
            )
        self._embeddings.assign(store["0"])
        if not self.tie_weights:
            self.reverse_embeddings.assign(store["1"])
        if count == start:
            self._reset_fp8_state()
        else:
            for i, variable in enumerate(self.fp8_state_variables):
                variable.assign(store[str(start + i)])
