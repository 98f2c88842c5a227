"""Settings as validated data, the three environment variables, and the
hardware gate (proved on CPU by faking a GPU's compute capability)."""

import os
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch
from absl.testing import parameterized

import torch_ops
from torch_ops import extension
from tests.support.backend_utils import REPO
from tests.support.backend_utils import subprocess_env


class SettingsTest(parameterized.TestCase):
    def test_defaults(self):
        s = torch_ops.Settings()
        self.assertIsNone(s.min_gemm_size)
        self.assertTrue(s.gemm_autotune)
        self.assertEqual(s.resolved_min_gemm_size(True), torch_ops.DEFAULT_MIN_GEMM_SIZE)
        self.assertEqual(s.resolved_min_gemm_size(False), 0)
        self.assertEqual(torch_ops.Settings(min_gemm_size=5).resolved_min_gemm_size(True), 5)

    @parameterized.named_parameters(
        ("negative", dict(min_gemm_size=-1), "min_gemm_size"),
        ("string", dict(min_gemm_size="x"), "min_gemm_size"),
        ("bool", dict(min_gemm_size=True), "min_gemm_size"),
        ("float", dict(min_gemm_size=1.5), "min_gemm_size"),
        ("autotune", dict(gemm_autotune=1), "gemm_autotune"),
    )
    def test_bad_values_are_named(self, kwargs, name):
        with self.assertRaisesRegex(ValueError, name):
            torch_ops.Settings(**kwargs)

    def test_set_settings_returns_the_previous_ones(self):
        before = torch_ops.get_settings()
        previous = torch_ops.set_settings(min_gemm_size=7)
        try:
            self.assertIs(previous, before)
            self.assertEqual(torch_ops.get_settings().min_gemm_size, 7)
            self.assertTrue(torch_ops.get_settings().gemm_autotune)
        finally:
            torch_ops.set_settings(previous)
        self.assertEqual(torch_ops.get_settings(), before)
        with self.assertRaisesRegex(ValueError, "min_gemm_sizes: not a torch_ops setting"):
            torch_ops.set_settings(min_gemm_sizes=1)
        with self.assertRaisesRegex(TypeError, "settings: expected a torch_ops.Settings"):
            torch_ops.set_settings({"min_gemm_size": 1})

    def test_the_setting_reaches_fp8_linear(self):
        st = torch_ops.FP8LinearState.create(4)
        previous = torch_ops.set_settings(min_gemm_size=10**9)
        try:
            torch_ops.fp8_linear(torch.randn(2, 8), torch.randn(4, 8), None, st)
        finally:
            torch_ops.set_settings(previous)
        self.assertEqual(float(st.input_amax_history.abs().max()), 0.0)  # the compute-dtype path


class EnvironmentTest(parameterized.TestCase):
    def test_only_three_variables_are_read(self):
        import pathlib
        import re

        names = set()
        for path in list(pathlib.Path(REPO, "torch_ops").glob("*.py")) + list(pathlib.Path(REPO, "csrc").glob("*")):
            names |= set(re.findall(r"TORCH_OPS_[A-Z_]+", path.read_text()))
        self.assertEqual(names, {"TORCH_OPS_DISABLE", "TORCH_OPS_REQUIRE_KERNELS", "TORCH_OPS_BUILD_DIR"})
        keras_names = set()
        for path in pathlib.Path(REPO, "keras_fp8").rglob("*.py"):
            keras_names |= set(re.findall(r"KERAS_FP8_[A-Z_]+", path.read_text()))
        self.assertEqual(keras_names, set())

    def test_build_dir(self):
        with mock.patch.dict(os.environ, {"TORCH_OPS_BUILD_DIR": "/tmp/x"}):
            self.assertTrue(str(extension.build_directory()).startswith("/tmp/x/torch"))

    def test_disable(self):
        with mock.patch.dict(os.environ, {"TORCH_OPS_DISABLE": "1"}):
            self.assertIn("TORCH_OPS_DISABLE", extension.device_problem())

    def test_bad_flag_value_is_named(self):
        with mock.patch.dict(os.environ, {"TORCH_OPS_REQUIRE_KERNELS": "maybe"}):
            with self.assertRaisesRegex(ValueError, "TORCH_OPS_REQUIRE_KERNELS: expected 0 or 1"):
                extension.kernels_required()


