"""Loss scaling for fp16 FP8 training.

`LossScaleOptimizer` is Keras's own (same arguments, `isinstance` holds, and
Keras's `compile` does not wrap it again), made FP8-aware: after every step it
writes the loss scale now in effect into each FP8 layer's
`grad_amax_pending[2]` and converts the pending gradient amax to that scale,
so the layer's next forward rescales its gradient amax history and scale by
the same factor as the loss scale (see `keras_fp8/layers/fp8_state.py`). A step
with non-finite gradients is skipped as in Keras: weights unchanged, the loss
scale halved, and (the pending amax not being overwritten) no gradient amax
recorded from that step.

`import keras_fp8` also makes `Model.compile` wrap the optimizer in this
class when the model's policy is an FP8 float16 policy
(`"fp8_hybrid_float16"`, `"fp8_e4m3_float16"`), as Keras does for
`"mixed_float16"`.

`FP8Adam`, `FP8AdamW` and `fp8_moments` (`keras_fp8/moments.py`) keep Adam's
moments in FP8; they compose with `LossScaleOptimizer` (wrap the FP8 one).
"""

import keras
from keras import ops
from keras.saving import register_keras_serializable

from keras_fp8 import compat
from keras_fp8 import policy as policy_lib
from keras_fp8.moments import FP8Adam  # noqa: F401 (public here)
from keras_fp8.moments import FP8AdamW  # noqa: F401
from keras_fp8.moments import fp8_moments  # noqa: F401


def _is_pending_grad_amax(variable):
    return getattr(variable, "_keras_fp8_pending_grad_amax", False)


def _retag(pending, old_scale, new_scale):
    """`[amax, token, _]` -> `[amax * new/old, token, new]`."""
    ratio = ops.divide(new_scale, old_scale)
    return ops.stack(
        [ops.multiply(pending[0], ratio), pending[1], ops.cast(new_scale, "float32")]
    )


@register_keras_serializable(package="keras_fp8")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras's dynamic `LossScaleOptimizer`, aware of FP8 gradient state.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
        initial_scale: Initial loss scale (a power of two keeps every rescale
            exact).
        dynamic_growth_steps: Finite steps before the scale doubles.
        **kwargs: As for `keras.optimizers.LossScaleOptimizer`.

    Example:

    ```python
    keras.mixed_precision.set_global_policy("fp8_hybrid_float16")
    model.compile(optimizer="adam", loss="mse")   # wrapped automatically
    isinstance(model.optimizer, keras_fp8.optimizers.LossScaleOptimizer)
    ```
    """

    def _scale_index(self):
        for i, v in enumerate(self.variables):
            if v is self.dynamic_scale:
                return i
        raise RuntimeError("LossScaleOptimizer has no dynamic_scale variable.")

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        index = self._scale_index()
        old_scale = optimizer_variables[index]
        new_trainable, new_optimizer = super().stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        new_scale = new_optimizer[index]
        new_trainable = list(new_trainable)
        for i, variable in enumerate(self._trainable_variables):
            if _is_pending_grad_amax(variable):
                new_trainable[i] = _retag(new_trainable[i], old_scale, new_scale)
        return new_trainable, new_optimizer

    def apply(self, grads, trainable_variables=None):
        old_scale = (
            ops.copy(self.dynamic_scale.value)
            if self.built
            else ops.convert_to_tensor(self.initial_scale, "float32")
        )
        super().apply(grads, trainable_variables)
        new_scale = self.dynamic_scale.value
        variables = (
            trainable_variables
            if trainable_variables is not None
            else self._trainable_variables
        )
        for variable in variables:
            if _is_pending_grad_amax(variable):
                variable.assign(_retag(variable.value, old_scale, new_scale))


def _policies(layer):
    """The policies a layer's own policy holds: itself, or for a
    `DTypePolicyMap` the one for the layer's path, its default and its
    entries."""
    policy = layer.dtype_policy
    if not isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return [policy]
    return [policy_lib.layer_policy(layer), policy.default_policy] + [policy[k] for k in policy]


def _computes_fp8_in_float16(model):
    """Whether `model` (or a layer in it) runs under an FP8 float16 policy:
    its own policy, a layer's (`convert` with `policy="fp8_hybrid_float16"`
    leaves the model's own policy as it was), or an entry of a
    `DTypePolicyMap` (as keras_hub models carry)."""
    return any(
        isinstance(policy, policy_lib.FP8DTypePolicy) and policy.compute_dtype == "float16"
        for layer in compat.sublayers(model)
        for policy in _policies(layer)
    )


def _keras_would_scale(model):
    """Whether Keras's own compile would wrap the optimizer: the model's
    policy is `mixed_float16`, which a `DTypePolicyMap` that `convert` put
    on the model (its default `mixed_float16`) hides from Keras."""
    policy = model.dtype_policy
    return (
        isinstance(policy, keras.dtype_policies.DTypePolicyMap)
        and policy.default_policy.name == "mixed_float16"
    )


def _with_fp8_loss_scaling(model, optimizer, auto_scale_loss):
    """The optimizer `compile` gets: wrapped in keras_fp8's `LossScaleOptimizer`
    where FP8 layers compute in float16 (as Keras wraps it for
    `"mixed_float16"`); Keras's own `LossScaleOptimizer` given by the user is
    re-wrapped with the same settings (it would not rescale the FP8 gradient
    state)."""
    if not auto_scale_loss or not (
        _computes_fp8_in_float16(model) or _keras_would_scale(model)
    ):
        return optimizer
    optimizer = keras.optimizers.get(optimizer)
    if optimizer is None or isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return LossScaleOptimizer(
            optimizer.inner_optimizer,
            initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps,
            name=optimizer.name,
        )
    return LossScaleOptimizer(optimizer, name="loss_scale_optimizer")


def register():
    """Installs the compile hook (idempotent; done at `import keras_fp8`:
    `keras_fp8/compat.py`, patch 3)."""
    compat.wrap_compile_optimizer(_with_fp8_loss_scaling)
