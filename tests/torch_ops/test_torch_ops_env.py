"""Settings read from the environment: a value that is set but not understood
warns (naming the variable and what it accepts) and gives the default; it
neither crashes the import nor passes silently. CPU tests (CI included); the
C++ settings' warnings are checked on the GPU in test_torch_ops_linear.py."""

import os
import subprocess
import sys
import warnings

from absl.testing import parameterized

from torch_ops import _env


class EnvChoiceTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self._saved = os.environ.pop("TORCH_OPS_TEST_SETTING", None)

    def tearDown(self):
        os.environ.pop("TORCH_OPS_TEST_SETTING", None)
        if self._saved is not None:
            os.environ["TORCH_OPS_TEST_SETTING"] = self._saved
        super().tearDown()

    def _choice(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = _env.choice("TORCH_OPS_TEST_SETTING", ("a", "b"), "a")
        return value, [str(w.message) for w in caught]

    def _integer(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = _env.integer("TORCH_OPS_TEST_SETTING", 7, minimum=1)
        return value, [str(w.message) for w in caught]

    @parameterized.named_parameters(("unset", None, "a"), ("empty", "", "a"), ("a", "a", "a"), ("b", "b", "b"))
    def test_choice_accepted(self, value, expected):
        if value is not None:
            os.environ["TORCH_OPS_TEST_SETTING"] = value
        got, messages = self._choice()
        self.assertEqual(got, expected)
        self.assertEqual(messages, [])

    @parameterized.named_parameters(("unknown", "c"), ("case", "B"), ("spaces", " b"))
    def test_choice_unknown_warns_and_defaults(self, value):
        os.environ["TORCH_OPS_TEST_SETTING"] = value
        got, messages = self._choice()
        self.assertEqual(got, "a")
        self.assertLen(messages, 1)
        self.assertIn("TORCH_OPS_TEST_SETTING", messages[0])
        self.assertIn("'a', 'b'", messages[0])

    @parameterized.named_parameters(("unset", None, 7), ("empty", "", 7), ("number", "123", 123),
                                    ("padded", " 42 ", 42), ("minimum", "1", 1))
    def test_integer_accepted(self, value, expected):
        if value is not None:
            os.environ["TORCH_OPS_TEST_SETTING"] = value
        got, messages = self._integer()
        self.assertEqual(got, expected)
        self.assertEqual(messages, [])

    @parameterized.named_parameters(("text", "abc"), ("float", "1.5"), ("below_minimum", "0"), ("negative", "-3"))
    def test_integer_bad_warns_and_defaults(self, value):
        os.environ["TORCH_OPS_TEST_SETTING"] = value
        got, messages = self._integer()
        self.assertEqual(got, 7)
        self.assertLen(messages, 1)
        self.assertIn("TORCH_OPS_TEST_SETTING", messages[0])
        self.assertIn(">= 1", messages[0])


def test_import_with_bad_settings_warns_and_keeps_defaults():
    """`import torch_ops` with unusable values: warnings naming each variable,
    the defaults in effect (no ValueError from int() at import)."""
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import torch_ops\n"
            "from torch_ops import _ops, linear\n"
            "print(linear.DEFAULT_MIN_GEMM_SIZE, _ops.GEMM_BACKEND, linear.FAST_PATH)\n")
    env = dict(os.environ, TORCH_OPS_FP8_MIN_GEMM_SIZE="lots", TORCH_OPS_GEMM_BACKEND="cublas",
               TORCH_OPS_LINEAR_FAST="yes", TORCH_OPS_DISABLE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(8192 * 2048 * 2048), "cublaslt", "True"], out.stdout
    for name in ("TORCH_OPS_FP8_MIN_GEMM_SIZE", "TORCH_OPS_GEMM_BACKEND", "TORCH_OPS_LINEAR_FAST"):
        assert name in out.stderr, out.stderr
