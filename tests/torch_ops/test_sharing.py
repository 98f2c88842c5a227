"""One quantize per tensor (torch_ops.sharing): linears reading one tensor.

Three FP8 linears reading the same input (Q, K and V) with sharing on
against the same three with it off: outputs, gradients and every state
tensor after several training steps, element by element; the number of
quantizes of the input; the cases where nothing may be shared. CPU runs the
torch.library ops over the reference; an FP8 GPU also the C++ eager entry.
"""

import gc
from unittest import mock

import pytest
import torch
from absl.testing import parameterized

import torch_ops
from torch_ops import ops
from torch_ops import sharing
from tests.support.torch_checks import FP8_GPU
from tests.support.torch_checks import fresh_sharing_cache  # noqa: F401 (fixture)
from tests.support.torch_checks import kernels_required  # noqa: F401 (fixture)

M, K, N = 40, 64, 48
DEVICES = ("cpu", "cuda") if FP8_GPU else ("cpu",)

pytestmark = pytest.mark.usefixtures("fresh_sharing_cache")


def _config(share, **options):
    return torch_ops.LinearConfig(share_quantized_inputs=share, min_gemm_size=0, **options)


def _tensors(device, seed):
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(N, K, generator=g) * 0.1).to(device).requires_grad_() for _ in range(3)]
    biases = [torch.randn(N, generator=g).to(device).requires_grad_() for _ in range(3)]
    xs = [(torch.randn(M, K, generator=g) * 3).to(device) for _ in range(4)]
    upstream = [torch.randn(M, N, generator=g).to(device) for _ in range(3)]
    return weights, biases, xs, upstream


def _train(configs, device="cpu", steps=3, seed=0, history_len=4, between=None):
    """Trains three linears that read one tensor per step; returns every
    output, gradient and state tensor, in order. ``between(i, x)`` runs
    before linear ``i``'s call (and may return a new x for it)."""
    weights, biases, xs, upstream = _tensors(device, seed)
    states = [torch_ops.FP8LinearState.create(history_len=history_len, device=device) for _ in range(3)]
    got = []
    for step in range(steps):
        x = xs[step].clone().requires_grad_()
        ys = []
        for i in range(3):
            changed = None if between is None else between(i, x)
            xi = x if changed is None else changed
            ys.append(torch_ops.fp8_linear(xi, weights[i], biases[i], states[i], configs[i], True))
        loss = (ys[0] * ys[1] * upstream[0]).sum() + (ys[2] * upstream[2]).sum()
        loss.backward()
        got += [y.detach() for y in ys] + [x.grad]
        for p in weights + biases:
            got.append(p.grad.clone())
            p.grad = None
        for s in states:
            got += [t.clone() for t in s.tensors()]
    return got


def _assert_identical(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), (i, (a - b).abs().max())


class _Counter:
    """Counts the quantizes of tensors shaped like the input (M, K)."""

    def __init__(self):
        self.count = 0

    def spy(self, original):
        def counted(x, *args, **kwargs):
            if tuple(x.shape) == (M, K):
                self.count += 1
            return original(x, *args, **kwargs)

        return counted


def _count_input_quantizes(fn):
    counter = _Counter()
    names = ("quantize_delayed", "quantize_current", "quantize_tiles")
    patches = [mock.patch.object(ops, name, counter.spy(getattr(ops, name))) for name in names]
    for p in patches:
        p.start()
    try:
        result = fn()
    finally:
        for p in patches:
            p.stop()
    return counter.count, result


