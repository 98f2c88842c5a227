"""The demo's front door: its output, its errors, the missing-backend error."""

import subprocess
import sys

import keras
import pytest

from keras_fp8 import demo
from tests.support.backend_utils import REPO
from tests.support.backend_utils import subprocess_env

torch_only = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="a subprocess of its own backend; run once, under torch")


@torch_only
def test_demo_prints_the_table_and_the_health_line():
    result = subprocess.run(
        [sys.executable, "-m", "keras_fp8.demo", "--epochs=1", "--monitor_every=5"],
        cwd=REPO, env=subprocess_env(KERAS_BACKEND="torch"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # The note says which of the two runs here (this process has the demo's backend).
    real = demo.real_fp8_gemms()
    assert ("FP8 GEMMs run on this GPU" in out) == real and ("FP8 is emulated here" in out) != real, out[:500]
    import torch

    assert ("CPU thread(s)" in out) != torch.cuda.is_available()  # threads are set for a CPU run only
    assert "Epoch 1/" not in out  # one progress bar per run, no line per epoch
    assert "accuracy gap (FP8 - bf16)" in out
    assert "FP8 health at step" in out and "(3 layers)" in out


@torch_only
def test_missing_backend_names_the_extra():
    backend, other = "jax", "torch"
    # JAX made unimportable: find_spec gives None.
    code = (f"import sys; sys.modules[{backend!r}] = None; "
            f"sys.argv = ['keras_fp8.demo', '--backend={backend}']; "
            "import runpy; runpy.run_module('keras_fp8.demo', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(KERAS_BACKEND=other),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f'pip install "keras-fp8[{backend}]"' in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@torch_only
def test_import_with_a_missing_backend_names_the_extra():
    code = "import sys; sys.modules['jax'] = None; import keras_fp8"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(KERAS_BACKEND="jax"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert 'KERAS_BACKEND=jax, but the jax package is not installed' in result.stderr
    assert 'pip install "keras-fp8[jax]"' in result.stderr


def test_policy_gets_min_gemm_size_zero_and_bad_policy_is_named():
    import keras_fp8

    assert demo.fp8_policy("fp8_hybrid").name == "fp8_hybrid[min_gemm_size=0]"
    assert demo.fp8_policy("fp8_e4m3[min_gemm_size=5]") == "fp8_e4m3[min_gemm_size=5]"
    from absl import app

    with pytest.raises(app.UsageError, match="--policy"):
        demo.fp8_policy("mixed_bfloat16")
    assert isinstance(demo.fp8_policy("fp8_hybrid"), keras_fp8.FP8DTypePolicy)


def test_emulation_note_says_why_slower():
    if not demo.real_fp8_gemms():
        assert "emulated" in demo.emulation_note() and "slower" in demo.emulation_note()
