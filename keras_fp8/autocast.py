"""The policy-level FP8 autocast scope.

`keras_fp8.autocast(...)` is to FP8 what a dtype-policy scope is to mixed
precision: layers built inside get the scope's policy, and FP8 layers called
inside use the scope's recipe (or run in plain compute precision with
`enabled=False`). The state is a `contextvars.ContextVar`, so threads and
async tasks each see their own scope; FP8 layers capture the scope's settings
in the forward pass, so the backward pass uses them too, wherever it runs.
"""

import contextvars
import dataclasses
import threading

from keras_fp8 import compat
from keras_fp8 import policy as policy_lib
from keras_fp8 import recipes

_CURRENT = contextvars.ContextVar("keras_fp8_autocast", default=None)

# How many scopes are open, in all threads and tasks together. While none
# is, `current()` answers without reading the ContextVar: torch.compile
# cannot trace `ContextVar.get` (a graph break in every FP8 layer), but it
# can read a module-level int, and guards on its value.
_open_scopes = 0
_open_scopes_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """The settings of one active `autocast` scope."""

    enabled: bool
    policy: policy_lib.FP8DTypePolicy
    recipe: recipes.Recipe


def current():
    """Returns the innermost active `AutocastState`, or None."""
    if not _open_scopes:
        return None
    return _CURRENT.get()


def _count_open_scopes(change):
    global _open_scopes
    with _open_scopes_lock:
        _open_scopes += change


class autocast:
    """Scope that turns FP8 on (or off) for the FP8 layers used inside it.

    Args:
        policy: An FP8 policy name or `FP8DTypePolicy`. Layers created inside
            the scope without an explicit `dtype` get this policy.
        enabled: If False, FP8 layers called inside run their matmul in plain
            compute precision (exactly like `Dense`/`EinsumDense`), whatever
            their policy.
        recipe: Optional recipe overriding the policy's recipe for the FP8
            layers called inside.

    Entering returns the `AutocastState` of the scope. A scope is left in the
    thread (and context) that entered it; leaving it from another raises a
    RuntimeError and changes nothing, so the scope can still be left where
    it was entered.

    Example:

    ```python
    with keras_fp8.autocast("fp8_hybrid"):
        layer = keras_fp8.layers.FP8Dense(64)   # gets the fp8_hybrid policy
        y = layer(x, training=True)             # quantized to FP8
    with keras_fp8.autocast(enabled=False):
        y_ref = layer(x)                        # plain bfloat16 matmul
    ```
    """

    def __init__(self, policy="fp8_hybrid", enabled=True, recipe=None):
        if not isinstance(enabled, bool):
            raise ValueError(
                f"Invalid `enabled`. Expected a bool. Received: enabled={enabled!r}"
            )
        fp8_policy = policy_lib.get(policy)
        recipe = recipes.get(recipe) if recipe is not None else fp8_policy.recipe
        self.state = AutocastState(enabled=enabled, policy=fp8_policy, recipe=recipe)
        self._tokens = []

    def __enter__(self):
        self._tokens.append(_CURRENT.set(self.state))
        _count_open_scopes(1)
        return self.state

    def __exit__(self, *exc_info):
        if not self._tokens:
            raise RuntimeError("keras_fp8.autocast: this scope is not open.")
        try:
            _CURRENT.reset(self._tokens[-1])
        except ValueError:
            raise RuntimeError(
                "keras_fp8.autocast: a scope must be left in the thread (and "
                "context) that entered it; this one was left from another. "
                "Nothing changed: the scope is still open where it was entered."
            ) from None
        self._tokens.pop()
        _count_open_scopes(-1)
        return False


def _scope_policy():
    """The active enabled scope's policy, or None."""
    state = current()
    if state is not None and state.enabled:
        return state.policy
    return None


def register():
    """Makes layers created inside an enabled scope default to its policy
    (`keras_fp8/compat.py`, patch 2)."""
    compat.answer_global_policy_first(_scope_policy)
