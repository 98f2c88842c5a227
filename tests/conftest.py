"""Test configuration: the Keras backend must be chosen explicitly.

The default FP8 path is tested as users get it: under the exact emulation
(CPU) FP8 layers run FP8 at every size by default; on a GPU with real FP8
GEMMs they run the compute-dtype layer below `min_gemm_size`. A test that
needs FP8 at its small sizes on every device asks for `fp8_at_every_size`.
"""

import os

import pytest

if "KERAS_BACKEND" not in os.environ:
    # ~/.keras/keras.json may name a backend that is not installed.
    os.environ["KERAS_BACKEND"] = "torch"


@pytest.fixture(autouse=True)
def _reset_global_policy():
    import keras

    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def fp8_at_every_size(monkeypatch):
    """FP8 layers run FP8 at every size, on every device, for this test."""
    import keras

    if keras.backend.backend() == "torch":
        import torch_ops

        previous = torch_ops.set_settings(min_gemm_size=0)
        yield
        torch_ops.set_settings(previous)
    else:
        from keras_fp8 import recipes

        monkeypatch.setattr(recipes, "DEFAULT_MIN_GEMM_SIZE", 0)
        yield
