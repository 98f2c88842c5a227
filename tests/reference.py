"""Hand-written NumPy/ml_dtypes reference of the FP8 numerics (docs/design.md)."""

import ml_dtypes
import numpy as np

FMT = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0),
}


MIN_SCALE = np.float32(2.0**-126)


def quantize(x, scale, fmt):
    dtype, fmt_max = FMT[fmt]
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.where(np.isinf(x), np.float32(np.nan), x * (np.float32(1.0) / np.float32(scale)))
    return np.clip(scaled, -fmt_max, fmt_max).astype(dtype)


def dequantize(q, scale):
    return q.astype(np.float32) * np.float32(scale)


def amax(x):
    return np.float32(np.max(np.abs(np.asarray(x, np.float32))))


def compute_scale(window, prev, fmt, margin=0.0):
    window = np.float32(window)
    if not np.isfinite(window) or window <= 0:
        return np.float32(prev)
    inverse_max = np.float32(1.0 / FMT[fmt][1])
    return np.maximum(np.float32(window * inverse_max), MIN_SCALE) * np.float32(2.0**margin)


class DelayedOperand:
    """One operand's delayed-scaling state, updated call by call."""

    def __init__(self, history_len, fmt, margin=0.0, algo="max"):
        self.history = np.zeros(history_len, np.float32)
        self.scale = np.float32(1.0)
        self.fmt, self.margin, self.algo = fmt, margin, algo

    def window(self):
        return self.history[0] if self.algo == "most_recent" else self.history.max()

    def step(self, a, record=True):
        """Returns the scale used for a tensor of amax `a`."""
        if self.history.max() == 0:
            used = compute_scale(a, self.scale, self.fmt, self.margin)
        else:
            used = self.scale
        if record:
            if np.isfinite(a):
                self.history = np.concatenate([[a], self.history[:-1]]).astype(
                    np.float32
                )
            self.scale = compute_scale(self.window(), used, self.fmt, self.margin)
        return used


def fp8_matmul(x, kernel, sx, sk, fmt="e4m3"):
    """Forward reference: quantize both, multiply in float32, scale."""
    qx = quantize(x, sx, fmt).astype(np.float32)
    qk = quantize(kernel, sk, fmt).astype(np.float32)
    return (qx @ qk) * np.float32(np.float32(sx) * np.float32(sk))
