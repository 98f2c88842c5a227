"""benchmarks/multi_gpu.py on CPU: its arguments, and a dry run of the
FSDP2 engine (two gloo processes, a tiny decoder), so that a slip fails
here rather than on a multi-GPU machine."""

import json
import os

import pytest

from tests.support.multiprocess import REPO
from tests.support.multiprocess import run_worker

torch = pytest.importorskip("torch")

from benchmarks import multi_gpu  # noqa: E402


def test_arguments():
    args = multi_gpu.parse_args(["--device", "cpu", "--tiny", "--modes", "bf16,fp8_all_gather"])
    assert args.modes == ("bf16", "fp8_all_gather") and args.nproc == 2 and args.hidden == 64
    assert multi_gpu.parse_args(["--engine", "jax", "--device", "cpu"]).modes == multi_gpu.JAX_MODES
    with pytest.raises(SystemExit):
        multi_gpu.parse_args(["--engine", "jax", "--modes", "fp8"])


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
def test_fsdp2_dry_run_gathers_fewer_bytes_in_fp8():
    output = run_worker(os.path.join(REPO, "benchmarks", "multi_gpu.py"), "--engine", "torch", "--device", "cpu",
                        "--tiny", "--modes", "bf16,fp8_all_gather", timeout=240)
    results = {r["mode"]: r for r in (json.loads(line[len("RESULT "):]) for line in output.splitlines()
                                      if line.startswith("RESULT "))}
    assert sorted(results) == ["bf16", "fp8_all_gather"]
    bf16, fp8 = results["bf16"], results["fp8_all_gather"]
    # The projections (2 blocks of 64x192, 64x64, 2 x 64x128, 128x64) are gathered for the
    # forward and the backward: 1 byte per element instead of bf16's 2.
    projections = 2 * (64 * 192 + 64 * 64 + 2 * 64 * 128 + 128 * 64)
    assert bf16["all_gather_bytes_per_step"] - fp8["all_gather_bytes_per_step"] == 2 * projections
    assert fp8["tokens_per_s"] > 0 and len(fp8["losses"]) == 3
