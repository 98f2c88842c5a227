"""Adam and AdamW with their moments in FP8: 3 bytes of state a parameter, not 8.

The first moment is stored in E4M3 and the second as its square root in
float16, each with one float32 scale per block of 128 elements
(`keras_fp8.numerics`, "FP8 optimizer moments"; docs/numerics.md,
"Optimizer moments"). Every step dequantizes them, runs Keras's Adam update
in float32 and quantizes the new moments; the weights stay in their own
dtype (float32 master weights under the mixed and FP8 policies).

The state is Keras variables (the E4M3 bytes as `uint8`, `float16`, and
`float32` scales), so `model.fit`, custom loops, `model.save` / `.keras`
files and both backends work as with Keras's own optimizers; variables with
`overwrite_with_gradient` (the FP8 layers' `grad_amax_pending`) get no state
and keep bypassing the update.
"""

import numbers

import keras
from keras import ops
from keras.saving import register_keras_serializable

from keras_fp8 import numerics

# The E4M3 payload is stored as its bytes: a float8 Keras variable does not
# survive a `.keras` file (torch cannot hand a float8 tensor to NumPy, and
# h5py writes float8 arrays as opaque bytes that Keras does not read back).
_PAYLOAD_DTYPE = "uint8"
_E4M3 = "float8_e4m3fn"


def _check_beta(owner, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}: `{name}` must be a number in [0, 1) with FP8 moments; got {value!r}.")


def _check_options(owner, beta_1, beta_2, epsilon, amsgrad):
    _check_beta(owner, "beta_1", beta_1)
    _check_beta(owner, "beta_2", beta_2)
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not epsilon >= 0.0:
        raise ValueError(f"{owner}: `epsilon` must be a number >= 0; got {epsilon!r}.")
    if amsgrad:
        raise ValueError(
            f"{owner}: `amsgrad=True` is not supported with FP8 moments (its running maximum of the second "
            f"moment is not stored in a compact format); expected amsgrad=False, got amsgrad={amsgrad!r}."
        )


class _FP8Moments:
    """The FP8-moment state and update of `keras.optimizers.Adam` (and so of
    AdamW, which only adds the decoupled weight decay the base optimizer
    applies before `update_step`)."""

    def build(self, var_list):
        if self.built:
            return
        # The base optimizer's build (iterations, accumulators, EMA), not
        # Adam's: its float32 moments are what this class replaces.
        super(keras.optimizers.Adam, self).build(var_list)
        self._momentums, self._momentum_scales = [], []
        self._velocities, self._velocity_scales = [], []
        for variable in var_list:
            if self._overwrite_variable_with_gradient(variable):
                for state in (self._momentums, self._momentum_scales, self._velocities, self._velocity_scales):
                    state.append(None)
                continue
            name = variable.path.replace("/", "_") if hasattr(variable, "path") else str(variable.name)
            layout = getattr(variable, "_layout", None)
            blocks = numerics.moment_blocks(variable.shape)
            self._momentums.append(self.add_variable(
                variable.shape, dtype=_PAYLOAD_DTYPE, layout=layout, name=f"{name}_momentum_e4m3"))
            self._momentum_scales.append(self.add_variable(
                (blocks,), initializer="ones", dtype="float32", name=f"{name}_momentum_scale"))
            self._velocities.append(self.add_variable(
                variable.shape, dtype="float16", layout=layout, name=f"{name}_velocity_sqrt_f16"))
            self._velocity_scales.append(self.add_variable(
                (blocks,), initializer="ones", dtype="float32", name=f"{name}_velocity_scale"))

    def update_step(self, gradient, variable, learning_rate):
        i = self._get_variable_index(variable)
        self._update_variable(variable, gradient, learning_rate, self._momentums[i], self._momentum_scales[i],
                              self._velocities[i], self._velocity_scales[i])

    def _update_variable(self, variable, gradient, learning_rate, m, m_scale, v, v_scale):
        """One variable's step on its state variables: what
        `keras_fp8.compile_optimizer` compiles, once for all the variables
        of one shape."""
        new_variable, m_q, m_scales, v_q, v_scales = numerics.adam_update_fp8_moments(
            variable.value, gradient, ops.view(m.value, _E4M3), m_scale.value, v.value, v_scale.value,
            learning_rate, self.iterations, self.beta_1, self.beta_2, self.epsilon)
        self.assign(variable, ops.cast(new_variable, variable.dtype))
        self.assign(m, ops.view(m_q, _PAYLOAD_DTYPE))
        self.assign(m_scale, m_scales)
        self.assign(v, v_q)
        self.assign(v_scale, v_scales)

    def moments(self, variable):
        """The moments of `variable` in float32, as the next step reads them.

        Args:
            variable: One of the variables the optimizer was built with.

        Returns:
            `(m, v)`, float32 tensors shaped like `variable`.
        """
        i = self._get_variable_index(variable)
        if self._momentums[i] is None:
            raise ValueError(f"{variable.path} is updated by overwrite_with_gradient; it has no moments.")
        m = numerics.dequantize_first_moment(ops.view(self._momentums[i].value, _E4M3), self._momentum_scales[i].value)
        v = numerics.dequantize_second_moment(self._velocities[i].value, self._velocity_scales[i].value)
        return m, v


