"""Building the JAX custom calls (`keras_fp8.backends.jax_ffi_build`), on
any machine: where the sources and CUDA are found, nvcc's architecture
names. The libraries themselves are built and run on an FP8 GPU
(tests/keras/test_jax_gpu.py)."""

import pathlib
import subprocess
import sys

import keras
import pytest

from tests.support.backend_utils import REPO
from tests.support.backend_utils import subprocess_env

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX backend's custom calls")


@pytest.fixture
def jax_ffi_build():
    from keras_fp8.backends import jax_ffi_build

    return jax_ffi_build


def test_the_sources_of_both_custom_calls_are_found(jax_ffi_build):
    folder = jax_ffi_build.source_dir()
    assert folder == pathlib.Path(REPO) / "csrc"
    for name in jax_ffi_build.GEMM_SOURCES + jax_ffi_build.QUANTIZE_SOURCES:
        assert (folder / name).is_file(), name
    assert set(jax_ffi_build.ENTRIES) <= set(jax_ffi_build.GEMM_SOURCES + jax_ffi_build.QUANTIZE_SOURCES)


def _write_sources(folder, names):
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_text("")


def test_an_installed_wheel_s_sources_are_found_without_importing_torch_ops(jax_ffi_build, monkeypatch, tmp_path):
    # A wheel ships csrc/ as the package data torch_ops/csrc (pyproject.toml);
    # found by its package's location, never by importing it (its
    # __init__ imports torch).
    site = tmp_path / "site"
    _write_sources(site / "torch_ops" / "csrc", jax_ffi_build.GEMM_SOURCES + jax_ffi_build.QUANTIZE_SOURCES)
    (site / "torch_ops" / "__init__.py").write_text("raise ImportError('torch_ops must not be imported')\n")
    monkeypatch.delitem(sys.modules, "torch_ops", raising=False)
    monkeypatch.syspath_prepend(str(site))
    # The package installed without a source checkout beside it.
    monkeypatch.setattr(jax_ffi_build, "__file__", str(tmp_path / "wheel" / "keras_fp8" / "backends" / "x.py"))
    assert jax_ffi_build.source_dir() == site / "torch_ops" / "csrc"
    assert "torch_ops" not in sys.modules


def test_missing_sources_are_named(jax_ffi_build, monkeypatch, tmp_path):
    site = tmp_path / "site"
    _write_sources(site / "torch_ops" / "csrc", jax_ffi_build.GEMM_SOURCES)  # no quantize sources
    (site / "torch_ops" / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "torch_ops", raising=False)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(jax_ffi_build, "__file__", str(tmp_path / "wheel" / "keras_fp8" / "backends" / "x.py"))
    with pytest.raises(FileNotFoundError, match=r"csrc/: expected .*jax_quantize\.cu.* in .* or in the installed "
                                                 r"torch_ops/csrc"):
        jax_ffi_build.source_dir()


def test_the_module_loads_by_path_with_the_standard_library_alone():
    # tools/compile_check.py loads it by path: no keras_fp8, JAX or torch import.
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('b', 'keras_fp8/backends/jax_ffi_build.py')\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print(module.source_dir())\n"
        "assert not {'jax', 'torch', 'torch_ops', 'keras', 'keras_fp8'} & set(sys.modules), sorted(sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, cwd=REPO,
                         env=subprocess_env())
    assert pathlib.Path(out.stdout.strip()) == pathlib.Path(REPO) / "csrc"


