"""The JAX custom calls' plumbing, on any machine: settings, the shapes they
take, what a failed build does, and the backend's `FUSED` route with the
calls stood in for by numerics. Their products are tested on an FP8 GPU
(tests/keras/test_jax_gpu.py); their build in tests/keras/test_jax_ffi_build.py."""

import pathlib
import warnings

import keras
import pytest

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX backend's custom call")


@pytest.fixture
def jax_ffi_build():
    from keras_fp8.backends import jax_ffi_build

    return jax_ffi_build


@pytest.fixture
def jax_gemm():
    from keras_fp8.backends import jax_gemm

    before = jax_gemm.enabled()
    yield jax_gemm
    jax_gemm.set_enabled(before)


def test_on_by_default_and_set_enabled_takes_a_bool(jax_gemm):
    assert jax_gemm.enabled()
    jax_gemm.set_enabled(False)
    assert not jax_gemm.enabled()
    jax_gemm.set_enabled(True)
    assert jax_gemm.enabled()
    with pytest.raises(TypeError, match=r"enabled: expected a bool, got 'no'"):
        jax_gemm.set_enabled("no")


def test_supports(jax_gemm):
    import jax.numpy as jnp

    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2

    def sup(a_shape, b_shape, a=e4, b=e4, out="bfloat16"):
        return jax_gemm.supports(jnp.zeros(a_shape, a), jnp.zeros(b_shape, b), out)

    assert sup((300, 64), (64, 200))
    assert sup((1, 16), (16, 8), e5, e4, "float32")
    assert sup((8, 32), (32, 16), e4, e5, "float16")
    assert not sup((8, 520), (520, 16))  # K not a multiple of 16
    assert not sup((8, 0), (0, 16))  # no K
    assert not sup((8, 32), (32, 12))  # N not a multiple of 8
    assert not sup((8, 32), (32, 16), e5, e5)  # cuBLASLt has no E5M2 x E5M2
    assert not sup((8, 32), (32, 16), out="int8")
    assert not jax_gemm.supports(jnp.zeros((8, 32), "bfloat16"), jnp.zeros((32, 16), e4), "bfloat16")
    assert not jax_gemm.supports(jnp.zeros((2, 8, 32), e4), jnp.zeros((32, 16), e4), "bfloat16")


def test_a_failed_build_warns_once_and_keeps_xla(jax_gemm, jax_ffi_build, monkeypatch):
    def no_build(build_dir=None):
        raise FileNotFoundError("a C++ compiler (g++ or $CXX): not found")

    monkeypatch.setattr(jax_ffi_build, "build_gemm", no_build)
    monkeypatch.setattr(jax_gemm.available, "_warned", False, raising=False)
    jax_gemm._load.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not jax_gemm.available()
            assert not jax_gemm.available()
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1, messages
        assert "custom call is not available (FileNotFoundError: a C++ compiler" in messages[0]
        assert "XLA's FP8 dot instead" in messages[0]
    finally:
        jax_gemm._load.cache_clear()


def test_the_backend_uses_it_only_on_an_fp8_gpu(jax_gemm, monkeypatch):
    # Off an FP8 GPU the products are the emulation's: the custom calls are
    # never built, nor warned about.
    import jax.numpy as jnp

    from keras_fp8 import recipes
    from keras_fp8.backends import jax as jax_backend

    if jax_backend.fp8_gemm_supported():
        pytest.skip("an FP8 GPU: tests/keras/test_jax_gpu.py covers the custom call")

    def fail():
        raise AssertionError("available() called off an FP8 GPU")

    monkeypatch.setattr(jax_gemm, "available", fail)
    monkeypatch.setattr(jax_gemm, "quantize_available", fail)
    jax_backend.prepare_device(None)
    for recipe in (recipes.DelayedScaling(), recipes.BlockScaling()):
        assert jax_backend.route(jnp.ones((256, 512)), jnp.ones((512, 384)), recipe) == jax_backend.EMULATION


def test_scaled_matmul_says_why_it_cannot_run(jax_gemm, jax_ffi_build, monkeypatch):
    import jax.numpy as jnp

    def no_build(build_dir=None):
        raise FileNotFoundError("CUDA runtime and cuBLASLt headers and libraries: not found under []")

    monkeypatch.setattr(jax_ffi_build, "build_gemm", no_build)
    jax_gemm._load.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"custom call is not available \(FileNotFoundError: CUDA runtime"):
            jax_gemm.scaled_matmul(jnp.zeros((8, 16), jnp.float8_e4m3fn), jnp.zeros((16, 8), jnp.float8_e4m3fn),
                                   jnp.float32(1.0), "bfloat16")
    finally:
        jax_gemm._load.cache_clear()


