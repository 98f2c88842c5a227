"""LinearConfig(requantize_weight_in_backward=True): the backward quantizes
the weight again with the forward's scale instead of keeping its FP8 copy
(docs/numerics.md, "Weights in the backward"): the same bits, and no FP8
copy of the weight among the tensors the graph keeps."""

import pytest
import torch

import torch_ops
from torch_ops import sharing
from tests.support.torch_checks import FP8_GPU
from tests.support.torch_checks import kernels_required  # noqa: F401 (fixture)

M, K, N = 40, 64, 48
DEVICES = ("cpu", "cuda") if FP8_GPU else ("cpu",)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)


def _step(config, device, seed, steps=3, gradient_channel=False):
    """Outputs, dx, dW, db and the state after `steps` training calls on
    fresh random data (magnitudes from tiny to huge across the steps)."""
    g = torch.Generator().manual_seed(seed)
    shape = (K, N) if config.weight_layout == "in_out" else (N, K)
    w = (torch.randn(*shape, generator=g) * 3).to(device).requires_grad_()
    b = torch.randn(N, generator=g).to(device).requires_grad_()
    state = torch_ops.FP8LinearState.create(history_len=4, device=device, gradient_channel=gradient_channel)
    out = []
    for step, magnitude in zip(range(steps), (1e-3, 1e3, 1.0)):
        sharing.clear()
        x = (torch.randn(3, M // 3 + 1, K, generator=g) * magnitude).to(device, torch.bfloat16).requires_grad_()
        gy = torch.randn(3, M // 3 + 1, N, generator=g).to(device, torch.bfloat16)
        y = torch_ops.fp8_linear(x, w, b, state, config, training=True)
        y.backward(gy)
        out += [y.detach(), x.grad, w.grad.clone(), b.grad.clone()]
        w.grad = b.grad = None
    return out + [t.clone() for t in state.tensors()]


def _device(request, device):
    """`device`, its kernels required where it is the GPU."""
    if device == "cuda":
        request.getfixturevalue("kernels_required")
    return device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,layout,channel", [
    ("delayed", "in_out", False), ("delayed", "out_in", False), ("current", "in_out", False),
    ("block", "in_out", False), ("block", "out_in", False), ("delayed", "in_out", True),
])
def test_same_bits_as_keeping_the_copy(request, device, scaling, layout, channel):
    device = _device(request, device)
    fmt = "e4m3" if scaling == "block" else "hybrid"
    base = dict(fp8_format=fmt, scaling=scaling, weight_layout=layout, min_gemm_size=0)
    kept = _step(torch_ops.LinearConfig(**base), device, seed=7, gradient_channel=channel)
    again = _step(torch_ops.LinearConfig(requantize_weight_in_backward=True, **base), device, seed=7,
                  gradient_channel=channel)
    for i, (a, b) in enumerate(zip(kept, again)):
        assert torch.equal(a, b), f"tensor {i} differs"


def _saved_fp8(config, device):
    """The numbers of elements of the FP8 tensors the graph keeps."""
    w = torch.randn(K, N, device=device, requires_grad=True)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    state = torch_ops.FP8LinearState.create(history_len=4, device=device)
    sizes = []

    def pack(t):
        if t.dtype in FP8_DTYPES:
            sizes.append(t.numel())
        return t

    sharing.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch_ops.fp8_linear(x, w, None, state, config, training=True)
    return sizes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["delayed", "current", "block"])
def test_no_fp8_weight_copy_is_kept(request, device, scaling):
    device = _device(request, device)
    fmt = "e4m3" if scaling == "block" else "hybrid"
    base = dict(fp8_format=fmt, scaling=scaling, weight_layout="in_out", min_gemm_size=0)
    kept = _saved_fp8(torch_ops.LinearConfig(**base), device)
    assert any(s >= K * N for s in kept) and len(kept) >= 2, kept
    again = _saved_fp8(torch_ops.LinearConfig(requantize_weight_in_backward=True, **base), device)
    assert len(again) == len(kept) - 1, (kept, again)


def test_a_bad_value_names_the_field():
    with pytest.raises(ValueError, match="requantize_weight_in_backward"):
        torch_ops.LinearConfig(requantize_weight_in_backward="yes")


def test_with_it_a_call_takes_the_ops_route():
    config = torch_ops.LinearConfig(requantize_weight_in_backward=True, min_gemm_size=0)
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda" if FP8_GPU else "cpu")
    w = torch.randn(N, K, device=x.device)
    state = torch_ops.FP8LinearState.create(history_len=4, device=x.device)
    _, route = torch_ops.linear.linear_call(x, w, None, state, config, True)
    assert route == torch_ops.linear.OPS
