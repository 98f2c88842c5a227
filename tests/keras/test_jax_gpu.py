"""JAX on an FP8 GPU: every FP8 layer GEMM must run in FP8 (checked in HLO).

Skips unless the Keras backend is JAX and the default device is a GPU with
FP8 tensor cores (compute capability >= 8.9).
"""

import contextlib
import re

import keras
import ml_dtypes
import numpy as np
import pytest

import keras_fp8
from keras_fp8.backends import jax_gemm
from tests.support.backend_utils import needs_jax_fp8_gpu
from tests.support.backend_utils import rng_normal
from tests.support.backend_utils import to_numpy

_FP8_TYPES = ("f8e4m3fn", "f8e5m2")


pytestmark = needs_jax_fp8_gpu


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\(?([a-z0-9]+)\[")


def gemm_operand_types(hlo_text):
    """For every matrix product in compiled HLO (dots inside fusions, cuBLAS
    custom calls and keras_fp8's own), the element types of its two
    operands."""
    types = {}
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if m:
            types[m.group(1)] = m.group(2)
    products = []
    for line in hlo_text.splitlines():
        gemm = re.search(r"\b(dot|custom-call)\(([^)]*)\)", line)
        if not gemm:
            continue
        if gemm.group(1) == "custom-call" and "__cublas" not in line and jax_gemm.TARGET not in line:
            continue
        names = re.findall(r"%([\w.\-]+)", gemm.group(2))[:2]
        products.append((line.strip()[:160], [types.get(n, "?") for n in names]))
    return products


def _is_fp8(operand_types):
    return all(t in _FP8_TYPES for t in operand_types) and operand_types


@contextlib.contextmanager
def _without_fp8_gemms():
    """The JAX backend as on a GPU without FP8 GEMMs: the exact emulation."""
    from keras_fp8.backends import jax as jax_backend

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax_backend, "fp8_gemm_supported", lambda: False)
        yield


@pytest.fixture(params=[True, False], ids=["custom_call", "xla_dot"])
def gemm_way(request):
    """Both ways the backend runs an FP8 product on the GPU."""
    before = jax_gemm.enabled()
    jax_gemm.set_enabled(request.param)
    yield request.param
    jax_gemm.set_enabled(before)


def _compiled_train_step_text(model, x, upstream):
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(trainable, x):
        y, nt = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.sum(y.astype(jnp.float32) * upstream), nt

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return step.lower(trainable, x).compile().as_text(), step(trainable, x)


def test_all_three_gemms_of_every_fp8_layer_are_fp8(gemm_way):
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    model = keras.Sequential([
        keras.Input((256,)),
        keras_fp8.layers.FP8Dense(512, activation="relu"),
        keras_fp8.layers.FP8Dense(384),
    ])
    x = rng_normal((1024, 256), 0).astype("float32")
    upstream = rng_normal((1024, 384), 1)
    text, _ = _compiled_train_step_text(model, x, upstream)
    products = gemm_operand_types(text)
    for line, types in products:
        print(types, line)
    fp8_lines = [line for line, types in products if _is_fp8(types)]
    other = [f"{types} {line}" for line, types in products if not _is_fp8(types)]
    # 2 layers x (forward, dx, dW); the first layer's dx is not needed.
    assert len(fp8_lines) >= 5, f"expected >= 5 FP8 GEMMs, found {len(fp8_lines)}"
    assert not other, "GEMMs in bf16/f32 inside an FP8 model:\n" + "\n".join(other)


def test_the_custom_call_is_available():
    # On an FP8 GPU the library builds, registers and passes its check;
    # a failure here would otherwise only be a warning.
    assert jax_gemm.available(), jax_gemm._load()


def test_backward_gemms_accumulate_in_full(gemm_way):
    # The forward may use cuBLASLt's fast FP8 accumulation, the backward's
    # two products accumulate in full (docs/design.md). The custom call
    # carries it as its fast_accum attribute; XLA turns fast accumulation
    # on for an FP8 dot at the default precision and off at HIGHEST.
    keras.mixed_precision.set_global_policy("fp8_hybrid")
    model = keras.Sequential([keras.Input((256,)), keras_fp8.layers.FP8Dense(512), keras_fp8.layers.FP8Dense(384)])
    x = rng_normal((1024, 256), 0).astype("float32")
    text, _ = _compiled_train_step_text(model, x, rng_normal((1024, 384), 1))
    if gemm_way:
        modes = [re.search(r"fast_accum = (\d)", line).group(1)
                 for line in text.splitlines() if f'custom_call_target="{jax_gemm.TARGET}"' in line]
        assert sorted(modes) == ["0"] * 4 + ["1"] * 2, modes
        assert "__cublas$lt$matmul$f8" not in text
        return
    precisions = [re.search(r'"operand_precision":\[([^\]]*)\]', line).group(1).replace('"', "")
                  for line in text.splitlines() if 'custom_call_target="__cublas$lt$matmul$f8"' in line]
    # 2 forward products; dx and dW of both layers (the step differentiates x too).
    assert sorted(precisions) == ["DEFAULT,DEFAULT"] * 2 + ["HIGHEST,HIGHEST"] * 4, precisions


_OUTPUT_RTOL = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-12}


