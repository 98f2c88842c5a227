"""exp/gemm-phases: where a gemm_amax launch's time goes, per CTA, from the
kernel's own trace (set_gemm_trace: globaltimer and clock64 at its phases),
at 4096x1024x1024. The launches queue behind a sleep kernel, so that they
run back to back as in a graph replay.

Usage (GPU, this branch's build): python scripts/gemm_phases.py
"""

import statistics

import torch

import torch_ops

SLOTS = 16


def pct(v):
    v = sorted(v)
    return f"min {v[0]:7.2f} med {statistics.median(v):7.2f} max {v[-1]:7.2f}"


def analyze(rows, label):
    """rows: (n, 16) int64 of one launch's CTAs."""
    gt_entry, gt_first, gt_end = rows[:, 1], rows[:, 6], rows[:, 10]
    clk = lambda i: rows[:, i].double()  # noqa: E731
    ns_per_clk = ((gt_end - gt_first).double() / (clk(9) - clk(5))).median().item()
    t0 = gt_entry.min().item()
    print(f"  {label}: {rows.shape[0]} CTAs, span {(gt_end.max().item() - t0) / 1e3:.2f} us (entry of the first "
          f"to the store of the last), SM clock ~{1 / ns_per_clk:.3f} GHz")
    us = lambda a, b: ((clk(b) - clk(a)) * ns_per_clk / 1e3).tolist()  # noqa: E731
    print(f"    entry after the first CTA's (us)        {pct(((gt_entry - t0).double() / 1e3).tolist())}")
    print(f"    entry -> init done (syncthreads)        {pct(us(2, 3))}")
    print(f"    init done -> producer past pdl_wait     {pct(us(3, 4))}")
    print(f"    first load issued -> first stage full   {pct(us(4, 5))}")
    print(f"    k loop (first stage full -> wgmma done) {pct(us(5, 7))}")
    print(f"    WG 2's k loop end after WG 1's          {pct(us(7, 13))}")
    print(f"    k loop end -> epilogue barrier passed   {pct(us(7, 8))}")
    print(f"    epilogue (smem + TMA store issued/read) {pct(us(8, 9))}")
    if rows[:, 11].any():
        print(f"    amax warps: first stage full -> done    {pct(us(5, 11))}")
    if rows[:, 12].any():
        print(f"    amax warps' record                      {pct(us(11, 12))}")
    print(f"    first stage full after the first entry  {pct(((gt_first - t0).double() / 1e3).tolist())}")
    print(f"    store done after the first entry        {pct(((gt_end - t0).double() / 1e3).tolist())}")
    return gt_entry.min().item(), gt_end.max().item()


def traced(ext, name, fns, n_ctas):
    for _ in range(20):
        for f in fns:
            f()
    torch.cuda.synchronize()
    buf = torch.zeros(SLOTS * n_ctas * len(fns), dtype=torch.int64, device="cuda")
    ext.set_gemm_trace(buf)
    torch.cuda._sleep(3_000_000)
    for f in fns:
        f()
    torch.cuda.synchronize()
    ext.set_gemm_trace(torch.empty(0, dtype=torch.int64, device="cuda"))
    rows = buf.view(-1, SLOTS).cpu()
    print(f"\n{name}")
    spans = []
    for k in range(len(fns)):
        spans.append(analyze(rows[k * n_ctas:(k + 1) * n_ctas], f"launch {k + 1}"))
    for k in range(1, len(spans)):
        print(f"  launch {k + 1}'s first entry - launch {k}'s last store: {(spans[k][0] - spans[k - 1][1]) / 1e3:.2f} us")


def event_times(name, fns, reps=50):
    """Each fn's GPU time (us, median over reps) when queued back to back."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(fns) + 1)]
    per = [[] for _ in fns]
    for _ in range(reps):
        torch.cuda._sleep(1_000_000)
        ev[0].record()
        for i, f in enumerate(fns):
            f()
            ev[i + 1].record()
        torch.cuda.synchronize()
        for i in range(len(fns)):
            per[i].append(ev[i].elapsed_time(ev[i + 1]) * 1e3)
    print(f"  {name}: " + ", ".join(f"{statistics.median(p):.2f}" for p in per) + " us (events, queued)")


def main():
    ext = torch_ops.linear._ext()
    bf = torch.bfloat16
    M, K, N = 4096, 1024, 1024
    x = torch.randn(M, K, device="cuda", dtype=bf)
    w = torch.randn(N, K, device="cuda", dtype=bf) * 0.05
    g = torch.randn(M, N, device="cuda", dtype=bf) * 1e-3
    hs = [(torch.zeros(1024, device="cuda"), torch.ones((), device="cuda")) for _ in range(3)]
    st = lambda i: [hs[i][0], hs[i][1]]  # noqa: E731
    fwd = lambda: ext.gemm_amax(x, w, 0, [], [], 0, 0, 0, 1.0)  # noqa: E731
    fwd_rec = lambda: ext.gemm_amax(x, w, 0, st(0), st(1), 0, 0, 0, 1.0)  # noqa: E731
    dx_rec = lambda: ext.gemm_amax(g, w, 1, st(2), [], 1, 0, 0, 1.0)  # noqa: E731
    tiles = (M // 128) * (N // 256)
    traced(ext, "fwd ours, no record, x3", [fwd, fwd, fwd], tiles)
    traced(ext, "fwd ours, record x and W, then dX ours record g", [fwd_rec, dx_rec], tiles)
    print("\nEvent times, back to back after a sleep kernel:")
    for _ in range(2):
        event_times("fwd cuBLAS x3", [lambda: torch.mm(x, w.t())] * 3)
        event_times("fwd ours no record x3", [fwd] * 3)
        event_times("fwd ours rec x,W; dX ours rec g", [fwd_rec, dx_rec])
        event_times("fwd cuBLAS; dX cuBLAS", [lambda: torch.mm(x, w.t()), lambda: torch.mm(g, w)])


if __name__ == "__main__":
    main()