@register_keras_serializable(package="keras_fp8")
class FP8Adam(_FP8Moments, keras.optimizers.Adam):
    """`keras.optimizers.Adam` with its moments stored in FP8.

    The first moment in E4M3 and the second as `sqrt(v)` in float16, each
    with a float32 scale per block of 128 elements of the flattened
    variable: 1 + 2 bytes of state per parameter (plus 8 bytes per 128),
    where Adam keeps 4 + 4. Each step runs Adam's own float32 update on the
    dequantized moments. `isinstance(opt, keras.optimizers.Adam)` holds.

    Args:
        learning_rate: A float, a `LearningRateSchedule` or a callable, as
            for `keras.optimizers.Adam`.
        beta_1: The first moment's decay, a Python number in [0, 1).
        beta_2: The second moment's decay, a Python number in [0, 1).
        epsilon: Added to `sqrt(v)`, a Python number >= 0.
        amsgrad: Must be `False` (not supported with FP8 moments).
        **kwargs: The base optimizer's arguments (`weight_decay`,
            `clipnorm`, `global_clipnorm`, `use_ema`,
            `gradient_accumulation_steps`, `name`, ...).

    Example:

    ```python
    model.compile(optimizer=keras_fp8.optimizers.FP8Adam(1e-3), loss="mse")
    ```
    """

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False, **kwargs):
        _check_options(type(self).__name__, beta_1, beta_2, epsilon, amsgrad)
        super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
                         amsgrad=amsgrad, **kwargs)


@register_keras_serializable(package="keras_fp8")
class FP8AdamW(_FP8Moments, keras.optimizers.AdamW):
    """`keras.optimizers.AdamW` with its moments stored in FP8.

    As `FP8Adam` (the same state and update), with AdamW's decoupled weight
    decay. `isinstance(opt, keras.optimizers.AdamW)` holds.

    Args:
        learning_rate: A float, a `LearningRateSchedule` or a callable, as
            for `keras.optimizers.AdamW`.
        weight_decay: The decoupled weight decay.
        beta_1: The first moment's decay, a Python number in [0, 1).
        beta_2: The second moment's decay, a Python number in [0, 1).
        epsilon: Added to `sqrt(v)`, a Python number >= 0.
        amsgrad: Must be `False` (not supported with FP8 moments).
        **kwargs: The base optimizer's arguments (`clipnorm`,
            `global_clipnorm`, `use_ema`, `gradient_accumulation_steps`,
            `name`, ...).

    Example:

    ```python
    optimizer = keras_fp8.optimizers.FP8AdamW(1e-3, weight_decay=0.1)
    model.compile(optimizer=optimizer, loss="mse")
    ```
    """

    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 amsgrad=False, **kwargs):
        _check_options(type(self).__name__, beta_1, beta_2, epsilon, amsgrad)
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, beta_1=beta_1, beta_2=beta_2,
                         epsilon=epsilon, amsgrad=amsgrad, **kwargs)


def has_fp8_moments(optimizer):
    """Whether `optimizer` keeps its moments in FP8 (`FP8Adam`, `FP8AdamW`)."""
    return isinstance(optimizer, _FP8Moments)


def _is_keras_adam(optimizer):
    """Keras's own Adam or AdamW (the torch backend's subclasses of them
    included), not a subclass with its own update."""
    cls = type(optimizer)
    return (
        isinstance(optimizer, keras.optimizers.Adam)
        and cls.update_step is keras.optimizers.Adam.update_step
        and cls.build is keras.optimizers.Adam.build
    )


def fp8_moments(optimizer):
    """The same optimizer with its moments stored in FP8.

    Args:
        optimizer: A `keras.optimizers.Adam` or `AdamW` (instance or
            identifier such as `"adamw"`), not built yet; or a
            `keras.optimizers.LossScaleOptimizer` around one (the result is
            `keras_fp8.optimizers.LossScaleOptimizer` around the FP8 one).
            An `FP8Adam` / `FP8AdamW` is returned as it is.

    Returns:
        An `FP8Adam` or `FP8AdamW` with `optimizer`'s configuration.

    Raises:
        ValueError: for any other optimizer (SGD, Adafactor, Lion, a
            subclass of Adam with its own update, ...), an optimizer that
            already has state (built), or options FP8 moments do not
            support (`amsgrad=True`).

    Example:

    ```python
    model.compile(optimizer=keras_fp8.optimizers.fp8_moments("adamw"), loss="mse")
    ```
    """
    from keras_fp8 import optimizers as optimizers_lib

    given = optimizer
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizers_lib.LossScaleOptimizer(
            fp8_moments(optimizer.inner_optimizer),
            initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps,
            name=optimizer.name,
        )
    if isinstance(optimizer, _FP8Moments):
        return optimizer
    if not _is_keras_adam(optimizer):
        raise ValueError(
            "fp8_moments: `optimizer` must be keras.optimizers.Adam or keras.optimizers.AdamW (or a "
            f"LossScaleOptimizer around one); got {type(optimizer).__name__} ({given!r}). Other optimizers keep "
            "their float32 state."
        )
    if optimizer.built:
        raise ValueError(
            f"fp8_moments: `optimizer` ({optimizer.name}) is already built and holds float32 moments; pass it "
            "before the first step (or before compile), or create a new one."
        )
    cls = FP8AdamW if isinstance(optimizer, keras.optimizers.AdamW) else FP8Adam
    return cls.from_config(optimizer.get_config())
