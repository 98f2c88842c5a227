"""torch_ops.reference against NumPy float32 arithmetic and ml_dtypes' casts.

The reference defines the numerics every other torch_ops path is tested
against; here it is checked against an independent NumPy implementation,
and against keras_fp8's NumPy reference's constants (tests/support/numpy_reference.py).
"""

import ml_dtypes
import numpy as np
import torch
from absl.testing import parameterized

from torch_ops import reference as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NP = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
MAX = {E4M3: 448.0, E5M2: 57344.0}
F32 = np.float32


def _special(x: torch.Tensor) -> torch.Tensor:
    """Random data with values past the max, NaN, +-inf, zeros sprinkled in."""
    x = x.clone()
    flat = x.view(-1)
    if flat.numel() >= 8:
        flat[:7] = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e9, -1e9, 0.0, -0.0])
    return x


def _numpy_quantize(x: np.ndarray, scale, dt) -> np.ndarray:
    m = F32(MAX[dt])
    x = x.astype(F32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.where(np.isinf(x), F32(np.nan), (x * (F32(1.0) / F32(scale))).astype(F32))
        y = np.where(np.isnan(y), y, np.clip(y, -m, m))
    return y.astype(NP[dt])


def _numpy_scale(window, prev, dt, margin=0.0):
    window = F32(window)
    if not np.isfinite(window) or window <= 0:
        return F32(prev)
    return F32(max(F32(window * F32(1.0 / MAX[dt])), F32(2.0**-126)) * F32(2.0**margin))


class QuantizeTest(parameterized.TestCase):
    @parameterized.product(dt=[E4M3, E5M2], in_dtype=[torch.float32, torch.bfloat16, torch.float16],
                           shape=[(1, 16), (17, 33), (3, 9, 33)], magnitude=[1e-30, 1.0, 300.0, 1e30])
    def test_bytes_match_ml_dtypes(self, dt, in_dtype, shape, magnitude):
        torch.manual_seed(0)
        x = _special(torch.randn(shape) * magnitude).to(in_dtype)
        scale = F32(0.37 * magnitude) if magnitude < 1e20 else F32(1e27)
        q = ref.quantize_with_scale(x, torch.tensor(scale), dt)
        want = _numpy_quantize(x.float().numpy(), scale, dt).astype(F32)
        got = q.float().numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_array_equal(got[ok], want[ok])
        self.assertTrue(torch.isnan(ref.amax(x)))

    @parameterized.parameters(E4M3, E5M2)
    def test_saturation_and_non_finite(self, dt):
        x = torch.tensor([1e30, -1e30, MAX[dt] * 1.06, 0.0, float("inf"), float("-inf"), float("nan")])
        q = ref.quantize_with_scale(x, torch.tensor(1.0), dt).float()
        m = MAX[dt]
        self.assertEqual(q[:4].tolist(), [m, -m, m, 0.0])
        self.assertTrue(bool(torch.isnan(q[4:]).all()))  # non-finite stays non-finite

    def test_amax_propagates(self):
        self.assertEqual(ref.amax(torch.tensor([1.0, -3.0])).item(), 3.0)
        self.assertTrue(torch.isinf(ref.amax(torch.tensor([1.0, float("-inf")]))))
        self.assertTrue(torch.isnan(ref.amax(torch.tensor([float("inf"), float("nan")]))))
        self.assertEqual(ref.amax(torch.zeros(0)).item(), 0.0)

    @parameterized.product(dt=[E4M3, E5M2], margin=[0.0, 1.0, 2.5, 8.0])
    def test_compute_scale(self, dt, margin):
        prev = torch.tensor(0.5)
        for w in (0.0, float("inf"), float("nan"), -1.0):
            self.assertEqual(ref.compute_scale(torch.tensor(w), prev, dt, margin).item(), 0.5)
        for w in (3.3, 1e-30, 1e-37, 1e-40, 1e-45, 1e30, 3e38, 448.0):
            got = F32(ref.compute_scale(torch.tensor(w), prev, dt, margin=margin).item())
            self.assertEqual(got, _numpy_scale(w, 0.5, dt, margin))


class DelayedTest(parameterized.TestCase):
    @parameterized.parameters("max", "most_recent")
    def test_history_after_k_calls(self, algo):
        torch.manual_seed(1)
        h, s = torch.zeros(6), torch.ones(())
        amaxes = []
        for k in range(8):
            x = torch.randn(5, 7) * (k + 1)
            a = x.abs().max().item()
            empty = h.max().item() == 0
            prev = s.item()
            _, su, am = ref.quantize_delayed(x, h, s, E4M3, amax_compute_algo=algo)
            self.assertEqual(am.item(), a)
            self.assertEqual(F32(su.item()), _numpy_scale(a, 1.0, E4M3) if empty else F32(prev))
            amaxes.insert(0, a)
            np.testing.assert_array_equal(h.numpy()[: min(k + 1, 6)], F32(amaxes[:6]))
            win = max(amaxes[:6]) if algo == "max" else amaxes[0]
            self.assertEqual(F32(s.item()), _numpy_scale(win, 1.0, E4M3))

    def test_nonfinite_not_recorded_zero_recorded(self):
        h, s = torch.zeros(4), torch.ones(())
        ref.quantize_delayed(torch.full((3,), 2.0), h, s, E4M3)
        h0, s0 = h.clone(), s.clone()
        _, su, _ = ref.quantize_delayed(torch.tensor([1.0, float("inf")]), h, s, E4M3)
        self.assertTrue(torch.equal(h, h0))
        self.assertTrue(torch.equal(s, s0))
        self.assertTrue(torch.equal(su, s0))
        ref.quantize_delayed(torch.zeros(3), h, s, E4M3)
        self.assertEqual(h.tolist(), [0.0, 2.0, 0.0, 0.0])

    def test_record_false_writes_nothing(self):
        h, s = torch.zeros(4), torch.ones(())
        _, su, _ = ref.quantize_delayed(torch.full((3,), 448.0 * 4), h, s, E4M3, record=False)
        self.assertEqual(su.item(), 4.0)  # seeded from the tensor itself
        self.assertEqual(h.tolist(), [0.0] * 4)
        self.assertEqual(s.item(), 1.0)

    def test_record_amax_skip_zero(self):
        h, s = torch.zeros(3), torch.ones(())
        ref.record_amax(h, s, torch.tensor(0.0), E5M2, skip_zero=True)
        self.assertEqual(h.tolist(), [0.0] * 3)
        ref.record_amax(h, s, torch.tensor(0.0), E5M2)
        self.assertEqual(h.tolist(), [0.0] * 3)
        ref.record_amax(h, s, torch.tensor(5.0), E5M2)
        ref.record_amax(h, s, torch.tensor(float("nan")), E5M2)
        self.assertEqual(h.tolist(), [5.0, 0.0, 0.0])
        self.assertEqual(F32(s.item()), _numpy_scale(5.0, 1.0, E5M2))

    def test_window_length(self):
        h = torch.tensor([1.0, 2.0, 9.0, 4.0])
        self.assertEqual(ref.window(h, "max", 2).item(), 2.0)
        self.assertEqual(ref.window(h, "max").item(), 9.0)
        self.assertEqual(ref.window(h, "most_recent", 2).item(), 1.0)

    def test_current_scaling(self):
        x = torch.randn(9, 4) * 10
        _, su, a = ref.quantize_current(x, E4M3)
        self.assertEqual(F32(su.item()), _numpy_scale(a.item(), 1.0, E4M3))
        _, su, _ = ref.quantize_current(torch.zeros(3), E4M3, prev_scale=torch.tensor(0.25))
        self.assertEqual(su.item(), 0.25)


class GemmTest(parameterized.TestCase):
    def test_gemm_matches_numpy(self):
        torch.manual_seed(2)
        a = (torch.randn(17, 9) * 3).to(E4M3)
        b = (torch.randn(33, 9) * 3).to(E5M2)
        bias = torch.randn(33)
        out = ref.fp8_gemm(a, b, torch.tensor(0.5), torch.tensor(0.25), bias=bias, out_dtype=torch.float32)
        want = (a.float().numpy() @ b.float().numpy().T) * F32(0.125) + bias.numpy()
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-5)