@pytest.mark.parametrize("a_shape,b_shape,a_dtype,b_dtype,out_dtype,bias_shape,match", [
    ((8, 32), (32, 16), "bfloat16", "float8_e4m3fn", "bfloat16", None,
     r"a_q: expected float8_e4m3fn or float8_e5m2, got bfloat16"),
    ((8, 32), (32, 16), "float8_e4m3fn", "float32", "bfloat16", None,
     r"b_q: expected float8_e4m3fn or float8_e5m2, got float32"),
    ((8, 32), (32, 16), "float8_e5m2", "float8_e5m2", "bfloat16", None, r"a_q, b_q: expected at most one float8_e5m2"),
    ((2, 8, 32), (32, 16), "float8_e4m3fn", "float8_e4m3fn", "bfloat16", None, r"a_q, b_q: expected 2-D"),
    ((8, 32), (48, 16), "float8_e4m3fn", "float8_e4m3fn", "bfloat16", None, r"a_q, b_q: expected the same K"),
    ((8, 24), (24, 16), "float8_e4m3fn", "float8_e4m3fn", "bfloat16", None,
     r"a_q, b_q: expected K a positive multiple of 16 and N of 8, got K 24, N 16"),
    ((8, 32), (32, 12), "float8_e4m3fn", "float8_e4m3fn", "bfloat16", None, r"got K 32, N 12"),
    ((8, 32), (32, 16), "float8_e4m3fn", "float8_e4m3fn", "int8", None,
     r"out_dtype: expected bfloat16, float16 or float32, got 'int8'"),
    ((8, 32), (32, 16), "float8_e4m3fn", "float8_e4m3fn", "no-dtype", None, r"out_dtype: expected bfloat16"),
    ((8, 32), (32, 16), "float8_e4m3fn", "float8_e4m3fn", "bfloat16", (8,), r"bias: expected shape \(16,\), got \(8,\)"),
])
def test_scaled_matmul_names_the_bad_argument(jax_gemm, a_shape, b_shape, a_dtype, b_dtype, out_dtype, bias_shape,
                                              match):
    # Checked before anything is built: the same error on any machine.
    import jax.numpy as jnp

    bias = None if bias_shape is None else jnp.zeros(bias_shape, "bfloat16")
    with pytest.raises(ValueError, match=match):
        jax_gemm.scaled_matmul(jnp.zeros(a_shape, a_dtype), jnp.zeros(b_shape, b_dtype), jnp.float32(1.0), out_dtype,
                               bias)
    assert not jax_gemm.supports(jnp.zeros(a_shape, a_dtype), jnp.zeros(b_shape, b_dtype), out_dtype) or bias_shape


@pytest.mark.parametrize("b_t_shape, match", [
    ((16, 32, 1), r"b_t: expected a 2-D \(N, K\) array"),
    ((16, 48), r"b_t"),  # K of b_t (48) is not a_q's (32)
])
def test_scaled_matmul_nt_names_the_bad_argument(jax_gemm, b_t_shape, match):
    import jax.numpy as jnp

    with pytest.raises(ValueError, match=match):
        jax_gemm.scaled_matmul_nt(jnp.zeros((8, 32), "float8_e4m3fn"), jnp.zeros(b_t_shape, "float8_e4m3fn"),
                                  jnp.float32(1.0), "bfloat16")


# --------------------------------------------------------------------------- the fused quantize custom call
@pytest.mark.parametrize("shape,dtype,fmt,mode,history_shape,match", [
    ((2, 8, 32), "bfloat16", "e4m3", "given", None, r"x: expected a 2-D array"),
    ((8, 32), "int8", "e4m3", "given", None, r"x: expected bfloat16, float16 or float32, got int8"),
    ((8, 32), "bfloat16", "e4m4", "given", None, r"fmt: expected one of \['e4m3', 'e5m2'\], got 'e4m4'"),
    ((8, 32), "bfloat16", "e4m3", "dynamic", None, r"scale_mode: expected one of"),
    ((8, 32), "bfloat16", "e4m3", "delayed", None, r"history: expected a non-empty 1-D amax history"),
    ((8, 32), "bfloat16", "e4m3", "delayed", (0,), r"history: expected a non-empty 1-D amax history"),
])
def test_quantize_names_the_bad_argument(jax_gemm, shape, dtype, fmt, mode, history_shape, match):
    import jax.numpy as jnp

    history = None if history_shape is None else jnp.zeros(history_shape, "float32")
    with pytest.raises(ValueError, match=match):
        jax_gemm.quantize(jnp.ones(shape, dtype), jnp.float32(1.0), fmt, mode, history)


