"""The probe: one pass over a batch that captures every FP8 GEMM's operands.

`FP8Monitor` needs, for each FP8 layer, the tensors its GEMMs quantize: the
layer's input (the `(M, K)` matrix), its kernel and its output gradient
(the `(M, N)` gradient of the GEMM's output, which the backward quantizes).
Training never keeps them, so the monitor runs a probe at the steps it
monitors: a forward pass of the model on a probe batch with
`training=False` and the gradient of the compiled loss, inside a
`keras.StatelessScope`, so that nothing it does changes a variable (no amax
recorded, no weight or metric touched).

For the duration of that pass the probe installs an observer on the FP8
layers it watches (`observe_gemms`, the one hook the layers have for the
monitor): each hands its GEMM's input and output to `Capture.record`, and
the backend's `probe_function` differentiates the loss with respect to
those outputs (torch autograd; JAX `value_and_grad` over zero offsets).
Outside a probe no layer has an observer.
"""

import contextlib

import keras
import numpy as np
from keras import ops

from keras_fp8 import inspection
from keras_fp8.monitor import statistics


class Capture:
    """What one probe pass saw: the FP8 GEMMs, in call order.

    Attributes:
        calls: `[(layer, x2d), ...]`, one entry per FP8 GEMM of the pass
            (a layer called twice appears twice), `x2d` the `(M, K)` input.
    """

    def __init__(self, tap):
        self._tap = tap
        self.calls = []

    def record(self, layer, x, y):
        """The layers' observer: called with a GEMM's input `x` and output
        `y`; returns `y` as the backend's tap passes it on (its gradient is
        captured)."""
        key = len(self.calls)
        self.calls.append((layer, ops.stop_gradient(x)))
        return self._tap(key, y)


@contextlib.contextmanager
def capturing(layers, tap):
    """Installs a `Capture`'s observer on `layers` (FP8 layers) while the
    block runs; its outputs pass through `tap(key, y)`."""
    capture = Capture(tap)
    installed = []
    try:
        for layer in layers:
            layer.observe_gemms(capture.record)
            installed.append(layer)
        yield capture
    finally:
        for layer in installed:
            layer.observe_gemms(None)


def loss_needs_labels(model):
    """Whether `model`'s loss takes labels: it was compiled with a `loss`
    (a Keras loss compares labels with the predictions)."""
    return getattr(model, "loss", None) is not None


def _shape(value):
    shape = getattr(value, "shape", None)
    return tuple(np.shape(value)) if shape is None else tuple(shape)


def check_batch(batch, argument="probe"):
    """The batch `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)` as
    `(x, y, sample_weight)` (None for the parts not given), checked: a
    tuple of one to three parts, `x` given, every array of at least one
    example and all with the same number of examples (first dimension).

    Raises:
        ValueError: naming `argument`, what was expected and what was given.
    """
    expected = "x, (x,), (x, y) or (x, y, sample_weight), as the model's train_step takes it"
    if batch is None:
        raise ValueError(f"Invalid `{argument}`. Expected {expected}. Received: {argument}=None")
    if isinstance(batch, tuple):
        if not 1 <= len(batch) <= 3:
            raise ValueError(f"Invalid `{argument}`. Expected {expected}. Received: a tuple of {len(batch)} elements")
        parts = tuple(batch) + (None,) * (3 - len(batch))
    else:
        parts = (batch, None, None)
    if parts[0] is None:
        raise ValueError(f"Invalid `{argument}`. Expected {expected}. Received: x=None")
    sizes = []
    for name, part in zip(("x", "y", "sample_weight"), parts):
        for leaf in keras.tree.flatten(part):
            if leaf is None:
                continue
            shape = _shape(leaf)
            if not shape:
                raise ValueError(
                    f"Invalid `{argument}`. Expected arrays with a batch dimension ({expected}). "
                    f"Received: {name} of type {type(leaf).__name__} and shape {shape}")
            if shape[0] == 0:
                raise ValueError(
                    f"Invalid `{argument}`. Expected a batch of at least one example. "
                    f"Received: {name} of shape {shape}")
            sizes.append((name, shape))
    if len({shape[0] for _, shape in sizes}) > 1:
        given = ", ".join(f"{name} of shape {shape}" for name, shape in sizes)
        raise ValueError(
            f"Invalid `{argument}`. Expected x, y and sample_weight with the same number of examples "
            f"(first dimension). Received: {given}")
    return parts


