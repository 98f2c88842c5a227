"""The benchmarks' table code on made-up numbers (CPU): a formatting slip
should fail here, not after minutes of GPU time."""

import io
import contextlib

import pytest
from absl.testing import parameterized

torch = pytest.importorskip("torch")

from benchmarks import linear  # noqa: E402
from benchmarks import model  # noqa: E402

_KEYS = ["bf16", "floor", "gemms", "ours_fp8", "ours"]


def _times(torchao, graphs):
    t = {k: 1.0 + 0.1 * i for i, k in enumerate(_KEYS)}
    t.update({f"{k}_b2b": 0.9 + 0.1 * i for i, k in enumerate(_KEYS)})
    t.update({k: (2.0 if graphs else None) for k in ("bf16_g", "ours_g", "floor_g", "gemms_g")})
    t["torchao"] = 1.5 if torchao else None
    if torchao:
        t["torchao_b2b"] = 1.4
    return t


class LinearSummaryTest(parameterized.TestCase):
    @parameterized.product(torchao=[False, True], graphs=[False, True])
    def test_print_summary(self, torchao, graphs):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            linear.print_summary([((16, 32, 64), _times(torchao, graphs))])
        rows = [line for line in out.getvalue().splitlines() if line.startswith("| 16x32x64")]
        self.assertLen(rows, 2)  # the synchronized and the back-to-back table
        header_cols = [line.count("|") for line in out.getvalue().splitlines() if line.startswith("| M x K x N")]
        self.assertEqual([row.count("|") for row in rows], header_cols)
        # ours/bf16 of the synchronized table: 1.0 / 1.4
        self.assertIn("| 0.71x |", rows[0])


class ModelArgsTest(parameterized.TestCase):
    def test_interleave_arguments(self):
        args = model.parse_args(["--interleave", "mixed_bfloat16,fp8_hybrid", "--rounds", "3", "--steps", "4"])
        self.assertEqual(args.interleave.split(","), ["mixed_bfloat16", "fp8_hybrid"])
        self.assertEqual((args.rounds, args.steps), (3, 4))
