"""Finding, building, loading and gating the compiled extension (``csrc/``).

Nothing compiles at import. ``load()`` builds on first use with
``torch.utils.cpp_extension.load`` (ninja, cached under ``build_directory()``).
``kernels_for(tensor)`` says whether the kernels serve a tensor's device: only
CUDA GPUs whose architecture the build targets (``BUILD_TARGETS``) take the
compiled path; any other CUDA GPU gets a one-time warning and the exact
reference, never a crash; CPU tensors always run the reference.

Environment variables (read when first needed; the only ones torch_ops
reads): ``TORCH_OPS_DISABLE``, ``TORCH_OPS_REQUIRE_KERNELS`` and
``TORCH_OPS_BUILD_DIR`` (``torch_ops.settings`` says what each does).
"""

from __future__ import annotations

import os
import pathlib
import threading
import warnings

import torch

from . import reference as ref

_NAME = "keras_fp8_torch_ops"
_HERE = pathlib.Path(__file__).resolve().parent
# An installed wheel ships the sources as torch_ops/csrc (pyproject.toml); a
# source checkout has them at the top level.
_CSRC = _HERE / "csrc" if (_HERE / "csrc").is_dir() else _HERE.parent / "csrc"
SOURCES = ("bindings.cpp", "gemm.cpp", "quantize.cu", "fold.cu", "block.cu", "linear.cpp", "producers.cu")
# (compute capability, nvcc target): the GPUs the kernels are built for. FP8
# tensor cores start at sm_89; sm_90a is Hopper with its arch-specific
# instructions. A GPU of any other architecture is not served (its FP8
# instructions and cuBLASLt's FP8 kernels are not what this build tested).
BUILD_TARGETS = {(8, 9): "arch=compute_89,code=sm_89", (9, 0): "arch=compute_90a,code=sm_90a"}

DISABLE_VARIABLE = "TORCH_OPS_DISABLE"
REQUIRE_VARIABLE = "TORCH_OPS_REQUIRE_KERNELS"
BUILD_DIR_VARIABLE = "TORCH_OPS_BUILD_DIR"

_lock = threading.Lock()
_module = None
_error: str | None = None
# CUDA device index -> the extension, or None (the reference runs there). A
# plain dict, which torch.compile can read without a graph break.
_BY_DEVICE: dict = {}


def _flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}: expected 0 or 1, got {os.environ[name]!r}")


def kernels_required() -> bool:
    """Whether ``TORCH_OPS_REQUIRE_KERNELS`` demands the kernels on CUDA."""
    return _flag(REQUIRE_VARIABLE)


def build_directory() -> pathlib.Path:
    """``TORCH_OPS_BUILD_DIR`` if set, else ~/.cache/keras_fp8/torch_ops/<torch>-<cuda>."""
    tag = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda or 'none'}"
    root = os.environ.get(BUILD_DIR_VARIABLE)
    if root:
        return pathlib.Path(root) / tag
    return pathlib.Path.home() / ".cache" / "keras_fp8" / "torch_ops" / tag


def capability_problem(capability, name: str = "this GPU") -> str | None:
    """Why a CUDA GPU of compute ``capability`` (major, minor) gets no kernels."""
    major, minor = capability
    if (major, minor) in BUILD_TARGETS:
        return None
    if (major, minor) < (8, 9):
        return f"{name} is sm_{major}{minor}, which has no FP8 tensor cores (they start at sm_89)"
    targets = ", ".join(f"sm_{a}{b}" for a, b in BUILD_TARGETS)
    return f"{name} is sm_{major}{minor}, which the torch_ops kernels are not built for ({targets})"


def fp8_gpu_present() -> bool:
    """True when a CUDA GPU of a build target is visible (what the GPU tests
    need; whether the kernels then build is what they test)."""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return False
    return any(torch.cuda.get_device_capability(i) in BUILD_TARGETS for i in range(torch.cuda.device_count()))


def device_problem(index: int | None = None) -> str | None:
    """Why the kernels cannot serve CUDA device ``index`` (default: the
    current one), without compiling anything; None when they can be built."""
    if _flag(DISABLE_VARIABLE):
        return f"torch_ops kernels disabled by {DISABLE_VARIABLE}"
    if torch.version.cuda is None:
        return f"this PyTorch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    index = torch.cuda.current_device() if index is None else index
    problem = capability_problem(torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index))
    if problem is not None:
        return problem
    if not all((_CSRC / s).is_file() for s in SOURCES):
        return f"CUDA sources not found under {_CSRC}"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "nvcc not found (set CUDA_HOME) to build the torch_ops kernels"
    return None


