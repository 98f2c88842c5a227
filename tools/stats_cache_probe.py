"""Whether the monitor's compiled statistics depend on an earlier process.

Under dynamic shapes inductor splits a reduction according to the sizes of
the tensor it compiles for, and its FX graph cache key leaves those sizes
out. `small` compiles the monitor's torch statistics for small tensors (as
the tests do); `large` then times them on the decoder's largest tensors in
a new process sharing the same cache directory. `--fx-graph-cache` compiles
with that cache on (the monitor compiles with it off:
`_stats_compile_options` in keras_fp8/monitor/torch_statistics.py). On a
GPU:

    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    KERAS_BACKEND=torch python tools/stats_cache_probe.py small --fx-graph-cache
    KERAS_BACKEND=torch python tools/stats_cache_probe.py large --fx-graph-cache

and the same pair without the flag in a fresh directory.
"""

import argparse
import functools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # noqa: E402
from keras_fp8.monitor import torch_statistics  # noqa: E402

SMALL = [((48, 80), torch.float32, "e4m3"), ((40, 24), torch.bfloat16, "e4m3"),
         ((48, 80), torch.float32, "e5m2"), ((64, 33), torch.bfloat16, "e5m2")]
LARGE = [((16384, 4096), torch.bfloat16, "e4m3"), ((16384, 14336), torch.bfloat16, "e5m2"),
         ((4096, 14336), torch.float32, "e4m3")]


def timed(x, scale, fmt, repeats):
    """The first call's seconds and the later calls' milliseconds, each
    call on the host clock up to its device work's end."""
    timer = timing.wall_timer(sync=lambda _: torch.cuda.synchronize())
    run = functools.partial(torch_statistics._compiled_tensor_stats, x, scale, fmt)
    torch.cuda.synchronize()
    first = timer(run) / 1e3
    return first, [timer(run) for _ in range(repeats)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["small", "large"])
    p.add_argument("--fx-graph-cache", action="store_true",
                   help="compile with inductor's FX graph cache on (the monitor turns it off)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("stats_cache_probe: needs a CUDA GPU (the split reductions are Triton's)")
    if args.fx_graph_cache:
        options = torch_statistics._stats_compile_options()
        torch_statistics._stats_compile_options = lambda: {**options, "fx_graph_cache": True}
    from torch._dynamo.utils import counters

    scale = torch.tensor(0.01, device="cuda")
    for shape, dtype, fmt in SMALL if args.mode == "small" else LARGE:
        x = torch.randn(shape, device="cuda").to(dtype)
        first, values = timed(x, scale, fmt, args.repeats)
        print(f"{shape[0]}x{shape[1]} {str(dtype).removeprefix('torch.')} {fmt}: first call {first:.1f} s, "
              f"then {statistics.median(values):.2f} ms [{min(values):.2f}-{max(values):.2f}]")
    cache = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    print("FX graph cache:", cache or "not used")


if __name__ == "__main__":
    main()