def assert_gemm_close(got, want, out_dtype, fast=False):
    """tests/support/torch_checks.py's bound for an FP8 GEMM against the
    float32 emulation: `|got - want| <= atol + rtol |want|`, atol 2**-9
    (2**-5 with fast accumulation) of want's root mean square, rtol one
    rounding to the output dtype."""
    rms = float(np.sqrt(np.mean(np.square(want)))) if want.size else 0.0
    atol = (2.0**-5 if fast else 2.0**-9) * rms
    bound = atol + _OUTPUT_RTOL[out_dtype] * np.abs(want)
    excess = np.abs(got - want) - bound
    assert np.all(excess <= 0), f"worst excess {float(np.max(excess)):.4g} over atol {atol:.3g} + rtol |want|"


def _custom_call_cases():
    cases = []
    for m, k, n in [(256, 512, 384), (300, 64, 200), (1, 16, 8), (4096, 1024, 2048)]:
        for a_fmt, b_fmt in [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")]:
            cases.append((m, k, n, a_fmt, b_fmt))
    return cases


@pytest.mark.parametrize("m,k,n,a_fmt,b_fmt", _custom_call_cases())
@pytest.mark.parametrize("magnitude", [2.0**-12, 1.0, 2.0**10])
@pytest.mark.parametrize("out_dtype,use_bias", [("bfloat16", True), ("bfloat16", False), ("float16", True),
                                                ("float32", True)])
def test_custom_call_matches_the_emulation(m, k, n, a_fmt, b_fmt, magnitude, out_dtype, use_bias):
    # Fresh random operands quantized with their delayed-style scales; the
    # custom call at full accumulation against numerics.scaled_matmul
    # (float32 sums, one rounding), element by element, with the bound the
    # torch_ops GEMM tests use (tests/support/torch_checks.py,
    # assert_gemm_close): FP8 tensor cores sum about 14 bits between
    # promotions, so an absolute part relative to the product's root mean
    # square (2**-9 of it), and the output dtype's one rounding.
    import jax.numpy as jnp

    from keras_fp8 import numerics

    seed = m + 7 * k + 13 * n
    a = jnp.asarray(rng_normal((m, k), seed, magnitude))
    b = jnp.asarray(rng_normal((k, n), seed + 1, 0.05))
    scales = [numerics.compute_scale(numerics.compute_amax(t), jnp.float32(1.0), fmt)
              for t, fmt in ((a, a_fmt), (b, b_fmt))]
    a_q, b_q = numerics.quantize(a, scales[0], a_fmt), numerics.quantize(b, scales[1], b_fmt)
    scale = scales[0] * scales[1]
    # The bias in the output dtype, as the layer hands it over.
    bias = jnp.asarray(rng_normal((n,), seed + 2, magnitude)).astype(out_dtype) if use_bias else None
    assert jax_gemm.supports(a_q, b_q, out_dtype)
    got = np.asarray(jax_gemm.scaled_matmul(a_q, b_q, scale, out_dtype, bias, fast_accum=False), np.float64)
    want = np.asarray(numerics.scaled_matmul(a_q, b_q, scale, out_dtype, bias), np.float64)
    assert np.all(np.isfinite(got))
    assert_gemm_close(got, want, out_dtype)


def test_custom_call_takes_an_empty_batch():
    # M = 0, as a Keras layer takes an empty batch: an empty product, no launch.
    import jax.numpy as jnp

    out = jax_gemm.scaled_matmul(jnp.zeros((0, 32), jnp.float8_e4m3fn), jnp.zeros((32, 16), jnp.float8_e4m3fn),
                                 jnp.float32(1.0), "bfloat16", jnp.ones((16,), "bfloat16"))
    assert out.shape == (0, 16) and out.dtype == jnp.bfloat16


def test_fast_accumulation_stays_close():
    import jax.numpy as jnp

    from keras_fp8 import numerics

    a_q = numerics.quantize(jnp.asarray(rng_normal((512, 2048), 3)), jnp.float32(16.0), "e4m3")
    b_q = numerics.quantize(jnp.asarray(rng_normal((2048, 256), 4)), jnp.float32(16.0), "e4m3")
    scale = jnp.float32(1 / 256)
    got = np.asarray(jax_gemm.scaled_matmul(a_q, b_q, scale, "bfloat16", fast_accum=True), np.float64)
    want = np.asarray(numerics.scaled_matmul(a_q, b_q, scale, "bfloat16"), np.float64)
    assert_gemm_close(got, want, "bfloat16", fast=True)


def test_ragged_shapes_run_xla_and_agree(gemm_way):
    # K = 520 is no multiple of 16: XLA's dot runs it either way; the layer's
    # output is the same FP8 product.
    keras.mixed_precision.set_global_policy("fp8_hybrid[history_len=8]")
    keras.utils.set_random_seed(0)
    layer = keras_fp8.layers.FP8Dense(200)
    layer.build((None, 520))
    x = rng_normal((300, 520), 0)
    y = np.asarray(to_numpy(layer(x, training=True)), np.float32)
    assert np.all(np.isfinite(y))
    import jax.numpy as jnp

    assert not jax_gemm.supports(jnp.zeros((300, 520), jnp.float8_e4m3fn), jnp.zeros((520, 200), jnp.float8_e4m3fn),
                                 "bfloat16")


def test_gpu_matches_emulation_within_fp8_tolerance():
    keras.mixed_precision.set_global_policy("fp8_hybrid[history_len=8]")
    keras.utils.set_random_seed(0)
    layer = keras_fp8.layers.FP8Dense(96, use_bias=False)
    layer.build((None, 80))
    x = rng_normal((256, 80), 0)
    y_gpu = to_numpy(layer(x, training=False))
    with _without_fp8_gemms():
        y_emu = to_numpy(layer(x, training=False))
    error = np.linalg.norm(y_gpu - y_emu) / np.linalg.norm(y_emu)
    assert error < 1e-2, error


def test_tiny_products_stay_finite_and_exact():
    # A 4x16 -> 8 layer: its weight-gradient product (16x4 @ 4x8) is below
    # XLA's GEMM rewrite threshold, where XLA's loop emitter would multiply
    # the FP8 operands in FP8 (inf/NaN); the call runs the exact emulation.
    import jax.numpy as jnp

    keras.mixed_precision.set_global_policy("fp8_hybrid[history_len=8]")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras_fp8.layers.FP8Dense(8)])
    x = jnp.asarray(rng_normal((4, 16), 0, 2.0))
    upstream = rng_normal((4, 8), 1)
    _, ((_, _), grads) = _compiled_train_step_text(model, x, upstream)
    for variable, grad in zip(model.trainable_variables, grads[0]):
        assert np.all(np.isfinite(np.asarray(grad, np.float32))), variable.path