def test_quantize_says_why_it_cannot_run(jax_gemm, jax_ffi_build, monkeypatch):
    import jax.numpy as jnp

    def no_build(build_dir=None, arch=None):
        raise FileNotFoundError("nvcc with the CUDA runtime headers: not found under []")

    monkeypatch.setattr(jax_ffi_build, "build_quantize", no_build)
    monkeypatch.setattr(jax_gemm.quantize_available, "_warned", False, raising=False)
    jax_gemm._load_quantize.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"quantize custom call is not available \(FileNotFoundError: nvcc"):
            jax_gemm.quantize(jnp.ones((8, 32), "bfloat16"), jnp.float32(1.0), "e4m3", "current")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not jax_gemm.quantize_available()
            assert not jax_gemm.quantize_available()
        assert len(caught) == 1 and "XLA's fusions instead" in str(caught[0].message)
    finally:
        jax_gemm._load_quantize.cache_clear()


def test_the_fused_path_stays_off_off_an_fp8_gpu(jax_gemm):
    import jax.numpy as jnp

    from keras_fp8 import recipes
    from keras_fp8.backends import jax as jax_backend

    if jax_backend.fp8_gemm_supported():
        pytest.skip("an FP8 GPU: tests/keras/test_jax_gpu.py covers the fused path")
    jax_gemm.set_enabled(True)
    assert not jax_backend._custom_calls_apply(jnp.ones((64, 64)), jnp.ones((64, 64)), recipes.DelayedScaling())


def test_the_fused_path_computes_what_the_emulation_computes(jax_gemm, monkeypatch):
    # The FUSED route's plumbing on any machine: with the two custom calls
    # stood in for by numerics (their GPU tests hold them to it), one
    # compiled train step of a model gives the EMULATION route's output,
    # gradients and recorded state, bit for bit.
    import jax
    import jax.numpy as jnp
    import numpy as np

    import keras_fp8
    from keras_fp8 import numerics
    from keras_fp8 import recipes
    from keras_fp8.backends import jax as jax_backend

    if jax_backend.fp8_gemm_supported():
        pytest.skip("an FP8 GPU runs the layers below the FP8 threshold in the compute dtype; "
                    "tests/keras/test_jax_gpu.py covers the fused path")
    calls = []

    def quantize(x, scale, fmt, scale_mode="given", history=None, margin=0.0):
        calls.append(scale_mode)
        amax = numerics.compute_amax(x)
        if scale_mode == "current":
            used = numerics.compute_scale(amax, scale, fmt, margin)
        elif scale_mode == "delayed":
            used, _, _ = numerics.delayed_scale_update(amax, history, scale, fmt, recipes.DelayedScaling(margin=margin),
                                                       record=False)
        else:
            used = scale
        q = numerics.quantize(x, used, fmt)
        return q, jnp.transpose(q), amax, used

    def matmul_nt(a_q, b_t, scale, out_dtype, bias=None, fast_accum=True):
        return numerics.scaled_matmul(a_q, jnp.transpose(b_t), scale, out_dtype, bias)

    def train_step(fused):
        chosen = jax_backend.FUSED if fused else jax_backend.EMULATION
        monkeypatch.setattr(jax_backend, "route", lambda x, kernel, recipe, kernel_layout=None: chosen)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras_fp8.layers.FP8Dense(48, use_bias=True),
                                  keras_fp8.layers.FP8Dense(32, use_bias=False)])
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        x = jnp.asarray(np.random.default_rng(1).normal(size=(96, 64)), "float32")

        def loss(trainable, non_trainable):
            outs = []
            for _ in range(2):  # two calls: the second one with a recorded history
                y, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
                outs.append(jnp.sum(jnp.square(y.astype("float32"))))
            return outs[0] + outs[1], non_trainable

        (value, state), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable, non_trainable)
        return [np.asarray(t) for t in [value, *state, *grads]]

    monkeypatch.setattr(jax_gemm, "quantize", quantize)
    monkeypatch.setattr(jax_gemm, "scaled_matmul_nt", matmul_nt)
    for policy in ("fp8_hybrid", "fp8_hybrid[scaling=current]"):
        keras.mixed_precision.set_global_policy(policy)
        try:
            calls.clear()
            fused = train_step(True)
            assert len(calls) == 12  # traced once: two calls of two layers, three operands each
            emulated = train_step(False)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        for got, want in zip(fused, emulated):
            assert got.tobytes() == want.tobytes()
