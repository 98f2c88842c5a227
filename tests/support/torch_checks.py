"""Shared helpers of the torch_ops tests: data, comparisons, the GPU gate.

GPU tests skip only where no FP8 GPU is present. On a machine with one, a
kernel build that fails makes them fail (`kernels_required`), never skip and
never pass on the reference that the fallback would run.
"""

import pytest
import torch

import torch_ops
from torch_ops import extension
from torch_ops import reference as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_GPU = extension.fp8_gpu_present()
DEV = "cuda" if FP8_GPU else "cpu"

# For GPU test modules: `pytestmark = needs_fp8_gpu` and the fixture below.
needs_fp8_gpu = pytest.mark.skipif(not FP8_GPU, reason="no FP8 GPU (sm_89 or sm_90) is present")


@pytest.fixture(autouse=False)
def kernels_required():
    """Fails (rather than skips) where the kernels do not serve the GPU."""
    reason = torch_ops.unavailable_reason("cuda")
    assert reason is None, f"an FP8 GPU is present but the torch_ops kernels do not serve it: {reason}"


@pytest.fixture()
def fresh_sharing_cache():
    """An empty one-quantize-per-tensor cache (torch_ops.sharing) before and
    after the test: no FP8 copy crosses tests."""
    from torch_ops import sharing

    sharing.clear()
    yield
    sharing.clear()


def poison(nbytes: int = 1 << 30):
    """Fills free memory of the caching allocator with 0xFF (NaN in both FP8
    formats), then releases it, so that an element a kernel did not write
    cannot match the reference."""
    ts = [torch.empty(nbytes, dtype=torch.uint8, device=DEV)]
    for p in range(9, 20):
        ts += [torch.empty(1 << p, dtype=torch.uint8, device=DEV) for _ in range(8)]
    for t in ts:
        t.fill_(0xFF)
    del ts


SPECIAL_VALUES = (float("nan"), float("inf"), float("-inf"), 1e9, -1e9, 7e4, -7e4)


def rand(shape, dtype, scale=100.0, special=True, seed=0, device=None):
    """Fresh random data (never zeros), with `SPECIAL_VALUES` sprinkled in."""
    device = DEV if device is None else device
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale
    if special and x.numel() >= 8:
        flat = x.view(-1)
        idx = torch.randint(0, x.numel(), (len(SPECIAL_VALUES),), generator=g, device=device)
        flat[idx] = torch.tensor(SPECIAL_VALUES, device=device)
    return x.to(dtype)


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor):
    """Equal FP8 bytes; NaN in the same places (any NaN encoding)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    gn, wn = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(gn, wn), f"NaN positions differ: {int((gn != wn).sum())}"
    diff = (got.view(torch.uint8) != want.view(torch.uint8)) & ~wn
    assert int(diff.sum()) == 0, f"{int(diff.sum())} of {got.numel()} bytes differ"


def assert_same_f32(got, want):
    """Bit-equal float32 tensors (NaN where the other is NaN)."""
    assert got.dtype == torch.float32 and want.dtype == torch.float32, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all()), f"{got} vs {want}"


def assert_close(got, want, rtol, atol_fraction=1e-2, msg="", atol=None):
    """Element by element: |got - want| <= atol + rtol * |want|. atol: given,
    or a fraction of want's largest magnitude (products of random data cancel)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    assert not bool(torch.isnan(got).any()), f"{msg}: NaN"
    if atol is None:
        atol = atol_fraction * rtol * float(want.abs().max().clamp_min(1e-30))
    bad = (got - want).abs() > atol + rtol * want.abs()
    assert int(bad.sum()) == 0, (f"{msg}: {int(bad.sum())} of {want.numel()} elements beyond "
                                 f"{atol:.3g} + {rtol} |want|; worst {float((got - want).abs().max()):.4g}")


# One rounding to each output dtype (relative).
OUTPUT_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-12}


def assert_gemm_close(got, want, out_dtype, fast, msg=""):
    """An FP8 GEMM against the float32 reference, element by element. The
    FP8 tensor cores accumulate with about 14 bits of precision between
    promotions, so the error of a sum grows with the sum's typical size, not
    with its own (a near-zero element of large terms): the absolute part is
    relative to want's root mean square, 2**-5 of it with cuBLASLt's fast
    accumulation (no promotion) and 2**-9 with split accumulation; the
    relative part is the output dtype's one rounding."""
    want64 = want.detach().double()
    rms = float(want64.square().mean().sqrt().clamp_min(1e-30)) if want64.numel() else 0.0
    atol = (2.0**-5 if fast else 2.0**-9) * rms
    assert_close(got, want, OUTPUT_RTOL[out_dtype], msg=msg, atol=atol)


def clone_state(state):
    return torch_ops.FP8LinearState(*(t.clone() for t in state.tensors()))


def assert_same_state(got, want):
    for name, u, v in zip(("input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history",
                           "grad_scale", "grad_amax_history"), got.tensors(), want.tensors()):
        assert torch.equal(u, v), f"state.{name}: {u} vs {v}"


