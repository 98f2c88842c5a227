"""Every place keras-fp8 touches Keras's internals, each with the reason.

Keras's public API has no hook for three things keras-fp8 needs, so this
module patches them (at `import keras_fp8`, idempotently), and it holds every
private Keras name the package uses, so that a Keras upgrade is checked here
and nowhere else. Written for the Keras versions in `TESTED_KERAS`; another
version gets a one-time warning naming what to check.

The patches:

1. `DTypePolicy.__new__`: Keras builds `DTypePolicy(name)` for every policy
   name outside its own quantization prefixes and has no registry of policy
   names; routing the FP8 names to `FP8DTypePolicy` here covers
   `set_global_policy`, `dtype_policies.get`, `Layer(dtype=...)` and
   deserialization in one place.
2. The global dtype-policy getter: layers built inside `keras_fp8.autocast`
   get the scope's policy (Keras has global policies only, no scopes).
3. `Trainer.compile`: Keras wraps the optimizer in a `LossScaleOptimizer` only
   for the policy named exactly `"mixed_float16"`; the FP8 float16 policies
   need keras-fp8's wrapper, whatever made the model FP8.
"""

import contextlib
import warnings

import keras
from keras.src.backend.common import global_state as _global_state
from keras.src.backend.common.stateless_scope import in_stateless_scope as _in_stateless_scope
from keras.src.backend.common.variables import AutocastScope as _AutocastScope
from keras.src.distribution import distribution_lib as _distribution_lib
from keras.src.dtype_policies import dtype_policy as _dtype_policy_module
from keras.src.trainers import trainer as _trainer_module

# (major, minor) versions of Keras this module was written and tested for.
TESTED_KERAS = ((3, 15),)

_warned_version = []


def keras_version():
    """Keras's `(major, minor)` version."""
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_keras_version():
    """Warns once when Keras is not a version this module was tested with.

    Returns:
        True when the version is a tested one.
    """
    if keras_version() in TESTED_KERAS:
        return True
    if not _warned_version:
        _warned_version.append(True)
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_KERAS)
        warnings.warn(
            f"keras_fp8 was tested with Keras {tested}; this is Keras {keras.__version__}. "
            "keras_fp8/compat.py lists the Keras internals it relies on: check them if FP8 layers, "
            "policies or loss scaling misbehave.",
            stacklevel=3,
        )
    return False


# --------------------------------------------------------------------------- patches
def route_policy_names(is_own_name, policy_class):
    """Patch 1: `DTypePolicy(name)` builds `policy_class` where `is_own_name(name)`.

    Python then runs `policy_class.__init__` with the same arguments.
    """
    base_classes = (_dtype_policy_module.DTypePolicy, _dtype_policy_module.FloatDTypePolicy)

    def dtype_policy_new(cls, *args, **kwargs):
        if cls in base_classes:
            name = args[0] if args else kwargs.get("name")
            if is_own_name(name):
                return object.__new__(policy_class)
        return object.__new__(cls)

    _dtype_policy_module.DTypePolicy.__new__ = staticmethod(dtype_policy_new)


_keras_global_policy = _dtype_policy_module.dtype_policy


def answer_global_policy_first(scoped_policy):
    """Patch 2: Keras's global-policy getter returns `scoped_policy()` when it
    is not None (the active autocast scope's policy), else the global one."""

    def dtype_policy():
        policy = scoped_policy()
        return policy if policy is not None else _keras_global_policy()

    _dtype_policy_module.dtype_policy = dtype_policy


_keras_compile = _trainer_module.Trainer.compile


def wrap_compile_optimizer(wrap):
    """Patch 3: `Model.compile(optimizer, ...)` first passes the optimizer
    through `wrap(model, optimizer, auto_scale_loss)`."""

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        optimizer = wrap(self, optimizer, kwargs.get("auto_scale_loss", True))
        return _keras_compile(self, optimizer, *args, **kwargs)

    compile.__doc__ = _keras_compile.__doc__
    _trainer_module.Trainer.compile = compile


# --------------------------------------------------------------------------- private names, wrapped
def raw_value(variable):
    """A variable's value in its own dtype: no mixed-precision autocast."""
    with _AutocastScope(None):
        return variable.value


def in_stateless_scope():
    """Whether a Keras stateless scope (e.g. `stateless_call`) is active."""
    return _in_stateless_scope()


def autocast_scope(dtype):
    """The scope `Layer.__call__` enters to autocast variables to `dtype`."""
    return _AutocastScope(dtype)


def current_call_context():
    """The call context of the outermost `Layer.__call__` running, or None."""
    return _global_state.get_global_attribute("current_call_ctx")


def distribution():
    """The active `keras.distribution` distribution, or None."""
    return _distribution_lib.distribution()


class _ReplicatingDistribution:
    """The active distribution, but for the layout of new variables: replicated."""

    def __init__(self, distribution):
        self._distribution = distribution

    def __getattr__(self, name):
        return getattr(self._distribution, name)

    def get_variable_layout(self, variable):
        return keras.distribution.TensorLayout(
            (None,) * len(variable.shape), self._distribution.device_mesh
        )


@contextlib.contextmanager
def replicated_variables():
    """Variables created inside get a replicated layout under the active
    `keras.distribution` (nothing changes without one).

    Why: `Layer.add_weight` takes no layout, and the backend variable asks
    the distribution for one (`get_variable_layout`, a `LayoutMap` lookup by
    path) while it is created. A `ModelParallel` `LayoutMap` key such as
    `".*kernel.*"` also matches a layer's `kernel_scale` and
    `kernel_amax_history`, which must be replicated (one scale for the whole
    kernel): a 2-D kernel layout on a scalar fails inside JAX's sharding
    code. So for the variables created in this scope the distribution is
    swapped, on this thread, for one that answers "replicated".
    """
    distribution = _distribution_lib.distribution()
    if distribution is None:
        yield
        return
    _distribution_lib.set_distribution(_ReplicatingDistribution(distribution))
    try:
        yield
    finally:
        _distribution_lib.set_distribution(distribution)


def keras_mask(x):
    """The Keras mask a tensor carries, or None."""
    return getattr(x, "_keras_mask", None)


def sublayers(layer, include_self=True):
    """Every layer nested in `layer` (attributes, lists, models), once each."""
    return list(layer._flatten_layers(include_self=include_self, recursive=True))


@contextlib.contextmanager
def unlocked_tracker(layer):
    """Lets `layer` add weights after its `build` has locked its tracker."""
    layer._tracker.unlock()
    try:
        yield
    finally:
        layer._tracker.lock()


def layer_name_scope(layer):
    """The name scope `build` runs in: new variables get the paths `build`
    would have given them."""
    return layer._open_name_scope()


def retrack_torch_parameters(layer):
    """torch backend: refreshes the `torch.nn.Parameter` snapshot a layer
    took of its variables (its own and its sublayers') after build."""
    if hasattr(layer, "_torch_params"):
        layer._track_variables()


def build_input_shape(layer):
    """The input shape `layer` was built with, or None."""
    shapes = getattr(layer, "_build_shapes_dict", None) or {}
    shape = shapes.get("input_shape")
    if shape is None and shapes:
        shape = next(iter(shapes.values()))
    return shape


def check_load_own_variables(layer, store):
    """Keras's check that a store holds as many variables as `layer` has."""
    layer._check_load_own_variables(store)
