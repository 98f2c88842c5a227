"""The CUDA kernels against torch_ops.reference (FP8 GPU only).

Every comparison is with the reference on the same device, never with bf16,
on fresh random data with NaN, +-inf and values past the FP8 range sprinkled
in, at aligned and ragged shapes and at tiny and huge magnitudes. Quantized
bytes must be equal for the same scale and every state tensor bit-equal;
GEMMs are compared element by element. Outputs are poisoned before each run
(the caching allocator hands the kernels memory just filled with 0xFF, NaN
in both FP8 formats), so an element a kernel did not write cannot match.
"""

import pytest
import torch
from absl.testing import parameterized

import torch_ops
from torch_ops import ops
from torch_ops import reference as ref
from tests.support.torch_checks import DEV
from tests.support.torch_checks import E4M3
from tests.support.torch_checks import E5M2
from tests.support.torch_checks import assert_block_gemm_close
from tests.support.torch_checks import assert_gemm_close
from tests.support.torch_checks import assert_same_f32
from tests.support.torch_checks import assert_same_fp8
from tests.support.torch_checks import kernels_required  # noqa: F401 (fixture)
from tests.support.torch_checks import needs_fp8_gpu
from tests.support.torch_checks import poison
from tests.support.torch_checks import rand

pytestmark = [needs_fp8_gpu, pytest.mark.usefixtures("kernels_required")]


def ref_quantize(x, scale, dt, transpose=False):
    """(q, q_t or None, amax) of the reference, x viewed as 2-D for q_t."""
    q = ref.quantize_with_scale(x, scale, dt)
    qt = q.reshape(-1, x.shape[-1]).t().contiguous() if transpose else None
    return q, qt, ref.amax(x)


def _check_quantize(x, scale, dt, transpose):
    """torch_ops.quantize on poisoned output memory: the reference's bytes
    (and its transpose, or none) and amax."""
    poison()
    q, qt, amax = torch_ops.quantize(x, scale, dt, transpose=transpose)
    rq, rqt, ramax = ref_quantize(x, scale, dt, transpose=transpose)
    assert_same_fp8(q, rq)
    if transpose:
        assert_same_fp8(qt, rqt)
    else:
        assert qt is None
    assert_same_f32(amax, ramax)


def ref_delayed(x, h, s, dt, margin=0.0, amax_compute_algo="max", transpose=False, record=True):
    q, su, a = ref.quantize_delayed(x, h, s, dt, margin=margin, amax_compute_algo=amax_compute_algo, record=record)
    return q, (q.reshape(-1, x.shape[-1]).t().contiguous() if transpose else None), su, a


def ref_current(x, dt, margin=0.0, prev_scale=None, transpose=False):
    q, su, a = ref.quantize_current(x, dt, margin=margin, prev_scale=prev_scale)
    return q, (q.reshape(-1, x.shape[-1]).t().contiguous() if transpose else None), su, a


def assert_same_delayed(got, want, state, want_state):
    """quantize_delayed's (q, q_t, scale_used, amax) and the (history, scale)
    it updated, equal to the reference's bit for bit."""
    (q, qt, su, a), (rq, rqt, rsu, ra) = got, want
    assert_same_f32(su, rsu)
    assert_same_f32(a, ra)
    assert_same_fp8(q, rq)
    if rqt is not None:
        assert_same_fp8(qt, rqt)
    for t, rt in zip(state, want_state):
        assert_same_f32(t, rt)


QUANT_SHAPES = [(1, 1, 16), (17, 9, 33), (4095, 4097), (4097, 129), (1, 7), (16384, 4096)]


