"""FP8 models under keras.distribution: DataParallel, ModelParallel (JAX).

`keras_distribution_worker.py` runs on 8 virtual CPU devices
(`--xla_force_host_platform_device_count=8`, in a subprocess): a 2 x 4
ModelParallel mesh whose LayoutMap keys also match the FP8 state variables'
paths, DataParallel, `model.fit`, and a save and reload inside the scope.
Every FP8 state variable must be replicated and, after every step, equal
bit for bit to the state of one device stepping on the same global batch
from the same weights (sharded kernels get the global amax).
"""

import json
import os

import keras
import pytest

from tests.support.multiprocess import REPO
from tests.support.multiprocess import run_worker

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="keras.distribution runs on JAX")

WORKER = os.path.join(REPO, "tests", "keras", "keras_distribution_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_distribution") / "results.json"
    # Eight virtual CPU devices, also where a GPU is present (JAX would pick it).
    run_worker(WORKER, out, timeout=300, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("run", ["data_parallel", "model_parallel", "reload"])
def test_state_replicated_and_equal_to_one_device(results, run):
    assert results[run]["differences"] == []
    assert results[run]["replicated"]


def test_model_parallel_shards_the_kernels_not_the_state(results):
    for run in ("model_parallel", "reload"):
        assert results[run]["kernel_specs"] == {"dense_1": "P(None, 'model')", "dense_2": "P('model', None)"}
    assert results["data_parallel"]["kernel_specs"] == {"dense_1": "P(None, None)", "dense_2": "P(None, None)"}


def test_fit_under_data_parallel(results):
    assert results["fit"]["replicated"]
    assert results["fit"]["max_relative_difference"] <= 1e-6
