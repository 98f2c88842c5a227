"""CPU tests of the emulation numerics (run everywhere, CI included).

The reference here is numpy float32 arithmetic plus ml_dtypes' RNE casts.
"""

import ml_dtypes
import numpy as np
import pytest
import torch
from absl.testing import parameterized

import torch_ops
from torch_ops import emulation as emu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NP = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
MAX = {E4M3: 448.0, E5M2: 57344.0}


def _special(x: torch.Tensor) -> torch.Tensor:
    """Random data with values past the max, NaN, +-inf, zeros sprinkled in."""
    x = x.clone()
    flat = x.view(-1)
    n = flat.numel()
    if n >= 8:
        flat[0] = float("nan")
        flat[1] = float("inf")
        flat[2] = float("-inf")
        flat[3] = 1e9
        flat[4] = -1e9
        flat[5] = 0.0
        flat[6] = -0.0
    return x


def _ref_quant(x: np.ndarray, scale: np.float32, dt) -> np.ndarray:
    m = np.float32(MAX[dt])
    y = (x.astype(np.float32) * (np.float32(1.0) / np.float32(scale))).astype(np.float32)
    with np.errstate(invalid="ignore"):
        y = np.where(np.isnan(y), y, np.clip(y, -m, m))
    return y.astype(NP[dt])


class EmulationQuantizeTest(parameterized.TestCase):
    @parameterized.product(
        dt=[E4M3, E5M2],
        in_dtype=[torch.float32, torch.bfloat16, torch.float16],
        shape=[(1, 16), (17, 33), (3, 9, 33)],
    )
    def test_bytes_match_ml_dtypes(self, dt, in_dtype, shape):
        torch.manual_seed(0)
        x = _special(torch.randn(shape) * 300).to(in_dtype)
        scale = torch.tensor(0.37, dtype=torch.float32)
        q, qt, amax = emu.quantize(x, scale, dt, transpose=True)
        ref = _ref_quant(x.float().numpy(), np.float32(0.37), dt)
        got = q.float().numpy()
        refv = ref.astype(np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(refv))
        ok = ~np.isnan(refv)
        np.testing.assert_array_equal(got[ok], refv[ok])
        self.assertEqual(tuple(qt.shape), (shape[-1], int(np.prod(shape[:-1]))))
        np.testing.assert_array_equal(
            qt.view(torch.uint8).numpy(), q.reshape(-1, shape[-1]).t().contiguous().view(torch.uint8).numpy()
        )
        self.assertTrue(torch.isnan(amax))

    @parameterized.parameters(E4M3, E5M2)
    def test_saturation_and_inf(self, dt):
        x = torch.tensor([1e30, -1e30, float("inf"), float("-inf"), MAX[dt] * 1.06, 0.0])
        q = emu.quantize_with_scale(x, torch.tensor(1.0), dt).float()
        m = MAX[dt]
        self.assertEqual(q.tolist(), [m, -m, m, -m, m, 0.0])

    def test_amax_propagates(self):
        self.assertEqual(emu.amax(torch.tensor([1.0, -3.0])).item(), 3.0)
        self.assertTrue(torch.isinf(emu.amax(torch.tensor([1.0, float("-inf")]))))
        self.assertTrue(torch.isnan(emu.amax(torch.tensor([float("inf"), float("nan")]))))
        self.assertEqual(emu.amax(torch.zeros(0)).item(), 0.0)

    @parameterized.parameters(E4M3, E5M2)
    def test_compute_scale(self, dt):
        prev = torch.tensor(0.5)
        for w, expect in [(0.0, 0.5), (float("inf"), 0.5), (float("nan"), 0.5), (-1.0, 0.5)]:
            self.assertEqual(emu.compute_scale(torch.tensor(w), prev, dt).item(), expect)
        w = np.float32(3.3)
        got = emu.compute_scale(torch.tensor(3.3), prev, dt, margin=1.0).item()
        ref = (w * np.float32(1.0 / MAX[dt])) * np.float32(0.5)
        self.assertEqual(np.float32(got), ref)


