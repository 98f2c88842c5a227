"""Setting an FP8 layer's weights, and LoRA on FP8 layers, as docs/guide.md
("Setting weights", "LoRA") says:

| case | outcome |
|---|---|
| `set_weights([kernel, bias])` on an FP8 layer (written or made by a policy) | Keras's ValueError naming the count it expects; nothing assigned |
| `model.set_weights(...)` with the plain form's weights | the same ValueError; nothing assigned |
| the kernel and bias assigned, the FP8 state set to a new layer's | the layer trains exactly as a new layer with that kernel and bias |
| `set_weights(other.get_weights())` between FP8 layers | kernel, bias and FP8 state copied |
| LoRA enabled on an FP8 layer | its FP8 state is kept; the weights saved then load, merged, into the model without LoRA, FP8 again |
"""

import os
import tempfile

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import to_numpy
from tests.support.backend_utils import train_call_with_grads

# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")

POLICY = "fp8_hybrid[history_len=8]"


def make_layer(kind):
    """A built FP8 layer: input (4, 16), kernel 16 x 8 (with a bias)."""
    if kind == "fp8_dense":
        layer = keras_fp8.layers.FP8Dense(8, dtype=POLICY)
    elif kind == "dense_under_policy":
        layer = keras.layers.Dense(8, dtype=POLICY)
    else:
        layer = keras_fp8.layers.FP8EinsumDense("ab,bc->ac", 8, bias_axes="c", dtype=POLICY)
    layer.build((4, 16))
    assert isinstance(layer, (keras_fp8.layers.FP8Dense, keras_fp8.layers.FP8EinsumDense))
    return layer


def values(layer):
    return [to_numpy(v) for v in layer.weights]


def train_steps(layer, steps, seed):
    for step in range(steps):
        train_call_with_grads(layer, rng_normal((4, 16), seed + step), rng_normal((4, 8), seed + 50 + step))


def as_new_layer(layer, kernel, bias):
    """What the guide writes: the kernel and bias, then a new layer's FP8 state."""
    layer.kernel.assign(kernel)
    layer.bias.assign(bias)
    for variable in layer.fp8_state_variables:
        fill = np.ones if variable.name.endswith("_scale") else np.zeros
        variable.assign(fill(variable.shape, "float32"))


KINDS = ("fp8_dense", "dense_under_policy", "fp8_einsum_dense")


def kept_state(layer):
    """The FP8 state a LoRA step keeps: every variable but
    `grad_amax_pending`. That one holds the last FP8 step's output-gradient
    amax until it is folded; a LoRA step gives it no gradient, which
    torch's optimizer leaves as it is (the next FP8 forward folds it) and
    JAX's writes as zeros, so on JAX the LoRA step folds it first
    (`after_lora`)."""
    return [to_numpy(v) for v in layer.fp8_state_variables if not v.path.endswith("grad_amax_pending")]


def after_lora(layer):
    """`kept_state` as LoRA steps leave it from the layer's state now: on
    JAX with the pending gradient amax folded (as the reference folds it)."""
    if keras.backend.backend() != "jax":
        return kept_state(layer)
    from tests.support.keras_reference import STATE_NAMES
    from tests.support.keras_reference import ReferenceSteps
    from tests.support.keras_reference import layer_state

    reference = ReferenceSteps(layer_state(layer), layer.active_recipe())
    reference.fold()
    return [reference.state[name] for name in STATE_NAMES if name != "grad_amax_pending"]


