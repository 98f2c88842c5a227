"""The notebooks in colab/ run, at tiny sizes, and are committed with outputs.

Each notebook keeps its sizes in a cell tagged `parameters`; the test adds a
cell after it with tiny ones (`TINY`) and runs the notebook in a fresh
kernel (nbclient) in a temporary directory. The notebooks choose their
Keras backend themselves, so they run once, under the torch run of the
README's test command.
"""

import copy
import glob
import importlib.util
import os

import keras
import pytest

from tests.support.backend_utils import REPO

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="each notebook sets its own backend; they run once, under the torch run")

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "colab", "*.ipynb")))
TINY = {
    "01_keras_fp8_quickstart": "EPOCHS = 2\nWIDTH = 32\nMONITOR_EVERY = 9",
    "02_torch_ops": "STEPS = 6\nBATCH = 16\nD, HIDDEN = 16, 32",
    "03_keras_hub": "LAYERS = 1\nHIDDEN = 32\nSEQ = 16\nSAMPLES = 64\nEPOCHS = 1\nBATCH = 16",
}


def _name(path):
    return os.path.splitext(os.path.basename(path))[0]


def _run_notebooks_tool():
    spec = importlib.util.spec_from_file_location("run_notebooks", os.path.join(REPO, "tools", "run_notebooks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _images(nb):
    return sum("image/png" in output.get("data", {})
               for cell in nb.cells if cell.cell_type == "code" for output in cell.get("outputs", []))


def test_every_notebook_has_tiny_sizes():
    assert sorted(TINY) == sorted(_name(p) for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_notebook_is_committed_with_outputs(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "every code cell has run"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert _images(nb) >= 1, "the committed notebook shows its plots"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_committed_outputs_name_no_machine_path(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    scrubbed = copy.deepcopy(nb)
    _run_notebooks_tool().scrub_notebook(scrubbed)
    changed = [i for i, (a, b) in enumerate(zip(nb.cells, scrubbed.cells)) if a != b]
    assert not changed, f"cells {changed} name folders of the machine that ran them (tools/run_notebooks.py scrubs them)"


def test_scrub_machine_paths():
    scrub = _run_notebooks_tool().scrub_machine_paths
    assert scrub("/work/main/keras_fp8/callbacks.py:218: UserWarning") == "keras_fp8/callbacks.py:218: UserWarning"
    assert scrub('File "/opt/venv/lib/python3.12/site-packages/keras/src/a.py", line 3') == 'File "keras/src/a.py", line 3'
    assert scrub("C:\\Users\\me\\repo\\torch_ops\\linear.py") == "torch_ops\\linear.py"
    kept = "fp8/ffn_up/grad/amax, 1/2 of the steps, an /etc/hosts path"
    assert scrub(kept) == kept


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    if _name(path) == "03_keras_hub":
        pytest.importorskip("keras_hub", reason="keras-hub (the test extra) is not installed")
    nb = nbformat.read(path, as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "one cell tagged 'parameters'"
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(TINY[_name(path)]))
    # The kernel imports this checkout's keras_fp8 (its install cell then
    # installs nothing) and computes with one thread.
    pythonpath = [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(pythonpath))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert _images(nb) >= 1
