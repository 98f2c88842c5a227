"""fold_pending_grad_amax: the reference against NumPy float32 arithmetic (CPU),
and the CUDA kernel against the reference, bit for bit (FP8 GPU only)."""

import numpy as np
import pytest
import torch
from absl.testing import parameterized

import torch_ops
from torch_ops.fold import FOLD_COUNT_PERIOD

from tests.torch_ops_utils import counting_linear_folded

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32 = np.float32
needs_kernels = pytest.mark.skipif(
    not torch_ops.is_available(), reason=f"torch_ops kernels unavailable: {torch_ops.unavailable_reason()}"
)


def numpy_fold(pending, fold_state, history, scale, fmt_max, margin, algo, window, update_scale):
    """Independent float32 reference (the meaning in torch_ops/fold.py)."""
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
    if update_scale:
        w = history[0] if algo == "most_recent" else history[:window].max()
        if fresh and np.isfinite(w) and w > 0:
            scale = F32(F32(w * F32(1.0 / fmt_max)) * F32(2.0 ** -margin))
    new_folds = F32((folds + 1) % FOLD_COUNT_PERIOD) if fresh else folds
    state = np.array(
        [new_folds, token if fresh else last_token, loss_scale if loss_scale > 0 else last_loss_scale], F32
    )
    return F32(new_folds + 1), scale, history, state


def random_case(rng, H):
    history = (rng.random(H, dtype=F32) * 10.0 ** rng.integers(-3, 4)).astype(F32)
    history[rng.random(H) < 0.2] = 0
    amax = F32(rng.choice([0.0, np.inf, np.nan, rng.random() * 100, rng.random() * 1e-3, 5e4]))
    last_token = F32(rng.integers(0, 4))
    token = F32(rng.choice([0, last_token, rng.integers(1, 6)]))
    last_ls = F32(rng.choice([0.0, 2.0 ** rng.integers(-2, 16)]))
    ls = F32(rng.choice([0.0, last_ls, 2.0 ** rng.integers(-2, 16)]))
    folds = F32(rng.choice([0.0, 3.0, FOLD_COUNT_PERIOD - 1]))
    scale = F32(rng.random() * 0.01 + 1e-6)
    return [amax, token, ls], [folds, last_token, last_ls], history, scale


class FoldReferenceTest(parameterized.TestCase):
    @parameterized.product(
        fp8_dtype=[E4M3, E5M2], algo=["max", "most_recent"], margin=[0.0, 2.0], update_scale=[True, False]
    )
    def test_matches_numpy(self, fp8_dtype, algo, margin, update_scale):
        rng = np.random.default_rng(0)
        fmt_max = 448.0 if fp8_dtype == E4M3 else 57344.0
        for case in range(60):
            H = int(rng.choice([1, 2, 17, 64]))
            window = int(rng.integers(1, H + 3))
            pending, fold_state, history, scale = random_case(rng, H)
            want = numpy_fold(pending, fold_state, history, scale, fmt_max, margin, algo, min(window, H),
                              update_scale)
            p = torch.tensor(pending)
            fs, h, s = torch.tensor(fold_state), torch.tensor(history), torch.tensor(scale)
            token, s_snap, h_snap = torch_ops.fold_pending_grad_amax(
                p, fs, h, s, fp8_dtype, margin=margin, amax_compute_algo=algo, window=window,
                update_scale=update_scale,
            )
            msg = f"case {case}: pending={pending} fold_state={fold_state}"
            np.testing.assert_array_equal(token.numpy(), want[0], err_msg=msg)
            np.testing.assert_array_equal(s.numpy(), want[1], err_msg=msg)
            np.testing.assert_array_equal(s_snap.numpy(), want[1], err_msg=msg)
            np.testing.assert_array_equal(h.numpy(), want[2], err_msg=msg)
            np.testing.assert_array_equal(h_snap.numpy(), want[2], err_msg=msg)
            np.testing.assert_array_equal(fs.numpy(), want[3], err_msg=msg)

    def test_snapshots_are_copies(self):
        fs, h, s = torch.zeros(3), torch.zeros(4), torch.ones(())
        _, s_snap, h_snap = torch_ops.fold_pending_grad_amax(torch.tensor([2.0, 1.0, 0.0]), fs, h, s, E5M2)
        torch_ops.fold_pending_grad_amax(torch.tensor([8.0, 2.0, 0.0]), fs, h, s, E5M2)
        self.assertEqual(float(h_snap[0]), 2.0)
        self.assertEqual(float(h[0]), 8.0)
        self.assertNotEqual(float(s_snap), float(s))

    def test_registered_op_matches(self):
        args = (torch.tensor([2.0, 1.0, 0.0]), torch.zeros(3), torch.zeros(4), torch.ones(()))
        copies = [t.clone() for t in args]
        a = torch_ops.fold_pending_grad_amax(*args, E5M2)
        b = torch.ops.torch_ops.fold_grad_amax(*copies, E5M2, 0.0, "max", 4, True)
        for x, y in zip(a + args[1:], b + tuple(copies[1:])):
            torch.testing.assert_close(x, y, rtol=0, atol=0)

    @parameterized.named_parameters(
        ("pending", dict(pending=torch.zeros(2)), "pending"),
        ("fold_state", dict(fold_state=torch.zeros(3, dtype=torch.float64)), "fold_state"),
        ("history", dict(amax_history=torch.zeros(2, 2)), "amax_history"),
        ("scale", dict(scale=torch.ones(2)), "scale"),
        ("algo", dict(amax_compute_algo="mean"), "amax_compute_algo"),
        ("window", dict(window=0), "window"),
        ("fp8_dtype", dict(fp8_dtype=torch.float16), "fp8_dtype"),
    )
    def test_bad_arguments(self, override, name):
        kwargs = dict(pending=torch.zeros(3), fold_state=torch.zeros(3), amax_history=torch.zeros(4),
                      scale=torch.ones(()), fp8_dtype=E5M2)
        kwargs.update(override)
        with self.assertRaisesRegex(ValueError, name):
            torch_ops.fold_pending_grad_amax(**kwargs)