def numpy_fold(pending, fold_state, history, scale, fmt_max, margin, algo, window, update_scale):
    """An independent float32 fold (the rule in torch_ops/reference.py)."""
    amax, token, loss_scale = (F32(v) for v in pending)
    folds, last_token, last_loss_scale = (F32(v) for v in fold_state)
    history = np.array(history, dtype=F32)
    scale = F32(scale)
    rescale = F32(1)
    if loss_scale > 0 and last_loss_scale > 0:
        rescale = F32(loss_scale / max(last_loss_scale, F32(1e-30)))
    history = (history * rescale).astype(F32)
    scale = F32(scale * rescale)
    fresh = token > 0 and token != last_token
    if fresh and np.isfinite(amax) and amax > 0:
        history = np.concatenate([[amax], history[:-1]]).astype(F32)
    scale = max(scale, F32(2.0**-126))
    if update_scale:
        w = history[0] if algo == "most_recent" else history[:window].max()
        if fresh and np.isfinite(w) and w > 0:
            scale = F32(max(F32(w * F32(1.0 / fmt_max)), F32(2.0**-126)) * F32(2.0**margin))
    new_folds = F32((folds + 1) % ref.FOLD_COUNT_PERIOD) if fresh else folds
    state = np.array(
        [new_folds, token if fresh else last_token, loss_scale if loss_scale > 0 else last_loss_scale], F32)
    return F32(new_folds + 1), scale, history, state


