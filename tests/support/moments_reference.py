"""Hand-written NumPy/ml_dtypes reference of the FP8 optimizer moments
(docs/numerics.md, "Optimizer moments"), element by element."""

import math

import numpy as np

from tests.support import numpy_reference

BLOCK = 128
FLOAT16_MAX = np.float32(65504.0)


def _blocks(x):
    """`x` flattened (float32) and cut into blocks of BLOCK (the last shorter)."""
    flat = np.asarray(x, np.float32).reshape(-1)
    return [flat[i:i + BLOCK] for i in range(0, flat.size, BLOCK)]


def _block_amax(part):
    with np.errstate(invalid="ignore"):
        return np.float32(np.max(np.abs(part)))


def quantize_first_moment(m):
    """`(q E4M3 shaped like m, scales (blocks,))`."""
    m = np.asarray(m, np.float32)
    qs, scales = [], []
    for part in _blocks(m):
        scale = numpy_reference.block_scale(_block_amax(part), "e4m3")
        qs.append(numpy_reference.quantize(part, scale, "e4m3"))
        scales.append(scale)
    q = np.concatenate(qs) if qs else np.zeros(0, numpy_reference.FMT["e4m3"][0])
    return q.reshape(m.shape), np.array(scales, np.float32)


def dequantize_first_moment(q, scales):
    flat = np.asarray(q).astype(np.float32).reshape(-1)
    out = np.concatenate([part * scales[i] for i, part in enumerate(_blocks(flat))]) if flat.size else flat
    return out.astype(np.float32).reshape(np.shape(q))


def root_scale(amax):
    """The power of two >= max(amax * f32(1/65504), 2**-126); 1 for a zero
    or non-finite amax."""
    amax = np.float32(amax)
    if not np.isfinite(amax) or amax <= 0:
        return np.float32(1.0)
    base = max(np.float32(amax * np.float32(1.0 / 65504.0)), numpy_reference.MIN_SCALE)
    mantissa, exponent = math.frexp(float(base))  # base = mantissa * 2**exponent, mantissa in [0.5, 1)
    return np.float32(base if mantissa == 0.5 else 2.0**exponent)


def quantize_second_moment(v):
    """`(q float16 = sqrt(v) / scale shaped like v, scales (blocks,))`."""
    v = np.asarray(v, np.float32)
    with np.errstate(invalid="ignore"):
        r = np.sqrt(v)
    qs, scales = [], []
    for part in _blocks(r):
        scale = root_scale(_block_amax(part))
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = np.where(np.isinf(part), np.float32(np.nan), part * (np.float32(1.0) / scale))
        qs.append(np.clip(scaled, -FLOAT16_MAX, FLOAT16_MAX).astype(np.float16))
        scales.append(scale)
    q = np.concatenate(qs) if qs else np.zeros(0, np.float16)
    return q.reshape(v.shape), np.array(scales, np.float32)


def dequantize_second_moment(q, scales):
    r = dequantize_first_moment(np.asarray(q).astype(np.float32), scales)
    return (r * r).astype(np.float32)


class AdamFP8Moments:
    """Adam / AdamW on one variable with the moments stored as the numerics
    say, step by step (float32 throughout)."""

    def __init__(self, shape, learning_rate, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=None):
        self.m_q, self.m_scales = quantize_first_moment(np.zeros(shape, np.float32))
        self.v_q, self.v_scales = quantize_second_moment(np.zeros(shape, np.float32))
        self.lr = np.float32(learning_rate)
        self.beta_1, self.beta_2 = beta_1, beta_2
        self.epsilon, self.weight_decay = epsilon, weight_decay
        self.iterations = 0

    def step(self, w, g):
        """Returns the new weight for gradient `g`; updates the moments."""
        w = np.asarray(w, np.float32)
        g = np.asarray(g, np.float32)
        if self.weight_decay:
            # Keras's decoupled decay, before the update (the torch backend
            # computes w * (1 - wd * lr): a rounding apart).
            w = w - w * np.float32(self.weight_decay) * self.lr
        t = np.float32(self.iterations + 1)
        b1p = np.power(np.float32(self.beta_1), t)
        b2p = np.power(np.float32(self.beta_2), t)
        alpha = self.lr * np.sqrt(np.float32(1.0) - b2p) / (np.float32(1.0) - b1p)
        m = dequantize_first_moment(self.m_q, self.m_scales)
        v = dequantize_second_moment(self.v_q, self.v_scales)
        with np.errstate(over="ignore", invalid="ignore"):
            m = m + (g - m) * np.float32(1.0 - self.beta_1)
            v = v + (g * g - v) * np.float32(1.0 - self.beta_2)
            w = w - (m * alpha) / (np.sqrt(v) + np.float32(self.epsilon))
        self.m_q, self.m_scales = quantize_first_moment(m)
        self.v_q, self.v_scales = quantize_second_moment(v)
        self.iterations += 1
        return w.astype(np.float32)
