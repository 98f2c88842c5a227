"""FP8 state on many processes: DDP, FSDP2, FP8 all-gather; the reduction setting.

The two-process runs (gloo on loopback, `distributed_worker.py`, one run for
every scenario) compare every FP8 state tensor after every step across the
processes and against one process stepping on the concatenated batch from
the same weights: bit for bit (the exact reference runs on CPU).
"""

import io
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import torch_ops
from tests.support.multiprocess import run_worker
from tests.torch_ops import distributed_worker as worker
from torch_ops import distributed as fp8_dist
from torch_ops import fsdp as fp8_fsdp
from torch_ops import gathered as fp8_gathered

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    run_worker(worker.__file__, out, timeout=300)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(worker.WORLD)]


@needs_gloo
@pytest.mark.parametrize("scenario", [s[0] for s in worker.SCENARIOS])
def test_state_equal_on_every_process_and_to_one_process(runs, scenario):
    reference = runs[0][scenario]["reference"]
    assert len(reference) == worker.STEPS
    for rank, run in enumerate(runs):
        for step, (got, want) in enumerate(zip(run[scenario]["states"], reference)):
            assert sorted(got) == sorted(want)
            for name in want:
                assert same(got[name], want[name]), (rank, step, name, got[name], want[name])


@needs_gloo
def test_one_process_evaluates_alone(runs):
    for scenario in ("ddp_broadcast", "ddp_no_broadcast", "ddp_current", "ddp_compiled"):
        assert runs[0][scenario]["evaluated_alone"] == (worker.ROWS, worker.OUT)


@needs_gloo
def test_the_second_process_amax_is_recorded(runs):
    # The rows of process 1 are 10x larger: the recorded input amax is its.
    x, _ = worker.batch(0)
    recorded = runs[0]["ddp_broadcast"]["states"][0]["0.input_amax_history"][0]
    assert float(recorded) == float(x[worker.ROWS:].abs().max()) > float(x[:worker.ROWS].abs().max())


@needs_gloo
@pytest.mark.parametrize("scenario", ["fsdp_fp8_all_gather", "fsdp_fp8_all_gather_current"])
def test_fp8_all_gather_moves_one_byte_per_element(runs, scenario):
    padded_rows = [-(-worker.HIDDEN // worker.WORLD), -(-worker.OUT // worker.WORLD)]
    shard_bytes = padded_rows[0] * worker.IN + padded_rows[1] * worker.HIDDEN  # E4M3: 1 byte each
    for run in runs:
        counts = run[scenario]["counts"]
        # Each step gathers both weights for the forward and again for the backward.
        assert counts["pre_all_gather"] == 4 * worker.STEPS
        assert counts["bytes"] == 2 * shard_bytes * worker.STEPS
        assert counts["gathered_operands"] == 2 * worker.STEPS  # the GEMMs took the gathered FP8 bytes
    assert runs[0]["fsdp"]["counts"]["pre_all_gather"] == 0


@needs_gloo
def test_sharded_state_dict_holds_plain_tensors(runs):
    for run in runs:
        for scenario in ("fsdp", "fsdp_fp8_all_gather", "fsdp_fp8_all_gather_current"):
            assert run[scenario]["plain_state_dict"], scenario


@needs_gloo
def test_fp8_all_gather_trains_as_fsdp2_without_it(runs):
    for run in runs:
        for with_fp8, without in zip(run["fsdp_fp8_all_gather"]["weights"], run["fsdp"]["weights"]):
            for name in without:
                assert same(with_fp8[name], without[name]), name


# --------------------------------------------------------------------------- one process
def test_amax_reduction_group_setting():
    assert fp8_dist.get_amax_reduction_group() == "world"
    assert fp8_dist.reduction_group() is None  # torch.distributed is not initialized here
    with fp8_dist.amax_reduction_group(None):
        assert fp8_dist.get_amax_reduction_group() is None
    assert fp8_dist.get_amax_reduction_group() == "world"
    for bad in ("all", 3, object()):
        with pytest.raises(ValueError, match="group: expected"):
            fp8_dist.set_amax_reduction_group(bad)
    assert fp8_dist.get_amax_reduction_group() == "world"


@pytest.fixture
def one_process_group(tmp_path):
    if not (dist.is_available() and dist.is_gloo_available()) or dist.is_initialized():
        pytest.skip("needs gloo and no process group yet")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_reduce_amax_maps_nan_to_inf(one_process_group):
    assert fp8_dist.reduction_group() is None  # one process: nothing to reduce
    assert float(fp8_dist.reduce_amax(torch.tensor(3.0), one_process_group)) == 3.0
    assert float(fp8_dist.reduce_amax(torch.tensor(float("nan")), one_process_group)) == float("inf")
    with pytest.raises(ValueError, match="group"):
        fp8_dist.set_amax_reduction_group(torch.zeros(2))
    previous = fp8_dist.set_amax_reduction_group(one_process_group)
    try:
        assert fp8_dist.get_amax_reduction_group() is one_process_group
    finally:
        fp8_dist.set_amax_reduction_group(previous)


def test_prepare_ddp_leaves_fp8linear_models_alone():
    model = torch_ops.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(8, 8)))
    assert fp8_dist.prepare_ddp(model) == []
    assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")
    channel = torch.nn.Parameter(torch.zeros(3))
    model.register_parameter("pending", fp8_dist.mark_amax_channel(channel))
    assert fp8_dist.prepare_ddp(model) == ["pending", ".pending"]
    assert model._ddp_params_and_buffers_to_ignore == ["pending", ".pending"]
    with pytest.raises(TypeError, match="module"):
        fp8_dist.prepare_ddp("model")


