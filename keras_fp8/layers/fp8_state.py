"""FP8 state of a layer: Keras variables, the per-call settings, the updates.

Shared by `FP8Dense` and `FP8EinsumDense`. Each FP8 layer owns, per operand
role (`input`, `kernel`, `grad`), a `{role}_scale` (shape `()`) and a
`{role}_amax_history` (shape `(H,)`), all float32 and non-trainable; the
checkpoint is the state.

The output gradient's amax cannot be assigned from inside a backward pass on
every backend (JAX forbids it), so it travels through the gradient channel:
`grad_amax_pending` is a trainable `(3,)` variable with
`overwrite_with_gradient=True`. Its "gradient" is `[amax, token, 0]`; Keras
optimizers overwrite it with that value instead of applying an update. The
next training forward folds a fresh pending amax into `grad_amax_history` and
`grad_scale`. `grad_fold_state = [folds, last_token, last_loss_scale]`
(non-trainable) tells a fresh pending value from one already folded: a skipped
fp16 step never reaches the optimizer's overwrite, and a layer called twice in
one step folds once. Two uses in one step sum their amaxes (an upper bound of
the true amax) and never record twice.

The third entry carries the fp16 loss scale: `keras_fp8.optimizers.
LossScaleOptimizer` writes the loss scale in effect after each step there (and
converts the pending amax to it); when it differs from `last_loss_scale`, the
fold rescales the gradient history and scale by the same factor, so the next
E5M2 gradient neither saturates nor underflows. Zero means "no loss scaling".
"""

import warnings
import weakref

from keras import ops
from keras.saving import serialize_keras_object

from keras_fp8 import backends
from keras_fp8 import compat
from keras_fp8 import policy as policy_lib
from keras_fp8 import probe
from keras_fp8 import recipes
from keras_fp8.autocast import current as current_autocast

ROLES = ("input", "kernel", "grad")
# The order in which the state is saved after the layer's own weights.
STATE_VARIABLE_NAMES = (
    "input_scale",
    "input_amax_history",
    "kernel_scale",
    "kernel_amax_history",
    "grad_scale",
    "grad_amax_history",
    "grad_amax_pending",
    "grad_fold_state",
)
# When an FP8 layer runs without FP8 (a non-FP8 policy, or autocast(enabled=
# False)), its `grad_amax_pending` gets no gradient, and Keras's optimizers on
# torch warn about it at every step. That is expected, so silence exactly the
# warnings whose list holds nothing but these variables.
PENDING_ONLY_MISSING_GRADIENTS = (
    r"Gradients do not exist for variables "
    r"\[('[^']*grad_amax_pending'(, )?)+\] when minimizing the loss"
)
warnings.filterwarnings("ignore", message=PENDING_ONLY_MISSING_GRADIENTS)

# layer -> the reasons it was warned about (once each).
_WARNED = weakref.WeakKeyDictionary()


def warn_runs_without_fp8(layer, reason, what="runs"):
    """Warns once per layer and reason that `layer` runs without FP8.

    Args:
        layer: The layer (named in the warning by its path, else its name).
        reason: Why, e.g. "LoRA is enabled".
        what: What the layer does instead, e.g. "runs" (this call) or "is
            built as a plain layer".
    """
    reasons = _WARNED.setdefault(layer, set())
    if reason in reasons:
        return
    reasons.add(reason)
    name = layer.path or layer.name
    warnings.warn(
        f"keras_fp8: layer '{name}' ({type(layer).__name__}) {what} in "
        f"{layer.compute_dtype}, not in FP8: {reason}.",
        stacklevel=3,
    )


def quantize_error(layers, mode):
    """The error Keras's `quantize(mode)` gets on FP8 layers or policies."""
    names = ", ".join(f"'{l.path or l.name}'" for l in layers[:3])
    more = f" and {len(layers) - 3} more" if len(layers) > 3 else ""
    return ValueError(
        f"Cannot quantize(mode={mode!r}): these layers are FP8 layers or run "
        "under an FP8 dtype policy (keras_fp8), which Keras's quantization "
        f"does not know: {names}{more}. Call `keras_fp8.unconvert(model)` "
        "first (it returns FP8 layers to plain Dense/EinsumDense with the same "
        "weights, and FP8 policies to their mixed-precision policies), then "
        "`model.quantize(...)`."
    )