class EmulationDelayedTest(parameterized.TestCase):
    @parameterized.parameters("max", "most_recent")
    def test_history_after_k_calls(self, algo):
        torch.manual_seed(1)
        H = 6
        h = torch.zeros(H)
        s = torch.ones(())
        amaxes = []
        for k in range(8):
            x = torch.randn(5, 7) * (k + 1)
            a = x.abs().max().item()
            empty = h.max().item() == 0
            prev = s.item()
            _, _, su, am = emu.quantize_delayed(x, h, s, E4M3, amax_compute_algo=algo)
            self.assertEqual(am.item(), a)
            expect_used = np.float32(a) * np.float32(1.0 / 448.0) if empty else np.float32(prev)
            self.assertEqual(np.float32(su.item()), expect_used)
            amaxes.insert(0, a)
            np.testing.assert_array_equal(h.numpy()[: min(k + 1, H)], np.float32(amaxes[:H]))
            win = max(amaxes[:H]) if algo == "max" else amaxes[0]
            self.assertEqual(np.float32(s.item()), np.float32(win) * np.float32(1.0 / 448.0))

    def test_nonfinite_not_recorded_zero_recorded(self):
        h = torch.zeros(4)
        s = torch.ones(())
        emu.quantize_delayed(torch.full((3,), 2.0), h, s, E4M3)
        h0, s0 = h.clone(), s.clone()
        x = torch.tensor([1.0, float("inf")])
        _, _, su, _ = emu.quantize_delayed(x, h, s, E4M3)
        self.assertTrue(torch.equal(h, h0))
        self.assertTrue(torch.equal(s, s0))
        self.assertTrue(torch.equal(su, s0))
        emu.quantize_delayed(torch.zeros(3), h, s, E4M3)
        self.assertEqual(h.tolist(), [0.0, 2.0, 0.0, 0.0])

    def test_record_false_writes_nothing(self):
        h = torch.zeros(4)
        s = torch.ones(())
        _, _, su, _ = emu.quantize_delayed(torch.full((3,), 448.0 * 4), h, s, E4M3, record=False)
        self.assertEqual(su.item(), 4.0)  # seeded from the tensor itself
        self.assertEqual(h.tolist(), [0.0] * 4)
        self.assertEqual(s.item(), 1.0)

    def test_record_amax_skip_zero(self):
        h = torch.zeros(3)
        s = torch.ones(())
        emu.record_amax(h, s, torch.tensor(0.0), E5M2, skip_zero=True)
        self.assertEqual(h.tolist(), [0.0] * 3)
        emu.record_amax(h, s, torch.tensor(0.0), E5M2)
        self.assertEqual(h.tolist(), [0.0] * 3)
        emu.record_amax(h, s, torch.tensor(5.0), E5M2)
        emu.record_amax(h, s, torch.tensor(float("nan")), E5M2)
        self.assertEqual(h.tolist(), [5.0, 0.0, 0.0])
        self.assertEqual(np.float32(s.item()), np.float32(5.0) * np.float32(1.0 / 57344.0))

    def test_current_scaling(self):
        x = torch.randn(9, 4) * 10
        _, _, su, a = emu.quantize_current(x, E4M3)
        self.assertEqual(np.float32(su.item()), np.float32(a.item()) * np.float32(1.0 / 448.0))
        _, _, su, _ = emu.quantize_current(torch.zeros(3), E4M3, prev_scale=torch.tensor(0.25))
        self.assertEqual(su.item(), 0.25)


class EmulationGemmTest(parameterized.TestCase):
    def test_gemm_matches_numpy(self):
        torch.manual_seed(2)
        a = (torch.randn(17, 9) * 3).to(E4M3)
        b = (torch.randn(33, 9) * 3).to(E5M2)
        sa, sb = torch.tensor(0.5), torch.tensor(0.25)
        bias = torch.randn(33)
        out = emu.fp8_gemm(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
        ref = (a.float().numpy() @ b.float().numpy().T) * np.float32(0.125) + bias.numpy()
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6, atol=1e-5)


