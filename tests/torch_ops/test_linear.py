"""fp8_linear on every route, against the reference.

CPU (everywhere): the compile path (the torch.library ops, over the
reference) against an FP8 linear composed explicitly from
torch_ops.reference: outputs and gradients element by element, the state bit
for bit; torch.compile against eager; the compute-dtype path below
min_gemm_size; the gradient channel. FP8 GPU: the same against the C++ eager
entry and the kernels, CUDA-graph replay, torch.compile on the GPU.
"""

from unittest import mock

import dataclasses

import pytest
import torch
from absl.testing import parameterized

import torch_ops
from torch_ops import linear as L
from tests.support.torch_checks import E4M3
from tests.support.torch_checks import assert_block_gemm_close
from tests.support.torch_checks import assert_close
from tests.support.torch_checks import assert_gemm_close
from tests.support.torch_checks import assert_same_state
from tests.support.torch_checks import clone_state
from tests.support.torch_checks import kernels_required  # noqa: F401 (fixture)
from tests.support.torch_checks import needs_fp8_gpu
from tests.support.torch_checks import poison
from tests.support.torch_checks import rand
from tests.support.torch_checks import reference_block_linear
from tests.support.torch_checks import reference_linear
from tests.support.torch_checks import run_linear


def linear(x, w, b=None, *, state, training=True, **options):
    """``torch_ops.fp8_linear`` with the ``LinearConfig`` fields as keywords."""
    return torch_ops.fp8_linear(x, w, b, state, torch_ops.LinearConfig(**options), training)


def folded(x, w, b=None, *, state, pending, fold_state, training=True, window=None, **options):
    """``torch_ops.fp8_linear`` on ``state`` with the gradient channel
    ``(pending, fold_state)``."""
    if isinstance(state, torch_ops.FP8LinearState):
        state = dataclasses.replace(state, grad_amax_pending=pending, grad_fold_state=fold_state)
    return torch_ops.fp8_linear(x, w, b, state, torch_ops.LinearConfig(fold_window=window, **options), training)


def ops_route_only():
    """Patches the route choice so that calls the C++ entry would take run
    the torch.library ops instead."""
    original = L._route

    def route(*args):
        taken, ext = original(*args)
        return (L.OPS if taken is L.EAGER_ENTRY else taken), ext

    return mock.patch.object(L, "_route", route)


def make(M, K, N, layout="out_in", dtype=torch.bfloat16, bias=True, seed=0, lead=None, device=None):
    x = rand((M, K), dtype, scale=1.0, special=False, seed=seed, device=device)
    w = rand((N, K), torch.float32, scale=0.05, special=False, seed=seed + 1, device=device)
    if layout == "in_out":
        w = w.t().contiguous()
    b = rand((N,), torch.float32, scale=1.0, special=False, seed=seed + 2, device=device) if bias else None
    gy = rand((M, N), dtype, scale=1e-3, special=False, seed=seed + 3, device=device)
    if lead is not None:
        x, gy = x.reshape(*lead, K), gy.reshape(*lead, N)
    return x, w, b, gy


def _assert_output_close(name, got, want, device, step):
    """Emulated GEMMs differ from the reference only in float32 summation
    order, then one rounding; on the GPU the FP8 tensor cores accumulate in
    reduced precision (the forward with fast accumulation, the backward's
    two GEMMs split): `assert_gemm_close`'s bounds."""
    if str(device).startswith("cuda") and name != "db":
        assert_gemm_close(got, want, want.dtype, fast=name == "y", msg=f"{name}, step {step}")
    else:
        assert_close(got, want, 2**-7, msg=f"{name}, step {step}")


