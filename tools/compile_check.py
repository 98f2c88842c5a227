"""Compiles every csrc/ translation unit to an object file, no GPU needed.

The flags are the extension's own (torch_ops/extension.py: the same nvcc
targets, torch's include paths); nothing is linked or loaded. A kernel
change must pass this before it lands.

    python tools/compile_check.py [-j 2] [--include DIR ...]

Where the CUDA toolkit has no cuBLAS headers, pass a folder that has them
(e.g. the include/ folder of the `nvidia-cublas` wheel).
"""

import argparse
import concurrent.futures
import importlib.util
import os
import pathlib
import subprocess
import sys
import sysconfig
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _jax_ffi_build():
    """keras_fp8/backends/jax_ffi_build.py, loaded by path (standard library
    only: neither keras_fp8 nor JAX is imported)."""
    path = ROOT / "keras_fp8" / "backends" / "jax_ffi_build.py"
    spec = importlib.util.spec_from_file_location("jax_ffi_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


JAX_FFI_BUILD = _jax_ffi_build()
# The JAX custom calls' entries, as the backend builds them.
JAX_SOURCES = list(JAX_FFI_BUILD.ENTRIES)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-j", type=int, default=os.cpu_count() or 2, help="parallel compiles")
    parser.add_argument("--include", action="append", default=[], help="extra include folder (cuBLAS headers)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.utils import cpp_extension

    from torch_ops import extension

    cuda_home = cpp_extension.CUDA_HOME or "/usr/local/cuda"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [
        f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_home}/include"] + [f"-I{d}" for d in args.include]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    defines = ["-DTORCH_EXTENSION_NAME=keras_fp8_torch_ops", "-DTORCH_API_INCLUDE_EXTENSION_H", abi]
    nvcc = [f"{cuda_home}/bin/nvcc", "-O3", "--expt-relaxed-constexpr", "-std=c++20",
            "-Xcompiler", "-fPIC"] + [f"-gencode={t}" for t in extension.BUILD_TARGETS.values()]
    cxx = ["g++", "-O3", "-std=c++20", "-fPIC"]
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix="torch_ops_check_"))
    # A CPU build of torch ships c10/cuda's headers without the one its CUDA
    # build generates; it holds a single definition.
    macros = "c10/cuda/impl/cuda_cmake_macros.h"
    if not any((pathlib.Path(p) / macros).is_file() for p in cpp_extension.include_paths()):
        (out_dir / macros).parent.mkdir(parents=True)
        (out_dir / macros).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(f"-I{out_dir}")

    def compile_one(name):
        src = ROOT / "csrc" / name
        obj = out_dir / (name + ".o")
        base = nvcc if name.endswith(".cu") else cxx
        cmd = base + defines + includes + ["-c", str(src), "-o", str(obj)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return name, r.returncode, r.stderr

    def compile_jax_ffi(name):
        # A JAX custom call's entry: the GEMM's host C++ against JAX's FFI
        # headers (keras_fp8/backends/jax_ffi_build.py builds it the same
        # way); the quantize kernels with nvcc, for every target.
        import jax

        base = nvcc if name.endswith(".cu") else ["g++", "-O3", "-std=c++17", "-fPIC"]
        src = JAX_FFI_BUILD.source_dir()
        cmd = base + [f"-I{src}", "-isystem", str(jax.ffi.include_dir()),
               f"-I{cuda_home}/include"] + [f"-I{d}" for d in args.include] + [
               "-c", str(src / name), "-o", str(out_dir / (name + ".o"))]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return name, r.returncode, r.stderr

    sources = list(extension.SOURCES)
    if importlib.util.find_spec("jax") is not None:
        sources += JAX_SOURCES
    else:
        print(f"{', '.join(JAX_SOURCES)}: skipped (jax not importable)")
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(args.j) as pool:
        for name, rc, err in pool.map(lambda n: compile_jax_ffi(n) if n in JAX_SOURCES else compile_one(n), sources):
            status = "ok" if rc == 0 else "FAILED"
            print(f"{name}: {status}")
            if rc != 0:
                failed += 1
                print(err[-6000:])
            elif "warning" in err:
                print("\n".join(line for line in err.splitlines() if "warning" in line)[:3000])
    targets = ", ".join(extension.BUILD_TARGETS.values())
    print(f"{len(sources) - failed} of {len(sources)} compiled ({targets})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
