"""An FP8 layer's training calls, computed with `keras_fp8.numerics` alone.

The oracle the layers are tested against on every backend: the state rules,
the fold and the exact emulated matmuls of the keras.ops reference, run
explicitly call by call (no layer, no backend dispatch).
"""

import keras
import numpy as np
from keras import ops

from keras_fp8 import numerics
from tests.support.backend_utils import to_numpy

STATE_NAMES = (
    "input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history",
    "grad_scale", "grad_amax_history", "grad_amax_pending", "grad_fold_state",
)


def layer_state(layer):
    """The layer's FP8 state variables as NumPy arrays, by name."""
    return {name: to_numpy(getattr(layer, name)) for name in STATE_NAMES}


class ReferenceSteps:
    """The state of one FP8 layer, advanced by explicit reference calls.

    Args:
        state: The starting state (`layer_state(layer)` of a fresh layer).
        recipe: The layer's recipe.
        compute_dtype: The dtype the layer computes in.
    """

    def __init__(self, state, recipe, compute_dtype="bfloat16"):
        self.state = {k: np.array(v, np.float32) for k, v in state.items()}
        self.recipe = recipe
        self.dtype = compute_dtype

    def _t(self, name):
        return ops.convert_to_tensor(self.state[name], "float32")

    def fold(self):
        """Folds the pending gradient amax (`numerics.fold_pending_grad_amax`),
        as every training call does first (on JAX also one that runs in the
        compute dtype). Returns the token this call's backward emits."""
        hist, scale, fold_state, token = numerics.fold_pending_grad_amax(
            self._t("grad_amax_pending"), self._t("grad_fold_state"), self._t("grad_amax_history"),
            self._t("grad_scale"), self.recipe.backward_format, self.recipe)
        self.state["grad_amax_history"] = to_numpy(hist)
        self.state["grad_scale"] = to_numpy(scale)
        self.state["grad_fold_state"] = to_numpy(fold_state)
        return token

    def step(self, x2d, kernel, upstream2d, bias=None, training=True):
        """One call (and, when training, its backward and the optimizer's
        overwrite of `grad_amax_pending`).

        Returns:
            `(y, dx, dkernel, dbias)` as float32 NumPy arrays (gradients None
            when not training).
        """
        r = self.recipe
        fwd, bwd = r.forward_format, r.backward_format
        x = ops.cast(ops.convert_to_tensor(x2d), self.dtype)
        k = ops.convert_to_tensor(kernel, "float32")
        b = None if bias is None else ops.cast(ops.convert_to_tensor(bias, "float32"), self.dtype)
        scales = {}
        for role, t in (("input", x), ("kernel", k)):
            used, hist, scale = numerics.operand_scale(
                numerics.compute_amax(t), self._t(f"{role}_amax_history"), self._t(f"{role}_scale"), fwd, r,
                record=training)
            scales[role] = used
            self.state[f"{role}_amax_history"] = to_numpy(hist)
            self.state[f"{role}_scale"] = to_numpy(scale)
        token = self.fold() if training else ops.zeros((), "float32")
        y, x_q, k_q = numerics.fp8_forward(x, k, scales["input"], scales["kernel"], r, bias=b)
        if not training:
            return to_numpy(y), None, None, None
        g = ops.cast(ops.convert_to_tensor(upstream2d), self.dtype)
        dx, dk, dpending = numerics.fp8_backward(
            g, x_q, k_q, scales["input"], scales["kernel"], self._t("grad_scale"), self._t("grad_amax_history"),
            token, r, self.dtype, "float32")
        self.state["grad_amax_pending"] = to_numpy(dpending)
        db = None
        if bias is not None:
            db = to_numpy(ops.cast(ops.sum(ops.cast(g, "float32"), axis=0), self.dtype))
        return to_numpy(y), to_numpy(dx), to_numpy(dk), db


def assert_same_state(layer, expected, names=STATE_NAMES):
    """Every FP8 state variable of `layer` equals `expected`'s, bit for bit."""
    got = layer_state(layer)
    for name in names:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def backend():
    return keras.backend.backend()
