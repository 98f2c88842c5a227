"""Keras callbacks: `FP8Monitor`, which watches FP8 training.

Its home is `keras_fp8.monitor` (`keras_fp8/monitor/callback.py`); this
module keeps the name `keras_fp8.callbacks.FP8Monitor`.
"""

from keras_fp8.monitor.callback import FP8Monitor

__all__ = ["FP8Monitor"]
