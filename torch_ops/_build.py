"""Finding, building and loading the compiled extension (csrc/).

Nothing here compiles at import time. ``load()`` builds on first use with
``torch.utils.cpp_extension.load`` (ninja, cached); a machine without CUDA, an
FP8 GPU or nvcc gets a one-line reason instead and never starts a compiler.
"""

from __future__ import annotations

import os
import pathlib
import threading

import torch

_NAME = "keras_fp8_torch_ops"
_HERE = pathlib.Path(__file__).resolve().parent
# An installed wheel ships the sources as torch_ops/csrc (pyproject.toml); a
# source checkout has them at the top level.
_CSRC = _HERE / "csrc" if (_HERE / "csrc").is_dir() else _HERE.parent / "csrc"
_SOURCES = ("bindings.cpp", "gemm.cpp", "quantize.cu", "fold.cu", "linear.cpp", "gemm_amax.cu")

_lock = threading.Lock()
_module = None
_error: str | None = None


def build_directory() -> pathlib.Path:
    """TORCH_EXTENSIONS_DIR if set, else ~/.cache/keras_fp8/torch_ops/<torch>-<cuda>."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    tag = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda or 'none'}"
    if root:
        return pathlib.Path(root) / _NAME / tag
    return pathlib.Path.home() / ".cache" / "keras_fp8" / "torch_ops" / tag


def prerequisite_problem() -> str | None:
    """Why the kernels cannot be used here, without compiling anything (or None)."""
    if os.environ.get("TORCH_OPS_DISABLE", "") not in ("", "0"):
        return "torch_ops kernels disabled by TORCH_OPS_DISABLE"
    if torch.version.cuda is None:
        return f"this PyTorch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name()
        return f"{name} is sm_{major}{minor}; FP8 kernels need sm_89 or newer"
    if not all((_CSRC / s).is_file() for s in _SOURCES):
        return f"CUDA sources not found under {_CSRC}"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "nvcc not found (set CUDA_HOME) to build the torch_ops kernels"
    return None


def load(verbose: bool = False):
    """Build (first time) and import the extension; raises RuntimeError with the reason."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise RuntimeError(_error)
        problem = prerequisite_problem()
        if problem is not None:
            _error = problem
            raise RuntimeError(problem)
        from torch.utils import cpp_extension

        build_dir = build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("MAX_JOBS", str(min(16, os.cpu_count() or 4)))
        # No -std flag: torch's own (C++20 for torch >= 2.10), the standard
        # its headers are written for. (Forcing -std=c++17 was not what
        # crashed argument errors on the H200: integers streamed into
        # TORCH_CHECK messages were, csrc/common.h.)
        cuda_flags = [
            "-O3",
            "--expt-relaxed-constexpr",
            # sm_90a for Hopper, sm_89 for Ada; no --use_fast_math: the
            # quantize division must be IEEE to match the emulation bit for bit.
            "-gencode=arch=compute_90a,code=sm_90a",
            "-gencode=arch=compute_89,code=sm_89",
        ]
        try:
            _module = cpp_extension.load(
                name=_NAME,
                sources=[str(_CSRC / s) for s in _SOURCES],
                extra_cflags=["-O3"],
                extra_cuda_cflags=cuda_flags,
                extra_ldflags=["-lcublasLt"],
                build_directory=str(build_dir),
                verbose=verbose,
                with_cuda=True,
            )
        except Exception as e:  # noqa: BLE001 - report any build failure as one line
            lines = str(e).strip().splitlines()
            first = lines[0] if lines else type(e).__name__
            # The compiler's first error line, where the log carries one.
            err = next((ln.strip() for ln in lines[1:] if "error" in ln.lower()), "")
            _error = f"building the torch_ops kernels failed: {first}" + (f" [{err[:300]}]" if err else "")
            raise RuntimeError(_error) from e
        return _module


def is_available() -> bool:
    try:
        load()
        return True
    except RuntimeError:
        return False


def unavailable_reason() -> str | None:
    try:
        load()
        return None
    except RuntimeError as e:
        return str(e)
