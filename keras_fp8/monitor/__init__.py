"""Watching FP8 training: `FP8Monitor` and the probe it runs.

- `callback.py`: `FP8Monitor`, the Keras callback (also reachable as
  `keras_fp8.callbacks.FP8Monitor`).
- `probe.py`: `Probe`, one pass over a batch that captures every FP8 GEMM's
  input and output gradient; it installs an observer on the FP8 layers it
  watches while it runs (`observe_gemms`, the layers' one hook for the
  monitor).
- `statistics.py`: the statistics table of one measurement;
  `torch_statistics.py` and `jax_statistics.py`: how the running backend
  differentiates the probe and runs the table.
- `health.py`: what the records say (thresholds, non-finite values, the
  one-line summary); `plot.py`: the curves.

The backends and the layers know nothing of the monitor beyond that hook.
`keras_fp8.summary` (a table of the FP8 layers) is in `keras_fp8.inspection`.
"""

from keras_fp8.monitor.callback import FP8Monitor
from keras_fp8.monitor.probe import Probe

__all__ = ["FP8Monitor", "Probe"]
