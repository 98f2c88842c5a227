"""Test configuration: the Keras backend must be chosen explicitly."""

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