class QuantizeKernelTest(parameterized.TestCase):
    @parameterized.product(
        shape=QUANT_SHAPES,
        in_dtype=[torch.bfloat16, torch.float16, torch.float32],
        dt=[E4M3, E5M2],
        transpose=[False, True],
    )
    def test_bytes_equal_reference(self, shape, in_dtype, dt, transpose):
        if shape == (16384, 4096) and in_dtype == torch.float16 and dt == E5M2:
            self.skipTest("covered by the other large-shape cases; keeps the run short")
        x = rand(shape, in_dtype, seed=hash((shape, str(in_dtype))) % 1000)
        scale = torch.tensor(0.173, device=DEV)
        _check_quantize(x, scale, dt, transpose)

    @parameterized.product(
        # flat (no transpose), the tile kernels (ragged; 8-column aligned) and the lean kernels (64-multiples)
        shape=[(4097, 129), (1000, 136), (256, 512)],
        in_dtype=[torch.bfloat16, torch.float32],
        magnitude=[1e-40, 1e-30, 1e-3, 1e4, 1e30],
        transpose=[False, True],
    )
    def test_tiny_and_huge_magnitudes(self, shape, in_dtype, magnitude, transpose):
        """Tensors far from 1 with the scale their own amax gives: the same
        bytes (subnormal FP8 values included) and amax as the reference."""
        x = rand(shape, in_dtype, scale=magnitude, special=False, seed=3)
        for dt in (E4M3, E5M2):
            scale = ref.compute_scale(ref.amax(x), torch.ones((), device=DEV), dt)
            _check_quantize(x, scale, dt, transpose)

    @parameterized.product(shape=[(96, 40), (256, 512)], magnitude=[1e-43, 1e-39, 1e-37, 1e30],
                           algo=["max", "most_recent"], margin=[0.0, 3.0])
    def test_delayed_state_with_tiny_and_subnormal_amaxes(self, shape, magnitude, algo, margin):
        """Seeds and records from subnormal, tiny and huge amaxes: the scale
        floor (2**-126 before the margin) and the bytes as the reference."""
        h, s = torch.zeros(8, device=DEV), torch.ones((), device=DEV)
        rh, rs = h.clone(), s.clone()
        for k in range(3):
            x = rand(shape, torch.float32, scale=magnitude * (k + 1), special=False, seed=70 + k)
            poison()
            got = torch_ops.quantize_delayed(x, h, s, E4M3, margin=margin, amax_compute_algo=algo, transpose=True)
            want = ref_delayed(x, rh, rs, E4M3, margin=margin, amax_compute_algo=algo, transpose=True)
            assert_same_delayed(got, want, (h, s), (rh, rs))
        self.assertGreaterEqual(float(s), ref.MIN_SCALE)

    @parameterized.product(dt=[E4M3, E5M2], transpose=[False, True], shape=[(17, 33), (4095, 129), (64, 128)])
    def test_padded_layout(self, dt, transpose, shape):
        """The GEMM-ready layout: rows padded to 16 bytes with zero bytes."""
        x = rand(shape, torch.bfloat16, special=False)
        s = torch.tensor(0.05, device=DEV)
        poison()
        q, qt, _ = torch.ops.torch_ops.quantize(x, s, dt, transpose, True, True)
        R, C = shape
        Cp, Rp = (C + 15) // 16 * 16, (R + 15) // 16 * 16
        rq = ref.quantize_with_scale(x, s, dt)
        self.assertEqual(tuple(q.shape), (R, Cp))
        assert_same_fp8(q[:, :C], rq)
        self.assertEqual(int(q[:, C:].view(torch.uint8).sum()), 0)
        if transpose:
            self.assertEqual(tuple(qt.shape), (C, Rp))
            assert_same_fp8(qt[:, :R], rq.t().contiguous())
            self.assertEqual(int(qt[:, R:].view(torch.uint8).sum()), 0)

    @parameterized.product(
        shape=[(64, 64), (128, 192), (1024, 4096), (8192, 4096)],
        in_dtype=[torch.bfloat16, torch.float16, torch.float32],
        special=[False, True],
        write_q=[True, False],
        dt=[E4M3, E5M2],
    )
    def test_lean_kernel_equal_reference(self, shape, in_dtype, special, write_q, dt):
        """The lean kernels (whole 64 x 64 tiles, no padding): bytes in both formats,
        finite and non-finite amax, with and without q."""
        if shape == (8192, 4096) and (in_dtype == torch.float32 or special):
            self.skipTest("the large case once per format and q")
        x = rand(shape, in_dtype, special=special, seed=11)
        s = torch.tensor(0.173, device=DEV)
        poison()
        q, qt, amax = torch.ops.torch_ops.quantize(x, s, dt, True, True, write_q)
        rq, _, ramax = ref_quantize(x, s, dt)
        if write_q:
            assert_same_fp8(q, rq)
        assert_same_fp8(qt, rq.t().contiguous())
        assert_same_f32(amax, ramax)
        self.assertEqual(bool(torch.isfinite(amax)), not special)

    @parameterized.product(H=[1, 1024, 2048, 2049, 5000], algo=["max", "most_recent"])
    def test_delayed_state_any_history_length(self, H, algo):
        """Histories that fit the one-pass finalize (<= 2048 entries per
        256-thread block) and longer ones (the chunked path) give the
        reference's state, through the transposing, flat and amax-only kernels."""
        h, s = torch.zeros(H, device=DEV), torch.ones((), device=DEV)
        rh, rs = h.clone(), s.clone()
        for k in range(6):
            x = rand((96, 40), torch.bfloat16, scale=3.0 * (k + 1), special=False, seed=50 + k)
            if k == 2:
                x[1, 1] = float("nan")  # not recorded
            transpose, write_q = [(True, True), (False, True), (False, False)][k % 3]
            _, _, su, a = torch.ops.torch_ops.quantize_delayed(x, h, s, E5M2, 0.5, algo, transpose, True, True,
                                                               write_q)
            _, _, rsu, ra = ref_delayed(x, rh, rs, E5M2, margin=0.5, amax_compute_algo=algo)
            assert_same_f32(su, rsu)
            assert_same_f32(a, ra)
            assert_same_f32(h, rh)
            assert_same_f32(s, rs)

    @parameterized.product(algo=["max", "most_recent"], dt=[E4M3, E5M2], margin=[0.0, 1.5])
    def test_delayed_state_matches_reference(self, algo, dt, margin):
        H = 5
        h, s = torch.zeros(H, device=DEV), torch.ones((), device=DEV)
        rh, rs = h.clone(), s.clone()
        shapes = [(33, 17), (128, 64), (1, 3), (300, 256), (7, 9), (64, 64), (2, 2)]
        for k, shp in enumerate(shapes):
            x = rand(shp, torch.bfloat16, scale=10.0 * (k + 1), special=False, seed=k)
            if k == 3:
                x[0, 0] = float("inf")  # not recorded
            if k == 4:
                x.zero_()  # recorded (zero)
            poison()
            got = torch_ops.quantize_delayed(x, h, s, dt, margin=margin, amax_compute_algo=algo, transpose=True)
            want = ref_delayed(x, rh, rs, dt, margin=margin, amax_compute_algo=algo, transpose=True)
            assert_same_delayed(got, want, (h, s), (rh, rs))
        # the inf call (k=3) was not recorded, the zero call (k=4) was
        self.assertEqual(h[2].item(), 0.0)

    def test_history_holds_k_amaxes(self):
        H = 16
        h, s = torch.zeros(H, device=DEV), torch.ones((), device=DEV)
        amaxes = []
        for k in range(10):
            x = rand((257, 129), torch.float32, scale=k + 1.0, special=False, seed=100 + k)
            amaxes.insert(0, x.abs().max().item())
            torch_ops.quantize_delayed(x, h, s, E4M3)
        self.assertEqual(h[:10].tolist(), amaxes)
        self.assertEqual(h[10:].abs().max().item(), 0.0)
        self.assertEqual(s.item(), (torch.tensor(max(amaxes)) * torch.tensor(1.0 / 448.0)).item())  # docs/numerics.md

    def test_record_false_and_seed(self):
        h, s = torch.zeros(4, device=DEV), torch.full((), 3.0, device=DEV)
        x = rand((100, 100), torch.bfloat16, special=False)
        _, _, su, a = torch_ops.quantize_delayed(x, h, s, E4M3, record=False)
        assert_same_f32(su, ref.compute_scale(a, torch.tensor(3.0, device=DEV), E4M3))
        self.assertEqual(h.abs().max().item(), 0.0)
        self.assertEqual(s.item(), 3.0)
        h[2] = 1.0  # non-empty: the state scale is used as is
        _, _, su, _ = torch_ops.quantize_delayed(x, h, s, E4M3, record=False)
        self.assertEqual(su.item(), 3.0)

    @parameterized.product(in_dtype=[torch.bfloat16, torch.float16, torch.float32], dt=[E4M3, E5M2],
                           H=[16, 4096], record=[True, False])
    def test_delayed_lean_in_kernel_check_sequence(self, in_dtype, dt, H, record):
        """The lean kernels' own history check (no pre-pass) against the
        reference call by call: a non-finite first tensor (not recorded, so
        the next call seeds again), an all-zero one (recorded as 0: the
        history still reads empty), then finite ones; a history whose newest
        entry is 0 but an older one is not (not empty); H = 4096 takes the
        finalize's long-history path. Two shapes: 256 blocks of eight 64 x 64
        tiles (the fallback launch strides over them), and 2 x 3 tiles (one
        block, a short unit)."""
        if True:
            for shape in [(2048, 4096), (128, 192)]:
                xs = [rand(shape, in_dtype, special=True, seed=60), torch.zeros(shape, dtype=in_dtype, device=DEV)]
                xs += [rand(shape, in_dtype, scale=3.0 * (k + 1), special=False, seed=61 + k) for k in range(3)]
                h, s = torch.zeros(H, device=DEV), torch.full((), 0.5, device=DEV)
                rh, rs = h.clone(), s.clone()
                for step, x in enumerate(xs):
                    if not record and step == 3:
                        h[7] = rh[7] = 2.5  # newest entry 0, an older one not: not empty
                    poison()
                    got = torch_ops.quantize_delayed(x, h, s, dt, transpose=True, record=record)
                    want = ref_delayed(x, rh, rs, dt, transpose=True, record=record)
                    torch.cuda.synchronize()
                    assert_same_delayed(got, want, (h, s), (rh, rs))
                if record:
                    self.assertGreater(float(h[0]), 0.0)

    def test_many_captures_past_the_reserved_workspaces(self):
        """Seventy CUDA graphs, more than the 64 workspaces the kernels zero
        ahead for captures (the later ones zero theirs inside the graph),
        each a delayed quantize with a state kernel of its own, replayed in
        turn three times on fresh data: each graph's outputs and state equal
        the reference's every time (a workspace shared by two graphs, or
        left dirty by a replay, would not)."""
        n = 70
        xbufs = [rand((192, 320), torch.bfloat16, special=False, seed=100 + i) for i in range(n)]
        states = [(torch.zeros(8, device=DEV), torch.ones((), device=DEV)) for _ in range(n)]
        refs = [(h.clone(), s.clone()) for h, s in states]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = (torch.zeros(8, device=DEV), torch.ones((), device=DEV))
            torch_ops.quantize_delayed(xbufs[0], *warm, E4M3, transpose=True)
        torch.cuda.current_stream().wait_stream(side)
        graphs, outs = [], []
        for xb, (h, s) in zip(xbufs, states):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs.append(torch_ops.quantize_delayed(xb, h, s, E4M3, transpose=True))
            graphs.append(g)
        for step in range(3):
            for i in range(n):
                x = rand((192, 320), torch.bfloat16, scale=1.0 + step + i / n, special=False, seed=1000 * step + i)
                xbufs[i].copy_(x)
                graphs[i].replay()
                want = ref_delayed(x, *refs[i], E4M3, transpose=True)
                torch.cuda.synchronize()
                assert_same_delayed(outs[i], want, states[i], refs[i])

    def _delayed_lean_three_calls(self, in_dtype, dt, graph):
        xs = [rand((2048, 4096), in_dtype, scale=10.0 * (k + 1), special=False, seed=40 + k) for k in range(3)]
        h, s = torch.zeros(16, device=DEV), torch.ones((), device=DEV)
        rh, rs = h.clone(), s.clone()
        if graph:
            xbuf = xs[0].clone()
            hw, sw = h.clone(), s.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    torch_ops.quantize_delayed(xbuf, hw, sw, dt, transpose=True)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = torch_ops.quantize_delayed(xbuf, h, s, dt, transpose=True)
            self.assertEqual(float(h.abs().max()), 0.0)  # capture ran nothing
        for x in xs:
            poison()
            if graph:
                xbuf.copy_(x)
                g.replay()
                got = out
            else:
                got = torch_ops.quantize_delayed(x, h, s, dt, transpose=True)
            want = ref_delayed(x, rh, rs, dt, transpose=True)
            torch.cuda.synchronize()
            assert_same_delayed(got, want, (h, s), (rh, rs))

    @parameterized.product(shape=[(1, 16), (4095, 4097), (256, 512)], dt=[E4M3, E5M2], prev=[False, True])
    def test_current_matches_reference(self, shape, dt, prev):
        x = rand(shape, torch.bfloat16, special=False)
        p = torch.tensor(0.5, device=DEV) if prev else None
        q, qt, su, a = torch_ops.quantize_current(x, dt, margin=0.5, prev_scale=p, transpose=True)
        rq, rqt, rsu, ra = ref_current(x, dt, margin=0.5, prev_scale=p, transpose=True)
        assert_same_f32(su, rsu)
        assert_same_f32(a, ra)
        assert_same_fp8(q, rq)
        assert_same_fp8(qt, rqt)
        # zeros: the fallback scale
        _, _, su, _ = torch_ops.quantize_current(torch.zeros(4, 4, device=DEV), dt, prev_scale=p)
        self.assertEqual(su.item(), 0.5 if prev else 1.0)

    @parameterized.product(skip_zero=[False, True], algo=["max", "most_recent"], H=[2000, 9000])
    def test_record_amax_matches_reference(self, skip_zero, algo, H):
        h = torch.rand(H, device=DEV)  # longer than one block; 9000: longer than the one-pass finalize
        h[H // 2:] = 0
        s = torch.full((), 0.1, device=DEV)
        rh, rs = h.clone(), s.clone()
        for v in [3.0, 0.0, float("inf"), float("nan"), 1e-3, 5000.0]:
            a = torch.tensor(v, device=DEV)
            torch_ops.record_amax(h, s, a, E5M2, amax_compute_algo=algo, skip_zero=skip_zero, margin=1.0)
            ref.record_amax(rh, rs, a, E5M2, amax_compute_algo=algo, skip_zero=skip_zero, margin=1.0)
            assert_same_f32(h, rh)
            assert_same_f32(s, rs)


GEMM_SHAPES = [(1, 1, 16), (17, 9, 33), (4095, 4097, 129), (16384, 4096, 4096), (256, 512, 128)]
class GemmKernelTest(parameterized.TestCase):
    @parameterized.product(
        mkn=GEMM_SHAPES,
        types=[(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)],
        out_dtype=[torch.bfloat16, torch.float32, torch.float16],
        fast=[True, False],
        bias=[False, True],
    )
    def test_gemm_matches_reference(self, mkn, types, out_dtype, fast, bias):
        M, K, N = mkn
        if M * K * N > 1e10 and (out_dtype != torch.bfloat16 or types != (E4M3, E4M3)):
            self.skipTest("large shape: one combination is enough")
        a = rand((M, K), torch.float32, scale=2.0, special=False, seed=1).to(types[0])
        b = rand((N, K), torch.float32, scale=2.0, special=False, seed=2).to(types[1])
        sa, sb = torch.tensor(0.37, device=DEV), torch.tensor(1.9, device=DEV)
        bias_dtype = out_dtype if out_dtype != torch.float32 else torch.bfloat16
        bb = rand((N,), torch.float32, special=False, seed=3).to(bias_dtype) if bias else None
        poison()
        out = torch_ops.fp8_gemm(a, b, sa, sb, bias=bb, out_dtype=out_dtype, use_fast_accum=fast)
        want = ref.fp8_gemm(a, b, sa, sb, bias=bb, out_dtype=torch.float32)
        self.assertEqual(out.dtype, out_dtype)
        self.assertEqual(tuple(out.shape), (M, N))
        assert_gemm_close(out, want, out_dtype, fast)

    @parameterized.product(magnitude=[2.0**-60, 2.0**60], types=[(E4M3, E4M3), (E5M2, E4M3)])
    def test_tiny_and_huge_scales(self, magnitude, types):
        """Scales far from 1 (tiny or huge tensors' dequantization steps)."""
        a = rand((257, 96), torch.float32, scale=2.0, special=False, seed=21).to(types[0])
        b = rand((130, 96), torch.float32, scale=2.0, special=False, seed=22).to(types[1])
        sa = torch.tensor(magnitude, device=DEV)
        sb = torch.tensor(1.0 / magnitude * 4, device=DEV)
        out = torch_ops.fp8_gemm(a, b, sa, sb, out_dtype=torch.float32, use_fast_accum=False)
        assert_gemm_close(out, ref.fp8_gemm(a, b, sa, sb, out_dtype=torch.float32), torch.float32, False)

    # Shapes used by no other test in this process: their first call makes the
    # plan (and, with gemm_autotune on, the default, times the cuBLASLt
    # candidates on these operands before the real GEMM).
    @parameterized.parameters(((3001, 2049, 1000), torch.bfloat16, False), ((2048, 4096, 6144), torch.bfloat16, True),
                              ((2048, 4096, 6144), torch.float32, False))
    def test_autotuned_gemm_matches_reference(self, mkn, out_dtype, fast):
        M, K, N = mkn
        a = rand((M, K), torch.float32, scale=2.0, special=False, seed=11).to(E4M3)
        b = rand((N, K), torch.float32, scale=2.0, special=False, seed=12).to(E5M2 if not fast else E4M3)
        sa, sb = torch.tensor(0.37, device=DEV), torch.tensor(1.9, device=DEV)
        want = ref.fp8_gemm(a, b, sa, sb, out_dtype=torch.float32)
        for _ in range(2):  # first call: tunes, then runs; second: the cached plan
            poison()
            out = torch_ops.fp8_gemm(a, b, sa, sb, out_dtype=out_dtype, use_fast_accum=fast)
            assert_gemm_close(out, want, out_dtype, fast)

    def test_autotune_off_matches_reference(self):
        previous = torch_ops.set_settings(gemm_autotune=False)
        try:
            a = rand((3011, 2041), torch.float32, scale=2.0, special=False, seed=31).to(E4M3)
            b = rand((1003, 2041), torch.float32, scale=2.0, special=False, seed=32).to(E4M3)
            s = torch.tensor(0.5, device=DEV)
            out = torch_ops.fp8_gemm(a, b, s, s, out_dtype=torch.bfloat16, use_fast_accum=True)
        finally:
            torch_ops.set_settings(previous)
        assert_gemm_close(out, ref.fp8_gemm(a, b, s, s, out_dtype=torch.float32), torch.bfloat16, True)

    def test_gemm_first_call_inside_cuda_graph(self):
        """A plan first made under graph capture: no timing there (top-1), the
        graph replays right, a later eager call tunes the plan, and the
        captured graph still replays right afterwards."""
        M, K, N = 1200, 784, 1520  # used by no other test: the capture makes the plan
        a = rand((M, K), torch.float32, scale=2.0, special=False, seed=13).to(E4M3)
        b = rand((N, K), torch.float32, scale=2.0, special=False, seed=14).to(E4M3)
        sa, sb = torch.tensor(0.5, device=DEV), torch.tensor(1.25, device=DEV)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch_ops.fp8_gemm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=False)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_gemm_close(out, ref.fp8_gemm(a, b, sa, sb, out_dtype=torch.float32), torch.bfloat16, False)
        eager = torch_ops.fp8_gemm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=False)  # tunes now
        assert_gemm_close(eager, ref.fp8_gemm(a, b, sa, sb, out_dtype=torch.float32), torch.bfloat16, False)
        a.copy_(rand((M, K), torch.float32, scale=2.0, special=False, seed=15).to(E4M3))
        sa.fill_(0.75)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_gemm_close(out, ref.fp8_gemm(a, b, sa, sb, out_dtype=torch.float32), torch.bfloat16, False)

    def test_gemm_non_contiguous_and_offset_inputs(self):
        a = rand((40, 48), torch.float32, scale=2.0, special=False).to(E4M3)
        b = rand((24, 48), torch.float32, scale=2.0, special=False, seed=5).to(E4M3)
        s = torch.ones((), device=DEV)
        out = torch_ops.fp8_gemm(a[1:, 3:35], b[:, 3:35], s, s, out_dtype=torch.float32, use_fast_accum=False)
        want = ref.fp8_gemm(a[1:, 3:35], b[:, 3:35], s, s, out_dtype=torch.float32)
        assert_gemm_close(out, want, torch.float32, False)

    def test_registered_op_equals_eager_path(self):
        a = rand((64, 48), torch.float32, scale=2.0, special=False).to(E4M3)
        b = rand((32, 48), torch.float32, scale=2.0, special=False, seed=6).to(E4M3)
        s = torch.full((), 0.5, device=DEV)
        out = torch.ops.torch_ops.gemm(a, b, s, s, None, torch.float32, False, True)
        want = torch_ops.fp8_gemm(a, b, s, s, out_dtype=torch.float32, use_fast_accum=False)
        self.assertTrue(torch.equal(out, want))
        x = rand((100, 40), torch.bfloat16, special=False)  # finite: torch.equal(nan, nan) is False
        h1, s1 = torch.zeros(4, device=DEV), torch.ones((), device=DEV)
        h2, s2 = h1.clone(), s1.clone()
        r1 = torch.ops.torch_ops.quantize_delayed(x, h1, s1, E4M3, 0.0, "max", True, True, True, True)
        r2 = ops.quantize_delayed(x, h2, s2, E4M3, 0.0, "max", True, True, True, True)
        for u, v in zip(r1 + (h1, s1), r2 + (h2, s2)):
            self.assertTrue(torch.equal(u.view(torch.uint8) if u.element_size() == 1 else u,
                                        v.view(torch.uint8) if v.element_size() == 1 else v))

    def test_amax_only_single_kernel_matches(self):
        """write_q=False, no transpose: the pre-pass is skipped, the last block seeds."""
        for algo in ("max", "most_recent"):
            h, s = torch.zeros(6, device=DEV), torch.ones((), device=DEV)
            rh, rs = h.clone(), s.clone()
            for k in range(4):
                x = rand((333, 77), torch.bfloat16, scale=k + 1.0, special=False, seed=20 + k)
                _, _, su, a = ops.quantize_delayed(x, h, s, E5M2, 0.5, algo, False, True, True, False)
                _, _, rsu, ra = ref_delayed(x, rh, rs, E5M2, margin=0.5, amax_compute_algo=algo)
                assert_same_f32(su, rsu)
                assert_same_f32(a, ra)
                assert_same_f32(h, rh)
                assert_same_f32(s, rs)
            x = rand((50, 16), torch.float32, special=False)
            _, _, su, a = ops.quantize_current(x, None, E4M3, 0.0, False, True, False)
            _, _, rsu, _ = ref_current(x, E4M3)
            assert_same_f32(su, rsu)

    def test_bad_inputs(self):
        a = torch.randn(16, 16, device=DEV).to(E5M2)
        s = torch.ones((), device=DEV)
        with self.assertRaisesRegex(ValueError, "E5M2 x E5M2"):
            torch_ops.fp8_gemm(a, a, s, s)
        with self.assertRaisesRegex(ValueError, "scale_b:"):
            torch_ops.fp8_gemm(a, a.to(E4M3), s, s.cpu())
        with self.assertRaisesRegex(ValueError, "x:|scale:"):
            torch_ops.quantize(torch.randn(4, 4, device=DEV), torch.ones(()), E4M3)


