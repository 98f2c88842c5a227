"""`import keras_fp8` sets XLA's FP8-friendly flags under the JAX backend."""

import os
import subprocess
import sys
import warnings
from unittest import mock

from absl.testing import parameterized

from keras_fp8.backends import xla_flags
from tests.support.backend_utils import subprocess_env


def _env(**values):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(values)
    return env


class ConfigureTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        xla_flags._warned.clear()
        self.enter_context(mock.patch.object(
            xla_flags, "_jax_backend_started", return_value=False
        ))

    def test_adds_the_flag_for_jax(self):
        with mock.patch.dict(os.environ, _env(), clear=True):
            self.assertTrue(xla_flags.configure("jax"))
            self.assertEqual(os.environ["XLA_FLAGS"], xla_flags.TRITON_GEMM_FLAG)

    def test_keeps_other_user_flags(self):
        with mock.patch.dict(
            os.environ, _env(XLA_FLAGS="--xla_dump_to=/tmp/d"), clear=True
        ):
            xla_flags.configure("jax")
            self.assertEqual(
                os.environ["XLA_FLAGS"],
                "--xla_dump_to=/tmp/d " + xla_flags.TRITON_GEMM_FLAG,
            )

    @parameterized.named_parameters(
        ("torch_backend", "torch", {}),
        ("user_choice_wins", "jax",
         {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}),
        ("user_opt_out", "jax",
         {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/d"}),
    )
    def test_leaves_flags_alone(self, backend, env):
        with mock.patch.dict(os.environ, _env(**env), clear=True):
            self.assertFalse(xla_flags.configure(backend))
            self.assertEqual(os.environ.get("XLA_FLAGS"), env.get("XLA_FLAGS"))

    def test_too_late_on_gpu_warns_once(self):
        with mock.patch.dict(os.environ, _env(), clear=True), \
                mock.patch.object(xla_flags, "_jax_backend_started",
                                  return_value=True), \
                mock.patch.object(xla_flags, "_on_gpu", return_value=True):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.assertFalse(xla_flags.configure("jax"))
                self.assertFalse(xla_flags.configure("jax"))
            self.assertNotIn("XLA_FLAGS", os.environ)
        messages = [str(w.message) for w in caught]
        self.assertLen(messages, 1)
        self.assertIn("xla_gpu_enable_triton_gemm=false", messages[0])

    def test_import_in_a_fresh_process(self):
        code = (
            "import os, keras_fp8, jax.numpy as jnp; "
            "jnp.ones(2).block_until_ready(); print(os.environ['XLA_FLAGS'])"
        )
        env = subprocess_env(KERAS_BACKEND="jax")
        env.pop("XLA_FLAGS", None)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True,
            text=True, check=True, timeout=120,
        )
        self.assertEqual(out.stdout.strip(), xla_flags.TRITON_GEMM_FLAG)