@pytest.mark.parametrize("mkn", [(512, 1024, 384), (300, 520, 200), (4096, 4096, 4096)])
@pytest.mark.parametrize("b_tiles", [False, True])
def test_block_scaled_matmul_on_the_gpu(mkn, b_tiles):
    # The GPU path of block scaling (the Pallas kernel, or the scan where it
    # does not compile) against the exact emulation, element by element.
    import jax.numpy as jnp

    from keras_fp8 import numerics
    from keras_fp8.backends import jax_block

    m, k, n = mkn
    a = jnp.asarray(rng_normal((m, k), 1, 3.0))
    b = jnp.asarray(rng_normal((k, n), 2, 0.1))
    a_q, a_s = numerics.quantize_tiles(a, "e4m3", 1)
    if b_tiles:
        b_q, b_s = numerics.quantize_tiles(b, "e5m2", 0)
    else:
        b_q, b_s = numerics.quantize_blocks(b, "e4m3")
    bias = jnp.asarray(rng_normal((n,), 3))
    want = np.asarray(numerics.block_matmul(a_q, a_s, b_q, b_s, "float32", bias, b_tiles), np.float64)
    got = np.asarray(jax_block.gpu_block_matmul(a_q, a_s, b_q, b_s, jnp.bfloat16, bias, b_tiles), np.float64)
    rms = np.sqrt(np.mean(want**2))
    assert np.all(np.abs(got - want) <= 2.0**-9 * rms + 2.0**-7 * np.abs(want))
    print("pallas failed for:", sorted(jax_block._PALLAS_FAILED))