def _compiled_loss(model, x, y, sample_weight, y_pred):
    loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "scale_loss"):
        # Under fp16 loss scaling the gradient training quantizes is the
        # scaled one (and the gradient state is kept in its units).
        loss = optimizer.scale_loss(loss)
    return ops.cast(loss, "float32")


def _variables(model):
    """Every variable a probe may read: the model's and its optimizer's
    (the loss scale), once each."""
    optimizer = getattr(model, "optimizer", None)
    found, seen = [], set()
    for variable in list(model.variables) + list(getattr(optimizer, "variables", None) or []):
        if id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)
    return found


def _described(value):
    shapes = [_shape(leaf) for leaf in keras.tree.flatten(value) if leaf is not None]
    if not shapes:
        return "None"
    return str(shapes[0]) if len(shapes) == 1 else str(shapes)


class Probe:
    """Runs probes of one compiled model (see the module docstring).

    The backend's `probe_function` turns the pass into a function of the
    variables' values and the batch (JAX compiles it once per batch shape;
    torch runs it eagerly).

    Args:
        model: A compiled Keras model.
        layers: Optional FP8 layers of `model` to capture (default: all).

    Attributes:
        model: The model.
        layers: The FP8 layers it captures.

    Example:

    >>> loss, calls = keras_fp8.monitor.Probe(model)(x_batch, y_batch)
    >>> [(layer.name, x2d.shape, g2d.shape) for layer, x2d, g2d in calls]
    """

    def __init__(self, model, layers=None):
        self.model = model
        self.layers = inspection.fp8_layers(model) if layers is None else list(layers)
        self._variables = _variables(model)
        # Per kind of pass (with gradients or not): its function, and the
        # layers of its GEMMs in call order (found while it runs or traces).
        self._functions = {}
        self._layers = {}

    def _pass(self, with_loss, tap, values, batch):
        x, y, sample_weight = batch
        mapping = None if values is None else list(zip(self._variables, values))
        with keras.StatelessScope(state_mapping=mapping), capturing(self.layers, tap) as capture:
            y_pred = self.model(x, training=False)
            loss = None
            if with_loss:
                try:
                    loss = _compiled_loss(self.model, x, y, sample_weight, y_pred)
                except (ValueError, TypeError, RuntimeError) as error:
                    if type(error).__name__ == "OutOfMemoryError":
                        raise
                    said = (str(error).strip() or repr(error)).splitlines()[0]
                    raise ValueError(
                        "Invalid `probe`: the model's loss failed on it. Expected a batch as the model's "
                        "train_step takes it (x, y and sample_weight that its loss accepts). Received "
                        f"shapes: x {_described(x)}, y {_described(y)}, sample_weight {_described(sample_weight)}; "
                        f"the model's output {_described(y_pred)}. The loss said: {said}"
                    ) from error
        self._layers[with_loss] = [layer for layer, _ in capture.calls]
        return loss, [x2d for _, x2d in capture.calls]

    def __call__(self, x, y=None, sample_weight=None):
        """Runs the probe on one batch.

        Args:
            x: The batch's inputs, as the model's `train_step` takes them
                (after any preprocessing).
            y: Optional labels. Without them, on a model compiled with a
                `loss` (which compares labels with the predictions), the
                probe runs the forward pass only.
            sample_weight: Optional sample weights.

        Returns:
            `(loss, calls)`: the loss (float32 scalar; None for a forward
            pass only) and `[(layer, x2d, g2d), ...]`, one entry per FP8
            GEMM of the forward pass; `g2d` is the gradient of the loss with
            respect to the GEMM's output (None where the output does not
            reach the loss, or without a loss).
        """
        gradients = y is not None or not loss_needs_labels(self.model)
        function = self._functions.get(gradients)
        if function is None:
            function = statistics.backend_functions().probe_function(
                lambda tap, values, batch: self._pass(gradients, tap, values, batch), gradients=gradients)
            self._functions[gradients] = function
        values = [variable.value for variable in self._variables]
        loss, inputs, grads = function(values, (x, y, sample_weight))
        layers = self._layers[gradients]
        return loss, [(layer, x2d, grads.get(i)) for i, (layer, x2d) in enumerate(zip(layers, inputs))]


def run(model, x, y=None, sample_weight=None):
    """Runs one probe of `model` on a batch: `Probe(model)(x, y,
    sample_weight)` (a `Probe` kept between calls compiles once)."""
    return Probe(model)(x, y, sample_weight)