@needs_kernels
class FoldKernelTest(parameterized.TestCase):
    @parameterized.product(
        fp8_dtype=[E4M3, E5M2], algo=["max", "most_recent"], update_scale=[True, False], H=[1, 17, 1024, 3001]
    )
    def test_kernel_equals_reference(self, fp8_dtype, algo, update_scale, H):
        rng = np.random.default_rng(H)
        for case in range(25):
            window = int(rng.integers(1, H + 3))
            margin = float(rng.choice([0.0, 1.0, 3.0]))
            pending, fold_state, history, scale = random_case(rng, H)
            cpu = [torch.tensor(pending), torch.tensor(fold_state), torch.tensor(history), torch.tensor(scale)]
            gpu = [t.cuda() for t in cpu]
            kw = dict(margin=margin, amax_compute_algo=algo, window=window, update_scale=update_scale)
            want = torch_ops.fold_pending_grad_amax(*cpu, fp8_dtype, **kw)
            torch.cuda.empty_cache()
            torch.empty(1 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)  # poison small outputs
            got = torch_ops.fold_pending_grad_amax(*gpu, fp8_dtype, **kw)
            msg = f"case {case}: pending={pending} fold_state={fold_state} window={window}"
            for g, w in zip(got + tuple(gpu[1:]), want + tuple(cpu[1:])):
                np.testing.assert_array_equal(g.cpu().numpy(), w.numpy(), err_msg=msg)

    def test_repeated_folds_and_cuda_graph(self):
        h, s, fs = torch.zeros(16, device="cuda"), torch.ones((), device="cuda"), torch.zeros(3, device="cuda")
        pending = torch.zeros(3, device="cuda")
        ref = [torch.zeros(16), torch.ones(()), torch.zeros(3)]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch_ops.fold_pending_grad_amax(torch.zeros(3, device="cuda"), torch.zeros(3, device="cuda"),
                                             torch.zeros(16, device="cuda"), torch.ones((), device="cuda"), E5M2)
            with torch.cuda.graph(graph):
                torch_ops.fold_pending_grad_amax(pending, fs, h, s, E5M2)
        torch.cuda.current_stream().wait_stream(stream)
        for step in range(1, 6):
            pending.copy_(torch.tensor([float(step) * 3.0, float(step), 0.0]))
            graph.replay()
            torch_ops.fold_pending_grad_amax(pending.cpu(), ref[2], ref[0], ref[1], E5M2)
        torch.cuda.synchronize()
        for g, w in zip((h, s, fs), ref):
            np.testing.assert_array_equal(g.cpu().numpy(), w.numpy())
        self.assertEqual(h[:5].tolist(), [15.0, 12.0, 9.0, 6.0, 3.0])


