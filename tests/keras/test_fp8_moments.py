"""FP8 optimizer moments (FP8Adam, FP8AdamW, fp8_moments): training, state
size, saving and resuming, custom loops, loss scaling, FP8 layers, errors.
The numerics against NumPy: tests/reference/test_optimizer_moments.py."""

import os
import tempfile

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8
from keras_fp8.layers import FP8Dense
from keras_fp8.optimizers import FP8Adam
from keras_fp8.optimizers import FP8AdamW
from keras_fp8.optimizers import fp8_moments
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import run_under_other_backend
from tests.support.backend_utils import to_numpy

# FP8 numerics at test sizes, on every device (conftest.py).
pytestmark = pytest.mark.usefixtures("fp8_at_every_size")


def _regression_data(n=256):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 32)).astype("float32")
    teacher = rng.standard_normal((32, 8)).astype("float32")
    y = (np.tanh(x @ teacher) + 0.05 * rng.standard_normal((n, 8))).astype("float32")
    return x, y


def _mlp(optimizer, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(96, activation="relu", name="hidden1"),
        keras.layers.Dense(64, activation="relu", name="hidden2"),
        keras.layers.Dense(8, name="out"),
    ])
    if optimizer is not None:
        model.compile(optimizer=optimizer, loss="mse")
    return model