class LinearEmulationTest(parameterized.TestCase):
    """fp8_linear on CPU runs the emulation through the custom ops."""

    @parameterized.product(layout=["out_in", "in_out"], fmt=["hybrid", "e4m3"])
    def test_forward_backward_close_to_float(self, layout, fmt):
        torch.manual_seed(3)
        K, N = 48, 20  # x holds 3 * 11 = 33 rows
        x = torch.randn(3, 11, K, requires_grad=True)
        w = torch.randn(N, K) * 0.1
        w = (w if layout == "out_in" else w.t().contiguous()).requires_grad_()
        b = torch.randn(N, requires_grad=True)
        st = torch_ops.FP8LinearState.create(8)
        y = torch_ops.fp8_linear(x, w, b, state=st, weight_layout=layout, fp8_format=fmt, min_gemm_size=0)
        gy = torch.randn_like(y)
        y.backward(gy)
        wf = w.detach() if layout == "out_in" else w.detach().t()
        ref = x.detach() @ wf.t() + b.detach()
        rel = (y - ref).norm() / ref.norm()
        self.assertLess(rel.item(), 0.1)
        self.assertEqual(tuple(x.grad.shape), tuple(x.shape))
        self.assertEqual(tuple(w.grad.shape), tuple(w.shape))
        dref = gy @ wf
        self.assertLess(((x.grad - dref).norm() / dref.norm()).item(), 0.15)
        self.assertTrue(torch.allclose(b.grad, gy.reshape(-1, N).sum(0), rtol=1e-5, atol=1e-4))
        # all three histories got one record each
        for h in (st.input_amax_history, st.kernel_amax_history, st.grad_amax_history):
            self.assertGreater(h[0].item(), 0)
            self.assertEqual(h[1].item(), 0)

    def test_emulated_reference_equals_custom_op_path_on_cpu(self):
        torch.manual_seed(4)
        x = torch.randn(17, 9)
        w = torch.randn(33, 9)
        outs = []
        for f in (torch_ops.fp8_linear, emu.fp8_linear):
            st = torch_ops.FP8LinearState.create(4)
            xx = x.clone().requires_grad_()
            ww = w.clone().requires_grad_()
            y = f(xx, ww, state=st, min_gemm_size=0)
            y.backward(torch.ones_like(y))
            outs.append((y, xx.grad, ww.grad, st.tensors()))
        for u, v in zip(outs[0][:3], outs[1][:3]):
            torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)
        for u, v in zip(outs[0][3], outs[1][3]):
            self.assertTrue(torch.equal(u, v))

    def test_grad_amax_sink(self):
        x = torch.randn(5, 8, requires_grad=True)
        w = torch.randn(4, 8, requires_grad=True)
        st = torch_ops.FP8LinearState.create(4)
        sink = torch.zeros((), requires_grad=True)
        y = torch_ops.fp8_linear(x, w, state=st, grad_amax_sink=sink, min_gemm_size=0)
        gy = torch.randn_like(y)
        gy[0, 0] = 7.5
        y.backward(gy)
        self.assertEqual(sink.grad.item(), gy.abs().max().item())
        self.assertEqual(st.grad_amax_history.abs().max().item(), 0.0)
        self.assertEqual(st.grad_scale.item(), 1.0)
        gy[0, 1] = float("inf")
        sink.grad = None
        y = torch_ops.fp8_linear(x, w, state=st, grad_amax_sink=sink, min_gemm_size=0)
        y.backward(gy)
        self.assertEqual(sink.grad.item(), 0.0)

    def test_inf_gradient_leaves_grad_state(self):
        x = torch.randn(5, 8, requires_grad=True)
        w = torch.randn(4, 8, requires_grad=True)
        st = torch_ops.FP8LinearState.create(4)
        y = torch_ops.fp8_linear(x, w, state=st, min_gemm_size=0)
        y.backward(torch.randn_like(y))
        h, s = st.grad_amax_history.clone(), st.grad_scale.clone()
        y = torch_ops.fp8_linear(x, w, state=st, min_gemm_size=0)
        gy = torch.randn_like(y)
        gy[1, 1] = float("-inf")
        y.backward(gy)
        self.assertTrue(torch.equal(st.grad_amax_history, h))
        self.assertTrue(torch.equal(st.grad_scale, s))

    def test_small_path_updates_state_like_fp8_path(self):
        torch.manual_seed(5)
        x = torch.randn(6, 8)
        w = torch.randn(4, 8)
        gy = torch.randn(6, 4)
        states = []
        for mgs in (0, 10**9):
            st = torch_ops.FP8LinearState.create(4)
            for _ in range(2):
                xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
                y = torch_ops.fp8_linear(xx, ww, state=st, min_gemm_size=mgs)
                y.backward(gy)
            states.append(st.tensors())
        for u, v in zip(*states):
            self.assertTrue(torch.equal(u, v))

    def test_inference_records_nothing(self):
        st = torch_ops.FP8LinearState.create(4)
        with torch.no_grad():
            torch_ops.fp8_linear(torch.randn(3, 8), torch.randn(4, 8), state=st, training=False, min_gemm_size=0)
        for t in (st.input_amax_history, st.kernel_amax_history, st.grad_amax_history):
            self.assertEqual(t.abs().max().item(), 0.0)

    def test_bad_inputs_name_the_argument(self):
        st = torch_ops.FP8LinearState.create(4)
        w = torch.randn(4, 8)
        with self.assertRaisesRegex(TypeError, "x:"):
            torch_ops.fp8_linear(torch.ones(3, 8, dtype=torch.int32), w, state=st)
        with self.assertRaisesRegex(ValueError, "weight:"):
            torch_ops.fp8_linear(torch.randn(3, 7), w, state=st)
        with self.assertRaisesRegex(ValueError, "bias:"):
            torch_ops.fp8_linear(torch.randn(3, 8), w, torch.randn(5), state=st)
        with self.assertRaisesRegex(ValueError, "fp8_format:"):
            torch_ops.fp8_linear(torch.randn(3, 8), w, state=st, fp8_format="e5m2")
        bad = torch_ops.FP8LinearState.create(4)
        bad.grad_scale = torch.ones((), dtype=torch.float64)
        with self.assertRaisesRegex(ValueError, "state.grad_scale"):
            torch_ops.fp8_linear(torch.randn(3, 8), w, state=bad)
        with self.assertRaisesRegex(ValueError, "fp8_dtype:"):
            torch_ops.quantize(torch.randn(3), torch.ones(()), torch.float16)
        with self.assertRaisesRegex(ValueError, "scale:"):
            torch_ops.quantize(torch.randn(3), torch.ones(2), E4M3)
        with self.assertRaisesRegex(ValueError, "a:"):
            torch_ops.fp8_gemm(torch.randn(3, 16), torch.randn(3, 16).to(E4M3), torch.ones(()), torch.ones(()))
        with self.assertRaisesRegex(ValueError, "amax_history:"):
            torch_ops.quantize_delayed(torch.randn(3), torch.zeros(2, 2), torch.ones(()), E4M3)