def folded_steps(device, fast, *, steps=3, training=True, pending_grad=True, bias=True, lead=None, mgs=0,
                 no_grad=False, twice=False, fp8_format="hybrid", inf_step=None, as_tuple=False, mkn=(24, 40, 16),
                 prequantized=None, bump=False):
    """Training steps of fp8_linear_folded as the Keras layers run them (the
    optimizer overwrites `pending` with its gradient); returns every output,
    gradient and state tensor, in order. `prequantized`: a list; each step's
    weight is quantized ahead (`prequantize_weight`) and whether the call
    took it is appended. `bump`: the weight is scaled in place before the
    call (after any quantize ahead)."""
    from torch_ops import linear as L

    saved = L.FAST_PATH
    L.FAST_PATH = fast
    try:
        g = torch.Generator().manual_seed(7)
        M, K, N = mkn
        kernel = (torch.randn(K, N, generator=g) * 0.05).to(device)
        b0 = torch.randn(N, generator=g).to(device) if bias else None
        st = torch_ops.FP8LinearState.create(8, device=device)
        pending = torch.zeros(3, device=device, requires_grad=pending_grad)
        fold_state = torch.zeros(3, device=device)
        out = []
        for step in range(steps):
            x = (torch.randn(M, K, generator=g) * (step + 1)).bfloat16().to(device)
            gy = torch.randn(M, N, generator=g).bfloat16().to(device)
            if step == inf_step:
                gy[3, 4] = float("inf")
            if lead is not None:
                x, gy = x.reshape(*lead, K), gy.reshape(*lead, N)
            x.requires_grad_(not no_grad)
            w = kernel.clone().requires_grad_(not no_grad)
            b = None if b0 is None else b0.clone().requires_grad_(not no_grad)
            state = st.tensors() if as_tuple else st
            pre = None if prequantized is None else L.prequantize_weight(w, state)
            if bump:
                with torch.no_grad():
                    w.mul_(1.5)
            with torch.set_grad_enabled(not no_grad):
                kw = dict(state=state, pending=pending, fold_state=fold_state, fp8_format=fp8_format,
                          weight_layout="in_out", training=training, min_gemm_size=mgs, window=8)
                y = L.fp8_linear_folded(x, w, b, prequantized_weight=pre, **kw)
                if pre is not None:
                    prequantized.append(pre.used)
                if twice:
                    y = y + L.fp8_linear_folded(x * 2, w, b, **kw)
            out.append(y.detach())
            if y.requires_grad:
                y.backward(gy)
                out += [x.grad, w.grad] + ([b.grad] if b is not None else [])
            if pending.grad is not None:
                out.append(pending.grad.clone())
                with torch.no_grad():
                    pending.copy_(pending.grad)
                pending.grad = None
            out += [t.clone() for t in st.tensors()] + [fold_state.clone(), pending.detach().clone()]
        return out
    finally:
        L.FAST_PATH = saved