def _train(layer, x, steps=3):
    outs = []
    for _ in range(steps):
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.float().square().sum().backward()
        outs.append((y.detach(), xx.grad, layer.weight.grad.clone()))
        layer.weight.grad = None
        layer.bias.grad = None
    return outs


def test_fp8_all_gather_weight_without_fsdp_trains_as_before():
    torch.manual_seed(0)
    plain = torch_ops.FP8Linear(32, 24, history_len=4, min_gemm_size=0)
    wrapped = torch_ops.FP8Linear(32, 24, history_len=4, min_gemm_size=0)
    wrapped.load_state_dict(plain.state_dict())
    assert fp8_fsdp.enable_fp8_all_gather(wrapped) == ["weight"]
    assert fp8_fsdp.enable_fp8_all_gather(wrapped) == []  # once
    assert isinstance(wrapped.weight, fp8_fsdp.FP8AllGatherWeight)
    assert isinstance(wrapped.weight, torch.nn.Parameter)
    x = torch.randn(16, 32)
    for got, want in zip(_train(wrapped, x), _train(plain, x)):
        for g, w in zip(got, want):
            assert same(g, w)
    for name, t in plain.named_buffers():
        assert same(getattr(wrapped, name), t), name
    with pytest.raises(TypeError, match="module"):
        fp8_fsdp.enable_fp8_all_gather(3)
    # Checkpoints hold plain tensors and load into either kind of layer.
    buffer = io.BytesIO()
    torch.save(wrapped.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert type(saved["weight"]) is torch.Tensor and same(saved["weight"], plain.weight.detach())
    fresh = torch_ops.FP8Linear(32, 24, history_len=4)
    fp8_fsdp.enable_fp8_all_gather(fresh)
    fresh.load_state_dict(saved)
    assert isinstance(fresh.weight, fp8_fsdp.FP8AllGatherWeight) and same(fresh.weight._tensor, saved["weight"])


def test_gathered_weight_used_elsewhere_is_dequantized_with_a_warning():
    w = torch.randn(8, 16)
    scale = torch.tensor(0.01)
    q = torch_ops.quantize(w, scale, torch.float8_e4m3fn)[0]
    gathered = fp8_gathered.FP8GatheredWeight(q, scale, torch.float32)
    assert gathered.shape == (8, 16) and gathered.dtype == torch.float32
    assert fp8_gathered.fp8_operands(w, False, True) is None
    qw, qwt, s = fp8_gathered.fp8_operands(gathered, False, True)
    assert same(qw.view(torch.uint8), q.view(torch.uint8))  # K = 16: no padding
    assert qwt.shape == (16, 16) and same(s, scale)  # the transpose, rows padded to 16 bytes
    fp8_gathered._warned_dequantized.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        doubled = gathered * 2
    assert any("outside fp8_linear" in str(c.message) for c in caught)
    assert same(doubled, q.float() * scale * 2)
