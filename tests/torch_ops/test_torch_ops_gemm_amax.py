"""gemm_amax (csrc/gemm_amax.cu): the small path's bf16 GEMM that records its
operands' amax, gemm_amax_pair (dX and dW in one launch), and fp8_linear's
small path on them (SmallAmaxFn in csrc/linear.cpp). Hopper (sm_90) only;
skips elsewhere, as in CI.

References: the product in float64 (bf16 output: relative error below
1e-2), the state of the emulation's delayed quantize (bit for bit), the
FP8 path's state, and fp8_linear's small path on cuBLAS (float32 weight)."""

import pytest
import torch
from absl.testing import parameterized

import torch_ops
from torch_ops import emulation as emu

from test_torch_ops_kernels import DEV, poison, rand, relerr

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = pytest.mark.skipif(
    not (torch_ops.is_available() and _sm90()),
    reason=f"needs the torch_ops kernels on an sm_90 GPU ({torch_ops.unavailable_reason() or 'not sm_90'})",
)

# (M, N, K): tiny, ragged multiples of 8, the small path's GEMMs at
# 4096x1024x1024 (forward / dX: 4096 x 1024 x 1024) and 1024x2048x1024
# (forward 1024 x 1024 x 2048: split-K; dX 1024 x 2048 x 1024), more K
# steps than stages, M and N not multiples of the tiles.
SHAPES = [(8, 8, 8), (64, 64, 64), (136, 24, 72), (300, 48, 64), (129, 264, 520), (1000, 1016, 2040),
          (4000, 1000, 1024), (4096, 1024, 1024), (1024, 1024, 2048), (1024, 2048, 1024)]


def _ext():
    return torch_ops.linear._ext()


def _operands(M, N, K, layout, seed, special=False):
    """a (M, K) and b (N, K) as the layout takes them, and the two."""
    a_mk = rand((M, K), BF16, scale=2.0, special=special, seed=seed)
    b_nk = rand((N, K), BF16, scale=0.05, special=False, seed=seed + 1)
    a = a_mk.t().contiguous() if layout == 2 else a_mk
    b = b_nk if layout == 0 else b_nk.t().contiguous()
    return a, b, a_mk, b_nk


def _state(H=8):
    return torch.zeros(H, device=DEV), torch.ones((), device=DEV)