class LinearFoldedTest(parameterized.TestCase):
    """fp8_linear_folded (the Keras layers' call): the fold, then fp8_linear
    with `pending` as the gradient channel."""

    @parameterized.named_parameters(
        ("pending_shape", dict(pending=torch.zeros(2)), ValueError, "pending"),
        ("pending_dtype", dict(pending=torch.zeros(3, dtype=torch.float64)), ValueError, "pending"),
        ("fold_state_shape", dict(fold_state=torch.zeros(4)), ValueError, "fold_state"),
        ("fold_state_not_tensor", dict(fold_state=[0.0, 0.0, 0.0]), ValueError, "fold_state"),
        ("window", dict(window=0), ValueError, "window"),
        ("fp8_format", dict(fp8_format="e5m2"), ValueError, "fp8_format"),
        ("x_dtype", dict(x=torch.zeros(8, 16, dtype=torch.int32)), TypeError, "x:"),
        ("weight_shape", dict(weight=torch.zeros(16)), ValueError, "weight:"),
    )
    def test_bad_arguments_are_named(self, override, error, name):
        from torch_ops import linear as L

        for training in (True, False):
            kwargs = dict(x=torch.randn(8, 16), weight=torch.randn(16, 4), state=torch_ops.FP8LinearState.create(4),
                          pending=torch.zeros(3), fold_state=torch.zeros(3), weight_layout="in_out",
                          training=training)
            kwargs.update(override)
            with self.assertRaisesRegex(error, name):
                L.fp8_linear_folded(**kwargs)

    def test_gradient_channel_and_fold(self):
        from torch_ops import linear as L

        st = torch_ops.FP8LinearState.create(4)
        pending, fold_state = torch.zeros(3, requires_grad=True), torch.zeros(3)
        x, w = torch.randn(8, 16), torch.randn(16, 4) * 0.1
        amaxes = []
        for step in range(3):
            gy = torch.randn(8, 4) * (step + 1)
            if step == 2:
                gy[0, 0] = float("nan")
            L.fp8_linear_folded(x, w, state=st, pending=pending, fold_state=fold_state,
                                weight_layout="in_out").backward(gy)
            amax = 0.0 if step == 2 else gy.abs().max().item()
            self.assertEqual(pending.grad.tolist(), [amax, step + 1.0, 0.0])
            amaxes.append(amax)
            with torch.no_grad():
                pending.copy_(pending.grad)
            pending.grad = None
            # The fold at the start of step t recorded step t-1's amax.
            want = (amaxes[:step][::-1] + [0.0, 0.0])[:2]
            self.assertEqual(st.grad_amax_history[:2].tolist(), want)
        self.assertEqual(fold_state.tolist(), [2.0, 2.0, 0.0])
        # Not training: no fold, token 0, nothing recorded.
        h = st.tensors()
        h = [t.clone() for t in h]
        L.fp8_linear_folded(x, w, state=st, pending=pending, fold_state=fold_state, weight_layout="in_out",
                            training=False).backward(gy)
        self.assertEqual(pending.grad[1:].tolist(), [0.0, 0.0])
        self.assertEqual(fold_state.tolist(), [2.0, 2.0, 0.0])
        for u, v in zip(st.tensors(), h):
            self.assertTrue(torch.equal(u, v))

    def test_bias_gradient_rounds_through_x_dtype(self):
        from torch_ops import linear as L

        st = torch_ops.FP8LinearState.create(4)
        pending, fold_state = torch.zeros(3, requires_grad=True), torch.zeros(3)
        x = torch.randn(64, 16).bfloat16()
        b = torch.randn(4, requires_grad=True)
        gy = torch.randn(64, 4).bfloat16()
        y = L.fp8_linear_folded(x, torch.randn(16, 4) * 0.1, b, state=st, pending=pending,
                                fold_state=fold_state, weight_layout="in_out")
        self.assertEqual(y.dtype, torch.bfloat16)
        y.backward(gy)
        self.assertEqual(b.grad.dtype, torch.float32)
        self.assertTrue(torch.equal(b.grad, gy.float().sum(0).bfloat16().float()))

    def test_state_tuple_equals_dataclass(self):
        a = folded_steps("cpu", False, as_tuple=True)
        b = folded_steps("cpu", False)
        for u, v in zip(a, b):
            self.assertTrue(torch.equal(u, v))


@needs_kernels
class LinearFoldedKernelTest(parameterized.TestCase):
    """The C++ entry (csrc/linear.cpp, linear_folded) against the Python
    composite on the same kernels: bit-equal outputs, gradients and state."""

    @parameterized.named_parameters(
        ("fp8", dict()),
        ("small", dict(mgs=1 << 40)),
        ("rank3_no_bias", dict(lead=(4, 6), bias=False)),
        ("rank3_small", dict(lead=(2, 12), mgs=1 << 40)),
        ("e4m3_twice", dict(fp8_format="e4m3", twice=True)),
        ("twice_small", dict(twice=True, mgs=1 << 40)),
        ("inference", dict(training=False)),
        ("no_grad", dict(no_grad=True)),
        ("pending_without_grad", dict(pending_grad=False)),
        # Small with autograd but no sink: PyTorch's own node records in the
        # backward, so the fold needs its own launch.
        ("small_pending_without_grad", dict(pending_grad=False, mgs=1 << 40)),
        ("inf_gradient", dict(inf_step=1)),
        ("inf_gradient_small", dict(inf_step=1, mgs=1 << 40)),
        ("tuple_state", dict(as_tuple=True)),
        # Multiples of 64: x, the weight and the gradient take the lean
        # kernels, whose last block also folds (x) and emits (the gradient);
        # the first step's empty histories go through their fallback launch.
        ("lean", dict(mkn=(128, 192, 256))),
        ("lean_inf_gradient", dict(mkn=(128, 192, 256), inf_step=1)),
        ("lean_twice_rank3", dict(mkn=(128, 192, 256), lead=(2, 64), twice=True)),
    )
    def test_equals_python_composite(self, kw):
        with counting_linear_folded() as calls:
            got = folded_steps("cuda", True, **kw)
        want = folded_steps("cuda", False, **kw)
        self.assertTrue(calls and all(calls), calls)
        self.assertEqual(len(got), len(want))
        for i, (u, v) in enumerate(zip(got, want)):
            self.assertEqual((u.dtype, u.shape), (v.dtype, v.shape), i)
            self.assertTrue(torch.equal(u, v), f"item {i}: {u.flatten()[:6]} vs {v.flatten()[:6]}")


