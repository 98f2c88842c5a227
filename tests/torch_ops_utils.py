"""Test helpers around the compiled torch_ops extension (torch only)."""

import contextlib


@contextlib.contextmanager
def counting_linear_folded():
    """Records the calls of the extension's `linear_folded` entry point.

    Yields a list that gets, per call, True when the C++ entry served it and
    False when it declined (returned None, so the Python path ran).
    """
    from torch_ops import linear

    ext = linear._ext()
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(ext, name)

        def linear_folded(self, *args):
            out = ext.linear_folded(*args)
            calls.append(out is not None)
            return out

    linear._ext_cache[0] = Counting()
    try:
        yield calls
    finally:
        linear._ext_cache[0] = ext
