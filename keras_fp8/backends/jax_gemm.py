"""The JAX backend's custom calls, on by default: the FP8 GEMM
(`csrc/jax_ffi.cpp`) and the fused FP8 quantize (`csrc/jax_quantize.cu`),
the kernels torch_ops runs, as XLA FFI targets.

XLA's own FP8 `dot_general` writes its product in the output dtype and
multiplies by the scale in a second pass: two roundings and one more read
and write of every output. The GEMM custom call runs the cuBLASLt GEMM that
torch_ops runs (`csrc/lt_gemm.h`): the two scales and the bias in the
epilogue, one rounding, no second pass, and the torch backend's algorithm
choice. The quantize custom call runs torch_ops's fused quantize kernels
(`csrc/quantize_kernels.cuh`): one read of the input writes the FP8 array,
its transpose, the amax and the scale used, where XLA needs separate
fusions for the quantize, each transpose and the amax. docs/design.md,
"Execution paths", says when a layer runs them (`set_enabled(False)` keeps
XLA's way).

Each library is built on first use (`keras_fp8.backends.jax_ffi_build`,
cached under `~/.cache/keras_fp8/jax_ffi/`), registered with XLA and checked
once against the exact emulation. Where any of that fails, a one-time
warning names why and the backend keeps XLA's FP8 dot (`available()` is
False) or XLA's quantize (`quantize_available()`).

Example:

```python
from keras_fp8.backends import jax_gemm

jax_gemm.set_enabled(False)   # XLA's fusions and FP8 dot, for functions traced from now on
```
"""

import ctypes
import functools
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from keras_fp8.backends import jax_ffi_build

TARGET = "keras_fp8_scaled_gemm"
QUANTIZE_TARGET = "keras_fp8_quantize"
# The quantize kernels' scale modes (csrc/quantize_kernels.cuh).
SCALE_MODES = {"given": 0, "delayed": 1, "current": 2}
# fp8lt::kWorkspaceBytes (csrc/lt_gemm.h): the workspace XLA allocates for
# each call (a buffer of its own, reused across calls).
WORKSPACE_BYTES = 32 << 20
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))

_lock = threading.Lock()
_enabled = True


