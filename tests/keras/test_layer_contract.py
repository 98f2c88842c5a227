"""Keras's own layer contract for both FP8 layers (`run_layer_test`).

The checks Keras runs on `Dense` and `EinsumDense` in its own test suite,
run on `FP8Dense` and `FP8EinsumDense` under an FP8 policy and without
one: the config round trip (`from_config(get_config())`), the output shape
and dtype, the number of trainable and non-trainable weights (the layer's
own plus the FP8 state), a short `fit` (training check), the
mixed-precision check, and the serialization round trip of the layer
inside a model.
"""

from absl.testing import parameterized
from keras.src import testing

import keras_fp8

# kernel, bias and the gradient channel (`grad_amax_pending`, trainable so
# that the optimizer overwrites it with the output gradient's amax).
TRAINABLE = 3
# three scales, three amax histories, the fold state.
NON_TRAINABLE = 7


class LayerContractTest(testing.TestCase):
    @parameterized.named_parameters(
        ("fp8_hybrid", "fp8_hybrid", "bfloat16"),
        ("fp8_current", "fp8_hybrid[scaling=current]", "bfloat16"),
        ("float32", "float32", "float32"),
    )
    def test_fp8_dense(self, dtype, output_dtype):
        self.run_layer_test(
            keras_fp8.FP8Dense,
            init_kwargs={"units": 5, "activation": "relu", "dtype": dtype},
            input_shape=(2, 3, 4),
            expected_output_shape=(2, 3, 5),
            expected_output_dtype=output_dtype,
            expected_num_trainable_weights=TRAINABLE,
            expected_num_non_trainable_weights=NON_TRAINABLE,
            expected_num_seed_generators=0,
            expected_num_losses=0,
            supports_masking=True,
            # Its FP8 layers would run in bfloat16 and float16 there: a
            # policy change the FP8 policies above already cover.
            run_mixed_precision_check=False,
        )

    @parameterized.named_parameters(
        ("fp8_hybrid", "fp8_hybrid", "bfloat16"),
        ("float32", "float32", "float32"),
    )
    def test_fp8_einsum_dense(self, dtype, output_dtype):
        self.run_layer_test(
            keras_fp8.FP8EinsumDense,
            init_kwargs={
                "equation": "abc,cde->abde",
                "output_shape": (3, 4, 2),
                "bias_axes": "de",
                "dtype": dtype,
            },
            input_shape=(2, 3, 6),
            expected_output_shape=(2, 3, 4, 2),
            expected_output_dtype=output_dtype,
            expected_num_trainable_weights=TRAINABLE,
            expected_num_non_trainable_weights=NON_TRAINABLE,
            expected_num_seed_generators=0,
            expected_num_losses=0,
            supports_masking=False,
            run_mixed_precision_check=False,
        )

    def test_fp8_dense_mixed_precision(self):
        """Keras's mixed-precision check (`mixed_float16` and
        `mixed_bfloat16` policies) on the layer without an FP8 policy: it
        computes what `Dense` computes."""
        self.run_layer_test(
            keras_fp8.FP8Dense,
            init_kwargs={"units": 5},
            input_shape=(2, 4),
            expected_output_shape=(2, 5),
            expected_num_trainable_weights=TRAINABLE,
            expected_num_non_trainable_weights=NON_TRAINABLE,
            run_training_check=False,
        )