class FoldKernelTest(parameterized.TestCase):
    @parameterized.product(fp8_dtype=[E4M3, E5M2], algo=["max", "most_recent"], update_scale=[True, False],
                           H=[1, 17, 1024, 3001])
    def test_kernel_equals_reference(self, fp8_dtype, algo, update_scale, H):
        import numpy as np

        from tests.reference.test_torch_reference import random_fold_case

        rng = np.random.default_rng(H)
        for case in range(25):
            window = int(rng.integers(1, H + 3))
            margin = float(rng.choice([0.0, 1.0, 3.0]))
            pending, fold_state, history, scale = random_fold_case(rng, H)
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
        import numpy as np

        h, s, fs = torch.zeros(16, device="cuda"), torch.ones((), device="cuda"), torch.zeros(3, device="cuda")
        pending = torch.zeros(3, device="cuda")
        want = [torch.zeros(16), torch.ones(()), torch.zeros(3)]
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
            torch_ops.fold_pending_grad_amax(pending.cpu(), want[2], want[0], want[1], E5M2)
        torch.cuda.synchronize()
        for g, w in zip((h, s, fs), want):
            np.testing.assert_array_equal(g.cpu().numpy(), w.numpy())
        self.assertEqual(h[:5].tolist(), [15.0, 12.0, 9.0, 6.0, 3.0])