class ShareTest(parameterized.TestCase):
    @parameterized.product(
        device=DEVICES,
        options=(dict(scaling="delayed"), dict(scaling="delayed", margin=1.0, amax_compute_algo="most_recent"),
                 dict(scaling="current"), dict(scaling="block"), dict(scaling="block", power_of_two=True)),
    )
    def test_three_siblings_equal_the_unshared_linears(self, device, options):
        shared = _train([_config(True, **options)] * 3, device)
        unshared = _train([_config(False, **options)] * 3, device)
        _assert_identical(shared, unshared)

    @parameterized.named_parameters(
        ("delayed", dict(scaling="delayed"), 1), ("current", dict(scaling="current"), 1),
        ("block", dict(scaling="block"), 2),  # x's tiles along K, and along M for dW
    )
    def test_one_quantize_of_the_input_per_step(self, options, per_linear):
        steps = 3
        shared, _ = _count_input_quantizes(lambda: _train([_config(True, **options)] * 3, steps=steps))
        unshared, _ = _count_input_quantizes(lambda: _train([_config(False, **options)] * 3, steps=steps))
        self.assertEqual(shared, steps * per_linear)
        self.assertEqual(unshared, 3 * steps * per_linear)

    def test_the_forward_format_decides_not_the_gradient_format(self):
        # hybrid and e4m3 both quantize x to E4M3: one copy serves both.
        configs = [_config(True, fp8_format="hybrid"), _config(True, fp8_format="e4m3"), _config(True)]
        count, shared = _count_input_quantizes(lambda: _train(configs, steps=2))
        self.assertEqual(count, 2)
        _assert_identical(shared, _train([c.replace(share_quantized_inputs=False) for c in configs], steps=2))

    @parameterized.named_parameters(
        ("margins", [dict(), dict(margin=1.0), dict()], 2),
        ("scalings", [dict(), dict(scaling="current"), dict()], 2),
        ("algorithms", [dict(), dict(amax_compute_algo="most_recent"), dict()], 2),
        ("opted_out", [dict(), dict(share_quantized_inputs=False), dict()], 2),
    )
    def test_different_settings_do_not_share(self, options, per_step):
        configs = [torch_ops.LinearConfig(**{"min_gemm_size": 0, **o}) for o in options]
        count, shared = _count_input_quantizes(lambda: _train(configs, steps=2))
        self.assertEqual(count, 2 * per_step)
        _assert_identical(shared, _train([c.replace(share_quantized_inputs=False) for c in configs], steps=2))

    def test_different_history_lengths_do_not_share(self):
        weights, biases, xs, _ = _tensors("cpu", 0)
        states = [torch_ops.FP8LinearState.create(history_len=n) for n in (4, 8)]

        def run():
            for i in range(2):
                torch_ops.fp8_linear(xs[0], weights[i], biases[i], states[i], _config(True), True)

        count, _ = _count_input_quantizes(run)
        self.assertEqual(count, 2)

    def test_a_copy_with_equal_values_is_another_tensor(self):
        count, shared = _count_input_quantizes(
            lambda: _train([_config(True)] * 3, steps=2, between=lambda i, x: x.clone() if i == 1 else None))
        self.assertEqual(count, 4)
        _assert_identical(shared, _train([_config(False)] * 3, steps=2,
                                         between=lambda i, x: x.clone() if i == 1 else None))

    def test_a_tensor_changed_in_place_is_quantized_again(self):
        def change(i, x):
            if i == 2:
                with torch.no_grad():
                    x.mul_(2.0)

        count, shared = _count_input_quantizes(lambda: _train([_config(True)] * 3, steps=2, between=change))
        self.assertEqual(count, 4)
        _assert_identical(shared, _train([_config(False)] * 3, steps=2, between=change))

    def test_a_view_of_the_same_tensor_shares(self):
        # Keras layers reshape their (B, S, K) input to (B*S, K) per call.
        weights, biases, xs, _ = _tensors("cpu", 0)
        x3 = xs[0].reshape(4, M // 4, K)
        states = [torch_ops.FP8LinearState.create(history_len=4) for _ in range(2)]

        def run():
            return [torch_ops.fp8_linear(x3.reshape(M, K), weights[i], None, states[i], _config(True), True)
                    for i in range(2)]

        count, ys = _count_input_quantizes(run)
        self.assertEqual(count, 1)
        sharing.clear()
        fresh = [torch_ops.FP8LinearState.create(history_len=4) for _ in range(2)]
        want = [torch_ops.fp8_linear(xs[0], weights[i], None, fresh[i], _config(False), True) for i in range(2)]
        _assert_identical(ys, want)

    def test_a_linear_reading_the_tensor_again_quantizes_it_again(self):
        # Its scale has moved since its first call (delayed scaling): the second
        # call must see the new one, as without sharing.
        weights, biases, xs, _ = _tensors("cpu", 0)

        def run(share):
            state = torch_ops.FP8LinearState.create(history_len=4)
            ys = [torch_ops.fp8_linear(xs[0], weights[0], None, state, _config(share), True) for _ in range(3)]
            return ys + list(state.tensors())

        count, shared = _count_input_quantizes(lambda: run(True))
        self.assertEqual(count, 3)
        _assert_identical(shared, run(False))

    def test_unequal_scales_use_the_first_linears_and_each_state_is_its_own(self):
        # Linear 1's history holds an earlier, larger amax: its scale differs.
        # It takes linear 0's copy (quantized with linear 0's scale) and
        # records the amax in its own state exactly as it would have.
        weights, biases, xs, _ = _tensors("cpu", 0)

        def run(share):
            sharing.clear()
            states = [torch_ops.FP8LinearState.create(history_len=4) for _ in range(2)]
            torch_ops.fp8_linear(xs[1] * 8, weights[1], None, states[1], _config(False), True)
            ys = [torch_ops.fp8_linear(xs[0], weights[i], None, states[i], _config(share), True) for i in range(2)]
            return ys, [t.clone() for s in states for t in s.tensors()]

        (y_shared, state_shared), (y_unshared, state_unshared) = run(True), run(False)
        _assert_identical(state_shared, state_unshared)
        _assert_identical(y_shared[:1], y_unshared[:1])
        self.assertFalse(torch.equal(y_shared[1], y_unshared[1]))
        # x at linear 0's scale (seeded from x's amax), the weight at linear
        # 1's (its amax, recorded before): what a fresh linear 1 computes.
        fresh = torch_ops.FP8LinearState.create(history_len=4)
        _assert_identical(y_shared[1:],
                          [torch_ops.fp8_linear(xs[0], weights[1], None, fresh, _config(False), True)])

    def test_evaluation_and_no_grad_calls_share(self):
        weights, biases, xs, _ = _tensors("cpu", 0)

        def run(share):
            states = [torch_ops.FP8LinearState.create(history_len=4) for _ in range(3)]
            with torch.no_grad():
                return [torch_ops.fp8_linear(xs[0], weights[i], biases[i], states[i], _config(share), False)
                        for i in range(3)]

        count, shared = _count_input_quantizes(lambda: run(True))
        self.assertEqual(count, 1)
        _assert_identical(shared, run(False))

    def test_inference_tensors_are_not_shared(self):
        weights, biases, xs, _ = _tensors("cpu", 0)
        states = [torch_ops.FP8LinearState.create(history_len=4) for _ in range(2)]
        with torch.inference_mode():
            x = xs[0].clone()
            count, _ = _count_input_quantizes(
                lambda: [torch_ops.fp8_linear(x, weights[i], None, states[i], _config(True), False) for i in range(2)])
        self.assertEqual(count, 2)
        self.assertEqual(sharing.entry_count(), 0)

    def test_entries_die_with_the_tensor(self):
        weights, _, xs, _ = _tensors("cpu", 0)
        state = torch_ops.FP8LinearState.create(history_len=4)
        x = xs[0].clone()
        torch_ops.fp8_linear(x, weights[0].detach(), None, state, _config(True), True)
        self.assertEqual(sharing.entry_count(), 1)
        del x
        gc.collect()
        self.assertEqual(sharing.entry_count(), 0)

    def test_at_most_max_entries_are_kept(self):
        weights, _, _, _ = _tensors("cpu", 0)
        state = torch_ops.FP8LinearState.create(history_len=4)
        xs = [torch.randn(M, K) for _ in range(sharing.MAX_ENTRIES + 3)]
        for x in xs:
            torch_ops.fp8_linear(x, weights[0].detach(), None, state, _config(True), True)
        self.assertEqual(sharing.entry_count(), sharing.MAX_ENTRIES)

    def test_opting_out_leaves_nothing(self):
        weights, _, xs, _ = _tensors("cpu", 0)
        state = torch_ops.FP8LinearState.create(history_len=4)
        torch_ops.fp8_linear(xs[0], weights[0], None, state, _config(False), True)
        self.assertEqual(sharing.entry_count(), 0)

    def test_the_setting_is_validated(self):
        with self.assertRaisesRegex(ValueError, "share_quantized_inputs: expected a bool, got 'yes'"):
            torch_ops.LinearConfig(share_quantized_inputs="yes")

    def test_nothing_is_shared_under_torch_compile(self):
        weights, biases, xs, upstream = _tensors("cpu", 0)
        configs = [_config(True)] * 3

        def block(x, states):
            return [torch_ops.fp8_linear(x, weights[i], biases[i], states[i], configs[i], True) for i in range(3)]

        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        states = [torch_ops.FP8LinearState.create(history_len=4) for _ in range(3)]
        got = compiled(xs[0], states)
        self.assertEqual(sharing.entry_count(), 0)
        fresh = [torch_ops.FP8LinearState.create(history_len=4) for _ in range(3)]
        want = [torch_ops.fp8_linear(xs[0], weights[i], biases[i], fresh[i], _config(False), True) for i in range(3)]
        _assert_identical([y.detach() for y in got] + [t for s in states for t in s.tensors()],
                          [y.detach() for y in want] + [t for s in fresh for t in s.tensors()])
