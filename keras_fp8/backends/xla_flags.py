"""XLA settings keras-fp8 applies for FP8 programs under the JAX backend.

With XLA's default flags, XLA's GEMM autotuner tries Triton configurations
for every product with FP8 operands, which makes a model's FP8 train step
take minutes to compile; cuBLASLt runs those products with no such search. XLA reads `XLA_FLAGS` once, when JAX starts its
backend, which `import keras` does not do. So `import keras_fp8` adds
`--xla_gpu_enable_triton_gemm=false` to `XLA_FLAGS` when all of these hold:

- the Keras backend is JAX;
- JAX has not started its backend yet (otherwise the flag could not take
  effect: a one-time warning says so on a GPU);
- `XLA_FLAGS` does not already set `xla_gpu_enable_triton_gemm`: the
  user's choice wins, so `XLA_FLAGS=--xla_gpu_enable_triton_gemm=true` keeps
  XLA's default.

Non-FP8 products then run through cuBLAS instead of Triton, which does not
slow the bf16 parts of a model (docs/guide.md, "Limitations").
"""

import os
import sys
import warnings

TRITON_GEMM_FLAG = "--xla_gpu_enable_triton_gemm=false"

_warned = []


def _jax_backend_started():
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # a JAX without this module: assume started
        return True
    return bool(getattr(xla_bridge, "_backends", {1: None}))


def _on_gpu():
    import jax

    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


def configure(backend):
    """Adds the FP8-friendly XLA flags for the JAX backend when they can act.

    Args:
        backend: The Keras backend name (`keras.backend.backend()`).

    Returns:
        True when `XLA_FLAGS` was changed.
    """
    if backend != "jax":
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_triton_gemm" in flags:
        return False
    if _jax_backend_started():
        if not _warned and _on_gpu():
            _warned.append(True)
            warnings.warn(
                "keras_fp8: JAX started before keras_fp8 was imported, so "
                f"XLA_FLAGS cannot get {TRITON_GEMM_FLAG}. Without it XLA "
                "may autotune FP8 products for minutes. Import keras_fp8 "
                "before running any JAX computation, or set "
                f"XLA_FLAGS={TRITON_GEMM_FLAG} before Python starts.",
                stacklevel=3,
            )
        return False
    os.environ["XLA_FLAGS"] = (flags + " " + TRITON_GEMM_FLAG).strip()
    return True