BLOCK_SHAPES = [(1, 1), (5, 300), (128, 256), (130, 129), (4097, 1000), (16384, 4096)]


class BlockQuantizeKernelTest(parameterized.TestCase):
    """csrc/block.cu against reference.quantize_tiles / quantize_blocks: the
    same bytes and the same scales."""

    @parameterized.product(shape=BLOCK_SHAPES, in_dtype=[torch.bfloat16, torch.float16, torch.float32],
                           dt=[E4M3, E5M2], power_of_two=[False, True])
    def test_tiles_equal_reference(self, shape, in_dtype, dt, power_of_two):
        if shape[0] * shape[1] > 1e7 and (in_dtype != torch.bfloat16 or dt != E4M3):
            self.skipTest("large shape: one combination is enough")
        x = rand(shape, in_dtype, scale=30.0, seed=shape[0])
        for transposed in (False, True):
            poison()
            q, s = ops.quantize_tiles(x, dt, transposed, 1.0, power_of_two)
            rq, rs = ref.quantize_tiles(x.t() if transposed else x, dt, axis=1, margin=1.0,
                                        power_of_two=power_of_two)
            assert_same_fp8(q, rq)
            assert_same_f32(s, rs)

    @parameterized.product(magnitude=[1e-36, 1e-3, 1e30], in_dtype=[torch.float32, torch.bfloat16])
    def test_tiles_tiny_and_huge(self, magnitude, in_dtype):
        x = (rand((300, 520), torch.float32, scale=1.0, special=False, seed=3) * magnitude).to(in_dtype)
        for transposed in (False, True):
            q, s = ops.quantize_tiles(x, E4M3, transposed, 0.0, False)
            rq, rs = ref.quantize_tiles(x.t() if transposed else x, E4M3, axis=1)
            assert_same_fp8(q, rq)
            assert_same_f32(s, rs)

    @parameterized.product(shape=BLOCK_SHAPES, in_dtype=[torch.bfloat16, torch.float32], dt=[E4M3, E5M2],
                           power_of_two=[False, True])
    def test_blocks_equal_reference(self, shape, in_dtype, dt, power_of_two):
        w = rand(shape, in_dtype, scale=0.05, seed=shape[1])
        poison()
        q, qt, s = ops.quantize_blocks(w, dt, 0.0, power_of_two)
        rq, rs = ref.quantize_blocks(w, dt, power_of_two=power_of_two)
        assert_same_fp8(q, rq)
        assert_same_fp8(qt, rq.t().contiguous())
        assert_same_f32(s, rs)

    def test_scale_layout_is_the_gemm_layout(self):
        q, s = ops.quantize_tiles(rand((6, 300), torch.bfloat16, seed=1), E4M3, False, 0.0, False)
        self.assertEqual(tuple(s.shape), (6, 3))
        self.assertEqual(s.stride(), (1, 8))  # per tile, the rows side by side, padded to 4


