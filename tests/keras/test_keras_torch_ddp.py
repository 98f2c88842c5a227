"""A Keras FP8 model on the torch backend under DDP (two processes, gloo).

`keras_torch_ddp_worker.py` trains it as Keras's "distributed training with
PyTorch" guide does (DDP around the Keras model, a custom loop), after
`torch_ops.distributed.prepare_ddp`; every FP8 state variable after every
step must be the same on both processes and equal, bit for bit, to one
process stepping on the concatenated batch from the same weights: the
input amax and the output gradient's amax (the gradient channel) are the
max over the processes, never a mean. In the "empty_batch" run process 1's
batch is empty at one step: its layers still take part in the reductions
(the run neither hangs nor aborts), and the state is the one process's on
the rows kept.
"""

import os

import keras
import pytest

from tests.support.multiprocess import REPO
from tests.support.multiprocess import run_worker

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="the torch backend's DDP")

WORKER = os.path.join(REPO, "tests", "keras", "keras_torch_ddp_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("keras_ddp")
    run_worker(WORKER, out, timeout=300, KERAS_TORCH_DEVICE="cpu")  # gloo on the CPU, also beside a GPU
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]


def same(a, b):
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("recipe", ["delayed", "current", "empty_batch"])
def test_state_equal_on_every_process_and_to_one_process(runs, recipe):
    reference = runs[0][recipe]["reference"]
    assert len(reference) == 3
    for rank, run in enumerate(runs):
        for step, (got, want) in enumerate(zip(run[recipe]["states"], reference)):
            assert sorted(got) == sorted(want)
            for name in want:
                assert same(got[name], want[name]), (rank, step, name, got[name], want[name])


def test_prepare_ddp_takes_the_gradient_channels_out_of_ddp(runs):
    ignored = runs[0]["delayed"]["ignored"]
    assert ignored and all(name.endswith("grad_amax_pending") for name in ignored)
    # Both layers' channels, under every name DDP may give them.
    assert len({name.rsplit("/", 2)[-2] for name in ignored}) == 2


def test_one_process_evaluates_alone(runs):
    for recipe in ("delayed", "current"):
        assert runs[0][recipe]["evaluated_alone"] == (8, 8)
    assert runs[0]["empty_batch"]["evaluated_alone"] == (8, 4, 8)
