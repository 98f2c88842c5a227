"""``python -m torch_ops build [-v]``: build the CUDA extension ahead of time.
``python -m torch_ops info``: say whether the kernels serve this machine."""

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else "info"
    import torch_ops
    from torch_ops import extension

    if cmd == "build":
        try:
            torch_ops.build(verbose="-v" in argv or "--verbose" in argv)
        except RuntimeError as e:
            print(f"torch_ops: not built: {e}", file=sys.stderr)
            return 1
        print(f"torch_ops: built, cached under {extension.build_directory()}")
        return 0
    if cmd == "info":
        r = torch_ops.unavailable_reason()
        print("torch_ops kernels: available" if r is None else f"torch_ops kernels: unavailable: {r}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
