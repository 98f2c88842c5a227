"""Executes the `colab/` notebooks at their own sizes and writes them, with
their outputs, to a folder (the committed notebooks are such runs).

    python tools/run_notebooks.py OUT_DIR [NAME ...]

NAME: a notebook's file name without `.ipynb` (default: every notebook).
Each runs in a fresh kernel (nbclient) with `colab/` as its working
directory; a notebook that fails is written up to the failing cell and the
exit status is 1.
"""

import argparse
import glob
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        nbformat.write(nb, os.path.join(args.out_dir, name + ".ipynb"))
        print(f"{name}: {status} in {time.time() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