def set_enabled(enabled):
    """Whether FP8 layers on the GPU run the custom calls (the quantize
    and the GEMM; the default) or XLA's fusions and FP8 `dot_general`,
    for functions traced from now on (a compiled step keeps the way it was
    traced with).

    Args:
        enabled: bool.
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {enabled!r}")
    _enabled = enabled


def enabled():
    """Whether the custom calls are on (`set_enabled`)."""
    return _enabled


def _register(path):
    library = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.KerasFp8ScaledGemm), platform="CUDA")
    return library


def _self_test():
    """The custom call on a small product with a bias against the exact
    emulation (float32 accumulation, one rounding)."""
    from keras_fp8 import numerics

    rng = np.random.default_rng(0)
    # Evaluated now even when the first FP8 product is being traced.
    with jax.ensure_compile_time_eval():
        a = jnp.asarray(rng.normal(size=(64, 48)), jnp.float8_e4m3fn)
        b = jnp.asarray(rng.normal(size=(48, 40)), jnp.float8_e4m3fn)
        bias = jnp.asarray(rng.normal(size=(40,)), jnp.bfloat16)
        scale = jnp.float32(0.375)
        run = jax.jit(functools.partial(_call, out_dtype=jnp.bfloat16, fast_accum=False))
        got = np.asarray(run(a, b, scale, bias=bias), np.float32)
        want = np.asarray(numerics.scaled_matmul(a, b, scale, jnp.bfloat16, bias), np.float32)
    # The FP8 GEMM bound of the test suites: 2**-9 of the product's root
    # mean square (the tensor cores' partial sums) and one bf16 rounding.
    rms = float(np.sqrt(np.mean(np.square(want))))
    excess = np.abs(got - want) - (2.0**-9 * rms + 2.0**-7 * np.abs(want))
    if np.any(excess > 0):
        raise RuntimeError(f"the custom call's product differs from the emulation by up to "
                           f"{float(np.max(np.abs(got - want))):.3g}")


@functools.lru_cache(maxsize=None)
def _load():
    """Builds, registers and checks the library once; returns None or the
    reason it is not used."""
    try:
        with _lock:
            _register(jax_ffi_build.build_gemm())
        _self_test()
    except Exception as e:  # any failure leaves XLA's FP8 dot in place
        return f"{type(e).__name__}: {e}"
    return None


def available():
    """True when the custom call is built, registered and checked (the
    first call does that; a failure warns once and returns False)."""
    return _usable(available, _load(), "GEMM",
                   "FP8 layers quantize with XLA's fusions and multiply with XLA's FP8 dot instead")


def _usable(owner, problem, what, instead):
    """True where `problem` (a loader's result) is None; otherwise warns
    once per `owner` that the `what` custom call is not available and what
    runs `instead`, and returns False."""
    if problem is None:
        return True
    if not getattr(owner, "_warned", False):
        owner._warned = True
        warnings.warn(f"keras_fp8: the JAX FP8 {what} custom call is not available ({problem.splitlines()[0]}); "
                      f"{instead}.", stacklevel=3)
    return False


def _operand_problem(a_q, b_q, out_dtype, bias=None):
    """Why `scaled_matmul` does not take these operands, as
    `(argument, message)`, or None when it does."""
    if a_q.ndim != 2 or b_q.ndim != 2:
        return "a_q, b_q", f"expected 2-D (M, K) and (K, N), got shapes {a_q.shape} and {b_q.shape}"
    for name, t in (("a_q", a_q), ("b_q", b_q)):
        if jnp.dtype(t.dtype) not in _FP8_DTYPES:
            return name, f"expected float8_e4m3fn or float8_e5m2, got {jnp.dtype(t.dtype).name}"
    if jnp.dtype(a_q.dtype) == jnp.dtype(b_q.dtype) == jnp.dtype(jnp.float8_e5m2):
        return "a_q, b_q", "expected at most one float8_e5m2 operand (cuBLASLt has no E5M2 x E5M2), got two"
    (m, k), (k_b, n) = a_q.shape, b_q.shape
    if not all(isinstance(v, int) for v in (m, k, k_b, n)):
        return "a_q, b_q", f"expected static shapes, got {a_q.shape} and {b_q.shape}"
    if k != k_b:
        return "a_q, b_q", f"expected the same K, got shapes {a_q.shape} and {b_q.shape}"
    if k <= 0 or k % 16 or n <= 0 or n % 8:
        return "a_q, b_q", f"expected K a positive multiple of 16 and N of 8, got K {k}, N {n}"
    try:
        out = jnp.dtype(out_dtype)
    except TypeError:
        out = None
    if out not in _OUT_DTYPES:
        return "out_dtype", f"expected bfloat16, float16 or float32, got {out_dtype!r}"
    if bias is not None and tuple(bias.shape) != (n,):
        return "bias", f"expected shape ({n},), got {tuple(bias.shape)}"
    return None


def supports(a_q, b_q, out_dtype):
    """Whether `scaled_matmul` takes these operands: 2-D FP8 `(M, K)` and
    `(K, N)`, not both E5M2, K a positive multiple of 16, N of 8, a 16- or
    32-bit float output."""
    return _operand_problem(a_q, b_q, out_dtype) is None


def scaled_matmul(a_q, b_q, scale, out_dtype, bias=None, fast_accum=True, autotune=True):
    """`(a_q @ b_q) * scale (+ bias)` by the cuBLASLt custom call: float32
    accumulation (`fast_accum`: cuBLASLt's fast FP8 mode), the scale and
    the bias in the epilogue, one rounding to `out_dtype`.

    Args:
        a_q: `(M, K)` FP8 array.
        b_q: `(K, N)` FP8 array (`supports` says which shapes).
        scale: float32 scalar, the product of the two operands' scales.
        out_dtype: bfloat16, float16 or float32.
        bias: Optional `(N,)` bias.
        fast_accum: bool.
        autotune: Time cuBLASLt's candidates on a shape's first call and
            keep the fastest (torch_ops's `gemm_autotune`).

    Returns:
        The `(M, N)` product in `out_dtype`.

    Raises:
        ValueError: operands it does not take (`supports`), naming the
            argument.
        RuntimeError: where the custom call is not available (`available`).
    """
    _check_call(_operand_problem(a_q, b_q, out_dtype, bias), _load, "GEMM")
    return _call(a_q, b_q, scale, out_dtype, bias, fast_accum, autotune)


def _check_call(bad, load, what):
    """Raises for `bad` (an `(argument, message)` or None), then where
    `load` (`_load`, `_load_quantize`) says the `what` custom call cannot
    be loaded."""
    if bad is not None:
        raise ValueError(f"{bad[0]}: {bad[1]}")
    problem = load()
    if problem is not None:
        raise RuntimeError(f"keras_fp8: the JAX FP8 {what} custom call is not available ({problem})")


def _call(a_q, b_q, scale, out_dtype, bias, fast_accum, autotune=True):
    """`scaled_matmul` once the target is registered."""
    return _call_nt(a_q, jnp.transpose(b_q), scale, out_dtype, bias, fast_accum, autotune)


def scaled_matmul_nt(a_q, b_t, scale, out_dtype, bias=None, fast_accum=True, autotune=True):
    """`scaled_matmul` with the second operand given transposed, `(N, K)`,
    as the GEMM reads it (no transpose in the program: the fused quantize
    writes both layouts).

    Raises:
        ValueError, RuntimeError: as `scaled_matmul`.
    """
    if b_t.ndim != 2:
        raise ValueError(f"b_t: expected a 2-D (N, K) array, got shape {b_t.shape}")
    bad = _operand_problem(a_q, jax.ShapeDtypeStruct(b_t.shape[::-1], b_t.dtype), out_dtype, bias)
    _check_call(None if bad is None else (bad[0].replace("b_q", "b_t"), bad[1]), _load, "GEMM")
    return _call_nt(a_q, b_t, scale, out_dtype, bias, fast_accum, autotune)


def _call_nt(a_q, b_t, scale, out_dtype, bias, fast_accum, autotune=True):
    out_dtype = jnp.dtype(out_dtype)
    m, n = a_q.shape[0], b_t.shape[0]
    # The epilogue adds a bias in the 16-bit output type; a float32 output
    # gets it added after (exact: the same float32 sum).
    fused_bias = bias is not None and out_dtype.itemsize == 2
    bias_operand = bias.astype(out_dtype) if fused_bias else jnp.zeros((1,), out_dtype)
    out, _ = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct((m, n), out_dtype), jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)),
        vmap_method="sequential",
    )(a_q, b_t, jnp.asarray(scale, jnp.float32).reshape(()), jnp.ones((), jnp.float32),
      bias_operand, fast_accum=np.int32(fast_accum), autotune=np.int32(autotune), has_bias=np.int32(fused_bias))
    if bias is not None and not fused_bias:
        out = (out + bias.astype(jnp.float32)).astype(out_dtype)
    return out


# --------------------------------------------------------------------------- the fused quantize
_IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _register_quantize(path):
    library = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(QUANTIZE_TARGET, jax.ffi.pycapsule(library.KerasFp8Quantize), platform="CUDA")
    return library


def _self_test_quantize():
    """The quantize custom call against the exact emulation on a ragged
    array: the same bytes, amax and scale, for a delayed first call (the
    scale seeded from the amax) and a given scale."""
    from keras_fp8 import numerics
    from keras_fp8 import recipes

    rng = np.random.default_rng(0)
    with jax.ensure_compile_time_eval():
        x = jnp.asarray(rng.normal(size=(96, 80)) * 7.0, jnp.bfloat16)
        history = jnp.zeros((4,), jnp.float32)
        state = jnp.float32(1.0)
        run = jax.jit(_quantize_call, static_argnums=(2, 3, 5))
        q, q_t, amax, used = run(x, state, "e4m3", "delayed", history, 0.0)
        want_used, _, _ = numerics.delayed_scale_update(numerics.compute_amax(x), history, state, "e4m3",
                                                         recipes.DelayedScaling(), record=False)
        checks = [("amax", amax, numerics.compute_amax(x)), ("scale_used", used, want_used),
                  ("q", q, numerics.quantize(x, want_used, "e4m3")),
                  ("q_t", q_t, jnp.transpose(numerics.quantize(x, want_used, "e4m3")))]
        q, _, _, _ = run(x, jnp.float32(0.25), "e5m2", "given", history, 0.0)
        checks.append(("q (given scale)", q, numerics.quantize(x, jnp.float32(0.25), "e5m2")))
        for name, got, want in checks:
            got, want = np.asarray(got), np.asarray(want)
            if got.tobytes() != want.tobytes():
                raise RuntimeError(f"the quantize custom call's {name} differs from the emulation")


@functools.lru_cache(maxsize=None)
def _load_quantize():
    """Builds, registers and checks the quantize library once; returns None
    or the reason it is not used."""
    try:
        with _lock:
            _register_quantize(jax_ffi_build.build_quantize())
        _self_test_quantize()
    except Exception as e:  # any failure leaves XLA's quantize in place
        return f"{type(e).__name__}: {e}"
    return None


def quantize_available():
    """True when the quantize custom call is built, registered and checked
    (the first call does that; a failure warns once and returns False)."""
    return _usable(quantize_available, _load_quantize(), "quantize",
                   "FP8 layers multiply with XLA's FP8 dot and quantize with XLA's fusions instead")


def _quantize_problem(x, fmt, scale_mode, history):
    """Why `quantize` does not take these arguments, as `(argument,
    message)`, or None when it does."""
    from keras_fp8 import recipes

    if x.ndim != 2 or not all(isinstance(v, int) for v in x.shape):
        return "x", f"expected a 2-D array of static shape, got shape {x.shape}"
    if jnp.dtype(x.dtype) not in _IN_DTYPES:
        return "x", f"expected bfloat16, float16 or float32, got {jnp.dtype(x.dtype).name}"
    if fmt not in recipes.FORMAT_DTYPE:
        return "fmt", f"expected one of {sorted(recipes.FORMAT_DTYPE)}, got {fmt!r}"
    if scale_mode not in SCALE_MODES:
        return "scale_mode", f"expected one of {sorted(SCALE_MODES)}, got {scale_mode!r}"
    if scale_mode == "delayed" and (history is None or history.ndim != 1 or history.shape[0] < 1):
        shape = None if history is None else history.shape
        return "history", f"expected a non-empty 1-D amax history for delayed scaling, got {shape}"
    return None


def quantize(x, scale, fmt, scale_mode="given", history=None, margin=0.0):
    """Quantizes a 2-D array to FP8 in one pass by the custom call: the
    bytes of `numerics.quantize` with the scale `scale_mode` picks, in
    both layouts, with the amax.

    Args:
        x: `(R, C)` bfloat16, float16 or float32 array.
        scale: float32 scalar: the scale (`"given"`), the state's scale
            (`"delayed"`) or the fallback where the amax is not usable
            (`"current"`).
        fmt: `"e4m3"` or `"e5m2"`.
        scale_mode: `"given"`, `"delayed"` (`scale` unless `history` is
            empty, then seeded from this amax: `numerics.delayed_scale_update`)
            or `"current"` (`numerics.compute_scale(amax, scale)`).
        history: The `(H,)` amax history (`"delayed"` only; not updated).
        margin: The recipe's scale margin.

    Returns:
        `(q, q_t, amax, scale_used)`: `q` `(R, C)` and `q_t` `(C, R)` in
        the format's dtype, the float32 amax of `x` and the scale used.

    Raises:
        ValueError: arguments it does not take, naming the argument.
        RuntimeError: where the custom call is not available.

    Example:

    ```python
    q, q_t, amax, scale = jax_gemm.quantize(x, state_scale, "e4m3", "delayed", history)
    ```
    """
    _check_call(_quantize_problem(x, fmt, scale_mode, history), _load_quantize, "quantize")
    return _quantize_call(x, scale, fmt, scale_mode, history, margin)


def _quantize_call(x, scale, fmt, scale_mode, history, margin):
    from keras_fp8 import recipes

    r, c = x.shape
    dtype = jnp.dtype(recipes.FORMAT_DTYPE[fmt])
    if history is None:
        history = jnp.zeros((1,), jnp.float32)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    return jax.ffi.ffi_call(
        QUANTIZE_TARGET,
        (jax.ShapeDtypeStruct((r, c), dtype), jax.ShapeDtypeStruct((c, r), dtype), scalar, scalar),
        vmap_method="sequential",
    )(x, jnp.asarray(scale, jnp.float32).reshape(()), jnp.asarray(history, jnp.float32),
      scale_mode=np.int32(SCALE_MODES[scale_mode]), mdiv=np.float32(2.0 ** float(margin)))
