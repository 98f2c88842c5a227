"""fp8_linear on the CUDA kernels vs the emulation (skip where no FP8 GPU).

Stated tolerance: outputs and gradients within 1e-2 relative (Frobenius) error
of torch_ops.emulation.fp8_linear on the same inputs and state. Both quantize
to identical bytes with identical scales, so the difference is only the GEMM's
accumulation order and the bf16 rounding of the output; the state (histories
and scales) must be bit-identical.
"""

import contextlib

import pytest
import torch
from absl.testing import parameterized

import torch_ops
from torch_ops import emulation as emu

from test_torch_ops_kernels import DEV, poison, rand, relerr

pytestmark = pytest.mark.skipif(
    not torch_ops.is_available(), reason=f"torch_ops kernels unavailable: {torch_ops.unavailable_reason()}"
)

TOL = 1e-2


@contextlib.contextmanager
def small_record_stream(mode):
    """The small path's backward state launch on the backward's stream (0)
    or a side stream (1, 2) inside the block (set_small_record_stream)."""
    ext = torch_ops.linear._ext()
    was = ext.set_small_record_stream(mode)
    try:
        yield
    finally:
        ext.set_small_record_stream(was)
SHAPES = [(1, 1, 16), (17, 9, 33), (4095, 4097, 129), (2048, 1024, 512), (16384, 4096, 4096)]


def make(M, K, N, layout="out_in", dtype=torch.bfloat16, bias=True, seed=0, lead=None):
    x = rand((M, K), dtype, scale=1.0, special=False, seed=seed)
    if lead is not None:
        x = x.reshape(*lead, K)
    w = rand((N, K), torch.float32, scale=0.05, special=False, seed=seed + 1)
    if layout == "in_out":
        w = w.t().contiguous()
    b = rand((N,), torch.float32, scale=1.0, special=False, seed=seed + 2) if bias else None
    gy = rand((M, N), dtype, scale=1e-3, special=False, seed=seed + 3)
    if lead is not None:
        gy = gy.reshape(*lead, N)
    return x, w, b, gy


def run(f, x, w, b, gy, st, **kw):
    xx = x.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    bb = None if b is None else b.clone().requires_grad_()
    y = f(xx, ww, bb, state=st, **kw)
    y.backward(gy)
    return y.detach(), xx.grad, ww.grad, None if bb is None else bb.grad