class PackagingTest(parameterized.TestCase):
    def test_public_api(self):
        for name in ("is_available", "unavailable_reason", "build", "quantize", "quantize_delayed",
                     "quantize_current", "record_amax", "fp8_gemm", "fp8_linear", "FP8LinearState", "emulation"):
            self.assertTrue(hasattr(torch_ops, name), name)

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
    def test_unavailable_without_cuda(self):
        self.assertFalse(torch_ops.is_available())
        r = torch_ops.unavailable_reason()
        self.assertIsInstance(r, str)
        self.assertNotIn("\n", r)

    def test_compile_fullgraph_cpu(self):
        torch.manual_seed(6)

        def fwd(x, w, b, st):
            return torch_ops.fp8_linear(x, w, b, state=st, min_gemm_size=0)

        results = []
        for f in (fwd, torch.compile(fwd, backend="aot_eager", fullgraph=True)):
            torch.manual_seed(7)
            st = torch_ops.FP8LinearState.create(8)
            x = torch.randn(2, 5, 16, requires_grad=True)
            w = torch.randn(12, 16, requires_grad=True)
            b = torch.randn(12, requires_grad=True)
            for _ in range(3):
                x.grad = w.grad = b.grad = None
                y = f(x, w, b, st)
                (y * y).sum().backward()
            results.append((y.detach(), x.grad, w.grad, b.grad) + st.tensors())
        for u, v in zip(*results):
            self.assertTrue(torch.equal(u, v))
