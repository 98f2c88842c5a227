"""keras_fp8.compat's own helpers (the Keras internals it wraps are tested
through the layers)."""

import keras
import pytest

from keras_fp8 import compat


@pytest.mark.parametrize("version, expected", [("3.15.1", (3, 15)), ("3.16rc0", (3, 16)), ("3.1\u00b2", (3, 1)),
                                               ("3.dev", (3, 0))])
def test_keras_version_reads_ascii_digits(monkeypatch, version, expected):
    monkeypatch.setattr(keras, "__version__", version)
    assert compat.keras_version() == expected