def test_find_picks_the_first_folder_with_every_file(jax_ffi_build, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    (first / "include").mkdir(parents=True)
    (second / "include").mkdir(parents=True)
    (first / "include" / "cuda_runtime.h").write_text("")
    (second / "include" / "cuda_runtime.h").write_text("")
    (second / "include" / "cublasLt.h").write_text("")
    (second / "lib").mkdir()
    (second / "lib" / "libcublasLt.so.13").write_text("")
    assert jax_ffi_build._find([first, second], ["include"], ["cuda_runtime.h", "cublasLt.h"]) == second / "include"
    assert jax_ffi_build._find([first, second], ["lib", "lib64"], ["libcublasLt.so*"]) == second / "lib"
    assert jax_ffi_build._find([first], ["lib"], ["libcublasLt.so*"]) is None


def test_cuda_roots_start_with_the_wheels_and_take_cuda_home(jax_ffi_build, monkeypatch, tmp_path):
    wheel = tmp_path / "site" / "nvidia" / "cu13"
    (wheel / "include").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    roots = jax_ffi_build._cuda_roots()
    assert roots[0] == wheel
    assert pathlib.Path(tmp_path / "toolkit") in roots
    assert len(roots) == len(set(roots))


def test_cuda_arch_names_what_nvcc_builds(jax_ffi_build):
    assert jax_ffi_build.cuda_arch("9.0") == "90a"
    assert jax_ffi_build.cuda_arch("8.9") == "89"
    assert jax_ffi_build.cuda_arch("10.0") == "100"
    for bad in ("9", "sm_90", "9.0.1", "", "9.\u00b2", "\u0669.0"):
        with pytest.raises(ValueError, match=r"capability: expected 'major.minor'"):
            jax_ffi_build.cuda_arch(bad)


def test_nvcc_is_taken_from_a_toolkit_with_the_runtime_headers(jax_ffi_build, tmp_path):
    wheel = tmp_path / "site-packages" / "nvidia" / "cu13"
    toolkit = tmp_path / "cuda"
    for root in (wheel, toolkit):
        (root / "bin").mkdir(parents=True)
        (root / "bin" / "nvcc").write_text("")
        (root / "include").mkdir()
    # The wheel's include folder lacks crt/: its nvcc cannot compile alone.
    assert jax_ffi_build._find_nvcc([wheel, toolkit]) is None
    (toolkit / "include" / "crt").mkdir()
    (toolkit / "include" / "crt" / "host_config.h").write_text("")
    assert jax_ffi_build._find_nvcc([wheel, toolkit]) == toolkit / "bin" / "nvcc"


def test_a_library_is_named_by_its_sources_and_kept_in_the_cache(jax_ffi_build, tmp_path):
    source = tmp_path / "a.cpp"
    source.write_text("int a;")
    first = jax_ffi_build._library_path(None, "libx", [source], "90a")
    assert first.parent == jax_ffi_build.CACHE_DIR
    assert first.parent == pathlib.Path.home() / ".cache" / "keras_fp8" / "jax_ffi"
    assert jax_ffi_build._library_path(tmp_path, "libx", [source], "90a").parent == tmp_path
    assert jax_ffi_build._library_path(None, "libx", [source], "89") != first
    source.write_text("int b;")
    assert jax_ffi_build._library_path(None, "libx", [source], "90a") != first


def test_a_failed_compile_names_the_command_and_leaves_nothing(jax_ffi_build, tmp_path):
    out = tmp_path / "cache" / "libx.so"
    with pytest.raises(RuntimeError, match=r"building libx\.so failed:\n.*python"):
        jax_ffi_build._compile(out, lambda partial: [sys.executable, "-c", "import sys; sys.exit('no')"])
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_source_lists_hold_every_included_file(jax_ffi_build):
    """A library's cache key covers every repository file its entry
    includes, transitively: a kernel change rebuilds it."""
    import re

    csrc = jax_ffi_build.source_dir()

    def closure(name, seen):
        seen.add(name)
        for inc in re.findall(r'^#include "([^"]+)"', (csrc / name).read_text(), re.M):
            if (csrc / inc).is_file() and inc not in seen:
                closure(inc, seen)
        return seen

    assert closure(jax_ffi_build.GEMM_ENTRY, set()) == set(jax_ffi_build.GEMM_SOURCES)
    assert closure(jax_ffi_build.QUANTIZE_ENTRY, set()) == set(jax_ffi_build.QUANTIZE_SOURCES)