def state_layout(history_len):
    """The shapes of the FP8 state variables, in checkpoint order."""
    history = (history_len,)
    return [(), history, (), history, (), history, (3,), (3,)]


def is_fp8_checkpoint(store, own_count):
    """Whether `store` holds `own_count` layer variables followed by the FP8
    state (`STATE_VARIABLE_NAMES`, in their order and shapes)."""
    if len(store.keys()) != own_count + len(STATE_VARIABLE_NAMES):
        return False
    shapes = [tuple(store[str(own_count + i)].shape) for i in range(len(STATE_VARIABLE_NAMES))]
    history = shapes[1]
    return len(history) == 1 and shapes == state_layout(history[0])


class FP8StateMixin:
    """Creates, resolves and updates the FP8 state of a layer.

    A layer using this mixin calls `_build_fp8_state()` in `build`, and in
    `call` asks `_fp8_call_recipe(inputs)` whether this call runs in FP8, then
    multiplies with `_fp8_matmul(x2d, kernel2d, recipe, training)`; it says
    what GEMM a call makes (`_gemm_dims`).
    """

    def __call__(self, *args, **kwargs):
        fast = getattr(backends.get(), "fast_layer_call", None)
        # A probe (keras_fp8.probe) captures in `_fp8_matmul`: no fast call.
        if fast is not None and probe.active() is None:
            outputs = fast(self, args, kwargs)
            if outputs is not None:
                return outputs
        return super().__call__(*args, **kwargs)

    def _fast_call_accepts(self, x):
        """Whether `x` passes the layer's input spec (checked cheaply)."""
        return False

    def _fp8_call_is_linear(self):
        """Whether `call` is exactly the FP8 linear on the layer's kernel and
        bias, then its activation (the torch backend's fast call runs that)."""
        return False

    def _gemm_dims(self, input_shape):
        """`(M, K, N)` of the matmul a call on `input_shape` makes (None
        where a dimension is not known yet)."""
        raise NotImplementedError

    def _init_fp8(self, recipe, min_gemm_size):
        self.recipe = recipes.get(recipe) if recipe is not None else None
        self.min_gemm_size = recipes.check_min_gemm_size(min_gemm_size)
        # `[(M, K, N)]` of the last call, for `fp8_execution`. A list set
        # here, in the instance dict (Keras's attribute tracking costs host
        # time), and written in place by calls: under torch.compile a write
        # into the layer's `__dict__` would make dynamo break the graph at
        # the next layer's `Layer.__call__` (it reads a mappingproxy, the
        # call signature's parameters, after a dict changed).
        self.__dict__["_last_gemm"] = [None]

    def _build_time_recipe(self):
        if self.recipe is not None:
            return self.recipe
        scope = current_autocast()
        if scope is not None and scope.enabled:
            return scope.recipe
        policy = policy_lib.layer_policy(self)
        if isinstance(policy, policy_lib.FP8DTypePolicy):
            return policy.recipe
        return recipes.DelayedScaling()

    def _build_fp8_state(self):
        """Creates the FP8 state variables (after the base layer's `build`,
        which has locked the layer's variable tracker)."""
        # Replicated under any keras.distribution, whatever its LayoutMap
        # says: one scale per tensor (docs/numerics.md, "Many devices").
        with compat.unlocked_tracker(self), compat.replicated_variables():
            self._add_fp8_state_variables()

    def _add_fp8_state_variables(self):
        recipe = self._build_time_recipe()
        history_len = getattr(recipe, "history_len", 1)

        def state(name, shape, initializer="zeros", trainable=False):
            # float32 and never autocast: `.value` is the stored tensor.
            variable = self.add_weight(
                name=name,
                shape=shape,
                initializer=initializer,
                dtype="float32",
                trainable=trainable,
                autocast=False,
            )
            setattr(self, name, variable)
            return variable

        for role in ROLES:
            state(f"{role}_scale", (), initializer="ones")
            state(f"{role}_amax_history", (history_len,))
        pending = state("grad_amax_pending", (3,), trainable=True)
        pending.overwrite_with_gradient = True
        # Lets keras_fp8.optimizers.LossScaleOptimizer find it.
        pending._keras_fp8_pending_grad_amax = True
        backends.mark_amax_channel(pending)
        state("grad_fold_state", (3,))
        # Where the FP8 matmuls of the state's device run is decided now, in
        # eager code, rather than in the first call (perhaps a traced one).
        # Only for a layer built to compute in FP8: no warning about FP8
        # hardware for one that never will.
        if self._fp8_recipe() is not None:
            backends.prepare_device(pending.value)

    @property
    def fp8_state_variables(self):
        """The FP8 state variables, in checkpoint order."""
        return [getattr(self, name) for name in STATE_VARIABLE_NAMES]

    def _fp8_recipe(self, policy=None):
        """The recipe for this call, or None when the layer runs without FP8.

        An active `autocast` scope decides first (its recipe wins); otherwise
        the layer is FP8 when its dtype policy (resolved by its path in a
        `DTypePolicyMap`; `policy`, where the caller resolved it already) is
        an `FP8DTypePolicy`, using the layer's own `recipe` if set, else the
        policy's.
        """
        scope = current_autocast()
        if scope is not None:
            return scope.recipe if scope.enabled else None
        if policy is None:
            policy = policy_lib.layer_policy(self)
        if not isinstance(policy, policy_lib.FP8DTypePolicy):
            return None
        return self.recipe if self.recipe is not None else policy.recipe

    def _min_gemm_size(self, policy=None):
        """The layer's `min_gemm_size`, else its policy's (`policy`, where
        the caller resolved it already; None: neither)."""
        if self.min_gemm_size is not None:
            return self.min_gemm_size
        if policy is None:
            policy = policy_lib.layer_policy(self)
        return getattr(policy, "min_gemm_size", None)

    def _runs_compute_dtype(self, inputs, policy=None):
        """Whether a call on `inputs` runs the compute-dtype layer: an empty
        matmul, or `M*N*K` below `min_gemm_size` (the layer's, its policy's,
        else the backend's default for where `inputs` lives)."""
        dims = self._gemm_dims(tuple(inputs.shape))
        self._last_gemm[0] = dims  # for `fp8_execution` (keras_fp8.summary)
        size = recipes.gemm_size(dims)
        if size is None:  # the output spec is the same either way
            return False
        if size == 0:
            return True
        limit = self._min_gemm_size(policy)
        if limit is None:
            limit = backends.get().default_min_gemm_size(inputs)
        return size < limit

    def active_recipe(self, or_built=False):
        """The recipe a call would take now: an `autocast` scope's, else the
        layer's own or its policy's; None where the layer runs without FP8
        now (then, with `or_built`, the recipe its state was built for)."""
        if not isinstance(or_built, bool):
            raise TypeError(f"or_built: expected a bool, got {or_built!r}")
        recipe = self._fp8_recipe()
        return self._build_time_recipe() if recipe is None and or_built else recipe

    def fp8_execution(self):
        """What the layer's last call ran.

        Returns:
            `(runs, gemm, min_gemm_size)`: `runs` is `"FP8"`, the compute
            dtype with the reason (FP8 off under the layer's policy, an
            empty matmul, below `min_gemm_size`), or `"not called"`; `gemm`
            the last call's `(M, K, N)` (None before a call); the
            `min_gemm_size` in effect (the layer's, its policy's, else the
            backend's default for where the kernel lives; None before
            `build`).
        """
        dims = self._last_gemm[0]
        limit = self._min_gemm_size()
        if limit is None and self.built:
            limit = backends.get().default_min_gemm_size(compat.raw_value(self._kernel))
        if self._fp8_recipe() is None:
            return f"{self.compute_dtype} (FP8 off)", dims, limit
        size = recipes.gemm_size(dims)
        if size is None:
            return "not called", dims, limit
        if size == 0:
            return f"{self.compute_dtype} (empty)", dims, limit
        if limit is not None and size < limit:
            return f"{self.compute_dtype} (< min_gemm_size)", dims, limit
        return "FP8", dims, limit

    def _raw_value(self, variable):
        """The variable's value in its own dtype (no mixed-precision cast)."""
        return compat.raw_value(variable)

    def _fp8_matmul(self, x, kernel, recipe, training, bias=None):
        """`x @ kernel (+ bias)` with FP8 operands; updates the state if training.

        Args:
            x: `(M, K)` tensor in the compute dtype.
            kernel: `(K, N)` float32 kernel (the variable's own value).
            recipe: The call's recipe.
            training: Whether to record amaxes and fold the gradient amax.
            bias: Optional `(N,)` bias variable, added to the output (fused
                into the GEMM where the backend can).

        Returns:
            `(M, N)` tensor in `x`'s dtype.
        """
        y = backends.get().fp8_matmul(self, x, kernel, bias, recipe, bool(training))
        capture = probe.active()
        return y if capture is None else capture.record(self, x, y)

    def _fp8_call_recipe(self, inputs):
        """The recipe of this call (None: run as the base layer).

        A call FP8 cannot take (LoRA enabled, inputs that are not floating
        point) runs as the base layer, with a one-time warning naming the
        layer; its FP8 state does not advance.
        """
        # One lookup of the policy per call (a DTypePolicyMap matches paths).
        policy = policy_lib.layer_policy(self)
        recipe = self._fp8_recipe(policy)
        if recipe is None or self._runs_compute_dtype(inputs, policy):
            return None
        if self.lora_enabled:
            warn_runs_without_fp8(self, "LoRA is enabled (FP8 layers do not support LoRA)")
            return None
        dtype = ops.dtype(inputs) if hasattr(inputs, "dtype") else None
        if dtype is None or "float" not in str(dtype):
            warn_runs_without_fp8(
                self, f"FP8 needs floating-point inputs, and these are {dtype}"
            )
            return None
        return recipe

    def quantize(self, mode=None, type_check=True, config=None):
        """Keras's quantization does not apply to FP8 layers: a ValueError
        saying to `keras_fp8.unconvert` the model first."""
        raise quantize_error([self], mode)

    # Saving: Keras's Dense/EinsumDense save only their own kernel and bias,
    # so the FP8 state follows them, in STATE_VARIABLE_NAMES order.

    def _own_variable_count(self):
        return 2 if self.bias is not None else 1

    def save_own_variables(self, store):
        if not self.built:
            return
        super().save_own_variables(store)
        start = self._own_variable_count()
        for i, variable in enumerate(self.fp8_state_variables):
            store[str(start + i)] = variable

    def load_own_variables(self, store):
        """Loads an FP8 checkpoint of the layer, or one of its plain
        `Dense`/`EinsumDense` form (kernel and bias only: the FP8 state is
        then reset to a fresh layer's)."""
        if not self.built:
            return
        start = self._own_variable_count()
        count = len(store.keys())
        if count not in (start, start + len(STATE_VARIABLE_NAMES)):
            compat.check_load_own_variables(self, store)  # Keras's error
            raise ValueError(
                f"Layer '{self.name}' expected {start} or "
                f"{start + len(STATE_VARIABLE_NAMES)} variables, but received "
                f"{count} variables during loading."
            )
        self._kernel.assign(store["0"])
        if self.bias is not None:
            self.bias.assign(store["1"])
        if count == start:
            self._reset_fp8_state()
        else:
            for i, variable in enumerate(self.fp8_state_variables):
                variable.assign(store[str(start + i)])
        if self.lora_enabled:
            # As Keras's Dense: the saved kernel has the LoRA update merged.
            self.lora_kernel_a.assign(ops.zeros(self.lora_kernel_a.shape))
            self.lora_kernel_b.assign(ops.zeros(self.lora_kernel_b.shape))

    def _reset_fp8_state(self):
        """Sets the FP8 state to a freshly built layer's (scales 1, the rest
        0)."""
        for name, variable in zip(STATE_VARIABLE_NAMES, self.fp8_state_variables):
            fill = ops.ones if name.endswith("_scale") else ops.zeros
            variable.assign(fill(variable.shape, "float32"))

    def get_config(self):
        config = super().get_config()
        config["min_gemm_size"] = self.min_gemm_size
        config["recipe"] = (
            serialize_keras_object(self.recipe) if self.recipe is not None else None
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if config.get("recipe") is not None:
            config["recipe"] = recipes.get(config["recipe"])
        return super().from_config(config)
