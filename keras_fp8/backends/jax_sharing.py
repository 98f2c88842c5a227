"""One quantize per tensor on JAX: the FP8 copy of an input several layers read.

Q, K and V (gate and up) projections read the same tensor. Within one trace
the same tracer reaches each of them; the first FP8 layer that quantizes it
leaves here what it made (the FP8 copy, the scale it used, its amax), and a
later layer reading the same tensor the same way, with the same settings, in
the same trace, takes them instead of quantizing again; it records the amax
in its own state (docs/numerics.md, "One quantize per tensor"). The program
then holds one quantize and one amax reduction per tensor.

An entry is found by the identity of the layer's input (the tensor its 2-D
operand was reshaped, or transposed and reshaped, from) and of the trace it
belongs to, never by values. Entries die with the input (a weak reference)
and at most `MAX_ENTRIES` are kept. A layer that took (or made) an entry's
copy quantizes afresh the next time it reads the same input, as it does
without sharing (its scale may have moved since).
"""

import collections
import threading
import weakref

from jax._src import core as jax_core

# Entries kept at most (the oldest goes first); siblings read their input
# one after the other.
MAX_ENTRIES = 8

_ENTRIES = collections.OrderedDict()
_LOCK = threading.Lock()


class _Entry:
    __slots__ = ("ref", "trace", "payload", "consumers", "token")

    def __init__(self, ref, trace, payload, consumer, token):
        self.ref = ref
        self.trace = trace
        self.payload = payload
        self.consumers = set() if consumer is None else {consumer}
        self.token = token


def _current_trace():
    """An opaque, comparable handle on the trace now running (its weak
    reference): a copy made in one trace (a jit, a grad, a scan body) must
    not be read from another."""
    return jax_core.get_opaque_trace_state(convention="keras_fp8")


def _key(source, settings):
    tensor, layout = source
    return (id(tensor), layout, settings)


def _drop(key, token, entries=_ENTRIES):
    """A dead input's weak-reference callback: forgets its entry. It
    takes no lock: it may run inside `lookup` or `store` (a collection
    started there), and a race can only drop a newer entry, which costs a
    quantize, never a wrong result. The table is bound early: a callback
    may also run while the interpreter shuts down."""
    entry = entries.get(key)
    if entry is not None and entry.token is token:
        entries.pop(key, None)


def lookup(source, settings, consumer):
    """The payload an earlier layer left for `source` quantized with
    `settings` in this trace, or None.

    Args:
        source: `(input, layout)`: the tensor the layer was called on and a
            hashable description of how its 2-D operand was made from it
            (e.g. the einsum's transposition), or None (nothing shared).
        settings: A hashable tuple of everything the copy depends on besides
            the tensor (route, format, recipe, the operand's shape, ...).
        consumer: What identifies the reading layer, or None where the copy
            depends on the tensor alone (block scaling).

    Returns:
        The payload, or None. A hit makes `consumer` one of the entry's readers.
    """
    if source is None:
        return None
    key = _key(source, settings)
    with _LOCK:
        entry = _ENTRIES.get(key)
        if entry is None or entry.ref() is not source[0] or entry.trace != _current_trace():
            return None
        if consumer is not None:
            if id(consumer) in entry.consumers:
                return None
            entry.consumers.add(id(consumer))
        return entry.payload


def store(source, settings, consumer, payload):
    """Leaves `payload` for the next layer reading `source` in this trace."""
    if source is None:
        return
    key = _key(source, settings)
    token = object()
    try:
        ref = weakref.ref(source[0], lambda _, key=key, token=token, drop=_drop: drop(key, token))
    except TypeError:  # a value without weak references (a NumPy array): nothing shared
        return
    entry = _Entry(ref, _current_trace(), payload, None if consumer is None else id(consumer), token)
    with _LOCK:
        _ENTRIES[key] = entry
        _ENTRIES.move_to_end(key)
        while len(_ENTRIES) > MAX_ENTRIES:
            _ENTRIES.popitem(last=False)


def clear():
    """Forgets every entry."""
    with _LOCK:
        _ENTRIES.clear()


def entry_count():
    """How many entries are held now."""
    return len(_ENTRIES)