def random_fold_case(rng, H):
    history = (rng.random(H, dtype=F32) * 10.0 ** rng.integers(-3, 4)).astype(F32)
    history[rng.random(H) < 0.2] = 0
    amax = F32(rng.choice([0.0, np.inf, np.nan, rng.random() * 100, rng.random() * 1e-3, 5e4]))
    last_token = F32(rng.integers(0, 4))
    token = F32(rng.choice([0, last_token, rng.integers(1, 6)]))
    last_ls = F32(rng.choice([0.0, 2.0 ** rng.integers(-2, 16)]))
    ls = F32(rng.choice([0.0, last_ls, 2.0 ** rng.integers(-2, 16)]))
    folds = F32(rng.choice([0.0, 3.0, ref.FOLD_COUNT_PERIOD - 1]))
    scale = F32(rng.choice([rng.random() * 0.01 + 1e-6, 2.0**-125]))  # the floor reached by a 1/4 rescale
    amax = F32(rng.choice([amax, 1e-39]))  # a subnormal amax now and then
    return [amax, token, ls], [folds, last_token, last_ls], history, scale


class FoldTest(parameterized.TestCase):
    @parameterized.product(fp8_dtype=[E4M3, E5M2], algo=["max", "most_recent"], margin=[0.0, 2.0],
                           update_scale=[True, False])
    def test_matches_numpy(self, fp8_dtype, algo, margin, update_scale):
        rng = np.random.default_rng(0)
        for case in range(60):
            H = int(rng.choice([1, 2, 17, 64]))
            window = int(rng.integers(1, H + 3))
            pending, fold_state, history, scale = random_fold_case(rng, H)
            want = numpy_fold(pending, fold_state, history, scale, MAX[fp8_dtype], margin, algo, min(window, H),
                              update_scale)
            fs, h, s = torch.tensor(fold_state), torch.tensor(history), torch.tensor(scale)
            token, s_copy, h_copy = ref.fold_pending_grad_amax(
                torch.tensor(pending), fs, h, s, fp8_dtype, margin=margin, amax_compute_algo=algo,
                window_len=window, update_scale=update_scale)
            msg = f"case {case}: pending={pending} fold_state={fold_state}"
            np.testing.assert_array_equal(token.numpy(), want[0], err_msg=msg)
            np.testing.assert_array_equal(s.numpy(), want[1], err_msg=msg)
            np.testing.assert_array_equal(s_copy.numpy(), want[1], err_msg=msg)
            np.testing.assert_array_equal(h.numpy(), want[2], err_msg=msg)
            np.testing.assert_array_equal(h_copy.numpy(), want[2], err_msg=msg)
            np.testing.assert_array_equal(fs.numpy(), want[3], err_msg=msg)

    def test_copies_are_copies(self):
        fs, h, s = torch.zeros(3), torch.zeros(4), torch.ones(())
        _, s_copy, h_copy = ref.fold_pending_grad_amax(torch.tensor([2.0, 1.0, 0.0]), fs, h, s, E5M2)
        ref.fold_pending_grad_amax(torch.tensor([8.0, 2.0, 0.0]), fs, h, s, E5M2)
        self.assertEqual(float(h_copy[0]), 2.0)
        self.assertEqual(float(h[0]), 8.0)
        self.assertNotEqual(float(s_copy), float(s))