class GemmAmaxTest(parameterized.TestCase):
    @parameterized.product(layout=[0, 1, 2], mnk=SHAPES)
    def test_product_and_state(self, layout, mnk):
        """Three calls on fresh data: the product (every element written:
        the output memory is poisoned first) and both operands' histories
        and scales as the emulation's delayed quantize leaves them."""
        M, N, K = mnk
        ext = _ext()
        (ha, sa), (hb, sb) = _state(), _state()
        (rha, rsa), (rhb, rsb) = _state(), _state()
        for step in range(3):
            a, b, a_mk, b_nk = _operands(M, N, K, layout, seed=10 * step + layout)
            # A given as (K, M) (layout 2) is a TMA row of M elements: M % 8.
            takes = layout != 2 or M % 8 == 0
            self.assertEqual(ext.gemm_amax_applies(a, b, layout), takes)
            if not takes:
                return
            poison()
            out = ext.gemm_amax(a, b, layout, [ha, sa], [hb, sb], 0, 1, 0, 1.0)
            torch.cuda.synchronize()
            self.assertEqual((out.shape, out.dtype), ((M, N), BF16))
            self.assertFalse(bool(torch.isnan(out).any()), "unwritten (poisoned) elements")
            ref = a_mk.double() @ b_nk.double().t()
            self.assertLess(relerr(out, ref), 1e-2, f"step {step}")
            emu.quantize_delayed(a_mk, rha, rsa, E4M3)
            emu.quantize_delayed(b_nk, rhb, rsb, E5M2)
            for got, want, name in ((ha, rha, "a history"), (sa, rsa, "a scale"), (hb, rhb, "b history"),
                                    (sb, rsb, "b scale")):
                self.assertTrue(torch.equal(got, want), f"{name} step {step}: {got} vs {want}")

    @parameterized.product(H=[1, 1152, 1153, 3000], algo=[0, 1], mnk=[(512, 256, 384), (1024, 1024, 2048)])
    def test_history_lengths(self, H, algo, mnk):
        """Histories up to 1152 entries are recorded by the amax warps, longer
        ones by the whole last CTA: both as the emulation, both algorithms,
        with and without split-K (1024 x 1024 x 2048)."""
        ext = _ext()
        (ha, sa), (hb, sb) = _state(H), _state(H)
        (rha, rsa), (rhb, rsb) = _state(H), _state(H)
        name = "max" if algo == 0 else "most_recent"
        for step in range(3):
            a, b, a_mk, b_nk = _operands(*mnk, 0, seed=40 + step)
            ext.gemm_amax(a, b, 0, [ha, sa], [hb, sb], 0, 1, algo, 1.0)
            emu.quantize_delayed(a_mk, rha, rsa, E4M3, amax_compute_algo=name)
            emu.quantize_delayed(b_nk, rhb, rsb, E5M2, amax_compute_algo=name)
            torch.cuda.synchronize()
            for got, want in ((ha, rha), (sa, rsa), (hb, rhb), (sb, rsb)):
                self.assertTrue(torch.equal(got, want), f"H={H} step {step}")

    @parameterized.parameters(0, 1, 2)
    def test_non_finite_operand_records_nothing(self, layout):
        """inf / NaN in A: A's history and scale stay as they were; B's record."""
        ext = _ext()
        (ha, sa), (hb, sb) = _state(), _state()
        a, b, _, b_nk = _operands(256, 128, 192, layout, seed=3)
        ext.gemm_amax(a, b, layout, [ha, sa], [hb, sb], 0, 0, 0, 1.0)
        h0, s0 = ha.clone(), sa.clone()
        for bad in (float("inf"), float("nan")):
            a2 = a.clone()
            a2.view(-1)[1234] = bad
            ext.gemm_amax(a2, b, layout, [ha, sa], [hb, sb], 0, 0, 0, 1.0)
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(ha, h0) and torch.equal(sa, s0), bad)
        self.assertEqual(hb[2].item(), b_nk.float().abs().max().item())

    @parameterized.parameters(0, 1, 2)
    def test_bias(self, layout):
        """A bf16 bias added to every row (also with split-K: 1024 x 1024 x
        2048); a bias of the wrong length, dtype or alignment is refused."""
        ext = _ext()
        for M, N, K in ((256, 136, 64), (1024, 1024, 2048)):
            a, b, a_mk, b_nk = _operands(M, N, K, layout, seed=17)
            bias = rand((N,), BF16, scale=1.0, special=False, seed=18)
            poison()
            out = ext.gemm_amax(a, b, layout, [], [], 0, 0, 0, 1.0, bias)
            ref = a_mk.double() @ b_nk.double().t() + bias.double()
            self.assertLess(relerr(out, ref), 1e-2)
        for bad in (bias[:-8], bias.float(), torch.empty(N + 1, device=DEV, dtype=BF16)[1:]):
            with self.assertRaisesRegex(RuntimeError, "bias: expected a contiguous bfloat16"):
                ext.gemm_amax(a, b, layout, [], [], 0, 0, 0, 1.0, bad)

    def test_one_operand_recorded(self):
        ext = _ext()
        (ha, sa), (hb, sb) = _state(), _state()
        a, b, a_mk, _ = _operands(512, 256, 256, 1, seed=5)
        ext.gemm_amax(a, b, 1, [ha, sa], [], 0, 0, 0, 1.0)
        ext.gemm_amax(a, b, 1, [], [hb, sb], 0, 0, 0, 1.0)
        torch.cuda.synchronize()
        self.assertEqual(ha[0].item(), a_mk.float().abs().max().item())
        self.assertEqual(ha[1].item(), 0.0)
        self.assertEqual(hb[0].item(), b.float().abs().max().item())

    def test_applies_and_bad_operands(self):
        ext = _ext()
        a = torch.randn(64, 64, device=DEV, dtype=BF16)
        self.assertTrue(ext.gemm_amax_applies(a, a, 0))
        self.assertFalse(ext.gemm_amax_applies(a.float(), a.float(), 0))  # float32
        self.assertFalse(ext.gemm_amax_applies(a[:, :60].contiguous(), a[:, :60].contiguous(), 0))  # K % 8
        self.assertFalse(ext.gemm_amax_applies(a, a[:56].contiguous(), 0 + 1))  # K (64) vs b's rows (56)
        flat = torch.randn(64 * 64 + 1, device=DEV, dtype=BF16)
        misaligned = flat[1:].view(64, 64)
        self.assertFalse(ext.gemm_amax_applies(misaligned, a, 0))
        self.assertFalse(ext.gemm_amax_applies(a.t(), a, 0))  # not contiguous
        with self.assertRaisesRegex(RuntimeError, "a, b: expected contiguous"):
            ext.gemm_amax(misaligned, a, 0, [], [], 0, 0, 0, 1.0)
        with self.assertRaisesRegex(RuntimeError, "layout: expected 0, 1 or 2"):
            ext.gemm_amax(a, a, 3, [], [], 0, 0, 0, 1.0)
        h, sc = _state()
        with self.assertRaisesRegex(RuntimeError, r"state: expected \[\] or \[history, scale\], got 1"):
            ext.gemm_amax(a, a, 0, [h], [], 0, 0, 0, 1.0)
        with self.assertRaisesRegex(ValueError, "fmt: expected 0 \\(E4M3\\) or 1"):
            ext.gemm_amax(a, a, 0, [], [], 2, 0, 0, 1.0)
        with self.assertRaisesRegex(ValueError, "algo: expected 0 \\(max\\) or 1"):
            ext.gemm_amax(a, a, 0, [], [], 0, 0, 5, 1.0)
        with self.assertRaisesRegex(RuntimeError, "state history: expected float32"):
            ext.gemm_amax(a, a, 0, [h.double(), sc], [], 0, 0, 0, 1.0)
        with self.assertRaisesRegex(RuntimeError, "state scale: expected one element"):
            ext.gemm_amax(a, a, 0, [h, h], [], 0, 0, 0, 1.0)
        with self.assertRaisesRegex(RuntimeError, "state history: expected device"):
            ext.gemm_amax(a, a, 0, [h.cpu(), sc], [], 0, 0, 0, 1.0)


