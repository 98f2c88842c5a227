"""The probe: one pass over a batch that captures every FP8 GEMM's operands.

`keras_fp8.callbacks.FP8Monitor` needs, for each FP8 layer, the tensors its
GEMMs quantize: the layer's input (the `(M, K)` matrix), its kernel and its
output gradient (the `(M, N)` gradient of the GEMM's output, which the
backward quantizes). Training never keeps them, so the monitor runs a probe
at the steps it monitors: a forward pass of the model on a probe batch with
`training=False` and the gradient of the compiled loss, inside a capture
scope and a `keras.StatelessScope`, so that nothing it does changes a
variable (no amax recorded, no weight or metric touched).

The capture scope is a module global that FP8 layers read once per call
(`active()`): None outside a probe. Under `jit_compile` (JAX tracing,
torch.compile) it is read while tracing only, so a compiled training step
holds nothing of it; an eager call pays one global read. While a probe runs,
the layers hand each GEMM's input and output to `Capture.record`, and the
backend module's `probe_function` differentiates the loss with respect to
those outputs (torch autograd; JAX `value_and_grad` over zero offsets).
"""

import contextlib

import keras
from keras import ops

from keras_fp8 import backends

# The capture of the probe running now, or None.
_ACTIVE = None


def active():
    """The active `Capture`, or None (the FP8 layers' one check per call)."""
    return _ACTIVE


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
        """Called by an FP8 layer with its GEMM's input `x` and output `y`;
        returns `y` as the backend's tap passes it on (its gradient is
        captured)."""
        key = len(self.calls)
        self.calls.append((layer, ops.stop_gradient(x)))
        return self._tap(key, y)


@contextlib.contextmanager
def capturing(tap):
    """Activates a `Capture` whose outputs pass through `tap(key, y)`."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("keras_fp8.probe: a probe is already running.")
    capture = Capture(tap)
    _ACTIVE = capture
    try:
        yield capture
    finally:
        _ACTIVE = None


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


class Probe:
    """Runs probes of one compiled model (see the module docstring).

    The backend's `probe_function` turns the pass into a function of the
    variables' values and the batch (JAX compiles it once per batch shape;
    torch runs it eagerly).

    Example:

    >>> loss, calls = keras_fp8.probe.Probe(model)(x_batch, y_batch)
    >>> [(layer.name, x2d.shape, g2d.shape) for layer, x2d, g2d in calls]
    """

    def __init__(self, model):
        self.model = model
        self._variables = _variables(model)
        self._layers = []
        self._function = backends.get().probe_function(self._loss)

    def _loss(self, tap, values, batch):
        x, y, sample_weight = batch
        mapping = None if values is None else list(zip(self._variables, values))
        with keras.StatelessScope(state_mapping=mapping), capturing(tap) as capture:
            y_pred = self.model(x, training=False)
            loss = _compiled_loss(self.model, x, y, sample_weight, y_pred)
        self._layers = [layer for layer, _ in capture.calls]
        return loss, [x2d for _, x2d in capture.calls]

    def __call__(self, x, y=None, sample_weight=None):
        """Runs the probe on one batch.

        Args:
            x, y, sample_weight: One batch, as the model's `train_step` takes
                it (after any preprocessing).

        Returns:
            `(loss, calls)`: the loss (float32 scalar) and `[(layer, x2d,
            g2d), ...]`, one entry per FP8 GEMM of the forward pass; `g2d`
            is the gradient of the loss with respect to the GEMM's output
            (None where the output does not reach the loss).
        """
        values = [variable.value for variable in self._variables]
        loss, inputs, grads = self._function(values, (x, y, sample_weight))
        return loss, [(layer, x2d, grads.get(i)) for i, (layer, x2d) in enumerate(zip(self._layers, inputs))]


def run(model, x, y=None, sample_weight=None):
    """Runs one probe of `model` on a batch: `Probe(model)(x, y,
    sample_weight)` (a `Probe` kept between calls compiles once)."""
    return Probe(model)(x, y, sample_weight)
