"""The documentation: the site builds (`mkdocs build --strict`) and every
```python block of README.md and docs/ runs.

The blocks of one page run in order in one namespace, as a reader would run
them, in a temporary directory. An HTML comment right before a block (blank
lines between are fine) changes that: `<!-- snippet-test: skip REASON -->`
does not run it (the reason is required), `<!-- snippet-test: gpu -->` runs
it only where FP8 layers run real FP8 GEMMs, `<!-- snippet-test: fresh -->`
starts a new namespace, and

    <!-- snippet-test: setup
    x = ...
    -->

runs hidden code first (data the text assumes). Both backends run the same
blocks, so they run once, under the torch run of the README's test command.
"""

import os
import re
import subprocess
import sys
import traceback

import keras
import pytest

from tests.support.backend_utils import REPO
from tests.support.backend_utils import real_fp8_gemm
from tests.support.backend_utils import subprocess_env

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="backend-independent (the snippets and the site); run once, under the torch run")

_DIRECTIVE = re.compile(r"<!--\s*snippet-test:\s*(\w+)(.*?)-->", re.DOTALL)
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


def doc_pages():
    pages = [os.path.join(REPO, "README.md")]
    for root, _, files in os.walk(os.path.join(REPO, "docs")):
        pages += [os.path.join(root, f) for f in sorted(files) if f.endswith(".md")]
    return sorted(pages)


def python_blocks(path):
    """`[(line, code, directives)]` for every ```python block of a page;
    `directives` maps `skip`/`gpu`/`fresh`/`setup` to its text."""
    lines = open(path, encoding="utf-8").read().split("\n")
    blocks, pending, i = [], {}, 0
    while i < len(lines):
        line = lines[i]
        if "<!--" in line and "snippet-test:" in line:
            j = i
            while "-->" not in lines[j]:
                j += 1
            match = _DIRECTIVE.search("\n".join(lines[i:j + 1]))
            if match is None:
                raise ValueError(f"{path}:{i + 1}: a malformed snippet-test comment")
            kind, text = match.group(1), match.group(2)
            if kind not in ("skip", "gpu", "fresh", "setup"):
                raise ValueError(f"{path}:{i + 1}: unknown snippet-test directive {kind!r}")
            if kind == "skip" and not text.strip():
                raise ValueError(f"{path}:{i + 1}: 'skip' needs a reason")
            pending[kind] = text.strip() if kind != "setup" else text
            i = j + 1
            continue
        fence = _FENCE.match(line)
        if fence:
            indent, language = fence.groups()
            j = i + 1
            while not lines[j].strip().startswith("```"):
                j += 1
            code = "\n".join(l[len(indent):] for l in lines[i + 1:j])
            if language == "python":
                blocks.append((i + 1, code, pending))
            elif pending:
                raise ValueError(f"{path}:{i + 1}: a snippet-test comment before a {language!r} block")
            pending, i = {}, j + 1
            continue
        if line.strip() and pending:
            raise ValueError(f"{path}:{i + 1}: a snippet-test comment not followed by a python block")
        i += 1
    return blocks


PAGES = [p for p in doc_pages() if python_blocks(p)]


@pytest.mark.parametrize("page", PAGES, ids=[os.path.relpath(p, REPO) for p in PAGES])
def test_doc_snippets_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    name = os.path.relpath(page, REPO)
    namespace, ran, skipped = {"__name__": "__snippet__"}, 0, []
    for line, code, directives in python_blocks(page):
        if "skip" in directives:
            skipped.append(f"{name}:{line}: {directives['skip']}")
            continue
        if "gpu" in directives and not real_fp8_gemm():
            skipped.append(f"{name}:{line}: GPU only")
            continue
        if "fresh" in directives:
            namespace = {"__name__": "__snippet__"}
        try:
            if "setup" in directives:
                exec(compile(directives["setup"], f"{name}:{line} (setup)", "exec"), namespace)
            exec(compile(code, f"{name}:{line}", "exec"), namespace)
        except Exception:
            pytest.fail(f"the block at {name}:{line} failed:\n{traceback.format_exc()}", pytrace=False)
        ran += 1
    with capsys.disabled():
        for reason in skipped:
            print(f"\n  not run: {reason}", end="")
    assert ran or skipped


def test_every_snippet_directive_is_well_formed():
    for page in doc_pages():
        python_blocks(page)  # raises on a malformed or stray directive


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs tooling (the docs or test extra) is not installed")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=subprocess_env(NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert (tmp_path / "site" / "api" / "keras_fp8" / "index.html").exists()