class PrequantizeOffTheKernelsTest(parameterized.TestCase):
    def test_none_off_the_kernels(self):
        from torch_ops import linear as L

        st = torch_ops.FP8LinearState.create(8)
        self.assertIsNone(L.prequantize_weight(torch.randn(16, 8), st))

    @parameterized.named_parameters(
        ("not_a_triple", lambda w, s, h: [(w, s)], ValueError, r"items\[0\]: expected a \(weight"),
        ("weight_rank", lambda w, s, h: [(w[0], s, h)], ValueError, r"items\[0\] weight: expected a 2-D"),
        ("weight_dtype", lambda w, s, h: [(w.int(), s, h)], TypeError, r"items\[0\] weight: expected bfloat16"),
        ("scale_dtype", lambda w, s, h: [(w, s.double(), h)], ValueError, r"items\[0\] kernel_scale: expected"),
        ("history_rank", lambda w, s, h: [(w, s, h[None])], ValueError,
         r"items\[0\] kernel_amax_history: expected a float32 tensor of a 1-D history"),
        ("second_item", lambda w, s, h: [(w, s, h), (w, h, h)], ValueError, r"items\[1\] kernel_scale"),
    )
    def test_bad_items_are_named(self, make, error, pattern):
        from torch_ops import linear as L

        st = torch_ops.FP8LinearState.create(8)
        w = torch.randn(16, 8)
        with self.assertRaisesRegex(error, pattern):
            L.prequantize_weights(make(w, st.kernel_scale, st.kernel_amax_history))

    def test_bad_state_and_options_are_named(self):
        from torch_ops import linear as L

        st = torch_ops.FP8LinearState.create(8)
        w = torch.randn(16, 8)
        with self.assertRaisesRegex(TypeError, "state: expected an FP8LinearState or its six tensors"):
            L.prequantize_weight(w, st.tensors()[:2])
        with self.assertRaisesRegex(ValueError, "amax_compute_algo: expected"):
            L.prequantize_weight(w, st, amax_compute_algo="mean")
        with self.assertRaisesRegex(TypeError, "prequantized_weight: expected None or prequantize_weight's"):
            L.fp8_linear_folded(torch.randn(4, 16), w, state=st, pending=torch.zeros(3),
                                fold_state=torch.zeros(3), weight_layout="in_out", prequantized_weight=w)


@needs_kernels
class PrequantizedWeightTest(parameterized.TestCase):
    """A weight quantized ahead on a side stream (prequantize_weight) and
    taken by the next training call gives bit-equal outputs, gradients and
    state; where the call may not take it, it is left unused."""

    @parameterized.named_parameters(
        ("fp8", dict(), True),
        ("e4m3", dict(fp8_format="e4m3"), True),
        # The first step's empty kernel history: the scale seeds from the
        # weight's own amax, ahead as in the call.
        ("lean", dict(mkn=(128, 192, 256)), True),
        ("lean_inf_gradient_rank3", dict(mkn=(128, 192, 256), inf_step=1, lead=(2, 64)), True),
        ("small", dict(mgs=1 << 40), False),
        ("inference", dict(training=False), False),
        ("weight_changed_after", dict(bump=True), False),
    )
    def test_equals_quantizing_in_the_call(self, kw, taken):
        used = []
        got = folded_steps("cuda", True, prequantized=used, **kw)
        want = folded_steps("cuda", True, **kw)
        self.assertEqual(used, [taken] * 3)
        self.assertEqual(len(got), len(want))
        for i, (u, v) in enumerate(zip(got, want)):
            self.assertEqual((u.dtype, u.shape), (v.dtype, v.shape), i)
            self.assertTrue(torch.equal(u, v), f"item {i}: {u.flatten()[:6]} vs {v.flatten()[:6]}")

    def test_another_state_or_a_spent_one_is_not_taken(self):
        from torch_ops import linear as L

        g = torch.Generator().manual_seed(3)
        w = (torch.randn(64, 128, generator=g) * 0.1).cuda()
        x = torch.randn(256, 64, generator=g).bfloat16().cuda()
        st, other = (torch_ops.FP8LinearState.create(8, device="cuda") for _ in range(2))
        kw = dict(pending=torch.zeros(3, device="cuda"), fold_state=torch.zeros(3, device="cuda"),
                  weight_layout="in_out", min_gemm_size=0)
        pre = L.prequantize_weight(w, st)
        L.fp8_linear_folded(x, w, state=other, prequantized_weight=pre, **kw)
        self.assertFalse(pre.used)
        L.fp8_linear_folded(x, w, state=st, prequantized_weight=pre, **kw)
        self.assertFalse(pre.used)  # spent by the first call
        pre = L.prequantize_weight(w, st)
        L.fp8_linear_folded(x, w, state=st, prequantized_weight=pre, **kw)
        self.assertTrue(pre.used)
