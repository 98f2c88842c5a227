"""Linear layer forward+backward: bf16 nn.Linear vs torchao Float8Linear
(tensorwise, compiled) vs the floor of three raw torch._scaled_mm calls vs
torch_ops.fp8_linear (delayed scaling, hybrid E4M3/E5M2).

    python benchmarks/linear.py [--shapes 16384x4096x4096,...] [--no-torchao] [--iters 30]

Shapes are M x K x N (tokens x in x out); x, weight and the output gradient
are bf16 random data, x requires grad (a layer in the middle of a network).
Each variant is timed three ways, all side by side:

- synchronized: CUDA events around each call, median over --iters calls
  taken in --rounds interleaved rounds (every variant runs its share of the
  calls in turn, so drifts of the GPU's clocks and power fall on all alike;
  one variant after the other, two runs of the same code differed by up to
  17%). Host time before the first kernel counts in full. At the small
  (host-bound) shapes the variants alternate call by call, --small-iters
  rounds of one call each.
- back-to-back: 5 calls per sample (20 at the small shapes) and one
  synchronization, so the host queues ahead as in a training loop: a sample
  is max(host, GPU) time per call.
- CUDA graph: the step captured and replayed, GPU time only (for bf16, the
  floor, our GEMMs and our default).

Prints one table per shape and two summary tables, pasteable into
docs/benchmarks.md.

The cuBLASLt GEMM algorithm choice follows TORCH_OPS_GEMM_AUTOTUNE (csrc/gemm.cpp,
read once per process; default on): run once with TORCH_OPS_GEMM_AUTOTUNE=0 to
compare with the heuristic's top-1 (what torch._scaled_mm uses).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
import torch_ops  # noqa: E402
from benchmarks.timing import cuda_graph_median_ms, interleaved_median_ms  # noqa: E402

SHAPES = [
    (16384, 4096, 4096),
    (16384, 4096, 14336),
    (16384, 14336, 4096),
    (8192, 8192, 8192),
    (4096, 1024, 1024),
    (1024, 2048, 1024),
]
LARGE = {(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096)}


def bench_graph(step, iters=20):
    """GPU time of one training step, without host overhead: CUDA-graph replay."""
    return cuda_graph_median_ms(step, iters, warmup=3)


def fwd_bwd(model, x, gy):
    def step():
        x.grad = None
        for p in model.parameters():
            p.grad = None
        y = model(x)
        y.backward(gy)

    return step


class OursLinear(torch.nn.Module):
    def __init__(self, lin: torch.nn.Linear, min_gemm_size=None, record=True):
        super().__init__()
        self.weight = lin.weight
        self.state = torch_ops.FP8LinearState.create(1024, device=lin.weight.device)
        self.min_gemm_size = min_gemm_size
        self.record = record  # False: training=False, nothing recorded (a host-cost diagnostic)

    def forward(self, x):
        return torch_ops.fp8_linear(x, self.weight, None, state=self.state, min_gemm_size=self.min_gemm_size,
                                    training=self.record)


def scaled_mm_floor(M, K, N):
    """Three raw FP8 GEMMs with the layouts _scaled_mm wants (fp8 inputs ready)."""
    dev = "cuda"
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    s = torch.ones((), device=dev)
    xq = torch.randn(M, K, device=dev).to(e4)            # (M, K) row-major
    wq_t = torch.randn(N, K, device=dev).to(e4).t()      # (K, N) column-major
    gq = torch.randn(M, N, device=dev).to(e5)            # (M, N) row-major
    wq_c = torch.randn(K, N, device=dev).to(e4).t()      # (N, K) column-major
    gq_t = torch.randn(N, M, device=dev).to(e5)          # (N, M) row-major
    xq_c = torch.randn(K, M, device=dev).to(e4).t()      # (M, K) column-major

    def step():
        torch._scaled_mm(xq, wq_t, scale_a=s, scale_b=s, out_dtype=torch.bfloat16, use_fast_accum=True)
        torch._scaled_mm(gq, wq_c, scale_a=s, scale_b=s, out_dtype=torch.bfloat16, use_fast_accum=False)
        torch._scaled_mm(gq_t, xq_c, scale_a=s, scale_b=s, out_dtype=torch.bfloat16, use_fast_accum=False)

    return step


def ours_gemms(M, K, N):
    """The three torch_ops.fp8_gemm calls of one fp8_linear step on pre-quantized
    operands in our layouts (K contiguous): forward (fast accumulation), dgrad,
    wgrad (split accumulation). The GEMM share of our step, next to the floor."""
    dev = "cuda"
    e4, e5, bf16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    s = torch.ones((), device=dev)
    xq = torch.randn(M, K, device=dev).to(e4)
    wq = torch.randn(N, K, device=dev).to(e4)
    gq = torch.randn(M, N, device=dev).to(e5)
    wq_t = torch.randn(K, N, device=dev).to(e4)
    gq_t = torch.randn(N, M, device=dev).to(e5)
    xq_t = torch.randn(K, M, device=dev).to(e4)

    def step():
        torch_ops.fp8_gemm(xq, wq, s, s, out_dtype=bf16, use_fast_accum=True)
        torch_ops.fp8_gemm(gq, wq_t, s, s, out_dtype=bf16, use_fast_accum=False)
        torch_ops.fp8_gemm(gq_t, xq_t, s, s, out_dtype=bf16, use_fast_accum=False)

    return step


def _with_attr(module, name, value, fn):
    """`fn` run with `module.name = value` (restored after each call)."""

    def step():
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            fn()
        finally:
            setattr(module, name, old)

    return step


def run_shape(M, K, N, iters, use_torchao, rounds=5):
    """Times every variant of one shape side by side (`interleaved_median_ms`:
    `rounds` rounds of `iters // rounds` iterations each, so clock and power
    drifts fall on all variants alike), then the CUDA-graph replays."""
    from torch_ops import _ops
    from torch_ops import linear as _lin

    dev = "cuda"
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    small = M * N * K < torch_ops.DEFAULT_MIN_GEMM_SIZE
    backend = _ops.GEMM_BACKEND
    variants = {"bf16 nn.Linear": ("bf16", fwd_bwd(lin, x, gy))}
    notes = []
    if use_torchao:
        try:
            import copy

            from torchao.float8 import convert_to_float8_training

            m = torch.nn.Sequential(copy.deepcopy(lin))
            convert_to_float8_training(m)
            variants["torchao Float8Linear tensorwise (compiled)"] = ("torchao", fwd_bwd(torch.compile(m), x, gy))
        except Exception as e:  # noqa: BLE001
            notes.append((f"torchao: {type(e).__name__}: {str(e)[:60]}", None))
    else:
        notes.append(("torchao: not run", None))
    variants["floor: 3x torch._scaled_mm"] = ("floor", scaled_mm_floor(M, K, N))
    variants["ours: 3x torch_ops.fp8_gemm (fp8 operands ready)"] = ("gemms", ours_gemms(M, K, N))
    variants[f"torch_ops.fp8_linear, FP8 GEMMs forced ({backend})"] = (
        "ours_fp8", fwd_bwd(OursLinear(lin, min_gemm_size=0), x, gy))
    if backend == "cublaslt":  # the same op with torch._scaled_mm as the GEMM, for comparison
        variants["torch_ops.fp8_linear, FP8 GEMMs forced (torch._scaled_mm)"] = (
            "ours_sm", _with_attr(_ops, "GEMM_BACKEND", "scaled_mm",
                                  fwd_bwd(OursLinear(lin, min_gemm_size=0), x, gy)))
    variants["torch_ops.fp8_linear, bf16 GEMMs forced (FP8 state kept)"] = (
        "ours_bf16", fwd_bwd(OursLinear(lin, min_gemm_size=1 << 62), x, gy))
    variants[f"torch_ops.fp8_linear, default ({'bf16 GEMMs' if small else 'FP8 GEMMs'})"] = (
        "ours", fwd_bwd(OursLinear(lin), x, gy))
    if small:  # host-time comparisons: the call without its state update; without the C++ fast path
        variants["torch_ops.fp8_linear, default, no state update (training=False)"] = (
            "ours_norec", fwd_bwd(OursLinear(lin, record=False), x, gy))
        variants["torch_ops.fp8_linear, default, Python path (no C++ fast path)"] = (
            "ours_py", _with_attr(_lin, "FAST_PATH", False, fwd_bwd(OursLinear(lin), x, gy)))
    per_round = max(1, iters // rounds)
    if small:
        # Host-bound steps: the variants alternate call by call (a round is one
        # call of each, in a shuffled order): with runs of calls per variant,
        # two identical variants differed by up to 20% (session 8, call 1).
        rounds, per_round = iters, 1
    medians = interleaved_median_ms({name: fn for name, (_, fn) in variants.items()}, rounds, per_round)
    # (name, ms, the bf16 time of the same timing method: None for notes)
    rows = [(name, medians[name], "bf16") for name in variants] + [(n, None, None) for n, _ in notes]
    t = {key: medians[name] for name, (key, _) in variants.items()}
    t.setdefault("torchao", None)
    # Back-to-back: `calls` calls per sample and one synchronization, so the
    # host queues ahead of the GPU (as inside a training loop): a sample is
    # max(host, GPU) time per call, without the host latency before the
    # first kernel that the synchronized timing above adds to every call.
    calls = 20 if small else 5
    if small:
        b2b_rounds, b2b_per_round = max(1, iters // calls), 1
    else:
        b2b_rounds, b2b_per_round = rounds, max(1, per_round // calls)
    b2b = interleaved_median_ms({name: fn for name, (_, fn) in variants.items()}, b2b_rounds, b2b_per_round,
                                warmup=1, calls=calls)
    for name, (key, _) in variants.items():
        t[f"{key}_b2b"] = b2b[name]
        rows.append((f"{name}, back-to-back ({calls} calls per sample)", b2b[name], "bf16_b2b"))
    # Same steps replayed from CUDA graphs: GPU time without host overhead.
    # (A GEMM first met inside a capture runs cuBLASLt's top-1 algorithm,
    # not the autotuned one: csrc/gemm.cpp.)
    t["bf16_g"] = t["ours_g"] = t["floor_g"] = t["gemms_g"] = None
    graphs = [("bf16_g", "bf16 nn.Linear", fwd_bwd(lin, x, gy)),
              ("floor_g", "floor: 3x torch._scaled_mm", scaled_mm_floor(M, K, N)),
              ("gemms_g", "ours: 3x torch_ops.fp8_gemm", ours_gemms(M, K, N)),
              ("ours_g", "torch_ops.fp8_linear default", fwd_bwd(OursLinear(lin), x, gy))]
    for key, name, fn in graphs:
        try:
            t[key] = bench_graph(fn, iters)
            rows.append((f"{name}, CUDA graph", t[key], "bf16_g"))
        except Exception as e:  # noqa: BLE001
            rows.append((f"{name}, CUDA graph: {type(e).__name__}: {str(e)[:60]}", None, None))
    return rows, t


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=None)
    p.add_argument("--iters", type=int, default=30, help="timed iterations per variant (split over --rounds)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--small-iters", type=int, default=2000,
                   help="--iters for shapes below the default min_gemm_size (host-bound, noisier)")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--torchao-shapes", default="large", help="'large' (the 3 target shapes), 'all' or 'none'")
    a = p.parse_args(argv)
    shapes = SHAPES if a.shapes is None else [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    props = torch.cuda.get_device_properties(0)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {props.name}; torch {torch.__version__}; "
          f"CUDA {torch.version.cuda}; min_gemm_size default {torch_ops.DEFAULT_MIN_GEMM_SIZE}; "
          f"TORCH_OPS_GEMM_AUTOTUNE={os.environ.get('TORCH_OPS_GEMM_AUTOTUNE', '1 (default)')}")
    summary = []
    for (M, K, N) in shapes:
        use_ao = not a.no_torchao and (a.torchao_shapes == "all" or
                                       (a.torchao_shapes == "large" and (M, K, N) in LARGE))
        # Host-bound small steps (~0.3 ms) vary more between iterations: more
        # samples for the same few milliseconds.
        small = M * N * K < torch_ops.DEFAULT_MIN_GEMM_SIZE
        rows, t = run_shape(M, K, N, a.small_iters if small else a.iters, use_ao, a.rounds)
        print(f"\n### {M} x {K} x {N} (M x K x N), forward + backward\n")
        print("| variant | ms | speed-up over bf16 (same timing method) |")
        print("|---|---|---|")
        for name, ms, ref in rows:
            if ms is None:
                print(f"| {name} | - | - |")
            else:
                print(f"| {name} | {ms:.3f} | " + (f"{t[ref] / ms:.2f}x |" if t.get(ref) else "- |"))
        summary.append(((M, K, N), t))
        sys.stdout.flush()
    print_summary(summary)


def print_summary(summary):
    """The two summary tables (synchronized calls; back-to-back) from
    `summary`, a list of ((M, K, N), times) with run_shape's `times`."""
    print("\n### summary (ms; ratios within this run)\n")
    print("Each call synchronized (host latency before the first kernel counts):\n")
    print("| M x K x N | bf16 | torchao | floor | ours GEMMs | ours FP8 | ours default | ours/bf16 | ours vs torchao "
          "| ours FP8/floor | default/floor | GEMMs/floor | graph: bf16 | graph: ours | graph: ours/bf16 "
          "| graph: floor | graph: ours/floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (M, K, N), t in summary:
        ao = f"{t['torchao']:.3f}" if t["torchao"] else "-"
        vs_ao = f"{t['torchao'] / t['ours']:.2f}x" if t["torchao"] else "-"
        print(f"| {M}x{K}x{N} | {t['bf16']:.3f} | {ao} | {t['floor']:.3f} | {t['gemms']:.3f} | {t['ours_fp8']:.3f} "
              f"| {t['ours']:.3f} | {t['bf16'] / t['ours']:.2f}x | {vs_ao} | {t['ours_fp8'] / t['floor']:.2f} "
              f"| {t['ours'] / t['floor']:.2f} | {t['gemms'] / t['floor']:.2f} "
              + (f"| {t['bf16_g']:.4f} | {t['ours_g']:.4f} | {t['bf16_g'] / t['ours_g']:.3f}x " if t["ours_g"]
                 and t["bf16_g"] else "| - | - | - ")
              + (f"| {t['floor_g']:.3f} | {t['ours_g'] / t['floor_g']:.2f} |" if t["ours_g"] and t["floor_g"]
                 else "| - | - |"))
    print("\nBack-to-back (throughput; 5 calls per sample, 20 at the small shapes):\n")
    print("| M x K x N | bf16 | torchao | floor | ours GEMMs | ours FP8 | ours default | ours/bf16 | ours vs torchao "
          "| ours FP8/floor | default/floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (M, K, N), t in summary:
        ao = t.get("torchao_b2b")
        ao_ms = f"{ao:.3f}" if ao else "-"
        vs_ao = f"{ao / t['ours_b2b']:.2f}x" if ao else "-"
        print(f"| {M}x{K}x{N} | {t['bf16_b2b']:.3f} | {ao_ms} | {t['floor_b2b']:.3f} "
              f"| {t['gemms_b2b']:.3f} | {t['ours_fp8_b2b']:.3f} | {t['ours_b2b']:.3f} "
              f"| {t['bf16_b2b'] / t['ours_b2b']:.2f}x | {vs_ao} "
              f"| {t['ours_fp8_b2b'] / t['floor_b2b']:.2f} | {t['ours_b2b'] / t['floor_b2b']:.2f} |")


if __name__ == "__main__":
    main()
