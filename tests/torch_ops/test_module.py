"""FP8Linear and convert_to_fp8: the nn.Module face of fp8_linear.

Runs everywhere: on an FP8 GPU through the compiled kernels, elsewhere
through the exact reference (CPU CI).
"""

import copy
import dataclasses
import io

import torch
from absl.testing import parameterized

import torch_ops

from tests.support.torch_checks import DEV  # noqa: E402
# The layer's buffer names, in FP8LinearState's field order.
STATE_NAMES = tuple(f.name for f in dataclasses.fields(torch_ops.FP8LinearState))[:6]


def _data(M, K, N, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    gy = (torch.randn(M, N, generator=g) * 1e-3).to(DEV, dtype)
    return x, gy


def _step(module, x, gy):
    xx = x.clone().requires_grad_()
    y = module(xx)
    y.backward(gy)
    return y.detach(), xx.grad


class FP8LinearTest(parameterized.TestCase):
    @parameterized.product(bias=[True, False], fmt=["hybrid", "e4m3"], mgs=[0, 1 << 40])
    def test_equals_fp8_linear_with_its_state(self, bias, fmt, mgs):
        """Three training steps: outputs, gradients and state bit-equal to
        fp8_linear called with an FP8LinearState of the same tensors."""
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 48, bias=bias, device=DEV)
        layer = torch_ops.FP8Linear.from_linear(copy.deepcopy(lin), history_len=8, fp8_format=fmt,
                                                min_gemm_size=mgs)
        w = lin.weight.detach().clone().requires_grad_()
        b = lin.bias.detach().clone().requires_grad_() if bias else None
        st = torch_ops.FP8LinearState.create(8, device=DEV)
        for step in range(3):
            x, gy = _data(32, 64, 48, step)
            y, dx = _step(layer, x, gy)
            xx = x.clone().requires_grad_()
            ref = torch_ops.fp8_linear(xx, w, b, st, torch_ops.LinearConfig(fp8_format=fmt, min_gemm_size=mgs))
            ref.backward(gy)
            self.assertTrue(torch.equal(y, ref.detach()), f"out step {step}")
            self.assertTrue(torch.equal(dx, xx.grad), f"dx step {step}")
            self.assertTrue(torch.equal(layer.weight.grad, w.grad), f"dw step {step}")
            for name, t in zip(STATE_NAMES, st.tensors()):
                self.assertTrue(torch.equal(getattr(layer, name), t), f"{name} step {step}")
            layer.weight.grad = None
            w.grad = None
        # The FP8 path records; below min_gemm_size the state stays fresh.
        self.assertEqual(float(layer.grad_amax_history[0]) > 0.0, mgs == 0)

    def test_eval_records_nothing(self):
        layer = torch_ops.FP8Linear(32, 16, device=DEV, history_len=4)
        x, _ = _data(8, 32, 16, 1)
        layer(x.float()).sum().backward()
        before = [t.clone() for t in layer.buffers()]
        layer.eval()
        with torch.no_grad():
            layer(x.float())
        for u, v in zip(before, layer.buffers()):
            self.assertTrue(torch.equal(u, v))

    def test_state_dict_round_trip(self):
        layer = torch_ops.FP8Linear(32, 16, device=DEV, history_len=4)
        for seed in range(2):
            x, gy = _data(8, 32, 16, seed, torch.float32)
            _step(layer, x, gy)
        buf = io.BytesIO()
        torch.save(layer.state_dict(), buf)
        buf.seek(0)
        fresh = torch_ops.FP8Linear(32, 16, device=DEV, history_len=4)
        fresh.load_state_dict(torch.load(buf))
        self.assertEqual(sorted(layer.state_dict()), sorted(fresh.state_dict()))
        x, gy = _data(8, 32, 16, 5, torch.float32)
        a, b = _step(layer, x, gy), _step(fresh, x, gy)
        self.assertTrue(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
        for u, v in zip(layer.buffers(), fresh.buffers()):
            self.assertTrue(torch.equal(u, v))

    def test_cast_keeps_the_state_float32(self):
        layer = torch_ops.FP8Linear(32, 16, device=DEV, history_len=4)
        x, gy = _data(8, 32, 16, 0, torch.float32)
        _step(layer, x, gy)
        state = [t.clone() for t in layer.buffers()]
        layer.to(torch.bfloat16)
        self.assertEqual(layer.weight.dtype, torch.bfloat16)
        for u, v in zip(state, layer.buffers()):
            self.assertEqual(v.dtype, torch.float32)
            self.assertTrue(torch.equal(u, v))
        _step(layer, x.bfloat16(), gy.bfloat16())  # still trains

    def test_to_empty_from_meta_gives_a_fresh_state(self):
        with torch.device("meta"):
            layer = torch_ops.FP8Linear(32, 16, history_len=4)
        layer.to_empty(device=DEV)
        self.assertEqual(layer.input_scale.item(), 1.0)
        self.assertEqual(float(layer.grad_amax_history.abs().max()), 0.0)

    def test_replaced_weight_buffer_and_options_take_effect(self):
        """The layer's cached call follows a new weight Parameter, a buffer
        replaced in the buffer dict, and options set after construction."""
        torch.manual_seed(0)
        layer = torch_ops.FP8Linear(64, 48, device=DEV, history_len=8, min_gemm_size=0)
        x, gy = _data(32, 64, 48, 0)
        _step(layer, x, gy)  # builds the cache
        new_w = torch.nn.Parameter(torch.randn(48, 64, device=DEV))
        layer.weight = new_w
        fresh_hist = torch.zeros(8, device=DEV)
        layer._buffers["input_amax_history"] = fresh_hist
        layer.fp8_format = "e4m3"
        st = torch_ops.FP8LinearState(*(getattr(layer, n) for n in STATE_NAMES))
        ref_state = torch_ops.FP8LinearState(*(t.clone() for t in st.tensors()))
        w = new_w.detach().clone().requires_grad_()
        x, gy = _data(32, 64, 48, 1)
        y, dx = _step(layer, x, gy)
        xx = x.clone().requires_grad_()
        ref = torch_ops.fp8_linear(xx, w, layer.bias.detach(), ref_state,
                                   torch_ops.LinearConfig(fp8_format="e4m3", min_gemm_size=0))
        ref.backward(gy)
        self.assertTrue(torch.equal(y, ref.detach()))
        self.assertTrue(torch.equal(dx, xx.grad))
        self.assertTrue(torch.equal(new_w.grad, w.grad))
        self.assertGreater(float(fresh_hist[0]), 0.0)  # the new buffer was recorded into
        for name, t in zip(STATE_NAMES, ref_state.tensors()):
            self.assertTrue(torch.equal(getattr(layer, name), t), name)

    def test_the_kept_compute_dtype_decision_follows_changes(self):
        """A call like the last compute-dtype one runs it again without
        deciding anew; min_gemm_size, the settings or a cast decide anew."""
        torch.manual_seed(0)
        lin = torch.nn.Linear(16, 8, device=DEV)
        layer = torch_ops.FP8Linear.from_linear(lin, min_gemm_size=2**40, history_len=4)
        x = torch.randn(4, 16, device=DEV)
        for _ in range(2):
            self.assertTrue(torch.equal(layer(x), lin(x)))
        self.assertEqual(float(layer.input_amax_history.abs().max()), 0.0)  # nothing recorded
        layer.min_gemm_size = 0
        layer(x)
        self.assertGreater(float(layer.input_amax_history[0]), 0.0)  # FP8 ran
        layer.min_gemm_size = None
        previous = torch_ops.set_settings(min_gemm_size=2**40)
        try:
            self.assertTrue(torch.equal(layer(x), lin(x)))
            torch_ops.set_settings(min_gemm_size=0)
            before = layer.input_amax_history.clone()
            layer(x)
            self.assertFalse(torch.equal(layer.input_amax_history, before))  # FP8 ran
        finally:
            torch_ops.set_settings(previous)
        layer.min_gemm_size = 2**40
        layer(x)
        layer.to(torch.bfloat16)  # the same Parameters, now bfloat16
        expected = torch.nn.functional.linear(x, layer.weight.float(), layer.bias.float())
        self.assertTrue(torch.equal(layer(x), expected))  # the weight cast to x's dtype
        xb = x.bfloat16()
        self.assertTrue(torch.equal(layer(xb), torch.nn.functional.linear(xb, layer.weight, layer.bias)))

    def test_pickles_and_deep_copies_after_a_call(self):
        layer = torch_ops.FP8Linear(32, 16, device=DEV, history_len=4)
        x, gy = _data(8, 32, 16, 0, torch.float32)
        _step(layer, x, gy)

        def pickled(m):
            buf = io.BytesIO()
            torch.save(m, buf)
            buf.seek(0)
            return torch.load(buf, weights_only=False)

        for make_copy in (pickled, copy.deepcopy):
            other = make_copy(layer)
            a, b = _step(layer, x, gy), _step(other, x, gy)
            self.assertTrue(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
            self.assertTrue(torch.equal(layer.grad_amax_history, other.grad_amax_history))
            self.assertIsNot(other.grad_amax_history, layer.grad_amax_history)

    def test_bad_arguments_are_named(self):
        with self.assertRaisesRegex(ValueError, "fp8_format"):
            torch_ops.FP8Linear(4, 4, fp8_format="e5m2")
        with self.assertRaisesRegex(ValueError, "scaling"):
            torch_ops.FP8Linear(4, 4, scaling="dynamic")
        with self.assertRaisesRegex(ValueError, "amax_compute_algo"):
            torch_ops.FP8Linear(4, 4, amax_compute_algo="mean")
        with self.assertRaisesRegex(ValueError, "history_len"):
            torch_ops.FP8Linear(4, 4, history_len=0)
        with self.assertRaisesRegex(TypeError, "linear: expected a torch.nn.Linear"):
            torch_ops.FP8Linear.from_linear(torch.nn.ReLU())

    def test_bad_inputs_are_named(self):
        layer = torch_ops.FP8Linear(8, 4, device=DEV)
        with self.assertRaisesRegex(ValueError, "does not match x's last dimension 5"):
            layer(torch.randn(2, 5, device=DEV))
        with self.assertRaisesRegex(TypeError, "x: expected bfloat16, float16 or float32"):
            layer(torch.ones(2, 8, dtype=torch.int32, device=DEV))
        with self.assertRaisesRegex(ValueError, "x: expected a tensor of rank >= 2"):
            layer(torch.randn(8, device=DEV))


class ConvertTest(parameterized.TestCase):
    def test_converts_in_place_with_a_filter(self):
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

            def forward(self, x):
                return x + self.inner(x)

        model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(16, 4)).to(DEV)
        params = list(model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = torch_ops.convert_to_fp8(model, filter_fn=lambda name, m: m.out_features != 4, history_len=4,
                                       min_gemm_size=0)
        self.assertIs(out, model)
        kinds = [type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.assertEqual(kinds, ["FP8Linear"] * 4 + ["Linear"])
        self.assertEqual([id(p) for p in model.parameters()], [id(p) for p in params])
        x, _ = _data(8, 16, 4, 3, torch.float32)
        w0 = model[0].inner[0].weight.detach().clone()
        model(x).square().sum().backward()
        opt.step()
        self.assertFalse(torch.equal(model[0].inner[0].weight, w0))  # the old optimizer updates the new layer
        self.assertGreater(float(model[0].inner[0].grad_amax_history[0]), 0.0)

    def test_a_layer_used_twice_stays_one_layer(self):
        shared = torch.nn.Linear(8, 8, device=DEV)
        model = torch.nn.ModuleDict({"a": torch.nn.Sequential(shared), "b": torch.nn.Sequential(shared)})
        torch_ops.convert_to_fp8(model)
        self.assertIsInstance(model["a"][0], torch_ops.FP8Linear)
        self.assertIs(model["a"][0], model["b"][0])

    def test_a_single_linear_is_returned_converted(self):
        lin = torch.nn.Linear(8, 8, device=DEV)
        new = torch_ops.convert_to_fp8(lin)
        self.assertIsInstance(new, torch_ops.FP8Linear)
        self.assertIs(new.weight, lin.weight)
        with self.assertRaisesRegex(TypeError, "module: expected a torch.nn.Module"):
            torch_ops.convert_to_fp8("model")

    def test_compile_fullgraph_equals_eager(self):
        torch.manual_seed(0)
        eager = torch_ops.FP8Linear(256, 128, device=DEV, history_len=4, min_gemm_size=0)
        compiled = copy.deepcopy(eager)
        fn = torch.compile(compiled, fullgraph=True)
        for seed in range(3):
            x, gy = _data(64, 256, 128, seed)
            a, b = _step(eager, x, gy), _step(fn, x, gy)
            self.assertTrue(torch.allclose(a[0].float(), b[0].float(), rtol=1e-2, atol=1e-3))
        for u, v in zip(eager.buffers(), compiled.buffers()):
            self.assertTrue(torch.equal(u, v))
