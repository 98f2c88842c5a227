"""What the monitor runs on the JAX backend: the probe's autodiff and the
statistics table, each one compiled program."""

import jax
import jax.numpy as jnp

from keras_fp8.monitor import statistics


def probe_function(loss_fn, gradients=True):
    """The probe's autodiff (`keras_fp8.monitor.probe`): returns `run(values,
    batch)`, compiled (`jax.jit`, once per batch shape), which returns
    `(loss, aux, {key: d loss / d y})` for every `y` that `loss_fn(tap,
    values, batch)` passes through `tap(key, y)`. A first trace
    (`jax.eval_shape`) finds the tapped tensors; then `jax.value_and_grad`
    differentiates with respect to a zero added to each (`y + 0` is `y`).
    With `gradients=False` the pass runs without differentiation and the
    dict is empty."""

    def forward(values, batch):
        loss, aux = loss_fn(lambda key, y: y, values, batch)
        return loss, aux, {}

    def run(values, batch):
        shapes = {}

        def shape_tap(key, y):
            shapes[key] = (y.shape, y.dtype)
            return y

        jax.eval_shape(lambda v, b: loss_fn(shape_tap, v, b), values, batch)
        offsets = {key: jnp.zeros(shape, dtype) for key, (shape, dtype) in shapes.items()}

        def offset_loss(offsets, values, batch):
            return loss_fn(lambda key, y: y + offsets[key], values, batch)

        (loss, aux), grads = jax.value_and_grad(offset_loss, has_aux=True)(offsets, values, batch)
        return loss, aux, grads

    return jax.jit(run if gradients else forward)


def compile_function(fn):
    """How the monitor runs its statistics table: one compiled program
    (eager JAX would compile every op of it separately)."""
    return jax.jit(fn)


def tensor_stats_function():
    """How the monitor's table computes one tensor's statistics:
    `statistics.tensor_stats` itself (`compile_function` compiles the whole
    table into one program)."""
    return statistics.tensor_stats
