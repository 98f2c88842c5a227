"""Device probe: which C++ errors and message formats crash a torch extension process.

Builds one tiny extension (torch's default flags) whose functions throw
std::runtime_error, c10::Error (TORCH_CHECK) and c10::ValueError
(TORCH_CHECK_VALUE) with an int or a string in the message, and
pybind11::value_error, or only format an int / long / long long with
c10::str or an ostringstream; calls each in its own process and prints the
exit status; then, where gdb exists, a native backtrace of the first crash.
Session 4 on the H200: messages with an int crashed (SIGSEGV), with strings
they raised."""
import os
import shutil
import subprocess
import sys

SRC = r'''
#include <torch/extension.h>
#include <sstream>
#include <stdexcept>
#include <string>
void std_err() { throw std::runtime_error("std runtime_error"); }
void c10_check() { TORCH_CHECK(false, "c10 check ", 7); }
void c10_value() { TORCH_CHECK_VALUE(false, "c10 value ", 7); }
void py_value() { throw pybind11::value_error("pybind value_error"); }
void c10_caught() { try { TORCH_CHECK(false, "inner"); } catch (const c10::Error& e) { } }
void c10_check_str() { TORCH_CHECK(false, "c10 check ", std::to_string(7)); }
std::string fmt_int() { return c10::str("a", 7); }
std::string fmt_long() { return c10::str("a", (long)7); }
std::string fmt_ll() { return c10::str("a", 7LL); }
std::string oss_int() { std::ostringstream o; o << 7; return o.str(); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("std_err", &std_err); m.def("c10_check", &c10_check); m.def("c10_value", &c10_value);
  m.def("py_value", &py_value); m.def("c10_caught", &c10_caught); m.def("c10_check_str", &c10_check_str);
  m.def("fmt_int", &fmt_int); m.def("fmt_long", &fmt_long); m.def("fmt_ll", &fmt_ll); m.def("oss_int", &oss_int);
}
'''
BUILD = "/tmp/throw_probe"
if len(sys.argv) == 1:
    os.makedirs(BUILD, exist_ok=True)
    open(f"{BUILD}/probe.cpp", "w").write(SRC)
    from torch.utils import cpp_extension
    cpp_extension.load(name="throw_probe", sources=[f"{BUILD}/probe.cpp"], build_directory=BUILD, verbose=False)
    print("built; compiler:", subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0])
    import torch
    print("torch pybind11 abi:", getattr(torch._C, "_PYBIND11_COMPILER_TYPE", "?"), getattr(torch._C, "_PYBIND11_STDLIB", "?"),
          getattr(torch._C, "_PYBIND11_BUILD_ABI", "?"), "cxx11abi", torch._C._GLIBCXX_USE_CXX11_ABI)
    first_crash = None
    for fn in ["c10_caught", "std_err", "py_value", "c10_check", "c10_value", "c10_check_str", "fmt_int", "fmt_long",
               "fmt_ll", "oss_int"]:
        r = subprocess.run([sys.executable, __file__, fn], capture_output=True, text=True, timeout=120)
        print(f"{fn}: rc={r.returncode} {r.stdout.strip()[:150]}", flush=True)
        if r.returncode < 0 and first_crash is None:
            first_crash = fn
    gdb = shutil.which("gdb")
    print("gdb:", gdb)
    if first_crash and gdb:
        r = subprocess.run([gdb, "-batch", "-ex", "run", "-ex", "bt 25", "--args", sys.executable, __file__, first_crash],
                           capture_output=True, text=True, timeout=200)
        print("\n".join(l for l in r.stdout.splitlines() if l.startswith("#"))[:5000])
else:
    sys.path.insert(0, BUILD)
    import torch  # noqa: F401
    import throw_probe
    try:
        print("returned", repr(getattr(throw_probe, sys.argv[1])()))
    except Exception as e:  # noqa: BLE001
        print(type(e).__name__, str(e).splitlines()[0][:100])
