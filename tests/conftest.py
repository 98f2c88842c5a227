"""Test configuration: the Keras backend must be chosen explicitly."""

import os

import pytest

if "KERAS_BACKEND" not in os.environ:
    # ~/.keras/keras.json may name a backend that is not installed.
    os.environ["KERAS_BACKEND"] = "torch"


# On an FP8 GPU, exercise the FP8 GEMMs even at test sizes (below the default
# small-GEMM threshold torch_ops would run them in bf16).
os.environ.setdefault("TORCH_OPS_FP8_MIN_GEMM_SIZE", "0")


@pytest.fixture(autouse=True)
def _reset_global_policy():
    import keras

    yield
    keras.mixed_precision.set_global_policy("float32")