# (M, K, N) of a linear layer whose backward runs as one gemm_amax_pair
# launch where all tiles of dX and dW fit in one wave: one tile each,
# ragged M, 128 x 128 tiles with one k step per dX tile beside long dW
# tiles (2048 x 512 x 64), 128 x 256 tiles (ragged, and the small-path
# shape 1024x2048x1024); and as gemm_amax_chain_kernel where only dX's
# 128 x 256 tiles fit one wave: two dX tiles per CTA beside dW's tiles in
# halves (4096x1024x1024; ragged 4000x1016x1000, a shorter second half), or
# a dX tile and a part of a dW tile per CTA, two parts (2048x2048x1024) or
# one (1024x4096x1024). 8192x1024x1024: dX's tiles alone fill more than one
# wave.
PAIR_SHAPES = [(8, 8, 8), (136, 72, 24), (300, 64, 48), (129, 520, 264), (2048, 512, 64), (1000, 2040, 1016),
               (1024, 2048, 1024), (4096, 1024, 1024), (4000, 1016, 1000), (2048, 2048, 1024), (1024, 4096, 1024),
               (8192, 1024, 1024)]
PAIR_TAKES = {(8192, 1024, 1024): False}


def _pair_operands(M, K, N, in_out, seed, special=False):
    """The backward's operands: g (M, N), x (M, K), the weight in its layout;
    and the pair's arguments (a0, b0, layout0, a1, b1): dX = g . W, dW in the
    weight's layout (out_in g^T x, in_out x^T g)."""
    g = rand((M, N), BF16, scale=1e-2, special=special, seed=seed)
    x = rand((M, K), BF16, scale=2.0, special=False, seed=seed + 1)
    w_nk = rand((N, K), BF16, scale=0.05, special=False, seed=seed + 2)
    w = w_nk.t().contiguous() if in_out else w_nk
    args = (g, w, 0, x, g) if in_out else (g, w, 1, g, x)
    return g, x, w_nk, w, args


