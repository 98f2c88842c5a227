"""One quantize per tensor: FP8 layers reading one input, on every backend.

A block whose three FP8Dense (or FP8EinsumDense, its bias in the GEMM or
added to a float32 GEMM) projections read the same normalized input, and an
FP8Dense beside a tied FP8ReversibleEmbedding's projection (its `(N, K)`
embeddings read as stored), trained with sharing on against the same block
with it off (`share_quantized_inputs=False`): every variable after several
steps and the predictions element by element; the input quantized once per
step (torch: the quantize ops counted; JAX: the compiled program's FP8
conversions of the input counted).
"""

import re
from unittest import mock

import keras
import numpy as np
import pytest
from absl.testing import parameterized

from keras_fp8 import recipes
from keras_fp8.layers import FP8Dense
from keras_fp8.layers import FP8EinsumDense
from keras_fp8.layers import FP8ReversibleEmbedding
from tests.support.backend_utils import rng_normal

pytestmark = pytest.mark.usefixtures("fp8_at_every_size")

BATCH, SEQ, DIM, UNITS = 8, 6, 160, 16
RECIPES = {
    "delayed": lambda share: recipes.DelayedScaling(history_len=4, share_quantized_inputs=share),
    "current": lambda share: recipes.CurrentScaling(share_quantized_inputs=share),
    "block": lambda share: recipes.BlockScaling(share_quantized_inputs=share),
}


def _projections(kind, recipe, margins=(0.0, 0.0, 0.0)):
    if kind == "dense":
        return [FP8Dense(UNITS, recipe=recipe.replace(**_margin(recipe, m)), dtype="fp8_hybrid", name=f"p{i}")
                for i, m in enumerate(margins)]
    if kind == "einsum":  # the bias spans the GEMM's columns: added in its epilogue
        return [FP8EinsumDense("abc,cde->abde", output_shape=(None, 2, UNITS // 2), bias_axes="de",
                               recipe=recipe.replace(**_margin(recipe, m)), dtype="fp8_hybrid", name=f"p{i}")
                for i, m in enumerate(margins)]
    # The bias varies along the sequence (an axis of M): added to the GEMM's
    # float32 output, the GEMM reading the input widened to float32.
    return [FP8EinsumDense("abc,cd->abd", output_shape=(SEQ, UNITS), bias_axes="bd",
                           bias_initializer="random_normal", recipe=recipe.replace(**_margin(recipe, m)),
                           dtype="fp8_hybrid", name=f"p{i}")
            for i, m in enumerate(margins)]


def _margin(recipe, margin):
    return {"margin": margin} if margin else {}


def _model(kind, recipe, margins=(0.0, 0.0, 0.0)):
    """Q, K and V reading one normalized input, combined non-linearly."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((SEQ, DIM))
    h = keras.layers.LayerNormalization(dtype="fp8_hybrid")(inputs)
    q, k, v = [layer(h) for layer in _projections(kind, recipe, margins)]
    out = keras.layers.Reshape((SEQ, UNITS))(q * k + v)
    model = keras.Model(inputs, out)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _tied_model(recipe):
    """An FP8Dense and a tied embedding's vocabulary projection (kernel
    layout "out_in") reading one normalized input."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((SEQ, DIM))
    h = keras.layers.LayerNormalization(dtype="fp8_hybrid")(inputs)
    dense = FP8Dense(UNITS, recipe=recipe, dtype="fp8_hybrid", name="p0")
    embedding = FP8ReversibleEmbedding(UNITS, DIM, tie_weights=True, recipe=recipe, dtype="fp8_hybrid", name="p1")
    model = keras.Model(inputs, dense(h) * embedding(h, reverse=True))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _data(steps):
    x = rng_normal((steps * BATCH, SEQ, DIM), 1, 2.0)
    y = rng_normal((steps * BATCH, SEQ, UNITS), 2)
    return x, y


def _fit_and_predict(model, steps):
    """Trains `steps` steps, then predicts one batch; returns every variable
    and the predictions."""
    x, y = _data(steps)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return [np.asarray(v.numpy()) for v in model.variables] + [model.predict(x[:BATCH], verbose=0)]


def _trained(kind, recipe, steps=3, margins=(0.0, 0.0, 0.0)):
    return _fit_and_predict(_model(kind, recipe, margins), steps)


def _assert_identical(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"item {i}")


def _torch_input_quantizes(fn):
    """Calls `fn` counting torch_ops's quantizes of the projections' 2-D input."""
    from torch_ops import ops

    count = [0]

    def spy(original):
        def counted(x, *args, **kwargs):
            # Keras's symbolic calls (meta tensors, while building) not counted.
            if tuple(x.shape) == (BATCH * SEQ, DIM) and x.device.type != "meta":
                count[0] += 1
            return original(x, *args, **kwargs)

        return counted

    names = ("quantize_delayed", "quantize_current", "quantize_tiles")
    with mock.patch.multiple(ops, **{name: spy(getattr(ops, name)) for name in names}):
        fn()
    return count[0]


