"""Builds `python_docs.txt`, the quality benchmark's text, from Python itself.

    python benchmarks/data/build_corpus.py [--out benchmarks/data/python_docs.txt]

The text is CPython's own documentation as it ships inside the interpreter:
the reference topics of `pydoc_data.topics` (what `help("if")` prints),
then the docstrings of the standard library's modules and of the classes,
functions and methods they define, each once, modules in sorted order.
Both are part of the Python distribution and under the PSF License
(`LICENSE.txt` beside this file is the interpreter's own copy of it). The
output depends only on the Python version that runs this script (the
committed file: the one its first line names); nothing is downloaded.
"""

import argparse
import contextlib
import importlib
import inspect
import io
import os
import sys
import warnings

# Modules not imported: they act on import (open a browser, print, start a
# GUI or a test run) or need a display.
SKIP = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__hello__", "__phello__",
    "lib2to3", "test", "pydoc_data", "xxlimited", "xxlimited_35", "xxsubtype", "_xxsubinterpreters",
    "_xxtestfuzz", "_testcapi", "_testinternalcapi", "_testbuffer", "_testimportmultiple",
    "_testmultiphase", "_testclinic", "_ctypes_test", "_testsinglephase",
}


def _docs_of(module):
    """Docstrings of `module` and of what it defines, in a fixed order."""
    out = [inspect.getdoc(module)]
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        obj = vars(module)[name]
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        out.append(inspect.getdoc(obj))
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                if attr.startswith("_") and attr != "__init__":
                    continue
                member = vars(obj)[attr]
                if inspect.isroutine(member) or isinstance(member, property):
                    out.append(inspect.getdoc(member))
    return out


def build():
    parts = []
    from pydoc_data import topics

    for key in sorted(topics.topics):
        parts.append(topics.topics[key].strip())
    names = sorted(n for n in sys.stdlib_module_names if n not in SKIP and not n.startswith("_"))
    seen = set()
    for name in names:
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 (platform-specific modules)
            continue
        for doc in _docs_of(module):
            if doc and len(doc) >= 40 and doc not in seen:
                seen.add(doc)
                parts.append(doc.strip())
    text = "\n\n".join(parts)
    # Bytes are the tokens: keep the text ASCII-clean of control characters.
    text = "".join(c for c in text if c in "\n\t" or " " <= c)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "python_docs.txt"))
    args = parser.parse_args(argv)
    text = build()
    header = (f"Python {sys.version.split()[0]} documentation: pydoc_data.topics and standard-library docstrings "
              "(PSF License, see LICENSE.txt)\n\n")
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        f.write(header + text + "\n")
    print(f"{args.out}: {len(header) + len(text) + 1} characters")


if __name__ == "__main__":
    main()
