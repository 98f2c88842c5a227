"""The settings a user of ``torch_ops`` may tune: validated data.

Pass a ``Settings`` where a call takes one, or set the process's defaults
once with ``set_settings``. Three environment variables remain, all about
the compiled kernels rather than their behaviour (``torch_ops.extension`` reads
them; docs/torch_ops.md lists them):

- ``TORCH_OPS_DISABLE=1``: never build or use the kernels (the exact
  reference runs everywhere);
- ``TORCH_OPS_REQUIRE_KERNELS=1``: on a CUDA device, fail instead of
  falling back to the reference when the kernels cannot serve it (the GPU
  test command sets it, so that a broken build cannot pass as skipped tests);
- ``TORCH_OPS_BUILD_DIR``: where the build is cached.

Example:

>>> previous = torch_ops.set_settings(min_gemm_size=0)   # FP8 at every size
>>> torch_ops.get_settings().min_gemm_size
0
>>> torch_ops.set_settings(previous)
"""

from __future__ import annotations

import dataclasses

# Below this M*N*K the compiled path runs the GEMMs in the compute dtype:
# quantizing and launching cost more than FP8 saves at such sizes
# (benchmarks/linear.py's small shapes; docs/benchmarks.md).
DEFAULT_MIN_GEMM_SIZE = 8192 * 2048 * 2048


def check_min_gemm_size(value, name: str = "min_gemm_size"):
    """Returns ``value`` (None or an int >= 0); raises naming ``name`` otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name}: expected None or an integer >= 0, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Settings:
    """Tunable behaviour of the FP8 linear and its GEMMs.

    Args:
        min_gemm_size: ``M*N*K`` below which a linear runs exactly what the
            compute-dtype layer runs (its GEMMs in bf16/fp16/fp32, its FP8
            state untouched). None: ``DEFAULT_MIN_GEMM_SIZE`` where the
            compiled kernels serve the device, 0 where the reference runs
            (there it exists to reproduce FP8 numerics at every size).
        gemm_autotune: Time cuBLASLt's candidate algorithms (and variants of
            the best ones) on the first call of each GEMM shape and keep the
            fastest; False keeps cuBLASLt's first heuristic choice. Applies to
            shapes first seen after it is set.

    Example:

    >>> Settings(min_gemm_size=2**30, gemm_autotune=False)
    Settings(min_gemm_size=1073741824, gemm_autotune=False)
    """

    min_gemm_size: int | None = None
    gemm_autotune: bool = True

    def __post_init__(self):
        check_min_gemm_size(self.min_gemm_size)
        if not isinstance(self.gemm_autotune, bool):
            raise ValueError(f"gemm_autotune: expected a bool, got {self.gemm_autotune!r}")

    def resolved_min_gemm_size(self, kernels: bool) -> int:
        """``min_gemm_size`` with None resolved for a device the compiled
        kernels serve (``kernels``) or one where the reference runs."""
        if self.min_gemm_size is not None:
            return self.min_gemm_size
        return DEFAULT_MIN_GEMM_SIZE if kernels else 0


_current = Settings()


def get_settings() -> Settings:
    """The process's current ``Settings``."""
    return _current


def set_settings(settings: Settings | None = None, **changes) -> Settings:
    """Sets the process's ``Settings``; returns the previous ones.

    Args:
        settings: A ``Settings`` to use as a whole (default: the current ones).
        **changes: Fields to change on top of ``settings``.

    Returns:
        The settings in effect before the call (pass them back to restore).
    """
    global _current
    if settings is not None and not isinstance(settings, Settings):
        raise TypeError(f"settings: expected a torch_ops.Settings or None, got {type(settings).__name__}")
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Settings)})
    if unknown:
        raise ValueError(f"{unknown[0]}: not a torch_ops setting; expected one of "
                         f"{[f.name for f in dataclasses.fields(Settings)]}")
    previous = _current
    _current = dataclasses.replace(settings if settings is not None else previous, **changes)
    return previous
