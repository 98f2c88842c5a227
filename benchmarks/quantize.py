"""The fused quantize kernels' bandwidth: bytes moved per second.

    python benchmarks/quantize.py [--processes 3] [--shapes 16384x4096,16384x14336]
    python benchmarks/quantize.py --dry-run        # CPU, tiny shapes: the table code

For a bf16 x of each shape, times the ops of `torch_ops.ops` that the FP8
linear runs (the kernels where they serve the GPU, the reference elsewhere):

- `copy`: a device-to-device copy of x, the bandwidth ceiling;
- `delayed`, `delayed_t`: delayed scaling (one read of x writes q, the
  amax, the history shift and the next scale), without and with q_t;
- `current`, `current_t`: current scaling (the scale from x's own amax);
- `tiles`, `tiles_t`: 1 x 128 tiles of x's rows (activations), of its
  columns (the transposed layout the weight gradient needs), each with its
  scales; `blocks`: 128 x 128 blocks with q and q_t (weights).

Bytes counted: x read once, each FP8 output written once (scales and
histories are negligible). Each sample is 10 back-to-back calls between
CUDA events (the host queues ahead), interleaved across variants.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # noqa: E402

SHAPES = [(16384, 4096), (16384, 14336)]
DRY_RUN_SHAPES = [(256, 256)]
VARIANTS = ["copy", "delayed", "delayed_t", "current", "current_t", "tiles", "tiles_t", "blocks"]
LABELS = {
    "copy": "device copy (x.clone())",
    "delayed": "quantize_delayed: q",
    "delayed_t": "quantize_delayed: q + q_t",
    "current": "quantize_current: q",
    "current_t": "quantize_current: q + q_t",
    "tiles": "quantize_tiles (1 x 128): q + scales",
    "tiles_t": "quantize_tiles, transposed (128 x 1): q_t + scales",
    "blocks": "quantize_blocks (128 x 128): q + q_t + scales",
}
# The block kernels' ops (absent from a torch_ops without block scaling).
BLOCK_OPS = {"tiles": "quantize_tiles", "tiles_t": "quantize_tiles", "blocks": "quantize_blocks"}
# FP8 bytes written per element of x.
OUT_BYTES = {"copy": None, "delayed": 1, "delayed_t": 2, "current": 1, "current_t": 2, "tiles": 1, "tiles_t": 1,
             "blocks": 2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Fused quantize kernels: TB/s.")
    p.add_argument("--shapes", default=None, help="RxC,... of the bf16 x (default 16384x4096,16384x14336)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10, help="samples per variant and round")
    p.add_argument("--calls", type=int, default=10, help="back-to-back calls per sample")
    p.add_argument("--dry-run", action="store_true")
    timing.add_process_arguments(p)
    args = p.parse_args(argv)
    timing.check_choices(p, "--variants", args.variants.split(","), VARIANTS)
    if args.shapes:
        try:
            args.shape_list = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        except ValueError:
            p.error(f"--shapes: expected RxC[,RxC...], got {args.shapes!r}")
    else:
        args.shape_list = DRY_RUN_SHAPES if args.dry_run else SHAPES
    if args.dry_run:
        args.rounds, args.iters, args.calls = 1, 2, 1
    return args


def build_variants(names, x):
    import torch
    import torch_ops
    from torch_ops import ops

    e4 = torch.float8_e4m3fn
    hist = torch.zeros(1024, device=x.device)
    scale = torch.ones((), device=x.device)
    torch_ops.quantize_delayed(x, hist, scale, e4)  # a recorded history: the steady state
    fns = {
        "copy": lambda: x.clone(),
        "delayed": lambda: torch_ops.quantize_delayed(x, hist, scale, e4),
        "delayed_t": lambda: torch_ops.quantize_delayed(x, hist, scale, e4, transpose=True),
        "current": lambda: torch_ops.quantize_current(x, e4),
        "current_t": lambda: torch_ops.quantize_current(x, e4, transpose=True),
        "tiles": lambda: ops.quantize_tiles(x, e4, False, 0.0, False),
        "tiles_t": lambda: ops.quantize_tiles(x, e4, True, 0.0, False),
        "blocks": lambda: ops.quantize_blocks(x, e4, 0.0, False),
    }
    out = {}
    for name in names:
        op = BLOCK_OPS.get(name)
        out[name] = fns[name] if op is None or hasattr(ops, op) else f"torch_ops.ops.{op} not present"
    return out


def worker(args):
    import torch
    import torch_ops

    cuda = torch.cuda.is_available() and not args.dry_run
    device = "cuda" if cuda else "cpu"
    timer = timing.cuda_timer if cuda else timing.wall_timer()
    env = timing.environment()
    env["kernels"] = bool(cuda and torch_ops.is_available())
    timing.emit({"env": env})
    names = args.variants.split(",")
    for r, c in args.shape_list:
        torch.manual_seed(0)
        x = torch.randn(r, c, device=device, dtype=torch.bfloat16)
        fns = build_variants(names, x)
        medians = timing.interleaved_medians({v: f for v, f in fns.items() if callable(f)}, rounds=args.rounds,
                                             iters=args.iters, warmup=2, calls=args.calls, timer=timer,
                                             seed=args.worker or 0)
        n = r * c
        for v in names:
            value = medians.get(v, fns[v])
            nbytes = 2 * n + (2 * n if OUT_BYTES[v] is None else OUT_BYTES[v] * n)
            rec = timing.variant_record(v, value, shape=f"{r}x{c}", bytes=nbytes)
            if "ms" in rec:
                rec["tbps"] = nbytes / (rec["ms"] * 1e-3) / 1e12
            timing.emit(rec)
        del x, fns
        if cuda:
            torch.cuda.empty_cache()


HEADER = "| x (bf16) | kernel | bytes moved | us | TB/s |"


def tables(per_process, args=None):
    res = timing.Results(per_process, row_key="shape")
    out = [f"# {timing.env_line(res.env())}; processes: {len(per_process)}", "", HEADER,
           "|" + "---|" * (HEADER.count("|") - 1)]
    for row in res.rows():
        for v in VARIANTS:
            recs = [r for r in res.records(row, v) if r]
            if not recs:
                continue
            nbytes = recs[0].get("bytes", 0)
            us = [None if x is None else x * 1e3 for x in res.values(row, v)]
            us_cell = timing.cell(us, "{:.1f}") if timing.summary(us) else res.problem(row, v)
            tb_cell = res.ms(row, v, field="tbps", fmt="{:.2f}") if timing.summary(us) else "-"
            out.append(f"| {row.replace('x', ' x ')} | {LABELS[v]} | {nbytes / 1e6:.4g} MB | {us_cell} | {tb_cell} |")
    return "\n".join(out)


def main(argv=None):
    return timing.main(__file__, argv, parse_args, worker, tables)


if __name__ == "__main__":
    main()