class GemmAmaxPairTest(parameterized.TestCase):
    """gemm_amax_pair: dX and dW in one launch (one CTA per tile of either,
    or the chain: two items per CTA), recording g, W, x."""

    @parameterized.product(in_out=[False, True], mkn=PAIR_SHAPES)
    def test_products_and_state(self, in_out, mkn):
        """Three calls on fresh data: both products (every element written:
        outputs poisoned first) within bf16 rounding of float64; the
        histories and scales of g (E5M2), W and x (E4M3) as the emulation's
        delayed quantize leaves them, bit for bit."""
        M, K, N = mkn
        ext = _ext()
        states = [_state() for _ in range(3)]
        refs = [_state() for _ in range(3)]
        for step in range(3):
            g, x, w_nk, w, (a0, b0, layout0, a1, b1) = _pair_operands(M, K, N, in_out, seed=50 + 10 * step)
            recs = [list(states[0]), list(states[1]), [], []]
            recs[2 if in_out else 3] = list(states[2])
            fmts = [1, 0, 0, 0]
            takes = PAIR_TAKES.get(mkn, True)
            self.assertEqual(ext.gemm_amax_pair_applies(a0, b0, layout0, a1, b1), takes)
            if not takes:
                with self.assertRaisesRegex(RuntimeError, "fit one wave"):
                    ext.gemm_amax_pair(a0, b0, layout0, a1, b1, recs, fmts, 0, 1.0)
                return
            poison()
            dx, dw = ext.gemm_amax_pair(a0, b0, layout0, a1, b1, recs, fmts, 0, 1.0)
            torch.cuda.synchronize()
            dw_nk = dw.t() if in_out else dw
            self.assertEqual((dx.shape, dw_nk.shape, dx.dtype, dw.dtype), ((M, K), (N, K), BF16, BF16))
            for out, name in ((dx, "dX"), (dw, "dW")):
                self.assertFalse(bool(torch.isnan(out).any()), f"{name}: unwritten (poisoned) elements")
            self.assertLess(relerr(dx, g.double() @ w_nk.double()), 1e-2, f"dX step {step}")
            self.assertLess(relerr(dw_nk, g.double().t() @ x.double()), 1e-2, f"dW step {step}")
            for t, (rh, rs), fmt in ((g, refs[0], E5M2), (w_nk, refs[1], E4M3), (x, refs[2], E4M3)):
                emu.quantize_delayed(t, rh, rs, fmt)
            for (h, sc), (rh, rs), name in zip(states, refs, ("g", "W", "x")):
                self.assertTrue(torch.equal(h, rh) and torch.equal(sc, rs), f"{name} step {step}: {h} vs {rh}")

    @parameterized.product(H=[1, 1152, 1153, 3000], algo=[0, 1], mkn=[(1024, 2048, 1024), (4096, 1024, 1024)])
    def test_history_lengths_and_no_records(self, H, algo, mkn):
        """Both algorithms, histories recorded by the amax warps (up to 1152
        entries) and by the whole last CTA (longer), one CTA per tile and
        the chain; a call without records leaves every state alone and
        gives the same products (within rounding: the k loops are not
        rotated then)."""
        ext = _ext()
        states = [_state(H) for _ in range(3)]
        refs = [_state(H) for _ in range(3)]
        name = "max" if algo == 0 else "most_recent"
        for step in range(3):
            g, x, w_nk, _, args = _pair_operands(*mkn, False, seed=70 + step)
            dx, dw = ext.gemm_amax_pair(*args, [list(states[0]), list(states[1]), [], list(states[2])],
                                        [1, 0, 0, 0], algo, 1.0)
            for t, (rh, rs), fmt in ((g, refs[0], E5M2), (w_nk, refs[1], E4M3), (x, refs[2], E4M3)):
                emu.quantize_delayed(t, rh, rs, fmt, amax_compute_algo=name)
            torch.cuda.synchronize()
            for (h, sc), (rh, rs) in zip(states, refs):
                self.assertTrue(torch.equal(h, rh) and torch.equal(sc, rs), f"H={H} step {step}")
        before = [t.clone() for st in states for t in st]
        dx2, dw2 = ext.gemm_amax_pair(*args, [[], [], [], []], [0, 0, 0, 0], algo, 1.0)
        self.assertLess(relerr(dx2, dx.double()), 1e-2)
        self.assertLess(relerr(dw2, dw.double()), 1e-2)
        self.assertTrue(all(torch.equal(u, v) for u, v in zip(before, [t for st in states for t in st])))

    def test_non_finite_gradient_records_nothing_for_it(self):
        """inf / NaN in g: g's history and scale stay as they were; W's and
        x's record."""
        ext = _ext()
        states = [_state() for _ in range(3)]
        g, x, w_nk, _, (a0, b0, layout0, a1, b1) = _pair_operands(512, 256, 384, False, seed=9)
        recs = [list(states[0]), list(states[1]), [], list(states[2])]
        ext.gemm_amax_pair(a0, b0, layout0, a1, b1, recs, [1, 0, 0, 0], 0, 1.0)
        h0, s0 = states[0][0].clone(), states[0][1].clone()
        for step, bad in enumerate((float("inf"), float("nan"))):
            g2 = g.clone()
            g2.view(-1)[777] = bad
            ext.gemm_amax_pair(g2, b0, layout0, g2, b1, recs, [1, 0, 0, 0], 0, 1.0)
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(states[0][0], h0) and torch.equal(states[0][1], s0), bad)
            self.assertEqual(states[1][0][step + 1].item(), w_nk.float().abs().max().item())
            self.assertEqual(states[2][0][step + 1].item(), x.float().abs().max().item())

    def test_bad_arguments_are_named(self):
        ext = _ext()
        g, x, _, w, args = _pair_operands(64, 64, 64, False, seed=1)
        none, zeros = [[], [], [], []], [0, 0, 0, 0]
        with self.assertRaisesRegex(ValueError, "layout0: expected 0 or 1, got 2"):
            ext.gemm_amax_pair(g, w, 2, g, x, none, zeros, 0, 1.0)
        with self.assertRaisesRegex(ValueError, "states, fmts: expected four entries each"):
            ext.gemm_amax_pair(*args, none[:3], zeros, 0, 1.0)
        with self.assertRaisesRegex(ValueError, "fmt: expected 0 \\(E4M3\\) or 1"):
            ext.gemm_amax_pair(*args, none, [0, 0, 3, 0], 0, 1.0)
        with self.assertRaisesRegex(RuntimeError, "at most three records, got four"):
            ext.gemm_amax_pair(*args, [list(_state()) for _ in range(4)], zeros, 0, 1.0)
        with self.assertRaisesRegex(RuntimeError, "a0, b0, a1, b1: expected contiguous"):
            ext.gemm_amax_pair(g, w, 1, g, x[:, :60].contiguous(), none, zeros, 0, 1.0)