def _fp8_model(optimizer):
    """FP8 layers (with `grad_amax_pending`) and a plain layer, under fp8_hybrid."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((6, 16))
    h = FP8Dense(32, activation="relu", name="up")(inp)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = FP8Dense(8, name="down")(h)
    out = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    model = keras.Model(inp, out)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _raw(variable):
    return np.asarray(keras.ops.convert_to_numpy(variable.value))


def _all_state(model):
    """Every variable of the model and its optimizer, by position and name
    (paths carry the unique suffixes of the model's and optimizer's names)."""
    state = {f"{i}/{v.name}": _raw(v) for i, v in enumerate(model.variables)}
    state.update({f"optimizer/{i}/{v.name}": _raw(v) for i, v in enumerate(model.optimizer.variables)})
    return state


class TrainingTest(parameterized.TestCase):
    def test_mlp_loss_tracks_adamw(self):
        # FP8Adam runs the same update (tests/reference checks both).
        x, y = _regression_data()
        plain = _mlp(keras.optimizers.AdamW(3e-3)).fit(x, y, batch_size=32, epochs=5, shuffle=False, verbose=0)
        fp8 = _mlp(FP8AdamW(3e-3)).fit(x, y, batch_size=32, epochs=5, shuffle=False, verbose=0)
        plain, fp8 = np.array(plain.history["loss"]), np.array(fp8.history["loss"])
        self.assertLess(fp8[-1], 0.5 * fp8[0])  # it trains
        # Each epoch's mean loss within 2% of the float32 optimizer's.
        np.testing.assert_allclose(fp8, plain, rtol=0.02)

    def test_state_is_3_bytes_a_parameter(self):
        model = _mlp(FP8AdamW())
        model.optimizer.build(model.trainable_variables)
        optimizer = model.optimizer
        total = 0
        for i, variable in enumerate(model.trainable_variables):
            n = int(np.prod(variable.shape))
            blocks = -(-n // 128)
            m, ms = optimizer._momentums[i], optimizer._momentum_scales[i]
            v, vs = optimizer._velocities[i], optimizer._velocity_scales[i]
            self.assertEqual(_raw(m).nbytes, n)          # 1 byte a parameter
            self.assertEqual(_raw(v).nbytes, 2 * n)      # 2 bytes a parameter
            self.assertEqual(_raw(ms).nbytes, 4 * blocks)
            self.assertEqual(_raw(vs).nbytes, 4 * blocks)
            total += sum(_raw(s).nbytes for s in (m, ms, v, vs))
        params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        state = sum(_raw(v).nbytes for v in optimizer.variables)
        self.assertLessEqual(total, 3.07 * params + 8 * len(model.trainable_variables))
        plain = keras.optimizers.AdamW()
        plain.build(model.trainable_variables)
        plain_state = sum(_raw(v).nbytes for v in plain.variables)
        self.assertLess(state, 0.4 * plain_state)

    def test_keras_file_round_trip_and_resume_bit_exact(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid")
        x, y = rng_normal((48, 6, 16), 5), rng_normal((48, 8), 6)
        straight = _fp8_model(FP8AdamW(1e-2, weight_decay=0.1, global_clipnorm=1.0))
        straight.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

        first = _fp8_model(FP8AdamW(1e-2, weight_decay=0.1, global_clipnorm=1.0))
        first.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        path = os.path.join(tempfile.mkdtemp(), "half.keras")
        first.save(path)
        resumed = keras.models.load_model(path)
        self.assertIsInstance(resumed.optimizer, FP8AdamW)
        self.assertEqual(resumed.optimizer.get_config(), first.optimizer.get_config())
        saved, loaded = _all_state(first), _all_state(resumed)
        self.assertEqual(sorted(saved), sorted(loaded))
        for name in saved:
            self.assertEqual(loaded[name].dtype, saved[name].dtype, msg=name)
            np.testing.assert_array_equal(loaded[name], saved[name], err_msg=name)
        resumed.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

        expected, got = _all_state(straight), _all_state(resumed)
        self.assertEqual(sorted(expected), sorted(got))
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)

    def test_custom_training_loop(self):
        x, y = _regression_data(64)
        model = _mlp(None)
        optimizer = FP8AdamW(1e-2)
        loss_fn = keras.losses.MeanSquaredError()
        losses = []
        if keras.backend.backend() == "torch":
            import torch

            for _ in range(12):
                model.zero_grad()
                loss = loss_fn(keras.ops.convert_to_tensor(y), model(keras.ops.convert_to_tensor(x)))
                loss.backward()
                grads = [v.value.grad for v in model.trainable_variables]
                with torch.no_grad():
                    optimizer.apply(grads, model.trainable_variables)
                losses.append(float(to_numpy(loss.detach())))
        else:
            import jax

            optimizer.build(model.trainable_variables)

            def compute_loss(trainable, non_trainable, xb, yb):
                pred, non_trainable = model.stateless_call(trainable, non_trainable, xb)
                return loss_fn(yb, pred), non_trainable

            @jax.jit
            def step(state, xb, yb):
                trainable, non_trainable, opt_vars = state
                (loss, non_trainable), grads = jax.value_and_grad(compute_loss, has_aux=True)(
                    trainable, non_trainable, xb, yb)
                trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
                return loss, (trainable, non_trainable, opt_vars)

            state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
                     [v.value for v in optimizer.variables])
            for _ in range(12):
                loss, state = step(state, x, y)
                losses.append(float(loss))
            for variable, value in zip(optimizer.variables, state[2]):
                variable.assign(value)
        self.assertEqual(int(to_numpy(optimizer.iterations)), 12)
        self.assertLess(losses[-1], 0.7 * losses[0])
        m, v = optimizer.moments(model.trainable_variables[0])
        self.assertGreater(float(np.abs(to_numpy(m)).max()), 0.0)
        self.assertGreater(float(to_numpy(v).max()), 0.0)

    def test_gradient_accumulation(self):
        x, y = _regression_data(64)
        model = _mlp(FP8AdamW(1e-2, gradient_accumulation_steps=2))
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        self.assertEqual(int(to_numpy(model.optimizer.iterations)), 2)
        self.assertTrue(all(np.isfinite(to_numpy(w)).all() for w in model.weights))


class FP8LayersTest(parameterized.TestCase):
    def test_grad_amax_pending_bypasses_the_update(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid")
        x, y = rng_normal((24, 6, 16), 5), rng_normal((24, 8), 6)
        fp8 = _fp8_model(FP8AdamW(1e-2))
        plain = _fp8_model(keras.optimizers.AdamW(1e-2))
        for model in (fp8, plain):
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        optimizer = fp8.optimizer
        pending = [i for i, v in enumerate(fp8.trainable_variables) if v.overwrite_with_gradient]
        self.assertLen(pending, 2)
        for i in pending:
            for state in (optimizer._momentums, optimizer._momentum_scales, optimizer._velocities,
                          optimizer._velocity_scales):
                self.assertIsNone(state[i])
        self.assertLen(optimizer.variables, 2 + 4 * (len(fp8.trainable_variables) - len(pending)))
        for name in ("up", "down"):
            got, want = fp8.get_layer(name), plain.get_layer(name)
            # The channel holds what the backward wrote ([amax, token, 0]),
            # the same token sequence as under Keras's AdamW.
            self.assertEqual(to_numpy(got.grad_amax_pending)[1], to_numpy(want.grad_amax_pending)[1])
            self.assertEqual(to_numpy(got.grad_amax_pending)[2], 0.0)
            self.assertEqual(np.count_nonzero(to_numpy(got.grad_amax_history)), 2)

    def test_loss_scale_optimizer_wraps_it_and_skips_overflow(self):
        keras.mixed_precision.set_global_policy("fp8_hybrid_float16")
        x, y = rng_normal((8, 6, 16), 5), rng_normal((8, 8), 6)
        model = _fp8_model(FP8AdamW(1e-2))
        self.assertIsInstance(model.optimizer, keras_fp8.optimizers.LossScaleOptimizer)
        self.assertIsInstance(model.optimizer.inner_optimizer, FP8AdamW)
        model.train_on_batch(x, y)
        before = _all_state(model)
        # Targets far outside the fp16 range once scaled: the step is skipped.
        model.train_on_batch(x, np.full((8, 8), 6e4, "float32"))
        after = _all_state(model)
        inner = model.optimizer.inner_optimizer
        keys = [k for k in before if "_momentum_" in k or "_velocity_" in k]
        self.assertLen(keys, 4 * 6)
        keys += [f"{i}/{v.name}" for i, v in enumerate(model.variables)
                 if v.trainable and not v.overwrite_with_gradient]
        for key in keys:  # the moments and the weights
            np.testing.assert_array_equal(after[key], before[key], err_msg=key)
        model.train_on_batch(x, y)
        self.assertTrue(all(np.isfinite(to_numpy(w)).all() for w in model.weights))
        self.assertEqual(int(to_numpy(inner.iterations)), 2)


class APITest(parameterized.TestCase):
    def test_fp8_moments_keeps_the_configuration(self):
        schedule = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=100, warmup_target=3e-3,
                                                          warmup_steps=10)
        original = keras.optimizers.AdamW(schedule, weight_decay=0.1, beta_2=0.95, global_clipnorm=1.0,
                                          name="opt")
        converted = fp8_moments(original)
        self.assertIsInstance(converted, FP8AdamW)
        self.assertIsInstance(converted, keras.optimizers.AdamW)
        self.assertEqual(converted.get_config(), original.get_config())
        self.assertIsInstance(fp8_moments("adam"), FP8Adam)
        self.assertNotIsInstance(fp8_moments("adam"), keras.optimizers.AdamW)
        self.assertIsInstance(fp8_moments("adamw"), FP8AdamW)
        self.assertIs(fp8_moments(converted), converted)

    def test_fp8_moments_inside_a_loss_scale_optimizer(self):
        original = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**10)
        converted = fp8_moments(original)
        self.assertIsInstance(converted, keras_fp8.optimizers.LossScaleOptimizer)
        self.assertIsInstance(converted.inner_optimizer, FP8Adam)
        self.assertEqual(converted.initial_scale, 2.0**10)

    def test_serialization(self):
        optimizer = FP8AdamW(2e-3, weight_decay=0.2, beta_1=0.8, epsilon=1e-6)
        again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
        self.assertIsInstance(again, FP8AdamW)
        self.assertEqual(again.get_config(), optimizer.get_config())
        self.assertEqual(keras.optimizers.serialize(optimizer)["registered_name"], "keras_fp8>FP8AdamW")

    @parameterized.named_parameters(
        ("sgd", lambda: keras.optimizers.SGD(), "SGD"),
        ("sgd_name", lambda: "sgd", "SGD"),
        ("adafactor", lambda: keras.optimizers.Adafactor(), "Adafactor"),
        ("lion", lambda: keras.optimizers.Lion(), "Lion"),
        ("nadam", lambda: keras.optimizers.Nadam(), "Nadam"),
    )
    def test_unsupported_optimizers(self, make, name):
        with self.assertRaisesRegex(ValueError, f"fp8_moments: `optimizer` must be keras.optimizers.Adam.*{name}"):
            fp8_moments(make())

    def test_adam_subclass_with_its_own_update(self):
        class MyAdam(keras.optimizers.Adam):
            def update_step(self, gradient, variable, learning_rate):
                super().update_step(gradient, variable, learning_rate)

        with self.assertRaisesRegex(ValueError, "`optimizer` must be.*MyAdam"):
            fp8_moments(MyAdam())

    def test_built_optimizer(self):
        optimizer = keras.optimizers.AdamW()
        optimizer.build([keras.Variable(np.zeros((3,), "float32"))])
        with self.assertRaisesRegex(ValueError, "fp8_moments: `optimizer` .* is already built"):
            fp8_moments(optimizer)

    @parameterized.named_parameters(
        ("amsgrad", dict(amsgrad=True), "`amsgrad=True` is not supported"),
        ("beta_1", dict(beta_1=1.0), "`beta_1` must be a number in \\[0, 1\\).*got 1.0"),
        ("beta_2", dict(beta_2="0.9"), "`beta_2` must be a number in \\[0, 1\\).*got '0.9'"),
        ("epsilon", dict(epsilon=-1e-7), "`epsilon` must be a number >= 0.*got -1e-07"),
    )
    def test_bad_options(self, options, message):
        for cls in (FP8Adam, FP8AdamW):
            with self.assertRaisesRegex(ValueError, f"{cls.__name__}: {message}"):
                cls(**options)
        with self.assertRaisesRegex(ValueError, f"FP8AdamW: {message}"):
            fp8_moments(keras.optimizers.AdamW(**options))

    def test_moments_of_a_variable(self):
        variable = keras.Variable(np.ones((200,), "float32"))
        optimizer = FP8Adam(0.1)
        grad = np.linspace(-1.0, 1.0, 200).astype("float32")
        optimizer.apply([keras.ops.convert_to_tensor(grad)], [variable])
        m, v = (to_numpy(t) for t in optimizer.moments(variable))
        np.testing.assert_allclose(m, 0.1 * grad, rtol=2.0**-4, atol=1e-3)
        np.testing.assert_allclose(np.sqrt(v), np.sqrt(0.001) * np.abs(grad), rtol=2.0**-10, atol=1e-6)


def test_saved_under_the_other_backend_loads_and_resumes(tmp_path):
    script = (
        "import numpy as np, keras, keras_fp8\n"
        "from tests.keras.test_fp8_moments import _mlp, _regression_data, _all_state\n"
        "x, y = _regression_data(64)\n"
        "m = _mlp(keras_fp8.optimizers.FP8AdamW(1e-2))\n"
        "m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)\n"
        f"m.save({str(tmp_path / 'm.keras')!r})\n"
        f"np.savez({str(tmp_path / 'state.npz')!r}, **_all_state(m))\n"
    )
    run_under_other_backend(script)
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, FP8AdamW)
    saved = np.load(tmp_path / "state.npz")
    got = _all_state(loaded)
    # In order (the loaded model's variable paths, which the optimizer's
    # variable names repeat, lose the saved model's name).
    assert len(saved.files) == len(got)
    for name, (key, value) in zip(saved.files, got.items()):
        assert name.split("_")[-1] == key.split("_")[-1], (name, key)
        np.testing.assert_array_equal(value, saved[name], err_msg=name)
    # Each backend's default: the saved `jit_compile` is the saving backend's
    # (True from JAX would make torch compile the step with torch.compile).
    loaded.jit_compile = keras.backend.backend() == "jax"
    x, y = _regression_data(64)
    loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(to_numpy(loaded.optimizer.iterations)) == 8