def _check_against_reference(fn, device, mkn, layout, fmt, scaling, steps=2, lead=None, dtype=torch.bfloat16,
                             bias=True):
    M, K, N = mkn
    x0, w, b, gy0 = make(M, K, N, layout, dtype=dtype, bias=bias, lead=lead, device=device)
    st = torch_ops.FP8LinearState.create(16, device=device)
    st_ref = clone_state(st)
    kw = dict(weight_layout=layout, fp8_format=fmt, scaling=scaling, min_gemm_size=0)
    for step in range(steps):  # step 0 seeds, later steps use the delayed scales
        x, gy = x0 * (step + 1), gy0 * (step + 2)
        if device == "cuda":
            poison()
        got = run_linear(fn, x, w, b, gy, st, **kw)
        want = reference_linear(x, w, b, gy, st_ref, fp8_format=fmt, scaling=scaling, weight_layout=layout)
        for name, g, r in zip(("y", "dx", "dw", "db"), got, want):
            if r is None:
                assert g is None, name
                continue
            assert g.dtype == r.dtype and g.shape == r.shape, (name, g.dtype, r.dtype, g.shape, r.shape)
            _assert_output_close(name, g, r, device, step)
        assert_same_state(st, st_ref)


class CompilePathTest(parameterized.TestCase):
    """The torch.library path (the reference underneath, on CPU)."""

    @parameterized.product(mkn=[(17, 9, 33), (64, 48, 40), (1, 16, 8)], layout=["out_in", "in_out"],
                           fmt=["hybrid", "e4m3"], scaling=["delayed", "current"])
    def test_equals_the_reference(self, mkn, layout, fmt, scaling):
        _check_against_reference(linear, "cpu", mkn, layout, fmt, scaling, steps=3)

    def test_rank3_fp16_and_fp32(self):
        for dtype in (torch.float16, torch.float32):
            _check_against_reference(linear, "cpu", (6 * 5, 24, 16), "out_in", "hybrid", "delayed",
                                     lead=(6, 5), dtype=dtype)

    def test_inference_records_nothing(self):
        st = torch_ops.FP8LinearState.create(4)
        with torch.no_grad():
            linear(torch.randn(3, 8), torch.randn(4, 8), state=st, training=False, min_gemm_size=0)
        for t in (st.input_amax_history, st.kernel_amax_history, st.grad_amax_history):
            self.assertEqual(t.abs().max().item(), 0.0)

    def test_inf_gradient_leaves_the_grad_state(self):
        x, w, b, gy = make(5, 8, 4, device="cpu")
        st = torch_ops.FP8LinearState.create(4)
        run_linear(linear, x, w, b, gy, st, min_gemm_size=0)
        h, s = st.grad_amax_history.clone(), st.grad_scale.clone()
        gy = gy.clone()
        gy[1, 1] = float("-inf")
        run_linear(linear, x, w, b, gy, st, min_gemm_size=0)
        self.assertTrue(torch.equal(st.grad_amax_history, h))
        self.assertTrue(torch.equal(st.grad_scale, s))

    def test_torch_compile_equals_eager(self):
        def fwd(x, w, b, state):
            return linear(x, w, b, state=state, min_gemm_size=0)

        results = []
        for f in (fwd, torch.compile(fwd, backend="aot_eager", fullgraph=True)):
            st = torch_ops.FP8LinearState.create(8)
            x = rand((2, 5, 16), torch.float32, scale=1.0, special=False, seed=7, device="cpu").requires_grad_()
            w = rand((12, 16), torch.float32, scale=1.0, special=False, seed=8, device="cpu").requires_grad_()
            b = rand((12,), torch.float32, scale=1.0, special=False, seed=9, device="cpu").requires_grad_()
            for _ in range(3):
                x.grad = w.grad = b.grad = None
                y = f(x, w, b, st)
                (y * y).sum().backward()
            results.append((y.detach(), x.grad, w.grad, b.grad) + st.tensors())
        for u, v in zip(*results):
            self.assertTrue(torch.equal(u, v))