class LinearKernelTest(parameterized.TestCase):
    @parameterized.product(mkn=SHAPES, layout=["out_in", "in_out"], fmt=["hybrid", "e4m3"])
    def test_matches_emulation(self, mkn, layout, fmt):
        M, K, N = mkn
        if M * K * N > 1e11 and (layout != "out_in" or fmt != "hybrid"):
            self.skipTest("large shape: one combination is enough")
        x, w, b, gy = make(M, K, N, layout)
        st_k = torch_ops.FP8LinearState.create(16, device=DEV)
        st_e = torch_ops.FP8LinearState.create(16, device=DEV)
        for step in range(2):  # step 0 seeds, step 1 uses the delayed scales
            poison()
            got = run(torch_ops.fp8_linear, x, w, b, gy, st_k, weight_layout=layout, fp8_format=fmt,
                      min_gemm_size=0)
            ref = run(emu.fp8_linear, x, w, b, gy, st_e, weight_layout=layout, fp8_format=fmt)
            for name, g_, r_ in zip(("out", "dx", "dw", "db"), got, ref):
                self.assertEqual(g_.dtype, r_.dtype, name)
                self.assertEqual(g_.shape, r_.shape, name)
                self.assertFalse(bool(torch.isnan(g_).any()), name)
                self.assertLess(relerr(g_, r_), TOL, f"{name} step {step}")
            for u, v in zip(st_k.tensors(), st_e.tensors()):
                self.assertTrue(torch.equal(u, v))

    @parameterized.parameters("delayed", "current")
    def test_rank3_fp16_and_fp32(self, scaling):
        for dtype in (torch.float16, torch.float32):
            x, w, b, gy = make(6 * 50, 96, 80, dtype=dtype, lead=(6, 50))
            st_k = torch_ops.FP8LinearState.create(4, device=DEV)
            st_e = torch_ops.FP8LinearState.create(4, device=DEV)
            got = run(torch_ops.fp8_linear, x, w, b, gy, st_k, scaling=scaling, min_gemm_size=0)
            ref = run(emu.fp8_linear, x, w, b, gy, st_e, scaling=scaling)
            self.assertEqual(got[0].shape, (6, 50, 80))
            for g_, r_ in zip(got, ref):
                self.assertLess(relerr(g_, r_), TOL)

    def test_history_after_k_steps_and_inf_gradient(self):
        x, w, b, gy = make(256, 128, 64)
        st = torch_ops.FP8LinearState.create(8, device=DEV)
        xa, ga = [], []
        for k in range(4):
            xk = x * (k + 1)
            gk = gy * (k + 2)
            run(torch_ops.fp8_linear, xk, w, b, gk, st, min_gemm_size=0)
            xa.insert(0, xk.float().abs().max().item())
            ga.insert(0, gk.float().abs().max().item())
        self.assertEqual(st.input_amax_history[:4].tolist(), xa)
        self.assertEqual(st.grad_amax_history[:4].tolist(), ga)
        self.assertEqual(st.kernel_amax_history[:4].tolist(), [w.abs().max().item()] * 4)
        h, s = st.grad_amax_history.clone(), st.grad_scale.clone()
        g_inf = gy.clone()
        g_inf[3, 5] = float("inf")
        run(torch_ops.fp8_linear, x, w, b, g_inf, st, min_gemm_size=0)
        self.assertTrue(torch.equal(st.grad_amax_history, h))
        self.assertTrue(torch.equal(st.grad_scale, s))

    def test_grad_amax_sink(self):
        x, w, b, gy = make(300, 64, 48)
        st = torch_ops.FP8LinearState.create(8, device=DEV)
        sink = torch.zeros((), device=DEV, requires_grad=True)
        xx = x.clone().requires_grad_()
        y = torch_ops.fp8_linear(xx, w, b, state=st, grad_amax_sink=sink, min_gemm_size=0)
        y.backward(gy)
        self.assertEqual(sink.grad.item(), gy.float().abs().max().item())
        self.assertEqual(st.grad_amax_history.abs().max().item(), 0.0)
        self.assertEqual(st.grad_scale.item(), 1.0)
        self.assertGreater(st.input_amax_history[0].item(), 0.0)

    def test_small_path_keeps_state_like_fp8_path(self):
        x, w, b, gy = make(64, 32, 16)
        sts = []
        for mgs in (0, 1 << 40):
            st = torch_ops.FP8LinearState.create(8, device=DEV)
            for _ in range(2):
                out = run(torch_ops.fp8_linear, x, w, b, gy, st, min_gemm_size=mgs)
            sts.append(st.tensors())
            ref = x.float() @ w.t() + b
            self.assertLess(relerr(out[0], ref), 0.05)
        for u, v in zip(*sts):
            self.assertTrue(torch.equal(u, v))

    # (min_gemm_size, bias): the FP8 path; the small path on PyTorch's
    # autograd with its state launch in the backward (no bias); the small
    # path on LinearFn (a float32 bias with bf16 x).
    @parameterized.parameters((0, True), (1 << 40, False), (1 << 40, True))
    def test_cuda_graph_replay_equals_eager(self, mgs, bias):
        M, K, N = 512, 256, 384
        x, w, b, gy = make(M, K, N, bias=bias)
        steps = 3
        # eager reference
        st_e = torch_ops.FP8LinearState.create(8, device=DEV)
        for _ in range(steps):
            ref = run(torch_ops.fp8_linear, x, w, b, gy, st_e, min_gemm_size=mgs)
        # graph
        st = torch_ops.FP8LinearState.create(8, device=DEV)
        st_warm = torch_ops.FP8LinearState.create(8, device=DEV)
        sx = x.clone().requires_grad_()
        sw = w.clone().requires_grad_()
        sb = b.clone().requires_grad_() if bias else None
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                y = torch_ops.fp8_linear(sx, sw, sb, state=st_warm, min_gemm_size=mgs)
                y.backward(gy)
        torch.cuda.current_stream().wait_stream(s)
        sx.grad = sw.grad = None
        if bias:
            sb.grad = None
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = torch_ops.fp8_linear(sx, sw, sb, state=st, min_gemm_size=mgs)
            y.backward(gy)
        for u in st.tensors():  # capture ran nothing
            self.assertTrue(float(u.abs().max()) in (0.0, 1.0))
        for _ in range(steps):
            g.replay()
        torch.cuda.synchronize()
        for u, v in zip(st.tensors(), st_e.tensors()):
            self.assertTrue(torch.equal(u, v))
        got = (y, sx.grad, sw.grad, sb.grad if bias else None)
        for name, g_, r_ in zip(("out", "dx", "dw", "db"), got, ref):
            if r_ is None:
                self.assertIsNone(g_, name)
                continue
            self.assertTrue(torch.equal(g_.detach(), r_), name)

    def test_compile_fullgraph_equals_eager(self):
        x, w, b, gy = make(4 * 128, 256, 192, lead=(4, 128))

        def f(xx, ww, bb, state):
            return torch_ops.fp8_linear(xx, ww, bb, state=state, min_gemm_size=0)

        cf = torch.compile(f, fullgraph=True)
        st_e = torch_ops.FP8LinearState.create(8, device=DEV)
        st_c = torch_ops.FP8LinearState.create(8, device=DEV)
        for _ in range(3):
            ref = run(f, x, w, b, gy, st_e)
            got = run(cf, x, w, b, gy, st_c)
            for u, v in zip(st_c.tensors(), st_e.tensors()):
                self.assertTrue(torch.equal(u, v))
            self.assertTrue(torch.equal(got[0], ref[0]))
            self.assertTrue(torch.equal(got[1], ref[1]))
            self.assertTrue(torch.equal(got[2], ref[2]))
            torch.testing.assert_close(got[3], ref[3], rtol=1e-5, atol=1e-5)

    def test_bad_inputs_on_cuda(self):
        st = torch_ops.FP8LinearState.create(4)  # CPU state
        with self.assertRaisesRegex(ValueError, "state.input_scale"):
            torch_ops.fp8_linear(torch.randn(4, 8, device=DEV), torch.randn(4, 8, device=DEV), state=st)
        st = torch_ops.FP8LinearState.create(4, device=DEV)
        with self.assertRaisesRegex(ValueError, "weight:"):
            torch_ops.fp8_linear(torch.randn(4, 8, device=DEV), torch.randn(4, 8), state=st)


