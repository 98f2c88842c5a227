"""Linear layer forward + backward, torch: ours against bf16 and the peers.

    python benchmarks/linear.py [--processes 3] [--shapes 16384x4096x4096,...] [--graphs]
    python benchmarks/linear.py --dry-run          # CPU, tiny shapes: the table code

Shapes are M x K x N (tokens x in x out); x, the weight and the output
gradient are bf16 random data, x requires grad (a layer inside a network), no
bias. One sample is one synchronized step (`x.grad`, `weight.grad` cleared,
forward, backward; CUDA events around it, so host time before the first
kernel counts). Variants, interleaved within each process
(`benchmarks.timing`):

- `bf16`: `torch.nn.Linear` in bf16;
- `delayed`, `current`, `block`: `torch_ops.FP8Linear` with delayed scaling
  (the default), current scaling, and block scaling (1 x 128 tiles of x and
  of the gradient, 128 x 128 blocks of the weight, E4M3), each at the default
  `min_gemm_size` (below it the layer runs bf16 GEMMs: the row says so);
- `torchao`: torchao's `Float8Linear`, tensorwise recipe (dynamic, i.e.
  current scaling), under `torch.compile`, where torchao imports;
- `te_delayed`, `te_current`, `te_block`: TransformerEngine's `Linear` under
  `DelayedScaling`, `Float8CurrentScaling`, `Float8BlockScaling`, where
  transformer_engine imports.

`--graphs` adds a table of GPU time alone (each step captured in a CUDA
graph and replayed), for the variants that can be captured. Without a GPU
the torch/TE peers are skipped with their reason and ours run the exact
emulation (slow by design: `--dry-run` checks arguments and tables only).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # noqa: E402

SHAPES = [
    (16384, 4096, 4096),
    (16384, 4096, 14336),
    (16384, 14336, 4096),
    (8192, 8192, 8192),
    (8192, 4096, 4096),
    (4096, 1024, 1024),
    (1024, 2048, 1024),
]
DRY_RUN_SHAPES = [(64, 128, 128), (32, 64, 256)]
VARIANTS = ["bf16", "delayed", "current", "block", "torchao", "te_delayed", "te_current", "te_block"]
LABELS = {
    "bf16": "bf16 nn.Linear",
    "delayed": "ours delayed",
    "current": "ours current",
    "block": "ours block",
    "torchao": "torchao tensorwise, compiled",
    "te_delayed": "TE delayed",
    "te_current": "TE current",
    "te_block": "TE block",
}
OURS = ("delayed", "current", "block")
TE = ("te_delayed", "te_current", "te_block")


def shape_name(shape):
    return "x".join(str(v) for v in shape)


def parse_shapes(text):
    try:
        return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s]
    except ValueError:
        raise SystemExit(f"--shapes: expected MxKxN[,MxKxN...], got {text!r}") from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Linear layer forward + backward: ours vs bf16 and peers.")
    p.add_argument("--shapes", default=None, help="MxKxN,... (default: the seven shapes of docs/benchmarks.md)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of %s" % ",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per shape")
    p.add_argument("--iters", type=int, default=6, help="samples per variant and round (large shapes)")
    p.add_argument("--small-rounds", type=int, default=150,
                   help="rounds at shapes below the default min_gemm_size (host-bound): one sample each")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--graphs", action="store_true", help="also time CUDA-graph replays (GPU time only)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, one round: checks the code paths")
    timing.add_process_arguments(p)
    args = p.parse_args(argv)
    timing.check_choices(p, "--variants", args.variants.split(","), VARIANTS)
    args.shape_list = parse_shapes(args.shapes) if args.shapes else (DRY_RUN_SHAPES if args.dry_run else SHAPES)
    if args.dry_run:
        args.rounds, args.iters, args.small_rounds, args.warmup = 1, 2, 2, 1
    return args


# --------------------------------------------------------------------------- variants
def _fwd_bwd(module, x, gy, params):
    def step():
        x.grad = None
        for p in params:
            p.grad = None
        module(x).backward(gy)

    return step


def _ours(lin, scaling):
    import torch_ops

    kwargs = {"scaling": scaling}
    if scaling == "block":
        kwargs["fp8_format"] = "e4m3"
    return torch_ops.FP8Linear.from_linear(lin, **kwargs)


def _torchao(lin):
    from torchao.float8 import convert_to_float8_training

    import torch

    m = torch.nn.Sequential(copy.deepcopy(lin))
    convert_to_float8_training(m)
    return torch.compile(m), list(m.parameters())


def _te_autocast(recipe):
    import transformer_engine.pytorch as te

    if hasattr(te, "fp8_autocast"):
        return te.fp8_autocast(enabled=True, fp8_recipe=recipe)
    return te.autocast(enabled=True, recipe=recipe)


def _te(lin, kind):
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    recipes = {
        "te_delayed": lambda: te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=1024,
                                                       amax_compute_algo="max"),
        "te_current": lambda: te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID),
        "te_block": lambda: te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.E4M3),
    }
    r = recipes[kind]()
    layer = te.Linear(lin.in_features, lin.out_features, bias=False, params_dtype=torch.bfloat16,
                      device=lin.weight.device)
    with torch.no_grad():
        layer.weight.copy_(lin.weight)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            with _te_autocast(r):
                return self.layer(x)

    return Wrapped(), list(layer.parameters())


def build_variants(names, lin, x, gy, cuda):
    """{name: step function or a reason string (skipped) or an exception}."""
    out = {}
    for name in names:
        try:
            if name == "bf16":
                out[name] = _fwd_bwd(lin, x, gy, [lin.weight])
            elif name in OURS:
                m = _ours(lin, name)
                out[name] = _fwd_bwd(m, x, gy, [m.weight])
            elif name == "torchao":
                if not cuda:
                    out[name] = "GPU only"
                    continue
                try:
                    import torchao  # noqa: F401
                except ImportError as e:
                    out[name] = f"not importable: {type(e).__name__}"
                    continue
                m, params = _torchao(lin)
                out[name] = _fwd_bwd(m, x, gy, params)
            elif name in TE:
                if not cuda:
                    out[name] = "GPU only"
                    continue
                try:
                    import transformer_engine.pytorch  # noqa: F401
                except Exception as e:  # noqa: BLE001 (ImportError, or a missing shared library)
                    out[name] = f"not importable: {type(e).__name__}"
                    continue
                m, params = _te(lin, name)
                out[name] = _fwd_bwd(m, x, gy, params)
        except Exception as e:  # noqa: BLE001 (the cell says n/a (error: ...))
            out[name] = timing.failure(e)
    return out


def _graph_ms(step, rounds):
    """GPU time of one step: captured in a CUDA graph (after warm-up on a
    side stream), replayed under `interleaved_medians`."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return timing.interleaved_medians({"g": graph.replay}, rounds=rounds, iters=5, warmup=2)["g"]


