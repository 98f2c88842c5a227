"""The documentation: the site builds (`mkdocs build --strict`) and every
```python block of README.md and docs/ runs.

The blocks of one page run in order in one namespace, as a reader would run
them, in a temporary directory. An HTML comment right before a block (blank
lines between are fine) changes that: `<!-- snippet-test: skip REASON -->`
does not run it (the reason is required), `<!-- snippet-test: gpu -->` runs
it only where FP8 layers run real FP8 GEMMs, `<!-- snippet-test: fresh -->`
starts a new namespace, `<!-- snippet-test: isolated -->` runs a complete
program, as if in a process of its own (a new namespace and the global dtype
policy restored afterwards; the blocks after it go on where the one before
it left off), and

    <!-- snippet-test: setup
    x = ...
    -->

runs hidden code first (data the text assumes). Both backends run the same
blocks, so they run once, under the torch run of the README's test command.
"""

import html
import os
import pkgutil
import re
import subprocess
import sys
import traceback
import types

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
    `directives` maps `skip`/`gpu`/`fresh`/`isolated`/`setup` to its text."""
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
            if kind not in ("skip", "gpu", "fresh", "isolated", "setup"):
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
        isolated = "isolated" in directives
        scope = {"__name__": "__snippet__"} if isolated else namespace
        policy = keras.config.dtype_policy()
        try:
            if "setup" in directives:
                exec(compile(directives["setup"], f"{name}:{line} (setup)", "exec"), scope)
            exec(compile(code, f"{name}:{line}", "exec"), scope)
        except Exception:
            pytest.fail(f"the block at {name}:{line} failed:\n{traceback.format_exc()}", pytrace=False)
        finally:
            if isolated:
                keras.config.set_dtype_policy(policy)
        ran += 1
    with capsys.disabled():
        for reason in skipped:
            print(f"\n  not run: {reason}", end="")
    assert ran or skipped


def test_every_snippet_directive_is_well_formed():
    for page in doc_pages():
        python_blocks(page)  # raises on a malformed or stray directive


def _fenced_block(text, after):
    """The first fenced block of `text` after the line `after`."""
    lines = text.split("\n")
    start = lines.index(after)
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    last = next(i for i in range(first + 1, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[first + 1:last]).strip()


def test_ci_runs_the_readme_commands():
    """.ci/run runs exactly the README's test command, and the README's install
    command but for torch's index (its comment says why)."""
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    ci = [line.strip() for line in open(os.path.join(REPO, ".ci", "run"), encoding="utf-8")]
    assert _fenced_block(readme, "## Test") in ci
    install = _fenced_block(readme, "## Install")
    cpu_index = " --index-url https://download.pytorch.org/whl/cpu"
    assert install.startswith("pip install torch==2.13.0" + cpu_index + " && ")
    assert install.replace(cpu_index, "", 1) in ci


def _api_objects():
    """Every object a `::: name` line of docs/api/ documents."""
    documented = []
    for page in sorted(os.listdir(os.path.join(REPO, "docs", "api"))):
        for line in open(os.path.join(REPO, "docs", "api", page), encoding="utf-8"):
            if line.startswith("::: "):
                documented.append(pkgutil.resolve_name(line[4:].strip()))
    return documented


@pytest.mark.parametrize("package", ["keras_fp8", "torch_ops"])
def test_api_reference_lists_every_public_callable(package):
    if package == "torch_ops":
        pytest.importorskip("torch")
    module = __import__(package)
    documented = _api_objects()
    missing = [name for name in module.__all__
               if callable(getattr(module, name)) and not isinstance(getattr(module, name), types.ModuleType)
               and not any(getattr(module, name) is obj for obj in documented)]
    assert not missing, f"{package}.{missing} not in docs/api/ (add a `::: ...` entry)"


def _api_sections(site):
    """`{object id: its rendered text}` of the API pages."""
    sections = {}
    for page in ("keras_fp8", "torch_ops"):
        text = (site / "api" / page / "index.html").read_text(encoding="utf-8")
        parts = re.split(r'<h2 id="([\w.]+)"', text)
        for ident, body in zip(parts[1::2], parts[2::2]):
            sections[ident] = body
    return sections


def _plain(fragment):
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", fragment)))


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs tooling (the docs or test extra) is not installed")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=subprocess_env(NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert (tmp_path / "site" / "api" / "keras_fp8" / "index.html").exists()

    # The API pages: no parameter is called required for want of a default in
    # the signature (the Keras arguments a layer takes through **kwargs, say);
    # defaults the signature has are shown; `**kwargs` shows none; a Keras-style
    # `Example:` renders as code, its fence not as text.
    sections = _api_sections(tmp_path / "site")
    assert "keras_fp8.convert.unconvert" in sections
    for ident, body in sections.items():
        text = _plain(body)
        assert "<em>required</em>" not in body, ident
        assert "DEFAULT: {}" not in text and "DEFAULT: ()" not in text, ident
        assert "```" not in text, ident
    dense = _plain(sections["keras_fp8.layers.FP8Dense"])
    assert "recipe Optional" in dense and "DEFAULT: None" in dense
    assert "use_bias" in dense and "As in keras.layers.Dense" in dense
    assert 'class="highlight"' in sections["keras_fp8.convert.unconvert"]