def load(verbose: bool = False):
    """Builds (the first time) and imports the extension.

    Raises:
        RuntimeError: with a one-line reason where it cannot be built here.
    """
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise RuntimeError(_error)
        problem = device_problem()
        if problem is not None:
            _error = problem
            raise RuntimeError(problem)
        from torch.utils import cpp_extension

        build_dir = build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("MAX_JOBS", str(min(16, os.cpu_count() or 4)))
        # No -std flag: torch's own, the standard its headers are written for.
        # No --use_fast_math: the quantize reciprocal must be IEEE to match
        # the reference bit for bit.
        cuda_flags = ["-O3", "--expt-relaxed-constexpr"] + [f"-gencode={t}" for t in BUILD_TARGETS.values()]
        try:
            _module = cpp_extension.load(
                name=_NAME,
                sources=[str(_CSRC / s) for s in SOURCES],
                extra_cflags=["-O3"],
                extra_cuda_cflags=cuda_flags,
                extra_ldflags=["-lcublasLt"],
                build_directory=str(build_dir),
                verbose=verbose,
                with_cuda=True,
            )
        except Exception as e:  # noqa: BLE001 - any build failure becomes one line
            lines = str(e).strip().splitlines()
            first = lines[0] if lines else type(e).__name__
            err = next((ln.strip() for ln in lines[1:] if "error" in ln.lower()), "")
            _error = f"building the torch_ops kernels failed: {first}" + (f" [{err[:300]}]" if err else "")
            raise RuntimeError(_error) from e
        try:
            check_constants(_module)
        except RuntimeError as e:
            _module, _error = None, str(e)
            raise
        return _module


def expected_constants() -> dict:
    """The numerics constants as ``torch_ops.reference`` states them, in the
    form the extension's ``constants()`` returns."""
    return {
        "fp8_format_ids": (ref.FP8_FORMAT_IDS[ref.E4M3], ref.FP8_FORMAT_IDS[ref.E5M2]),
        "fp8_max": (ref.FP8_MAX[ref.E4M3], ref.FP8_MAX[ref.E5M2]),
        "amax_compute_algo_ids": tuple(ref.AMAX_COMPUTE_ALGO_IDS[a] for a in ref.AMAX_COMPUTE_ALGOS),
        "min_scale": ref.MIN_SCALE,
        "fold_count_period": ref.FOLD_COUNT_PERIOD,
        "max_history_len": ref.MAX_HISTORY_LEN,
    }


def check_constants(module) -> None:
    """Raises a RuntimeError naming each constant the compiled kernels
    (``module.constants()``, csrc/cuda_common.h) state differently from
    ``torch_ops.reference``: a build from other sources than this package's
    would compute other numerics."""
    built = dict(module.constants())
    wrong = []
    for name, want in expected_constants().items():
        got = built.get(name)
        if isinstance(got, list):
            got = tuple(got)
        if got != want:
            wrong.append(f"{name}: the reference has {want!r}, the kernels {got!r}")
    if wrong:
        raise RuntimeError("the torch_ops kernels disagree with torch_ops/reference.py (rebuild them from this "
                           f"package's csrc/): {'; '.join(wrong)}")


def kernels_for(t: torch.Tensor):
    """The extension if its kernels serve ``t``'s device, else None.

    CPU (and other non-CUDA) tensors: None, silently: the reference is what
    runs there. A CUDA device the kernels cannot serve: a one-time warning
    naming the device and the reason, then None, unless
    ``TORCH_OPS_REQUIRE_KERNELS=1``, which raises instead.
    """
    if t.device.type != "cuda":
        return None
    index = t.device.index
    if index is None:
        index = torch.cuda.current_device()
    if index in _BY_DEVICE:
        return _BY_DEVICE[index]
    return _settle_device(index)


@torch.compiler.disable
def _settle_device(index: int):
    problem = device_problem(index)
    ext = None
    if problem is None:
        try:
            with torch.cuda.device(index):
                ext = load()
        except RuntimeError as e:
            problem = str(e)
    if problem is not None:
        if kernels_required():
            raise RuntimeError(f"torch_ops: {REQUIRE_VARIABLE}=1, but the kernels cannot serve cuda:{index}: "
                               f"{problem}")
        warnings.warn(f"torch_ops: running the exact FP8 reference on cuda:{index}: {problem}.", stacklevel=4)
    _BY_DEVICE[index] = ext
    return ext


def is_available(device=None) -> bool:
    """True when the kernels serve ``device`` (default: the current CUDA
    device). May build the extension (cached)."""
    return unavailable_reason(device) is None


def unavailable_reason(device=None) -> str | None:
    """One line saying why the kernels do not serve ``device``, or None."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return f"{device} is not a CUDA device"
        index = device.index
    else:
        index = None
    problem = device_problem(index)
    if problem is not None:
        return problem
    try:
        load()
    except RuntimeError as e:
        return str(e)
    return None