def worker(args):
    import torch
    import torch_ops

    cuda = torch.cuda.is_available() and not args.dry_run
    device = "cuda" if cuda else "cpu"
    timer = timing.cuda_timer if cuda else timing.wall_timer()
    env = timing.environment()
    kernels = cuda and torch_ops.is_available()
    threshold = torch_ops.get_settings().resolved_min_gemm_size(kernels)
    env["min_gemm_size"] = threshold
    env["kernels"] = bool(kernels) if cuda else torch_ops.unavailable_reason("cpu") or "cpu"
    timing.emit({"env": env})
    names = args.variants.split(",")
    for shape in args.shape_list:
        m, k, n = shape
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        small = m * n * k < threshold
        fns = build_variants(names, lin, x, gy, cuda)
        runnable = {v: f for v, f in fns.items() if callable(f)}
        if small:  # host-bound: variants alternate sample by sample
            medians = timing.interleaved_medians(runnable, rounds=args.small_rounds, iters=1, warmup=args.warmup,
                                                 timer=timer, seed=args.worker or 0)
        else:
            medians = timing.interleaved_medians(runnable, rounds=args.rounds, iters=args.iters,
                                                 warmup=args.warmup, timer=timer, seed=args.worker or 0)
        gemms = "bf16" if small else "fp8"
        for v in names:
            value = medians.get(v, fns.get(v))
            timing.emit(timing.variant_record(v, value, shape=shape_name(shape), ours_gemms=gemms))
        if args.graphs and cuda:
            for v in names:
                if not callable(fns.get(v)):
                    continue
                try:
                    value = _graph_ms(fns[v], args.rounds)
                except Exception as e:  # noqa: BLE001
                    value = timing.failure(e)
                    torch.cuda.synchronize()
                timing.emit(timing.variant_record(v + "@graph", value, shape=shape_name(shape)))
        del fns, runnable, lin, x, gy
        if cuda:
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------- tables
MS_HEADER = ("| M x K x N | bf16 nn.Linear | ours delayed | ours current | ours block "
             "| torchao tensorwise, compiled | TE delayed | TE current | TE block |")
RATIO_HEADER = ("| M x K x N | ours delayed | ours current | ours block | torchao | TE delayed | TE current "
                "| TE block | ours delayed / torchao | ours current / torchao | ours block / TE block |")
GRAPH_HEADER = "| M x K x N | " + " | ".join(LABELS[v] for v in VARIANTS) + " |"


def _sep(header):
    return "|" + "---|" * (header.count("|") - 1)


def row_label(results, row):
    recs = [r for v in OURS for r in results.records(row, v) if r]
    small = any(r.get("ours_gemms") == "bf16" for r in recs)
    return row.replace("x", " x ") + (" (bf16 GEMMs)" if small else "")


def tables(per_process, args=None):
    """The Markdown tables (ms; speed-ups; CUDA graphs if measured)."""
    res = timing.Results(per_process, row_key="shape")
    out = [f"# {timing.env_line(res.env())}; processes: {len(per_process)}", "",
           "Forward + backward, ms per step (median over processes [range of per-process medians]):", "",
           MS_HEADER, _sep(MS_HEADER)]
    for row in res.rows():
        cells = [res.ms(row, v) for v in VARIANTS]
        out.append(f"| {row_label(res, row)} | " + " | ".join(cells) + " |")
    out += ["", "Speed-up over bf16 nn.Linear (ratios within each process):", "", RATIO_HEADER, _sep(RATIO_HEADER)]
    for row in res.rows():
        cells = [res.ratio(row, v, "bf16") for v in ("delayed", "current", "block", "torchao") + TE]
        cells += [res.ratio(row, "delayed", "torchao"), res.ratio(row, "current", "torchao"),
                  res.ratio(row, "block", "te_block")]
        out.append(f"| {row_label(res, row)} | " + " | ".join(cells) + " |")
    if any(k[1].endswith("@graph") for d in res.index for k in d):
        out += ["", "CUDA graph replay, GPU time only, ms:", "", GRAPH_HEADER, _sep(GRAPH_HEADER)]
        for row in res.rows():
            out.append(f"| {row_label(res, row)} | " + " | ".join(res.ms(row, v + "@graph") for v in VARIANTS)
                       + " |")
    return "\n".join(out)


def main(argv=None):
    return timing.main(__file__, argv, parse_args, worker, tables)


if __name__ == "__main__":
    main()