def _jax_layers_converting_the_input(model):
    """The layers (name scopes) whose part of the compiled train step
    converts the 2-D input, or its tiles, to FP8 (an HLO `convert`)."""
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(_data(1)[0][:BATCH])
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(trainable, non_trainable):
        y, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.sum(y.astype(jnp.float32)), non_trainable

    hlo = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(trainable, non_trainable).compile().as_text()
    tiles = -(-DIM // 128)
    # x as (B, S, K), (M, K), (K, M); its 1 x 128 tiles along K, and along M.
    shapes = {f"{BATCH},{SEQ},{DIM}", f"{BATCH * SEQ},{DIM}", f"{DIM},{BATCH * SEQ}",
              f"{BATCH * SEQ},{tiles},128", f"{DIM},1,128"}
    layers = set()
    for shape, layer in re.findall(r"f8e4m3fn\[([0-9,]*)\]\S* convert\(.*?jvp\((p\d)\)", hlo):
        if shape in shapes:
            layers.add(layer)
    return layers


class ShareQuantizeTest(parameterized.TestCase):
    @parameterized.product(kind=("dense", "einsum", "einsum_row_bias"), recipe=tuple(RECIPES))
    def test_shared_block_trains_exactly_as_the_unshared_one(self, kind, recipe):
        _assert_identical(_trained(kind, RECIPES[recipe](True)), _trained(kind, RECIPES[recipe](False)))

    @parameterized.product(recipe=tuple(RECIPES))
    def test_tied_projection_beside_a_dense_trains_exactly_as_unshared(self, recipe):
        # Sharing is about x; the tied projection's kernel layout plays no part.
        _assert_identical(_fit_and_predict(_tied_model(RECIPES[recipe](True)), 3),
                          _fit_and_predict(_tied_model(RECIPES[recipe](False)), 3))

    @parameterized.product(kind=("dense", "einsum"))
    def test_different_margins_share_only_where_equal(self, kind):
        margins = (0.0, 1.0, 0.0)
        _assert_identical(_trained(kind, RECIPES["delayed"](True), margins=margins),
                          _trained(kind, RECIPES["delayed"](False), margins=margins))

    @parameterized.named_parameters(("delayed", "delayed", 1), ("current", "current", 1), ("block", "block", 2))
    def test_the_input_is_quantized_once_per_step(self, recipe, per_layer):
        backend = keras.backend.backend()
        if backend == "torch":
            steps = 2
            models = [_model("dense", RECIPES[recipe](share)) for share in (True, False)]
            shared, unshared = (_torch_input_quantizes(lambda: _fit_and_predict(m, steps)) for m in models)
            # Each count also holds the predict call's quantize (one batch;
            # no tiles along M for a weight gradient).
            self.assertEqual(shared, steps * per_layer + 1)
            self.assertEqual(unshared, 3 * (steps * per_layer + 1))
        elif backend == "jax":
            shared = _jax_layers_converting_the_input(_model("dense", RECIPES[recipe](True)))
            unshared = _jax_layers_converting_the_input(_model("dense", RECIPES[recipe](False)))
            self.assertEqual(shared, {"p0"})
            # Block scales come from the tensor alone: XLA's common
            # subexpression elimination merges the unshared layers' copies too.
            self.assertEqual(unshared, {"p0"} if recipe == "block" else {"p0", "p1", "p2"})
        else:
            self.skipTest(f"no FP8 layers on {backend}")

    def test_the_input_is_quantized_once_beside_other_kernel_layouts_and_biases(self):
        backend = keras.backend.backend()
        if backend == "torch":
            # A tied projection reads the same view of the input as the
            # FP8Dense (torch_ops finds it without a source).
            steps = 2
            models = [_tied_model(RECIPES["delayed"](share)) for share in (True, False)]
            shared, unshared = (_torch_input_quantizes(lambda: _fit_and_predict(m, steps)) for m in models)
            self.assertEqual(shared, steps + 1)
            self.assertEqual(unshared, 2 * (steps + 1))
        elif backend == "jax":
            # The einsum's float32 GEMM (a bias along M) reads the widened
            # input: one copy for the three layers as well.
            shared = _jax_layers_converting_the_input(_model("einsum_row_bias", RECIPES["delayed"](True)))
            unshared = _jax_layers_converting_the_input(_model("einsum_row_bias", RECIPES["delayed"](False)))
            self.assertEqual(shared, {"p0"})
            self.assertEqual(unshared, {"p0", "p1", "p2"})
        else:
            self.skipTest(f"no FP8 layers on {backend}")

    def test_the_setting_is_validated_and_kept_by_the_policy_name(self):
        with self.assertRaisesRegex(ValueError, "share_quantized_inputs"):
            recipes.DelayedScaling(share_quantized_inputs="no")
        policy = keras.dtype_policies.get("fp8_hybrid[share_quantized_inputs=False]")
        self.assertFalse(policy.recipe.share_quantized_inputs)
        self.assertEqual(keras.dtype_policies.get(policy.name).recipe, policy.recipe)
