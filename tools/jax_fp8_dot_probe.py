"""How XLA compiles the FP8 dot of `keras_fp8.backends.jax`, and what each
way of writing it costs (one GPU with FP8 tensor cores).

    python tools/jax_fp8_dot_probe.py [--shapes 16384x4096x14336] [--hlo-dir DIR]
    python tools/jax_fp8_dot_probe.py --dry-run     # CPU, a tiny shape: the code runs

One step is a linear layer's forward and backward on bf16 data (x, kernel,
output gradient): quantize x and the kernel (E4M3) and the gradient (E5M2)
with given scales (`keras_fp8.numerics`' quantize and scale rules, Keras on
JAX), then the three products y, dx and dkernel. The ways:

- `bf16`: the three products in bf16 (no FP8);
- `custom_call`: the GEMM custom call on given scales (`jax_gemm.scaled_matmul`,
  the products of the backend's `FUSED` route, its default): the cuBLASLt
  GEMM of `csrc/lt_gemm.h` as an XLA custom call, scales and bias in the
  epilogue, the forward in fast accumulation, the backward in full;
- `scale_after`: XLA's own FP8 dot (`_xla_dot`, the products of the
  backend's `XLA` route: after `jax_gemm.set_enabled(False)` and where the
  custom calls do not apply): FP8 operands straight into `dot_general`,
  the product in bf16, then `* scale` in float32 and a second rounding;
- `dequant_one`: the first operand dequantized to float32 with the product
  of the two scales (`q.astype(f32) * scale`), the second only converted,
  and a `dot_general` with a bf16 result: the dequantize-then-dot pattern
  that XLA's GEMM rewriter can fold into one cuBLASLt FP8 GEMM taking the
  scale as an operand scale (one rounding, in the epilogue); the custom
  calls printed say whether the XLA at hand does;
- `dequant_f32`: both operands dequantized with their own scales, a
  float32 result cast to bf16;
- `_hi`: the two backward products with `Precision.HIGHEST` (XLA then
  turns cuBLASLt's fast FP8 accumulation off); `scale_after_hi` is what
  the backend runs by default.

Printed per way: ms per step (median of interleaved samples), the largest
relative difference of y, dx and dkernel from the float32 emulation
(upcast operands, accumulated in float32) and the fraction of elements
equal to that rounded once to bf16, the custom calls of the optimized HLO
(cuBLAS GEMM targets) and its number of fusions.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

WAYS = ("bf16", "custom_call", "scale_after", "scale_after_hi", "dequant_one", "dequant_one_hi", "dequant_f32",
        "dequant_f32_hi")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=None, help="MxKxN,... (default 16384x4096x14336)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--hlo-dir", default=None, help="write each way's optimized HLO here")
    p.add_argument("--ways", default=",".join(WAYS), help="comma list of " + ",".join(WAYS))
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    unknown = sorted(set(args.ways.split(",")) - set(WAYS))
    if unknown:
        p.error(f"--ways: expected names from {','.join(WAYS)}, got {unknown}")
    text = args.shapes or ("64x128x256" if args.dry_run else "16384x4096x14336")
    args.shape_list = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    if args.dry_run:
        args.rounds, args.iters = 1, 1
    return args


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import jax.numpy as jnp
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit(f"KERAS_BACKEND: expected jax, got {keras.backend.backend()}")
    from keras_fp8 import numerics
    from keras_fp8.backends import jax as jax_backend
    from keras_fp8.backends import jax_gemm


    f32, bf16 = jnp.float32, jnp.bfloat16

    dims = (((1,), (0,)), ((), ()))
    highest = jax.lax.Precision.HIGHEST

    def scale_after(a_q, b_q, sa, sb, precision=None):
        # The backend's own product (forward at the default precision,
        # backward at HIGHEST: `scale_after_hi`).
        return jax_backend._xla_dot(a_q, b_q, sa * sb, bf16, precision=precision)

    def custom_call(a_q, b_q, sa, sb, precision=None):
        # As the FUSED route: fast accumulation forward, full backward.
        return jax_gemm.scaled_matmul(a_q, b_q, sa * sb, bf16, fast_accum=precision is None)

    def dequant_f32(a_q, b_q, sa, sb, precision=None):
        a, b = a_q.astype(f32) * sa, b_q.astype(f32) * sb
        return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=f32).astype(bf16)

    def dequant_one(a_q, b_q, sa, sb, precision=None):
        a = a_q.astype(f32) * (sa * sb)
        return jax.lax.dot_general(a, b_q.astype(f32), dims, precision=precision, preferred_element_type=bf16)

    def exact(a_q, b_q, sa, sb, precision=None):
        p = jnp.matmul(a_q.astype(f32), b_q.astype(f32), precision=highest)
        return p * (sa * sb)

    def fp8_step(mm, backward_precision=None):
        def step(x, k, g, sx, sk, sg):
            x_q, k_q = numerics.quantize(x, sx, "e4m3"), numerics.quantize(k, sk, "e4m3")
            g_q = numerics.quantize(g, sg, "e5m2")
            return (mm(x_q, k_q, sx, sk), mm(g_q, k_q.T, sg, sk, backward_precision),
                    mm(x_q.T, g_q, sx, sg, backward_precision))
        return step

    def bf16_step(x, k, g, sx, sk, sg):
        return x @ k, g @ k.T, x.T @ g

    ways = {"bf16": bf16_step, "custom_call": fp8_step(custom_call, highest), "scale_after": fp8_step(scale_after),
            "scale_after_hi": fp8_step(scale_after, highest), "dequant_one": fp8_step(dequant_one),
            "dequant_one_hi": fp8_step(dequant_one, highest), "dequant_f32": fp8_step(dequant_f32),
            "dequant_f32_hi": fp8_step(dequant_f32, highest)}
    ways = {name: ways[name] for name in args.ways.split(",")}
    device = jax.devices()[0]
    print(f"# jax {jax.__version__}; device {device.device_kind} ({device.platform})", flush=True)
    for m, k, n in args.shape_list:
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        x = jax.random.normal(keys[0], (m, k), bf16)
        w = (jax.random.normal(keys[1], (k, n), f32) * 0.02).astype(bf16)
        g = (jax.random.normal(keys[2], (m, n), f32) * 1e-3).astype(bf16)
        sx, sk, sg = (numerics.compute_scale(numerics.compute_amax(t), jnp.float32(1.0), fmt)
                      for t, fmt in ((x, "e4m3"), (w, "e4m3"), (g, "e5m2")))
        operands = (x, w, g, sx, sk, sg)
        ref = jax.jit(fp8_step(exact))(*operands)
        compiled = {}
        for name, fn in ways.items():
            exe = jax.jit(fn).lower(*operands).compile()
            compiled[name] = exe
            text = exe.as_text()
            if args.hlo_dir:
                os.makedirs(args.hlo_dir, exist_ok=True)
                with open(os.path.join(args.hlo_dir, f"{name}_{m}x{k}x{n}.hlo.txt"), "w") as f:
                    f.write(text)
            targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
            fusions = len(re.findall(r"^\s*\S+ = \S+ fusion\(", text, flags=re.M))
            out = exe(*operands)
            if name == "bf16":
                errs = "-"
            else:
                errs = " ".join(
                    f"{label} {float(jnp.max(jnp.abs(o.astype(f32) - r)) / jnp.max(jnp.abs(r))):.2e} "
                    f"(once-rounded {float(jnp.mean(o == r.astype(bf16))):.4f})"
                    for label, o, r in zip(("y", "dx", "dk"), out, ref))
            print(f"{m}x{k}x{n} {name}: custom calls {targets}, {fusions} fusions; max |diff|/max|ref| {errs}",
                  flush=True)
        samples = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, exe in compiled.items():
                jax.block_until_ready(exe(*operands))
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    out = exe(*operands)
                jax.block_until_ready(out)
                samples[name].append((time.perf_counter() - t0) * 1e3 / args.iters)
        base = statistics.median(samples["bf16"]) if "bf16" in samples else None
        for name, s in samples.items():
            ms = statistics.median(s)
            ratio = f", {base / ms:.2f}x of bf16" if base else ""
            print(f"{m}x{k}x{n} {name}: {ms:.3f} ms [{min(s):.3f}-{max(s):.3f}]{ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
