"""The probe `FP8Monitor` runs: `Probe`, `run`.

Their home is `keras_fp8.monitor` (`keras_fp8/monitor/probe.py`); this
module keeps the names `keras_fp8.probe.Probe` and `keras_fp8.probe.run`.
"""

from keras_fp8.monitor.probe import Probe
from keras_fp8.monitor.probe import run

__all__ = ["Probe", "run"]
