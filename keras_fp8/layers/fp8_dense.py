"""FP8Dense: `keras.layers.Dense` with FP8 matmuls and delayed scaling."""

import math

import keras
from keras import ops
from keras.saving import register_keras_serializable

from keras_fp8.layers.fp8_state import FP8StateMixin


@register_keras_serializable(package="keras_fp8")
class FP8Dense(FP8StateMixin, keras.layers.Dense):
    """A densely-connected layer whose matmul runs in FP8.

    Takes exactly the arguments of `keras.layers.Dense`, plus `recipe`. Under
    an FP8 dtype policy (e.g. `"fp8_hybrid"`) or inside an enabled
    `keras_fp8.autocast` scope, the input and the kernel are quantized to FP8
    (E4M3) with per-tensor scales, multiplied with float32 accumulation, and
    the output gradient is quantized (E5M2 for the hybrid format) for both
    backward matmuls. Otherwise the layer computes exactly what `Dense` does.

    The FP8 state lives in non-trainable float32 variables created in
    `build`: `input_scale`, `input_amax_history`, `kernel_scale`,
    `kernel_amax_history`, `grad_scale`, `grad_amax_history`, plus
    `grad_amax_pending` (the output gradient's amax, carried by the gradient
    channel and overwritten by the optimizer) and `grad_fold_state`. They are
    saved and loaded with the model.

    Args:
        units: Positive integer, dimensionality of the output space.
        activation, use_bias, kernel_initializer, bias_initializer,
        kernel_regularizer, bias_regularizer, activity_regularizer,
        kernel_constraint, bias_constraint, lora_rank, lora_alpha: As in
            `keras.layers.Dense`.
        recipe: Optional `keras_fp8.DelayedScaling` / `CurrentScaling`. If
            None, the policy's recipe (or the default `DelayedScaling()`).
        min_gemm_size: `M*N*K` below which a call runs exactly what `Dense`
            runs (FP8 cannot win at small shapes) and leaves the FP8 state
            alone. None: the policy's setting, else the backend's default
            (`torch_ops.DEFAULT_MIN_GEMM_SIZE` where real FP8 GEMMs run, 0
            where the exact emulation runs).
        **kwargs: Base layer keyword arguments, such as `name` and `dtype`.

    Input shape:
        N-D tensor with shape `(batch_size, ..., input_dim)`, N >= 2.

    Output shape:
        N-D tensor with shape `(batch_size, ..., units)`.

    Example:

    >>> import keras_fp8
    >>> layer = keras_fp8.layers.FP8Dense(32, dtype="fp8_hybrid")
    >>> y = layer(np.random.rand(8, 16).astype("float32"), training=True)
    >>> y.shape, layer.input_amax_history.shape
    ((8, 32), (1024,))
    """

    def __init__(self, units, *, recipe=None, min_gemm_size=None, **kwargs):
        super().__init__(units, **kwargs)
        self.init_fp8(recipe, min_gemm_size)

    def build(self, input_shape):
        super().build(input_shape)
        self.build_fp8_state()

    def _gemm_dims(self, input_shape):
        lead = input_shape[:-1]
        m = None if any(d is None for d in lead) else math.prod(lead)
        return m, self._kernel.shape[0], self.units

    def call(self, inputs, training=None):
        config = self._fp8_call_config(inputs, bool(training))
        if config is None:
            return super().call(inputs, training=training)
        # Rank 2 skips two reshapes (Keras ops cost host time per call).
        flat = len(inputs.shape) == 2
        x = inputs if flat else ops.reshape(inputs, (-1, self._kernel.shape[0]))
        y = self._fp8_matmul(
            x, self._raw_value(self._kernel), config, bool(training),
            bias=self.bias, source=(inputs, None),
        )
        if not flat:
            y = ops.reshape(y, tuple(ops.shape(inputs)[:-1]) + (self.units,))
        if self.activation is not None:
            y = self.activation(y)
        return y
