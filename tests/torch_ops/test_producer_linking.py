"""Fused producers feeding FP8 linears (torch_ops.producers, torch_ops.sharing).

An RMSNorm tail feeding three linears (Q, K and V) and a SwiGLU feeding a
down projection, trained for several steps with fusion on against the same
with it off: outputs, gradients and every state tensor bit for bit; the
fused ops and the input quantizes counted; the cases where the deposit must
not be taken. CPU runs the torch.library ops over the reference; an FP8 GPU
also the CUDA kernels and the C++ eager entry.
"""

from unittest import mock

import pytest
import torch

import torch_ops
from torch_ops import ops
from torch_ops import producers
from torch_ops import sharing
from tests.support.torch_checks import FP8_GPU
from tests.support.torch_checks import fresh_sharing_cache  # noqa: F401 (fixture)
from tests.support.torch_checks import kernels_required  # noqa: F401 (fixture)

B, S, C, N = 2, 20, 64, 48
DEVICES = ("cpu", "cuda") if FP8_GPU else ("cpu",)

pytestmark = pytest.mark.usefixtures("fresh_sharing_cache")


def _config(**options):
    return torch_ops.LinearConfig(min_gemm_size=0, weight_layout="in_out", **options)


class _Counter:
    """Counts calls of an ops function while patched in."""

    def __init__(self, name):
        self.name, self.calls = name, 0
        self._fn = getattr(ops, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._fn(*args, **kwargs)


def _run_norm_block(device, fuse, steps=4, config=None, seed=0, order=(0, 1, 2)):
    """Steps of x -> RMSNorm tail -> Q, K, V (FP8) -> loss; returns every
    output, gradient and state tensor, and the call counts."""
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(C, N, generator=g) * 0.1).to(device).requires_grad_() for _ in range(3)]
    norm_w = (1 + 0.1 * torch.randn(C, generator=g)).to(device).requires_grad_()
    states = [torch_ops.FP8LinearState.create(history_len=4, device=device) for _ in range(3)]
    config = config or _config()
    producer = producers.Producer() if fuse else None
    fused, quantized = _Counter("scaled_rows_quantize"), _Counter("quantize_delayed")
    got = []
    with mock.patch.object(ops, "scaled_rows_quantize", fused), mock.patch.object(ops, "quantize_delayed", quantized):
        for step in range(steps):
            x = (torch.randn(B, S, C, generator=g) * (3 + step)).to(device).requires_grad_()
            x32 = x.to(torch.float32)
            inv = torch.rsqrt(torch.mean(torch.pow(x32, 2), dim=-1, keepdim=True) + 1e-6)
            y = producers.scaled_rows(x32, inv, norm_w.to(torch.bfloat16), torch.bfloat16, producer)
            outs = [None] * 3
            for i in order:
                outs[i] = torch_ops.fp8_linear(y, weights[i], None, states[i], config, True)
            loss = sum((o.float() * (j + 1)).square().mean() for j, o in enumerate(outs))
            loss.backward()
            got += [y, *outs, x.grad]
    got += [w.grad for w in weights] + [norm_w.grad]
    got += [t for s in states for t in s.tensors()]
    return got, fused.calls, quantized.calls


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert u.dtype == v.dtype and u.shape == v.shape, i
        same = (u == v) | (torch.isnan(u) & torch.isnan(v))
        assert bool(same.all()), f"tensor {i} differs in {int((~same).sum())} of {u.numel()} elements"


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_into_qkv_is_bit_identical_and_fused(device, request):
    if device == "cuda":
        request.getfixturevalue("kernels_required")
    on, fused, quantized_on = _run_norm_block(device, True)
    off, none, quantized_off = _run_norm_block(device, False)
    _assert_same(on, off)
    # Step 1 links the producer (Q quantizes y itself); steps 2-4 run fused.
    assert fused == 3 and none == 0
    # Unfused: Q quantizes x and the weight each step; K and V their weights
    # (x shared). Fused: Q's input quantize is gone from step 2 on.
    assert quantized_off - quantized_on == 3


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_into_down_projection(device, request):
    if device == "cuda":
        request.getfixturevalue("kernels_required")

    def run(fuse):
        g = torch.Generator().manual_seed(3)
        w = (torch.randn(C, N, generator=g) * 0.1).to(device).requires_grad_()
        state = torch_ops.FP8LinearState.create(history_len=4, device=device)
        producer = producers.Producer() if fuse else None
        counter = _Counter("gated_quantize")
        got = []
        with mock.patch.object(ops, "gated_quantize", counter):
            for step in range(3):
                gate = (torch.randn(B, S, C, generator=g) * 2).to(device, torch.bfloat16).requires_grad_()
                up = (torch.randn(B, S, C, generator=g) * 2).to(device, torch.bfloat16).requires_grad_()
                a = torch.nn.functional.silu(gate.to(torch.float32)).to(torch.bfloat16)
                h = producers.gated(a, up, "identity", producer)
                out = torch_ops.fp8_linear(h, w, None, state, _config(), True)
                out.float().square().mean().backward()
                got += [h, out, gate.grad, up.grad]
        return got + [w.grad, *state.tensors()], counter.calls

    on, fused = run(True)
    off, _ = run(False)
    _assert_same(on, off)
    assert fused == 2


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_gated_activation_in_the_op_has_the_unfused_gradients(activation):
    """The activation computed inside the fused op: the same output and
    gradients as the unfused torch ops (cast, activation, cast, multiply)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(C, N, generator=g) * 0.1
    gate0 = (torch.randn(B, S, C, generator=g) * 2).to(torch.bfloat16)
    up0 = (torch.randn(B, S, C, generator=g) * 2).to(torch.bfloat16)

    def run(fuse):
        state = torch_ops.FP8LinearState.create(history_len=4)
        producer = producers.Producer() if fuse else None
        got = []
        for _ in range(3):
            gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
            h = producers.gated(gate, up, activation, producer)
            out = torch_ops.fp8_linear(h, w, None, state, _config(), True)
            out.float().square().mean().backward()
            got += [h, out, gate.grad, up.grad]
        return got + list(state.tensors())

    on = run(True)
    sharing.clear()
    _assert_same(on, run(False))


def test_another_reader_first_quantizes_itself():
    """A deposit made for Q is not taken by K reading first: K quantizes y
    at its own scale (as unfused), and the producer relinks to K."""
    # Q first in step 1 (links Q), then K first: the deposit for Q is missed.
    g_on = _run_order_switch(True)
    sharing.clear()
    g_off = _run_order_switch(False)
    _assert_same(g_on, g_off)


def _run_order_switch(fuse):
    g = torch.Generator().manual_seed(5)
    weights = [(torch.randn(C, N, generator=g) * 0.1).requires_grad_() for _ in range(2)]
    states = [torch_ops.FP8LinearState.create(history_len=4) for _ in range(2)]
    # Different histories: a wrong scale would show.
    states[1].input_amax_history[0] = 1000.0
    states[1].input_scale.fill_(1000.0 / 448)
    producer = producers.Producer() if fuse else None
    got = []
    for order in ((0, 1), (1, 0), (1, 0)):
        x = (torch.randn(B, S, C, generator=g) * 3)
        inv = torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6)
        y = producers.scaled_rows(x, inv, torch.ones(C), torch.bfloat16, producer)
        outs = [None, None]
        for i in order:
            outs[i] = torch_ops.fp8_linear(y, weights[i], None, states[i], _config(), True)
        got += outs
    return got + [t for s in states for t in s.tensors()]


def test_changed_state_is_not_taken():
    """A linear whose input scale changed after the producer ran quantizes
    y itself, at its new scale."""
    producer = producers.Producer()
    w = torch.randn(C, N) * 0.1
    state = torch_ops.FP8LinearState.create(history_len=4)
    config = _config()

    def step(change):
        x = torch.randn(B, S, C) * 3
        inv = torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6)
        y = producers.scaled_rows(x, inv, torch.ones(C), torch.bfloat16, producer)
        if change:
            state.input_scale.mul_(2.0)
        scale = state.input_scale.clone()
        out = torch_ops.fp8_linear(y, w, None, state, config, True)
        return y, scale, out

    step(False)  # links
    assert producer.linked
    y, scale, out = step(True)
    q = torch_ops.reference.quantize_with_scale(y.reshape(-1, C), scale, torch.float8_e4m3fn)
    qw = torch_ops.reference.quantize_with_scale(w, state.kernel_scale, torch.float8_e4m3fn)
    # The output is the GEMM of y quantized at the changed scale.
    want = torch_ops.reference.fp8_gemm(q, qw.t().contiguous(), scale, state.kernel_scale, out_dtype=torch.bfloat16)
    assert torch.equal(out.reshape(-1, N), want)


@pytest.mark.parametrize("options", [dict(fuse_producers=False), dict(share_quantized_inputs=False),
                                     dict(scaling="current")])
def test_nothing_links_where_fusion_cannot_apply(options):
    _, fused, _ = _run_norm_block("cpu", True, steps=3, config=_config(**options))
    assert fused == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_cast_into_linear(device, out_dtype, request):
    """A float32 norm's cast to the compute dtype (Keras's LayerNormalization
    on torch), fused: the cast's output and gradients bit for bit, the
    norm's float32 output not kept for the backward."""
    if device == "cuda":
        request.getfixturevalue("kernels_required")

    def run(fuse):
        g = torch.Generator().manual_seed(6)
        w = (torch.randn(C, N, generator=g) * 0.1).to(device).requires_grad_()
        gamma = (1 + 0.1 * torch.randn(C, generator=g)).to(device).requires_grad_()
        beta = (0.1 * torch.randn(C, generator=g)).to(device).requires_grad_()
        state = torch_ops.FP8LinearState.create(history_len=4, device=device)
        producer = producers.Producer() if fuse else None
        counter = _Counter("scaled_rows_quantize")
        got = []
        with mock.patch.object(ops, "scaled_rows_quantize", counter):
            for step in range(3):
                x = (torch.randn(B, S, C, generator=g) * (2 + step)).to(device, out_dtype).requires_grad_()
                out32 = torch.nn.functional.layer_norm(x.to(torch.float32), (C,), gamma, beta, 1e-5)
                y = producers.cast(out32, out_dtype, producer)
                out = torch_ops.fp8_linear(y, w, None, state, _config(), True)
                out.float().square().mean().backward()
                got += [y, out, x.grad]
        return got + [w.grad, gamma.grad, beta.grad, *state.tensors()], counter.calls

    on, fused = run(True)
    off, _ = run(False)
    _assert_same(on, off)
    assert fused == 2


def test_cast_keeps_nothing_large_for_the_backward():
    producer = producers.Producer()
    state = torch_ops.FP8LinearState.create(history_len=4)
    w = torch.randn(C, N) * 0.1
    for _ in range(2):
        x = torch.randn(B, S, C, requires_grad=True)
        y = producers.cast(x, torch.bfloat16, producer)
        torch_ops.fp8_linear(y, w, None, state, _config(), True)
    assert producer.linked
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert all(t.numel() < x.numel() for t in saved)


def test_a_slice_of_a_produced_tensor_never_links():
    """A linear reading part of a producer's output (a pooler's first token)
    does not link it: the producer's copy of the whole would go unread."""
    producer = producers.Producer()
    state = torch_ops.FP8LinearState.create(history_len=4)
    w = torch.randn(C, N) * 0.1
    for _ in range(2):
        x = torch.randn(B, S, C)
        y = producers.cast(x, torch.bfloat16, producer)
        torch_ops.fp8_linear(y[:, 0, :], w, None, state, _config(), True)
        assert not producer.linked
    # The whole (or its 2-D view) links.
    torch_ops.fp8_linear(y.view(-1, C), w, None, state, _config(), True)
    assert producer.linked