def _check_block_against_reference(device, mkn, layout, fmt, power_of_two, dtype=torch.bfloat16, margin=0.0,
                                   fn=None):
    M, K, N = mkn
    x, w, b, gy = make(M, K, N, layout, dtype=dtype, device=device)
    st = torch_ops.FP8LinearState.create(4, device=device)
    st_ref = clone_state(st)
    kw = dict(weight_layout=layout, fp8_format=fmt, scaling="block", power_of_two=power_of_two, margin=margin,
              min_gemm_size=0)
    if device == "cuda":
        poison()
    got = run_linear(fn or linear, x, w, b, gy, st, **kw)
    want, sums = reference_block_linear(x, w, b, gy, fp8_format=fmt, margin=margin, power_of_two=power_of_two,
                                        weight_layout=layout, bounds=True)
    for name, g, r, abs_sum in zip(("y", "dx", "dw", "db"), got, want, sums + (None,)):
        assert g.dtype == r.dtype and g.shape == r.shape, (name, g.dtype, r.dtype, g.shape, r.shape)
        if device == "cuda" and name != "db":
            assert_block_gemm_close(g, r, abs_sum, r.dtype, msg=name)
        else:
            assert_close(g, r, 2**-7, msg=name)
    assert_same_state(st, st_ref)  # block scaling keeps no state


