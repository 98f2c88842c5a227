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

import contextlib
import threading
import warnings
import weakref

import keras
import numpy as np
from keras import ops
from keras.saving import serialize_keras_object

from keras_fp8 import backends
from keras_fp8 import compat
from keras_fp8 import policy as policy_lib
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


def warn_runs_without_fp8(layer, reason, what="runs", runs_in=None):
    """Warns once per layer and reason that `layer` runs without FP8.

    Args:
        layer: The layer (named in the warning by its path, else its name).
        reason: Why, e.g. "LoRA is enabled".
        what: What the layer does instead, e.g. "runs" (this call) or "is
            built as a plain layer".
        runs_in: The dtype it computes in (None: its compute dtype).
    """
    reasons = _WARNED.setdefault(layer, set())
    if reason in reasons:
        return
    reasons.add(reason)
    name = layer.path or layer.name
    warnings.warn(
        f"keras_fp8: layer '{name}' ({type(layer).__name__}) {what} in "
        f"{runs_in or layer.compute_dtype}, not in FP8: {reason}.",
        stacklevel=3,
    )


def _plain_name(layer):
    """The Keras class `layer`'s plain calls run (`Dense`, `EinsumDense`)."""
    for cls in type(layer).__mro__:
        if cls in (keras.layers.Dense, keras.layers.EinsumDense):
            return cls.__name__
    return type(layer).__name__


def _plain_result_dtype(dtype, compute_dtype):
    """The dtype the plain layer's call gives for inputs of `dtype` (its
    matmul with the kernel in `compute_dtype`): e.g. complex64 for complex64
    inputs, the compute dtype for integer ones."""
    try:
        return keras.backend.result_type(str(dtype), compute_dtype)
    except Exception:  # a dtype Keras's promotion rules do not know
        return compute_dtype


# layer -> the lock its eager training calls hold across the read, update
# and write-back of its FP8 state.
_STATE_LOCKS = weakref.WeakKeyDictionary()
_STATE_LOCKS_GUARD = threading.Lock()


def _state_lock(layer, training):
    """What a call of `layer` holds while it reads and updates the FP8 state.

    A training call reads the histories and scales, computes, and writes them
    back; two threads calling one layer at once would both read the same
    history, and one call's amaxes would be lost. So an eager training call
    holds the layer's lock across that (concurrent calls of one layer take
    turns; different layers do not wait for each other). Inference calls
    write nothing and take no lock. Under tracing (a compiled train step,
    `torch.compile`) nothing is locked: the state update is part of the
    compiled program, and a lock there would break a torch.compile graph.
    (On torch, the eager call on the compiled kernels is one C++ call that
    keeps the GIL until it has queued all its work, in order, on the
    device.)
    """
    if not training or compat.traced():
        return contextlib.nullcontext()
    lock = _STATE_LOCKS.get(layer)
    if lock is None:
        with _STATE_LOCKS_GUARD:
            lock = _STATE_LOCKS.setdefault(layer, threading.RLock())
    return lock


