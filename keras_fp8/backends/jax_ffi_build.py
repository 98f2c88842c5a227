"""Building the JAX backend's custom-call libraries from `csrc/`.

Two shared libraries, compiled on first use and cached under
`~/.cache/keras_fp8/jax_ffi/` (a name per source content, jaxlib version
and, for the quantize, GPU architecture, so a change rebuilds them):

- the FP8 GEMM (`GEMM_ENTRY`, host C++ calling cuBLASLt): a C++ compiler
  and the CUDA runtime and cuBLASLt headers and libraries, from the
  `nvidia-*` wheels JAX's CUDA plugin installs or from a CUDA toolkit;
- the fused FP8 quantize (`QUANTIZE_ENTRY`, CUDA kernels): nvcc, for the
  GPU's architecture.

The sources are the repository's `csrc/` beside the `keras_fp8` package
or, in an installed wheel, the `torch_ops/csrc` package data, found
through `importlib.util.find_spec` (torch is never imported).
`keras_fp8.backends.jax_gemm` registers and checks the libraries; a build
that fails there leaves XLA's own FP8 products in place with a one-time
warning.

This module imports only the standard library at import time (JAX inside
the functions that need it), so that `tools/compile_check.py` can load it
by path.

Example:

```python
from keras_fp8.backends import jax_ffi_build

jax_ffi_build.source_dir()     # the folder the custom calls compile from
jax_ffi_build.build_gemm()     # the GEMM library's path (built once)
```
"""

import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

# The translation unit of each library and every file its content depends on.
# Both include the kernel header, `fp8_kernels.h`, and with it every kernel
# file (test_jax_ffi_build checks these lists against the #include lines).
KERNEL_HEADERS = ("jax_ffi_util.h", "fp8_kernels.h", "cuda_common.h", "lt_gemm.h", "block_kernels.cuh",
                  "fold_block.cuh", "quantize_kernels.cuh", "finalize.cuh")
GEMM_ENTRY = "jax_ffi.cpp"
GEMM_SOURCES = (GEMM_ENTRY,) + KERNEL_HEADERS
QUANTIZE_ENTRY = "jax_quantize.cu"
QUANTIZE_SOURCES = (QUANTIZE_ENTRY,) + KERNEL_HEADERS
ENTRIES = (GEMM_ENTRY, QUANTIZE_ENTRY)
# Where the libraries are built and kept by default.
CACHE_DIR = pathlib.Path.home() / ".cache" / "keras_fp8" / "jax_ffi"


def _has_sources(folder):
    return all((folder / name).is_file() for name in GEMM_SOURCES + QUANTIZE_SOURCES)


def source_dir():
    """The folder holding the custom calls' sources.

    Returns:
        The repository's `csrc/` beside the `keras_fp8` package where it has
        every source, else the installed `torch_ops/csrc` package data.

    Raises:
        FileNotFoundError: neither has them.
    """
    repository = pathlib.Path(__file__).resolve().parents[2] / "csrc"
    if _has_sources(repository):
        return repository
    # find_spec locates a top-level package without running its __init__
    # (which imports torch).
    spec = importlib.util.find_spec("torch_ops")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        installed = pathlib.Path(location) / "csrc"
        if _has_sources(installed):
            return installed
    names = ", ".join(sorted(set(GEMM_SOURCES + QUANTIZE_SOURCES)))
    raise FileNotFoundError(f"csrc/: expected {names} in {repository} or in the installed torch_ops/csrc")