def test_block_scaled_layer_trains_on_the_gpu():
    keras.utils.set_random_seed(0)
    policy = "fp8_e4m3[scaling=block,min_gemm_size=0]"
    model = keras.Sequential([keras.Input((512,)), keras_fp8.layers.FP8Dense(384, activation="relu", dtype=policy),
                              keras_fp8.layers.FP8Dense(16, dtype=policy)])
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng_normal((1024, 512), 0)
    y = np.arange(1024) % 16
    history = model.fit(x, y, batch_size=256, epochs=3, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][-1] < history.history["loss"][0]


# --------------------------------------------------------------------------- the fused quantize custom call
def _quantize_cases():
    cases = []
    for shape in [(256, 512), (64, 64), (100, 72), (33, 17), (1, 8), (2048, 1024)]:
        for mode in ["given", "delayed_empty", "delayed", "current"]:
            for fmt in ["e4m3", "e5m2"]:
                for dtype, magnitude in [("bfloat16", 2.0**-12), ("bfloat16", 1.0), ("bfloat16", 2.0**10),
                                         ("float16", 1.0), ("float32", 2.0**10)]:
                    cases.append((shape, mode, fmt, dtype, magnitude))
    return cases


def _reference_quantize(x, state_scale, history, fmt, mode):
    """numerics' amax, scale and bytes for the custom call's mode, computed
    by XLA on the CPU: XLA's GPU conversion of float32 to FP8 was seen to
    round one value in 131072 differently (a float32 x at magnitude 2**10;
    bf16 and f16 inputs agree), which the CPU's conversion, the cast
    torch_ops's reference and the kernels round once, does not."""
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        x, state_scale = np.asarray(x), np.asarray(state_scale)
        history = None if history is None else np.asarray(history)
        return tuple(np.asarray(t) for t in _reference_quantize_here(x, state_scale, history, fmt, mode))


def _reference_quantize_here(x, state_scale, history, fmt, mode):
    from keras_fp8 import numerics
    from keras_fp8 import recipes

    amax = numerics.compute_amax(x)
    if mode == "given":
        used = state_scale
    elif mode == "current":
        used = numerics.compute_scale(amax, state_scale, fmt)
    else:
        used, _, _ = numerics.delayed_scale_update(amax, history, state_scale, fmt, recipes.DelayedScaling(),
                                                   record=False)
    return amax, used, numerics.quantize(x, used, fmt)


def _assert_same_bits(got, want, name):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    if got.tobytes() != want.tobytes():
        differ = np.flatnonzero(got.view(np.uint8).ravel() != want.view(np.uint8).ravel())
        raise AssertionError(f"{name}: {differ.size} bytes differ, first at {differ[:5]}")