def _to_numpy(value):
    """A checkpoint entry (an h5py dataset, an array, a tensor or a Keras
    variable) as a NumPy array."""
    if isinstance(value, keras.Variable) or ops.is_tensor(value):
        return ops.convert_to_numpy(value)
    return np.asarray(value)


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

    A layer using this mixin calls `build_fp8_state()` in `build`, and in
    `call` asks `_fp8_call_config(inputs)` whether this call runs in FP8
    (and with which backend config), then multiplies with
    `_fp8_matmul(x2d, kernel2d, config, training)`; it says what GEMM a call
    makes (`_gemm_dims`).
    """

    def _gemm_dims(self, input_shape):
        """`(M, K, N)` of the matmul a call on `input_shape` makes (None
        where a dimension is not known yet)."""
        raise NotImplementedError

    def init_fp8(self, recipe, min_gemm_size):
        """Sets the FP8 arguments (`__init__`, and `keras_fp8.convert` on a
        plain layer whose class it swapped).

        Args:
            recipe: A recipe, its name, or None (the policy's).
            min_gemm_size: The smallest M*K*N that runs FP8, or None.
        """
        self.recipe = recipes.get(recipe) if recipe is not None else None
        self.min_gemm_size = recipes.check_min_gemm_size(min_gemm_size)
        # `[(M, K, N)]` of the last call, for `fp8_execution`. A list set
        # here, in the instance dict (Keras's attribute tracking costs host
        # time), and written in place by calls: under torch.compile a write
        # into the layer's `__dict__` would make dynamo break the graph at
        # the next layer's `Layer.__call__` (it reads a mappingproxy, the
        # call signature's parameters, after a dict changed).
        self.__dict__["_last_gemm"] = [None]
        # The last FP8 call's (recipe, min_gemm_size, backend config), written
        # in place for the same reason.
        self.__dict__["_fp8_backend_config"] = [None]
        self._check_not_quantized(self.dtype_policy)

    def _check_not_quantized(self, policy):
        """Raises for a Keras quantized policy (`"int8_from_float32"`...):
        Keras would build its quantized variables and call next to the FP8
        state, and the outputs would be neither's."""
        if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
            if not self.path:
                return
            policy = policy[self.path]
        if policy.quantization_mode is not None:
            raise ValueError(
                f"Invalid `dtype` for the FP8 layer '{self.path or self.name}' "
                f"({type(self).__name__}): a quantized dtype policy "
                f"('{policy.name}', quantization_mode='{policy.quantization_mode}') "
                "cannot be combined with FP8. Expected an FP8 policy (e.g. "
                "'fp8_hybrid') or a float one ('float32', 'mixed_bfloat16'); for "
                "Keras's quantization use a plain Dense/EinsumDense. "
                f"Received: dtype={policy.name!r}"
            )

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

    def build_fp8_state(self):
        """Creates the FP8 state variables: from `build`, after the base
        layer's (which has locked the layer's variable tracker), and from
        `keras_fp8.convert` on an already built layer."""
        # A DTypePolicyMap entry is known by path only now.
        self._check_not_quantized(self.dtype_policy)
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

    def _resolved_min_gemm_size(self, like, policy=None):
        """The `min_gemm_size` in effect: the layer's, else its policy's, else
        the backend's default for where `like` lives. The one place the
        limit is resolved."""
        limit = self._min_gemm_size(policy)
        return backends.get().default_min_gemm_size(like) if limit is None else limit

    def fp8_kernel(self):
        """The variable the layer's FP8 matmul quantizes (Dense's and
        EinsumDense's stored kernel, without a LoRA update; a
        ReversibleEmbedding's projection matrix), for the monitor and
        `keras_fp8.summary`."""
        return self._kernel

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
            limit = self._resolved_min_gemm_size(compat.raw_value(self._kernel))
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

    # How `_fp8_matmul`'s kernel is stored: `(K, N)` ("in_out", Keras's
    # Dense) or `(N, K)` ("out_in", a tied embedding matrix, read as stored).
    _kernel_layout = "in_out"

    def _fp8_matmul(self, x, kernel, config, training, bias=None, source=None):
        """`x @ kernel (+ bias)` with FP8 operands; updates the state if training.

        Args:
            x: `(M, K)` tensor in the compute dtype.
            kernel: `(K, N)` float32 kernel (the variable's own value), or
                `(N, K)` where the layer's `_kernel_layout` is "out_in".
            config: The call's backend config (`_fp8_call_config`).
            training: Whether to record amaxes and fold the gradient amax.
            bias: Optional `(N,)` bias variable, added to the output (fused
                into the GEMM where the backend can).
            source: `(inputs, layout)`: the tensor the layer was called on
                and a hashable description of how `x` was made from it, so
                that layers reading the same tensor quantize it once
                (docs/numerics.md, "One quantize per tensor"); None: `x`
                is not shared.

        Returns:
            `(M, N)` tensor in `x`'s dtype.
        """
        with _state_lock(self, training):
            y = backends.get().fp8_matmul(self, x, kernel, bias, config, bool(training), self._kernel_layout,
                                          source)
        observer = self._gemm_observer
        return y if observer is None else observer(self, x, y)

    # Set by `observe_gemms` on the instance; None: no observer.
    _gemm_observer = None

    def observe_gemms(self, observer):
        """Installs or removes the layer's GEMM observer.

        `keras_fp8.monitor`'s probe installs one on the layers it watches
        while it runs; without one an FP8 call reads one attribute.

        Args:
            observer: `observer(layer, x, y) -> y`, called with each FP8
                GEMM's `(M, K)` input `x` and `(M, N)` output `y` (what it
                returns stands for the output); None removes the observer.

        Raises:
            RuntimeError: when the layer has an observer already (a probe
                is running).
        """
        if observer is None:
            self.__dict__.pop("_gemm_observer", None)
            return
        if self._gemm_observer is not None:
            raise RuntimeError(
                f"Layer '{self.path or self.name}' has a GEMM observer already: a probe "
                "(keras_fp8.monitor) is running on it.")
        # Into the instance dict: Keras's attribute tracking is not needed.
        self.__dict__["_gemm_observer"] = observer

    def _fp8_call_config(self, inputs, training=False):
        """The backend config of this call's FP8 matmul (None: run as the
        base layer).

        The call runs as the base layer where FP8 is off for the layer, for
        an empty matmul, below `min_gemm_size` (`_resolved_min_gemm_size`),
        and where FP8 cannot take it (LoRA enabled, inputs that are not
        floating point: with a one-time warning naming the layer); its FP8
        state does not advance, but a training call keeps the pending
        gradient amax of the last FP8 step (`_keep_pending_grad_amax`).
        The config is made once per recipe and limit
        (`backends.linear_config`) and kept on the layer.
        """
        # One lookup of the policy per call (a DTypePolicyMap matches paths).
        policy = policy_lib.layer_policy(self)
        recipe = self._fp8_recipe(policy)
        if recipe is None:
            return None
        config = self._fp8_config_for(inputs, recipe, policy, training)
        if config is None and training:
            self._keep_pending_grad_amax(recipe)
        return config

    def _keep_pending_grad_amax(self, recipe):
        """A training call in the compute dtype while FP8 is on: the last
        FP8 step's output-gradient amax, still pending in
        `grad_amax_pending`, must survive this step's optimizer. Keras's
        torch optimizer gets no gradient for the variable and leaves it for
        the next FP8 call to fold; Keras's JAX optimizer overwrites it with
        this step's gradient (zero), so there the backend folds it now
        (`fold_pending_grad_amax`: the fold the next FP8 call would make;
        a value already folded is not folded again)."""
        fold = getattr(backends.get(), "fold_pending_grad_amax", None)
        if fold is not None:
            with _state_lock(self, True):
                fold(self, recipe)

    def _fp8_config_for(self, inputs, recipe, policy, training):
        """`_fp8_call_config` once FP8 is on for the layer (`recipe`).

        An empty training call takes the FP8 path where the backend reduces
        amaxes over processes now (`backends.reduces_amaxes`: torch under
        `torch.distributed`): the other processes' calls wait for its part
        in each reduction (zero), and a collective left out would pair
        their next ones wrongly.
        """
        dims = self._gemm_dims(tuple(inputs.shape))
        self._last_gemm[0] = dims  # for `fp8_execution` (keras_fp8.summary)
        size = recipes.gemm_size(dims)
        limit = None  # a call of unknown size takes the FP8 path (the same output spec)
        if size is not None:
            if size == 0 and not (training and backends.reduces_amaxes()):
                return None
            limit = self._resolved_min_gemm_size(inputs, policy)
            if 0 < size < limit:
                return None
        if self.lora_enabled:
            warn_runs_without_fp8(self, "LoRA is enabled (FP8 layers do not support LoRA)")
            return None
        dtype = ops.dtype(inputs) if hasattr(inputs, "dtype") else None
        if dtype is None or "float" not in str(dtype):
            # Says what runs: the plain call's matmul, whose result type
            # follows the inputs (complex64 for complex64 inputs).
            warn_runs_without_fp8(
                self,
                f"FP8 needs real floating-point inputs, and these are {dtype}",
                what=f"runs as {_plain_name(self)}",
                runs_in=_plain_result_dtype(dtype, self.compute_dtype),
            )
            return None
        # The last call's (recipe, limit, config): compared by identity and
        # equality only, which torch.compile traces without a graph break
        # (a dict keyed by the recipe, or `__dict__.setdefault`, is not).
        cached = self._fp8_backend_config[0]
        if cached is None or cached[0] is not recipe or cached[1] != limit:
            cached = (recipe, limit, backends.linear_config(recipe, limit, self._kernel_layout))
            self._fp8_backend_config[0] = cached
        return cached[2]

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
        if count != start:
            # Before anything is assigned: a refused checkpoint changes nothing.
            self._check_loaded_fp8_state([store[str(start + i)] for i in range(len(STATE_VARIABLE_NAMES))])
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

    def _check_loaded_fp8_state(self, values):
        """Raises, naming the variable, for FP8 state that no training run
        leaves (docs/numerics.md, "State invariants"): a scale that is not
        finite and positive (it would turn every output NaN or infinite), an
        amax history entry that is not finite and non-negative, a gradient
        channel entry that is not finite."""
        for name, value in zip(STATE_VARIABLE_NAMES, values):
            array = np.asarray(_to_numpy(value), dtype=np.float64).reshape(-1)
            if name.endswith("_scale"):
                bad, expected = ~(np.isfinite(array) & (array > 0)), "a finite, positive scale"
            elif name.endswith("_amax_history"):
                bad, expected = ~(np.isfinite(array) & (array >= 0)), "finite, non-negative amaxes"
            else:
                bad, expected = ~np.isfinite(array), "finite values"
            if bad.any():
                index = int(np.argmax(bad))
                where = f" at index {index}" if array.size > 1 else ""
                raise ValueError(
                    f"Invalid FP8 state in the checkpoint of layer "
                    f"'{self.path or self.name}': variable "
                    f"'{getattr(self, name).path}' holds {float(array[index])!r}{where}; "
                    f"expected {expected}. The checkpoint is damaged (or was "
                    "written after training diverged); loaded, every output "
                    "of the layer would be NaN or wrong. Load an earlier "
                    "checkpoint, or load this one into the plain model (built "
                    "under a non-FP8 policy, it takes the kernels and biases "
                    "and leaves the FP8 state out) and make that FP8 again "
                    "(`keras_fp8.convert`), with a fresh FP8 state."
                )

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
