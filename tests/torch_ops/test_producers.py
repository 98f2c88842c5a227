"""Fused producers (a norm's last step, a gated activation, each with its
output's FP8 copy and amax) against torch_ops.reference.

On an FP8 GPU the CUDA kernels run and must give the reference's output,
bytes and amax bit for bit, on fresh random data with NaN, +-inf and huge
values sprinkled in, at aligned and ragged row widths and at tiny and huge
magnitudes, with poisoned output memory. Everywhere, the reference must be
the composition it is defined as: the producer's own math (as Keras's
layers compute it with torch ops), rounded to the output dtype, then the
existing quantize.
"""

import pytest
import torch

from torch_ops import ops
from torch_ops import reference as ref
from tests.support.torch_checks import DEV
from tests.support.torch_checks import E4M3
from tests.support.torch_checks import E5M2
from tests.support.torch_checks import FP8_GPU
from tests.support.torch_checks import assert_same_f32
from tests.support.torch_checks import assert_same_fp8
from tests.support.torch_checks import kernels_required  # noqa: F401 (fixture)
from tests.support.torch_checks import needs_fp8_gpu
from tests.support.torch_checks import poison
from tests.support.torch_checks import rand

SHAPES = [(64, 4096), (17, 33), (1, 7), (300, 129), (8, 2048)]
MAGNITUDES = [1e-30, 1.0, 3e4]