@pytest.mark.parametrize("shape,mode,fmt,dtype,magnitude", _quantize_cases())
def test_quantize_custom_call_matches_the_emulation(shape, mode, fmt, dtype, magnitude):
    # Fresh random x; the custom call's bytes (both layouts), amax and scale
    # against numerics', bit for bit.
    import jax.numpy as jnp

    assert jax_gemm.quantize_available(), jax_gemm._load_quantize()
    seed = shape[0] * 31 + shape[1]
    x = jnp.asarray(rng_normal(shape, seed, magnitude)).astype(dtype)
    history = jnp.zeros((8,), jnp.float32)
    if mode == "delayed":
        history = history.at[1].set(float(np.float32(magnitude)) * 3.0)
    state = jnp.float32(magnitude / 100.0)
    kernel_mode = "delayed" if mode.startswith("delayed") else mode
    q, q_t, amax, used = jax_gemm.quantize(x, state, fmt, kernel_mode, history)
    want_amax, want_used, want_q = _reference_quantize(x, state, history, fmt, kernel_mode)
    _assert_same_bits(amax, want_amax, "amax")
    _assert_same_bits(used, want_used, "scale_used")
    _assert_same_bits(q, want_q, "q")
    _assert_same_bits(q_t, np.transpose(want_q), "q_t")


def test_quantize_custom_call_keeps_non_finite_values_and_empty_arrays():
    import jax.numpy as jnp

    x = np.asarray(rng_normal((128, 192), 5), np.float32)
    x[3, 7], x[100, 0], x[64, 191] = np.inf, -np.inf, np.nan
    x = jnp.asarray(x).astype("bfloat16")
    for mode in ("given", "current"):
        q, q_t, amax, used = jax_gemm.quantize(x, jnp.float32(0.5), "e4m3", mode)
        want_amax, want_used, want_q = _reference_quantize(x, jnp.float32(0.5), None, "e4m3", mode)
        _assert_same_bits(q, want_q, f"q ({mode})")
        _assert_same_bits(q_t, np.transpose(want_q), f"q_t ({mode})")
        assert np.isnan(np.asarray(amax)) and np.asarray(used).tobytes() == np.asarray(want_used).tobytes()
    q, q_t, amax, used = jax_gemm.quantize(jnp.zeros((0, 64), "bfloat16"), jnp.float32(0.5), "e4m3", "current")
    assert q.shape == (0, 64) and q_t.shape == (64, 0)
    assert float(amax) == 0.0 and float(used) == 0.5


def _fused_reference(x, kernel, bias, states, grad, recipe):
    """The fused path's outputs by numerics: y, dx, dkernel (float64), the
    amaxes and the scales used."""
    import jax.numpy as jnp

    from keras_fp8 import numerics

    fmt, mode = recipe.forward_format, ("current" if recipe.name == "current" else "delayed")
    (x_amax, x_used, x_q), (k_amax, k_used, k_q) = (
        _reference_quantize(t, scale, history, fmt, mode) for t, (scale, history) in zip((x, kernel), states[:2]))
    y = numerics.scaled_matmul(x_q, k_q, x_used * k_used, x.dtype, bias)
    g_scale, g_history = states[2]
    g_amax, g_used, g_q = _reference_quantize(grad, g_scale, g_history, recipe.backward_format, mode)
    dx = numerics.scaled_matmul(g_q, jnp.transpose(k_q), g_used * k_used, x.dtype)
    dkernel = numerics.scaled_matmul(jnp.transpose(x_q), g_q, x_used * g_used, kernel.dtype)
    as64 = lambda t: np.asarray(t, np.float64)  # noqa: E731
    return as64(y), as64(dx), as64(dkernel), (x_amax, k_amax, g_amax), (x_used, k_used, g_used)