def _cuda_roots():
    """Folders that may hold CUDA headers and libraries, best first: the
    `nvidia-*` wheels (what JAX's CUDA plugin loads), then a toolkit."""
    roots = []
    for site in sys.path:
        nvidia = pathlib.Path(site) / "nvidia"
        if nvidia.is_dir():
            roots += sorted(p for p in nvidia.glob("cu*") if p.is_dir())
            roots += sorted(p for p in nvidia.glob("*") if (p / "include").is_dir())
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            roots.append(pathlib.Path(os.environ[variable]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(pathlib.Path(os.path.realpath(nvcc)).parent.parent)
    roots.append(pathlib.Path("/usr/local/cuda"))
    return [r for i, r in enumerate(roots) if r not in roots[:i]]


def _find(roots, subdirs, names):
    """The first folder `root/subdir` holding every file of `names` (a
    name ending in `*` matches any suffix)."""
    for root in roots:
        for sub in subdirs:
            folder = root / sub
            if all(any(folder.glob(name)) for name in names):
                return folder
    return None


def _find_nvcc(roots):
    """The first nvcc whose toolkit also has the runtime headers it needs
    (`crt/`): a toolkit, or the `nvidia-cuda-nvcc` wheel beside a full
    include folder."""
    ordered = [r for r in roots if "site-packages" not in str(r)] + [r for r in roots if "site-packages" in str(r)]
    for root in ordered:
        nvcc = root / "bin" / "nvcc"
        if nvcc.is_file() and (root / "include" / "crt" / "host_config.h").is_file():
            return nvcc
    return None


def cuda_arch(capability):
    """nvcc's architecture name for a compute capability string (`"9.0"`
    -> `"90a"`, the Hopper features the kernels use; `"8.9"` -> `"89"`).

    Raises:
        ValueError: `capability` not of the form `"major.minor"`.
    """
    parts = str(capability).split(".")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
        raise ValueError(f"capability: expected 'major.minor' (e.g. '9.0'), got {capability!r}")
    major, minor = int(parts[0]), int(parts[1])
    return f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def _library_path(build_dir, stem, sources, *extra):
    """Where the library built from `sources` (and `extra` strings) with
    this jaxlib lives: a name per content, so a change rebuilds it."""
    import jax

    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    for value in (jax.__version__, *extra):
        digest.update(str(value).encode())
    root = pathlib.Path(build_dir) if build_dir else CACHE_DIR
    return root / f"{stem}_{digest.hexdigest()[:16]}.so"


def _compile(out, command):
    """Runs `command(partial_path)` and moves the result to `out` (so that
    a concurrent or interrupted build never leaves half a library there)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = pathlib.Path(tmp) / out.name
        cmd = command(partial)
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building {out.name} failed:\n{' '.join(cmd)}\n{result.stderr[-4000:]}")
        os.replace(partial, out)
    return out


def build_gemm(build_dir=None):
    """Compiles the GEMM custom call's library (once per source and jaxlib
    version) and returns its path.

    Args:
        build_dir: Where to build; default `CACHE_DIR`.

    Returns:
        The path of the shared library.

    Raises:
        FileNotFoundError: the sources, the CUDA headers and libraries or
            a C++ compiler are missing.
        RuntimeError: the compiler failed (its command and errors).
    """
    import jax

    src = source_dir()
    out = _library_path(build_dir, "libkeras_fp8_jax", [src / name for name in GEMM_SOURCES])
    if out.is_file():
        return out
    roots = _cuda_roots()
    # cuda_runtime.h with the crt/ headers it includes (a runtime wheel may
    # ship it without them).
    includes = [_find(roots, ["include"], ["cuda_runtime.h", "crt/host_config.h"]),
                _find(roots, ["include"], ["cublasLt.h"])]
    libs = [_find(roots, ["lib", "lib64"], ["libcudart.so*"]), _find(roots, ["lib", "lib64"], ["libcublasLt.so*"])]
    if None in includes or None in libs:
        raise FileNotFoundError(f"CUDA runtime and cuBLASLt headers and libraries: not found under "
                                f"{[str(r) for r in roots]}")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise FileNotFoundError("a C++ compiler (g++ or $CXX): not found")

    def lib_flag(folder, stem):
        # The versioned name where there is no plain .so (the wheels ship
        # only libcublasLt.so.13).
        plain = folder / f"lib{stem}.so"
        return f"-l{stem}" if plain.exists() else f"-l:{sorted(folder.glob(f'lib{stem}.so.*'))[0].name}"

    lib_dirs = list(dict.fromkeys(libs))
    return _compile(out, lambda partial: (
        [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{src}", f"-I{jax.ffi.include_dir()}"]
        + [f"-I{d}" for d in dict.fromkeys(includes)]
        + [str(src / GEMM_ENTRY), "-o", str(partial)]
        + [f"-L{d}" for d in lib_dirs] + [f"-Wl,-rpath,{d}" for d in lib_dirs]
        + [lib_flag(libs[1], "cublasLt"), lib_flag(libs[0], "cudart")]))


def build_quantize(build_dir=None, arch=None):
    """Compiles the quantize custom call's library with nvcc for `arch`
    (once per source, jaxlib version and architecture) and returns its path.

    Args:
        build_dir: Where to build; default `CACHE_DIR`.
        arch: nvcc's architecture name (`cuda_arch`); default: the first
            JAX device's.

    Returns:
        The path of the shared library.

    Raises:
        FileNotFoundError: the sources or nvcc with the CUDA runtime
            headers are missing.
        RuntimeError: nvcc failed (its command and errors).
    """
    import jax

    if arch is None:
        arch = cuda_arch(jax.devices()[0].compute_capability)
    src = source_dir()
    out = _library_path(build_dir, "libkeras_fp8_jax_quantize", [src / name for name in QUANTIZE_SOURCES], arch)
    if out.is_file():
        return out
    roots = _cuda_roots()
    nvcc = _find_nvcc(roots)
    if nvcc is None:
        raise FileNotFoundError(f"nvcc with the CUDA runtime headers: not found under {[str(r) for r in roots]}")
    # No --use_fast_math: the quantize's reciprocal must be IEEE (byte-exact).
    return _compile(out, lambda partial: (
        [str(nvcc), "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-w", "--expt-relaxed-constexpr",
         f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-I{src}", f"-I{jax.ffi.include_dir()}",
         str(src / QUANTIZE_ENTRY), "-o", str(partial)]))
