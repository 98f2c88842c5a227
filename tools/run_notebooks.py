"""Executes the `colab/` notebooks at their own sizes and writes them, with
their outputs, to a folder (the committed notebooks are such runs).

    python tools/run_notebooks.py OUT_DIR [NAME ...]

NAME: a notebook's file name without `.ipynb` (default: every notebook).
Each runs in a fresh kernel (nbclient) with `colab/` as its working
directory; a notebook that fails is written up to the failing cell and the
exit status is 1. Paths of the machine that ran them (a warning's
`/.../keras_fp8/callbacks.py:218`) are written relative to the package.
"""

import argparse
import glob
import os
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The folders of an absolute path in front of one of the project's packages
# or of an installed package: where the checkout or the environment sits
# says nothing about the project, and names the machine that ran it.
_MACHINE_PATH = re.compile(
    r"(?:[A-Za-z]:)?[/\\](?:[^\s'\"():,]+[/\\])*?"
    r"(?:(?:site|dist)-packages[/\\]|(?=(?:keras_fp8|torch_ops|benchmarks|tests)[/\\]))")


def scrub_machine_paths(text):
    """`text` with the machine's folders dropped from its paths
    (`/work/venv/lib/python3.12/site-packages/keras/...` -> `keras/...`)."""
    return _MACHINE_PATH.sub("", text)


def scrub_notebook(nb):
    """Scrubs the machine's paths from `nb`'s text outputs, in place."""
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = scrub_machine_paths(output["text"])
            if "traceback" in output:
                output["traceback"] = [scrub_machine_paths(line) for line in output["traceback"]]
            for key, value in output.get("data", {}).items():
                if key.startswith("text/") and isinstance(value, str):
                    output["data"][key] = scrub_machine_paths(value)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("names", nargs="*")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = p.parse_args(argv)

    import nbclient
    import nbformat

    paths = sorted(glob.glob(os.path.join(REPO, "colab", "*.ipynb")))
    known = [os.path.splitext(os.path.basename(path))[0] for path in paths]
    unknown = sorted(set(args.names) - set(known))
    if unknown:
        p.error(f"NAME: expected some of {known}, got {unknown}")
    os.makedirs(args.out_dir, exist_ok=True)
    failed = 0
    for path, name in zip(paths, known):
        if args.names and name not in args.names:
            continue
        nb = nbformat.read(path, as_version=4)
        client = nbclient.NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                                         record_timing=False,  # no execution timestamps in the files
                                         resources={"metadata": {"path": os.path.dirname(path)}})
        start = time.time()
        try:
            client.execute()
            status = "ok"
        except Exception as e:  # noqa: BLE001 (the notebook is written up to the failing cell)
            status = f"failed: {type(e).__name__}: {str(e)[-2000:]}"
            failed += 1
        scrub_notebook(nb)
        nbformat.write(nb, os.path.join(args.out_dir, name + ".ipynb"))
        print(f"{name}: {status} in {time.time() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
