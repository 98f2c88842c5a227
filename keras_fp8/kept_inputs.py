"""Which FP8 layers' inputs stay alive in the compute dtype for the backward:
`kept_inputs`.

An FP8 layer keeps only the FP8 copy of its input for its backward (1 byte
per element instead of 2 in bfloat16). The compute-dtype input is freed
after the forward only where no other op keeps it: a `Multiply` of it with
another tensor, a layer that runs it through a bfloat16 matmul, a norm of
it all save it for their own backward, and then the FP8 copy saves nothing
there. `kept_inputs` runs one training forward pass of a model on a sample
batch and says, per FP8 layer call, which other layers (and ops) keep its
input and how many bytes stay alive.
"""

import contextlib
from typing import NamedTuple

import keras
from keras import ops

from keras_fp8 import backends
from keras_fp8 import compat
from keras_fp8.layers.fp8_state import FP8StateMixin


class KeptInput(NamedTuple):
    """One FP8 layer call of `kept_inputs`' pass and what keeps its input.

    Attributes:
        layer: The FP8 layer.
        shape: The shape of its input.
        dtype: The input's dtype (the layer's compute dtype).
        nbytes: The input's size in bytes.
        kept_by: `((path, op), ...)`, sorted: every op of the pass that
            saves the input (its memory) for the backward, `path` the chain
            of layer calls that ran it below the model (`"block/mul"`; `""`
            for an op outside the model's layers, such as the loss) and
            `op` the backend's name for it (torch: the autograd node, e.g.
            `Mul`; JAX: the primitive, e.g. `mul`). Empty where only the
            layer's FP8 copy is kept.
    """

    layer: object
    shape: tuple
    dtype: str
    nbytes: int
    kept_by: tuple

    @property
    def kept(self):
        """Whether the compute-dtype input stays alive for the backward."""
        return bool(self.kept_by)


class _InputRecorder:
    """Records the input of every FP8 layer call that runs an FP8 GEMM
    (`calls`: `[(layer, inputs), ...]` in the order the calls end). A call
    is seen through `compat.calls_through` (its input, as `call` gets it:
    after Keras's autocast) and its GEMM through `observe_gemms` (calls that
    run in the compute dtype keep their input as a plain layer does, and
    are left out)."""

    def __init__(self):
        self.calls = []
        self._open = []  # [layer, inputs, ran_fp8] of the calls running

    def call(self, layer, own_call, *args, **kwargs):
        inputs = args[0] if args else kwargs.get("inputs")
        entry = [layer, inputs, False]
        self._open.append(entry)
        try:
            return own_call(*args, **kwargs)
        finally:
            self._open.remove(entry)
            if entry[2]:
                self.calls.append((layer, inputs))

    def observe(self, layer, x, y):
        for entry in reversed(self._open):
            if entry[0] is layer:
                entry[2] = True
                break
        return y

    @contextlib.contextmanager
    def watching(self, layers):
        with contextlib.ExitStack() as stack:
            for layer in layers:
                # The pass is not one of the layer's calls: its last GEMM
                # (`fp8_execution`, what `summary` shows) stays the last
                # real call's.
                last = layer._last_gemm[0]
                stack.callback(layer._last_gemm.__setitem__, 0, last)
                stack.enter_context(compat.calls_through(
                    layer, lambda own, *a, layer=layer, **k: self.call(layer, own, *a, **k)))
                layer.observe_gemms(self.observe)
                stack.callback(layer.observe_gemms, None)
            yield


class _FunctionLoss(keras.losses.Loss):
    """A loss function `fn(y_true, y_pred)` as a `keras.losses.Loss` (its
    reduction and sample weights are Keras's)."""

    def __init__(self, fn):
        super().__init__(name=getattr(fn, "__name__", "loss"))
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)


def _loss_object(loss):
    """A `keras.losses.Loss` for `loss` (a Loss, a name or a function
    `fn(y_true, y_pred)`)."""
    if isinstance(loss, keras.losses.Loss):
        return loss
    try:
        fn = loss if callable(loss) else keras.losses.get(loss)
    except ValueError:
        fn = None
    if not callable(fn):
        raise ValueError(
            "Invalid `loss`. Expected a keras.losses.Loss, a loss name or a function fn(y_true, y_pred). "
            f"Received: loss={loss!r}")
    return _FunctionLoss(fn)


def _check_arguments(model, y, sample_weight, loss):
    if sample_weight is not None and y is None:
        raise ValueError("Invalid `sample_weight`. Expected it with `y` (it weighs the loss). Received: y=None")
    if loss is not None and y is None:
        raise ValueError("Invalid `loss`. Expected it with `y` (the loss compares y with the predictions). "
                         "Received: y=None")
    if y is not None and loss is None and getattr(model, "loss", None) is None:
        raise ValueError(
            f"Invalid `y`. Expected it for a model compiled with a loss, or with `loss=`; model {model.name!r} "
            "has no compiled loss and no `loss` was given.")