def _run(x, w, gy, st, layout, mgs=1 << 40, x_grad=True, bias=None):
    xx = x.clone().requires_grad_(x_grad)
    ww = w.clone().requires_grad_()
    bb = None if bias is None else bias.clone().requires_grad_()
    y = torch_ops.fp8_linear(xx, ww, bb, state=st, weight_layout=layout, min_gemm_size=mgs)
    y.backward(gy)
    return y.detach(), xx.grad, ww.grad, None if bb is None else bb.grad


def _data(M, K, N, layout, seed, w_dtype=BF16):
    x = rand((M, K), BF16, scale=1.0, special=False, seed=seed)
    w = rand((N, K), torch.float32, scale=0.05, special=False, seed=seed + 1).to(w_dtype)
    if layout == "in_out":
        w = w.t().contiguous()
    gy = rand((M, N), BF16, scale=1e-3, special=False, seed=seed + 2)
    return x, w, gy


class SmallPathOnGemmAmaxTest(parameterized.TestCase):
    """fp8_linear below min_gemm_size with bf16 x and weight: our GEMMs."""

    @parameterized.product(layout=["out_in", "in_out"],
                           mkn=[(96, 64, 48), (1024, 512, 256), (4096, 1024, 1024), (1024, 2048, 1024)],
                           bias=[False, True])
    def test_state_like_fp8_path_and_products(self, layout, mkn, bias):
        """Fresh data each step: the state equals the FP8 path's bit for bit
        (x and W recorded in the forward, the gradient in the backward: one
        gemm_amax_pair launch where dX's and dW's tiles fit one wave, 128 x
        256 at 1024x2048x1024, the chain of dX's tiles and dW's parts at
        4096x1024x1024); output and gradients (the bias's too) within bf16
        rounding of float64."""
        M, K, N = mkn
        st = torch_ops.FP8LinearState.create(8, device=DEV)
        st_ref = torch_ops.FP8LinearState.create(8, device=DEV)
        for step in range(3):
            x, w, gy = _data(M, K, N, layout, seed=20 + step)
            b = rand((N,), BF16, scale=1.0, special=False, seed=30 + step) if bias else None
            poison()
            y, dx, dw, db = _run(x, w, gy, st, layout, bias=b)
            _run(x, w, gy, st_ref, layout, mgs=0, bias=b)
            for u, v in zip(st.tensors(), st_ref.tensors()):
                self.assertTrue(torch.equal(u, v), f"state step {step}")
            w_nk = (w.t() if layout == "in_out" else w).double()
            y_ref = x.double() @ w_nk.t() + (b.double() if bias else 0)
            self.assertLess(relerr(y, y_ref), 1e-2)
            if bias:
                self.assertEqual(db.dtype, BF16)
                self.assertLess(relerr(db, gy.double().sum(0)), 1e-2)
            self.assertLess(relerr(dx, gy.double() @ w_nk), 1e-2)
            dw_ref = gy.double().t() @ x.double()
            self.assertLess(relerr(dw, dw_ref.t() if layout == "in_out" else dw_ref), 1e-2)
            self.assertEqual(dw.dtype, BF16)

    @parameterized.product(layout=["out_in", "in_out"], bias=[False, True])
    def test_forward_records_x_and_weight(self, layout, bias):
        """As the FP8 path: x's and W's amax in the forward (the cuBLAS small
        path records them in the backward: this tells the two apart), the
        gradient's in the backward; a gradient with inf records nothing."""
        x, w, gy = _data(256, 128, 64, layout, seed=7)
        b = rand((64,), BF16, scale=1.0, special=False, seed=8).requires_grad_() if bias else None
        st = torch_ops.FP8LinearState.create(4, device=DEV)
        xx = x.clone().requires_grad_()
        y = torch_ops.fp8_linear(xx, w.clone().requires_grad_(), b, state=st, weight_layout=layout,
                                 min_gemm_size=1 << 40)
        self.assertEqual(st.input_amax_history[0].item(), x.float().abs().max().item())
        self.assertEqual(st.kernel_amax_history[0].item(), w.float().abs().max().item())
        self.assertEqual(float(st.grad_amax_history.abs().max()), 0.0)
        y.backward(gy)
        self.assertEqual(st.grad_amax_history[0].item(), gy.float().abs().max().item())
        g_inf = gy.clone()
        g_inf[3, 5] = float("inf")
        h, s = st.grad_amax_history.clone(), st.grad_scale.clone()
        _run(x, w, g_inf, st, layout)
        self.assertTrue(torch.equal(st.grad_amax_history, h) and torch.equal(st.grad_scale, s))

    def test_gradient_unsuited_to_the_kernel_and_frozen_input(self):
        """A gradient the kernel does not take (a view at an odd offset) and
        an x that needs no gradient: the gradient's amax is recorded by its
        own launch; the state still equals the FP8 path's."""
        M, K, N = 512, 256, 128
        x, w, gy = _data(M, K, N, "out_in", seed=11)
        buf = torch.empty(M * N + 1, device=DEV, dtype=BF16)
        odd = buf[1:].view(M, N)
        odd.copy_(gy)
        for x_grad in (True, False):
            st = torch_ops.FP8LinearState.create(8, device=DEV)
            st_ref = torch_ops.FP8LinearState.create(8, device=DEV)
            _run(x, w, odd, st, "out_in", x_grad=x_grad)
            _run(x, w, gy, st_ref, "out_in", mgs=0, x_grad=x_grad)
            for u, v in zip(st.tensors(), st_ref.tensors()):
                self.assertTrue(torch.equal(u, v), x_grad)

    @parameterized.parameters((1, 1024, 2048, 1024, True, True, True), (2, 4096, 1024, 1024, False, True, True),
                              (2, 4096, 1024, 1024, True, True, False), (1, 4096, 1024, 1024, True, False, True),
                              (2, 1024, 2048, 1024, False, True, True), (-1, 1024, 2048, 1024, False, False, True),
                              (0, 1024, 2048, 1024, False, True, True), (2, 4096, 1024, 512, False, False, True),
                              (2, 1024, 2048, 1024, False, False, False), (3, 4096, 1024, 1024, False, False, True))
    def test_cuda_graph_replay_equals_eager(self, mode, M, K, N, ours, bias, x_grad):
        """set_gemm_amax_in_graphs(1): captured calls take our GEMMs as eager
        calls do; replays equal them bit for bit, state included. 2 (auto,
        also as the environment's default, -1): where the backward is one
        launch of ours (dX and dW in one wave: 1024x2048x1024; the chain:
        4096x1024x1024) or our forward would take narrow tiles, cuBLAS's
        forward (its output within bf16 rounding of the eager one) and our
        backward recording x and W too; else (4096x1024x512: dX recording g
        and W, a launch for x; with no dX needed, one launch for all three;
        4096x1024x1024 without dX: our forward) as 1. 0: cuBLAS's GEMMs and
        the state kernel; 3: cuBLAS's forward at every shape. The same state
        bit for bit in every mode."""
        ext = _ext()
        was = ext.set_gemm_amax_in_graphs(mode)
        self.addCleanup(ext.set_gemm_amax_in_graphs, was)
        with self.assertRaisesRegex(ValueError, "mode: expected -1"):
            ext.set_gemm_amax_in_graphs(4)
        x, w, gy = _data(M, K, N, "out_in", seed=14)
        b = rand((N,), BF16, scale=1.0, special=False, seed=15) if bias else None
        grads = [gy, 2 * gy, 0.5 * gy]
        st_e = torch_ops.FP8LinearState.create(8, device=DEV)
        eager = [_run(x, w, g, st_e, "out_in", bias=b, x_grad=x_grad) for g in grads]
        st = torch_ops.FP8LinearState.create(8, device=DEV)
        warm = torch_ops.FP8LinearState.create(8, device=DEV)
        leaves = [t.clone().requires_grad_(t is not x or x_grad) for t in (x, w, b) if t is not None]
        sg = torch.empty_like(gy)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            # The backward thread's cuBLAS handle made before the capture
            # (mode 0 calls cuBLAS there only while captured).
            torch.nn.functional.linear(x.detach().requires_grad_(), w).sum().backward()
            for _ in range(2):
                sg.copy_(gy)
                torch_ops.fp8_linear(*leaves, state=warm, min_gemm_size=1 << 40).backward(sg)
        torch.cuda.current_stream().wait_stream(s)
        for t in leaves:
            t.grad = None
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            y = torch_ops.fp8_linear(*leaves, state=st, min_gemm_size=1 << 40)
            y.backward(sg)
        for g, want in zip(grads, eager):
            sg.copy_(g)
            cg.replay()
            torch.cuda.synchronize()
            for got, ref in zip([y] + [t.grad for t in leaves], want):
                if ref is None:  # x without a gradient
                    self.assertIsNone(got)
                elif ours:
                    self.assertTrue(torch.equal(got, ref))
                else:
                    self.assertLess(relerr(got, ref), 1e-2)
        for u, v in zip(st.tensors(), st_e.tensors()):
            self.assertTrue(torch.equal(u, v))