def _same_out(got, want):
    """Equal bits in the output dtype (NaN where the other is NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    assert_same_f32(got.float(), want.float())


def _assert_same(got, want, pad, cols):
    y, q, su, a = got
    ry, rq, rsu, ra = want
    _same_out(y, ry)
    assert_same_f32(su, rsu)
    assert_same_f32(a, ra)
    assert_same_fp8(q[:, :cols], rq)
    if pad:
        assert q.shape[1] == (cols + 15) // 16 * 16
        assert int(q[:, cols:].view(torch.uint8).sum()) == 0, "padding bytes not zero"


def _state(kind, device):
    """(amax_history, scale) of a reading linear: a given scale, an empty
    history (the seed rule) or one that holds amaxes."""
    scale = torch.tensor(0.37, device=device)
    if kind == "given":
        return None, scale
    history = torch.zeros(16, device=device)
    if kind == "recorded":
        history[3] = 5.0
    return history, scale


# --------------------------------------------------------------------------- the definition (every device)
def test_scaled_rows_is_llama_rms_norm_tail():
    """Llama's RMSNorm on torch: x (float32) * rsqrt(var + eps), then times the
    scale autocast to bfloat16, cast to bfloat16."""
    x32 = rand((9, 40), torch.bfloat16, scale=3.0, special=False, seed=1).float()
    inv = torch.rsqrt(torch.mean(torch.pow(x32, 2), dim=-1, keepdim=True) + 1e-6)
    scale = rand((40,), torch.float32, scale=1.0, special=False, seed=2).to(torch.bfloat16)
    keras_way = ((x32 * inv) * scale).to(torch.bfloat16)
    _same_out(ref.scaled_rows(x32, inv, scale, torch.bfloat16), keras_way)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_gated_is_keras_glu(activation):
    """Llama's gated FFN on torch: the gate cast to float32, activated, cast
    back; times the up projection in the compute dtype."""
    gate = rand((7, 24), torch.bfloat16, scale=4.0, special=False, seed=3)
    up = rand((7, 24), torch.bfloat16, scale=4.0, special=False, seed=4)
    fn = {"silu": torch.nn.functional.silu,
          "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
          "gelu": torch.nn.functional.gelu}[activation]
    a = fn(gate.float()).to(torch.bfloat16)
    _same_out(ref.gated(gate, up, activation, torch.bfloat16), torch.multiply(up, a))
    _same_out(ref.gated(gate, None, activation, torch.bfloat16), a)


@pytest.mark.parametrize("kind", ["given", "empty", "recorded"])
def test_producer_quantize_is_the_linears_quantize(kind):
    """The copy a producer leaves is what the reading linear's own quantize
    makes of the rounded output: the state's scale, seeded while its history
    is empty."""
    y = rand((12, 50), torch.bfloat16, scale=50.0, seed=5, device="cpu")
    history, scale = _state(kind, "cpu")
    q, su, a = ref.producer_quantize(y, scale, E4M3, amax_history=history, margin=1.0)
    if history is None:
        want_q, want_su = ref.quantize_with_scale(y, scale, E4M3), scale
    else:
        want_q, want_su, _ = ref.quantize_delayed(y, history.clone(), scale.clone(), E4M3, margin=1.0, record=False)
    assert_same_fp8(q, want_q)
    assert_same_f32(su, want_su)
    assert_same_f32(a, ref.amax(y))


def test_ops_reference_path_layout():
    """Off the kernels the ops run the reference, padded as asked."""
    x = rand((5, 13), torch.float32, scale=2.0, seed=6, device="cpu")
    rows, w = torch.rand(5) + 0.5, torch.randn(13)
    history, scale = _state("empty", "cpu")
    got = ops.scaled_rows_quantize(x, rows, w, torch.bfloat16, history, scale, E4M3, 0.0, True)
    _assert_same(got, ref.rms_norm_quantize(x, rows, w, scale, E4M3, torch.bfloat16, amax_history=history), True, 13)
    gate, up = x.bfloat16(), rand((5, 13), torch.bfloat16, seed=7, device="cpu")
    got = ops.gated_quantize(gate, up, "silu", None, scale, E5M2, 0.0, False)
    _assert_same(got, ref.glu_quantize(gate, up, "silu", scale, E5M2, torch.bfloat16), False, 13)


def test_ops_trace_under_torch_compile():
    """The custom ops have fake implementations: torch.compile traces them."""
    x = rand((6, 16), torch.bfloat16, scale=2.0, seed=8, device="cpu")
    scale = torch.tensor(0.5)

    def f(g, u):
        y, q, su, a = torch.ops.torch_ops.gated_quantize(g, u, "silu", None, scale, E4M3, 0.0, True)
        return y, q, a

    got = torch.compile(f, backend="eager", fullgraph=True)(x, x)
    want = f(x, x)
    _same_out(got[0], want[0])
    assert_same_fp8(got[1], want[1])


# --------------------------------------------------------------------------- the kernels (FP8 GPU)
@needs_fp8_gpu
@pytest.mark.usefixtures("kernels_required")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("kind", ["given", "empty", "recorded"])
def test_scaled_rows_kernel(shape, in_dtype, out_dtype, kind):
    rows_n, cols = shape
    for seed, mag in enumerate(MAGNITUDES):
        x = rand(shape, in_dtype, scale=mag, seed=10 + seed)
        rows = (torch.rand(rows_n, device=DEV) + 0.5) * (1.0 if mag >= 1 else 1e3)
        w = rand((cols,), torch.bfloat16, scale=1.0, special=False, seed=20 + seed)
        for dt in (E4M3, E5M2):
            history, scale = _state(kind, DEV)
            for pad in (True, False):
                poison()
                got = ops.scaled_rows_quantize(x, rows, w, out_dtype, history, scale, dt, 1.0, pad)
                want = ref.rms_norm_quantize(x, rows, w.float(), scale, dt, out_dtype, amax_history=history,
                                             margin=1.0)
                _assert_same(got, want, pad, cols)


@needs_fp8_gpu
@pytest.mark.usefixtures("kernels_required")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", list(ref.PRODUCER_ACTIVATIONS))
@pytest.mark.parametrize("with_up", [True, False])
def test_gated_kernel(shape, dtype, activation, with_up):
    for seed, mag in enumerate(MAGNITUDES):
        gate = rand(shape, dtype, scale=mag * 4, seed=30 + seed)
        up = rand(shape, dtype, scale=mag, seed=40 + seed) if with_up else None
        for dt, kind in ((E4M3, "recorded"), (E5M2, "empty"), (E4M3, "given")):
            history, scale = _state(kind, DEV)
            poison()
            got = ops.gated_quantize(gate, up, activation, history, scale, dt, 0.0, True)
            want = ref.glu_quantize(gate, up, activation, scale, dt, dtype, amax_history=history)
            _assert_same(got, want, True, shape[1])


@pytest.mark.skipif(FP8_GPU, reason="the reference path (no FP8 GPU)")
def test_cpu_runs_the_reference():
    gate = rand((4, 9), torch.bfloat16, seed=50, device="cpu")
    got = ops.gated_quantize(gate, None, "gelu_tanh", None, torch.tensor(2.0), E4M3, 0.0, False)
    _assert_same(got, ref.glu_quantize(gate, None, "gelu_tanh", torch.tensor(2.0), E4M3, torch.bfloat16), False, 9)