def _loss_value(model, x, y, sample_weight, y_pred, loss):
    """The pass's float32 loss: `loss`'s, else the model's compiled loss
    (with `y`), else the sum of the outputs (it saves nothing for the
    backward, so what is kept is what the model's layers keep)."""
    if loss is not None:
        value = loss(y, y_pred, sample_weight=sample_weight)
    elif y is not None:
        value = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    else:
        leaves = [leaf for leaf in keras.tree.flatten(y_pred) if leaf is not None]
        value = sum(ops.sum(ops.cast(leaf, "float32")) for leaf in leaves)
    return ops.cast(value, "float32")


def _fp8_state(layers):
    """The non-trainable FP8 state variables of `layers`, once each: the
    variables the pass maps to values of its own (on torch, copies: torch_ops
    updates them in place). Every other variable's assignments in the
    pass's `keras.StatelessScope` stay in the scope."""
    found, seen = [], set()
    for layer in layers:
        for variable in layer.fp8_state_variables if layer.built else ():
            if not variable.trainable and id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
    return found


def _below_model(path, model):
    """`path` with the model's own scope left out (`""`: the model itself,
    or outside it)."""
    if path == model.name:
        return ""
    prefix = model.name + "/"
    return path[len(prefix):] if path.startswith(prefix) else path


def kept_inputs(model, x, y=None, sample_weight=None, loss=None):
    """Which FP8 layers' compute-dtype inputs stay alive for the backward,
    and what keeps them.

    Runs one training forward pass of `model` on `x` (with `training=True`,
    as `fit` does) and the loss, and asks the backend what its backward pass
    would keep (the backward does not run): torch records every tensor the
    ops save for the backward (`torch.autograd.graph.saved_tensors_hooks`)
    and which layer was running; JAX traces the gradient's program
    (`jax.make_jaxpr`, nothing runs) and finds the values its backward reads
    (the residuals). An FP8 layer's input is kept where another op saves it
    (on torch: any tensor sharing its storage), with the layers and ops that
    save it. Nothing the pass does changes a variable: it runs in a
    `keras.StatelessScope` (on torch on copies of the FP8 state variables,
    which its FP8 ops update in place).

    Args:
        model: A Keras model or layer; one not built yet is built by a
            call on `x` first (inference mode: no FP8 state advances).
        x: A sample batch of inputs, as the model takes them (a few
            examples suffice: what is kept does not depend on the batch
            size, the bytes are this batch's).
        y: Optional targets for the loss: with the model's compiled loss,
            or with `loss`. Without them the pass's loss is the sum of the
            model's outputs (which keeps nothing itself).
        sample_weight: Optional sample weights for the loss (with `y`).
        loss: Optional loss used instead of the model's compiled one: a
            `keras.losses.Loss`, a loss name or a function
            `fn(y_true, y_pred)`. Needs `y`.

    Returns:
        A list of `KeptInput`, one per FP8 layer call of the pass that ran
        an FP8 GEMM (a layer called twice appears twice), in the order the
        calls ended. Calls below `min_gemm_size` or with FP8 off run in the
        compute dtype, as a plain layer (which keeps its input), and are
        left out.

    Raises:
        ValueError: `y`, `loss` or `sample_weight` given without what they
            need (see above).

    Example:

    >>> for kept in keras_fp8.inspection.kept_inputs(model, x[:8]):
    ...     if kept.kept:
    ...         print(kept.layer.name, kept.nbytes, kept.kept_by)
    """
    _check_arguments(model, y, sample_weight, loss)
    loss = None if loss is None else _loss_object(loss)
    layers = [layer for layer in compat.sublayers(model) if isinstance(layer, FP8StateMixin)]
    recorder = _InputRecorder()

    def loss_fn(trainable_values, other_values):
        recorder.calls.clear()
        mapping = list(zip(trainable, trainable_values)) + list(zip(others, other_values))
        with keras.StatelessScope(state_mapping=mapping), recorder.watching(layers):
            y_pred = model(x, training=True)
            value = _loss_value(model, x, y, sample_weight, y_pred, loss)
        return value, [inputs for _, inputs in recorder.calls]

    if not model.built:
        # Variables are made by the first call; the pass then maps them.
        model(x)
    trainable = list(model.trainable_variables)
    others = _fp8_state(layers)
    report = backends.saved_for_backward(
        loss_fn, [v.value for v in trainable], [v.value for v in others])
    found = []
    for (layer, _), (shape, dtype, nbytes, savers) in zip(recorder.calls, report):
        kept_by = tuple(sorted({(_below_model(path, model), op) for path, op in savers}))
        found.append(KeptInput(layer, shape, dtype, nbytes, kept_by))
    return found