class SetWeightsTest(parameterized.TestCase):
    @parameterized.parameters(*KINDS)
    def test_kernel_and_bias_alone_raise_and_assign_nothing(self, kind):
        layer = make_layer(kind)
        train_steps(layer, 2, seed=1)
        before = values(layer)
        kernel, bias = rng_normal((16, 8), 3), rng_normal((8,), 4)
        with self.assertRaisesRegex(ValueError, "weight list of length 2.*expecting 10 weights"):
            layer.set_weights([kernel, bias])
        for got, want in zip(values(layer), before):
            np.testing.assert_array_equal(got, want)

    def test_a_model_rejects_its_plain_form_weights(self):
        def model(policy):
            keras.utils.set_random_seed(0)
            return keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, dtype=policy),
                                     keras.layers.Dense(4, dtype=policy)])

        fp8, plain = model(POLICY), model("float32")
        before = [to_numpy(v) for v in fp8.weights]
        with self.assertRaisesRegex(ValueError, "expecting"):
            fp8.set_weights(plain.get_weights())
        for got, want in zip([to_numpy(v) for v in fp8.weights], before):
            np.testing.assert_array_equal(got, want)

    @parameterized.parameters(*KINDS)
    def test_assigned_kernel_and_new_state_train_as_a_new_layer(self, kind):
        kernel, bias = rng_normal((16, 8), 5, scale=0.1), rng_normal((8,), 6)
        used = make_layer(kind)
        train_steps(used, 3, seed=10)  # state recorded for another kernel
        self.assertGreater(float(to_numpy(used.kernel_amax_history)[0]), 0)
        as_new_layer(used, kernel, bias)
        new = make_layer(kind)
        new.kernel.assign(kernel)
        new.bias.assign(bias)
        for got, want in zip(values(used), values(new)):
            np.testing.assert_array_equal(got, want)
        for step in range(2):
            x, upstream = rng_normal((4, 16), 20 + step), rng_normal((4, 8), 30 + step)
            y_used, dx_used, _ = train_call_with_grads(used, x, upstream)
            y_new, dx_new, _ = train_call_with_grads(new, x, upstream)
            np.testing.assert_array_equal(y_used, y_new)
            np.testing.assert_array_equal(dx_used, dx_new)
        for got, want in zip(values(used), values(new)):
            np.testing.assert_array_equal(got, want)

    @parameterized.parameters(*KINDS)
    def test_weights_of_another_fp8_layer_copy_the_state(self, kind):
        source, target = make_layer(kind), make_layer(kind)
        train_steps(source, 3, seed=40)
        target.set_weights(source.get_weights())
        for got, want in zip(values(target), values(source)):
            np.testing.assert_array_equal(got, want)
        x = rng_normal((4, 16), 50)
        np.testing.assert_array_equal(to_numpy(target(x)), to_numpy(source(x)))


class LoraTest(parameterized.TestCase):
    def test_lora_keeps_the_state_and_merges_into_the_model_without_lora(self):
        def build_model():
            keras.utils.set_random_seed(0)
            return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, dtype=POLICY),
                                     keras.layers.Dense(10, dtype=POLICY)])

        x, y = rng_normal((64, 16), 60), np.random.default_rng(61).integers(0, 10, 64)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model = build_model()
        model.compile(optimizer="adam", loss=loss)
        model.fit(x, y, batch_size=16, verbose=0)
        trained = [after_lora(layer) for layer in model.layers]
        for layer in model.layers:
            layer.enable_lora(4)
        model.compile(optimizer="adam", loss=loss)
        with self.assertWarnsRegex(UserWarning, "not in FP8.*LoRA"):
            model.fit(x, y, batch_size=16, verbose=0)
        for layer, state in zip(model.layers, trained):
            self.assertGreater(float(np.abs(to_numpy(layer.lora_kernel_b)).max()), 0)
            for got, want in zip(kept_state(layer), state):
                np.testing.assert_array_equal(got, want)

        path = os.path.join(tempfile.mkdtemp(), "lora.weights.h5")
        model.save_weights(path)
        merged = build_model()
        merged.load_weights(path)
        for layer, lora_layer, state in zip(merged.layers, model.layers, trained):
            self.assertIsInstance(layer, keras_fp8.layers.FP8Dense)
            self.assertFalse(layer.lora_enabled)
            np.testing.assert_array_equal(to_numpy(layer.kernel), to_numpy(lora_layer.kernel))
            np.testing.assert_array_equal(to_numpy(layer.bias), to_numpy(lora_layer.bias))
            for got, want in zip(kept_state(layer), state):
                np.testing.assert_array_equal(got, want)
        before = to_numpy(merged.layers[0].input_amax_history)
        merged.compile(optimizer="adam", loss=loss)
        merged.fit(x[:16], y[:16], batch_size=16, verbose=0)  # FP8 again: it records
        self.assertFalse(np.array_equal(to_numpy(merged.layers[0].input_amax_history), before))
