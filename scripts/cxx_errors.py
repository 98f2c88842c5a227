"""Device check: C++ argument errors of the extension arrive as Python
exceptions naming the argument (not a crash). Each case runs in its own
process; prints one line per case with the exit status."""
import subprocess
import sys

CASES = {
    "set_tile_version(7)": "ext.set_tile_version(7)",
    "quantize: CPU x": "ext.quantize(torch.ones(4, 4), torch.ones(()), 0, False, False, True)",
    "gemm: K mismatch": ("ext.gemm(torch.ones(16, 32, device='cuda').to(torch.float8_e4m3fn), "
                         "torch.ones(16, 16, device='cuda').to(torch.float8_e4m3fn), s, s, None, torch.bfloat16, True)"),
    "linear: weight shape": ("ext.linear(torch.ones(4, 8, device='cuda'), torch.ones(3, 5, device='cuda'), None, "
                             "[s, h, s, h, s, h], 1, 1, 1.0, 0, False, True, None, 0)"),
}
PRE = ("import torch, torch_ops; ext = torch_ops._build.load(); s = torch.ones((), device='cuda'); "
       "h = torch.zeros(4, device='cuda')\ntry:\n    {}\nexcept Exception as e:\n"
       "    print(type(e).__name__, str(e).splitlines()[0][:120])\n")
for name, stmt in CASES.items():
    r = subprocess.run([sys.executable, "-c", PRE.format(stmt)], capture_output=True, text=True, timeout=120)
    err = r.stderr.strip().splitlines()
    print(f"{name}: rc={r.returncode} {r.stdout.strip()} {err[-1][:160] if (r.returncode and err) else ''}", flush=True)
