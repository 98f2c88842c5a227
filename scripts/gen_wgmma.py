"""Writes csrc/wgmma_bf16.cuh: `Wgmma<N, TA, TB>::mma(d, desc_a, desc_b)`,
one `wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16` (d += A . B, both
operands from shared-memory descriptors; TA / TB select MN-major operands)
for N in 64, 128, 256. The accumulator operand lists are too long to write by
hand (N / 2 registers per thread).

Usage: python scripts/gen_wgmma.py
"""

import pathlib

HEADER = """// Written by scripts/gen_wgmma.py: wgmma.mma_async m64nNk16 f32 += bf16 x bf16,
// operands from shared-memory descriptors; TA / TB select MN-major operands.
#pragma once
#include <cstdint>

template <int N, int TA, int TB> struct Wgmma;
"""


def one(n, ta, tb):
    nreg = n // 2
    regs = ", ".join(f"%{i}" for i in range(nreg))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nreg))
    return f"""template <> struct Wgmma<{n}, {ta}, {tb}> {{
  __device__ static inline void mma(float* d, uint64_t da, uint64_t db) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nreg + 2}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, %{nreg}, %{nreg + 1}, p, 1, 1, {ta}, {tb};\\n}}\\n"
        : {outs}
        : "l"(da), "l"(db), "r"(1));
  }}
}};
"""


def main():
    parts = [HEADER] + [one(n, ta, tb) for n in (64, 128, 256) for ta in (0, 1) for tb in (0, 1)]
    out = pathlib.Path(__file__).resolve().parent.parent / "csrc" / "wgmma_bf16.cuh"
    out.write_text("\n".join(parts))
    print(out)


if __name__ == "__main__":
    main()
