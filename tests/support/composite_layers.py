"""A composite test layer that builds its own Dense/EinsumDense sublayers and
passes its dtype policy on to them, as keras_hub's and Keras's composite
layers do, and a Functional model around it (tests/keras/test_policy_layers.py,
tests/keras/test_round_trips.py); and `Head`, a token embedding's reverse
call as a layer of its own (tests/keras/test_keras_hub.py,
tests/keras/test_jax_routes.py)."""

import keras


@keras.saving.register_keras_serializable(package="keras_fp8_tests")
class Block(keras.layers.Layer):
    """A custom layer that builds its own sublayers and passes its dtype
    policy on to them (as keras_hub's and Keras's composite layers do)."""

    def __init__(self, units=16, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.up = keras.layers.Dense(units, activation="relu", dtype=self.dtype_policy, name="up")
        self.down = keras.layers.EinsumDense(
            "abc,cd->abd", (None, units), bias_axes="d", dtype=self.dtype_policy, name="down"
        )

    def build(self, input_shape):
        self.up.build(input_shape)
        self.down.build(tuple(input_shape[:-1]) + (self.units,))

    def call(self, x, training=None):
        return self.down(self.up(x, training=training), training=training)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def functional_model():
    """Attention, a norm, a `Block`, pooling and a Dense head named "head"."""
    inp = keras.Input((6, 16))
    h = keras.layers.MultiHeadAttention(2, 8, name="mha")(inp, inp)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = Block(16, name="block")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    out = keras.layers.Dense(4, name="head")(h)
    return keras.Model(inp, out, name="func")


class Head(keras.layers.Layer):
    """A token embedding's reverse call as a layer of its own (what a causal
    LM's `call` runs last)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding
        self.built = embedding.built  # (stateless_call asks for a built layer)

    def call(self, x, training=None):
        # (`stateless_call` runs `call` outside any call context: pass it on.)
        return self.embedding(x, reverse=True, training=training)
