"""One quantize per tensor: the FP8 copy of an input several linears read.

Q, K and V (gate and up) projections read the same tensor. The first FP8
linear that quantizes it leaves here what it made (the FP8 copy in the
layouts the GEMMs read, the scale it used, the amax); a later linear that
reads the same tensor, unchanged, with the same quantize settings takes them
instead of quantizing again, and records the amax in its own state
(docs/numerics.md, "One quantize per tensor").

An entry is found by the tensor's identity, never by its values: the tensor
(the base of a view, with the view's offset, shape, strides and dtype) and
its version counter, which any in-place change bumps. Deciding needs no
device-to-host sync. Entries die with the tensor (a weak reference) and at
most ``MAX_ENTRIES`` are kept, so the copies held here are bounded.

A linear that took (or made) an entry's copy quantizes afresh the next time
it reads the same tensor: its own scale may have moved since (a tensor fed
again in the next step), and a layer's second call must see it, as it does
without sharing.

Eager code only: under torch.compile nothing is shared (Dynamo does not
trace the weak references and version counters this decides by), and
neither are inference tensors (they have no version counter).
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch

# Entries kept at most (the oldest goes first). Siblings read their input
# one after the other, so a few suffice; the bound caps the FP8 copies kept
# alive by tensors that live long (a batch reused step after step).
MAX_ENTRIES = 8

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


class _Entry:
    __slots__ = ("ref", "version", "payload", "consumers", "token", "reserved")

    def __init__(self, ref, version, payload, consumer, token, reserved=None):
        self.ref = ref
        self.version = version
        self.payload = payload
        self.consumers = {consumer} if consumer is not None else set()
        self.token = token
        # A fused producer's deposit (``deposit``): (the reading linear's
        # history id, its version, a weak reference to its scale, the scale's
        # version), which only that linear may read first; else None.
        self.reserved = reserved


def _reserved_for(entry, consumer, scale) -> bool:
    """Whether a reader may take a deposit no one has read yet: the linear it
    was made for, with the state it was made from, unchanged since."""
    cid, history_version, scale_ref, scale_version = entry.reserved
    return (consumer is not None and id(consumer) == cid and consumer._version == history_version
            and scale is not None and scale is scale_ref() and scale._version == scale_version)


_ENTRIES: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()


def _identity(x):
    """``(root, key part)`` of a tensor that can be shared, or None: eager,
    a plain tensor with a version counter."""
    if torch.compiler.is_compiling() or type(x) not in _PLAIN_TYPES or x.is_inference():
        return None
    root = x._base if x._base is not None else x
    return root, (id(root), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype)


def _drop(key, token, entries=_ENTRIES):
    """A dead tensor's weak-reference callback: forgets its entry. It
    takes no lock: it may run inside ``lookup`` or ``store`` (a collection
    started there), and a race can only drop a newer entry, which costs a
    quantize, never a wrong result. The table is bound early: a callback
    may also run while the interpreter shuts down."""
    entry = entries.get(key)
    if entry is not None and entry.token is token:
        entries.pop(key, None)


def lookup(x, settings, consumer, transpose, scale=None):
    """The payload an earlier linear left for ``x`` quantized with
    ``settings``, or None.

    Args:
        x: The input tensor as the linear received it.
        settings: A hashable tuple of everything the quantized copy depends
            on besides the tensor (format, scaling, margin, ...).
        consumer: What identifies the reading linear (its input history
            tensor), or None where the copy depends on the tensor alone
            (block scaling): a linear that read the entry already misses.
        transpose: Whether the reader needs the transposed copy
            (``payload[1]``; None where the maker did not write it).
        scale: The reading linear's input scale tensor: a fused producer's
            deposit (``deposit``) is taken first only by the linear whose
            state made it, unchanged since.

    Returns:
        The stored payload (``store``'s), or None. A hit makes ``consumer``
        one of the entry's readers.
    """
    ident = _identity(x)
    if ident is None:
        return None
    root, part = ident
    key = (part, settings)
    with _LOCK:
        entry = _ENTRIES.get(key)
        if entry is None or entry.ref() is not root or entry.version != x._version:
            return None
        if transpose and entry.payload[1] is None:
            return None
        if entry.reserved is not None and not entry.consumers and not _reserved_for(entry, consumer, scale):
            return None
        if consumer is not None:
            cid = id(consumer)
            if cid in entry.consumers:
                return None
            entry.consumers.add(cid)
        return entry.payload


def store(x, settings, consumer, payload):
    """Leaves ``payload`` (what quantizing ``x`` with ``settings`` made: a
    tuple whose second item is the transposed copy, or None where it was
    not written) for the next linear reading ``x``; replaces an older entry. A no-op where
    ``x`` cannot be shared (see the module docstring)."""
    _put(x, settings, payload, consumer, None)


def deposit(y, settings, payload, history, scale, versions):
    """Leaves a fused producer's copy of its output ``y`` for the linear whose
    input state is ``(history, scale)``, as that linear's own ``store`` would
    (``torch_ops.producers``); no reader has read it. Another linear reading
    ``y`` first misses it, and so does that linear where its history or scale
    changed since ``versions`` (their version counters when the copy was
    made) or is another tensor."""
    reserved = (id(history), versions[0], weakref.ref(scale), versions[1])
    _put(y, settings, payload, None, reserved)


def _put(x, settings, payload, consumer, reserved):
    """Enters ``payload`` for ``x`` (replacing an older entry, dropping the
    oldest beyond ``MAX_ENTRIES``); a no-op where ``x`` cannot be shared,
    deciding that before anything else is read (under torch.compile, an
    ``id()`` of the consumer would become a guard of the compiled code)."""
    ident = _identity(x)
    if ident is None:
        return
    consumer_id = None if consumer is None else id(consumer)
    root, part = ident
    key = (part, settings)
    token = object()
    ref = weakref.ref(root, lambda _, key=key, token=token, drop=_drop: drop(key, token))
    entry = _Entry(ref, x._version, payload, consumer_id, token, reserved)
    with _LOCK:
        _ENTRIES[key] = entry
        _ENTRIES.move_to_end(key)
        while len(_ENTRIES) > MAX_ENTRIES:
            _ENTRIES.popitem(last=False)


# Tensors fused producers made: id(root) -> (weak reference, version,
# producer), so that the linear reading one first can link itself to its
# producer (torch_ops.producers.link). Bounded like the entries.
_PRODUCED: collections.OrderedDict = collections.OrderedDict()


def note_produced(y, producer):
    """Records that ``producer`` made ``y`` (a no-op where ``y`` cannot be
    shared)."""
    ident = _identity(y)
    if ident is None:
        return
    root = ident[0]
    key = id(root)
    token = object()
    ref = weakref.ref(root, lambda _, key=key, token=token: _drop_produced(key, token))
    with _LOCK:
        _PRODUCED[key] = (ref, root._version, weakref.ref(producer), token)
        _PRODUCED.move_to_end(key)
        while len(_PRODUCED) > MAX_ENTRIES:
            _PRODUCED.popitem(last=False)


def _drop_produced(key, token, produced=_PRODUCED):
    item = produced.get(key)
    if item is not None and item[3] is token:
        produced.pop(key, None)


def producer_of(x):
    """The producer that made ``x`` (or the tensor ``x`` is a contiguous view
    of, as a whole: the layouts its deposits are left under), unchanged
    since, or None (a slice, such as a pooler's first token, never links:
    the copy of the whole would go unread)."""
    ident = _identity(x)
    if ident is None:
        return None
    root = ident[0]
    if x is not root and (x.numel() != root.numel() or x.storage_offset() != root.storage_offset()
                          or not x.is_contiguous()):
        return None
    with _LOCK:
        item = _PRODUCED.get(id(root))
    if item is None or item[0]() is not root or item[1] != root._version:
        return None
    return item[2]()


def clear():
    """Forgets every entry (the FP8 copies they hold are freed)."""
    with _LOCK:
        _ENTRIES.clear()
        _PRODUCED.clear()


def entry_count() -> int:
    """How many entries are held now."""
    return len(_ENTRIES)