class _FakeGpu:
    """Makes torch report one CUDA GPU of `capability` (CPU-only machine)."""

    def __init__(self, capability):
        self.capability = capability

    def __enter__(self):
        self.patches = [
            mock.patch.object(torch.version, "cuda", "13.0"),
            mock.patch.object(torch.cuda, "is_available", return_value=True),
            mock.patch.object(torch.cuda, "device_count", return_value=1),
            mock.patch.object(torch.cuda, "current_device", return_value=0),
            mock.patch.object(torch.cuda, "get_device_capability", return_value=self.capability),
            mock.patch.object(torch.cuda, "get_device_name", return_value="Fake GPU"),
            mock.patch.object(torch.cuda, "device", return_value=mock.MagicMock()),
            mock.patch.dict(extension._BY_DEVICE, clear=True),
        ]
        for p in self.patches:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in reversed(self.patches):
            p.stop()


class _FakeCudaTensor:
    device = torch.device("cuda", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes a GPU on a machine without one")
class HardwareGateTest(parameterized.TestCase):
    @parameterized.parameters((8, 0), (8, 6), (10, 0), (12, 0))
    def test_unbuilt_architectures_get_a_warning_and_the_reference(self, major, minor):
        with _FakeGpu((major, minor)):
            self.assertFalse(extension.fp8_gpu_present())
            problem = extension.device_problem(0)
            self.assertIn(f"sm_{major}{minor}", problem)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.assertIsNone(extension.kernels_for(_FakeCudaTensor()))
                self.assertIsNone(extension.kernels_for(_FakeCudaTensor()))  # cached: no second warning
            messages = [str(w.message) for w in caught]
            self.assertLen(messages, 1)
            self.assertIn("running the exact FP8 reference on cuda:0", messages[0])

    @parameterized.parameters((8, 9), (9, 0))
    def test_build_targets_are_served(self, major, minor):
        with _FakeGpu((major, minor)):
            self.assertTrue(extension.fp8_gpu_present())
            self.assertIsNone(extension.capability_problem((major, minor)))

    def test_required_kernels_raise_instead(self):
        with _FakeGpu((10, 0)), mock.patch.dict(os.environ, {"TORCH_OPS_REQUIRE_KERNELS": "1"}):
            with self.assertRaisesRegex(RuntimeError, "TORCH_OPS_REQUIRE_KERNELS=1.*sm_100"):
                extension.kernels_for(_FakeCudaTensor())

    def test_cpu_tensors_run_the_reference_silently(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self.assertIsNone(extension.kernels_for(torch.zeros(1)))


def test_info_command_runs():
    out = subprocess.run([sys.executable, "-m", "torch_ops", "info"], capture_output=True, text=True, timeout=120,
                         env=subprocess_env(), cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("torch_ops kernels:")


class KernelConstantsTest(parameterized.TestCase):
    """The extension's load compares the kernels' constants with the reference's."""

    class _Built:
        def __init__(self, **changes):
            self.values = {**extension.expected_constants(), **changes}

        def constants(self):
            return {k: list(v) if isinstance(v, tuple) else v for k, v in self.values.items()}

    def test_equal_constants_pass(self):
        extension.check_constants(self._Built())

    @parameterized.parameters(
        ("fp8_max", (448.0, 57344.5)),
        ("min_scale", 2.0**-125),
        ("amax_compute_algo_ids", (1, 0)),
        ("max_history_len", 2**21),
        ("fold_count_period", 2.0**19),
        ("fp8_format_ids", (0, 2)),
    )
    def test_a_different_constant_is_named(self, name, value):
        with self.assertRaisesRegex(RuntimeError, f"{name}: the reference has"):
            extension.check_constants(self._Built(**{name: value}))