@pytest.mark.parametrize("recipe_name", ["delayed_empty", "delayed", "current"])
@pytest.mark.parametrize("mkn,use_bias", [((256, 512, 384), True), ((1024, 4096, 1024), False)])
def test_fused_path_matches_the_emulation(recipe_name, mkn, use_bias):
    # The FUSED route's custom_vjp (quantize + GEMM custom calls) against numerics:
    # amaxes and scales bit for bit, the products within the FP8 GEMM bound
    # (fast accumulation forward, full backward).
    import jax
    import jax.numpy as jnp

    from keras_fp8 import recipes
    from keras_fp8.backends import jax as jax_backend

    m, k, n = mkn
    recipe = recipes.CurrentScaling() if recipe_name == "current" else recipes.DelayedScaling()
    x = jnp.asarray(rng_normal((m, k), 11)).astype("bfloat16")
    kernel = jnp.asarray(rng_normal((k, n), 12, 0.05)).astype("bfloat16")
    bias = jnp.asarray(rng_normal((n,), 13)).astype("bfloat16") if use_bias else jnp.zeros((), "bfloat16")
    grad = jnp.asarray(rng_normal((m, n), 14, 2.0**-8)).astype("bfloat16")
    history = jnp.zeros((16,), jnp.float32)
    if recipe_name == "delayed":
        history = history.at[0].set(4.0)
    states = [(jnp.float32(0.01), history), (jnp.float32(2.0**-10), history), (jnp.float32(2.0**-14), history)]
    before = jax_gemm.enabled()
    jax_gemm.set_enabled(True)
    try:
        assert jax_backend.route(x, kernel, recipe) == jax_backend.FUSED

        def run(x, kernel, bias):
            # x is quantized before the product (fp8_matmul's _quantize_input).
            x_op = jax_backend._quantize(jax_backend.FUSED, jax.lax.stop_gradient(x), *states[0],
                                         recipe.forward_format, recipe)
            y, k_amax, k_used = jax_backend._per_tensor_product(
                x, x_op.q, x_op.q_t, x_op.scale, kernel, bias, jnp.zeros((3,), jnp.float32), *states[1], *states[2],
                jnp.float32(0.0), jax_backend.FUSED, recipe, use_bias, False)
            return y, x_op.amax, k_amax, x_op.scale, k_used

        outputs, vjp = jax.vjp(jax.jit(run), x, kernel, bias)
        dx, dkernel, _ = vjp((grad,) + tuple(jnp.zeros_like(o) for o in outputs[1:]))
    finally:
        jax_gemm.set_enabled(before)
    y_ref, dx_ref, dk_ref, amaxes, used = _fused_reference(x, kernel, bias if use_bias else None, states, grad,
                                                           recipe)
    y, x_amax, k_amax, x_used, k_used = outputs
    for name, got, want in [("x amax", x_amax, amaxes[0]), ("kernel amax", k_amax, amaxes[1]),
                            ("x scale", x_used, used[0]), ("kernel scale", k_used, used[1])]:
        _assert_same_bits(got, want, name)
    assert_gemm_close(np.asarray(y, np.float64), y_ref, "bfloat16", fast=True)
    assert_gemm_close(np.asarray(dx, np.float64), dx_ref, "bfloat16")
    assert_gemm_close(np.asarray(dkernel, np.float64), dk_ref, "bfloat16")


def test_fused_train_step_runs_the_custom_calls_and_records_like_xla():
    # One compiled train step of an FP8Dense: three quantize and three GEMM
    # custom calls, and the recorded state equal to XLA's path (the amaxes
    # are exact on both).
    def step(enabled):
        jax_gemm.set_enabled(enabled)
        keras.mixed_precision.set_global_policy("fp8_hybrid")
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((256,)), keras_fp8.layers.FP8Dense(512)])
        text, ((_, nt), _) = _compiled_train_step_text(model, rng_normal((1024, 256), 0).astype("float32"),
                                                      rng_normal((1024, 512), 1))
        names = [v.name for v in model.non_trainable_variables]
        return text, list(zip(names, (np.asarray(v) for v in nt)))

    before = jax_gemm.enabled()
    try:
        fused_text, fused_state = step(True)
        _, xla_state = step(False)
    finally:
        jax_gemm.set_enabled(before)
    assert fused_text.count(f'custom_call_target="{jax_gemm.QUANTIZE_TARGET}"') == 3
    assert fused_text.count(f'custom_call_target="{jax_gemm.TARGET}"') == 3
    assert [name for name, _ in fused_state] == [name for name, _ in xla_state]
    for (name, got), (_, want) in zip(fused_state, xla_state):
        if "amax_history" in name or name.endswith("_scale"):
            _assert_same_bits(got, want, name)