class ConstantsTest(parameterized.TestCase):
    def test_same_constants_as_keras_fp8(self):
        """torch_ops and keras_fp8 each define the format facts once: the same."""
        from keras_fp8 import numerics
        from keras_fp8 import recipes

        self.assertEqual(ref.FP8_MAX[E4M3], recipes.FORMAT_MAX["e4m3"])
        self.assertEqual(ref.FP8_MAX[E5M2], recipes.FORMAT_MAX["e5m2"])
        self.assertEqual(ref.FOLD_COUNT_PERIOD, numerics.FOLD_COUNT_PERIOD)
        self.assertEqual(ref.margin_multiplier(1.5), float(numerics.margin_multiplier(1.5)))
        import torch_ops

        self.assertEqual(torch_ops.DEFAULT_MIN_GEMM_SIZE, recipes.DEFAULT_MIN_GEMM_SIZE)

    def test_reference_imports_nothing_else_of_torch_ops(self):
        import ast
        import inspect

        tree = ast.parse(inspect.getsource(ref))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                self.assertNotEqual(node.level, 1, "a relative import in torch_ops/reference.py")
                self.assertFalse((node.module or "").startswith("torch_ops"))
            if isinstance(node, ast.Import):
                self.assertFalse(any(a.name.startswith("torch_ops") for a in node.names))


class BlockReferenceTest(parameterized.TestCase):
    """The block-scaling reference against tests/support/numpy_reference.py (NumPy): the
    same bytes and scales."""

    @parameterized.product(shape=[(128, 256), (130, 300), (3, 5)], dt=[E4M3, E5M2], power_of_two=[False, True],
                           magnitude=[1e-36, 1.0, 1e30])
    def test_tiles_and_blocks_match_numpy(self, shape, dt, power_of_two, magnitude):
        from tests.support import numpy_reference as np_ref

        fmt = "e4m3" if dt == E4M3 else "e5m2"
        torch.manual_seed(shape[0] + shape[1])
        x = torch.randn(shape)
        x = _special(torch.sign(x) * (x.abs() + 1) * magnitude)
        for axis in (0, 1):
            q, s = ref.quantize_tiles(x, dt, axis=axis, margin=1.0, power_of_two=power_of_two)
            q_np, s_np = np_ref.quantize_tiles(x.numpy(), fmt, axis, 1.0, power_of_two)
            np.testing.assert_array_equal(s.numpy(), s_np)
            got, want = q.float().numpy(), q_np.astype(F32)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
        q, s = ref.quantize_blocks(x, dt, margin=0.0, power_of_two=power_of_two)
        q_np, s_np = np_ref.quantize_blocks(x.numpy(), fmt, 0.0, power_of_two)
        np.testing.assert_array_equal(s.numpy(), s_np)
        got, want = q.float().numpy(), q_np.astype(F32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])

    @parameterized.parameters((64, 256, 128, False), (33, 300, 129, True), (130, 128, 5, False))
    def test_block_gemm_matches_numpy(self, m, k, n, b_tiles):
        from tests.support import numpy_reference as np_ref

        torch.manual_seed(m + k + n)
        a = torch.randn(m, k) * torch.exp2(torch.randint(-20, 20, (m, 1)).float())
        b = torch.randn(k, n)
        qa, sa = ref.quantize_tiles(a, E4M3, axis=1)
        qb, sb = ref.quantize_tiles(b, E5M2, axis=0) if b_tiles else ref.quantize_blocks(b, E4M3)
        got = ref.block_gemm(qa, sa, qb, sb, b_tiles=b_tiles, out_dtype=torch.float32).double().numpy()
        want = np_ref.block_matmul(qa.float().numpy(), sa.numpy(), qb.float().numpy(), sb.numpy(), b_tiles)
        bound = np_ref.block_matmul(np.abs(qa.float().numpy()), sa.numpy(), np.abs(qb.float().numpy()),
                                    sb.numpy(), b_tiles) * k * 2.0**-23
        self.assertTrue(np.all(np.abs(got - want) <= bound + 1e-45))