class LinearFastPathTest(parameterized.TestCase):
    """The C++ eager entry point (csrc/linear.cpp, what fp8_linear runs on plain
    CUDA tensors) against the Python path on the same kernels
    (fp8_linear_python: bit-equal) and the emulation (state bit-equal)."""

    @parameterized.product(
        mkn=[(17, 9, 33), (300, 64, 48), (1000, 512, 300)],
        layout=["out_in", "in_out"],
        fmt=["hybrid", "e4m3"],
        mgs=[0, 1 << 40],
        scaling=["delayed", "current"],
    )
    def test_equals_python_path(self, mkn, layout, fmt, mgs, scaling):
        from torch_ops.linear import fp8_linear_python

        M, K, N = mkn
        for seed, bias in ((0, True), (10, False)):
            x, w, b, gy = make(M, K, N, layout, bias=bias, seed=seed)
            st_f = torch_ops.FP8LinearState.create(8, device=DEV)
            st_p = torch_ops.FP8LinearState.create(8, device=DEV)
            for step in range(3):
                poison()
                got = run(torch_ops.fp8_linear, x * (step + 1), w, b, gy, st_f, weight_layout=layout,
                          fp8_format=fmt, scaling=scaling, min_gemm_size=mgs)
                ref = run(fp8_linear_python, x * (step + 1), w, b, gy, st_p, weight_layout=layout,
                          fp8_format=fmt, scaling=scaling, min_gemm_size=mgs)
                for name, g_, r_ in zip(("out", "dx", "dw", "db"), got, ref):
                    if r_ is None:
                        self.assertIsNone(g_, name)
                        continue
                    self.assertEqual((g_.dtype, g_.shape), (r_.dtype, r_.shape), name)
                    self.assertTrue(torch.equal(g_, r_), f"{name} step {step}: relerr {relerr(g_, r_)}")
                for u, v in zip(st_f.tensors(), st_p.tensors()):
                    self.assertTrue(torch.equal(u, v), f"state step {step}")

    @parameterized.parameters(0, 1 << 40)
    def test_state_matches_emulation_keras_layout(self, mgs):
        """bf16 x, float32 in_out kernel (the Keras layer's call), ragged shapes,
        fresh data each step: the state equals the emulation's bit for bit."""
        for (M, K, N) in ((4095, 129, 65), (64, 1000, 3)):
            st_k = torch_ops.FP8LinearState.create(6, device=DEV)
            st_e = torch_ops.FP8LinearState.create(6, device=DEV)
            for step in range(3):
                x, w, b, gy = make(M, K, N, "in_out", seed=100 + step)
                got = run(torch_ops.fp8_linear, x, w, b, gy, st_k, weight_layout="in_out", min_gemm_size=mgs)
                ref = run(emu.fp8_linear, x, w, b, gy, st_e, weight_layout="in_out")
                for u, v in zip(st_k.tensors(), st_e.tensors()):
                    self.assertTrue(torch.equal(u, v), f"{(M, K, N)} step {step}")
                self.assertLess(relerr(got[0], ref[0]), 0.05 if mgs else TOL)

    def test_sink_inference_and_no_grad(self):
        from torch_ops.linear import fp8_linear_python

        x, w, b, gy = make(300, 64, 48, lead=(3, 100))
        for mgs in (0, 1 << 40):
            outs = []
            for f in (torch_ops.fp8_linear, fp8_linear_python):
                st = torch_ops.FP8LinearState.create(8, device=DEV)
                sink = torch.zeros((), device=DEV, requires_grad=True)
                xx = x.clone().requires_grad_()
                y = f(xx, w, b, state=st, grad_amax_sink=sink, min_gemm_size=mgs)
                y.backward(gy)
                with torch.no_grad():
                    y2 = f(x, w, b, state=st, min_gemm_size=mgs)
                y3 = f(x, w, b, state=st, training=False, min_gemm_size=mgs)
                outs.append((y.detach(), xx.grad, sink.grad, y2, y3) + st.tensors())
            self.assertEqual(outs[0][0].shape, (3, 100, 48))
            self.assertEqual(outs[0][2].item(), gy.float().abs().max().item())
            for u, v in zip(*outs):
                self.assertTrue(torch.equal(u, v))

    @parameterized.parameters("out_in", "in_out")
    def test_small_path_records_in_backward(self, layout):
        """Below min_gemm_size, while autograd records a graph, the amaxes of x,
        the weight and the gradient are recorded together when the backward
        runs (one launch); under no_grad the forward records x and the weight."""
        x, w, _, gy = make(64, 32, 16, layout, bias=False, seed=7)
        st = torch_ops.FP8LinearState.create(4, device=DEV)
        xx = x.clone().requires_grad_()
        y = torch_ops.fp8_linear(xx, w, state=st, weight_layout=layout, min_gemm_size=1 << 40)
        for h in (st.input_amax_history, st.kernel_amax_history, st.grad_amax_history):
            self.assertEqual(float(h.abs().max()), 0.0)
        y.backward(gy)
        self.assertEqual(st.input_amax_history[0].item(), x.float().abs().max().item())
        self.assertEqual(st.kernel_amax_history[0].item(), w.float().abs().max().item())
        self.assertEqual(st.grad_amax_history[0].item(), gy.float().abs().max().item())
        self.assertEqual(float(st.input_amax_history[1:].abs().max()), 0.0)
        with torch.no_grad():
            torch_ops.fp8_linear(2 * x, w, state=st, weight_layout=layout, min_gemm_size=1 << 40)
        self.assertEqual(st.input_amax_history[0].item(), 2 * x.float().abs().max().item())
        self.assertEqual(st.input_amax_history[1].item(), x.float().abs().max().item())
        self.assertEqual(st.grad_amax_history[1].item(), 0.0)

    @parameterized.product(graph=[False, True], side=[0, 1, 2])
    def test_small_path_keeps_state_like_fp8_path_native(self, graph, side):
        """The small path on PyTorch's autograd (no bias) leaves the state of
        the FP8 path (bit-identical), eagerly and replayed from a CUDA graph,
        with its state launch where set_small_record_stream puts it: on the
        backward's stream (side=0), on a side stream beside the backward's
        GEMMs (1), on the side stream while captured (2, the default); a
        gradient with inf records nothing in the gradient's history."""
        self.enterContext(small_record_stream(side))
        M, K, N = 96, 64, 48
        x, w, _, gy = make(M, K, N, bias=False, seed=3)
        g_inf = gy.clone()
        g_inf[5, 7] = float("inf")
        grads = [gy, g_inf, 2 * gy]
        st_ref = torch_ops.FP8LinearState.create(8, device=DEV)
        for g in grads:
            run(torch_ops.fp8_linear, x, w, None, g, st_ref, min_gemm_size=0)
        st = torch_ops.FP8LinearState.create(8, device=DEV)
        if not graph:
            for g in grads:
                out = run(torch_ops.fp8_linear, x, w, None, g, st, min_gemm_size=1 << 40)
            self.assertLess(relerr(out[0], x.float() @ w.t()), 0.05)
        else:
            sx = x.clone().requires_grad_()
            sw = w.clone().requires_grad_()
            sg = gy.clone()
            warm = torch_ops.FP8LinearState.create(8, device=DEV)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    torch_ops.fp8_linear(sx, sw, state=warm, min_gemm_size=1 << 40).backward(sg)
            torch.cuda.current_stream().wait_stream(s)
            sx.grad = sw.grad = None
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                torch_ops.fp8_linear(sx, sw, state=st, min_gemm_size=1 << 40).backward(sg)
            for g in grads:
                sg.copy_(g)
                cg.replay()
            torch.cuda.synchronize()
        for u, v in zip(st.tensors(), st_ref.tensors()):
            self.assertTrue(torch.equal(u, v))

    def test_set_small_record_stream_names_bad_mode(self):
        ext = torch_ops.linear._ext()
        with self.assertRaisesRegex(ValueError, "mode: expected -1"):
            ext.set_small_record_stream(3)

    def test_unknown_env_settings_warn_once_and_default(self):
        """The C++ settings read from the environment (once): unknown values
        warn once each, naming the variable, and the defaults run (a small
        training call (M = 64: below min_gemm_size) with a float32 weight
        (cuBLAS's GEMMs and the state launch) and with a bf16 one (our GEMMs,
        which read TORCH_OPS_GEMM_AMAX and TORCH_OPS_GEMM_AMAX_GRAPHS), and an
        FP8 one (M = 4096: cuBLASLt's GEMMs, autotuned), twice each, in a
        fresh process)."""
        import os
        import subprocess
        import sys

        code = (
            "import torch, torch_ops\n"
            "for _ in range(2):\n"
            "    for M, wd in ((64, torch.float32), (64, torch.bfloat16), (4096, torch.float32)):\n"
            "        st = torch_ops.FP8LinearState.create(device='cuda')\n"
            "        x = torch.randn(M, 256, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
            "        w = torch.randn(512, 256, device='cuda', dtype=wd, requires_grad=True)\n"
            "        y = torch_ops.fp8_linear(x, w, state=st, min_gemm_size=1 << 26)\n"
            "        y.float().sum().backward()\n"
            "        assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()\n"
            "        assert float(st.grad_amax_history[0]) > 0\n"
            "torch.cuda.synchronize(); print('ok')\n")
        bad = {"TORCH_OPS_SMALL_RECORD_STREAM": "7", "TORCH_OPS_QTILE": "v9", "TORCH_OPS_PDL": "maybe",
               "TORCH_OPS_DELAYED_PREPASS": "2", "TORCH_OPS_LEAN": "fast", "TORCH_OPS_GEMM_AMAX": "yes",
               "TORCH_OPS_GEMM_AMAX_GRAPHS": "sometimes", "TORCH_OPS_GEMM_AUTOTUNE": "perhaps",
               "TORCH_OPS_GEMM_VARIANTS": "2", "TORCH_OPS_GEMM_AUTOTUNE_LOG": "loud"}
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **bad), capture_output=True,
                             text=True, timeout=600)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertIn("ok", out.stdout)
        for name in bad:
            self.assertEqual(out.stderr.count(name + "="), 1, (name, out.stderr[-2000:]))

    def test_small_path_side_stream_layers_and_strided_gradient(self):
        """Three small layers in a row, each recording on the side stream
        (set_small_record_stream(1); one pair of events reused layer after
        layer), the last one's gradient a strided view (copied on the
        backward's stream before the side stream reads it): the states and
        gradients equal those of mode 0, step after step, with fresh data
        each step."""
        M, K = 512, 96
        w = [rand((K, K), torch.float32, scale=0.1, special=False, seed=20 + i) for i in range(3)]
        results = []
        for mode in (0, 1):
            with small_record_stream(mode):
                sts = [torch_ops.FP8LinearState.create(4, device=DEV) for _ in w]
                ws = [v.clone().requires_grad_() for v in w]
                grads = []
                for step in range(3):
                    x = rand((M, K), torch.bfloat16, scale=1.0, special=False, seed=40 + step).requires_grad_()
                    h = x
                    for wi, st in zip(ws, sts):
                        h = torch_ops.fp8_linear(h, wi, state=st, min_gemm_size=1 << 40)
                    g = rand((K, M), torch.bfloat16, scale=1e-2, special=False, seed=60 + step).t()
                    h.backward(g)
                    grads.append(x.grad.clone())
                torch.cuda.synchronize()
                results.append([t.clone() for st in sts for t in st.tensors()] + grads + [v.grad for v in ws])
        self.assertGreater(float(results[0][5].abs().max()), 0.0)  # the first layer's gradient history
        for u, v in zip(*results):
            self.assertTrue(torch.equal(u, v))

    @parameterized.product(mkn=[(4096, 1024, 1024), (999, 1031, 24)],
                           dtype=[torch.bfloat16, torch.float16, torch.float32])
    def test_small_path_amax_large_and_ragged(self, mkn, dtype):
        """The small path's state record (one launch, 16-byte loads four at a
        time, then element by element) finds a single outlier anywhere: at the
        end of x (the element-wise tail where K is odd), in the middle of the
        gradient, in the weight; its state equals the FP8 path's."""
        M, K, N = mkn
        x, w, _, gy = make(M, K, N, dtype=dtype, bias=False, seed=5)
        x.view(-1)[-1] = 7.5
        gy.view(-1)[(M * N) // 2 + 3] = -3.0
        w.view(-1)[K + 1] = 2.25
        sts = []
        for mgs in (1 << 40, 0):
            st = torch_ops.FP8LinearState.create(8, device=DEV)
            for _ in range(2):
                run(torch_ops.fp8_linear, x, w, None, gy, st, min_gemm_size=mgs)
            sts.append(st)
        small = sts[0]
        self.assertEqual(small.input_amax_history[0].item(), 7.5)
        self.assertEqual(small.grad_amax_history[0].item(), 3.0)
        self.assertEqual(small.kernel_amax_history[0].item(), 2.25)
        for u, v in zip(small.tensors(), sts[1].tensors()):
            self.assertTrue(torch.equal(u, v))

    def test_wrong_inputs_fast_path(self):
        st = torch_ops.FP8LinearState.create(4, device=DEV)
        x = torch.randn(4, 8, device=DEV)
        with self.assertRaisesRegex(TypeError, "x:"):
            torch_ops.fp8_linear(x.to(torch.int32), torch.randn(4, 8, device=DEV), state=st)
        with self.assertRaisesRegex(ValueError, "weight:"):
            torch_ops.fp8_linear(x, torch.randn(4, 7, device=DEV), state=st)
        with self.assertRaisesRegex(ValueError, "bias:"):
            torch_ops.fp8_linear(x, torch.randn(4, 8, device=DEV), torch.randn(5, device=DEV), state=st)
        st.grad_amax_history = torch.zeros(4, device=DEV, dtype=torch.float64)
        with self.assertRaisesRegex(ValueError, "state.grad_amax_history"):
            torch_ops.fp8_linear(x, torch.randn(4, 8, device=DEV), state=st)