class BlockGemmKernelTest(parameterized.TestCase):
    """cuBLASLt's block-scaled GEMM (csrc/gemm.cpp block_gemm) against
    reference.block_gemm, element by element."""

    @parameterized.product(mkn=[(1, 16, 16), (17, 300, 33), (256, 512, 128), (4095, 4097, 129),
                                (16384, 4096, 4096)],
                           types=[(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], b_tiles=[False, True],
                           out_dtype=[torch.bfloat16, torch.float32], bias=[False, True])
    def test_block_gemm_matches_reference(self, mkn, types, b_tiles, out_dtype, bias):
        M, K, N = mkn
        if M * K * N > 1e10 and (types != (E4M3, E4M3) or out_dtype != torch.bfloat16 or bias):
            self.skipTest("large shape: one combination is enough")
        a = rand((M, K), torch.float32, scale=3.0, special=False, seed=1)
        a = a * torch.exp2(torch.randint(-20, 20, (M, 1), device=a.device).float())
        b = rand((N, K), torch.float32, scale=0.1, special=False, seed=2)
        qa, sa = ops.quantize_tiles(a, types[0], False, 0.0, False)
        if b_tiles:
            qb, sb = ops.quantize_tiles(b, types[1], False, 0.0, False)
        else:
            qb, _, sb = ops.quantize_blocks(b, types[1], 0.0, False)
        bb = rand((N,), torch.float32, special=False, seed=3).to(torch.bfloat16) if bias else None
        poison()
        out = ops.block_gemm(qa, sa, qb, sb, b_tiles, bb, out_dtype)
        want = ref.block_gemm(qa, sa, qb.t(), sb.t(), b_tiles=b_tiles, bias=bb, out_dtype=torch.float32)
        abs_sum = ref.block_gemm(qa.float().abs(), sa, qb.float().abs().t(), sb.t(), b_tiles=b_tiles,
                                 out_dtype=torch.float32)
        self.assertEqual(out.dtype, out_dtype)
        assert_block_gemm_close(out, want, abs_sum, out_dtype)

    def test_strided_and_padded_scales(self):
        qa, sa = ops.quantize_tiles(rand((64, 384), torch.bfloat16, special=False, seed=4), E4M3, False, 0.0, False)
        qb, _, sb = ops.quantize_blocks(rand((256, 384), torch.bfloat16, special=False, seed=5), E4M3, 0.0, False)
        want = ref.block_gemm(qa, sa, qb.t(), sb.t(), out_dtype=torch.float32)
        # Contiguous copies of the scales (not the kernels' layout) give the same product.
        out = ops.block_gemm(qa, sa.contiguous(), qb, sb.t().contiguous().t(), False, None, torch.float32)
        abs_sum = ref.block_gemm(qa.float().abs(), sa, qb.float().abs().t(), sb.t(), out_dtype=torch.float32)
        assert_block_gemm_close(out, want, abs_sum, torch.float32)

    def test_registered_op_equals_eager_call(self):
        qa, sa = ops.quantize_tiles(rand((128, 256), torch.bfloat16, special=False, seed=6), E4M3, False, 0.0, False)
        qb, _, sb = ops.quantize_blocks(rand((128, 256), torch.bfloat16, special=False, seed=7), E4M3, 0.0, False)
        eager = ops.block_gemm(qa, sa, qb, sb, False, None, torch.bfloat16)
        registered = torch.ops.torch_ops.block_gemm(qa, sa, qb, sb, False, None, torch.bfloat16)
        self.assertTrue(torch.equal(eager, registered))