# --------------------------------------------------------------------------- compiled widenings
# XLA on a GPU folds a chain of float conversions into one (SimplifyFPConversions,
# under xla_allow_excess_precision): float32 -> float8 -> float32 inside one
# compiled function would skip the FP8 rounding. Eager JAX runs op by op and
# never folds, so every compiled path is checked against the reference or its
# eager run.


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4])
def test_compiled_quantize_then_widen_keeps_the_fp8_rounding(fmt, magnitude):
    import jax

    from keras_fp8 import numerics
    from tests.support import numpy_reference as reference

    x = rng_normal((300, 257), 0, magnitude)
    scale = np.float32(np.abs(x).max() / reference.FMT[fmt][1] * 4)  # some elements flush to zero
    got = jax.jit(lambda x: numerics.dequantize(numerics.quantize(x, scale, fmt), scale))(x)
    want = reference.quantize(x, scale, fmt).astype(np.float32) * scale
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.any(np.asarray(got) != x)


def test_compiled_quantization_statistics_match_eager():
    import jax

    from keras_fp8 import numerics

    x = rng_normal((512, 384), 1, 2.0)
    scale = np.float32(np.abs(x).max() / 448 * 2)
    eager = numerics.quantization_stats(x, scale, "e4m3")
    compiled = jax.jit(lambda x: numerics.quantization_stats(x, scale, "e4m3"))(x)
    for key in ("saturation", "underflow"):
        assert float(compiled[key]) == float(eager[key]), key
    assert float(eager["underflow"]) > 0
    assert abs(float(compiled["sqnr_db"]) - float(eager["sqnr_db"])) < 0.01
    assert float(eager["sqnr_db"]) < 40  # E4M3 rounding, not float32


@pytest.mark.parametrize("emulated", [False, True], ids=["small_dot", "emulation"])
def test_compiled_layer_matches_eager(emulated):
    # A product small enough to run the exact emulation (is_small_dot), and
    # the emulation a GPU without FP8 runs: both widen the quantized operands.
    import jax

    from keras_fp8.backends import jax as jax_backend

    keras.mixed_precision.set_global_policy("fp8_hybrid[history_len=8]")
    keras.utils.set_random_seed(0)
    units, k, m = (96, 80, 256) if emulated else (8, 16, 4)
    layer = keras_fp8.layers.FP8Dense(units)
    layer.build((None, k))
    x = rng_normal((m, k), 2)
    assert emulated or jax_backend.is_small_dot(m, k, units)
    with _without_fp8_gemms() if emulated else contextlib.nullcontext():
        eager = to_numpy(layer(x, training=False)).astype(np.float32)
        compiled = to_numpy(jax.jit(lambda x: layer(x, training=False))(x)).astype(np.float32)
    error = np.linalg.norm(compiled - eager) / np.linalg.norm(eager)
    assert error < 1e-3, error


def test_compiled_bias_gradient_is_rounded_to_the_output_dtype():
    import jax.numpy as jnp

    keras.mixed_precision.set_global_policy("fp8_hybrid[history_len=8]")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,)), keras_fp8.layers.FP8Dense(384)])
    x = jnp.asarray(rng_normal((512, 256), 3))
    upstream = rng_normal((512, 384), 4)
    _, ((_, _), grads) = _compiled_train_step_text(model, x, upstream)
    bias_grad = np.asarray(grads[0][1], np.float32)
    assert model.trainable_variables[1].path.endswith("bias")
    np.testing.assert_array_equal(bias_grad, bias_grad.astype(ml_dtypes.bfloat16).astype(np.float32))