def reference_linear(x, w, b, gy, state, *, fp8_format="hybrid", scaling="delayed", margin=0.0,
                     amax_compute_algo="max", weight_layout="out_in", training=True):
    """One training call of an FP8 linear composed explicitly from
    `torch_ops.reference` (quantize x and W, one FP8 GEMM; quantize the
    gradient once, two FP8 GEMMs), on `state` in place.

    Returns:
        `(y, dx, dw, db)`; the gradients in the dtypes autograd gives them.
    """
    fwd_dt, grad_dt = ref.FP8_FORMATS[fp8_format]
    k = x.shape[-1]
    x2d = x.reshape(-1, k)
    w_nk = w.t() if weight_layout == "in_out" else w
    s = state

    def quant(t, hist, scale, dt, record):
        if scaling == "delayed":
            return ref.quantize_delayed(t, hist, scale, dt, margin=margin, amax_compute_algo=amax_compute_algo,
                                        record=record)
        q, used, a = ref.quantize_current(t, dt, margin=margin, prev_scale=scale)
        if record:
            scale.copy_(used.reshape(scale.shape))
        return q, used, a

    qx, sx, _ = quant(x2d, s.input_amax_history, s.input_scale, fwd_dt, training)
    qw, sw, _ = quant(w_nk, s.kernel_amax_history, s.kernel_scale, fwd_dt, training)
    bias = None if b is None else b.to(x.dtype)
    y = ref.fp8_gemm(qx, qw, sx, sw, bias=bias, out_dtype=x.dtype)
    g2d = gy.reshape(-1, y.shape[-1])
    qg, sg, _ = quant(g2d, s.grad_amax_history, s.grad_scale, grad_dt, training and scaling == "delayed")
    dx = ref.fp8_gemm(qg, qw.t().contiguous(), sg, sw, out_dtype=x.dtype)
    dw_nk = ref.fp8_gemm(qg.t().contiguous(), qx.t().contiguous(), sg, sx, out_dtype=w.dtype)
    dw = dw_nk.t() if weight_layout == "in_out" else dw_nk
    db = None if b is None else g2d.float().sum(0).to(b.dtype)
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw, db


def run_linear(fn, x, w, b, gy, state, **kwargs):
    """``fn(x, w, b, state=state, **kwargs)`` forward and backward on fresh
    leaves. Returns `(y, dx, dw, db)`."""
    xx = x.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    bb = None if b is None else b.clone().requires_grad_()
    y = fn(xx, ww, bb, state=state, **kwargs)
    y.backward(gy)
    return y.detach(), xx.grad, ww.grad, None if bb is None else bb.grad


def assert_block_gemm_close(got, want, abs_sum, out_dtype, msg=""):
    """A block-scaled FP8 GEMM against the reference, element by element:
    within 2**-11 of the sum of the magnitudes of the element's terms
    (`abs_sum`: the same GEMM on |q|; the tensor cores' partial sums over each
    128-long stretch carry about 14 bits) plus one rounding to the output
    dtype. Rows of very different magnitudes each get their own bound."""
    got, want, abs_sum = (t.detach().double().cpu() for t in (got, want, abs_sum))
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    assert not bool(torch.isnan(got).any()), f"{msg}: NaN"
    bound = 2.0**-11 * abs_sum + OUTPUT_RTOL[out_dtype] * want.abs() + 1e-30
    bad = (got - want).abs() > bound
    assert int(bad.sum()) == 0, (f"{msg}: {int(bad.sum())} of {want.numel()} elements beyond the bound; worst "
                                 f"excess {float(((got - want).abs() / bound).max()):.3g}x")


def reference_block_linear(x, w, b, gy, *, fp8_format="e4m3", margin=0.0, power_of_two=False,
                           weight_layout="out_in", bounds=False):
    """One call of the block-scaled FP8 linear composed from
    `torch_ops.reference`: x in 1 x 128 tiles along K, W in 128 x 128 blocks;
    the gradient in 1 x 128 tiles along N (dX) and 128 x 1 tiles along M
    (dW, against x's 128 x 1 tiles).

    Returns:
        `(y, dx, dw, db)`, and with `bounds` also the three GEMMs on |q|
        (for `assert_block_gemm_close`).
    """
    fwd_dt, grad_dt = ref.FP8_FORMATS[fp8_format]
    kw = dict(margin=margin, power_of_two=power_of_two)
    k = x.shape[-1]
    x2d = x.reshape(-1, k)
    w_kn = w if weight_layout == "in_out" else w.t()
    qx, sx = ref.quantize_tiles(x2d, fwd_dt, axis=1, **kw)
    qw, sw = ref.quantize_blocks(w_kn, fwd_dt, **kw)  # blocks of W are blocks of W^T, transposed
    bias = None if b is None else b.to(x.dtype)
    y = ref.block_gemm(qx, sx, qw, sw, bias=bias, out_dtype=x.dtype)
    g2d = gy.reshape(-1, y.shape[-1])
    qg, sg = ref.quantize_tiles(g2d, grad_dt, axis=1, **kw)
    dx = ref.block_gemm(qg, sg, qw.t(), sw.t(), out_dtype=x.dtype)
    qxc, sxc = ref.quantize_tiles(x2d, fwd_dt, axis=0, **kw)  # (M, K), scales (Mb, K)
    qgc, sgc = ref.quantize_tiles(g2d, grad_dt, axis=0, **kw)  # (M, N), scales (Mb, N)
    dw_kn = ref.block_gemm(qxc.t(), sxc.t(), qgc, sgc, b_tiles=True, out_dtype=w.dtype)
    dw = dw_kn if weight_layout == "in_out" else dw_kn.t()
    db = None if b is None else g2d.float().sum(0).to(b.dtype)
    out = (y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw, db)
    if not bounds:
        return out
    f32, mag = torch.float32, (lambda q: q.float().abs())
    y_sum = ref.block_gemm(mag(qx), sx, mag(qw), sw, out_dtype=f32).reshape(out[0].shape)
    dx_sum = ref.block_gemm(mag(qg), sg, mag(qw).t(), sw.t(), out_dtype=f32).reshape(x.shape)
    dw_sum = ref.block_gemm(mag(qxc).t(), sxc.t(), mag(qgc), sgc, b_tiles=True, out_dtype=f32)
    return out, (y_sum, dx_sum, dw_sum if weight_layout == "in_out" else dw_sum.t())