class BlockLinearTest(parameterized.TestCase):
    """scaling="block" (the custom ops over the reference, on CPU)."""

    @parameterized.product(mkn=[(17, 300, 33), (128, 256, 128), (1, 16, 8)], layout=["out_in", "in_out"],
                           fmt=["e4m3", "hybrid"], power_of_two=[False, True])
    def test_equals_the_reference(self, mkn, layout, fmt, power_of_two):
        _check_block_against_reference("cpu", mkn, layout, fmt, power_of_two)

    def test_margin_and_float32(self):
        _check_block_against_reference("cpu", (40, 200, 24), "in_out", "e4m3", False, dtype=torch.float32,
                                       margin=2.0)

    def test_torch_compile_equals_eager(self):
        def fwd(x, w, state):
            return linear(x, w, state=state, scaling="block", min_gemm_size=0)

        results = []
        for f in (fwd, torch.compile(fwd, backend="aot_eager", fullgraph=True)):
            st = torch_ops.FP8LinearState.create(4)
            x = rand((2, 5, 160), torch.float32, scale=1.0, special=False, seed=7, device="cpu").requires_grad_()
            w = rand((12, 160), torch.float32, scale=1.0, special=False, seed=8, device="cpu").requires_grad_()
            y = f(x, w, st)
            (y * y).sum().backward()
            results.append((y.detach(), x.grad, w.grad))
        for u, v in zip(*results):
            self.assertTrue(torch.equal(u, v))

    def test_non_finite_values_stay_in_their_tiles(self):
        x, w, b, gy = make(4, 256, 8, device="cpu")
        x = x.clone()
        x[1, 3] = float("inf")
        st = torch_ops.FP8LinearState.create(4)
        y = linear(x, w, b, state=st, scaling="block", min_gemm_size=0)
        self.assertTrue(bool(torch.isnan(y[1]).all()))
        self.assertTrue(bool(torch.isfinite(y[[0, 2, 3]]).all()))

    def test_folded_emits_the_gradient_amax(self):
        x, w, b, gy = make(16, 160, 24, "in_out", device="cpu")
        st = torch_ops.FP8LinearState.create(1)
        pending = torch.zeros(3, requires_grad=True)
        fold_state = torch.zeros(3)
        xx = x.clone().requires_grad_()
        y = folded(xx, w, b, state=st, pending=pending, fold_state=fold_state,
                                        scaling="block", weight_layout="in_out", min_gemm_size=0)
        y.backward(gy)
        self.assertEqual(float(pending.grad[0]), float(gy.float().abs().max()))
        self.assertEqual(float(pending.grad[1]), 1.0)  # the token of the first fold
        want = reference_block_linear(x, w, b, gy, fp8_format="hybrid", weight_layout="in_out")
        assert_close(y.detach(), want[0], 2**-7)
        assert_close(xx.grad, want[1], 2**-7)

    def test_module_and_convert(self):
        model = torch.nn.Sequential(torch.nn.Linear(160, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        torch_ops.convert_to_fp8(model, scaling="block", fp8_format="e4m3", power_of_two=True, min_gemm_size=0)
        self.assertEqual(model[0].scaling, "block")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(32, 160)
        for _ in range(3):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
        self.assertTrue(bool(torch.isfinite(loss)))

    @parameterized.parameters(
        (dict(power_of_two=True), "power_of_two: applies to scaling='block'"),
        (dict(scaling="block", power_of_two=1), "power_of_two: expected a bool"),
    )
    def test_bad_options_are_named(self, kwargs, message):
        with self.assertRaisesRegex(ValueError, message):
            linear(torch.randn(4, 8), torch.randn(8, 8), state=torch_ops.FP8LinearState.create(4),
                                 min_gemm_size=0, **kwargs)
        with self.assertRaisesRegex(ValueError, message):
            torch_ops.FP8Linear(8, 8, **kwargs)

    def test_empty_batch(self):
        st = torch_ops.FP8LinearState.create(4)
        x = torch.zeros(0, 160, requires_grad=True)
        w = torch.randn(8, 160, requires_grad=True)
        y = linear(x, w, state=st, scaling="block", min_gemm_size=0)
        self.assertEqual(tuple(y.shape), (0, 8))
        y.sum().backward()
        self.assertEqual(float(w.grad.abs().sum()), 0.0)


class ComputeDtypeTest(parameterized.TestCase):
    """Below min_gemm_size, and for empty inputs: what nn.Linear runs; the
    state untouched."""

    @parameterized.product(layout=["out_in", "in_out"], bias=[True, False])
    def test_runs_f_linear_and_leaves_the_state(self, layout, bias):
        x, w, b, gy = make(6, 8, 4, layout, bias=bias, device="cpu")
        st = torch_ops.FP8LinearState.create(4)
        before = clone_state(st)
        got = run_linear(linear, x, w, b, gy, st, weight_layout=layout, min_gemm_size=10**9)
        w_nk = w.t() if layout == "in_out" else w

        def plain(xx, ww, bb, state):
            return torch.nn.functional.linear(xx, (ww.t() if layout == "in_out" else ww).to(xx.dtype),
                                              None if bb is None else bb.to(xx.dtype))

        want = run_linear(plain, x, w, b, gy, st)
        for g, r in zip(got, want):
            if r is None:
                self.assertIsNone(g)
            else:
                self.assertTrue(torch.equal(g, r))
        assert_same_state(st, before)
        del w_nk

    def test_default_threshold_off_the_kernels_is_zero(self):
        self.assertEqual(torch_ops.get_settings().resolved_min_gemm_size(kernels=False), 0)
        self.assertEqual(torch_ops.get_settings().resolved_min_gemm_size(kernels=True),
                         torch_ops.DEFAULT_MIN_GEMM_SIZE)
        st = torch_ops.FP8LinearState.create(4)
        linear(torch.randn(2, 8), torch.randn(4, 8), state=st)  # CPU default: FP8
        self.assertGreater(float(st.input_amax_history[0]), 0.0)

    def test_the_next_fp8_call_continues_the_state(self):
        x, w, b, gy = make(32, 16, 8, device="cpu")
        st = torch_ops.FP8LinearState.create(4)
        st_ref = clone_state(st)
        run_linear(linear, x, w, b, gy, st, min_gemm_size=32 * 16 * 8)
        reference_linear(x, w, b, gy, st_ref)
        small = make(2, 16, 8, device="cpu", seed=5)
        for _ in range(3):
            run_linear(linear, small[0] * 100, w, b, small[3], st, min_gemm_size=32 * 16 * 8)
        assert_same_state(st, st_ref)
        got = run_linear(linear, x * 3, w, b, gy, st, min_gemm_size=32 * 16 * 8)
        want = reference_linear(x * 3, w, b, gy, st_ref)
        assert_close(got[0], want[0], 2**-7)
        assert_same_state(st, st_ref)


class FoldedTest(parameterized.TestCase):
    """A state with a gradient channel (the Keras layers' call)."""

    def _step(self, x, w, b, pending, fold_state, st, **kw):
        xx = x.clone().requires_grad_()
        y = folded(xx, w, b, state=st, pending=pending, fold_state=fold_state,
                                        weight_layout="in_out", min_gemm_size=0, **kw)
        y.float().sum().backward()
        return y

    def test_gradient_channel_and_fold(self):
        x = torch.randn(8, 16)
        w = (torch.randn(16, 4) * 0.1).requires_grad_()
        st = torch_ops.FP8LinearState.create(4)
        pending = torch.zeros(3, requires_grad=True)
        fold_state = torch.zeros(3)
        for step in range(3):
            pending.grad = None
            self._step(x * (step + 1), w, None, pending, fold_state, st)
            # The amax of the output gradient (all ones) and this call's token.
            self.assertEqual(pending.grad.tolist(), [1.0, float(step + 1), 0.0])
            # The backward recorded nothing in the grad state itself.
            with torch.no_grad():
                pending.copy_(pending.grad)
        self.assertEqual(st.grad_amax_history.tolist(), [1.0, 1.0, 0.0, 0.0])  # folded at steps 2 and 3
        self.assertEqual(fold_state.tolist(), [2.0, 2.0, 0.0])

    def test_bias_gradient_rounds_through_x_dtype(self):
        x = torch.randn(5, 16).bfloat16()
        b = (torch.randn(4) * 1e-3).requires_grad_()
        st = torch_ops.FP8LinearState.create(4)
        xx = x.clone().requires_grad_()
        y = folded(xx, torch.randn(16, 4) * 0.1, b, state=st, pending=torch.zeros(3),
                                        fold_state=torch.zeros(3), weight_layout="in_out", min_gemm_size=0)
        g = torch.randn_like(y)
        y.backward(g)
        self.assertTrue(torch.equal(b.grad, g.float().sum(0).bfloat16().float()))

    @parameterized.named_parameters(
        ("pending", dict(pending=torch.zeros(2)), ValueError, "pending"),
        ("fold_state", dict(fold_state=torch.zeros(3, dtype=torch.float64)), ValueError, "fold_state"),
        ("format", dict(fp8_format="e5m2"), ValueError, "fp8_format"),
        ("window", dict(window=0), ValueError, "window"),
        ("state", dict(state=(torch.ones(()),)), TypeError, "state"),
    )
    def test_bad_arguments_are_named(self, override, error, name):
        kwargs = dict(state=torch_ops.FP8LinearState.create(4), pending=torch.zeros(3), fold_state=torch.zeros(3),
                      weight_layout="in_out", min_gemm_size=0)
        kwargs.update(override)
        with self.assertRaisesRegex(error, name):
            folded(torch.randn(4, 16), torch.randn(16, 8), **kwargs)


class LinearConfigTest(parameterized.TestCase):
    @parameterized.parameters(
        (dict(fp8_format="e5m2"), "fp8_format: expected one of"),
        (dict(scaling="tensor"), "scaling: expected one of"),
        (dict(margin=-1), "margin: expected a number from 0 to 8"),
        (dict(amax_compute_algo="mean"), "amax_compute_algo: expected one of"),
        (dict(fold_window=0), "fold_window: expected None or an integer >= 1, got 0"),
        (dict(fast_accum_dgrad=1), "fast_accum_dgrad: expected a bool, got 1"),
        (dict(weight_layout="nk"), "weight_layout: expected one of"),
        (dict(min_gemm_size=-1), "min_gemm_size: expected None or an integer >= 0"),
    )
    def test_a_bad_field_is_named_once_at_construction(self, fields, message):
        with self.assertRaisesRegex(ValueError, message):
            torch_ops.LinearConfig(**fields)

    def test_frozen_hashable_and_replaced(self):
        config = torch_ops.LinearConfig(margin=1)
        self.assertEqual(config.margin, 1.0)
        self.assertEqual(config.grad_dtype, torch.float8_e5m2)
        with self.assertRaises(dataclasses.FrozenInstanceError):
            config.margin = 2.0
        self.assertEqual({config: 1}[torch_ops.LinearConfig(margin=1.0)], 1)
        self.assertEqual(config.replace(fp8_format="e4m3").grad_dtype, torch.float8_e4m3fn)
        with self.assertRaisesRegex(ValueError, "scaling"):
            config.replace(scaling="x")

    def test_fast_accumulation_reaches_each_gemm(self):
        """The config's per-GEMM fast accumulation is what each GEMM gets."""
        seen = []
        original = L.ops.gemm

        def gemm(a, b, sa, sb, bias, out_dtype, fast, autotune):
            seen.append(fast)
            return original(a, b, sa, sb, bias, out_dtype, fast, autotune)

        x, w, b, gy = make(8, 16, 4, device="cpu")
        with mock.patch.object(L.ops, "gemm", gemm):
            run_linear(linear, x, w, b, gy, torch_ops.FP8LinearState.create(4), min_gemm_size=0,
                       fast_accum_forward=False, fast_accum_dgrad=True, fast_accum_wgrad=True)
        self.assertEqual(seen, [False, True, True])

    def test_config_must_be_a_linear_config(self):
        with self.assertRaisesRegex(TypeError, "config: expected a torch_ops.LinearConfig, got dict"):
            torch_ops.fp8_linear(torch.randn(2, 8), torch.randn(4, 8), None, torch_ops.FP8LinearState.create(4),
                                 {"scaling": "current"})


class BadInputTest(parameterized.TestCase):
    def test_bad_inputs_name_the_argument(self):
        st = torch_ops.FP8LinearState.create(4)
        w = torch.randn(4, 8)
        with self.assertRaisesRegex(TypeError, "x:"):
            linear(torch.ones(3, 8, dtype=torch.int32), w, state=st)
        with self.assertRaisesRegex(ValueError, "weight:"):
            linear(torch.randn(3, 7), w, state=st)
        with self.assertRaisesRegex(ValueError, "bias:"):
            linear(torch.randn(3, 8), w, torch.randn(5), state=st)
        with self.assertRaisesRegex(ValueError, "fp8_format:"):
            linear(torch.randn(3, 8), w, state=st, fp8_format="e5m2")
        with self.assertRaisesRegex(ValueError, "margin:"):
            linear(torch.randn(3, 8), w, state=st, margin=float("nan"))
        bad = torch_ops.FP8LinearState.create(4)
        bad.grad_scale = torch.ones((), dtype=torch.float64)
        with self.assertRaisesRegex(ValueError, "state.grad_scale"):
            linear(torch.randn(3, 8), w, state=bad)
        with self.assertRaisesRegex(ValueError, "fp8_dtype:"):
            torch_ops.quantize(torch.randn(3), torch.ones(()), torch.float16)
        with self.assertRaisesRegex(ValueError, "scale:"):
            torch_ops.quantize(torch.randn(3), torch.ones(2), E4M3)
        with self.assertRaisesRegex(ValueError, "a:"):
            torch_ops.fp8_gemm(torch.randn(3, 16), torch.randn(3, 16).to(E4M3), torch.ones(()), torch.ones(()))
        with self.assertRaisesRegex(ValueError, "amax_history:"):
            torch_ops.quantize_delayed(torch.randn(3), torch.zeros(2, 2), torch.ones(()), E4M3)
        with self.assertRaisesRegex(ValueError, "history_len:"):
            torch_ops.FP8LinearState.create(0)


@needs_fp8_gpu
@pytest.mark.usefixtures("kernels_required")
class GpuLinearTest(parameterized.TestCase):
    """The C++ eager entry and the compile path on the kernels, against the
    reference (outputs within FP8 tolerance, element by element; state bit
    for bit), and against each other."""

    SHAPES = [(1, 1, 16), (17, 9, 33), (4095, 4097, 129), (2048, 1024, 512), (16384, 4096, 4096)]

    @parameterized.product(mkn=SHAPES, layout=["out_in", "in_out"], fmt=["hybrid", "e4m3"],
                           scaling=["delayed", "current"])
    def test_eager_entry_equals_the_reference(self, mkn, layout, fmt, scaling):
        M, K, N = mkn
        if M * K * N > 1e11 and (layout != "out_in" or fmt != "hybrid" or scaling != "delayed"):
            self.skipTest("large shape: one combination is enough")
        _check_against_reference(linear, "cuda", mkn, layout, fmt, scaling)

    @parameterized.product(mkn=[(17, 9, 33), (2048, 1024, 512)], layout=["out_in", "in_out"],
                           scaling=["delayed", "current"])
    def test_compile_path_equals_the_reference(self, mkn, layout, scaling):
        with ops_route_only():
            _check_against_reference(linear, "cuda", mkn, layout, "hybrid", scaling)

    @parameterized.parameters("delayed", "current")
    def test_eager_entry_equals_compile_path_bit_for_bit(self, scaling):
        x, w, b, gy = make(512, 256, 384, "in_out")
        results = []
        for entry in (True, False):
            st = torch_ops.FP8LinearState.create(8, device="cuda")
            with (mock.patch.object(L, "_route", wraps=L._route) if entry else ops_route_only()):
                for _ in range(3):
                    out = run_linear(linear, x, w, b, gy, st, weight_layout="in_out",
                                     scaling=scaling, min_gemm_size=0)
            results.append(out + st.tensors())
        for u, v in zip(*results):
            self.assertTrue(torch.equal(u, v))

    def test_the_eager_entry_serves_plain_cuda_tensors(self):
        """fp8_linear on plain CUDA tensors is one C++ call, with or without
        a gradient channel (the route is chosen in Python, once)."""
        from torch_ops import extension

        ext = extension.kernels_for(torch.zeros(1, device="cuda"))
        served = []

        def spy(name):
            original = getattr(ext, name)

            def call(*args):
                out = original(*args)
                served.append((name, out is not None))
                return out

            return call

        x, w, b, gy = make(64, 32, 16)
        with mock.patch.object(ext, "linear", spy("linear")):
            run_linear(linear, x, w, b, gy, torch_ops.FP8LinearState.create(4, device="cuda"),
                       min_gemm_size=0)
            pending = torch.zeros(3, device="cuda", requires_grad=True)
            y = folded(x, w.t().contiguous(), b, state=torch_ops.FP8LinearState.create(
                4, device="cuda"), pending=pending, fold_state=torch.zeros(3, device="cuda"),
                weight_layout="in_out", window=4, min_gemm_size=0)
            y.backward(gy)
        self.assertEqual(served, [("linear", True), ("linear", True)])
        self.assertEqual(float(pending.grad[1]), 1.0)  # the token of the first fold

    @parameterized.parameters(True, False)
    def test_cuda_graph_replay_equals_eager(self, bias):
        x, w, b, gy = make(512, 256, 384, bias=bias)
        steps = 3
        st_e = torch_ops.FP8LinearState.create(8, device="cuda")
        for _ in range(steps):
            want = run_linear(linear, x, w, b, gy, st_e, min_gemm_size=0)
        st = torch_ops.FP8LinearState.create(8, device="cuda")
        warm = torch_ops.FP8LinearState.create(8, device="cuda")
        sx, sw = x.clone().requires_grad_(), w.clone().requires_grad_()
        sb = b.clone().requires_grad_() if bias else None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                linear(sx, sw, sb, state=warm, min_gemm_size=0).backward(gy)
        torch.cuda.current_stream().wait_stream(side)
        sx.grad = sw.grad = None
        if bias:
            sb.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = linear(sx, sw, sb, state=st, min_gemm_size=0)
            y.backward(gy)
        for t in st.tensors():  # the capture ran nothing
            self.assertIn(float(t.abs().max()), (0.0, 1.0))
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
        assert_same_state(st, st_e)
        for name, g, r in zip(("y", "dx", "dw", "db"), (y, sx.grad, sw.grad, sb.grad if bias else None), want):
            if r is None:
                self.assertIsNone(g, name)
            else:
                self.assertTrue(torch.equal(g.detach(), r), name)

    def test_torch_compile_equals_eager(self):
        x, w, b, gy = make(4 * 128, 256, 192, lead=(4, 128))

        def f(xx, ww, bb, state):
            return linear(xx, ww, bb, state=state, min_gemm_size=0)

        compiled = torch.compile(f, fullgraph=True)
        st_e = torch_ops.FP8LinearState.create(8, device="cuda")
        st_c = torch_ops.FP8LinearState.create(8, device="cuda")
        for _ in range(3):
            want = run_linear(f, x, w, b, gy, st_e)
            got = run_linear(compiled, x, w, b, gy, st_c)
            assert_same_state(st_c, st_e)
            for g, r in zip(got[:3], want[:3]):
                self.assertTrue(torch.equal(g, r))
            torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5)

    @parameterized.parameters("delayed", "current")
    def test_folded_eager_entry_equals_compile_path(self, scaling):
        x, w, b, gy = make(256, 128, 64, "in_out")
        results = []
        for entry in (True, False):
            st = torch_ops.FP8LinearState.create(8, device="cuda")
            pending = torch.zeros(3, device="cuda", requires_grad=True)
            fold_state = torch.zeros(3, device="cuda")
            outs = []
            with (mock.patch.object(L, "_route", wraps=L._route) if entry else ops_route_only()):
                for _ in range(3):
                    xx = x.clone().requires_grad_()
                    pending.grad = None
                    y = folded(xx, w, b, state=st, pending=pending, fold_state=fold_state,
                                                    weight_layout="in_out", scaling=scaling, min_gemm_size=0)
                    y.backward(gy)
                    outs += [y.detach(), xx.grad, pending.grad.clone()]
                    with torch.no_grad():
                        pending.copy_(pending.grad)
            results.append(outs + list(st.tensors()) + [fold_state])
        for u, v in zip(*results):
            self.assertTrue(torch.equal(u, v))

    def test_bad_inputs_on_cuda(self):
        st = torch_ops.FP8LinearState.create(4)  # CPU state
        with self.assertRaisesRegex(ValueError, "state.input_scale"):
            linear(torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda"), state=st,
                                 min_gemm_size=0)
        st = torch_ops.FP8LinearState.create(4, device="cuda")
        with self.assertRaisesRegex(ValueError, "weight:"):
            linear(torch.randn(4, 8, device="cuda"), torch.randn(4, 8), state=st, min_gemm_size=0)


@needs_fp8_gpu
@pytest.mark.usefixtures("kernels_required")
class GpuBlockLinearTest(parameterized.TestCase):
    """scaling="block" on the kernels (block quantize, cuBLASLt's block-scaled
    GEMMs) against the reference."""

    @parameterized.product(mkn=[(17, 300, 33), (4095, 4097, 129), (2048, 1024, 512), (16384, 4096, 4096)],
                           layout=["out_in", "in_out"], fmt=["e4m3", "hybrid"], power_of_two=[False, True])
    def test_equals_the_reference(self, mkn, layout, fmt, power_of_two):
        M, K, N = mkn
        if M * K * N > 1e11 and (layout != "out_in" or fmt != "e4m3" or power_of_two):
            self.skipTest("large shape: one combination is enough")
        _check_block_against_reference("cuda", mkn, layout, fmt, power_of_two)

    def test_folded_on_cuda(self):
        x, w, b, gy = make(512, 384, 256, "in_out", device="cuda")
        st = torch_ops.FP8LinearState.create(1, device="cuda")
        pending = torch.zeros(3, device="cuda", requires_grad=True)
        fold_state = torch.zeros(3, device="cuda")
        xx = x.clone().requires_grad_()
        y = folded(xx, w, b, state=st, pending=pending, fold_state=fold_state,
                                        scaling="block", weight_layout="in_out", min_gemm_size=0)
        y.backward(gy)
        self.assertEqual(float(pending.grad[0]), float(gy.float().abs().max()))
        want, sums = reference_block_linear(x, w, b, gy, fp8_format="hybrid", weight_layout="in_out", bounds=True)
        assert_block_gemm_close(y.detach(), want[0], sums[0], y.dtype)
        assert_block_gemm_close(xx.grad, want[1], sums[1], xx.dtype)

    def test_torch_compile_on_cuda(self):
        x, w, b, gy = make(1024, 512, 256, device="cuda")
        st = torch_ops.FP8LinearState.create(1, device="cuda")

        def fwd(x, w, b):
            return linear(x, w, b, state=st, scaling="block", min_gemm_size=0)

        got = run_linear(lambda x, w, b, state: torch.compile(fwd)(x, w, b), x, w, b, gy, st)
        want = run_linear(lambda x, w, b, state: fwd(x, w, b), x, w, b, gy, st)
        # The custom ops' outputs bit for bit; the bias gradient is inductor's
        # own reduction (its summation order).
        for name, u, v in zip(("y", "dx", "dw"), got[:3], want[:3]):
            self.assertTrue(torch.equal(u, v), name)
        assert_close(got[3], want[3], 2**-7, msg="db")
