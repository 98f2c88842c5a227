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


def fp8_linear_output(x, kernel, sx, sk, bias=None, out_dtype=ml_dtypes.bfloat16, fmt="e4m3"):
    """The forward output of an FP8 layer with a fused bias, as
    docs/numerics.md states it: the product of the quantized operands
    summed exactly (float64; exact in float32 for data whose sums fit its
    24 bits), times `sx * sk` in float32, the bias (in `out_dtype`) added
    in float32, one rounding to `out_dtype`. Returns float32."""
    qx = quantize(x, sx, fmt).astype(np.float64)
    qk = quantize(kernel, sk, fmt).astype(np.float64)
    product = (qx @ qk).astype(np.float32) * np.float32(np.float32(sx) * np.float32(sk))
    if bias is not None:
        product = product + np.asarray(bias, np.float32).astype(out_dtype).astype(np.float32)
    return product.astype(out_dtype).astype(np.float32)


# --------------------------------------------------------------------------- block scaling
BLOCK = 128


def block_scale(amax, fmt, margin=0.0, power_of_two=False):
    """Per-tile scales from per-tile amaxes (any shape)."""
    a = np.asarray(amax, np.float32)
    inverse_max = np.float32(1.0 / FMT[fmt][1])
    s = np.maximum(a * inverse_max, MIN_SCALE) * np.float32(2.0**margin)
    if power_of_two:
        out = np.empty_like(s)
        for i, v in np.ndenumerate(s):
            # The smallest power of two >= v, by walking exact powers.
            p = np.float32(2.0**-149)
            e = -149
            while p < v and e < 127:
                e += 1
                p = np.float32(2.0**e)
            out[i] = p
        s = out
    usable = np.isfinite(a) & (a > 0)
    return np.where(usable, s, np.float32(1.0)).astype(np.float32)


def quantize_tiles(x, fmt, axis=1, margin=0.0, power_of_two=False):
    """1 x 128 tiles of each row (axis 1) or 128 x 1 tiles of each column
    (axis 0): (q, scales) with scales (R, ceil(C/128)) or (ceil(R/128), C)."""
    x = np.asarray(x, np.float32)
    t = x.T if axis == 0 else x
    rows, cols = t.shape
    tiles = -(-cols // BLOCK)
    scales = np.empty((rows, tiles), np.float32)
    q = np.empty(t.shape, FMT[fmt][0])
    for j in range(tiles):
        part = t[:, j * BLOCK:(j + 1) * BLOCK]
        with np.errstate(invalid="ignore"):
            a = np.max(np.abs(part), axis=1) if part.size else np.zeros(rows, np.float32)
        s = block_scale(a, fmt, margin, power_of_two)
        scales[:, j] = s
        for r in range(rows):
            q[r, j * BLOCK:(j + 1) * BLOCK] = quantize(part[r], s[r], fmt)
    if axis == 0:
        return q.T, scales.T
    return q, scales


def quantize_blocks(w, fmt, margin=0.0, power_of_two=False):
    """128 x 128 blocks: (q, scales (ceil(R/128), ceil(C/128)))."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    rb, cb = -(-rows // BLOCK), -(-cols // BLOCK)
    scales = np.empty((rb, cb), np.float32)
    q = np.empty(w.shape, FMT[fmt][0])
    for i in range(rb):
        for j in range(cb):
            part = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            with np.errstate(invalid="ignore"):
                s = block_scale(np.max(np.abs(part)), fmt, margin, power_of_two)
            scales[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = quantize(part, s, fmt)
    return q, scales


def block_matmul(a_q, a_scales, b_q, b_scales, b_tiles=False):
    """float64 sum over K tiles of (a tile @ b tile) * scales (exact up to
    rounding the float64 result), as float64."""
    a = np.asarray(a_q, np.float64)
    b = np.asarray(b_q, np.float64)
    k = a.shape[1]
    n = b.shape[1]
    out = np.zeros((a.shape[0], n))
    for kb in range(-(-k // BLOCK)):
        sl = slice(kb * BLOCK, (kb + 1) * BLOCK)
        sb = b_scales[kb] if b_tiles else np.repeat(b_scales[kb], BLOCK)[:n]
        out += (a[:, sl] @ b[sl]) * np.asarray(a_scales, np.float64)[:, kb:kb + 1] * np.asarray(sb, np.float64)[None]
    return out
